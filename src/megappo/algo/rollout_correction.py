"""Rollout correction (verl's ``algorithm.rollout_correction``): the rollout engine samples from
pi_rollout, which is not exactly the trainer's pi_old (other kernels, precision, a stale engine);
truncated importance weights w = min(pi_old / pi_rollout, threshold) reweight each token's (or
sequence's) policy loss so the update stays an estimate under pi_old.

``rollout_is="token"``: w_t = min(exp(old_logp_t - rollout_logp_t), C) per token (biased, low
variance). ``"sequence"``: one weight per sequence, min(exp(sum_t (old_logp_t - rollout_logp_t)),
C), on every token of it (unbiased before truncation, high variance). Log-ratios are clamped to
+-20 before exp. ``batch_normalize`` divides by the weights' mean over the whole batch (every DP
rank; tokens or sequences as the level), so they average 1. Weights are constants (no gradient).

Rejection sampling (verl's ``rollout_rs`` / ``rollout_rs_threshold``): with the per-token log-ratio
d = clamp(old_logp - rollout_logp, +-20), a divergence per token, k1 = -d, k2 = d^2 / 2,
k3 = exp(d) - 1 - d, is checked per token (``token_k*``) or as its sum, mean or max over each
sequence (``seq_sum_k*``, ``seq_mean_k*``, ``seq_max_k2/k3``); a token or a whole sequence outside
the bound is taken out of the mask. k2/k3 (>= 0) have an upper bound; k1 options take ratio bounds
``lower_upper`` kept in log space, log(lower) <= k1-statistic <= log(upper) (one number u means
1/u_u). Several comma-separated options must all pass. :func:`rollout_rejection_mask`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .stats import masked_mean

__all__ = ["ROLLOUT_IS_LEVELS", "rollout_is_weights", "truncated_is_weights", "ROLLOUT_RS_OPTIONS", "RSOption",
           "RolloutRSError", "parse_rollout_rs", "rollout_rejection_mask", "apply_weights"]

ROLLOUT_IS_LEVELS = ("token", "sequence")
SAFETY_BOUND = 20.0


def rollout_is_weights(old_log_prob: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor, *,
                       level: str = "token", threshold: float = 2.0, batch_normalize: bool = False,
                       dp_group=None) -> tuple[torch.Tensor, dict]:
    """(B, T) truncated importance weights (0 off the mask) and their metrics, DP-global with
    ``dp_group``: verl's ``compute_is_metrics`` (v0.9.0) on the whole batch, see :func:`_is_metrics`.
    ``batch_normalize`` divides the weights by their mean over tokens (token) or sequences
    (sequence) after the metrics are taken, as verl."""
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {', '.join(ROLLOUT_IS_LEVELS)}, got {level!r}")
    if not threshold > 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {threshold}")
    m = response_mask.to(torch.float64)
    with torch.no_grad():
        d = torch.where(m > 0, old_log_prob.detach().double() - rollout_log_probs.detach().double(),
                        torch.zeros((), dtype=torch.float64, device=m.device))
        seq_log = d.sum(-1) if level == "sequence" else None   # unclamped: verl's metrics read it
        if level == "token":
            raw = torch.exp(d.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * m
        else:
            raw = torch.exp(seq_log.clamp(-SAFETY_BOUND, SAFETY_BOUND))[:, None] * m
        w = raw.clamp(max=threshold)
        metrics = _is_metrics(w, raw, seq_log, m, threshold, dp_group)
        if batch_normalize:
            # the mean of the units: tokens, or one weight per non-empty sequence
            units, umask = (w, m) if level == "token" else (w.amax(-1), (m.sum(-1) > 0).to(m.dtype))
            mean = masked_mean(units, umask, group=dp_group).item()
            factor = mean if mean > 1e-8 else 1.0
            w = w / factor
            metrics["rollout_corr/rollout_is_batch_norm_factor"] = factor
    return w.to(old_log_prob.dtype), metrics


def _is_metrics(w: torch.Tensor, raw: torch.Tensor, seq_log: Optional[torch.Tensor], m: torch.Tensor,
                threshold: float, group) -> dict:
    """verl v0.9.0's ``compute_is_metrics`` (names under ``rollout_corr/``), DP-global: over the
    batch's tokens, each sequence counting with its token count, and over its non-empty sequences
    (verl's row statistics take every row; the two agree unless DP padding adds empty rows).
    ``w`` the truncated (B, T) weights, ``raw`` before truncation, ``seq_log`` the sequences'
    unclamped log-ratio sums (sequence level) or None (token level).

    rollout_is_mean / _std / _eff_sample_size: token mean, population std and 1 / mean((w / mean w)^2)
    of the truncated weights (at sequence level too: a sequence weighs by its length);
    _max / _min: of the truncated weights (token) or exp of the largest (capped at 20) / smallest
    log-ratio sum (sequence); _ratio_fraction_high / _low: the share of tokens (token) or
    sequences (sequence) whose raw ratio is above C / below 1 / C; _seq_mean / _seq_std (Bessel) /
    _seq_max / _seq_min / _seq_max_deviation (max |. - 1|): of each sequence's mean truncated
    weight; _seq_fraction_high / _low: sequences whose mean raw weight is above C / below 1 / C."""
    f64, lo = torch.float64, 1.0 / threshold
    n = m.sum(-1)
    seq = n > 0
    sf = seq.to(f64)
    s = (w * m).sum(-1) / n.clamp(min=1)            # each sequence's mean truncated weight
    s_raw = (raw * m).sum(-1) / n.clamp(min=1)
    if seq_log is None:
        hi_u, lo_u, umask = raw > threshold, raw < lo, m
    else:
        hi_u, lo_u, umask = seq_log > math.log(threshold), seq_log < math.log(lo), sf
    S = _reduce([m.sum(), sf.sum(), (w * m).sum(), (w * w * m).sum(), (umask * hi_u).sum(), (umask * lo_u).sum(),
                 (sf * s).sum(), (sf * s * s).sum(), (sf * (s_raw > threshold)).sum(), (sf * (s_raw < lo)).sum()],
                group)
    ninf = torch.tensor(-math.inf, dtype=f64, device=m.device)

    def top(x, keep):   # the largest x where keep, -inf if none
        return x[keep].max() if keep.any() else ninf

    units, ukeep = (w, m > 0) if seq_log is None else (seq_log, seq)
    M = _reduce([top(units, ukeep), top(-units, ukeep), top(s, seq), top(-s, seq), top((s - 1).abs(), seq)],
                group, dist.ReduceOp.MAX)
    N, NS, sw, sw2, u_hi, u_lo, ss, ss2, s_hi, s_lo = S
    if N == 0:
        return {f"rollout_corr/rollout_is_{k}": 0.0 for k in _IS_METRICS}
    NU = N if seq_log is None else NS
    mean, mean_sq, seq_mean = sw / N, sw2 / N, ss / NS
    mx, mn = (M[0], -M[1]) if seq_log is None else (math.exp(min(M[0], SAFETY_BOUND)), math.exp(-M[1]))
    vals = [mean, mx, mn, u_hi / NU, u_lo / NU, math.sqrt(max(mean_sq - mean * mean, 0.0)) if N > 1 else 0.0,
            mean * mean / mean_sq if mean_sq > 0 else 0.0, seq_mean,
            math.sqrt(max(ss2 - NS * seq_mean * seq_mean, 0.0) / (NS - 1)) if NS > 1 else 0.0,
            M[2], -M[3], M[4], s_hi / NS, s_lo / NS]
    return {f"rollout_corr/rollout_is_{k}": float(v) for k, v in zip(_IS_METRICS, vals)}


_IS_METRICS = ("mean", "max", "min", "ratio_fraction_high", "ratio_fraction_low", "std", "eff_sample_size", "seq_mean",
               "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high", "seq_fraction_low")


def truncated_is_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, *, level: str = "token",
                         threshold: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance weights from a (B, T) log-ratio d = log(pi / pi_behaviour), no metrics,
    no gradient, nothing global (the policy loss ``reinforce`` computes them per micro-batch):
    token: min(exp(d_t), C); sequence: min(exp(sum_t d_t), C) on each of its tokens; d (its sum)
    clamped to +-20 before exp; 0 off the mask. Also the (B, T) bool of the mask's tokens whose
    ratio exceeded C (truncated)."""
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {', '.join(ROLLOUT_IS_LEVELS)}, got {level!r}")
    if not threshold > 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {threshold}")
    with torch.no_grad():
        m = response_mask.bool()
        zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
        d = torch.where(m, log_ratio.detach(), zero)
        if level == "sequence":
            d = d.sum(-1, keepdim=True).expand_as(d)
        ratio = torch.exp(d.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        return torch.where(m, ratio.clamp(max=threshold), zero), (ratio > threshold) & m


# -- rejection sampling (verl's rollout_rs) ------------------------------------------------------

ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                      "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
RS_KEY = "algorithm.rollout_correction.rollout_rs"
RS_THRESHOLD_KEY = "algorithm.rollout_correction.rollout_rs_threshold"


class RolloutRSError(ValueError):
    """A bad rollout_rs / rollout_rs_threshold: ``key`` is the config key at fault, ``reason`` the
    message without it (the config validator reports the two apart)."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"{key}: {reason}")
        self.key, self.reason = key, reason


@dataclass(frozen=True)
class RSOption:
    """One rejection criterion: ``name`` (one of ROLLOUT_RS_OPTIONS) and its bounds as given:
    k1 options the ratio bounds ``lower`` <= . <= ``upper``, k2/k3 an ``upper`` bound on the
    divergence (``lower`` None)."""

    name: str
    upper: float
    lower: Optional[float] = None

    @property
    def k(self) -> int:
        return int(self.name[-1])

    @property
    def agg(self) -> str:
        """token, sum, mean or max: what is compared, a token's divergence or a sequence's."""
        return "token" if self.name.startswith("token") else self.name.split("_")[1]

    def stat_bounds(self) -> tuple[Optional[float], float]:
        """(lower, upper) bounds on the statistic: k1 in log space, k2/k3 (None, upper)."""
        if self.k == 1:
            return math.log(self.lower), math.log(self.upper)
        return None, self.upper


def _bound(text: str, name: str, spec: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise RolloutRSError(RS_THRESHOLD_KEY, f"entry {spec!r} for {name}: {text!r} is not a number") from None
    if not (math.isfinite(v) and v > 0):
        raise RolloutRSError(RS_THRESHOLD_KEY, f"entry {spec!r} for {name}: bounds must be finite and > 0, got {text}")
    return v


def parse_rollout_rs(rs, threshold) -> list[RSOption]:
    """The criteria of ``rollout_rs`` (comma-separated options; a repeated one counts once, as
    verl) with their ``rollout_rs_threshold`` (a number, or a string of comma-separated entries:
    one for all options or one per option; a k1 entry is ``lower_upper`` ratio bounds or one
    upper bound u with lower 1/u; a k2/k3 entry one upper bound). Raises :class:`RolloutRSError`
    (a ValueError naming the key at fault). Both this and verl v0.9.0 refuse lower > upper; this
    also refuses what verl would misread and run with: 'a_b_c' (verl splits at the first '_' and
    Python's float reads '2_3' as 23, so '0.5_2_3' is 0.5 to 23) and non-finite bounds."""
    names: list[str] = []
    for opt in (rs.split(",") if isinstance(rs, str) else []):
        opt = opt.strip()
        if opt and opt not in ROLLOUT_RS_OPTIONS:
            raise RolloutRSError(RS_KEY, f"unknown option {opt!r}; supported: {', '.join(ROLLOUT_RS_OPTIONS)} "
                                         "(comma-separated to require several)")
        if opt and opt not in names:
            names.append(opt)
    if not names:
        raise RolloutRSError(RS_KEY, f"must name one or more options (comma-separated) of "
                                     f"{', '.join(ROLLOUT_RS_OPTIONS)}, got {rs!r}")
    if threshold is None:
        raise RolloutRSError(RS_THRESHOLD_KEY, f"is required with rollout_rs={','.join(names)} (no default, as "
                                               "verl): a k2/k3 bound such as 0.01, or k1 ratio bounds such as 0.5_2.0")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, str)):
        raise RolloutRSError(RS_THRESHOLD_KEY, f"must be a number or a string of comma-separated entries, got {threshold!r}")
    specs = [p.strip() for p in threshold.split(",") if p.strip()] if isinstance(threshold, str) else [str(threshold)]
    if len(specs) not in (1, len(names)):
        raise RolloutRSError(RS_THRESHOLD_KEY, f"has {len(specs)} entries for {len(names)} option"
                                               f"{'s' if len(names) > 1 else ''} ({', '.join(names)}): give one "
                                               "for all or one per option")
    out = []
    for name, spec in zip(names, specs * len(names) if len(specs) == 1 else specs):
        if name.endswith("k1"):
            parts = spec.split("_")
            if len(parts) > 2:
                raise RolloutRSError(RS_THRESHOLD_KEY, f"entry {spec!r} for {name}: a k1 option takes ratio bounds "
                                                       "'lower_upper' (e.g. 0.5_2.0) or one upper bound u (lower 1/u)")
            vals = [_bound(p, name, spec) for p in parts]
            lower, upper = (1.0 / vals[0], vals[0]) if len(vals) == 1 else vals
            if lower > upper:
                alone = " (one number u means lower 1/u: u must be >= 1)" if len(vals) == 1 else ""
                raise RolloutRSError(RS_THRESHOLD_KEY, f"entry {spec!r} for {name}: lower bound {lower:g} above upper "
                                                       f"bound {upper:g} keeps nothing{alone}")
            out.append(RSOption(name, upper, lower))
        else:
            if "_" in spec:
                raise RolloutRSError(RS_THRESHOLD_KEY, f"entry {spec!r} for {name}: a k2/k3 option takes one upper "
                                                       "bound on the divergence, not 'lower_upper'")
            out.append(RSOption(name, _bound(spec, name, spec)))
    return out


def _reduce(values: list, group, op=None) -> list[float]:
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in values])
    if group is not None:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
    return t.tolist()


