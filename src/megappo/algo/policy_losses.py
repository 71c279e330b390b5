"""Policy losses by name (verl's ``actor.policy_loss.loss_mode``).

Every loss takes (B, T) ``old_log_prob``, ``log_prob``, ``advantages``, ``response_mask`` and
returns ``(loss, metrics)``: a scalar that adds up over micro-batches and data-parallel ranks when
``global_tokens``/``global_seqs`` are the mini-batch's (see :func:`megappo.algo.agg_loss`), and
token-mean metrics (``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``) of this micro-batch.
Formulas are in each docstring; ``r = exp(logp - old_logp)``, ``A`` the advantage, ``m`` the mask.

Losses that rank or sample tokens over the whole batch (verl's ``clip_cov``, ``kl_cov``) are not
here: per micro-batch they are not the mini-batch's loss, and a DP-invariant form needs a
global selection (issue 5/7, open).
"""
from __future__ import annotations

from typing import Callable

import torch

from .losses import agg_loss, policy_loss
from .rollout_correction import apply_weights
from .stats import masked_mean, masked_sum

__all__ = ["POLICY_LOSSES", "register_policy_loss", "list_policy_losses", "compute_policy_loss"]

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn
    return deco


def list_policy_losses() -> list[str]:
    return sorted(POLICY_LOSSES)


def compute_policy_loss(loss_mode: str, old_log_prob, log_prob, advantages, response_mask, **kw):
    """The loss ``loss_mode`` names; ``kw``: clip_ratio_low/high, clip_ratio_c, loss_agg_mode,
    tau_pos/tau_neg, global_tokens/global_seqs, norm_factor, rollout_is_weights (rollout
    correction: each token's loss times its weight; each loss takes what it uses)."""
    if loss_mode not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {loss_mode!r}; registered: {', '.join(list_policy_losses())}")
    return POLICY_LOSSES[loss_mode](old_log_prob, log_prob, advantages, response_mask, **kw)


def _norm(kw: dict) -> dict:
    return {k: kw.get(k) for k in ("global_tokens", "global_seqs", "norm_factor")}


def _metrics(log_ratio, mask, clipfrac=None, clipfrac_lower=None) -> dict:
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    with torch.no_grad():
        return {"pg_clipfrac": zero if clipfrac is None else masked_mean(clipfrac.to(log_ratio.dtype), mask),
                "pg_clipfrac_lower": zero if clipfrac_lower is None else masked_mean(clipfrac_lower.to(log_ratio.dtype), mask),
                "ppo_kl": masked_mean(-log_ratio.detach(), mask)}


@register_policy_loss("vanilla")
def _vanilla(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low=0.2, clip_ratio_high=0.2,
             clip_ratio_c=3.0, loss_agg_mode="token-mean", **kw):
    """PPO's clipped objective with dual clip (:func:`megappo.algo.policy_loss`)."""
    return policy_loss(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low=clip_ratio_low,
                       clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode,
                       rollout_is_weights=kw.get("rollout_is_weights"), **_norm(kw))


