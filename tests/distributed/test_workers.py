"""Actor/Critic workers: one PPO update from identical weights gives the same losses at TP1PP1,
TP2PP2 and DP2 (different micro-batch splits too)."""
import json
import os
import sys

import pytest
import torch

from harness import raise_if_failed, spawn, spawn_each
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


def _worker(rank, world, tp, pp, micro, dirs, out_file, max_tokens=None, cp=1, vpp=None, packed=False):
    setup(tp, pp, vpp, cp=cp)
    from megatron.core import parallel_state as ps

    from megappo.workers import Actor, Critic

    path = os.path.join(dirs, "qwen3")
    info, cfg, chunks = build(path, tp, pp, vpp, cp=cp)
    # SGD: Adam turns round-off-level gradient differences into full-size steps, which would
    # compare the layouts' summation orders rather than their gradients.
    actor = Actor(chunks, cfg, vocab_size=info.desc.vocab_size, lr=0.5, clip_grad=1.0, optimizer="sgd",
                  use_distributed_optimizer=False)
    cinfo, ccfg, cchunks = build(path, tp, pp, vpp, value_head=True, cp=cp)
    critic = Critic(cchunks, ccfg, lr=0.5, clip_grad=1.0, optimizer="sgd", use_distributed_optimizer=False)
    actor.pack_sequences = critic.pack_sequences = packed
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
def single(model_dir, tmp_path_factory):
    """Every single-rank run of this file in one spawned process: name -> its output file."""
    root = tmp_path_factory.mktemp("single")
    runs = {"reference": (_worker, (1, 1, 2, model_dir)), "lr": (_lr_worker, (model_dir,)), "hfgrad": (_hf_grad_worker, (model_dir,)),
            "value_mode": (_value_mode_worker, (model_dir,)),
            "modes": (_loss_mode_worker, (model_dir,)), "is": (_rollout_is_worker, (model_dir,)),
            "rs": (_rejection_worker, (model_dir,)), "shuffle": (_shuffle_worker, (model_dir,))}
    outs = {name: str(root / f"{name}.json") for name in runs}
    spawn_each(1, [(fn, (*args, outs[name]), outs[name] + ".error") for name, (fn, args) in runs.items()])
    return outs


def _result(single, name):
    raise_if_failed(single[name] + ".error")
    with open(single[name]) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def reference(single):
    return _result(single, "reference")


@pytest.mark.parametrize("world, tp, pp, micro, max_tokens, cp, vpp, packed", [
    (4, 2, 2, 1, None, 1, None, False), (2, 1, 1, 1, None, 1, None, False), (2, 2, 1, 2, None, 1, None, False),
    (2, 1, 2, 2, None, 1, None, False), (2, 1, 1, None, 40, 1, None, False), (2, 1, 1, 2, None, 2, None, False),
    (4, 2, 1, 1, None, 2, None, False), (4, 1, 2, None, 40, 2, 2, False),
    (2, 1, 1, 2, None, 1, None, True), (2, 2, 1, 2, None, 1, None, True), (4, 1, 2, None, 40, 1, 2, True),
    (2, 1, 1, 2, None, 2, None, True), (4, 2, 1, 1, None, 2, None, True), (4, 1, 2, None, 40, 2, 2, True),
], ids=["TP2PP2", "DP2", "TP2", "PP2", "DP2-token-budget", "CP2", "TP2CP2", "PP2VPP2CP2-token-budget",
        "DP2-packed", "TP2-packed", "PP2VPP2-packed-token-budget", "CP2-packed", "TP2CP2-packed",
        "PP2VPP2CP2-packed-token-budget"])
def test_one_ppo_update_is_layout_invariant(model_dir, reference, tmp_path, world, tp, pp, micro, max_tokens, cp, vpp,
                                            packed):
    """Packed cases (use_remove_padding: the sequences of a micro-batch end to end in one row,
    attention kept within each) against the padded single rank too."""
    out = str(tmp_path / "r.json")
    spawn(_worker, world, tp, pp, micro, model_dir, out, max_tokens, cp, vpp, packed)
    with open(out) as f:
        got = json.load(f)
    assert len(got["pg"]) == len(reference["pg"]) == 4          # 2 mini-batches x 2 epochs
    # the forward alone: the log-probs before the update (rank 0's rows)
    assert (torch.tensor(got["old"]) - torch.tensor(reference["old"])[got["rows"]]).abs().max().item() < 1e-5
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


