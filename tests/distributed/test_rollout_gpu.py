"""GPU rollout: the CUDA vLLM engine, sleep/wake around training, in-place sync. Skipped without a GPU."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_models import save_tiny_model  # noqa: E402

pytestmark = [pytest.mark.gpu]


def test_cuda_engine_sleep_wake_and_sync(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (the one-GPU check box has none)")
    from megappo.rollout import SamplingConfig, VLLMRollout

    a = save_tiny_model("qwen3", tmp_path / "a", seed=0)
    b = save_tiny_model("qwen3", tmp_path / "b", seed=1)
    eng = VLLMRollout(str(tmp_path / "a"), device="cuda", dtype="float32", max_model_len=512,
                      gpu_memory_utilization=0.3, free_cache_engine=True, external_launcher=False)
    prompts = [list(range(5, 25)), list(range(30, 330))]  # the second spans several KV blocks
    greedy = SamplingConfig(n=1, do_sample=False, max_tokens=8, ignore_eos=True)

    def check(model):
        model.generation_config.eos_token_id = None
        model = model.cuda()
        out = eng.generate(prompts, greedy)
        for j, p in enumerate(prompts):
            ref = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=8, do_sample=False)[0, len(p):]
            assert out.responses[j].tolist() == ref.cpu().tolist()
        model.cpu()

    eng.sync_weights(iter((n, t.cuda()) for n, t in a.state_dict().items()))
    check(a)
    for model in (b, a):  # generate -> sleep (weights and KV freed) -> "train" -> wake, reload, generate
        eng.sleep()
        assert eng._sleeping
        eng.sync_weights(iter((n, t.cuda()) for n, t in model.state_dict().items()))
        assert not eng._sleeping
        check(model)
