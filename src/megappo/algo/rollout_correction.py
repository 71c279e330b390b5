"""Rollout correction (verl's ``algorithm.rollout_correction``): the rollout engine samples from
pi_rollout, which is not exactly the trainer's pi_old (other kernels, precision, a stale engine);
truncated importance weights w = min(pi_old / pi_rollout, threshold) reweight each token's (or
sequence's) policy loss so the update stays an estimate under pi_old.

``rollout_is="token"``: w_t = min(exp(old_logp_t - rollout_logp_t), C) per token (biased, low
variance). ``"sequence"``: one weight per sequence, min(exp(sum_t (old_logp_t - rollout_logp_t)),
C), on every token of it (unbiased before truncation, high variance). Log-ratios are clamped to
+-20 before exp. ``batch_normalize`` divides by the weights' mean over the whole batch (every DP
rank; tokens or sequences as the level), so they average 1. Weights are constants (no gradient).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .stats import masked_mean

__all__ = ["ROLLOUT_IS_LEVELS", "rollout_is_weights"]

ROLLOUT_IS_LEVELS = ("token", "sequence")
SAFETY_BOUND = 20.0


def _global_max_min(x: torch.Tensor, mask: torch.Tensor, group) -> tuple[float, float]:
    vals = x[mask.bool()]
    big = torch.tensor([vals.max().item() if vals.numel() else -float("inf"),
                        -(vals.min().item()) if vals.numel() else -float("inf")], dtype=torch.float64, device=x.device)
    if group is not None:
        dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)
    return float(big[0]), float(-big[1])


def rollout_is_weights(old_log_prob: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor, *,
                       level: str = "token", threshold: float = 2.0, batch_normalize: bool = False,
                       dp_group=None) -> tuple[torch.Tensor, dict]:
    """(B, T) truncated importance weights (0 off the mask) and their metrics (verl's
    ``rollout_corr/`` names; before truncation: mean, max, min, the fraction above the threshold;
    after: the effective sample size 1 / mean((w / mean w)^2)). DP-global with ``dp_group``."""
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {', '.join(ROLLOUT_IS_LEVELS)}, got {level!r}")
    if not threshold > 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {threshold}")
    m = response_mask.to(torch.float64)
    log_ratio = (old_log_prob.double() - rollout_log_probs.double()) * m
    with torch.no_grad():
        # the weighted units: every token, or one entry per non-empty sequence
        if level == "token":
            unit = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
            unit_mask = m
        else:
            unit = torch.exp(log_ratio.sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND))
            unit_mask = (m.sum(-1) > 0).to(m.dtype)
        mx, mn = _global_max_min(unit, unit_mask, dp_group)
        metrics = {"rollout_corr/rollout_is_mean": masked_mean(unit, unit_mask, group=dp_group).item(),
                   "rollout_corr/rollout_is_max": mx, "rollout_corr/rollout_is_min": mn,
                   "rollout_corr/rollout_is_ratio_fraction_high":
                       masked_mean((unit > threshold).to(m.dtype), unit_mask, group=dp_group).item()}
        unit = unit.clamp(max=threshold)
        if batch_normalize:
            mean = masked_mean(unit, unit_mask, group=dp_group).item()
            factor = mean if mean > 1e-8 else 1.0
            unit = unit / factor
            metrics["rollout_corr/rollout_is_batch_norm_factor"] = factor
        mean = masked_mean(unit, unit_mask, group=dp_group)
        sq = masked_mean((unit / mean.clamp(min=1e-12)) ** 2, unit_mask, group=dp_group)
        metrics["rollout_corr/rollout_is_eff_sample_size"] = (1.0 / sq.clamp(min=1e-12)).item()
        w = (unit if level == "token" else unit[:, None].expand_as(m)) * m
    return w.to(old_log_prob.dtype) * response_mask.to(old_log_prob.dtype), metrics


def apply_weights(losses: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-token losses reweighted (the weights carry no gradient)."""
    return losses if weights is None else losses * weights.detach().to(losses.dtype)