def test_lr_warmup_then_linear_decay(single):
    lrs = _result(single, "lr")
    want = [0.0, 5e-4, 1e-3] + [1e-3 - (1e-3 - 1e-4) * k / 4 for k in (1, 2, 3, 4)] + [1e-4]
    assert lrs == pytest.approx(want, rel=1e-6, abs=1e-12)


def _hf_grad_worker(rank, world, dirs, out_file):
    """The actor's gradient norm (what actor.optim.clip_grad compares with) for one PPO mini-batch,
    and the same loss's gradient norm computed by HF transformers on the same weights."""
    setup(1, 1)
    from transformers import AutoModelForCausalLM

    from megappo.workers import Actor

    path = os.path.join(dirs, "qwen3")
    info, cfg, chunks = build(path, 1, 1)
    # lr 0 and no clipping: the step reports the raw norm and changes nothing
    actor = Actor(chunks, cfg, vocab_size=info.desc.vocab_size, lr=0.0, clip_grad=1e9, optimizer="sgd",
                  use_distributed_optimizer=False)
    batch = _global_batch()
    batch.old_log_prob = actor.compute_log_prob(batch, 4)
    m = actor.update_policy(batch, mini_batch_size=B, micro_batch_size=2,
                            loss=algo.PolicyLossSpec(loss_agg_mode="token-mean"))
    # the entropy bonus alone (advantages 0; lr 0: the same weights): its gradient flows when weighted
    ent_batch = batch.select(list(range(len(batch))))
    ent_batch.advantages = torch.zeros_like(batch.advantages)
    m_ent = actor.update_policy(ent_batch, mini_batch_size=B, micro_batch_size=2,
                                loss=algo.PolicyLossSpec(loss_agg_mode="token-mean", entropy_coeff=0.5))
    # at ratio 1 the clipped loss's gradient is -A grad(log p): token-mean over the batch's response tokens
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def hf_grad_norm(entropy_coeff, batch):
        hf.zero_grad()
        total = torch.zeros(())
        for i in range(len(batch)):
            n = int(batch.response_mask[i].sum())
            p = int(batch.prompt_lengths[i])
            ids = batch.input_ids[i, :p + n][None]
            logp = torch.log_softmax(hf(ids).logits[0, p - 1:p + n - 1].float(), -1)
            lp = logp.gather(-1, ids[0, p:, None])[:, 0]
            entropy = -(logp.exp() * logp).sum(-1)
            total = total - (batch.advantages[i, :n] * lp).sum() - entropy_coeff * entropy.sum()
        (total / batch.response_mask.sum()).backward()
        return float(sum(q.grad.pow(2).sum() for q in hf.parameters() if q.grad is not None).sqrt())
    with open(out_file, "w") as f:
        json.dump({"megappo": m["actor/grad_norm"], "hf": hf_grad_norm(0.0, batch),
                   "megappo_entropy": m_ent["actor/grad_norm"], "hf_entropy": hf_grad_norm(0.5, ent_batch)}, f)


def test_the_gradient_norm_is_the_losss_own(single):
    """actor/grad_norm (what clip_grad clips) is the norm of the mini-batch loss's gradient, as HF
    transformers computes it on the same weights and tokens: four micro-batches, no double-counted
    or missing parameters, no scale from the micro-batch split."""
    got = _result(single, "hfgrad")
    assert got["hf"] > 0.1
    assert got["megappo"] == pytest.approx(got["hf"], rel=1e-4)
    # an entropy bonus's gradient is in it when weighted (at weight 0 the entropy is only a metric):
    # with zero advantages it is the whole gradient
    assert got["hf_entropy"] > 1e-4
    assert got["megappo_entropy"] == pytest.approx(got["hf_entropy"], rel=1e-3)


