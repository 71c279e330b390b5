"""Metrics and losses that carry verl's names mean what they mean in verl.

Each ``verl_*`` function below is a float64 transcription of verl v0.9.0's code (identical in
its main branch of 2026-08-22): ``verl/trainer/ppo/rollout_corr_helper.py``
(compute_rollout_correction_weights + compute_is_metrics, compute_rollout_rejection_mask +
compute_rs_metrics), ``verl/utils/debug/metrics.py`` (calculate_debug_metrics) and
``verl/trainer/ppo/core_algos.py`` (every registered policy loss, with the actor's config as
keyword arguments and no global batch info). megappo's functions are compared with them on random
batches with ragged masks: the value, the gradient and every metric verl logs for that loss.
Where megappo logs a verl name verl does not log for a loss, the expected value is stated.
"""
import math

import pytest
import torch

from megappo import algo

DT = torch.float64
SAFETY_BOUND = 20.0


def _msum(v, m, axis=None):
    v = torch.where(m.bool(), v, torch.zeros((), dtype=v.dtype)) * m
    return v.sum() if axis is None else v.sum(dim=axis)


def _mmean(v, m, axis=None):
    return _msum(v, m, axis) / ((m.sum() if axis is None else m.sum(dim=axis)) + 1e-8)


def _batch(seed, B=9, T=7, noise=0.4):
    """Ragged masks, every row with at least one token (verl's row statistics take every row)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=DT) * 2 - 0.05
    rollout = old + torch.randn(B, T, generator=g, dtype=DT) * noise
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(DT)
    mask[:, 1:] *= (torch.rand(B, T - 1, generator=g) > 0.15).to(DT)   # holes (multi-turn tool tokens)
    return old, rollout, mask


# -- rollout correction's importance weights --------------------------------------------------

def verl_is(old, rollout, mask, level, C, batch_normalize=False):
    """compute_rollout_correction_weights (TIS, one upper bound) with compute_is_metrics."""
    log_ratio = old - rollout
    if level == "token":
        lrm = log_ratio
        raw = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:
        lrm = _msum(log_ratio, mask, axis=-1).unsqueeze(-1)
        raw = torch.exp(torch.clamp(lrm, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * mask
    w = raw.clamp(max=C)
    met = {}
    lower = 1.0 / C
    log_up, log_lo = torch.log(torch.tensor(C)), torch.log(torch.tensor(lower))
    if level == "sequence":
        met["rollout_is_max"] = torch.exp(torch.clamp(lrm.max(), max=SAFETY_BOUND)).item()
        met["rollout_is_min"] = torch.exp(lrm.min()).item()
        met["rollout_is_mean"] = _mmean(w, mask).item()
        met["rollout_is_ratio_fraction_high"] = (lrm > log_up).double().mean().item()
        met["rollout_is_ratio_fraction_low"] = (lrm < log_lo).double().mean().item()
    else:
        met["rollout_is_mean"] = _mmean(w, mask).item()
        met["rollout_is_ratio_fraction_high"] = _mmean((raw > C).double(), mask).item()
        met["rollout_is_ratio_fraction_low"] = _mmean((raw < lower).double(), mask).item()
        met["rollout_is_max"] = w.masked_fill(~mask.bool(), float("-inf")).max().item()
        met["rollout_is_min"] = w.masked_fill(~mask.bool(), float("inf")).min().item()
    wc = w.clamp(min=0.0, max=C)
    mc = _mmean(wc, mask)
    met["rollout_is_std"] = torch.sqrt(torch.clamp(_mmean(wc.square(), mask) - mc.square(), min=0.0)).item()
    met["rollout_is_eff_sample_size"] = 1.0 / _mmean((wc / (mc + 1e-8)).square(), mask).item()
    seq_w = _mmean(w, mask, axis=-1)
    met["rollout_is_seq_mean"] = seq_w.mean().item()
    met["rollout_is_seq_std"] = seq_w.std().item()
    met["rollout_is_seq_max"] = seq_w.max().item()
    met["rollout_is_seq_min"] = seq_w.min().item()
    met["rollout_is_seq_max_deviation"] = (seq_w - 1.0).abs().max().item()
    raw_seq = _mmean(raw, mask, axis=-1)
    met["rollout_is_seq_fraction_high"] = (raw_seq > C).double().mean().item()
    met["rollout_is_seq_fraction_low"] = (raw_seq < lower).double().mean().item()
    if batch_normalize:
        if level == "token":
            mean = _mmean(w, mask)
        else:
            sw, sm = _mmean(w, mask, axis=-1), (mask.sum(-1) > 0).double()
            mean = (sw * sm).sum() / sm.sum().clamp_min(1e-8)
        w = w / mean
        met["rollout_is_batch_norm_factor"] = mean.item()
    return w, {f"rollout_corr/{k}": v for k, v in met.items()}


def _close(got: dict, want: dict, rel=1e-6, abs_=1e-9):
    assert set(got) == set(want), set(got) ^ set(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=rel, abs=abs_), (k, got[k], want[k])


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("normalize", [False, True])
def test_is_weights_and_metrics_are_verls(level, seed, normalize):
    old, rollout, mask = _batch(seed, noise=0.4 if level == "token" else 0.25)
    C = 1.5
    w, got = algo.rollout_is_weights(old, rollout, mask, level=level, threshold=C, batch_normalize=normalize)
    want_w, want = verl_is(old, rollout, mask, level, C, normalize)
    torch.testing.assert_close(w, want_w, rtol=1e-7, atol=1e-12)
    _close(got, want)
    # the data reaches both sides of the bounds, so the fractions are not trivially 0
    key = "rollout_corr/rollout_is_ratio_fraction_"
    assert 0 < got[key + "high"] < 1 and 0 < got[key + "low"] < 1
    # DP padding (empty rows) changes nothing; verl's row statistics would count such rows
    pad = torch.zeros(3, mask.shape[1], dtype=DT)
    _, padded = algo.rollout_is_weights(torch.cat([old, pad]), torch.cat([rollout, pad]), torch.cat([mask, pad]),
                                        level=level, threshold=C, batch_normalize=normalize)
    _close(padded, got, rel=1e-12, abs_=1e-15)


def test_is_metrics_are_after_truncation_and_token_weighted():
    """The two differences a dashboard would show before: the mean and max are of the truncated
    weights, and at sequence level a sequence weighs by its token count."""
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1]], dtype=DT)
    old = torch.zeros(2, 4, dtype=DT)
    rollout = torch.tensor([[-math.log(3.0), 0, 0, 0], [0, 0, 0, 0]], dtype=DT)   # ratios 3 and 1
    _, m = algo.rollout_is_weights(old, rollout, mask, level="sequence", threshold=2.0)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((2.0 + 4 * 1.0) / 5)   # truncated 3 -> 2, by tokens
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(3.0)                     # sequence max: the raw ratio
    assert m["rollout_corr/rollout_is_seq_mean"] == pytest.approx(1.5)                # per sequence: equal weights
    _, m = algo.rollout_is_weights(old, rollout, mask, level="token", threshold=2.0)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(2.0)                     # token max: truncated


# -- rollout correction's rejection sampling ---------------------------------------------------

def verl_rs(log_ratio, mask, rs, spec):
    """compute_rollout_rejection_mask with compute_rs_metrics (spec: {option: (lower, upper)})."""
    lrs = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    tok = {1: -lrs, 2: 0.5 * lrs ** 2, 3: torch.exp(lrs) - 1.0 - lrs}
    mb, seq_valid = mask.bool(), mask.sum(-1) > 0
    combined, met = torch.ones_like(mask), {}
    for name in rs:
        lower, upper = spec[name]
        k1, k = name.endswith("k1"), int(name[-1])
        lo_log, up_log = (math.log(lower), math.log(upper)) if k1 else (None, None)
        if name.startswith("token"):
            stat, seq_stat, level = tok[k], None, "token"
            keep = (stat >= lo_log) & (stat <= up_log) if k1 else stat <= upper
        else:
            agg = name.split("_")[1]
            if agg == "sum":
                seq_stat = _msum(tok[k], mask, axis=-1)
            elif agg == "mean":
                seq_stat = _mmean(tok[k], mask, axis=-1)
            else:
                mx = tok[k].masked_fill(~mb, float("-inf")).max(dim=-1).values
                seq_stat = torch.where(mx == float("-inf"), torch.zeros_like(mx), mx)
            sk = (seq_stat >= lo_log) & (seq_stat <= up_log) if k1 else seq_stat <= upper
            keep, stat, level = sk.unsqueeze(-1).expand_as(mb), seq_stat.unsqueeze(-1).expand_as(mask), "sequence"
        hi, lo = (up_log, lo_log) if k1 else (upper, 0.0)
        keep_f = keep.to(DT)
        combined = combined * keep_f
        p = f"rollout_rs_{name}"
        sv = (seq_stat if seq_stat is not None else _mmean(stat, mask, axis=-1))[seq_valid]
        met[p + "_mean"] = _mmean(stat, mask).item()
        if level == "sequence":
            met[p + "_max"], met[p + "_min"] = sv.max().item(), sv.min().item()
            met[p + "_fraction_high"] = (sv > hi).double().mean().item()
            met[p + "_fraction_low"] = (sv < lo).double().mean().item() if k1 else 0.0
        else:
            met[p + "_max"] = stat.masked_fill(~mb, float("-inf")).max().item()
            met[p + "_min"] = stat.masked_fill(~mb, float("inf")).min().item()
            met[p + "_fraction_high"] = _mmean((stat > hi).double(), mask).item()
            met[p + "_fraction_low"] = _mmean((stat < lo).double(), mask).item() if k1 else 0.0
        sc = stat.clamp(min=lo, max=hi)
        var = _mmean(sc.square(), mask) - _mmean(sc, mask).square()
        met[p + "_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item()
        met[p + "_seq_mean"], met[p + "_seq_std"] = sv.mean().item(), sv.std().item()
        met[p + "_seq_max"], met[p + "_seq_min"] = sv.max().item(), sv.min().item()
        met[p + "_seq_max_deviation"] = sv.abs().max().item()
        met[p + "_seq_fraction_high"] = (sv > hi).double().mean().item()
        if k1:
            met[p + "_seq_fraction_low"] = (sv < lo).double().mean().item()
        met[p + "_masked_fraction"] = _mmean(1 - keep_f, mask).item()
        seq_keep = (~((~keep) & mb)).all(dim=-1).to(DT)
        svf = seq_valid.to(DT)
        met[p + "_seq_masked_fraction"] = (((1.0 - seq_keep) * svf).sum() / svf.sum()).item()
    met["rollout_rs_masked_fraction"] = _mmean(1 - combined, mask).item()
    met["rollout_rs_seq_masked_fraction"] = (~((combined > 0.5) & mb) & mb).any(dim=-1).double().mean().item()
    return (mask * combined), {f"rollout_corr/{k}": v for k, v in met.items()}


RS = {"token_k1": ("0.7_1.3", (0.7, 1.3)), "token_k2": ("0.05", (None, 0.05)), "token_k3": ("0.05", (None, 0.05)),
      "seq_sum_k1": ("2", (0.5, 2.0)), "seq_sum_k2": ("0.3", (None, 0.3)), "seq_sum_k3": ("0.3", (None, 0.3)),
      "seq_mean_k1": ("0.8_1.2", (0.8, 1.2)), "seq_mean_k2": ("0.08", (None, 0.08)),
      "seq_mean_k3": ("0.08", (None, 0.08)), "seq_max_k2": ("0.15", (None, 0.15)), "seq_max_k3": ("0.15", (None, 0.15))}


@pytest.mark.parametrize("options", [[o] for o in sorted(RS)] + [["token_k1", "seq_mean_k3", "seq_max_k2"]])
@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_mask_and_metrics_are_verls(options, seed):
    old, rollout, mask = _batch(seed, B=12, noise=0.3)
    threshold = ",".join(RS[o][0] for o in options)
    keep, got = algo.rollout_correction.rollout_rejection_mask(old, rollout, mask, rs=",".join(options),
                                                              threshold=threshold)
    want_keep, want = verl_rs(old - rollout, mask, options, {o: RS[o][1] for o in options})
    assert torch.equal(keep * mask, want_keep)
    _close(got, want, rel=1e-6, abs_=1e-9)


# -- the engine-vs-trainer drift -----------------------------------------------------------------

def test_rollout_probs_diff_is_verls():
    old, rollout, mask = _batch(4)
    got = algo.rollout_probs_diff(rollout, old, mask)
    d = torch.masked_select(torch.abs(torch.exp(old) - torch.exp(rollout)), mask.bool())
    want = {"training/rollout_probs_diff_max": d.max().item(), "training/rollout_probs_diff_mean": d.mean().item(),
            "training/rollout_probs_diff_std": d.std().item()}
    _close(got, want, rel=1e-12, abs_=0)


# -- policy losses ------------------------------------------------------------------------------

def verl_agg(loss_mat, mask, mode):
    """agg_loss without global batch info (dp_size 1)."""
    if mode == "token-mean":
        return _msum(loss_mat, mask) / mask.sum()
    if mode == "seq-mean-token-mean":
        n = mask.sum(-1)
        seq = (loss_mat * mask).sum(-1) / (n + 1e-8)
        sm = (n > 0).to(DT)
        return _msum(seq, sm) / sm.sum()
    seq = (loss_mat * mask).sum(-1)
    sm = (mask.sum(-1) > 0).to(DT)
    return _msum(seq, sm) / sm.sum()   # seq-mean-token-sum


def _ratio(old, lp, clamp=True):
    nak = lp - old
    return torch.clamp(nak, min=-20.0, max=20.0) if clamp else nak


def verl_vanilla(old, lp, adv, mask, c, mode):
    nak = _ratio(old, lp)
    ratio = torch.exp(nak)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - c["lo"], 1 + c["hi"])
    cl1 = torch.maximum(l1, l2)
    l3 = -adv * c["c"]
    cl2 = torch.min(l3, cl1)
    losses = torch.where(adv < 0, cl2, cl1)
    return verl_agg(losses, mask, mode), {
        "pg_clipfrac": _mmean(torch.gt(l2, l1).double(), mask), "ppo_kl": _mmean(-nak, mask),
        "pg_clipfrac_lower": _mmean(torch.gt(cl1, l3) * (adv < 0).double(), mask)}


def _verl_dppo(old, lp, adv, mask, c, mode, valid):
    nak = _ratio(old, lp)
    ratio = torch.exp(nak)
    tr = torch.clamp(ratio, max=c["c"]).detach()
    valid = valid.detach().double()
    return verl_agg(-adv * tr * lp * valid, mask, mode), {
        "pg_clipfrac": _mmean(1.0 - valid, mask), "ppo_kl": _mmean(-nak, mask),
        "pg_clipfrac_lower": _mmean((ratio > c["c"]).double() * valid, mask)}


def verl_dppo_tv(old, lp, adv, mask, c, mode):
    prob, old_prob = torch.exp(lp), torch.exp(old)
    valid = torch.where(adv > 0, (prob - old_prob) <= c["hi"], (prob - old_prob) >= -c["lo"])
    return _verl_dppo(old, lp, adv, mask, c, mode, valid)


def verl_dppo_kl(old, lp, adv, mask, c, mode):
    prob, old_prob = torch.exp(lp), torch.exp(old)
    bkl = old_prob * (old - lp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    valid = torch.where(adv > 0, (bkl <= c["hi"]) | (prob <= old_prob), (bkl <= c["lo"]) | (prob >= old_prob))
    return _verl_dppo(old, lp, adv, mask, c, mode, valid)


def verl_gspo(old, lp, adv, mask, c, mode):
    nak = lp - old
    seq = torch.sum(nak * mask, dim=-1) / torch.sum(mask, dim=-1).clamp(min=1)
    s = torch.exp(torch.clamp(lp - lp.detach() + seq.detach().unsqueeze(-1), max=10.0))
    l1, l2 = -adv * s, -adv * torch.clamp(s, 1 - c["lo"], 1 + c["hi"])
    loss = verl_agg(torch.maximum(l1, l2), mask, "seq-mean-token-mean")   # whatever `mode` is
    return loss, {"pg_clipfrac": _mmean(torch.gt(l2, l1).double(), mask), "pg_clipfrac_lower": torch.tensor(0.0),
                  "ppo_kl": _mmean(-nak, mask)}


def verl_sapo(old, lp, adv, mask, c, mode):
    nak = _ratio(old, lp)
    taus = torch.where(adv > 0, torch.as_tensor(c["tau_pos"], dtype=DT), torch.as_tensor(c["tau_neg"], dtype=DT))
    gates = torch.sigmoid(taus * (torch.exp(nak) - 1.0)) * (4.0 / taus)
    return verl_agg(-gates * adv, mask, "seq-mean-token-mean"), {
        "pg_clipfrac": torch.tensor(0.0), "pg_clipfrac_lower": torch.tensor(0.0), "ppo_kl": _mmean(-nak, mask)}


def verl_gpg(old, lp, adv, mask, c, mode):
    return verl_agg(-lp * adv, mask, mode), {}


def verl_cispo(old, lp, adv, mask, c, mode):
    nak = _ratio(old, lp)
    ratio = torch.exp(nak)
    clipped = torch.clamp(ratio, 1 - c["lo"], 1 + c["hi"])
    return verl_agg(-clipped.detach() * adv * lp, mask, mode), {
        "pg_clipfrac": _mmean((ratio != clipped).double(), mask), "pg_clipfrac_lower": torch.tensor(0.0),
        "ppo_kl": _mmean(-nak, mask)}


def verl_geo_mean(old, lp, adv, mask, c, mode):
    nak = lp - old
    sgn = torch.sign(adv)
    nak_c = torch.clamp(nak, -c["lo"], c["hi"])
    nak_min = sgn * torch.min(sgn * nak, sgn * nak_c)
    n = mask.sum(dim=-1)
    ratio = torch.exp((nak_min * mask).sum(dim=-1) / (n + 1e-8))
    a = (adv * mask).sum(dim=-1) / (n + 1e-8)
    clipped = torch.ne(nak, nak_c)
    return torch.mean(-a * ratio), {
        "pg_clipfrac": _mmean((clipped * (adv > 0)).double(), mask), "ppo_kl": _mmean(-nak, mask),
        "pg_clipfrac_lower": _mmean((clipped * (adv < 0)).double(), mask)}


def verl_dro(old, lp, adv, mask, c, mode):
    lr = lp - old
    return verl_agg(-(lp * adv - 0.5 * c["dro_beta"] * lr.square()), mask, mode), {"ppo_kl": _mmean(-lr, mask)}


def verl_clip_cov(old, lp, adv, mask, c, mode, chosen):
    """verl's Clip-Cov with ``chosen`` in place of its random draw (torch.randperm) of the
    candidates; also returns the candidates and the number verl draws."""
    nak = lp - old
    ratio = torch.exp(nak)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - c["lo"], 1 + c["hi"])
    clip_by_origin = (l2 > l1) & (mask > 0)
    cov = (adv - _mmean(adv, mask)) * (lp - _mmean(lp.detach(), mask))
    cov = cov.detach().clone()
    cov[mask == 0] = -torch.inf
    cov[clip_by_origin] = -torch.inf
    clip_num = max(int(c["clip_cov_ratio"] * mask.sum().item()), 1)
    cand = (cov < c["clip_cov_ub"]) & (cov > c["clip_cov_lb"]) & (mask > 0)
    corr = torch.ones_like(adv)
    corr[chosen] = 0
    losses = torch.maximum(l1, l2) * corr
    return verl_agg(losses, mask, mode), {"pg_clipfrac": _mmean((corr == 0).double(), mask),
                                          "ppo_kl": _mmean(-nak, mask)}, cand, min(clip_num, int(cand.sum()))


def verl_kl_cov(old, lp, adv, mask, c, mode):
    nak = lp - old
    ratio = torch.exp(nak)
    losses = (-adv * ratio).clone()
    kl_losses = -adv * ratio + c["ppo_kl_coef"] * nak.abs()
    valid = mask > 0
    valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    va, vl = adv[valid].detach().reshape(-1), lp[valid].detach().reshape(-1)
    cov = (va - va.mean()) * (vl - vl.mean())
    k = max(1, int(len(cov) * c["kl_cov_ratio"]))
    idx = valid_idx[torch.topk(cov, k, largest=True).indices]
    r, t = idx // adv.shape[1], idx % adv.shape[1]
    losses[r, t] = kl_losses[r, t]
    sel = torch.zeros_like(valid)
    sel[r, t] = True
    return verl_agg(losses, mask, mode), {"ppo_kl": _mmean(nak.abs(), mask)}, sel


def verl_reinforce(old, lp, adv, mask, c, mode):
    """bypass_mode with loss_type=reinforce: IS weights from the current policy against old_log_prob
    (the engine's), then compute_policy_loss_reinforce."""
    with torch.no_grad():
        w, _ = verl_is(lp.detach(), old, mask, c["rollout_is"], c["rollout_is_threshold"])
    return verl_agg(-adv * lp * w, mask, mode), {"ppo_kl": _mmean(-(lp - old), mask)}


CFG = dict(lo=0.2, hi=0.28, c=3.0, tau_pos=1.0, tau_neg=1.05, dro_beta=0.3, clip_cov_ratio=0.1, clip_cov_lb=0.0,
           clip_cov_ub=5.0, kl_cov_ratio=0.1, ppo_kl_coef=0.5, rollout_is="token", rollout_is_threshold=1.2)
MEGAPPO_KW = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05, dro_beta=0.3,
                  ppo_kl_coef=0.5)
