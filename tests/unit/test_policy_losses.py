"""Policy losses by name (actor.policy_loss.loss_mode): each against a float64 loop over tokens
written from its paper's formula (value and gradient), each adding up over micro-batches and
data-parallel ranks with the mini-batch's global counts."""
import math

import pytest
import torch

from megappo import algo

EPS_LO, EPS_HI, C = 0.2, 0.28, 3.0
TAU_POS, TAU_NEG = 1.0, 1.05
DRO_BETA = 0.3
# DPPO's thresholds (clip_ratio_low/high) and IS cap (clip_ratio_c), small enough that the random
# data below has tokens outside each trust region, on both sides, and truncated ratios
DPPO = {"dppo_tv": dict(clip_ratio_low=0.05, clip_ratio_high=0.08, clip_ratio_c=1.3),
        "dppo_kl": dict(clip_ratio_low=0.005, clip_ratio_high=0.01, clip_ratio_c=1.3)}


def _data(seed=0, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # log-probs of a distribution are <= 0 (DPPO reads exp(logp) as the token's probability)
    lp = torch.clamp(old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4, max=-1e-3)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv[1] = adv[1, 0]                      # one sequence-level advantage
    mask = (torch.rand(B, T, generator=g) > 0.25).to(torch.float64)
    mask[2] = 0                             # an empty row (DP padding): counts for nothing
    mask[0, 0] = 1
    return old, lp, adv, mask


def _tokens(mask):
    return [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t] > 0]


def _rows(mask):
    return [i for i in range(mask.shape[0]) if mask[i].sum() > 0]


def ref_vanilla(old, lp, adv, mask):
    total = 0.0
    for i, t in _tokens(mask):
        r = torch.exp(torch.clamp(lp[i, t] - old[i, t], -20, 20))
        l1 = torch.maximum(-adv[i, t] * r, -adv[i, t] * torch.clamp(r, 1 - EPS_LO, 1 + EPS_HI))
        total = total + (torch.minimum(l1, -adv[i, t] * C) if adv[i, t] < 0 else l1)
    return total / len(_tokens(mask))


def ref_gspo(old, lp, adv, mask):
    total = 0.0
    for i in _rows(mask):
        ts = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
        log_si = sum(lp[i, t] - old[i, t] for t in ts) / len(ts)
        row = 0.0
        for t in ts:
            s = torch.exp(torch.clamp(log_si.detach() + lp[i, t] - lp[i, t].detach(), max=10.0))
            row = row + torch.maximum(-adv[i, t] * s, -adv[i, t] * torch.clamp(s, 1 - EPS_LO, 1 + EPS_HI))
        total = total + row / len(ts)
    return total / len(_rows(mask))


def ref_sapo(old, lp, adv, mask):
    total = 0.0
    for i in _rows(mask):
        ts = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
        row = 0.0
        for t in ts:
            r = torch.exp(torch.clamp(lp[i, t] - old[i, t], -20, 20))
            tau = TAU_POS if adv[i, t] > 0 else TAU_NEG
            row = row - adv[i, t] * torch.sigmoid(tau * (r - 1)) * 4 / tau
        total = total + row / len(ts)
    return total / len(_rows(mask))


def ref_gpg(old, lp, adv, mask):
    return sum(-adv[i, t] * lp[i, t] for i, t in _tokens(mask)) / len(_tokens(mask))


def ref_cispo(old, lp, adv, mask):
    total = 0.0
    for i, t in _tokens(mask):
        w = min(max(math.exp(float((lp[i, t] - old[i, t]).detach())), 1 - EPS_LO), 1 + EPS_HI)   # a number: no gradient
        total = total - w * adv[i, t] * lp[i, t]
    return total / len(_tokens(mask))


def ref_geo_mean(old, lp, adv, mask):
    total = 0.0
    for i in _rows(mask):
        ts = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
        ds = []
        for t in ts:
            d = lp[i, t] - old[i, t]
            lo_hi = torch.clamp(d, -EPS_LO, EPS_HI)
            # clip only where it lowers the objective: a positive advantage caps the increase,
            # a negative one caps the decrease
            ds.append(torch.minimum(d, lo_hi) if adv[i, t] > 0 else torch.maximum(d, lo_hi) if adv[i, t] < 0 else d * 0)
        ratio = torch.exp(sum(ds) / len(ts))
        total = total - sum(adv[i, t] for t in ts) / len(ts) * ratio
    return total / len(_rows(mask))


