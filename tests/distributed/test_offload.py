"""Offload while idle (megatron.param_offload / grad_offload / optimizer_offload): the storage of
every offloaded tensor is really released, and after the round trip the weights and optimizer
state are bit-identical and training continues exactly as without offload (TP1 x DP2, Adam,
distributed optimizer, and the forward-only reference; gloo)."""
import json
import os
import sys

import pytest
import torch

from harness import spawn
from mcore import build, random_batch, setup
from megappo import algo

pytestmark = pytest.mark.distributed

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
from tiny_models import VOCAB, save_tiny_model  # noqa: E402


def _state(worker):
    """Weights and every optimizer tensor, copied."""
    out = {f"p{i}": p.detach().clone() for i, p in enumerate(p for c in worker.chunks for p in c.parameters())}
    for j, opt in enumerate(getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])):
        for k, st in enumerate(opt.optimizer.state.values()):
            out.update({f"o{j}.{k}.{n}": v.clone() for n, v in st.items() if isinstance(v, torch.Tensor)})
        for k, g in enumerate(opt.optimizer.param_groups):
            out.update({f"m{j}.{k}.{i}": p.detach().clone() for i, p in enumerate(g["params"])})
    return out


def _worker(rank, world, path, out_file):
    from megappo.workers import Actor

    setup(1, 1)
    kw = dict(lr=1e-3, clip_grad=1.0, use_distributed_optimizer=True)
    info, cfg, chunks = build(path, 1, 1)
    plain = Actor(chunks, cfg, vocab_size=info.desc.vocab_size, **kw)
    info, cfg, chunks = build(path, 1, 1)
    moved = Actor(chunks, cfg, vocab_size=info.desc.vocab_size, **kw)
    moved.set_offload(params=True, grads=True, optimizer=True)
    _, rcfg, rchunks = build(path, 1, 1)
    ref = Actor(rchunks, rcfg, vocab_size=info.desc.vocab_size)
    ref.set_offload(params=True)
    batch = random_batch(8, seed=rank, prompt_len=(3, 9), response_len=(2, 7), vocab=VOCAB)
    mb = dict(micro_batch_size=2)
    freed, same = [], []
    ref_before = ref.compute_log_prob(batch, **mb)
    ref.offload()
    freed.append(all(p.untyped_storage().nbytes() == 0 for c in ref.chunks for p in c.parameters()))
    same.append(torch.equal(ref.compute_log_prob(batch, **mb), ref_before))    # reloads by itself
    for step in range(3):
        batch.old_log_prob = plain.compute_log_prob(batch, **mb)
        same.append(torch.equal(moved.compute_log_prob(batch, **mb), batch.old_log_prob))
        a = plain.update_policy(batch, mini_batch_size=4, loss=algo.PolicyLossSpec(entropy_coeff=0.01), **mb)
        b = moved.update_policy(batch, mini_batch_size=4, loss=algo.PolicyLossSpec(entropy_coeff=0.01), **mb)
        same.append(a["actor/pg_loss_per_minibatch"] == b["actor/pg_loss_per_minibatch"])
        before = _state(moved)
        moved.offload(params=step != 1)   # once with the weights kept (as before the weight sync)
        tensors = [p for c in moved.chunks for p in c.parameters()]
        grads = [buf.grad_data for m in moved.ddp_chunks for buf in m.buffers]
        states = [v for opt in moved.optimizer.chained_optimizers for st in opt.optimizer.state.values()
                  for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        freed.append(all(t.untyped_storage().nbytes() == 0 for t in grads + states))
        freed.append(all((t.untyped_storage().nbytes() == 0) == (step != 1) for t in tensors))
        moved.state_offload.reload_all()
        after = _state(moved)
        same.append(before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before))
        same.append(all(torch.equal(x, y) for x, y in zip(_state(plain).values(), after.values())))
    with open(f"{out_file}.{rank}", "w") as f:
        json.dump({"freed": freed, "same": same}, f)


def test_offload_round_trip_is_exact_and_frees_storage(tmp_path):
    save_tiny_model("qwen3", tmp_path / "model")
    spawn(_worker, 2, str(tmp_path / "model"), str(tmp_path / "out"))
    for rank in range(2):
        out = json.loads((tmp_path / f"out.{rank}").read_text())
        assert all(out["freed"]) and len(out["freed"]) == 7, out
        assert all(out["same"]) and len(out["same"]) == 13, out
