"""DP- and TP-aware forms of the RL kernels equal the single-process computation (gloo, 2-4 ranks)."""
import pytest
import torch
import torch.distributed as dist

from megappo import algo
from megappo.distributed import (entropy_from_vocab_parallel_logits, log_probs_and_entropy, log_probs_from_logits,
                                 log_probs_reference, sum_pi_squared_from_vocab_parallel_logits)

from harness import raise_if_failed, spawn_each

pytestmark = pytest.mark.distributed
DT = torch.float64


# ------------------------------------------------------------------------------------------
# TP: vocabulary-parallel log-probs and entropy
# ------------------------------------------------------------------------------------------

def _vocab_parallel_worker(rank, world, vocab, padded):
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 7, padded, generator=g, dtype=DT) * 3
    labels = torch.randint(0, vocab, (3, 7), generator=g)
    grad_lp = torch.randn(3, 7, generator=g, dtype=DT)
    grad_h = torch.randn(3, 7, generator=g, dtype=DT)
    v_local = padded // world

    # reference: the full vocabulary on one device, naive log_softmax
    ref_in = full.clone().requires_grad_(True)
    ref_lp = log_probs_reference(ref_in, labels, vocab)
    ref_h = algo.entropy_from_logits(ref_in[..., :vocab])
    ref_g, = torch.autograd.grad((ref_lp * grad_lp).sum() + (ref_h * grad_h).sum(), ref_in)

    # chunks of 4 of the 21 tokens (the last one partial), and the whole batch at once: same bits
    results = []
    for chunk in (None, 4):
        shard = full[..., rank * v_local:(rank + 1) * v_local].clone().requires_grad_(True)
        lp = log_probs_from_logits(shard, labels, dist.group.WORLD, vocab_size=vocab, chunk_tokens=chunk)
        h = entropy_from_vocab_parallel_logits(shard, dist.group.WORLD, vocab_size=vocab, chunk_tokens=chunk)
        g_shard, = torch.autograd.grad((lp * grad_lp).sum() + (h * grad_h).sum(), shard)
        torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=0)
        torch.testing.assert_close(h, ref_h, atol=1e-12, rtol=0)
        torch.testing.assert_close(g_shard, ref_g[..., rank * v_local:(rank + 1) * v_local], atol=1e-12, rtol=0)
        results.append((lp, h, g_shard))
        shard = full[..., rank * v_local:(rank + 1) * v_local].clone().requires_grad_(True)
        lp, h = log_probs_and_entropy(shard, labels, dist.group.WORLD, vocab_size=vocab, chunk_tokens=chunk)
        g_shard, = torch.autograd.grad((lp * grad_lp).sum() + (h * grad_h).sum(), shard)
        results.append((lp, h, g_shard))
    assert all(torch.equal(x, y) for r in results[1:] for x, y in zip(results[0], r))
    # sum of pi^2 (forward only), against the plain softmax of the full vocabulary
    ref_spi2 = torch.softmax(full[..., :vocab], dim=-1).pow(2).sum(-1)
    for chunk in (None, 4):
        spi2 = sum_pi_squared_from_vocab_parallel_logits(full[..., rank * v_local:(rank + 1) * v_local],
                                                         dist.group.WORLD, vocab_size=vocab, chunk_tokens=chunk)
        torch.testing.assert_close(spi2, ref_spi2, atol=1e-12, rtol=1e-12)


VOCAB_CASES = [(2, 50, 50), (2, 45, 48), (4, 61, 64)]
DP_CASES = [(2, (9, 9)), (2, (5, 13)), (4, (4, 6, 1, 7)), (4, (0, 10, 3, 5))]
MICRO_CASES = [1, 3]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """Every case of this file in two spawned worlds, one of 2 ranks and one of 4 (a world costs
    seconds of imports; these workers hold no state between cases). case -> its error file."""
    root = tmp_path_factory.mktemp("algo")
    calls = {2: [], 4: []}
    errors = {}
    for case in VOCAB_CASES:
        errors[("vocab", case)] = str(root / f"vocab_{case[1]}_{case[2]}.error")
        calls[case[0]].append((_vocab_parallel_worker, case[1:], errors[("vocab", case)]))
    for world, splits in DP_CASES:
        errors[("dp", splits)] = str(root / f"dp_{'_'.join(map(str, splits))}.error")
        calls[world].append((_dp_worker, (splits,), errors[("dp", splits)]))
    for n in MICRO_CASES:
        errors[("micro", n)] = str(root / f"micro_{n}.error")
        calls[2].append((_agg_worker, (n,), errors[("micro", n)]))
    for world, world_calls in calls.items():
        spawn_each(world, world_calls)
    return errors