def dppo_keeps(mode, old_lp, lp, a, lo, hi):
    """DPPO's trust region for one token (floats): is its update inside?"""
    p_old, p = math.exp(old_lp), math.exp(lp)
    if mode == "dppo_tv":
        # binary total variation of the sampled token: |p - p_old|, bounded on the side A pushes
        return p - p_old <= hi if a > 0 else p - p_old >= -lo
    kl = p_old * math.log(p_old / p) + (1 - p_old) * math.log((1 - p_old) / (1 - p))
    if a > 0:      # a raise is what A > 0 asks for: bounded; a drop is not
        return p <= p_old or kl <= hi
    return p >= p_old or kl <= lo


def _ref_dppo(mode, old, lp, adv, mask, lo, hi, cap):
    total = 0.0
    for i, t in _tokens(mask):
        if dppo_keeps(mode, float(old[i, t]), float(lp[i, t].detach()), float(adv[i, t]), lo, hi):
            w = min(math.exp(float((lp[i, t] - old[i, t]).detach())), cap)   # a number: no gradient
            total = total - adv[i, t] * w * lp[i, t]
    return total / len(_tokens(mask))


def ref_dppo_tv(old, lp, adv, mask):
    k = DPPO["dppo_tv"]
    return _ref_dppo("dppo_tv", old, lp, adv, mask, k["clip_ratio_low"], k["clip_ratio_high"], k["clip_ratio_c"])


def ref_dppo_kl(old, lp, adv, mask):
    k = DPPO["dppo_kl"]
    return _ref_dppo("dppo_kl", old, lp, adv, mask, k["clip_ratio_low"], k["clip_ratio_high"], k["clip_ratio_c"])


def ref_dro(old, lp, adv, mask):
    total = 0.0
    for i, t in _tokens(mask):
        total = total - (adv[i, t] * lp[i, t] - DRO_BETA / 2 * (lp[i, t] - old[i, t]) ** 2)
    return total / len(_tokens(mask))


# bypass mode's REINFORCE (rollout_correction.loss_type=reinforce): sequence-level weights from the
# current policy, a cap small enough that some sequences of the data below are truncated
REINFORCE = dict(rollout_is="sequence", rollout_is_threshold=1.3)


def ref_reinforce(old, lp, adv, mask):
    """-A w logp, token-mean; w a number (no gradient): min(prod_t pi / pi_old, C) of the sequence."""
    total = 0.0
    for i in _rows(mask):
        ts = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
        w = min(math.exp(sum(float((lp[i, t] - old[i, t]).detach()) for t in ts)), REINFORCE["rollout_is_threshold"])
        total = total - sum(adv[i, t] * w * lp[i, t] for t in ts)
    return total / len(_tokens(mask))

# Clip-Cov / KL-Cov: ratios large enough that the small test batches select several tokens
COV = {"clip_cov": dict(clip_cov_ratio=0.15, clip_cov_lb=0.0, clip_cov_ub=5.0), "kl_cov": dict(kl_cov_ratio=0.15)}
PPO_KL_COEF = 0.5
KEY_SEED = 11


def ref_cov_select(mode, old, lp, adv, mask):
    """The paper's token choice, as loops over the whole batch: cov = (A - mean A)(logp - mean logp);
    Clip-Cov: of the tokens with lb < cov < ub that PPO's clip leaves alone, the k with the smallest
    key (a random draw); KL-Cov: the k with the largest cov (ties: smaller key)."""
    toks = _tokens(mask)
    n = len(toks)
    keys = algo.token_keys(torch.arange(mask.shape[0]), mask.shape[1], KEY_SEED)
    a_mean = sum(float(adv[i, t]) for i, t in toks) / n
    l_mean = sum(float(lp[i, t]) for i, t in toks) / n
    cov = {(i, t): (float(adv[i, t]) - a_mean) * (float(lp[i, t]) - l_mean) for i, t in toks}
    sel = torch.zeros(mask.shape, dtype=torch.bool)
    if mode == "clip_cov":
        c = COV[mode]
        cand = []
        for i, t in toks:
            r, a = math.exp(float(lp[i, t] - old[i, t])), float(adv[i, t])
            clipped = -a * min(max(r, 1 - EPS_LO), 1 + EPS_HI) > -a * r
            if c["clip_cov_lb"] < cov[i, t] < c["clip_cov_ub"] and not clipped:
                cand.append((i, t))
        chosen = sorted(cand, key=lambda it: float(keys[it]))[:max(int(c["clip_cov_ratio"] * n), 1)]
    else:
        k = max(1, int(n * COV[mode]["kl_cov_ratio"]))
        chosen = sorted(toks, key=lambda it: (-cov[it], float(keys[it])))[:k]
    for it in chosen:
        sel[it] = True
    return sel


