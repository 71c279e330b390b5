"""megappo.algo statistics and advantage estimators against independent float64 loop references."""
import math
import random
import statistics

import pytest
import torch

from megappo import algo

DT = torch.float64


# ------------------------------------------------------------------------------------------
# independent references: plain Python over lists
# ------------------------------------------------------------------------------------------

def ref_mean(x, m):
    vals = [x[i][t] for i in range(len(x)) for t in range(len(x[0])) if m[i][t]]
    return sum(vals) / len(vals) if vals else 0.0


def ref_var(x, m):
    vals = [x[i][t] for i in range(len(x)) for t in range(len(x[0])) if m[i][t]]
    return statistics.variance(vals)  # unbiased


def ref_whiten(x, m):
    mu, var = ref_mean(x, m), ref_var(x, m)
    return [[(x[i][t] - mu) / math.sqrt(var + 1e-8) if m[i][t] else 0.0 for t in range(len(x[0]))]
            for i in range(len(x))]


def ref_gae(r, v, m, gamma, lam):
    """Per row: walk the response positions backwards, ignoring masked positions entirely."""
    adv = [[0.0] * len(r[0]) for _ in r]
    for i in range(len(r)):
        pos = [t for t in range(len(r[0])) if m[i][t]]
        a_next, v_next = 0.0, 0.0
        for t in reversed(pos):
            delta = r[i][t] + gamma * v_next - v[i][t]
            a_next = delta + gamma * lam * a_next
            v_next = v[i][t]
            adv[i][t] = a_next
    ret = [[adv[i][t] + v[i][t] if m[i][t] else 0.0 for t in range(len(r[0]))] for i in range(len(r))]
    return adv, ret


def ref_return_to_go(r, m, gamma):
    out = [[0.0] * len(r[0]) for _ in r]
    for i in range(len(r)):
        g = 0.0
        for t in reversed([t for t in range(len(r[0])) if m[i][t]]):
            g = r[i][t] + gamma * g
            out[i][t] = g
    return out


def scores_of(r, m):
    return [sum(r[i][t] for t in range(len(r[0])) if m[i][t]) for i in range(len(r))]


def broadcast(a, m):
    return [[a[i] if m[i][t] else 0.0 for t in range(len(m[0]))] for i in range(len(m))]


def T(x):
    return torch.tensor(x, dtype=DT)


