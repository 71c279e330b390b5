"""PPO losses and loss aggregation.

``loss_mat``/masks are (B, T). Aggregation takes explicit global normalisers so that the
gradient of a mini-batch is the same whatever its split into data-parallel ranks and
micro-batches: each micro-batch contributes sum(its part) / (global normaliser), and the parts
add up (gradient accumulation + a DP *sum*) to the loss of the whole mini-batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .stats import masked_mean, masked_sum

__all__ = ["LOSS_AGG_MODES", "list_loss_agg_modes", "agg_loss", "policy_loss", "value_loss", "entropy_from_logits",
           "PolicyLossSpec", "ValueLossSpec"]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def list_loss_agg_modes() -> list[str]:
    return list(LOSS_AGG_MODES)


@dataclass(frozen=True)
class PolicyLossSpec:
    """The actor's loss: clipped/dual-clip policy gradient - entropy bonus + KL loss, settings
    resolved once (the trainer builds it from actor_rollout_ref.actor)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0            # dual-clip constant
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    norm_factor: Optional[float] = None  # seq-mean-token-sum-norm's constant (max response length)
    loss_mode: str = "vanilla"           # megappo.algo.policy_losses
    tau_pos: float = 1.0                 # SAPO's gate temperatures
    tau_neg: float = 1.05
    dro_beta: Optional[float] = None     # DRO's log-ratio penalty; loss_mode dro requires it > 0
    clip_cov_ratio: float = 0.0002       # Clip-Cov: share of tokens taken out of the gradient
    clip_cov_lb: float = 1.0             # Clip-Cov: covariance range of the candidates
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002         # KL-Cov: share of tokens penalised
    ppo_kl_coef: float = 0.1             # KL-Cov: weight of |logp - old_logp| on them
    rollout_is: Optional[str] = None     # reinforce: truncated IS weights pi / pi_old per token|sequence
    rollout_is_threshold: float = 2.0
    # bypass mode's rejection sampling (rollout_rs, rollout_rs_threshold): the current policy against
    # the old log-probs (the engine's), per micro-batch, on the policy loss only; None: off
    bypass_rejection: Optional[tuple] = None

    def loss_kwargs(self) -> dict:
        """The keyword arguments of :func:`megappo.algo.compute_policy_loss` this spec fixes."""
        return dict(clip_ratio_low=self.clip_ratio_low, clip_ratio_high=self.clip_ratio_high,
                    clip_ratio_c=self.clip_ratio_c, loss_agg_mode=self.loss_agg_mode, tau_pos=self.tau_pos,
                    tau_neg=self.tau_neg, dro_beta=self.dro_beta, ppo_kl_coef=self.ppo_kl_coef,
                    rollout_is=self.rollout_is, rollout_is_threshold=self.rollout_is_threshold)

    def clip_cov_kwargs(self) -> dict:
        """The settings of :func:`megappo.algo.clip_cov_selection`."""
        return dict(clip_ratio_low=self.clip_ratio_low, clip_ratio_high=self.clip_ratio_high,
                    clip_cov_ratio=self.clip_cov_ratio, clip_cov_lb=self.clip_cov_lb, clip_cov_ub=self.clip_cov_ub)


