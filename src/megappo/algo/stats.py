"""Masked statistics, optionally global over a data-parallel process group.

Shapes: ``x`` and ``mask`` are broadcast-compatible, usually ``(B, T)`` with ``mask`` 1 on
response tokens. With ``group`` the sums and counts are all-reduced first, so the result is the
statistic of the concatenated batch whatever way it was split over ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten", "global_count", "global_seq_count",
           "rollout_probs_diff"]


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """sum(x * mask); masked positions never contribute, even when they hold nan/inf."""
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim=dim)


def global_count(mask: torch.Tensor, group=None) -> torch.Tensor:
    """Number of unmasked elements over all ranks of ``group`` (float64 scalar)."""
    return _all_reduce(mask.to(torch.float64).sum().reshape(1), group)[0]


def global_seq_count(mask: torch.Tensor, group=None) -> torch.Tensor:
    """Number of sequences (rows of ``mask``) with at least one unmasked token, over all ranks."""
    return _all_reduce((mask.sum(-1) > 0).to(torch.float64).sum().reshape(1), group)[0]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None, group=None) -> torch.Tensor:
    """mean over unmasked elements: sum(x*m) / sum(m). ``group`` makes it DP-global (dim=None only).

    An all-masked input gives 0 (not nan), so an empty micro-batch adds nothing to a metric.
    """
    if dim is not None:
        if group is not None:
            raise ValueError("masked_mean: a DP-global mean is only defined over all elements (dim=None)")
        return masked_sum(x, mask, dim) / mask.to(x.dtype).sum(dim=dim).clamp(min=1)
    acc = torch.stack([masked_sum(x.double(), mask), mask.double().sum()])
    s, n = _all_reduce(acc, group)
    return (s / n.clamp(min=1)).to(x.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, group=None) -> torch.Tensor:
    """Variance of the unmasked elements, Bessel-corrected by default: sum((x-mean)^2 m) / (n-1)."""
    mean = masked_mean(x, mask, group=group).double()
    acc = torch.stack([masked_sum((x.double() - mean) ** 2, mask), mask.double().sum()])
    ss, n = _all_reduce(acc, group)
    if unbiased:
        if n.item() < 2:
            raise ValueError(f"masked_var: the unbiased variance needs at least 2 unmasked elements, got {int(n.item())}")
        return (ss / (n - 1)).to(x.dtype)
    return (ss / n.clamp(min=1)).to(x.dtype)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, group=None, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over unmasked elements (unbiased var); masked positions give 0.

    ``shift_mean=False`` keeps the mean: x / sqrt(var + eps) ... + mean, i.e. only rescales.
    """
    mean = masked_mean(x, mask, group=group)
    var = masked_var(x, mask, group=group)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros((), dtype=out.dtype, device=out.device))


def rollout_probs_diff(rollout_log_probs: torch.Tensor, old_log_prob: torch.Tensor, response_mask: torch.Tensor,
                       dp_group=None) -> dict:
    """Drift between the rollout engine and the trainer on the same tokens, verl's
    ``calculate_debug_metrics`` (v0.9.0): d = |exp(rollout_logp) - exp(old_logp)| over the response
    tokens -> max, mean, std (Bessel-corrected, as torch.std); DP-global with ``dp_group`` (verl
    takes the whole batch on its driver). No token on any rank: 0s (verl: nan)."""
    m = response_mask.bool()
    d = (torch.exp(rollout_log_probs.double()) - torch.exp(old_log_prob.double())).abs()
    d = torch.where(m, d, torch.zeros((), dtype=d.dtype, device=d.device))
    n, total = _all_reduce(torch.stack([m.to(d.dtype).sum(), d.sum()]), dp_group).tolist()
    big = d.max().reshape(1) if d.numel() else torch.zeros(1, dtype=d.dtype, device=d.device)   # d >= 0
    if dp_group is not None:
        dist.all_reduce(big, op=dist.ReduceOp.MAX, group=dp_group)
    mean = total / n if n else 0.0
    ss = _all_reduce(torch.where(m, (d - mean) ** 2, torch.zeros((), dtype=d.dtype, device=d.device)).sum().reshape(1),
                     dp_group).item()
    return {"training/rollout_probs_diff_max": float(big.item()) if n else 0.0,
            "training/rollout_probs_diff_mean": mean,
            "training/rollout_probs_diff_std": (ss / (n - 1)) ** 0.5 if n > 1 else 0.0}
