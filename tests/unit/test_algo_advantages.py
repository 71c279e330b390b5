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
    (before rpp_baseline's batch whitening; gpg scales it by alpha), as in verl; Pass@k refuses it."""
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