@register_policy_loss("gspo")
def _gspo(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low=0.2, clip_ratio_high=0.2, **kw):
    """GSPO (arXiv 2507.18071): one ratio per sequence, s_i = exp(mean_t (logp - old_logp)),
    carried to each token as s_it = sg(s_i) * pi / sg(pi) (log s_it clamped at 10);
    L = max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high)), aggregated seq-mean-token-mean
    whatever loss_agg_mode says (as verl). GSPO's own ranges are small (3e-4, 4e-4)."""
    m = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    seq = masked_sum(log_ratio, response_mask, dim=-1) / m.sum(-1).clamp(min=1)
    log_s = torch.clamp(log_prob - log_prob.detach() + seq.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    l1 = -advantages * s
    l2 = -advantages * torch.clamp(s, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = agg_loss(apply_weights(torch.maximum(l1, l2), kw.get("rollout_is_weights")), response_mask,
                    "seq-mean-token-mean", **_norm(kw))
    return loss, _metrics(log_ratio, response_mask, clipfrac=l2 > l1)


@register_policy_loss("sapo")
def _sapo(old_log_prob, log_prob, advantages, response_mask, *, tau_pos=1.0, tau_neg=1.05, **kw):
    """SAPO (arXiv 2511.20347): a smooth gate instead of a clip,
    L = -A f(r), f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos where A > 0 else tau_neg
    (r from the log-ratio clamped to [-20, 20]); aggregated seq-mean-token-mean (as verl)."""
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    r = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, torch.as_tensor(tau_pos, dtype=r.dtype, device=r.device),
                      torch.as_tensor(tau_neg, dtype=r.dtype, device=r.device))
    gate = torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau)
    loss = agg_loss(apply_weights(-gate * advantages, kw.get("rollout_is_weights")), response_mask,
                    "seq-mean-token-mean", **_norm(kw))
    return loss, _metrics(log_ratio, response_mask)


@register_policy_loss("gpg")
def _gpg(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", **kw):
    """GPG (arXiv 2504.02546): plain policy gradient, L = -A logp, no ratio, no clip."""
    loss = agg_loss(apply_weights(-log_prob * advantages, kw.get("rollout_is_weights")), response_mask, loss_agg_mode,
                    **_norm(kw))
    return loss, _metrics(log_prob - old_log_prob, response_mask)


@register_policy_loss("cispo")
def _cispo(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low=0.2, clip_ratio_high=0.2,
           loss_agg_mode="token-mean", **kw):
    """CISPO (arXiv 2506.13585): clip the importance weight, not the update,
    L = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp: every token keeps a gradient."""
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    r = torch.exp(log_ratio)
    clipped = torch.clamp(r, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = agg_loss(apply_weights(-clipped.detach() * advantages * log_prob, kw.get("rollout_is_weights")),
                    response_mask, loss_agg_mode, **_norm(kw))
    return loss, _metrics(log_ratio, response_mask, clipfrac=r != clipped)


@register_policy_loss("geo_mean")
def _geo_mean(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low=0.2, clip_ratio_high=0.2, **kw):
    """GMPO (arXiv 2507.20673): the geometric mean of the token ratios per sequence, each token's
    log-ratio clipped in log space on the side its advantage's sign makes harmful:
    d_t = sign(A) min(sign(A) d, sign(A) clip(d, -eps_low, eps_high)), d = logp - old_logp;
    L_i = -Abar_i exp(mean_t d_t) with Abar_i the sequence's mean advantage; the loss is the mean
    of L_i over (non-empty) sequences (loss_agg_mode is not used, as in verl)."""
    m = response_mask.to(log_prob.dtype)
    d = log_prob - old_log_prob
    sgn = torch.sign(advantages)
    d_clip = torch.clamp(d, -clip_ratio_low, clip_ratio_high)
    d_min = sgn * torch.minimum(sgn * d, sgn * d_clip)
    n = m.sum(-1)
    ratio = torch.exp((d_min * m).sum(-1) / n.clamp(min=1))   # verl: / (n + 1e-8); empty rows add 0 either way
    adv = (advantages * m).sum(-1) / n.clamp(min=1)
    n_seq = kw.get("global_seqs")
    n_seq = (n > 0).to(m.dtype).sum() if n_seq is None else torch.as_tensor(n_seq, dtype=m.dtype)
    per_seq = -adv * ratio
    w = kw.get("rollout_is_weights")
    if w is not None:   # one weight per sequence: the geometric mean of its tokens' (as verl; weights of 1 give 1)
        per_seq = per_seq * torch.exp((torch.log(w.detach().to(m.dtype).clamp(min=1e-10)) * m).sum(-1) / n.clamp(min=1))
    loss = per_seq.sum() / n_seq.clamp(min=1)
    clipped = d != d_clip
    return loss, _metrics(d, response_mask, clipfrac=clipped & (advantages > 0), clipfrac_lower=clipped & (advantages < 0))