@pytest.mark.parametrize("world, vocab, padded", VOCAB_CASES)
def test_vocab_parallel_log_probs_and_entropy(world, vocab, padded, worlds):
    raise_if_failed(worlds[("vocab", (world, vocab, padded))])


# ------------------------------------------------------------------------------------------
# DP: statistics and every estimator, the batch split unevenly, groups spread over ranks
# ------------------------------------------------------------------------------------------

def _batch():
    g = torch.Generator().manual_seed(1)
    B, L = 18, 12
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    lengths[4] = 0
    mask = (torch.arange(L)[None, :] < lengths[:, None]).to(DT)
    mask[torch.rand(B, L, generator=g) < 0.15] = 0
    r = torch.randn(B, L, generator=g, dtype=DT) * mask
    v = torch.randn(B, L, generator=g, dtype=DT)
    gid = torch.tensor([0, 1, 2, 0, 3, 1, 2, 4, 5, 0, 1, 5, 2, 3, 6, 6, 4, 0])  # sizes 4,3,3,2,2,2,2
    base = torch.randn(B, generator=g, dtype=DT)
    return r, v, mask, gid, base


def _estimator_inputs(r):
    """The extra inputs of optimal_token_baseline and gdpo (the other estimators ignore them)."""
    g = torch.Generator().manual_seed(7)
    B = r.shape[0]
    return dict(old_log_probs=-torch.rand(r.shape, generator=g, dtype=DT) * 3,
                sum_pi_squared=torch.rand(r.shape, generator=g, dtype=DT),
                rollout_is_weights=torch.rand(r.shape, generator=g, dtype=DT) * 2,
                reward_components={"acc": torch.randint(0, 2, (B,), generator=g).to(DT),
                                   "fmt": torch.rand(B, generator=g, dtype=DT)},
                reward_weights=[1.0, 0.5])


def _rows(inputs, sl):
    return {k: ({n: c[sl] for n, c in v.items()} if isinstance(v, dict) else v[sl] if torch.is_tensor(v) else v)
            for k, v in inputs.items()}


