"""TP2PP2 Megatron actor on 4 processes, one in-process vLLM engine per rank: after real optimizer
steps and sync_weights, the engine generates what transformers generates on the exported weights
and its log-probs equal the actor's; without the sync the mismatch is detected."""
import os
import sys

import pytest
import torch

from harness import spawn
from mcore import build, setup, token_log_probs, train_step

pytestmark = pytest.mark.distributed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_models import VOCAB, save_tiny_model  # noqa: E402

N_NEW = 8


def _exported_hf_model(chunks, info, path):
    """transformers model holding the actor's current weights, via the per-tensor generator."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megappo.convert import iter_hf_tensors

    from megappo.layout import RankCoords

    sd = dict(iter_hf_tensors(chunks, info.desc, RankCoords.from_megatron()))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if info.desc.tie_word_embeddings:
        model.tie_weights()
    model.generation_config.eos_token_id = None
    return model.eval()


def _check_engine_equals_actor(engine, chunks, info, path, prompts, tol=1e-4, expect_equal=True):
    from megatron.core import parallel_state as ps

    from megappo.rollout import SamplingConfig

    out = engine.generate(prompts, SamplingConfig(n=1, do_sample=False, max_tokens=N_NEW, ignore_eos=True))
    # actor log-probs of the same tokens; micro-batches group prompts of equal length
    by_len = {}
    for j, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(j)
    batches, rows = [], []
    for L, js in sorted(by_len.items()):
        batches.append(torch.stack([torch.tensor(prompts[j] + out.responses[j].tolist()) for j in js]))
        rows.append(js)
    # one schedule call per distinct length keeps every stage in step
    results = [token_log_probs(chunks, info, [b]) for b in batches]
    hf = _exported_hf_model(chunks, info, path)  # collective: every rank
    if not ps.is_pipeline_last_stage():
        return None
    worst = 0.0
    for b, js, res in zip(batches, rows, results):
        actor = res[0][:, -N_NEW:]
        for k, j in enumerate(js):
            worst = max(worst, (out.rollout_log_probs[j] - actor[k]).abs().max().item())
    if expect_equal:
        assert worst < tol, f"engine vs actor log-prob diff {worst}"
        for j, p in enumerate(prompts):
            ref = hf.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False)[0, len(p):]
            assert out.responses[j].tolist() == ref.tolist(), f"prompt {j}: engine and transformers disagree"
    return worst


def _worker(rank, world, path):
    setup(2, 2)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megappo.convert import iter_hf_tensors, plan_shared_gather

    from megappo.layout import RankCoords
    from megappo.rollout import VLLMRollout

    info, cfg, chunks = build(path, 2, 2)
    ddp = [DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True), c) for c in chunks]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, use_distributed_optimizer=True, clip_grad=1.0), ddp)
    engine = VLLMRollout(path, device="cpu", dtype="float32", max_model_len=512, max_num_seqs=16,
                         max_num_batched_tokens=1024, kv_cache_memory_bytes=64 << 20)

    coords = RankCoords.from_megatron()
    shared = plan_shared_gather(chunks, info.desc, coords)  # the trainer's path on CPU
    assert shared is not None

    def sync():
        return engine.sync_weights(iter_hf_tensors(chunks, info.desc, coords, shared=shared), bucket_bytes=1)

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (20,), generator=g).tolist() for _ in range(3)]
    prompts.append(torch.randint(3, VOCAB, (300,), generator=g).tolist())  # > 2 KV blocks of 128
    train = [torch.randint(0, VOCAB, (2, 32), generator=g) for _ in range(2)]

    stats = sync()
    assert stats["rollout/sync_buckets"] == info.desc.num_layers
    _check_engine_equals_actor(engine, chunks, info, path, prompts)

    train_step(ddp, optimizer, info, train)
    stale = _check_engine_equals_actor(engine, chunks, info, path, prompts, expect_equal=False)
    if stale is not None:
        assert stale > 1e-2, f"the engine's stale weights went unnoticed (diff {stale})"
    sync()
    _check_engine_equals_actor(engine, chunks, info, path, prompts)

    train_step(ddp, optimizer, info, train)  # a second sync after another step: nothing stale
    sync()
    _check_engine_equals_actor(engine, chunks, info, path, prompts)
    engine.shutdown()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_sync_after_optimizer_steps_tp2pp2(arch, tmp_path):
    path = tmp_path / arch
    save_tiny_model(arch, path)
    spawn(_worker, 4, str(path))
