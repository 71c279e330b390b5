"""The vLLM engine serving LoRA adapters synced in memory (VLLMRollout.sync_lora), against PEFT's
LoRA on the transformers model: log-probs after each of several syncs, the caller's tensors left
as they were, one adapter held at a time; the rank vLLM is started with."""
import glob
import os
import sys

import pytest
import torch

from megappo.rollout import SamplingConfig, vllm_lora_rank

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_models import save_tiny_model  # noqa: E402

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_vllm_lora_rank_is_the_smallest_slot_that_holds_the_adapters():
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 64, 65, 300, 512)] == [1, 8, 8, 16, 64, 128, 320, 512]
    with pytest.raises(ValueError, match="LoRA rank 513: vLLM serves adapters up to rank 512"):
        vllm_lora_rank(513)


def _peft_log_probs(model, prompt, tokens):
    ids = torch.tensor([list(prompt) + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_engine_serves_in_memory_adapters_as_peft_computes_them(tmp_path):
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megappo.rollout import VLLMRollout

    path = str(tmp_path / "model")
    save_tiny_model("qwen3", path)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                          LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)).eval()
    base = {}
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        base.update(load_file(f))
    engine = VLLMRollout(path, device="cpu", dtype="float32", max_model_len=128, lora_rank=8)
    engine.sync_weights(list(base.items()))
    with pytest.raises(RuntimeError, match="serves LoRA adapters but has none yet: call sync_lora first"):
        engine.generate([[5, 6]], SamplingConfig(n=1, max_tokens=2))
    prompts = [[5, 17, 33, 41, 9, 12], [7, 7, 20]]
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=10, seed=3)
    g = torch.Generator().manual_seed(0)
    for version in range(3):   # several syncs: each replaces the adapter the engine serves
        tensors = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in get_peft_model_state_dict(peft).items()}
        kept = {k: v.clone() for k, v in tensors.items()}
        stats = engine.sync_lora(tensors, 8, 16, MODULES, version)
        assert stats["rollout/sync_bytes"] == sum(t.numel() * 4 for t in tensors.values())
        # vLLM folds the scaling into B in place: the caller's tensors must not see it
        assert all(torch.equal(tensors[k], kept[k]) for k in kept)
        set_peft_model_state_dict(peft, tensors)
        out = engine.generate(prompts, sampling)
        for j in range(len(out.responses)):
            n = int(out.response_mask[j].sum())
            tokens = out.responses[j][:n].tolist()
            want = _peft_log_probs(peft, prompts[int(out.prompt_index[j])], tokens)
            assert (want - out.rollout_log_probs[j][:n]).abs().max() < 1e-4, (version, j)
        held = engine.llm.collective_rpc(lambda w: sorted(w.model_runner.lora_manager.list_adapters()))[0]
        assert held == [version + 1]
    prompt = prompts[int(out.prompt_index[j])]
    with peft.disable_adapter():   # the adapters matter: the base's log-probs are elsewhere
        assert (_peft_log_probs(peft, prompt, tokens) - out.rollout_log_probs[j][:n]).abs().max() > 1e-2
    full = VLLMRollout.__new__(VLLMRollout)
    full.lora_rank = 0
    with pytest.raises(RuntimeError, match="started without LoRA"):
        full.sync_lora(tensors, 8, 16, MODULES, 0)
