"""Policy losses by name (verl's ``actor.policy_loss.loss_mode``).

Every loss takes (B, T) ``old_log_prob``, ``log_prob``, ``advantages``, ``response_mask`` and
returns ``(loss, metrics)``: a scalar that adds up over micro-batches and data-parallel ranks when
``global_tokens``/``global_seqs`` are the mini-batch's (see :func:`megappo.algo.agg_loss`), and
token-mean metrics (``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``) of this micro-batch, each
what verl v0.9.0's loss of that name logs (``ppo_kl``: mean of old_logp - logp, for kl_cov of
|logp - old_logp|). Where verl's loss logs no such key (gpg, dro, kl_cov, clip_cov's
pg_clipfrac_lower, reinforce's pg_clipfrac) megappo still returns it: 0 for a clip fraction
(nothing of that kind is clipped) except reinforce's pg_clipfrac (its truncated share), and the
usual signed ppo_kl for gpg; tests/unit/test_verl_parity.py holds verl's formulas.
Formulas are in each docstring; ``r = exp(logp - old_logp)``, ``A`` the advantage, ``m`` the mask.

``clip_cov`` and ``kl_cov`` treat a few tokens of the whole mini-batch differently; which ones is
decided before the micro-batches run, DP-globally (:mod:`megappo.algo.cov_selection`), and
reaches the loss as ``cov_selected``.
"""
from __future__ import annotations

from typing import Callable

import torch

from .losses import agg_loss, policy_loss
from .rollout_correction import apply_weights, truncated_is_weights
from .stats import masked_mean, masked_sum

__all__ = ["POLICY_LOSSES", "COV_LOSSES", "register_policy_loss", "list_policy_losses", "compute_policy_loss"]

