"""Actor/Critic workers: one PPO update from identical weights gives the same losses at TP1PP1,
TP2PP2 and DP2 (different micro-batch splits too)."""
import json
import os
import sys

import pytest
import torch

from harness import spawn
from megappo import algo
from mcore import build, setup, random_batch

pytestmark = pytest.mark.distributed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_models import VOCAB, save_tiny_model  # noqa: E402

B, M = 8, 4   # samples, global mini-batch size


def _global_batch():
    return random_batch(B, 5, (5, 13), (3, 11), VOCAB, prompt_index=torch.arange(B) // 2)


def _rows_for(rank_dp, dp):
    """This DP rank's rows: its part of every global mini-batch."""
    per = M // dp
    return [j * M + rank_dp * per + k for j in range(B // M) for k in range(per)]


def _worker(rank, world, tp, pp, micro, dirs, out_file, max_tokens=None):
    setup(tp, pp)
    from megatron.core import parallel_state as ps

    from megappo.workers import Actor, Critic

    path = os.path.join(dirs, "qwen3")
    info, cfg, chunks = build(path, tp, pp)
    # SGD: Adam turns round-off-level gradient differences into full-size steps, which would
    # compare the layouts' summation orders rather than their gradients.
    actor = Actor(chunks, cfg, vocab_size=info.desc.vocab_size, lr=0.5, clip_grad=1.0, optimizer="sgd",
                  use_distributed_optimizer=False)
    cinfo, ccfg, cchunks = build(path, tp, pp, value_head=True)
    critic = Critic(cchunks, ccfg, lr=0.5, clip_grad=1.0, optimizer="sgd", use_distributed_optimizer=False)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batch = _global_batch().select(_rows_for(dp_rank, dp))
    mb = dict(micro_batch_size=None if max_tokens else micro, max_token_len=max_tokens)
    batch.old_log_prob = actor.compute_log_prob(batch, **mb)
    batch.values = critic.compute_values(batch, **mb)
    a = actor.update_policy(batch, mini_batch_size=M // dp, ppo_epochs=2,
                            loss=algo.PolicyLossSpec(entropy_coeff=0.01, loss_agg_mode="token-mean"), **mb)
    c = critic.update_critic(batch, mini_batch_size=M // dp, ppo_epochs=2, **mb)
    after = actor.compute_log_prob(batch, **mb)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"pg": a["actor/pg_loss_per_minibatch"], "vf": c["critic/vf_loss_per_minibatch"],
                       "kl": a["actor/ppo_kl"], "grad": a["actor/grad_norm"],
                       "old": batch.old_log_prob.tolist(), "after": after.tolist(), "rows": _rows_for(dp_rank, dp)}, f)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("w")
    save_tiny_model("qwen3", root / "qwen3", seed=3)
    return str(root)


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ref") / "r.json")
    spawn(_worker, 1, 1, 1, 2, model_dir, out)
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize("world, tp, pp, micro, max_tokens", [
    (4, 2, 2, 1, None), (2, 1, 1, 1, None), (2, 2, 1, 2, None), (2, 1, 2, 2, None), (2, 1, 1, None, 40),
], ids=["TP2PP2", "DP2", "TP2", "PP2", "DP2-token-budget"])
def test_one_ppo_update_is_layout_invariant(model_dir, reference, tmp_path, world, tp, pp, micro, max_tokens):
    out = str(tmp_path / "r.json")
    spawn(_worker, world, tp, pp, micro, model_dir, out, max_tokens)
    with open(out) as f:
        got = json.load(f)
    assert len(got["pg"]) == len(reference["pg"]) == 4          # 2 mini-batches x 2 epochs
    for key in ("pg", "vf"):
        for a, b in zip(got[key], reference[key]):
            assert abs(a - b) < 1e-5, f"{key}: {got[key]} vs {reference[key]}"
    assert abs(got["grad"] - reference["grad"]) < 1e-4
    # the updated policy is the same too: compare log-probs of rank 0's rows
    ref_after = torch.tensor(reference["after"])[got["rows"]]
    assert (torch.tensor(got["after"]) - ref_after).abs().max().item() < 1e-4
    assert (torch.tensor(reference["after"]) - torch.tensor(reference["old"])).abs().max().item() > 1e-3  # it moved


def _lr_worker(rank, world, dirs, out_file):
    setup(1, 1)
    from megappo.workers import Actor

    info, cfg, chunks = build(os.path.join(dirs, "qwen3"), 1, 1)
    actor = Actor(chunks, cfg, vocab_size=info.desc.vocab_size, lr=1e-3, lr_warmup_steps=2, lr_decay_steps=6,
                  lr_decay_style="linear", min_lr=1e-4)
    batch = _global_batch()
    batch.old_log_prob = actor.compute_log_prob(batch, 4)
    lrs = [actor.update_policy(batch, mini_batch_size=8, micro_batch_size=4)["actor/lr"] for _ in range(8)]
    with open(out_file, "w") as f:
        json.dump(lrs, f)


def test_lr_warmup_then_linear_decay(model_dir, tmp_path):
    out = str(tmp_path / "lr.json")
    spawn(_lr_worker, 1, model_dir, out)
    with open(out) as f:
        lrs = json.load(f)
    want = [0.0, 5e-4, 1e-3] + [1e-3 - (1e-3 - 1e-4) * k / 4 for k in (1, 2, 3, 4)] + [1e-4]
    assert lrs == pytest.approx(want, rel=1e-6, abs=1e-12)


def _loss_mode_worker(rank, world, dirs, out_file):
    setup(1, 1)
    from megappo.workers import Actor

    batch = _global_batch()
    out = {}
    for mode in algo.list_policy_losses():
        info, cfg, chunks = build(os.path.join(dirs, "qwen3"), 1, 1)
        actor = Actor(chunks, cfg, vocab_size=info.desc.vocab_size, lr=1e-3)
        batch.old_log_prob = actor.compute_log_prob(batch, 4)
        m = actor.update_policy(batch, mini_batch_size=B, micro_batch_size=4,
                                loss=algo.PolicyLossSpec(loss_mode=mode, clip_ratio_high=0.28))
        # on the host, the same loss on the same tensors: before the step, log-probs = old ones
        want, _ = algo.compute_policy_loss(mode, batch.old_log_prob, batch.old_log_prob, batch.advantages,
                                           batch.response_mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
        out[mode] = [m["actor/pg_loss_per_minibatch"][0], float(want)]
    with open(out_file, "w") as f:
        json.dump(out, f)


def test_the_actor_uses_the_configured_policy_loss(model_dir, tmp_path):
    """actor.policy_loss.loss_mode reaches the update: each mode's first mini-batch loss is that
    loss on the batch (two micro-batches, global counts), and the modes differ."""
    out = str(tmp_path / "modes.json")
    spawn(_loss_mode_worker, 1, model_dir, out)
    with open(out) as f:
        got = json.load(f)
    assert sorted(got) == algo.list_policy_losses()
    for mode, (actor, host) in got.items():
        assert actor == pytest.approx(host, abs=1e-5), mode
    assert abs(got["gpg"][0] - got["vanilla"][0]) > 1e-2 and abs(got["gspo"][0] - got["vanilla"][0]) > 1e-4


def _rollout_is_worker(rank, world, dirs, out_file):
    setup(1, 1)
    from megappo.workers import Actor

    batch = _global_batch()
    info, cfg, chunks = build(os.path.join(dirs, "qwen3"), 1, 1)
    out = {}
    for name in ("off", "token"):
        info, cfg, chunks = build(os.path.join(dirs, "qwen3"), 1, 1)
        actor = Actor(chunks, cfg, vocab_size=info.desc.vocab_size, lr=1e-3)
        batch.old_log_prob = actor.compute_log_prob(batch, 4)
        engine = batch.old_log_prob + 0.3 * torch.randn(batch.old_log_prob.shape, generator=torch.Generator().manual_seed(0))
        batch.rollout_is_weights = None
        if name == "token":
            batch.rollout_is_weights, _ = algo.rollout_is_weights(batch.old_log_prob, engine, batch.response_mask)
        m = actor.update_policy(batch, mini_batch_size=B, micro_batch_size=4)
        want, _ = algo.compute_policy_loss("vanilla", batch.old_log_prob, batch.old_log_prob, batch.advantages,
                                           batch.response_mask, rollout_is_weights=batch.rollout_is_weights)
        out[name] = [m["actor/pg_loss_per_minibatch"][0], float(want)]
    with open(out_file, "w") as f:
        json.dump(out, f)


def test_rollout_correction_weights_reach_the_update(model_dir, tmp_path):
    """The batch's rollout_is_weights multiply the actor's token losses (two micro-batches,
    global counts): the loss is the host's weighted loss, and not the unweighted one."""
    out = str(tmp_path / "is.json")
    spawn(_rollout_is_worker, 1, model_dir, out)
    with open(out) as f:
        got = json.load(f)
    for name, (actor, host) in got.items():
        assert actor == pytest.approx(host, abs=1e-5), name
    assert abs(got["token"][0] - got["off"][0]) > 1e-3