def ref_clip_cov(old, lp, adv, mask):
    sel = ref_cov_select("clip_cov", old, lp.detach(), adv, mask)
    total = 0.0
    for i, t in _tokens(mask):
        if sel[i, t]:
            continue          # taken out: no loss, no gradient
        r = torch.exp(lp[i, t] - old[i, t])
        total = total + torch.maximum(-adv[i, t] * r, -adv[i, t] * torch.clamp(r, 1 - EPS_LO, 1 + EPS_HI))
    return total / len(_tokens(mask))


def ref_kl_cov(old, lp, adv, mask):
    sel = ref_cov_select("kl_cov", old, lp.detach(), adv, mask)
    total = 0.0
    for i, t in _tokens(mask):
        total = total - adv[i, t] * torch.exp(lp[i, t] - old[i, t])
        if sel[i, t]:
            total = total + PPO_KL_COEF * torch.abs(lp[i, t] - old[i, t])
    return total / len(_tokens(mask))


REFS = {"vanilla": ref_vanilla, "gspo": ref_gspo, "sapo": ref_sapo, "gpg": ref_gpg, "cispo": ref_cispo,
        "geo_mean": ref_geo_mean, "dppo_tv": ref_dppo_tv, "dppo_kl": ref_dppo_kl, "dro": ref_dro,
        "clip_cov": ref_clip_cov, "kl_cov": ref_kl_cov, "reinforce": ref_reinforce}
KW = dict(clip_ratio_low=EPS_LO, clip_ratio_high=EPS_HI, clip_ratio_c=C, loss_agg_mode="token-mean",
          tau_pos=TAU_POS, tau_neg=TAU_NEG, dro_beta=DRO_BETA, ppo_kl_coef=PPO_KL_COEF)


def kw(mode, data=None):
    """The loss's keyword arguments; for Clip-Cov/KL-Cov the batch's selection (from the loop),
    which needs the batch (old, lp, adv, mask)."""
    out = {**KW, **DPPO.get(mode, {}), **(REINFORCE if mode == "reinforce" else {})}
    if mode in algo.COV_LOSSES:
        old, lp, adv, mask = data
        out["cov_selected"] = ref_cov_select(mode, old, lp.detach(), adv, mask)
    return out


def test_every_registered_loss_has_a_reference_here():
    assert sorted(REFS) == algo.list_policy_losses()


@pytest.mark.parametrize("mode", sorted(REFS))
@pytest.mark.parametrize("seed", [0, 1])
def test_value_and_gradient_equal_the_loop_reference(mode, seed):
    old, lp, adv, mask = _data(seed)
    a = lp.clone().requires_grad_(True)
    loss, metrics = algo.compute_policy_loss(mode, old, a, adv, mask, **kw(mode, (old, lp, adv, mask)))
    ga, = torch.autograd.grad(loss, a)
    b = lp.clone().requires_grad_(True)
    ref = REFS[mode](old, b, adv, mask)
    gb, = torch.autograd.grad(ref, b)
    torch.testing.assert_close(loss, ref.reshape(()), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ga, gb, atol=1e-12, rtol=1e-12)
    assert (ga[mask == 0] == 0).all()
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    d = (old - lp).abs() if mode == "kl_cov" else old - lp   # KL-Cov logs the mean |log-ratio| (verl's)
    assert metrics["ppo_kl"].item() == pytest.approx(float((d * mask).sum() / mask.sum()), abs=1e-12)