def random_batch(seed, B=7, L=13, holes=True):
    """Right-padded responses of random length (1..L, some empty), optionally with interior
    masked spans (multi-turn observation tokens); random junk at masked positions."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    lengths[0] = 0          # an all-masked row
    lengths[1] = 1          # a length-1 response
    mask = (torch.arange(L)[None, :] < lengths[:, None]).to(DT)
    if holes:
        hole = torch.rand(B, L, generator=g) < 0.25
        hole[1] = False
        mask = mask * (~hole)
    r = torch.randn(B, L, generator=g, dtype=DT)
    v = torch.randn(B, L, generator=g, dtype=DT)
    return r, v, mask


# ------------------------------------------------------------------------------------------
# masked statistics
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_masked_stats(seed):
    r, _, m = random_batch(seed)
    x, ml = r.tolist(), m.tolist()
    assert algo.masked_mean(r, m).item() == pytest.approx(ref_mean(x, ml), abs=1e-12)
    assert algo.masked_var(r, m).item() == pytest.approx(ref_var(x, ml), abs=1e-12)
    torch.testing.assert_close(algo.masked_whiten(r, m), T(ref_whiten(x, ml)), atol=1e-10, rtol=0)
    # shift_mean=False keeps the mean, only rescales
    w = algo.masked_whiten(r, m, shift_mean=False)
    assert algo.masked_mean(w, m).item() == pytest.approx(ref_mean(x, ml), abs=1e-9)
    # per-row mean
    rows = algo.masked_mean(r, m, dim=-1)
    for i in range(len(x)):
        assert rows[i].item() == pytest.approx(ref_mean([x[i]], [ml[i]]), abs=1e-12)


def test_masked_stats_ignore_nonfinite_masked_values_and_edge_cases():
    x = torch.tensor([[1.0, float("nan"), 3.0], [float("inf"), 5.0, 0.0]], dtype=DT)
    m = torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=DT)
    assert algo.masked_mean(x, m).item() == pytest.approx(3.0)
    assert algo.masked_var(x, m).item() == pytest.approx(4.0)
    assert algo.masked_mean(x, torch.zeros_like(m)).item() == 0.0
    with pytest.raises(ValueError, match="at least 2 unmasked"):
        algo.masked_var(x, torch.tensor([[1, 0, 0], [0, 0, 0]], dtype=DT))


# ------------------------------------------------------------------------------------------
# GAE and return-to-go
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.3), (0.0, 0.9), (1.0, 0.0)])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_equals_reference_loops(gamma, lam, holes):
    for seed in range(3):
        r, v, m = random_batch(seed, B=9, L=40, holes=holes)
        want_a, want_r = ref_gae(r.tolist(), v.tolist(), m.tolist(), gamma, lam)
        for fn in (algo.gae, algo.gae_reference):
            a, ret = fn(r, v, m, gamma, lam)
            torch.testing.assert_close(a, T(want_a), atol=1e-10, rtol=0)
            torch.testing.assert_close(ret, T(want_r), atol=1e-10, rtol=0)


def test_gae_long_sequences_many_chunks():
    # Long rows cross many scan chunks; the decays stress the carries between them.
    g = torch.Generator().manual_seed(0)
    r = torch.randn(3, 1000, generator=g, dtype=DT)
    v = torch.randn(3, 1000, generator=g, dtype=DT)
    m = (torch.rand(3, 1000, generator=g) > 0.3).to(DT)
    for gamma, lam in [(0.999, 0.99), (0.9, 0.5), (1.0, 1.0)]:
        a, ret = algo.gae(r, v, m, gamma, lam)
        a2, ret2 = algo.gae_reference(r, v, m, gamma, lam)
        torch.testing.assert_close(a, a2, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(ret, ret2, atol=1e-9, rtol=1e-9)


def test_gae_ignores_values_and_rewards_at_masked_positions():
    r, v, m = random_batch(5, L=20)
    junk = torch.randn_like(v) * 100
    a1, ret1 = algo.gae(r, v, m, 0.97, 0.9)
    a2, ret2 = algo.gae(torch.where(m > 0, r, junk), torch.where(m > 0, v, junk), m, 0.97, 0.9)
    torch.testing.assert_close(a1, a2, atol=0, rtol=0)
    torch.testing.assert_close(ret1, ret2, atol=0, rtol=0)
    assert (a1[m == 0] == 0).all()


def test_gae_float32_matches_float64_reference():
    g = torch.Generator().manual_seed(1)
    r = torch.randn(16, 2048, generator=g)
    v = torch.randn(16, 2048, generator=g)
    m = torch.ones(16, 2048)
    a, _ = algo.gae(r, v, m, 1.0, 0.95)
    a64, _ = algo.gae_reference(r.double(), v.double(), m.double(), 1.0, 0.95)
    assert a.dtype == torch.float32
    assert ((a.double() - a64).abs().max() / a64.abs().max()).item() < 1e-5


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_discounted_returns(gamma):
    r, _, m = random_batch(3, L=30)
    want = T(ref_return_to_go(r.tolist(), m.tolist(), gamma))
    torch.testing.assert_close(algo.discounted_returns(r, m, gamma), want, atol=1e-10, rtol=0)
    torch.testing.assert_close(algo.discounted_returns_reference(r, m, gamma), want, atol=1e-10, rtol=0)


# ------------------------------------------------------------------------------------------
# estimators
# ------------------------------------------------------------------------------------------

def outcome_batch(seed, groups=(4, 4, 1, 3, 2)):
    """Outcome rewards on the last response token; samples of a prompt share a group id, shuffled."""
    rnd = random.Random(seed)
    ids = [gid for gid, n in enumerate(groups) for _ in range(n)]
    rnd.shuffle(ids)
    B, L = len(ids), 9
    m = torch.zeros(B, L, dtype=DT)
    r = torch.zeros(B, L, dtype=DT)
    for i in range(B):
        n = rnd.randint(1, L)
        m[i, :n] = 1
        r[i, n - 1] = rnd.choice([0.0, 1.0, 0.5, -1.0]) + rnd.random() * 0.1
    return r, m, torch.tensor([100 + g for g in ids])  # ids need not be 0..G-1


def ref_group(scores, ids):
    by = {}
    for s, g in zip(scores, ids):
        by.setdefault(g, []).append(s)
    return by


def test_grpo_and_dr_grpo():
    r, m, gid = outcome_batch(0)
    s = scores_of(r.tolist(), m.tolist())
    by = ref_group(s, gid.tolist())
    want, want_dr = [], []
    for si, g in zip(s, gid.tolist()):
        members = by[g]
        mean, std = (statistics.mean(members), statistics.stdev(members)) if len(members) > 1 else (0.0, 1.0)
        want.append((si - mean) / (std + 1e-6))
        want_dr.append(si - mean)
    for name in ("grpo", "grpo_vectorized"):
        a, ret = algo.compute_advantages(name, token_level_rewards=r, response_mask=m, group_index=gid)
        torch.testing.assert_close(a, T(broadcast(want, m.tolist())), atol=1e-9, rtol=0)
        torch.testing.assert_close(ret, a)
    a, _ = algo.compute_advantages("grpo", token_level_rewards=r, response_mask=m, group_index=gid,
                                   norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(a, T(broadcast(want_dr, m.tolist())), atol=1e-9, rtol=0)


def test_rloo():
    r, m, gid = outcome_batch(1)
    s = scores_of(r.tolist(), m.tolist())
    ids = gid.tolist()
    want = []
    for i, (si, g) in enumerate(zip(s, ids)):
        others = [s[j] for j in range(len(s)) if ids[j] == g and j != i]
        want.append(si - statistics.mean(others) if others else si)
    for name in ("rloo", "rloo_vectorized"):
        a, _ = algo.compute_advantages(name, token_level_rewards=r, response_mask=m, group_index=gid)
        torch.testing.assert_close(a, T(broadcast(want, m.tolist())), atol=1e-9, rtol=0)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus(gamma):
    r, _, m = random_batch(2, L=15)
    g = ref_return_to_go(r.tolist(), m.tolist(), gamma)
    a, ret = algo.compute_advantages("reinforce_plus_plus", token_level_rewards=r, response_mask=m, gamma=gamma)
    torch.testing.assert_close(a, T(ref_whiten(g, m.tolist())), atol=1e-9, rtol=0)
    torch.testing.assert_close(ret, T(g), atol=1e-10, rtol=0)


def test_reinforce_plus_plus_baseline():
    r, m, gid = outcome_batch(3)
    s = scores_of(r.tolist(), m.tolist())
    by = ref_group(s, gid.tolist())
    # a singleton group (one in this batch) keeps its raw score, as in verl and every group estimator here
    centred = broadcast([si - (statistics.mean(by[g]) if len(by[g]) > 1 else 0.0) for si, g in zip(s, gid.tolist())],
                        m.tolist())
    a, _ = algo.compute_advantages("reinforce_plus_plus_baseline", token_level_rewards=r, response_mask=m,
                                   group_index=gid)
    torch.testing.assert_close(a, T(ref_whiten(centred, m.tolist())), atol=1e-9, rtol=0)


def test_remax():
    r, _, m = random_batch(4, L=12)
    base = torch.randn(r.shape[0], dtype=DT)
    g = ref_return_to_go(r.tolist(), m.tolist(), 1.0)
    want = [[g[i][t] - base[i].item() if m[i, t] else 0.0 for t in range(r.shape[1])] for i in range(r.shape[0])]
    a, ret = algo.compute_advantages("remax", token_level_rewards=r, response_mask=m, baseline_scores=base)
    torch.testing.assert_close(a, T(want), atol=1e-10, rtol=0)
    torch.testing.assert_close(ret, T(g), atol=1e-10, rtol=0)


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95)])
def test_gae_estimator_whitens_advantages_not_returns(gamma, lam):
    r, v, m = random_batch(6, L=20)
    adv, ret = ref_gae(r.tolist(), v.tolist(), m.tolist(), gamma, lam)
    a, rt = algo.compute_advantages("gae", token_level_rewards=r, values=v, response_mask=m, gamma=gamma, lam=lam)
    torch.testing.assert_close(a, T(ref_whiten(adv, m.tolist())), atol=1e-9, rtol=0)
    torch.testing.assert_close(rt, T(ret), atol=1e-10, rtol=0)


def test_group_of_one_everywhere():
    """A group with one sample (e.g. after filtering) keeps its raw score in every group estimator
    (before rpp_baseline's and gdpo's batch whitening; gpg scales it by alpha; optimal_token_baseline
    keeps its reward-to-go), as in verl; Pass@k refuses it."""
    r, m, _ = outcome_batch(5, groups=(1, 1, 1))
    gid = torch.arange(3)
    s = scores_of(r.tolist(), m.tolist())
    a, _ = algo.compute_advantages("grpo", token_level_rewards=r, response_mask=m, group_index=gid)
    torch.testing.assert_close(a, T(broadcast([x / (1 + 1e-6) for x in s], m.tolist())), atol=1e-12, rtol=0)
    for name in ("rloo", "opo", "grpo_vectorized", "rloo_vectorized"):
        a, _ = algo.compute_advantages(name, token_level_rewards=r, response_mask=m, group_index=gid,
                                       norm_adv_by_std_in_grpo=False)
        torch.testing.assert_close(a, T(broadcast(s, m.tolist())), atol=1e-12, rtol=0, msg=name)
    _, raw = algo.compute_advantages("reinforce_plus_plus_baseline", token_level_rewards=r, response_mask=m, group_index=gid)
    torch.testing.assert_close(raw, T(broadcast(s, m.tolist())), atol=1e-12, rtol=0)
    a, _ = algo.compute_advantages("gpg", token_level_rewards=r, response_mask=m, group_index=gid)
    alpha = len(s) / sum(1 for x in s if x != 0)
    torch.testing.assert_close(a, T(broadcast([alpha * x for x in s], m.tolist())), atol=1e-12, rtol=0)
    # optimal_token_baseline: no baseline, the reward-to-go; gdpo: each component's raw score
    # (/ (1 + 1e-6)), weighted and summed, before the batch whitening
    lp, spi2 = -torch.rand(r.shape, dtype=DT), torch.rand(r.shape, dtype=DT)
    a, ret = algo.compute_advantages("optimal_token_baseline", token_level_rewards=r, response_mask=m, group_index=gid,
                                     old_log_probs=lp, sum_pi_squared=spi2)
    torch.testing.assert_close(a, T(ref_return_to_go(r.tolist(), m.tolist(), 1.0)), atol=1e-12, rtol=0)
    extra = [0.3, -2.0, 1.5]
    a, _ = algo.compute_advantages("gdpo", token_level_rewards=r, response_mask=m, group_index=gid,
                                   reward_components={"x": T(s), "y": T(extra)}, reward_weights=[2.0, 1.0])
    want = [(2.0 * x + y) / (1 + 1e-6) for x, y in zip(s, extra)]
    torch.testing.assert_close(a, T(ref_whiten(broadcast(want, m.tolist()), m.tolist())), atol=1e-9, rtol=0)
    with pytest.raises(ValueError, match="grpo_passk needs at least 2 samples per group; group 0 has 1"):
        algo.compute_advantages("grpo_passk", token_level_rewards=r, response_mask=m, group_index=gid)


def test_opo():
    r, m, gid = outcome_batch(7)
    s = scores_of(r.tolist(), m.tolist())
    n = [sum(row) for row in m.tolist()]
    ids = gid.tolist()
    want = []
    for i, g in enumerate(ids):
        members = [j for j in range(len(s)) if ids[j] == g]
        b = sum(n[j] * s[j] for j in members) / sum(n[j] for j in members) if len(members) > 1 else 0.0
        want.append(s[i] - b)
    a, ret = algo.compute_advantages("opo", token_level_rewards=r, response_mask=m, group_index=gid)
    torch.testing.assert_close(a, T(broadcast(want, m.tolist())), atol=1e-9, rtol=0)
    torch.testing.assert_close(ret, a)


def test_gpg_estimator():
    r, m, gid = outcome_batch(8)
    r[0] = 0   # a sample scoring exactly 0: alpha counts the others
    s = scores_of(r.tolist(), m.tolist())
    by = ref_group(s, gid.tolist())
    alpha = len(s) / sum(1 for x in s if x != 0)
    want = [alpha * (si - (statistics.mean(by[g]) if len(by[g]) > 1 else 0.0)) for si, g in zip(s, gid.tolist())]
    a, _ = algo.compute_advantages("gpg", token_level_rewards=r, response_mask=m, group_index=gid)
    torch.testing.assert_close(a, T(broadcast(want, m.tolist())), atol=1e-9, rtol=0)
    assert alpha > 1


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk(norm):
    r, m, gid = outcome_batch(9, groups=(4, 3, 2, 2))
    s = scores_of(r.tolist(), m.tolist())
    ids = gid.tolist()
    want = [0.0] * len(s)
    for g in set(ids):
        members = [j for j in range(len(s)) if ids[j] == g]
        ranked = sorted(members, key=lambda j: (-s[j], j))        # ties: the first in batch order
        best, second = ranked[0], ranked[1]
        gap = s[best] - s[second]
        want[best] = gap / (statistics.stdev([s[j] for j in members]) + 1e-6) if norm else gap
    a, _ = algo.compute_advantages("grpo_passk", token_level_rewards=r, response_mask=m, group_index=gid,
                                   norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(a, T(broadcast(want, m.tolist())), atol=1e-9, rtol=0)
    assert sum(1 for x in want if x != 0) <= len(set(ids))
    # a tie for the best: the first of the tied samples gets the (zero) gap, nobody else anything
    r2 = torch.zeros(2, 3, dtype=DT)
    r2[:, 0] = 1.0
    a, _ = algo.compute_advantages("grpo_passk", token_level_rewards=r2, response_mask=torch.ones(2, 3, dtype=DT),
                                   group_index=torch.tensor([7, 7]))
    assert (a == 0).all()


def test_registry_errors_and_extension():
    with pytest.raises(KeyError, match="unknown advantage estimator 'nope'; registered: .*gae.*grpo"):
        algo.get_estimator("nope")
    with pytest.raises(ValueError, match="already registered"):
        algo.register_estimator("gae")(lambda **kw: None)
    with pytest.raises(ValueError, match="needs values"):
        algo.compute_advantages("gae", token_level_rewards=torch.zeros(1, 1), response_mask=torch.ones(1, 1))
    with pytest.raises(ValueError, match="needs group_index"):
        algo.compute_advantages("grpo", token_level_rewards=torch.zeros(1, 1), response_mask=torch.ones(1, 1))
    with pytest.raises(ValueError, match="needs baseline_scores"):
        algo.compute_advantages("remax", token_level_rewards=torch.zeros(1, 1), response_mask=torch.ones(1, 1))

    name = "test_only_sign"
    if name not in algo.list_estimators():
        @algo.register_estimator(name)
        def _sign(*, token_level_rewards, response_mask, **_):
            a = torch.sign(token_level_rewards) * response_mask
            return a, a
    a, _ = algo.compute_advantages(name, token_level_rewards=torch.tensor([[-2.0, 3.0]]), response_mask=torch.ones(1, 2))
    assert a.tolist() == [[-1.0, 1.0]]
    assert not algo.get_estimator(name).needs_critic
    assert algo.get_estimator("gae").needs_critic and algo.get_estimator("grpo").group_relative


# ------------------------------------------------------------------------------------------
# optimal_token_baseline and gdpo (verl's estimators that take more than the rewards)
# ------------------------------------------------------------------------------------------

def token_batch(seed, groups=(4, 3, 1, 5, 2), L=11, holes=False):
    """Token-level rewards, old log-probs, sum pi^2 and IS weights for samples in groups of the
    given sizes (shuffled ids). Group 0's longest response is unique, group 3's is tied; junk
    at masked positions."""
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    ids = [gid for gid, n in enumerate(groups) for _ in range(n)]
    rnd.shuffle(ids)
    B = len(ids)
    lengths = [rnd.randint(1, L - 2) for _ in range(B)]
    members = {k: [i for i in range(B) if ids[i] == k] for k in range(len(groups))}
    lengths[members[0][0]] = L                      # unique longest of group 0
    for i in members[0][1:]:
        lengths[i] = min(lengths[i], L - 3)
    lengths[members[3][0]] = lengths[members[3][1]] = L - 1   # tied longest of group 3
    for i in members[3][2:]:
        lengths[i] = min(lengths[i], L - 4)
    m = (torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]).to(DT)
    if holes:
        hole = torch.rand(B, L, generator=g) < 0.2
        hole[:, 0] = False
        m = m * (~hole)
    junk = torch.randn(B, L, generator=g, dtype=DT) * 50
    r = torch.where(m > 0, torch.randn(B, L, generator=g, dtype=DT), junk)
    lp = torch.where(m > 0, -torch.rand(B, L, generator=g, dtype=DT) * 4, junk)
    spi2 = torch.where(m > 0, torch.rand(B, L, generator=g, dtype=DT), junk)
    rho = torch.where(m > 0, torch.rand(B, L, generator=g, dtype=DT) * 2, junk)
    return r, m, torch.tensor([100 + k for k in ids]), lp, spi2, rho


def ref_otb(r, m, ids, lp, spi2, rho=None, zero_tail=True, eps=1e-8):
    """OTB from its formula, one group and one position at a time:
    G_t = sum_{s>=t} r_s, W_t = sum_{s<=t} (1 - 2 exp(logp_s) + sum pi^2_s) rho_s^2,
    b_t = sum_i G_t W_t / (sum_i W_t + eps) over the group's members with a token at t."""
    B, L = len(r), len(r[0])
    G = [[0.0] * L for _ in range(B)]
    W = [[0.0] * L for _ in range(B)]
    for i in range(B):
        pos = [t for t in range(L) if m[i][t]]
        for t in range(L):
            G[i][t] = sum(r[i][s] for s in pos if s >= t)
            W[i][t] = sum((1 - 2 * math.exp(lp[i][s]) + spi2[i][s]) * (rho[i][s] ** 2 if rho else 1.0)
                          for s in pos if s <= t)
    base = [[0.0] * L for _ in range(B)]
    for g in set(ids):
        mem = [i for i in range(B) if ids[i] == g]
        if len(mem) == 1:
            continue                                   # a singleton: no baseline
        for t in range(L):
            num = sum(G[i][t] * W[i][t] for i in mem if m[i][t])
            den = sum(W[i][t] for i in mem if m[i][t])
            for i in mem:
                base[i][t] = num / (den + eps)
        if zero_tail:
            n = sorted(((sum(m[i]), i) for i in mem), reverse=True)
            if n[0][0] > n[1][0]:                      # one longest response: past the second-longest
                for t in range(int(n[1][0]), L):       # length it is alone, keep its return
                    base[n[0][1]][t] = 0.0
    adv = [[G[i][t] - base[i][t] if m[i][t] else 0.0 for t in range(L)] for i in range(B)]
    ret = [[G[i][t] if m[i][t] else 0.0 for t in range(L)] for i in range(B)]
    return adv, ret


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("with_is", [False, True])
@pytest.mark.parametrize("zero_tail", [True, False])
def test_optimal_token_baseline(holes, with_is, zero_tail):
    for seed in range(3):
        r, m, gid, lp, spi2, rho = token_batch(seed, holes=holes)
        want_a, want_r = ref_otb(r.tolist(), m.tolist(), gid.tolist(), lp.tolist(), spi2.tolist(),
                                 rho.tolist() if with_is else None, zero_tail)
        kw = dict(token_level_rewards=r, response_mask=m, group_index=gid, old_log_probs=lp, sum_pi_squared=spi2,
                  rollout_is_weights=rho if with_is else None)
        if zero_tail:   # verl's default, what compute_advantages gives
            a, ret = algo.compute_advantages("optimal_token_baseline", **kw)
        else:
            a, ret = algo.get_estimator("optimal_token_baseline").fn(handle_zero_tail=False, dp_group=None, **kw)
        torch.testing.assert_close(a, T(want_a), atol=1e-9, rtol=0)
        torch.testing.assert_close(ret, T(want_r), atol=1e-9, rtol=0)


