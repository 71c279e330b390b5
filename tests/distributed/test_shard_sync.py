"""Direct-shard weight sync against the full gather, on a real vLLM engine: a TP2 PP2 actor on 4
processes, two vLLM replicas of TP2 (external launcher). After an optimizer step the engine's
parameters loaded from each rank's own shards equal, bit for bit, those loaded from gathered full
tensors, and every parameter changed. vLLM's CPU backend normally repacks linear weights into
oneDNN handles (the direct path then falls back); the engine here is built without that repacking
so its parameters are real tensors to copy into, as on GPU. The engine starts although a killed
job left its /dev/shm segments behind."""
import os
import sys

import pytest
import torch

from harness import spawn
from mcore import build, setup, train_step

pytestmark = pytest.mark.distributed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_models import save_tiny_model  # noqa: E402


def _engine_params(engine):
    def grab(worker):
        return {n: p.detach().clone() for n, p in worker.model_runner.model.named_parameters()}

    return engine.llm.collective_rpc(grab)[0]


def _worker(rank, world, path, vocab_direct):
    import vllm._custom_ops as ops

    ops._supports_onednn = False  # keep vLLM's CPU linears as plain weights (see the module docstring)
    setup(2, 2)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megappo.convert import iter_hf_tensors

    from megappo.layout import RankCoords
    from megappo.convert import param_maps
    from megappo.rollout import VLLMRollout
    from megappo.convert import iter_sync_tensors
    from megappo.sync import plan_for_engine

    # What a job killed mid-run leaves behind under vLLM's own names: the engine must still start.
    stale = [f"/dev/shm/-tp:0-[{a}-{a + 1}]-cpushm_{r}" for a in (0, 2) for r in (0, 1)]
    if rank == 0:
        for f in stale:
            open(f, "wb").close()
    torch.distributed.barrier()
    info, cfg, chunks = build(path, 2, 2)
    ddp = [DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True), c) for c in chunks]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, use_distributed_optimizer=True, clip_grad=1.0), ddp)
    engine = VLLMRollout(path, device="cpu", dtype="float32", tensor_parallel_size=2, max_model_len=256,
                         max_num_seqs=8, max_num_batched_tokens=512, kv_cache_memory_bytes=32 << 20)
    coords = RankCoords.from_megatron()
    plan = plan_for_engine(engine, chunks, info.desc, coords)
    assert plan is not None
    every = {pm.megatron for pm in param_maps(info.desc)}
    vocab = {"embedding.word_embeddings.weight", "output_layer.weight"} & every  # qwen2's head is tied
    assert set(plan.gathered) == (set() if vocab_direct else vocab)
    assert plan.direct | set(plan.gathered) == every

    def full():
        return engine.sync_weights(iter_hf_tensors(chunks, info.desc, coords), bucket_bytes=1)

    def direct():
        return engine.sync_weights(iter_sync_tensors(chunks, info.desc, coords, plan, te=False), bucket_bytes=1)

    full()
    before = _engine_params(engine)
    g = torch.Generator().manual_seed(5)
    train_step(ddp, optimizer, info, [torch.randint(0, info.desc.vocab_size, (2, 32), generator=g) for _ in range(2)])
    d_stats = direct()
    by_shards = _engine_params(engine)
    f_stats = full()
    by_full = _engine_params(engine)
    assert by_shards.keys() == by_full.keys() == before.keys()
    for n in by_full:
        assert torch.equal(by_shards[n], by_full[n]), f"{n}: direct-shard sync differs from the full gather"
        assert not torch.equal(by_shards[n], before[n]), f"{n}: the sync did not change it"
    # the direct path moves a TP shard where the full path moves whole tensors
    assert d_stats["rollout/sync_bytes"] < 0.75 * f_stats["rollout/sync_bytes"], (d_stats, f_stats)
    engine.shutdown()
    if rank == 0:
        for f in stale:
            os.remove(f)


# Two query groups per TP rank, so megatron's per-group [q; k; v] really differs from vLLM's.
GROUPS = dict(num_attention_heads=8, num_key_value_heads=4)


@pytest.mark.parametrize("arch, over, vocab_direct", [("qwen3", dict(vocab_size=500, **GROUPS), True),
                                                      ("qwen2", dict(vocab_size=300, hidden_size=256, **GROUPS), False)])
def test_direct_shards_equal_full_gather_tp2pp2(arch, over, vocab_direct, tmp_path):
    """qwen3 with 500 tokens: both pad the vocabulary to 512, every tensor goes direct; qwen2 (QKV
    bias, tied head) with 300: vLLM pads to 320, megatron to 512, so the embedding is gathered."""
    path = tmp_path / arch
    save_tiny_model(arch, path, **over)
    spawn(_worker, 4, str(path), vocab_direct)