@pytest.mark.parametrize("mode", sorted(REFS))
def test_losses_add_up_over_micro_batches_and_ranks(mode):
    """Three parts (micro-batches or DP ranks) with the mini-batch's global counts: the parts'
    losses add up to the whole batch's loss and so do their gradients."""
    old, lp, adv, mask = _data(3, B=9)
    whole = lp.clone().requires_grad_(True)
    k = kw(mode, (old, lp, adv, mask))   # Clip-Cov/KL-Cov: the whole batch's selection, given to each part
    loss, _ = algo.compute_policy_loss(mode, old, whole, adv, mask, **k)
    g_whole, = torch.autograd.grad(loss, whole)
    norm = dict(global_tokens=mask.sum(), global_seqs=(mask.sum(-1) > 0).sum().to(mask.dtype))
    part = lp.clone().requires_grad_(True)

    def part_kw(rows):
        return {**k, "cov_selected": k["cov_selected"][rows]} if "cov_selected" in k else k

    total = sum(algo.compute_policy_loss(mode, old[rows], part[rows], adv[rows], mask[rows], **part_kw(rows), **norm)[0]
                for rows in ([0, 4, 8], [1, 2, 3], [5, 6, 7]))
    g_parts, = torch.autograd.grad(total, part)
    torch.testing.assert_close(total, loss, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(g_parts, g_whole, atol=1e-12, rtol=1e-12)


def test_losses_differ_where_their_papers_say():
    """At r = 1 (on-policy) the ratio losses share PPO's gradient -A; CISPO, GPG, REINFORCE and DPPO
    differ from it by design only in what carries the gradient (logp directly; on-policy every token
    is inside DPPO's trust region and REINFORCE's weights are 1), DRO's penalty has no gradient at logp = old_logp, GSPO differs
    in the aggregation."""
    old, lp, adv, mask = _data(4)
    grads = {}
    for mode in REFS:
        x = old.clone().requires_grad_(True)   # on-policy: lp == old
        loss, m = algo.compute_policy_loss(mode, old, x, adv, mask, **kw(mode, (old, old, adv, mask)))
        grads[mode], = torch.autograd.grad(loss, x)
        assert (m["pg_clipfrac"].item() == 0) == (mode != "clip_cov") and m["ppo_kl"].item() == 0
    # KL-Cov's |logp - old_logp| has gradient +-coef at 0 on its tokens (torch: sign(0) = 0, none)
    for mode in ("cispo", "gpg", "dppo_tv", "dppo_kl", "dro", "kl_cov", "reinforce"):
        torch.testing.assert_close(grads[mode], grads["vanilla"], atol=1e-12, rtol=0)
    assert not torch.allclose(grads["gspo"], grads["vanilla"])   # seq-mean-token-mean vs token-mean
    # Clip-Cov: exactly its selected tokens lose the gradient
    sel = kw("clip_cov", (old, old, adv, mask))["cov_selected"]
    assert sel.any() and (grads["clip_cov"][sel] == 0).all()
    torch.testing.assert_close(grads["clip_cov"][~sel], grads["vanilla"][~sel], atol=1e-12, rtol=0)


@pytest.mark.parametrize("mode", algo.COV_LOSSES)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_cov_selection_equals_the_loop(mode, seed):
    """algo.clip_cov_selection / kl_cov_selection choose exactly the paper's tokens (the loop in
    ref_cov_select), a handful of them, all response tokens."""
    old, lp, adv, mask = _data(seed, B=8, T=9)
    keys = algo.token_keys(torch.arange(8), 9, KEY_SEED)
    if mode == "clip_cov":
        got = algo.clip_cov_selection(old, lp, adv, mask, keys, clip_ratio_low=EPS_LO, clip_ratio_high=EPS_HI,
                                      **COV[mode])
    else:
        got = algo.kl_cov_selection(lp, adv, mask, keys, **COV[mode])
    want = ref_cov_select(mode, old, lp, adv, mask)
    assert torch.equal(got, want)
    n = int(mask.sum())
    k = max(1, int(0.15 * n))
    assert (mode == "clip_cov" and 0 < int(got.sum()) <= k) or int(got.sum()) == k
    assert not (got & (mask == 0)).any()


def test_cov_losses_need_their_selection():
    old, lp, adv, mask = _data(0)
    for mode in algo.COV_LOSSES:
        with pytest.raises(ValueError, match=f"loss_mode {mode} needs cov_selected"):
            algo.compute_policy_loss(mode, old, lp, adv, mask)


def test_token_keys_are_per_sample_and_position():
    """The key of (sample, position) does not depend on which rows are asked for together (so a
    split batch draws the same tokens), differs with the seed, and looks uniform."""
    all_keys = algo.token_keys(torch.arange(64), 32, 5)
    some = algo.token_keys(torch.tensor([40, 3, 17]), 32, 5)
    assert torch.equal(some, all_keys[[40, 3, 17]])
    assert not torch.equal(algo.token_keys(torch.arange(64), 32, 6), all_keys)
    assert len(torch.unique(all_keys)) == all_keys.numel()
    assert 0 <= float(all_keys.min()) and float(all_keys.max()) < 1 and abs(float(all_keys.mean()) - 0.5) < 0.02


def test_unknown_loss_is_named():
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'; registered: cispo, clip_cov, dppo_kl, dppo_tv, dro, geo_mean, gpg, gspo, kl_cov"):
        algo.compute_policy_loss("ppo2", *(_data()[0:4]))
    with pytest.raises(ValueError, match="already registered"):
        algo.register_policy_loss("vanilla")(lambda *a, **k: None)


def test_the_config_sets_the_spec():
    from megappo.builders import loss_specs
    from megappo.config import load_config

    cfg = load_config(["actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "actor_rollout_ref.actor.tau_neg=2.0",
                       "actor_rollout_ref.actor.clip_ratio=0.1", "actor_rollout_ref.actor.clip_ratio_high=0.3"])
    policy, _ = loss_specs(cfg)
    assert (policy.loss_mode, policy.tau_pos, policy.tau_neg) == ("sapo", 1.0, 2.0)
    assert policy.loss_kwargs() == dict(clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=3.0,
                                        loss_agg_mode="token-mean", tau_pos=1.0, tau_neg=2.0, dro_beta=None,
                                        ppo_kl_coef=0.1, rollout_is=None, rollout_is_threshold=2.0)
    cfg = load_config(["actor_rollout_ref.actor.policy_loss.loss_mode=dro", "actor_rollout_ref.actor.policy_loss.dro_beta=0.05"])
    policy, _ = loss_specs(cfg)
    assert (policy.loss_mode, policy.loss_kwargs()["dro_beta"]) == ("dro", 0.05)
    p = "actor_rollout_ref.actor.policy_loss."
    cfg = load_config([p + "loss_mode=clip_cov", p + "clip_cov_ratio=0.01", p + "clip_cov_lb=0.5", p + "clip_cov_ub=2",
                       p + "kl_cov_ratio=0.02", p + "ppo_kl_coef=0.3"])
    policy, _ = loss_specs(cfg)
    assert policy.clip_cov_kwargs() == dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_cov_ratio=0.01,
                                            clip_cov_lb=0.5, clip_cov_ub=2.0)
    assert (policy.kl_cov_ratio, policy.loss_kwargs()["ppo_kl_coef"]) == (0.02, 0.3)
    # bypass mode's REINFORCE is the policy loss, with rollout_is as its weights
    rc = "algorithm.rollout_correction."
    cfg = load_config([rc + "bypass_mode=true", rc + "loss_type=reinforce", rc + "rollout_is=token",
                       rc + "rollout_is_threshold=1.5"])
    policy, _ = loss_specs(cfg)
    assert (policy.loss_mode, policy.rollout_is, policy.rollout_is_threshold) == ("reinforce", "token", 1.5)
    cfg = load_config([rc + "loss_type=reinforce", rc + "rollout_is=token"])   # no bypass: loss_mode as set
    assert loss_specs(cfg)[0].loss_mode == "vanilla"