@pytest.mark.parametrize("with_is", [False, True])
def test_tir_optimal_token_baseline_counts_response_tokens_only(with_is):
    """The multi-turn variant: the loop reference run on each row's response tokens moved to the
    front (k-th response token against the group's k-th), mapped back to their positions; without
    masked tokens inside responses it is optimal_token_baseline itself."""
    for seed in range(3):
        r, m, gid, lp, spi2, rho = token_batch(seed, holes=True)
        B, L = m.shape
        pos = [[t for t in range(L) if m[i, t]] for i in range(B)]
        pack = lambda x: [[float(x[i, t]) for t in pos[i]] + [0.0] * (L - len(pos[i])) for i in range(B)]  # noqa: E731
        cm = [[1.0] * len(pos[i]) + [0.0] * (L - len(pos[i])) for i in range(B)]
        ca, cr = ref_otb(pack(r), cm, gid.tolist(), pack(lp), pack(spi2), pack(rho) if with_is else None)
        want_a, want_r = torch.zeros(B, L, dtype=DT), torch.zeros(B, L, dtype=DT)
        for i in range(B):
            for k, t in enumerate(pos[i]):
                want_a[i, t], want_r[i, t] = ca[i][k], cr[i][k]
        kw = dict(token_level_rewards=r, response_mask=m, group_index=gid, old_log_probs=lp, sum_pi_squared=spi2,
                  rollout_is_weights=rho if with_is else None)
        a, ret = algo.compute_advantages("tir_optimal_token_baseline", **kw)
        torch.testing.assert_close(a, want_a, atol=1e-9, rtol=0)
        torch.testing.assert_close(ret, want_r, atol=1e-9, rtol=0)
        r2, m2, gid2, lp2, spi22, rho2 = token_batch(seed, holes=False)
        kw2 = dict(token_level_rewards=r2, response_mask=m2, group_index=gid2, old_log_probs=lp2, sum_pi_squared=spi22)
        a1, _ = algo.compute_advantages("tir_optimal_token_baseline", **kw2)
        a2, _ = algo.compute_advantages("optimal_token_baseline", **kw2)
        assert torch.equal(a1, a2)