def _dp_worker(rank, world, splits):
    r, v, m, gid, base = _batch()
    extra = _estimator_inputs(r)
    bounds = [0]
    for n in splits:
        bounds.append(bounds[-1] + n)
    sl = slice(bounds[rank], bounds[rank + 1])
    grp = dist.group.WORLD
    # statistics
    torch.testing.assert_close(algo.masked_mean(r[sl], m[sl], group=grp), algo.masked_mean(r, m), atol=1e-12, rtol=0)
    torch.testing.assert_close(algo.masked_var(r[sl], m[sl], group=grp), algo.masked_var(r, m), atol=1e-12, rtol=0)
    torch.testing.assert_close(algo.masked_whiten(r[sl], m[sl], group=grp), algo.masked_whiten(r, m)[sl],
                               atol=1e-12, rtol=0)
    assert algo.global_count(m[sl], grp).item() == m.sum().item()
    assert algo.global_seq_count(m[sl], grp).item() == (m.sum(-1) > 0).sum().item()
    # every estimator
    for name in algo.list_estimators():
        if name.startswith("test_only"):
            continue
        kw = dict(gamma=0.95, lam=0.9, norm_adv_by_std_in_grpo=True)
        full_a, full_r = algo.compute_advantages(name, token_level_rewards=r, response_mask=m, values=v,
                                                 group_index=gid, baseline_scores=base, **extra, **kw)
        a, ret = algo.compute_advantages(name, token_level_rewards=r[sl], response_mask=m[sl], values=v[sl],
                                         group_index=gid[sl], baseline_scores=base[sl], dp_group=grp,
                                         **_rows(extra, sl), **kw)
        torch.testing.assert_close(a, full_a[sl], atol=1e-12, rtol=0, msg=lambda s: f"{name}: {s}")
        torch.testing.assert_close(ret, full_r[sl], atol=1e-12, rtol=0, msg=lambda s: f"{name}: {s}")
    # optimal_token_baseline's per-position group sums when the ranks hold different widths
    # (each rank's rows cut to their own longest response)
    otb = {k: extra[k] for k in ("old_log_probs", "sum_pi_squared", "rollout_is_weights")}
    full_a, _ = algo.compute_advantages("optimal_token_baseline", token_level_rewards=r, response_mask=m,
                                        group_index=gid, **otb)
    cols = m[sl].sum(0).nonzero()
    w = int(cols.max().item()) + 1 if cols.numel() else 1
    cut = {k: t[sl, :w] for k, t in otb.items()}
    a, _ = algo.compute_advantages("optimal_token_baseline", token_level_rewards=r[sl, :w], response_mask=m[sl, :w],
                                   group_index=gid[sl], dp_group=grp, **cut)
    torch.testing.assert_close(a, full_a[sl, :w], atol=1e-12, rtol=0)
    # gae's group normalisations (groups spread over ranks); group_centred also with each rank's rows
    # cut to their own longest response (its per-position group sums over different widths)
    for norm in ("group", "group_shift", "group_centred", "group_cv"):
        targets = ("return", "group_relative") if norm in algo.SHIFT_FREE_ADV_NORMS else ("return",)
        for target in targets:   # group_relative: the leave-one-out mean return of groups spread over ranks
            kw = dict(gamma=0.95, lam=0.9, gae_adv_norm=norm, critic_target=target)
            full_a, full_r = algo.compute_advantages("gae", token_level_rewards=r, response_mask=m, values=v,
                                                     group_index=gid, **kw)
            a, ret = algo.compute_advantages("gae", token_level_rewards=r[sl], response_mask=m[sl], values=v[sl],
                                             group_index=gid[sl], dp_group=grp, **kw)
            torch.testing.assert_close(a, full_a[sl], atol=1e-12, rtol=0, msg=lambda s: f"{norm}: {s}")
            torch.testing.assert_close(ret, full_r[sl], atol=1e-12, rtol=0, msg=lambda s: f"{norm}, {target}: {s}")
    cols = m[sl].sum(0).nonzero()
    w = int(cols.max().item()) + 1 if cols.numel() else 1
    for norm in ("group_centred", "group_cv"):   # group_cv: its weight beta is DP-global too
        kw = dict(gamma=1.0, lam=1.0, gae_adv_norm=norm)
        full_a, _ = algo.compute_advantages("gae", token_level_rewards=r, response_mask=m, values=v, group_index=gid, **kw)
        a, _ = algo.compute_advantages("gae", token_level_rewards=r[sl, :w], response_mask=m[sl, :w], values=v[sl, :w],
                                       group_index=gid[sl], dp_group=grp, **kw)
        torch.testing.assert_close(a, full_a[sl, :w], atol=1e-12, rtol=0, msg=lambda s: f"{norm}: {s}")
    # rollout correction: weights (batch-normalised) and their metrics are global
    g = torch.Generator().manual_seed(5)  # same on every rank
    old, eng = -torch.rand(r.shape, generator=g, dtype=DT), -torch.rand(r.shape, generator=g, dtype=DT)
    for level in ("token", "sequence"):
        w_full, m_full = algo.rollout_is_weights(old, eng, m, level=level, threshold=1.5, batch_normalize=True)
        w_dp, m_dp = algo.rollout_is_weights(old[sl], eng[sl], m[sl], level=level, threshold=1.5, batch_normalize=True,
                                             dp_group=grp)
        torch.testing.assert_close(w_dp, w_full[sl], atol=1e-12, rtol=0)
        assert m_dp == pytest.approx(m_full, rel=1e-12), level
    # the engine-vs-trainer drift metrics are the whole batch's
    full = algo.rollout_probs_diff(eng, old, m)
    assert algo.rollout_probs_diff(eng[sl], old[sl], m[sl], dp_group=grp) == pytest.approx(full, rel=1e-12)
    # rejection sampling: the mask is each token's / sequence's own, its metrics are global
    for rs, th in (("token_k1,seq_mean_k3", "0.7_1.3,0.05"), ("seq_sum_k1,seq_max_k2,token_k2", "0.5_2.0,0.15,0.08")):
        k_full, rs_full = algo.rollout_correction.rollout_rejection_mask(old, eng, m, rs=rs, threshold=th)
        k_dp, rs_dp = algo.rollout_correction.rollout_rejection_mask(old[sl], eng[sl], m[sl], rs=rs, threshold=th,
                                                                     dp_group=grp)
        assert 0 < k_full.sum() < m.sum() and torch.equal(k_dp, k_full[sl])
        assert rs_dp == pytest.approx(rs_full, rel=1e-9, abs=1e-12), rs
    # KL in reward: the batch KL and the controller update are global
    g = torch.Generator().manual_seed(3)  # same on every rank
    logp, ref = -torch.rand(r.shape, generator=g, dtype=DT), -torch.rand(r.shape, generator=g, dtype=DT)
    c_full, c_dp = algo.AdaptiveKLController(0.1, 0.01, 20), algo.AdaptiveKLController(0.1, 0.01, 20)
    _, m_full = algo.apply_kl_in_reward(r, logp, ref, m, c_full, "k3")
    _, m_dp = algo.apply_kl_in_reward(r[sl], logp[sl], ref[sl], m[sl], c_dp, "k3", dp_group=grp)
    assert m_dp["actor/reward_kl_penalty"] == pytest.approx(m_full["actor/reward_kl_penalty"], abs=1e-12)
    assert c_dp.value == pytest.approx(c_full.value, rel=1e-12)
    # Clip-Cov / KL-Cov: each rank's share of the whole batch's selection (global means, top-k, keys)
    g = torch.Generator().manual_seed(9)  # same on every rank
    old = -torch.rand(r.shape, generator=g, dtype=DT) * 3
    lp = old + torch.randn(r.shape, generator=g, dtype=DT) * 0.3
    adv = torch.randn(r.shape, generator=g, dtype=DT)
    keys = algo.token_keys(torch.arange(r.shape[0]), r.shape[1], 4)
    clip = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_cov_ratio=0.1, clip_cov_lb=0.0, clip_cov_ub=5.0)
    full = algo.clip_cov_selection(old, lp, adv, m, keys, **clip)
    part = algo.clip_cov_selection(old[sl], lp[sl], adv[sl], m[sl], keys[sl], dp_group=grp, **clip)
    assert full.sum() > 1 and torch.equal(part, full[sl])
    full = algo.kl_cov_selection(lp, adv, m, keys, kl_cov_ratio=0.1)
    part = algo.kl_cov_selection(lp[sl], adv[sl], m[sl], keys[sl], kl_cov_ratio=0.1, dp_group=grp)
    assert full.sum() > 1 and torch.equal(part, full[sl])