def _value_mode_worker(rank, world, dirs, out_file):
    """critic.value_mode=increments on one model: its values, the state values of the same
    weights, after a response token is replaced, under a token budget, and its update's loss."""
    setup(1, 1)
    from megappo.workers import Critic

    info, cfg, chunks = build(os.path.join(dirs, "qwen3"), 1, 1, value_head=True)
    critic = Critic(chunks, cfg, lr=1e-3, value_mode="increments")
    batch = _global_batch()
    inc = critic.compute_values(batch, 4)
    inc_budget = critic.compute_values(batch, max_token_len=40)
    critic.value_mode = "state"
    state = critic.compute_values(batch, 4)
    critic.value_mode = "increments"
    changed = _global_batch()
    col = 3   # response token 3 of the samples that have a token after it
    rows = [i for i in range(len(changed)) if changed.response_mask[i, col + 1] > 0]
    for i in rows:
        new = 3 + (int(changed.responses[i, col]) - 3 + 1) % (VOCAB - 3)   # another ordinary token
        changed.responses[i, col] = new
        changed.input_ids[i, int(changed.prompt_lengths[i]) + col] = new
    inc_changed = critic.compute_values(changed, 4)
    batch.values = inc.clone()
    m = critic.update_critic(batch, mini_batch_size=len(batch), micro_batch_size=4)
    want, _ = algo.value_loss(inc, batch.returns, inc, batch.response_mask, cliprange_value=0.5,
                              global_tokens=batch.response_mask.sum())
    with open(out_file, "w") as f:
        json.dump({"inc": inc.tolist(), "inc_budget": inc_budget.tolist(), "state": state.tolist(),
                   "inc_changed": inc_changed.tolist(), "rows": rows, "col": col,
                   "mask": batch.response_mask.tolist(), "vf": m["critic/vf_loss_per_minibatch"][0],
                   "vf_host": float(want)}, f)


def test_increment_values_are_running_sums_of_the_heads_outputs(single):
    """critic.value_mode=increments: V(s_t) = V(s_0) + the head's outputs at the response tokens
    before t. Per token the state mode reads exactly those outputs (at the token before t), so the
    increments are the state values' running sums; V(s_t) does not see token t (replacing it
    changes V(s_t+1) onwards only); a token budget's micro-batches give the same values; the
    update trains on them (its first loss is the clipped value loss of those values)."""
    got = _result(single, "value_mode")
    inc, state, mask = (torch.tensor(got[k]) for k in ("inc", "state", "mask"))
    assert state.abs().max() > 1e-2
    assert torch.allclose(inc, state.cumsum(-1) * mask, atol=1e-5)
    assert torch.allclose(torch.tensor(got["inc_budget"]), inc, atol=1e-5)
    changed, col, rows = torch.tensor(got["inc_changed"]), got["col"], got["rows"]
    assert len(rows) >= 4
    assert torch.allclose(changed[rows, :col + 1], inc[rows, :col + 1], atol=1e-6)
    assert (changed[rows, col + 1:] - inc[rows, col + 1:]).abs().amax(-1).min() > 1e-4
    assert got["vf"] == pytest.approx(got["vf_host"], rel=1e-5)