def rollout_rejection_mask(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                           *, rs, threshold, dp_group=None) -> tuple[torch.Tensor, dict]:
    """Rejection sampling (verl's ``rollout_rs``): the (B, T) float mask of the response tokens
    that pass every criterion of ``rs`` (:func:`parse_rollout_rs`; a sequence criterion keeps or
    drops all of its tokens) and its metrics, DP-global with ``dp_group`` (three all-reduces).

    d = clamp(old_logp - rollout_logp, +-20) per token (the trainer's policy against the engine's);
    k1 = -d, k2 = d^2 / 2, k3 = exp(d) - 1 - d. token_k*: each token's; seq_sum/seq_mean/seq_max_k*:
    the sum, mean or max over the sequence's tokens. Kept: k2/k3 <= upper; k1 in
    [log(lower), log(upper)] (so pi_rollout / pi_old within [lower, upper], verl's sign).

    Metrics (verl's names, ``rollout_corr/rollout_rs_<option>_``): mean (token mean of the
    statistic), max/min and fraction_high/low (beyond the bounds; low only for k1) over the units
    (tokens, or non-empty sequences), std (token std of the statistic clamped to the bounds),
    seq_mean/std/max/min/max_deviation/fraction_high(/fraction_low for k1) over sequences (a token
    option's sequence value is its mean), masked_fraction (tokens it rejects), seq_masked_fraction
    (sequences with a token it rejects); and ``rollout_corr/rollout_rs_masked_fraction`` /
    ``_seq_masked_fraction`` for all criteria together. Fractions of sequences count non-empty
    ones (verl divides the last by every row). An all-masked batch gives 0s."""
    opts = parse_rollout_rs(rs, threshold)
    if not old_log_prob.shape == rollout_log_prob.shape == response_mask.shape:
        raise ValueError(f"rollout_rejection_mask: old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
                         f"{tuple(rollout_log_prob.shape)} and response_mask {tuple(response_mask.shape)} differ in shape")
    f64 = torch.float64
    with torch.no_grad():
        m = response_mask != 0
        mf = m.to(f64)
        zero = torch.zeros((), dtype=f64, device=m.device)
        d = torch.where(m, old_log_prob.detach().to(f64) - rollout_log_prob.detach().to(f64), zero)
        d = d.clamp(-SAFETY_BOUND, SAFETY_BOUND)
        div = {1: -d, 2: 0.5 * d * d, 3: torch.exp(d) - 1.0 - d}
        n_tok = mf.sum(-1)
        seq = n_tok > 0
        sf = seq.to(f64)
        keep = m.clone()
        first, rows = [mf.sum(), sf.sum()], []
        for o in opts:
            x = torch.where(m, div[o.k], zero)
            if o.agg == "max":
                sv = torch.where(seq, torch.where(m, x, -math.inf).amax(-1) if x.shape[-1] else zero, zero)
            else:
                sv = x.sum(-1) / (1.0 if o.agg == "sum" else n_tok.clamp(min=1))   # token options: the mean
            stat = x if o.agg == "token" else sv[:, None].expand_as(x)
            lo, hi = o.stat_bounds()
            ok = stat <= hi if lo is None else (stat >= lo) & (stat <= hi)
            rej = m & ~ok
            keep &= ok
            units, umask = (x, mf) if o.agg == "token" else (sv, sf)
            c = stat.clamp(min=0.0 if lo is None else lo, max=hi)
            first += [(mf * stat).sum(), (umask * (units > hi)).sum(),
                      (umask * (units < lo)).sum() if lo is not None else zero, (mf * c).sum(), (sf * sv).sum(),
                      (sf * (sv > hi)).sum(), (sf * (sv < lo)).sum() if lo is not None else zero,
                      rej.to(f64).sum(), (sf * rej.any(-1)).sum()]
            rows.append((o, units, umask, c, sv, lo))
        rejected = m & ~keep
        first += [rejected.to(f64).sum(), (sf * rejected.any(-1)).sum()]
        S = _reduce(first, dp_group)
        N, NS = S[0], S[1]
        second, big = [], []
        for i, (o, units, umask, c, sv, lo) in enumerate(rows):
            s = S[2 + 9 * i: 11 + 9 * i]
            second += [(mf * (c - s[3] / max(N, 1)) ** 2).sum(), (sf * (sv - s[4] / max(NS, 1)) ** 2).sum()]
            ninf = torch.tensor(-math.inf, dtype=f64, device=m.device)
            on, son = umask > 0, seq
            big += [units[on].max() if on.any() else ninf, (-units[on]).max() if on.any() else ninf,
                    sv[son].max() if son.any() else ninf, (-sv[son]).max() if son.any() else ninf,
                    sv[son].abs().max() if son.any() else ninf]
        V = _reduce(second, dp_group) if second else []
        M = _reduce(big, dp_group, dist.ReduceOp.MAX) if big else []

        metrics = _rs_metrics(rows, S, V, M, N, NS)
        dtype = response_mask.dtype if response_mask.is_floating_point() else torch.float32
    return keep.to(dtype), metrics


