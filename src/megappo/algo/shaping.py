"""Reward shaping: DAPO's overlong penalty (arXiv 2503.14476, verl's ``reward_model.overlong_buffer``).

A response longer than ``max_response_length - buffer_len`` loses ``penalty_factor`` times the
fraction of the buffer it used: penalty = min(0, -(len - (max_len - buffer_len)) / buffer_len
* penalty_factor), added to its score on its last token. A response that fills the whole buffer
(a truncated one) loses ``penalty_factor``.
"""
from __future__ import annotations

import torch

__all__ = ["overlong_penalty"]


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