def test_optimal_token_baseline_zero_tail_and_singleton():
    r, m, gid, lp, spi2, _ = token_batch(4)
    kw = dict(token_level_rewards=r, response_mask=m, group_index=gid, old_log_probs=lp, sum_pi_squared=spi2)
    a, ret = algo.compute_advantages("optimal_token_baseline", **kw)
    a0, _ = algo.get_estimator("optimal_token_baseline").fn(handle_zero_tail=False, dp_group=None, **kw)
    ids = gid.tolist()
    lengths = m.sum(-1).tolist()
    alone = {}                       # a group's unique longest response -> the second-longest length
    for g in set(ids):
        mem = sorted((lengths[i], i) for i in range(len(ids)) if ids[i] == g)
        if len(mem) > 1 and mem[-1][0] > mem[-2][0]:
            alone[mem[-1][1]] = int(mem[-2][0])
    assert any(ids[i] == 100 for i in alone) and all(ids[i] != 103 for i in alone)   # group 0 unique, 3 tied
    for i, second in alone.items():
        # the unique longest response keeps its reward-to-go past the second-longest length ...
        torch.testing.assert_close(a[i, second:], ret[i, second:], atol=0, rtol=0)
        torch.testing.assert_close(a[i, :second], a0[i, :second], atol=0, rtol=0)
        # ... where without zero-tail its own return (W/(W+eps) ~ 1) cancels it
        assert a0[i, second:].abs().max().item() < 1e-6
    assert (a - a0).abs().max().item() > 0.1
    # a tied longest (group 3) and every other sample: the same either way
    others = [i for i in range(len(ids)) if i not in alone]
    torch.testing.assert_close(a[others], a0[others], atol=0, rtol=0)
    # the singleton (group 2) keeps its reward-to-go
    single = ids.index(102)
    torch.testing.assert_close(a[single], ret[single], atol=0, rtol=0)
    assert (a[m == 0] == 0).all() and (ret[m == 0] == 0).all()


