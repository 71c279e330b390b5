"""Token selection of Clip-Cov and KL-Cov (arXiv 2505.22617, verl's ``clip_cov`` / ``kl_cov``).

Both rank the tokens of a batch by the covariance of their advantage with their log-probability,
``cov = (A - mean A) (logp - mean logp)`` (means over the batch's response tokens), and treat a few
of them differently: Clip-Cov takes a random ``clip_cov_ratio`` share of the tokens whose cov lies
in ``(clip_cov_lb, clip_cov_ub)`` (and that PPO's clip did not already cut) out of the gradient;
KL-Cov adds ``ppo_kl_coef |logp - old_logp|`` to the ``kl_cov_ratio`` share with the largest cov.

verl selects within each micro-batch, so the tokens chosen, and the loss, change with the
micro-batch size and the data-parallel size. Here the selection is over the whole mini-batch,
made once before its micro-batches run (from the current policy's log-probs of the mini-batch):
means and counts are DP-global, the top-k is DP-global (each rank offers its own best k, every
rank ranks the union), and Clip-Cov's random choice ranks tokens by a hash of (seed, sample, position)
so that the same tokens are chosen however the batch is split. Ties in cov are broken by that key.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .stats import _all_reduce, global_count

__all__ = ["token_cov", "token_keys", "select_top_k", "clip_cov_selection", "kl_cov_selection"]


def token_cov(advantages: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor,
              dp_group=None) -> torch.Tensor:
    """(B, T) float64 ``(A - mean A)(logp - mean logp)``, means over every response token of the
    (DP-global) batch; 0 on masked positions."""
    m = response_mask.to(torch.float64)
    a, lp = advantages.detach().to(torch.float64), log_prob.detach().to(torch.float64)
    n, a_sum, lp_sum = _all_reduce(torch.stack([m.sum(), (a * m).sum(), (lp * m).sum()]), dp_group)
    n = n.clamp(min=1)
    return (a - a_sum / n) * (lp - lp_sum / n) * m


_MASK64 = (1 << 64) - 1


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic; logical shifts emulated by masking)."""
    def shr(v, s):
        return (v >> s) & ((1 << (64 - s)) - 1)

    x = x + _to_i64(0x9E3779B97F4A7C15)
    x = (x ^ shr(x, 30)) * _to_i64(0xBF58476D1CE4E5B9)
    x = (x ^ shr(x, 27)) * _to_i64(0x94D049BB133111EB)
    return x ^ shr(x, 31)


def _to_i64(u: int) -> int:
    u &= _MASK64
    return u - (1 << 64) if u >= 1 << 63 else u


def token_keys(sample_index: torch.Tensor, T: int, seed: int) -> torch.Tensor:
    """(B, T) float64 in [0, 1): a pseudo-random key per (seed, sample, position), the same
    whichever rank or micro-batch holds the sample."""
    s = sample_index.to(torch.int64)[:, None] * T + torch.arange(T, dtype=torch.int64, device=sample_index.device)[None]
    h = _splitmix64(_splitmix64(torch.full_like(s, _to_i64(seed))) ^ s)
    return ((h >> 11) & ((1 << 53) - 1)).to(torch.float64) / float(1 << 53)  # the top 53 bits


def select_top_k(score: torch.Tensor, eligible: torch.Tensor, k: int, keys: torch.Tensor,
                 dp_group=None) -> torch.Tensor:
    """(B, T) bool: the ``k`` eligible tokens of the (DP-global) batch with the largest ``score``,
    ties broken by the smaller ``keys``; every eligible token when there are fewer than ``k``."""
    sel = torch.zeros_like(eligible, dtype=torch.bool)
    s, kk = score[eligible].to(torch.float64), keys[eligible].to(torch.float64)
    order = _lexsort(s, kk)
    mine = torch.full((k, 2), float("inf"), dtype=torch.float64, device=score.device)
    mine[:, 0] = -float("inf")
    top = order[:k]
    mine[:len(top), 0], mine[:len(top), 1] = s[top], kk[top]
    if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(dp_group))]
        dist.all_gather(parts, mine, group=dp_group)
        mine = torch.cat(parts)
    real = mine[torch.isfinite(mine[:, 1])]
    if len(real) == 0:
        return sel
    last = real[_lexsort(real[:, 0], real[:, 1])[min(k, len(real)) - 1]]
    chosen = (s > last[0]) | ((s == last[0]) & (kk <= last[1]))
    sel[eligible] = chosen
    return sel


def _lexsort(primary: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Indices ordering by ``primary`` descending, then ``key`` ascending."""
    by_key = torch.sort(key, stable=True).indices
    return by_key[torch.sort(primary[by_key], descending=True, stable=True).indices]


def clip_cov_selection(old_log_prob, log_prob, advantages, response_mask, keys, *, clip_ratio_low: float,
                       clip_ratio_high: float, clip_cov_ratio: float, clip_cov_lb: float, clip_cov_ub: float,
                       dp_group=None) -> torch.Tensor:
    """(B, T) bool: Clip-Cov's tokens to take out of the gradient. Candidates: response tokens with
    ``clip_cov_lb < cov < clip_cov_ub`` that PPO's clip leaves alone; chosen: ``max(1,
    int(clip_cov_ratio x tokens))`` of them by the smallest key (a random draw, split-invariant)."""
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    mask = response_mask > 0
    cov = token_cov(advantages, log_prob, response_mask, dp_group)
    ratio = torch.exp(log_prob.detach().to(torch.float64) - old_log_prob.detach().to(torch.float64))
    a = advantages.detach().to(torch.float64)
    clipped = (-a * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)) > (-a * ratio)
    eligible = mask & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    k = max(int(clip_cov_ratio * int(global_count(response_mask, dp_group))), 1)
    return select_top_k(-keys, eligible, k, keys, dp_group)


def kl_cov_selection(log_prob, advantages, response_mask, keys, *, kl_cov_ratio: float,
                     dp_group=None) -> torch.Tensor:
    """(B, T) bool: KL-Cov's ``max(1, int(kl_cov_ratio x tokens))`` response tokens with the
    largest cov."""
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    cov = token_cov(advantages, log_prob, response_mask, dp_group)
    k = max(1, int(int(global_count(response_mask, dp_group)) * kl_cov_ratio))
    return select_top_k(cov, response_mask > 0, k, keys, dp_group)
