"""KL estimators, KL controllers, PPO losses and loss aggregation against scalar float64 references."""
import math

import pytest
import torch

from megappo import algo

DT = torch.float64


def rand_logps(seed, B=5, L=11):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=DT) * 3
    ref = -torch.rand(B, L, generator=g, dtype=DT) * 3
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    lengths[0] = 0
    lengths[1] = 1
    mask = (torch.arange(L)[None, :] < lengths[:, None]).to(DT)
    return logp, ref, mask


# ------------------------------------------------------------------------------------------
# kl_penalty: values and gradients
# ------------------------------------------------------------------------------------------

def kl_value(kind, lp, rp):
    d = lp - rp
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return abs(d)
    if kind in ("mse", "k2"):
        return 0.5 * d * d
    x = min(max(rp - lp, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


def kl_grad(kind, lp, rp):
    """d estimator / d logprob."""
    d = lp - rp
    if kind in ("kl", "k1"):
        return 1.0
    if kind == "abs":
        return math.copysign(1.0, d) if d != 0 else 0.0
    if kind in ("mse", "k2"):
        return d
    x = rp - lp
    if not -20 < x < 20:
        return 0.0
    f = math.exp(x) - x - 1.0
    return 0.0 if not -10 < f < 10 else 1.0 - math.exp(x)


BASE_KINDS = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


@pytest.mark.parametrize("kind", BASE_KINDS)
def test_kl_values_and_gradients(kind):
    logp, ref, _ = rand_logps(0)
    # include the clamps of low_var_kl: a very unlikely token under the policy
    logp[0, 0], ref[0, 0] = -30.0, -1.0
    logp[0, 1], ref[0, 1] = -1.0, -30.0
    lp = logp.clone().requires_grad_(True)
    out = algo.kl_penalty(lp, ref, kind)
    out.sum().backward()
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            a, b = logp[i, t].item(), ref[i, t].item()
            assert out[i, t].item() == pytest.approx(kl_value(kind, a, b), abs=1e-12)
            assert lp.grad[i, t].item() == pytest.approx(kl_grad(kind, a, b), abs=1e-12)


@pytest.mark.parametrize("kind", [k + "+" for k in BASE_KINDS])
def test_straight_through_variants(kind):
    logp, ref, _ = rand_logps(1)
    lp = logp.clone().requires_grad_(True)
    out = algo.kl_penalty(lp, ref, kind)
    out.sum().backward()
    base = kind[:-1]
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            a, b = logp[i, t].item(), ref[i, t].item()
            assert out[i, t].item() == pytest.approx(kl_value(base, a, b), abs=1e-12)   # forward: named estimator
            assert lp.grad[i, t].item() == pytest.approx(a - b, abs=1e-12)               # backward: k2's gradient


def test_kl_kind_errors():
    x = torch.zeros(2, 2)
    with pytest.raises(NotImplementedError, match="full vocabulary"):
        algo.kl_penalty(x, x, "full")
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; supported: kl, k1"):
        algo.kl_penalty(x, x, "k4")
    with pytest.raises(ValueError, match="unknown KL estimator 'full\\+'"):
        algo.kl_penalty(x, x, "full+")
    assert "low_var_kl+" in algo.list_kl_kinds() and "full" in algo.list_kl_kinds()
    assert "full+" not in algo.list_kl_kinds()


# ------------------------------------------------------------------------------------------
# controllers and KL in reward
# ------------------------------------------------------------------------------------------

def test_adaptive_controller_follows_its_formula():
    c = algo.AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=1000)
    value = 0.2
    for kl, n in [(0.3, 64), (0.05, 64), (0.1, 10), (10.0, 500), (0.0, 500)]:
        c.update(kl, n)
        err = min(max(kl / 0.1 - 1, -0.2), 0.2)
        value *= 1 + err * n / 1000
        assert c.value == pytest.approx(value, rel=1e-12)
    f = algo.FixedKLController(0.05)
    f.update(3.0, 100)
    assert f.value == 0.05
    with pytest.raises(ValueError, match="target_kl > 0"):
        algo.AdaptiveKLController(0.1, 0.0, 10)


def test_make_kl_controller():
    c = algo.make_kl_controller({"type": "adaptive", "kl_coef": 0.3, "target_kl": 6.0, "horizon": 100})
    assert isinstance(c, algo.AdaptiveKLController) and c.value == 0.3 and c.target == 6.0
    from megappo.config import load_config
    c = algo.make_kl_controller(load_config().algorithm.kl_ctrl)
    assert type(c) is algo.FixedKLController and c.value == 0.001
    with pytest.raises(ValueError, match="unknown kl_ctrl.type 'pid'"):
        algo.make_kl_controller({"type": "pid", "kl_coef": 0.1})
    s = c.state_dict()
    c2 = algo.FixedKLController(9.0)
    c2.load_state_dict(s)
    assert c2.value == c.value


@pytest.mark.parametrize("kind", ["kl", "low_var_kl", "k3+"])
def test_apply_kl_in_reward(kind):
    logp, ref, mask = rand_logps(2)
    scores = torch.randn_like(logp) * mask
    ctrl = algo.AdaptiveKLController(0.1, target_kl=0.01, horizon=50)
    rewards, metrics = algo.apply_kl_in_reward(scores, logp, ref, mask, ctrl, kind)
    base = kind.rstrip("+")
    per_seq = []
    for i in range(logp.shape[0]):
        kls = []
        for t in range(logp.shape[1]):
            k = kl_value(base, logp[i, t].item(), ref[i, t].item()) if mask[i, t] else 0.0
            assert rewards[i, t].item() == pytest.approx(scores[i, t].item() - 0.1 * k, abs=1e-12)
            if mask[i, t]:
                kls.append(k)
        per_seq.append(sum(kls) / len(kls) if kls else 0.0)
    batch_kl = sum(per_seq) / len(per_seq)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(batch_kl, abs=1e-12)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    err = min(max(batch_kl / 0.01 - 1, -0.2), 0.2)
    assert ctrl.value == pytest.approx(0.1 * (1 + err * logp.shape[0] / 50), rel=1e-12)


# ------------------------------------------------------------------------------------------
# aggregation
# ------------------------------------------------------------------------------------------

def agg_ref(loss, mask, mode, norm_factor=None):
    B, L = len(loss), len(loss[0])
    rows = [[loss[i][t] for t in range(L) if mask[i][t]] for i in range(B)]
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        toks = [x for r in rows for x in r]
        return sum(toks) / len(toks)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / len(nonempty)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    return sum(sum(r) for r in nonempty) / (len(nonempty) * (norm_factor or L))


MODES = list(algo.LOSS_AGG_MODES)


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_modes(mode):
    _, _, mask = rand_logps(3)
    loss = torch.randn(mask.shape, dtype=DT)
    got = algo.agg_loss(loss, mask, mode)
    assert got.item() == pytest.approx(agg_ref(loss.tolist(), mask.tolist(), mode), abs=1e-12)
    if mode == "seq-mean-token-sum-norm":
        got = algo.agg_loss(loss, mask, mode, norm_factor=100)
        assert got.item() == pytest.approx(agg_ref(loss.tolist(), mask.tolist(), mode, 100), abs=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("splits", [[5], [2, 3], [1, 1, 1, 2]])
def test_micro_batches_with_global_normalisers_add_up(mode, splits):
    _, _, mask = rand_logps(4)
    w = torch.randn(mask.shape, dtype=DT, requires_grad=True)
    full = algo.agg_loss(w * 1.5, mask, mode, norm_factor=11)
    g_full, = torch.autograd.grad(full, w)
    n_tok = mask.sum()
    n_seq = (mask.sum(-1) > 0).sum()
    total, start = 0.0, 0
    for n in splits:
        sl = slice(start, start + n)
        total = total + algo.agg_loss(w[sl] * 1.5, mask[sl], mode, global_tokens=n_tok, global_seqs=n_seq,
                                      norm_factor=11)
        start += n
    g_parts, = torch.autograd.grad(total, w)
    assert total.item() == pytest.approx(full.item(), abs=1e-12)
    torch.testing.assert_close(g_parts, g_full, atol=1e-12, rtol=0)


def test_agg_loss_unknown_mode():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'; supported: token-mean"):
        algo.agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "mean")


# ------------------------------------------------------------------------------------------
# policy and value losses
# ------------------------------------------------------------------------------------------

def pg_token_ref(old, new, adv, lo, hi, c):
    ratio = math.exp(min(max(new - old, -20.0), 20.0))
    l1 = max(-adv * ratio, -adv * min(max(ratio, 1 - lo), 1 + hi))
    clipped = -adv * min(max(ratio, 1 - lo), 1 + hi) > -adv * ratio
    if adv < 0:
        lower = l1 > -adv * c
        return min(l1, -adv * c), clipped, lower
    return l1, clipped, False


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lo, hi, c", [(0.2, 0.2, 3.0), (0.2, 0.28, 1.5), (0.1, 0.3, 10.0)])
def test_policy_loss(mode, lo, hi, c):
    old, _, mask = rand_logps(5, B=6, L=9)
    g = torch.Generator().manual_seed(6)
    new = old + torch.randn(old.shape, generator=g, dtype=DT) * 0.8   # large ratios hit every branch
    adv = torch.randn(old.shape, generator=g, dtype=DT) * 2
    lp = new.clone().requires_grad_(True)
    loss, metrics = algo.policy_loss(old, lp, adv, mask, clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=c,
                                     loss_agg_mode=mode)
    toks, clip, lower = [], [], []
    rows = []
    for i in range(old.shape[0]):
        row = []
        for t in range(old.shape[1]):
            l, cl, lw = pg_token_ref(old[i, t].item(), new[i, t].item(), adv[i, t].item(), lo, hi, c)
            row.append(l)
            if mask[i, t]:
                clip.append(cl)
                lower.append(lw)
                toks.append(new[i, t].item() - old[i, t].item())
        rows.append(row)
    assert loss.item() == pytest.approx(agg_ref(rows, mask.tolist(), mode), abs=1e-12)
    assert metrics["pg_clipfrac"].item() == pytest.approx(sum(clip) / len(clip), abs=1e-12)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(sum(lower) / len(lower), abs=1e-12)
    assert metrics["ppo_kl"].item() == pytest.approx(-sum(toks) / len(toks), abs=1e-12)
    assert 0 < sum(clip) < len(clip) and (c > 5 or sum(lower) > 0)  # the branches were exercised
    # gradient: zero where the clipped or dual-clip branch is active, -A * ratio / N elsewhere
    loss.backward()
    if mode == "token-mean":
        n = mask.sum().item()
        for i in range(old.shape[0]):
            for t in range(old.shape[1]):
                if not mask[i, t]:
                    assert lp.grad[i, t].item() == 0.0
                    continue
                a, o, nw = adv[i, t].item(), old[i, t].item(), new[i, t].item()
                ratio = math.exp(nw - o)
                l_un, l_cl = -a * ratio, -a * min(max(ratio, 1 - lo), 1 + hi)
                active_unclipped = l_un >= l_cl and not (a < 0 and max(l_un, l_cl) > -a * c)
                want = -a * ratio / n if active_unclipped else 0.0
                assert lp.grad[i, t].item() == pytest.approx(want, abs=1e-12)


def test_policy_loss_rejects_bad_dual_clip():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        algo.policy_loss(x, x, x, torch.ones(1, 1), clip_ratio_c=1.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_value_loss(mode):
    _, _, mask = rand_logps(7)
    g = torch.Generator().manual_seed(8)
    values = torch.randn(mask.shape, generator=g, dtype=DT)
    vpreds = values + torch.randn(mask.shape, generator=g, dtype=DT)
    returns = torch.randn(mask.shape, generator=g, dtype=DT)
    loss, clipfrac = algo.value_loss(vpreds, returns, values, mask, cliprange_value=0.5, loss_agg_mode=mode)
    rows, fr = [], []
    for i in range(mask.shape[0]):
        row = []
        for t in range(mask.shape[1]):
            v, p, R = values[i, t].item(), vpreds[i, t].item(), returns[i, t].item()
            pc = min(max(p, v - 0.5), v + 0.5)
            row.append(max((p - R) ** 2, (pc - R) ** 2))
            if mask[i, t]:
                fr.append((pc - R) ** 2 > (p - R) ** 2)
        rows.append(row)
    assert loss.item() == pytest.approx(0.5 * agg_ref(rows, mask.tolist(), mode), abs=1e-12)
    assert clipfrac.item() == pytest.approx(sum(fr) / len(fr), abs=1e-12)
    assert 0 < sum(fr) < len(fr)



def test_value_clipfrac_counts_only_clipped_tokens():
    """float32 values and predictions that moved less than the clip range: nothing is clipped, so
    the clip fraction is exactly 0 and the loss is the plain squared error (round-off in the clip
    once counted ~10% of such tokens as clipped)."""
    g = torch.Generator().manual_seed(3)
    values = 0.05 + torch.rand(64, 16, generator=g) * 0.1
    returns = torch.rand(64, 16, generator=g)
    vpreds = (torch.rand(64, 16, generator=g) - 0.5) * 2e-3     # moved by < 0.15, inside the clip 0.2
    mask = torch.ones(64, 16)
    loss, clipfrac = algo.value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    assert clipfrac.item() == 0.0
    assert loss.item() == pytest.approx(0.5 * (vpreds - returns).square().mean().item(), rel=1e-6)
    # rows moved past the clip towards their return (the clip holds them back) are the clipped ones
    far = vpreds.clone()
    far[:8] = values[:8] + 0.5
    far_returns = returns.clone()
    far_returns[:8] = values[:8] + 1.0
    _, clipfrac = algo.value_loss(far, far_returns, values, mask, cliprange_value=0.2)
    assert clipfrac.item() == pytest.approx(8 / 64)

def test_entropy_from_logits():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 4, 17, generator=g, dtype=DT) * 4
    got = algo.entropy_from_logits(logits)
    for idx in [(0, 0), (1, 2), (2, 3)]:
        z = logits[idx].tolist()
        mx = max(z)
        ps = [math.exp(x - mx) for x in z]
        s = sum(ps)
        want = -sum(p / s * math.log(p / s) for p in ps)
        assert got[idx].item() == pytest.approx(want, abs=1e-12)
    # extreme logits stay finite
    assert torch.isfinite(algo.entropy_from_logits(torch.tensor([[1e4, -1e4, 0.0]]))).all()
