"""DAPO's batch shaping (arXiv 2503.14476): the overlong penalty (verl's
``reward_model.overlong_buffer``) and the group filter of dynamic sampling (``algorithm.filter_groups``).

A response longer than ``max_response_length - buffer_len`` loses ``penalty_factor`` times the
fraction of the buffer it used: penalty = min(0, -(len - (max_len - buffer_len)) / buffer_len
* penalty_factor), added to its score on its last token. A response that fills the whole buffer
(a truncated one) loses ``penalty_factor``.
"""
from __future__ import annotations

import torch

__all__ = ["overlong_penalty", "informative_groups"]


def overlong_penalty(token_level_scores: torch.Tensor, response_mask: torch.Tensor, *, max_response_length: int,
                     buffer_len: int, penalty_factor: float) -> tuple[torch.Tensor, dict]:
    """(B, T) scores with the penalty added at each response's last token, and metrics:
    ``reward/overlong_penalty_mean`` (over responses) and ``reward/overlong_fraction``."""
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(f"buffer_len must be in (0, max_response_length={max_response_length}], got {buffer_len}")
    n = response_mask.sum(-1)
    exceed = n - (max_response_length - buffer_len)
    penalty = torch.clamp(-exceed.to(torch.float64) / buffer_len * penalty_factor, max=0.0)
    out = token_level_scores.clone()
    rows = torch.nonzero(n > 0).squeeze(-1)
    last = (n[rows].long() - 1)
    out[rows, last] = out[rows, last] + penalty[rows].to(out.dtype)
    metrics = {"reward/overlong_penalty_mean": float(penalty.mean()) if penalty.numel() else 0.0,
               "reward/overlong_fraction": float((penalty < 0).double().mean()) if penalty.numel() else 0.0}
    return out, metrics


def informative_groups(metric: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """(B,) bool: the samples of groups whose ``metric`` is not the same for all members, and of
    singleton groups (nothing to compare; verl keeps them too). A group that is all right or all
    wrong has zero advantage under every group-relative estimator: it only dilutes the batch.
    "The same" is exact equality, where verl tests ``np.std(values) > 0``, which keeps e.g. a
    group of three 0.1s (the mean 0.30000000000000004 / 3 is not 0.1)."""
    if metric.shape != group_index.shape or metric.dim() != 1:
        raise ValueError(f"metric {tuple(metric.shape)} and group_index {tuple(group_index.shape)} must be the same (B,)")
    ids, inverse = torch.unique(group_index, return_inverse=True)
    m = metric.to(torch.float64)
    lo = torch.full((len(ids),), float("inf"), dtype=torch.float64).scatter_reduce(0, inverse, m, "amin")
    hi = torch.full((len(ids),), float("-inf"), dtype=torch.float64).scatter_reduce(0, inverse, m, "amax")
    size = torch.zeros(len(ids), dtype=torch.long).scatter_add(0, inverse, torch.ones_like(inverse))
    return ((hi > lo) | (size == 1))[inverse]