def ref_gdpo(components, weights, m, ids, norm=True):
    """GDPO from its formula: per component, GRPO within each group (a singleton: mean 0, std 1),
    the weighted sum, then whitened over the batch's response tokens."""
    B = len(ids)
    total = [0.0] * B
    for comp, w in zip(components, weights):
        by = ref_group(comp, ids)
        for i in range(B):
            members = by[ids[i]]
            mean, std = (statistics.mean(members), statistics.stdev(members)) if len(members) > 1 else (0.0, 1.0)
            total[i] += w * ((comp[i] - mean) / (std + 1e-6) if norm else comp[i] - mean)
    return ref_whiten(broadcast(total, m), m)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("weights", [None, [1.0, 0.5, 2.0]])
def test_gdpo(norm, weights):
    r, m, gid = outcome_batch(11)
    rnd = random.Random(3)
    B = len(gid)
    comps = {"accuracy": [rnd.choice([0.0, 1.0]) for _ in range(B)],
             "format": [rnd.choice([0.0, 0.5, 1.0]) for _ in range(B)],
             "length": [rnd.random() * 10 for _ in range(B)]}
    want = ref_gdpo(list(comps.values()), weights or [1.0] * 3, m.tolist(), gid.tolist(), norm)
    a, ret = algo.compute_advantages("gdpo", token_level_rewards=r, response_mask=m, group_index=gid,
                                     norm_adv_by_std_in_grpo=norm, reward_weights=weights,
                                     reward_components={k: T(v) for k, v in comps.items()})
    torch.testing.assert_close(a, T(want), atol=1e-9, rtol=0)
    torch.testing.assert_close(ret, a)
    # decoupled: not GRPO of the summed reward (whitened), which the large "length" component would dominate
    summed = [sum(w * c[i] for w, c in zip(weights or [1.0] * 3, comps.values())) for i in range(B)]
    grpo_sum = T(ref_gdpo([summed], [1.0], m.tolist(), gid.tolist(), norm))
    if norm:
        assert (a - grpo_sum).abs().max().item() > 1e-3
    else:   # without the std, centring is linear: whitened Dr.GRPO of the weighted sum
        torch.testing.assert_close(a, grpo_sum, atol=1e-9, rtol=0)