COV_LOSSES = ("clip_cov", "kl_cov")  # need ``cov_selected``: the mini-batch's token selection

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
    tau_pos/tau_neg, dro_beta, global_tokens/global_seqs, norm_factor, rollout_is_weights (rollout
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
    whatever loss_agg_mode says: verl v0.9.0 (and its main branch of 2026-08-22) hard-codes that
    mode in compute_policy_loss_gspo too, whatever actor.loss_agg_mode is. GSPO's own ranges are
    small (3e-4, 4e-4). pg_clipfrac_lower is 0 (as verl)."""
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


@register_policy_loss("reinforce")
def _reinforce(old_log_prob, log_prob, advantages, response_mask, *, rollout_is=None, rollout_is_threshold=2.0,
               loss_agg_mode="token-mean", **kw):
    """REINFORCE with truncated importance weights: rollout correction's bypass-mode loss (verl's
    algorithm.rollout_correction.loss_type=reinforce, where old_log_prob is the engine's):
    L = -A w logp, no ratio, no clip, loss_agg_mode as set; w = sg(min(pi / pi_old, C)) from the
    current log-probs, per token (rollout_is=token) or one per sequence, the product of its
    tokens' ratios (sequence), log-ratios clamped to +-20, C = rollout_is_threshold; rollout_is
    null: w = 1 (plain REINFORCE, as gpg). The gradient -A min(r, C) grad logp is the truncated
    off-policy policy gradient. ``pg_clipfrac``: the share of tokens whose weight was truncated."""
    log_ratio = log_prob - old_log_prob
    losses, truncated = -advantages * log_prob, None
    if rollout_is is not None:
        w, truncated = truncated_is_weights(log_ratio, response_mask, level=rollout_is, threshold=rollout_is_threshold)
        losses = losses * w.to(losses.dtype)
    loss = agg_loss(apply_weights(losses, kw.get("rollout_is_weights")), response_mask, loss_agg_mode, **_norm(kw))
    return loss, _metrics(log_ratio, response_mask, clipfrac=truncated)


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
    of L_i over (non-empty) sequences (loss_agg_mode is not used, as in verl). verl v0.9.0 takes
    torch.mean over the micro-batch's rows instead: the same on one micro-batch without empty
    rows; here global_seqs makes micro-batches and DP ranks add up to the mini-batch's mean."""
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


def _dppo(old_log_prob, log_prob, advantages, response_mask, valid, clip_ratio_c, loss_agg_mode, kw):
    """DPPO's surrogate on the tokens its trust region keeps (``valid``, (B, T) bool, no gradient):
    L = -A sg(min(r, C)) logp, 0 elsewhere. Metrics: pg_clipfrac is the fraction of tokens outside
    the trust region, pg_clipfrac_lower the fraction kept whose ratio was truncated at C (verl's)."""
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    r = torch.exp(log_ratio)
    # truncated IS weight, a constant: the gradient is the policy gradient -A min(r, C) grad logp
    w = torch.clamp(r, max=clip_ratio_c).detach()
    # where, not a 0/1 factor: a token outside the region gets no gradient even if its logp is -inf
    losses = torch.where(valid, -advantages * w * log_prob, torch.zeros((), dtype=log_prob.dtype, device=log_prob.device))
    loss = agg_loss(apply_weights(losses, kw.get("rollout_is_weights")), response_mask, loss_agg_mode, **_norm(kw))
    return loss, _metrics(log_ratio, response_mask, clipfrac=~valid, clipfrac_lower=(r > clip_ratio_c) & valid)


@register_policy_loss("dppo_tv")
def _dppo_tv(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low=0.2, clip_ratio_high=0.2,
             clip_ratio_c=3.0, loss_agg_mode="token-mean", **kw):
    """DPPO-Binary-TV (arXiv 2602.04879): the trust region bounds the sampled token's probability
    change p - p_old (its binary total variation) instead of the ratio p / p_old, which PPO clips
    too hard for rare tokens and too little for likely ones:
    L = -A sg(min(r, C)) logp on tokens with p - p_old <= delta_high (A > 0) or
    p - p_old >= -delta_low (A <= 0), 0 elsewhere; delta_low/high are clip_ratio_low/high, C is
    clip_ratio_c (truncated IS, not dual clip: the paper wants it large), loss_agg_mode as set."""
    with torch.no_grad():
        dp = torch.exp(log_prob) - torch.exp(old_log_prob)
        valid = torch.where(advantages > 0, dp <= clip_ratio_high, dp >= -clip_ratio_low)
    return _dppo(old_log_prob, log_prob, advantages, response_mask, valid, clip_ratio_c, loss_agg_mode, kw)


@register_policy_loss("dppo_kl")
def _dppo_kl(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low=0.2, clip_ratio_high=0.2,
             clip_ratio_c=3.0, loss_agg_mode="token-mean", **kw):
    """DPPO-Binary-KL (arXiv 2602.04879): as dppo_tv, with the trust region on the binary KL
    D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p)) of the sampled token:
    L = -A sg(min(r, C)) logp on tokens with D <= delta_high or p <= p_old (A > 0), D <= delta_low
    or p >= p_old (A <= 0), 0 elsewhere: only a move the advantage pushes for is bounded."""
    with torch.no_grad():
        p, p_old = torch.exp(log_prob), torch.exp(old_log_prob)
        # log(1 - p) as log(-expm1(logp)): 1 - exp(logp) cancels for likely tokens; +1e-8 (verl's)
        # keeps p = 1 finite
        log_q, log_q_old = torch.log(-torch.expm1(log_prob) + 1e-8), torch.log(-torch.expm1(old_log_prob) + 1e-8)
        kl = p_old * (old_log_prob - log_prob) + (1.0 - p_old) * (log_q_old - log_q)
        valid = torch.where(advantages > 0, (kl <= clip_ratio_high) | (p <= p_old), (kl <= clip_ratio_low) | (p >= p_old))
    return _dppo(old_log_prob, log_prob, advantages, response_mask, valid, clip_ratio_c, loss_agg_mode, kw)


@register_policy_loss("dro")
def _dro(old_log_prob, log_prob, advantages, response_mask, *, dro_beta=None, loss_agg_mode="token-mean", **kw):
    """DRO, Direct Reward Optimisation (Richemond et al., arXiv 2405.19107; verl's form is Tinker's):
    L = -(A logp - beta / 2 (logp - old_logp)^2), a policy gradient with a quadratic penalty on the
    log-ratio instead of a clip; its gradient -(A - beta (logp - old_logp)) grad logp is DRO's
    policy gradient with pi_old as the reference. The penalty acts on every unmasked token, A = 0
    ones too. beta is policy_loss.dro_beta (no default: required)."""
    if dro_beta is None or not dro_beta > 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.dro_beta must be > 0 for loss_mode dro, got {dro_beta}")
    log_ratio = log_prob - old_log_prob
    losses = -(advantages * log_prob - 0.5 * dro_beta * log_ratio.square())
    loss = agg_loss(apply_weights(losses, kw.get("rollout_is_weights")), response_mask, loss_agg_mode, **_norm(kw))
    return loss, _metrics(log_ratio, response_mask)


def _need_selection(name: str, cov_selected):
    if cov_selected is None:
        raise ValueError(f"loss_mode {name} needs cov_selected: the mini-batch's tokens chosen by "
                         f"megappo.algo.{name}_selection before its micro-batches run")
    return cov_selected.to(torch.bool)


@register_policy_loss("clip_cov")
def _clip_cov(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low=0.2, clip_ratio_high=0.2,
              loss_agg_mode="token-mean", cov_selected=None, **kw):
    """Clip-Cov (arXiv 2505.22617): PPO's clipped objective max(-A r, -A clip(r, 1 - eps_low,
    1 + eps_high)) (no dual clip, as verl) times 0 on the selected tokens (:func:`clip_cov_selection`:
    a random few with high covariance of advantage and log-prob), which so give no gradient.
    ``pg_clipfrac``: the share of tokens taken out."""
    sel = _need_selection("clip_cov", cov_selected)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    losses = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))
    losses = losses * (~sel).to(losses.dtype)
    loss = agg_loss(apply_weights(losses, kw.get("rollout_is_weights")), response_mask, loss_agg_mode, **_norm(kw))
    return loss, _metrics(log_ratio, response_mask, clipfrac=sel & (response_mask > 0))


@register_policy_loss("kl_cov")
def _kl_cov(old_log_prob, log_prob, advantages, response_mask, *, ppo_kl_coef=0.1, loss_agg_mode="token-mean",
            cov_selected=None, **kw):
    """KL-Cov (arXiv 2505.22617): the unclipped -A r on every token, plus ppo_kl_coef |logp - old_logp|
    on the selected tokens (:func:`kl_cov_selection`: those with the largest covariance of
    advantage and log-prob). ``ppo_kl`` is the mean of |logp - old_logp|, as verl logs it for this
    loss (v0.9.0), not the signed mean of the other losses; nothing is clipped (pg_clipfrac 0; verl
    logs no pg_clipfrac here; the actor logs the share penalised as actor/cov_selected_fraction)."""
    sel = _need_selection("kl_cov", cov_selected)
    log_ratio = log_prob - old_log_prob
    losses = -advantages * torch.exp(log_ratio) + sel.to(log_prob.dtype) * ppo_kl_coef * log_ratio.abs()
    loss = agg_loss(apply_weights(losses, kw.get("rollout_is_weights")), response_mask, loss_agg_mode, **_norm(kw))
    metrics = _metrics(log_ratio, response_mask)
    with torch.no_grad():
        metrics["ppo_kl"] = masked_mean(log_ratio.detach().abs(), response_mask)
    return loss, metrics