@pytest.mark.parametrize("world, splits", DP_CASES)
def test_dp_statistics_and_estimators_match_single_process(world, splits, worlds):
    raise_if_failed(worlds[("dp", splits)])


# ------------------------------------------------------------------------------------------
# DP x micro-batches: agg_loss with global normalisers gives the same gradient
# ------------------------------------------------------------------------------------------

def _loss_grad(w, x, m, mode, ranges, n_tok, n_seq):
    """Sum over micro-batches of agg_loss with the mini-batch's global normalisers."""
    total = torch.zeros((), dtype=DT)
    for a, b in ranges:
        logits = x[a:b] @ w                      # (b-a, L) per-token "loss"
        total = total + algo.agg_loss(torch.tanh(logits), m[a:b], mode, global_tokens=n_tok, global_seqs=n_seq,
                                      norm_factor=16)
    g, = torch.autograd.grad(total, w)
    return g


def _agg_worker(rank, world, n_micro):
    g = torch.Generator().manual_seed(2)
    B, L, H = 12, 10, 5
    x = torch.randn(B, L, H, generator=g, dtype=DT)
    m = (torch.rand(B, L, generator=g) > 0.3).to(DT)
    m[3] = 0
    w0 = torch.randn(H, generator=g, dtype=DT)
    for mode in algo.LOSS_AGG_MODES:
        w = w0.clone().requires_grad_(True)
        ref = _loss_grad(w, x, m, mode, [(0, B)], m.sum(), (m.sum(-1) > 0).sum())
        # this rank's share (uneven), cut into n_micro micro-batches
        cuts = [0, 5, B] if world == 2 else None
        lo, hi = cuts[rank], cuts[rank + 1]
        edges = torch.linspace(lo, hi, n_micro + 1).round().long().tolist()
        ranges = list(zip(edges[:-1], edges[1:]))
        n_tok = algo.global_count(m[lo:hi], dist.group.WORLD)
        n_seq = algo.global_seq_count(m[lo:hi], dist.group.WORLD)
        w = w0.clone().requires_grad_(True)
        grad = _loss_grad(w, x, m, mode, ranges, n_tok, n_seq)
        dist.all_reduce(grad)   # the DP reduction is a SUM with these normalisers
        torch.testing.assert_close(grad, ref, atol=1e-12, rtol=0, msg=lambda s: f"{mode}: {s}")


@pytest.mark.parametrize("n_micro", MICRO_CASES)
def test_agg_loss_gradient_independent_of_dp_and_micro_batches(n_micro, worlds):
    raise_if_failed(worlds[("micro", n_micro)])