def test_estimators_name_their_missing_inputs():
    r, m, gid, lp, spi2, _ = token_batch(0)
    kw = dict(token_level_rewards=r, response_mask=m, group_index=gid)
    with pytest.raises(ValueError, match="'optimal_token_baseline' needs old_log_probs"):
        algo.compute_advantages("optimal_token_baseline", sum_pi_squared=spi2, **kw)
    with pytest.raises(ValueError, match="'optimal_token_baseline' needs sum_pi_squared: per-token sum over the vocabulary"):
        algo.compute_advantages("optimal_token_baseline", old_log_probs=lp, **kw)
    with pytest.raises(ValueError, match="sum_pi_squared has shape \\(15, 10\\), the response mask \\(15, 11\\)"):
        algo.compute_advantages("optimal_token_baseline", old_log_probs=lp, sum_pi_squared=spi2[:, :-1], **kw)
    with pytest.raises(ValueError, match="'gdpo' needs reward_components: .*algorithm.gdpo_reward_keys"):
        algo.compute_advantages("gdpo", **kw)
    comps = {"a": torch.zeros(len(gid)), "b": torch.ones(len(gid))}
    with pytest.raises(ValueError, match=r"gdpo: 1 reward weights \(algorithm.gdpo_reward_weights\) for 2 reward components \(a, b\)"):
        algo.compute_advantages("gdpo", reward_components=comps, reward_weights=[1.0], **kw)
    with pytest.raises(ValueError, match=r"reward component 'a' has shape \(3,\), expected \(15,\)"):
        algo.compute_advantages("gdpo", reward_components={"a": torch.zeros(3)}, **kw)
    with pytest.raises(ValueError, match="unknown estimator inputs"):
        algo.register_estimator("test_only_bad_inputs", inputs=("values_of_something",))
    assert algo.get_estimator("optimal_token_baseline").inputs == ("old_log_probs", "sum_pi_squared")
    assert algo.get_estimator("gdpo").group_relative and algo.get_estimator("gae").inputs == ()