def _loss_mode_worker(rank, world, dirs, out_file):
    setup(1, 1)
    from megappo.workers import Actor

    batch = _global_batch()
    batch.sample_index = torch.arange(len(batch))
    out = {}
    for mode in algo.list_policy_losses():
        info, cfg, chunks = build(os.path.join(dirs, "qwen3"), 1, 1)
        actor = Actor(chunks, cfg, vocab_size=info.desc.vocab_size, lr=1e-3)
        batch.old_log_prob = actor.compute_log_prob(batch, 4)
        spec = algo.PolicyLossSpec(loss_mode=mode, clip_ratio_high=0.28, dro_beta=0.05, clip_cov_ratio=0.05,
                                   clip_cov_lb=-10.0, kl_cov_ratio=0.05)
        m = actor.update_policy(batch, mini_batch_size=B, micro_batch_size=4, loss=spec)
        # on the host, the same loss on the same tensors: before the step, log-probs = old ones;
        # Clip-Cov/KL-Cov: the mini-batch's selection with the first mini-batch's seed (0)
        extra = {}
        if mode in algo.COV_LOSSES:
            lp, keys = batch.old_log_prob, algo.token_keys(batch.sample_index, batch.responses.shape[1], 0)
            extra["cov_selected"] = (
                algo.clip_cov_selection(lp, lp, batch.advantages, batch.response_mask, keys, **spec.clip_cov_kwargs())
                if mode == "clip_cov" else
                algo.kl_cov_selection(lp, batch.advantages, batch.response_mask, keys, kl_cov_ratio=0.05))
            assert extra["cov_selected"].sum() >= 2
        want, _ = algo.compute_policy_loss(mode, batch.old_log_prob, batch.old_log_prob, batch.advantages,
                                           batch.response_mask, clip_ratio_low=0.2, clip_ratio_high=0.28, dro_beta=0.05,
                                           **extra)
        out[mode] = [m["actor/pg_loss_per_minibatch"][0], float(want)]
        if mode in algo.COV_LOSSES:   # the selected share, under megappo's own name
            out[mode + "/share"] = [m["actor/cov_selected_fraction"],
                                    float(extra["cov_selected"].sum() / (batch.response_mask > 0).sum())]
        else:
            assert "actor/cov_selected_fraction" not in m
    with open(out_file, "w") as f:
        json.dump(out, f)


def test_the_actor_uses_the_configured_policy_loss(single):
    """actor.policy_loss.loss_mode reaches the update: each mode's first mini-batch loss is that
    loss on the batch (two micro-batches, global counts), and the modes differ."""
    got = _result(single, "modes")
    assert sorted(k for k in got if "/" not in k) == algo.list_policy_losses()
    for mode, (actor, host) in got.items():
        assert actor == pytest.approx(host, abs=1e-5), mode
    assert abs(got["gpg"][0] - got["vanilla"][0]) > 1e-2 and abs(got["gspo"][0] - got["vanilla"][0]) > 1e-4
    assert abs(got["clip_cov"][0] - got["vanilla"][0]) > 1e-4   # its selected tokens dropped out of the loss


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


def test_rollout_correction_weights_reach_the_update(single):
    """The batch's rollout_is_weights multiply the actor's token losses (two micro-batches,
    global counts): the loss is the host's weighted loss, and not the unweighted one."""
    got = _result(single, "is")
    for name, (actor, host) in got.items():
        assert actor == pytest.approx(host, abs=1e-5), name
    assert abs(got["token"][0] - got["off"][0]) > 1e-3


def _rejection_worker(rank, world, dirs, out_file):
    """Rejection sampling reaches the actor's loss: decoupled (a batch field, the loss mask of
    every term and its normaliser) and bypass mode (from the current policy, per micro-batch,
    on the policy term only)."""
    setup(1, 1)
    from megappo.workers import Actor

    batch = _global_batch()
    mask = batch.response_mask
    out = {}
    for mode in ("decoupled", "bypass"):
        info, cfg, chunks = build(os.path.join(dirs, "qwen3"), 1, 1)
        actor = Actor(chunks, cfg, vocab_size=info.desc.vocab_size, lr=1e-3)
        lp = actor.compute_log_prob(batch, 4)
        g = torch.Generator().manual_seed(7)
        engine = (lp + 0.3 * torch.randn(lp.shape, generator=g)) * mask   # the engine's, perturbed
        keep, _ = algo.rollout_rejection_mask(lp, engine, mask, rs="token_k3", threshold="0.02")
        assert 0.2 < float((keep * mask).sum() / mask.sum()) < 0.9
        if mode == "decoupled":   # the trainer's old log-probs; the mask is a batch field
            batch.old_log_prob, batch.rollout_rs_mask = lp, keep
            m = actor.update_policy(batch, mini_batch_size=B, micro_batch_size=4)
            want, _ = algo.compute_policy_loss("vanilla", lp, lp, batch.advantages, mask * keep)
            batch.rollout_rs_mask = None
        else:                     # old = the engine's; the actor rejects against its own log-probs
            batch.old_log_prob = engine
            m = actor.update_policy(batch, mini_batch_size=B, micro_batch_size=4,
                                    loss=algo.PolicyLossSpec(bypass_rejection=("token_k3", "0.02")))
            want, _ = algo.compute_policy_loss("vanilla", engine, lp, batch.advantages, mask * keep,
                                               global_tokens=mask.sum(), global_seqs=(mask.sum(-1) > 0).sum())
        plain, _ = algo.compute_policy_loss("vanilla", batch.old_log_prob, lp, batch.advantages, mask)
        out[mode] = [m["actor/pg_loss_per_minibatch"][0], float(want), float(plain)]
    with open(out_file, "w") as f:
        json.dump(out, f)