def _rs_metrics(rows: list, S, V, M, N, NS) -> dict:
    """Rejection sampling's metrics from the reduced sums ``S``, squared deviations ``V`` and
    maxima ``M`` (see :func:`rollout_rejection_mask`); N tokens and NS non-empty sequences."""

    def fin(v: float) -> float:   # a max/min with no unit on any rank: 0
        return v if math.isfinite(v) else 0.0

    metrics = {}
    for i, (o, units, umask, c, sv, lo) in enumerate(rows):
        s_stat, u_hi, u_lo, _, s_sv, sv_hi, sv_lo, rej_tok, rej_seq = S[2 + 9 * i: 11 + 9 * i]
        NU = N if o.agg == "token" else NS
        mx, mn, smx, smn, dev = M[5 * i: 5 * i + 5]
        p = f"rollout_corr/rollout_rs_{o.name}_"
        metrics.update({
            p + "mean": s_stat / max(N, 1), p + "max": fin(mx), p + "min": fin(-mn),
            p + "fraction_high": u_hi / max(NU, 1), p + "fraction_low": u_lo / max(NU, 1),
            p + "std": math.sqrt(V[2 * i] / N) if N > 1 else 0.0,
            p + "seq_mean": s_sv / max(NS, 1), p + "seq_std": math.sqrt(V[2 * i + 1] / (NS - 1)) if NS > 1 else 0.0,
            p + "seq_max": fin(smx), p + "seq_min": fin(-smn), p + "seq_max_deviation": fin(dev),
            p + "seq_fraction_high": sv_hi / max(NS, 1)})
        if lo is not None:
            metrics[p + "seq_fraction_low"] = sv_lo / max(NS, 1)
        metrics[p + "masked_fraction"] = rej_tok / max(N, 1)
        metrics[p + "seq_masked_fraction"] = rej_seq / max(NS, 1)
    metrics["rollout_corr/rollout_rs_masked_fraction"] = S[-2] / max(N, 1)
    metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = S[-1] / max(NS, 1)
    return metrics


def apply_weights(losses: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-token losses reweighted (the weights carry no gradient)."""
    return losses if weights is None else losses * weights.detach().to(losses.dtype)