VERL = {"vanilla": verl_vanilla, "gspo": verl_gspo, "sapo": verl_sapo, "gpg": verl_gpg, "cispo": verl_cispo,
        "geo_mean": verl_geo_mean, "dppo_tv": verl_dppo_tv, "dppo_kl": verl_dppo_kl, "dro": verl_dro}
# megappo always returns pg_clipfrac, pg_clipfrac_lower and ppo_kl; where verl logs no such key for
# a loss, megappo's value is 0 (nothing of that kind is clipped), except reinforce's pg_clipfrac
# (the share of tokens whose weight was truncated: verl logs no pg_clipfrac for this loss) and
# gpg's ppo_kl (the usual signed mean; verl logs no ppo_kl for gpg)
ABSENT_ZERO = ("pg_clipfrac", "pg_clipfrac_lower")


def _policy_data(seed, B=8, T=9):
    g = torch.Generator().manual_seed(100 + seed)
    old, _, mask = _batch(seed, B, T)
    lp = (old + torch.randn(B, T, generator=g, dtype=DT) * 0.3).clamp(max=-1e-3)
    adv = torch.randn(B, T, generator=g, dtype=DT)
    return old, lp, adv, mask


def _run_both(mode, verl_fn, data, agg, extra=None, verl_extra=()):
    old, lp, adv, mask = data
    a = lp.clone().requires_grad_(True)
    loss, got = algo.compute_policy_loss(mode, old, a, adv, mask, loss_agg_mode=agg, **MEGAPPO_KW, **(extra or {}))
    ga, = torch.autograd.grad(loss, a)
    b = lp.clone().requires_grad_(True)
    out = verl_fn(old, b, adv, mask, CFG, agg, *verl_extra)
    gb, = torch.autograd.grad(out[0], b)
    # rtol: verl divides by (count + 1e-8) in places
    torch.testing.assert_close(loss, out[0], rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(ga, gb, rtol=1e-7, atol=1e-12)
    return got, out[1], out[2:]


def _metrics_match(mode, got, want):
    for k, v in want.items():
        assert got[k].item() == pytest.approx(float(torch.as_tensor(v).detach()), rel=1e-7, abs=1e-10), (mode, k)
    for k in ABSENT_ZERO:
        if k not in want and not (mode == "reinforce" and k == "pg_clipfrac"):
            assert got[k].item() == 0.0, (mode, k)


@pytest.mark.parametrize("mode", sorted(VERL))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("seed", [0, 1])
def test_policy_loss_value_gradient_and_metrics_are_verls(mode, agg, seed):
    got, want, _ = _run_both(mode, VERL[mode], _policy_data(seed), agg)
    _metrics_match(mode, got, want)


def test_gspo_and_sapo_aggregate_seq_mean_token_mean_whatever_the_mode():
    """verl v0.9.0 hard-codes seq-mean-token-mean in both (the actor's loss_agg_mode is passed and
    ignored), so the default token-mean gives the same loss as the sequence mode."""
    data = _policy_data(5)
    for mode in ("gspo", "sapo"):
        by_mode = [algo.compute_policy_loss(mode, *data, loss_agg_mode=m, **MEGAPPO_KW)[0]
                   for m in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")]
        assert by_mode[0] == by_mode[1] == by_mode[2]
        vanilla = [algo.compute_policy_loss("vanilla", *data, loss_agg_mode=m, **MEGAPPO_KW)[0]
                   for m in ("token-mean", "seq-mean-token-mean")]
        assert not torch.isclose(vanilla[0], vanilla[1])   # the data would show a difference


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_cov_selection_loss_and_ppo_kl_are_verls(seed):
    """One micro-batch, one rank: megappo's mini-batch selection is verl's top-k, and ppo_kl is
    the mean |log-ratio| (not the signed mean the other losses log)."""
    old, lp, adv, mask = data = _policy_data(seed)
    keys = algo.token_keys(torch.arange(mask.shape[0]), mask.shape[1], 3)
    sel = algo.kl_cov_selection(lp, adv, mask, keys, kl_cov_ratio=CFG["kl_cov_ratio"])
    got, want, (verl_sel,) = _run_both("kl_cov", verl_kl_cov, data, "token-mean", {"cov_selected": sel})
    assert torch.equal(sel, verl_sel)
    _metrics_match("kl_cov", got, want)
    signed = float(((old - lp) * mask).sum() / mask.sum())
    assert abs(got["ppo_kl"].item() - signed) > 1e-3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_candidates_loss_and_metrics_are_verls(seed):
    """megappo's draw (a hash, split-invariant) and verl's (torch.randperm) are both uniform draws
    of the same number from the same candidates; given the same draw, loss, gradient and metrics
    agree."""
    old, lp, adv, mask = data = _policy_data(seed)
    keys = algo.token_keys(torch.arange(mask.shape[0]), mask.shape[1], 3)
    sel = algo.clip_cov_selection(old, lp, adv, mask, keys, clip_ratio_low=CFG["lo"], clip_ratio_high=CFG["hi"],
                                  clip_cov_ratio=CFG["clip_cov_ratio"], clip_cov_lb=CFG["clip_cov_lb"],
                                  clip_cov_ub=CFG["clip_cov_ub"])
    got, want, (cand, n) = _run_both("clip_cov", verl_clip_cov, data, "token-mean", {"cov_selected": sel},
                                     verl_extra=(sel,))
    assert n > 1 and int(sel.sum()) == n and not (sel & ~cand).any()
    _metrics_match("clip_cov", got, want)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_reinforce_is_verls_bypass_reinforce(level):
    extra = dict(rollout_is=level, rollout_is_threshold=CFG["rollout_is_threshold"])
    old_cfg = CFG["rollout_is"]
    CFG["rollout_is"] = level
    try:
        for agg in ("token-mean", "seq-mean-token-sum"):
            got, want, _ = _run_both("reinforce", verl_reinforce, _policy_data(7), agg, extra)
            _metrics_match("reinforce", got, want)
    finally:
        CFG["rollout_is"] = old_cfg


def test_every_registered_loss_is_compared_with_verl_here():
    assert sorted([*VERL, "kl_cov", "clip_cov", "reinforce"]) == algo.list_policy_losses()


# -- GAE over multi-turn responses (tool tokens masked inside) ----------------------------------

def verl_gae(r, v, mask, gamma, lam):
    """compute_gae_advantage_return: masked (observation) tokens pass the next value and the
    running advantage through; masked_whiten with the unbiased variance."""
    nextvalues, lastgaelam, rev = 0, 0, []
    for t in reversed(range(r.shape[-1])):
        delta = r[:, t] + gamma * nextvalues - v[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = v[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        rev.append(lastgaelam)
    adv = torch.stack(rev[::-1], dim=1)
    returns = adv + v
    mean = _msum(adv, mask) / mask.sum()
    var = _msum((adv - mean) ** 2, mask) / mask.sum() * (mask.sum() / (mask.sum() - 1))
    return (adv - mean) * torch.rsqrt(var + 1e-8), returns


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_over_tool_turns_is_verls_on_model_tokens(gamma, lam):
    g = torch.Generator().manual_seed(3)
    B, T = 6, 30
    lengths = torch.randint(8, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(DT)
    mask[:, 3:7] = 0          # a tool turn after the first model turn of every row
    mask[::2, 12:15] = 0      # and a second one in half the rows
    r = torch.zeros(B, T, dtype=DT)
    r[torch.arange(B), lengths - 1] = torch.randn(B, generator=g, dtype=DT)   # the outcome on the last token
    r += torch.randn(B, T, generator=g, dtype=DT) * 0.1 * mask                 # and a KL penalty per model token
    v = torch.randn(B, T, generator=g, dtype=DT)
    want_a, want_r = verl_gae(r, v, mask, gamma, lam)
    a, ret = algo.compute_advantages("gae", token_level_rewards=r, values=v, response_mask=mask, gamma=gamma, lam=lam)
    m = mask.bool()
    torch.testing.assert_close(a[m], want_a[m], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ret[m], want_r[m], rtol=1e-9, atol=1e-9)
    # the tool tokens carry nothing into the loss (megappo writes 0 there; verl's values there are never read)
    assert (a[~m] == 0).all() and (ret[~m] == 0).all()