# -- DPPO's trust region and DRO's penalty, by hand-built tokens ---------------------------------

# (p_old, p, A) per token, built around thresholds delta_low < delta_high so that a swapped pair, a
# flipped comparison or a mask on the wrong advantage sign moves a token across the boundary
HAND = [(0.5, 0.65, 1.0),    # 0: raise inside delta_high (but outside delta_low): kept
        (0.2, 0.7, 1.0),     # 1: raise beyond delta_high with A > 0: outside (ratio 3.5 > C, not "truncated")
        (0.5, 0.75, -1.0),   # 2: a raise beyond both deltas with A < 0 is not what A pushes for: kept
        (0.5, 0.35, -1.0),   # 3: drop beyond delta_low with A < 0: outside the region
        (0.5, 0.25, 1.0),    # 4: a drop beyond both deltas with A > 0: kept
        (0.02, 0.08, 1.0),   # 5: rare token, ratio 4 (PPO clips it), small change: kept, its weight
                             #    truncated; binary KL 0.034 (KL(p_old||p)), 0.053 the other way round
        (0.5, 0.42, -1.0)]   # 6: small drop with A < 0, inside delta_low: kept
OUTSIDE = {1, 3}
TRUNCATED = {5}
HAND_KW = {"dppo_tv": dict(clip_ratio_low=0.1, clip_ratio_high=0.2, clip_ratio_c=3.0),
           "dppo_kl": dict(clip_ratio_low=0.02, clip_ratio_high=0.05, clip_ratio_c=3.0)}