@dataclass(frozen=True)
class ValueLossSpec:
    """The critic's clipped value loss, settings resolved once (from critic.*)."""

    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    norm_factor: Optional[float] = None


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, *, global_tokens=None, global_seqs=None,
             norm_factor: Optional[float] = None) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar.

    token-mean               sum_{i,t} l m / N_tok
    seq-mean-token-sum       sum_i (sum_t l m) / N_seq
    seq-mean-token-mean      sum_i (sum_t l m / sum_t m) / N_seq
    seq-mean-token-sum-norm  sum_i (sum_t l m) / (N_seq * norm_factor)   (Dr.GRPO; norm_factor
                             should be a constant such as max_response_length; default T)
    N_tok / N_seq default to this batch's token count / count of sequences with at least one
    unmasked token (empty rows, e.g. DP padding, count for nothing); pass the global counts of
    the mini-batch to make micro-batch losses add up to the mini-batch loss.
    """
    m = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        n = m.sum() if global_tokens is None else global_tokens
        return masked_sum(loss_mat, mask) / torch.as_tensor(n, dtype=loss_mat.dtype).clamp(min=1)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; supported: {', '.join(LOSS_AGG_MODES)}")
    tok = m.sum(-1)
    n_seq = (tok > 0).to(loss_mat.dtype).sum() if global_seqs is None else global_seqs
    n_seq = torch.as_tensor(n_seq, dtype=loss_mat.dtype).clamp(min=1)
    seq_sum = masked_sum(loss_mat, mask, dim=-1)
    if mode == "seq-mean-token-sum":
        return seq_sum.sum() / n_seq
    if mode == "seq-mean-token-mean":
        return (seq_sum / tok.clamp(min=1)).sum() / n_seq
    factor = float(loss_mat.shape[-1] if norm_factor is None else norm_factor)
    return seq_sum.sum() / (n_seq * factor)


def policy_loss(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low: float = 0.2,
                clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0, loss_agg_mode: str = "token-mean",
                global_tokens=None, global_seqs=None, norm_factor=None, rollout_is_weights=None):
    """Clipped PPO objective with dual clip.

    ratio = exp(clamp(logp - old_logp, -20, 20));
    L1 = max(-A ratio, -A clamp(ratio, 1 - eps_low, 1 + eps_high));
    for A < 0 the loss is also bounded by -A c (dual clip, c > 1): L = min(L1, -A c).
    ``rollout_is_weights`` (B, T), when given, multiply each token's loss (rollout correction).
    Metrics (token means over the mask): pg_clipfrac (the clipped branch is active),
    pg_clipfrac_lower (the dual-clip bound is active), ppo_kl (mean of old_logp - logp).
    Returns ``(loss, metrics)`` with tensor metrics (detached).
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for the dual-clip bound, got {clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    l_unclipped = -advantages * ratio
    l_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    l1 = torch.maximum(l_unclipped, l_clipped)
    l_dual = -advantages * clip_ratio_c
    l2 = torch.minimum(l1, l_dual)
    neg = advantages < 0
    losses = torch.where(neg, l2, l1)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights.detach().to(losses.dtype)
    loss = agg_loss(losses, response_mask, loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs,
                    norm_factor=norm_factor)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((l_clipped > l_unclipped).to(log_prob.dtype), response_mask),
            "pg_clipfrac_lower": masked_mean(((l1 > l_dual) & neg).to(log_prob.dtype), response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, metrics


def value_loss(vpreds, returns, values, response_mask, *, cliprange_value: float, loss_agg_mode: str = "token-mean",
               global_tokens=None, global_seqs=None, norm_factor=None):
    """0.5 * agg(max((v - R)^2, (clip(v, V_old - c, V_old + c) - R)^2)).

    Returns ``(loss, vf_clipfrac)``; vf_clipfrac is the token fraction where the clipped term wins.
    """
    # clamp vpreds itself: ``values + clamp(vpreds - values)`` is vpreds only up to round-off, and
    # the round-off alone made (l2 > l1) true on ~10% of unclipped tokens (vf_clipfrac read 0.1 where
    # nothing was clipped)
    v_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    l1 = (vpreds - returns).square()
    l2 = (v_clipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(l1, l2), response_mask, loss_agg_mode, global_tokens=global_tokens,
                          global_seqs=global_seqs, norm_factor=norm_factor)
    with torch.no_grad():
        clipfrac = masked_mean((l2 > l1).to(vpreds.dtype), response_mask)
    return loss, clipfrac


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum softmax(z) z. (..., V) -> (...)."""
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)