def test_rejection_sampling_reaches_the_actor_loss(single):
    got = _result(single, "rs")
    for mode, (actor, want, plain) in got.items():
        assert actor == pytest.approx(want, abs=1e-5), mode
        assert abs(want - plain) > 1e-3, mode    # without the mask the loss would differ


def _shuffle_worker(rank, world, dirs, out_file):
    """Two PPO epochs with shuffled mini-batches, and the same updates taken by hand: each epoch
    as one unshuffled epoch over the batch's rows in seeds.epoch_order's order."""
    setup(1, 1)
    from megappo import seeds
    from megappo.workers import Actor, Critic

    path = os.path.join(dirs, "qwen3")
    out = {}
    for shuffled in (True, False):
        info, cfg, chunks = build(path, 1, 1)
        actor = Actor(chunks, cfg, vocab_size=info.desc.vocab_size, lr=0.5, clip_grad=1.0, optimizer="sgd",
                      use_distributed_optimizer=False)
        _, ccfg, cchunks = build(path, 1, 1, value_head=True)
        critic = Critic(cchunks, ccfg, lr=0.5, clip_grad=1.0, optimizer="sgd", use_distributed_optimizer=False)
        batch = _global_batch()
        batch.old_log_prob = actor.compute_log_prob(batch, 4)
        batch.values = critic.compute_values(batch, 4)
        if shuffled:
            a = actor.update_policy(batch, mini_batch_size=M, micro_batch_size=2, ppo_epochs=2, shuffle_seed=7)
            c = critic.update_critic(batch, mini_batch_size=M, micro_batch_size=2, ppo_epochs=2, shuffle_seed=7)
            pg, vf = a["actor/pg_loss_per_minibatch"], c["critic/vf_loss_per_minibatch"]
        else:
            pg, vf = [], []
            for epoch in range(2):
                rows = batch.select(seeds.epoch_order(B, 7, 0, epoch))
                pg += actor.update_policy(rows, mini_batch_size=M, micro_batch_size=2)["actor/pg_loss_per_minibatch"]
                vf += critic.update_critic(rows, mini_batch_size=M, micro_batch_size=2)["critic/vf_loss_per_minibatch"]
        out["shuffled" if shuffled else "by_hand"] = {"pg": pg, "vf": vf}
        out.setdefault("first_rows", sorted(seeds.epoch_order(B, 7, 0, 0)[:M].tolist()))
    with open(out_file, "w") as f:
        json.dump(out, f)


def test_shuffled_mini_batches_take_each_epoch_in_a_new_order(single):
    """actor/critic.shuffle: each PPO epoch splits a new permutation of the batch (the same
    updates as taking the permuted rows by hand, loss for loss), not the batch in its order."""
    got = _result(single, "shuffle")
    assert len(got["shuffled"]["pg"]) == len(got["shuffled"]["vf"]) == 4   # 2 mini-batches x 2 epochs
    for key in ("pg", "vf"):
        assert got["shuffled"][key] == pytest.approx(got["by_hand"][key], rel=1e-6, abs=1e-9)
    assert got["first_rows"] != list(range(M))   # the order is not the batch's own