@pytest.mark.parametrize("mode", sorted(HAND_KW))
def test_dppo_masks_exactly_the_tokens_outside_its_trust_region(mode):
    old = torch.tensor([[math.log(q) for q, _, _ in HAND]], dtype=torch.float64)
    lp = torch.tensor([[math.log(p) for _, p, _ in HAND]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[a for _, _, a in HAND]], dtype=torch.float64)
    mask = torch.ones_like(adv)
    k = HAND_KW[mode]
    loss, m = algo.compute_policy_loss(mode, old, lp, adv, mask, **k)
    g, = torch.autograd.grad(loss, lp)
    assert {t for t in range(len(HAND)) if g[0, t] == 0} == OUTSIDE
    assert {t for t in range(len(HAND))
            if not dppo_keeps(mode, float(old[0, t]), float(lp[0, t].detach()), float(adv[0, t]), k["clip_ratio_low"],
                              k["clip_ratio_high"])} == OUTSIDE   # the reference agrees with the design
    assert m["pg_clipfrac"].item() == pytest.approx(len(OUTSIDE) / len(HAND), abs=1e-12)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(len(TRUNCATED) / len(HAND), abs=1e-12)
    # kept tokens: -A min(r, C) / N; the truncated one's weight is C, not r = 5
    for t in set(range(len(HAND))) - OUTSIDE:
        q, p, a = HAND[t]
        assert g[0, t].item() == pytest.approx(-a * min(p / q, k["clip_ratio_c"]) / len(HAND), rel=1e-12)
    ref = _ref_dppo(mode, old, lp.detach(), adv, mask, k["clip_ratio_low"], k["clip_ratio_high"], k["clip_ratio_c"])
    torch.testing.assert_close(loss.detach(), ref.reshape(()), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("mode", sorted(DPPO))
@pytest.mark.parametrize("seed", [0, 1])
def test_dppo_metrics_equal_the_loop_and_the_data_exercises_them(mode, seed):
    """pg_clipfrac: tokens outside the trust region; pg_clipfrac_lower: tokens kept whose ratio was
    truncated. The random data must have both, on both advantage signs, or the reference test
    above would not test the masks."""
    old, lp, adv, mask = _data(seed)
    k = kw(mode, None)
    _, m = algo.compute_policy_loss(mode, old, lp, adv, mask, **k)
    toks = _tokens(mask)
    out = [(i, t) for i, t in toks if not dppo_keeps(mode, float(old[i, t]), float(lp[i, t]), float(adv[i, t]),
                                                      k["clip_ratio_low"], k["clip_ratio_high"])]
    cut = [(i, t) for i, t in toks if (i, t) not in out and math.exp(float(lp[i, t] - old[i, t])) > k["clip_ratio_c"]]
    assert any(adv[i, t] > 0 for i, t in out) and any(adv[i, t] < 0 for i, t in out) and len(out) < len(toks)
    assert cut
    assert m["pg_clipfrac"].item() == pytest.approx(len(out) / len(toks), abs=1e-12)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(len(cut) / len(toks), abs=1e-12)


def test_dro_penalises_every_token_and_needs_its_beta():
    """The quadratic penalty pulls logp back to old_logp on tokens with A = 0 too (unlike a ratio
    clip, which leaves them alone), and loss_mode dro refuses a missing or non-positive beta."""
    old, lp, adv, mask = _data(5)
    adv = torch.zeros_like(adv)
    x = lp.clone().requires_grad_(True)
    loss, _ = algo.compute_policy_loss("dro", old, x, adv, mask, dro_beta=DRO_BETA)
    g, = torch.autograd.grad(loss, x)
    on = mask > 0
    torch.testing.assert_close(g[on], (DRO_BETA * (lp - old) / mask.sum())[on], atol=1e-12, rtol=1e-12)
    for beta in (None, 0.0, -0.1):
        with pytest.raises(ValueError, match=f"policy_loss.dro_beta must be > 0 for loss_mode dro, got {beta}"):
            algo.compute_policy_loss("dro", old, lp, adv, mask, dro_beta=beta)
