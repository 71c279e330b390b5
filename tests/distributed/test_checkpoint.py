"""Checkpoints: resume equals the uninterrupted run (Adam + distributed optimizer), a checkpoint
loads under another TP/PP, and publication is atomic."""
import json
import os
import sys

import pytest
import torch

from harness import spawn
from mcore import build, setup

pytestmark = pytest.mark.distributed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_models import save_tiny_model  # noqa: E402
from test_workers import _global_batch  # noqa: E402


def _actor(path, tp, pp):
    from megappo.workers import Actor

    info, cfg, chunks = build(path, tp, pp)
    return Actor(chunks, cfg, vocab_size=info.desc.vocab_size, lr=1e-2, clip_grad=1.0, lr_warmup_steps=1,
                 lr_decay_steps=6, lr_decay_style="cosine")


def _updates(actor, batch, k):
    out = []
    for _ in range(k):
        batch.old_log_prob = actor.compute_log_prob(batch, 2)
        out += actor.update_policy(batch, mini_batch_size=len(batch) // 2, micro_batch_size=2)[
            "actor/pg_loss_per_minibatch"]
    return out


def _resume_worker(rank, world, path, root, out_file):
    setup(1, 1)
    from megatron.core import parallel_state as ps

    from megappo.checkpoint import latest_step, load_checkpoint, save_checkpoint

    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batch = _global_batch().select(list(range(r * 8 // dp, (r + 1) * 8 // dp)))
    straight = _updates(_actor(path, 1, 1), batch, 4)
    first = _actor(path, 1, 1)
    head = _updates(first, batch, 2)
    save_checkpoint(root, 2, {"actor": first}, {"data": {"epoch": 0}})
    assert latest_step(root) == 2
    # the save's write results came back through a plain in-process queue, not through the
    # Manager process megatron would start (and keep) in every saving rank
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    assert type(fa._results_queue) is queue.Queue
    resumed = _actor(path, 1, 1)
    state = load_checkpoint(os.path.join(root, "global_step_2"), {"actor": resumed})
    tail = _updates(resumed, batch, 2)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"straight": straight, "resumed": head + tail, "state": state}, f)


def test_resume_continues_exactly(tmp_path):
    path = str(tmp_path / "qwen3")
    save_tiny_model("qwen3", path, seed=2)
    out = str(tmp_path / "r.json")
    spawn(_resume_worker, 2, path, str(tmp_path / "ckpt"), out)
    with open(out) as f:
        r = json.load(f)
    assert r["state"] == {"step": 2, "data": {"epoch": 0}}
    assert len(r["straight"]) == 8
    for a, b in zip(r["straight"], r["resumed"]):
        assert abs(a - b) < 1e-6, (r["straight"], r["resumed"])


def _save_tp2pp2(rank, world, path, root, out_file):
    setup(2, 2)
    from megappo.checkpoint import save_checkpoint

    actor = _actor(path, 2, 2)
    batch = _global_batch()
    _updates(actor, batch, 1)
    save_checkpoint(root, 1, {"actor": actor}, {})
    lp = actor.compute_log_prob(batch, 2)
    if rank == 0:
        torch.save(lp, out_file)


def _load_tp1(rank, world, path, root, out_file):
    setup(1, 1)
    from megappo.checkpoint import load_checkpoint

    actor = _actor(path, 1, 1)
    load_checkpoint(os.path.join(root, "global_step_1"), {"actor": actor})
    lp = actor.compute_log_prob(_global_batch(), 2)
    ref = torch.load(out_file)
    assert (lp - ref).abs().max().item() < 1e-5


def test_checkpoint_loads_under_another_layout(tmp_path):
    path = str(tmp_path / "qwen3")
    save_tiny_model("qwen3", path, seed=2)
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "lp.pt")
    spawn(_save_tp2pp2, 4, path, root, out)
    spawn(_load_tp1, 1, path, root, out)


def test_latest_and_errors(tmp_path):
    from megappo.checkpoint import CheckpointError, latest_step, load_checkpoint

    assert latest_step(str(tmp_path)) is None
    (tmp_path / "latest").write_text("7")
    with pytest.raises(CheckpointError, match="names step 7, but global_step_7/trainer_state.json is missing"):
        latest_step(str(tmp_path))
    (tmp_path / "latest").write_text("x")
    with pytest.raises(CheckpointError, match="expected a step number"):
        latest_step(str(tmp_path))
    with pytest.raises(CheckpointError, match="no trainer_state.json"):
        load_checkpoint(str(tmp_path), {})


def _common_payload(rank, world, root):
    import pickle

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from megappo import megatron_cpu
    from test_checkpoint_pickles import Payload

    megatron_cpu.install()   # megatron loads common state onto the current CUDA device
    marker = os.path.join(root, "ran")
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2)), "sched": {"step": 1}}, root)
    assert dist_checkpointing.load_common_state_dict(root)["sched"] == {"step": 1}
    torch.save({"sched": Payload(marker)}, os.path.join(root, "common.pt"))
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        dist_checkpointing.load_common_state_dict(root)
    assert not os.path.exists(marker)


def test_megatron_common_state_refuses_a_payload(tmp_path):
    """megatron-core's dist_checkpointing reads common.pt (the scheduler, the optimizer's
    non-tensor state) with torch.load's default, weights_only=True since torch 2.6: a payload
    planted there is refused too."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit"))
    spawn(_common_payload, 1, str(tmp_path))
