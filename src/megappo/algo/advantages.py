"""Advantage estimators and their registry.

Notation: ``B`` samples, ``T`` response tokens (right-padded). ``token_level_rewards (B, T)``,
``values (B, T)``, ``response_mask (B, T)`` with 1 on tokens the policy generated. Outcome
estimators use the sequence score ``s_i = sum_t r_{i,t}``. ``group_index (B,)`` is an integer id
per sample: samples of one prompt share it (GRPO/RLOO groups).

Masked positions *inside* a sequence (tool/observation tokens in multi-turn) are skipped by the
recurrences: the running return/advantage and the next value carry across them unchanged, so
whatever values or rewards sit there do not change the result. Outputs are 0 at masked positions.

Data-parallel: ``dp_group`` makes whitening and group statistics global, so results equal the
single-process computation on the concatenated batch, however it is split over ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .stats import masked_whiten

__all__ = [
    "gae",
    "gae_reference",
    "discounted_returns",
    "discounted_returns_reference",
    "group_stats",
    "group_sums",
    "group_max",
    "GAE_ADV_NORMS",
    "SHIFT_FREE_ADV_NORMS",
    "CRITIC_TARGETS",
    "group_relative_rewards",
    "group_normalised_gae",
    "group_shifted_gae",
    "group_centred_gae",
    "group_cv_gae",
    "critic_cv_coefficient",
    "critic_cv_fit",
    "critic_cv_beta",
    "CvMemory",
    "equal_score_share",
    "length_adaptive_lam",
    "gae_per_sample_lam",
    "EstimatorSpec",
    "ESTIMATOR_INPUTS",
    "register_estimator",
    "get_estimator",
    "list_estimators",
    "compute_advantages",
]


def _zero_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


# ---------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------

def gae_reference(token_level_rewards, values, response_mask, gamma: float, lam: float):
    """The plain reverse loop over time; the oracle for :func:`gae`.

    For response positions t (skipping masked ones), with t' the next response position:
        delta_t = r_t + gamma * V_{t'} - V_t          (V after the last response token = 0)
        A_t     = delta_t + gamma * lam * A_{t'}
        returns = A + V
    Returns ``(advantages, returns)``, both (B, T), unwhitened, 0 at masked positions.
    """
    B, T = token_level_rewards.shape
    m = response_mask.to(values.dtype)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    last_adv = torch.zeros(B, dtype=values.dtype, device=values.device)
    adv = torch.zeros_like(values)
    for t in reversed(range(T)):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * last_adv
        mt = m[:, t]
        next_value = mt * values[:, t] + (1 - mt) * next_value
        last_adv = mt * a + (1 - mt) * last_adv
        adv[:, t] = a
    adv = _zero_masked(adv, response_mask)
    ret = _zero_masked(adv + values, response_mask)
    return adv, ret


def _suffix_scan(x: torch.Tensor, decay: float, chunk: int = 32) -> torch.Tensor:
    """y_t = x_t + decay * y_{t+1} along the last dim (y past the end = 0), without a loop over T.

    The row is cut into chunks of C positions. Inside a chunk the recurrence is a (C, C)
    upper-triangular matrix of powers decay^(s-t) (one batched matmul); the value entering each
    chunk from the next is the recurrence over chunk starts with factor decay^C, again a small
    triangular matmul over the chunks. Powers only shrink, so nothing overflows.
    """
    B, T = x.shape
    if decay == 0.0:
        return x.clone()
    C = min(chunk, T)
    nb = (T + C - 1) // C
    if nb * C != T:
        x = torch.nn.functional.pad(x, (0, nb * C - T))
    dt, dev = x.dtype, x.device
    i = torch.arange(C, device=dev)
    expo = (i[None, :] - i[:, None]).to(torch.float64)          # s - t
    W = torch.where(expo >= 0, decay ** expo.clamp(min=0), torch.zeros((), dtype=torch.float64, device=dev))
    y_local = torch.matmul(x.view(B, nb, C), W.t().to(dt))       # (B, nb, C)
    # carry_in[b] = y at the start of chunk b+1 = sum_{b' > b} decay^(C (b' - b - 1)) y_local[b', 0]
    j = torch.arange(nb, device=dev)
    e2 = (j[None, :] - j[:, None] - 1).to(torch.float64)        # b' - b - 1
    K = torch.where(e2 >= 0, (decay ** C) ** e2.clamp(min=0), torch.zeros((), dtype=torch.float64, device=dev))
    carry_in = torch.matmul(y_local[:, :, 0], K.t().to(dt))     # (B, nb)
    tail = (decay ** (C - i).to(torch.float64)).to(dt)          # decay^(C - t)
    y_local.baddbmm_(carry_in[:, :, None], tail.expand(B, 1, C))
    return y_local.reshape(B, nb * C)[:, :T]


class _Compaction:
    """Moves each row's unmasked positions to the front (in order) and back again, so that
    recurrences that skip masked positions become plain recurrences over a prefix."""

    def __init__(self, mask: torch.Tensor, dtype: torch.dtype):
        self.mask = mask.to(dtype)  # no copy when the mask already has the compute dtype
        T = mask.shape[1]
        # A right-padded (prefix) mask needs no moving: skip the scatter/gather.
        self.identity = bool((self.mask[:, 1:] <= self.mask[:, :-1]).all()) if T > 1 else True
        if not self.identity:
            m = mask.bool()
            pos = torch.cumsum(m, 1) - 1
            self.index = torch.where(m, pos, torch.full_like(pos, T))  # masked -> a dump column

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.mask
        if self.identity:
            return x
        B, T = x.shape
        out = torch.zeros(B, T + 1, dtype=x.dtype, device=x.device)
        return out.scatter_(1, self.index, x)[:, :T]

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """Back to the original positions, 0 where masked. For a prefix mask the packed result
        of a recurrence over zero-padded inputs is already 0 past the end: nothing to do."""
        if self.identity:
            return y
        y = torch.nn.functional.pad(y, (0, 1)).gather(1, self.index)
        return y * self.mask


def gae(token_level_rewards, values, response_mask, gamma: float, lam: float):
    """Generalised advantage estimation without a Python loop over time (oracle:
    :func:`gae_reference`, same semantics).

    Response tokens are packed to the front of each row (skipping masked positions), then
    delta_j = r_j + gamma V_{j+1} - V_j and A_j = delta_j + gamma lam A_{j+1} is solved by a
    chunked triangular matmul (:func:`_suffix_scan`). Returns ``(advantages, returns)`` (B, T),
    unwhitened, 0 where masked, in the promoted dtype of rewards and values.
    """
    dtype = torch.promote_types(values.dtype, token_level_rewards.dtype)
    c = _Compaction(response_mask, dtype)
    v = c.pack(values.to(dtype))
    delta = c.pack(token_level_rewards.to(dtype)).sub_(v)
    delta[:, :-1].add_(v[:, 1:], alpha=gamma)   # + gamma V_{j+1}; 0 past each row's last token
    adv = _suffix_scan(delta, gamma * lam)
    del delta
    # Fresh multi-MB buffers cost page faults on CPU (glibc returns them to the OS): reuse v's.
    return c.unpack(adv), c.unpack(v.add_(adv))


# ---------------------------------------------------------------------------------------------
# Discounted return-to-go (REINFORCE++)
# ---------------------------------------------------------------------------------------------

def discounted_returns_reference(token_level_rewards, response_mask, gamma: float):
    """G_t = r_t + gamma * G_{t'} over response positions (loop); 0 at masked positions."""
    B, T = token_level_rewards.shape
    m = response_mask.to(token_level_rewards.dtype)
    running = torch.zeros(B, dtype=token_level_rewards.dtype, device=token_level_rewards.device)
    out = torch.zeros_like(token_level_rewards)
    for t in reversed(range(T)):
        g = token_level_rewards[:, t] + gamma * running
        running = m[:, t] * g + (1 - m[:, t]) * running
        out[:, t] = g
    return _zero_masked(out, response_mask)


def discounted_returns(token_level_rewards, response_mask, gamma: float):
    """Vectorised :func:`discounted_returns_reference`."""
    c = _Compaction(response_mask, token_level_rewards.dtype)
    return c.unpack(_suffix_scan(c.pack(token_level_rewards), gamma))


# ---------------------------------------------------------------------------------------------
# Group statistics (GRPO / RLOO), DP-global when a group is given
# ---------------------------------------------------------------------------------------------

def _group_ids(group_index: torch.Tensor, dp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted ids of every group in the batch, each sample's position in them). With
    ``dp_group`` the ids of every rank's samples: all ranks get the same table."""
    gid = group_index.to(torch.int64)
    if dp_group is not None:
        # Agree on the set of ids: gather every rank's ids (small: one int per sample).
        # On the inputs' device: the group's backend decides (NCCL: cuda tensors, gloo: host).
        world, dv = dist.get_world_size(dp_group), gid.device
        n_local = torch.tensor([gid.numel()], dtype=torch.int64, device=dv)
        sizes = [torch.zeros(1, dtype=torch.int64, device=dv) for _ in range(world)]
        dist.all_gather(sizes, n_local, group=dp_group)
        mx = int(max(x.item() for x in sizes))
        padded = torch.full((mx,), -1, dtype=torch.int64, device=dv)
        padded[: gid.numel()] = gid
        bufs = [torch.empty(mx, dtype=torch.int64, device=dv) for _ in range(world)]
        dist.all_gather(bufs, padded, group=dp_group)
        all_ids = torch.cat(bufs)
        uniq = torch.unique(all_ids[all_ids >= 0]).to(gid.device)
    else:
        uniq = torch.unique(gid)
    return uniq, torch.searchsorted(uniq, gid)


def group_sums(columns: torch.Tensor, group_index: torch.Tensor, dp_group=None) -> torch.Tensor:
    """(B, k) float64 -> (B, k): each sample's group totals of the k columns (over every rank's
    samples with ``dp_group``)."""
    uniq, inv = _group_ids(group_index, dp_group)
    cols = columns.to(torch.float64)
    table = torch.zeros(uniq.numel(), cols.shape[1], dtype=torch.float64, device=cols.device).index_add_(0, inv, cols)
    if dp_group is not None:
        dist.all_reduce(table, group=dp_group)
    return table[inv]


def group_max(values: torch.Tensor, group_index: torch.Tensor, dp_group=None) -> torch.Tensor:
    """(B,) -> (B,) float64: each sample's group maximum (over every rank's samples with
    ``dp_group``)."""
    uniq, inv = _group_ids(group_index, dp_group)
    v = values.to(torch.float64)
    table = torch.full((uniq.numel(),), float("-inf"), dtype=torch.float64, device=v.device)
    table.scatter_reduce_(0, inv, v, reduce="amax", include_self=True)
    if dp_group is not None:
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=dp_group)
    return table[inv]


def group_stats(scores: torch.Tensor, group_index: torch.Tensor, dp_group=None):
    """Per-sample (count, mean, unbiased std) of the sample's group.

    scores (B,), group_index (B,) integer ids. With ``dp_group`` the members of a group may sit
    on different ranks: per-id sums are all-reduced over a table keyed by the union of ids.
    Singleton groups get std = nan-free 0 (callers decide what a singleton means).
    """
    s = scores.to(torch.float64)
    uniq, inv = _group_ids(group_index, dp_group)
    G = uniq.numel()
    table = torch.zeros(3, G, dtype=torch.float64, device=s.device)
    table[0].index_add_(0, inv, torch.ones_like(s))
    table[1].index_add_(0, inv, s)
    if dp_group is not None:
        t01 = table[:2].clone()
        dist.all_reduce(t01, group=dp_group)
        table[:2] = t01
    cnt, tot = table[0], table[1]
    mean = tot / cnt.clamp(min=1)
    dev = (s - mean[inv]) ** 2
    ss = torch.zeros(G, dtype=torch.float64, device=s.device).index_add_(0, inv, dev)
    if dp_group is not None:
        dist.all_reduce(ss, group=dp_group)
    std = torch.where(cnt > 1, torch.sqrt(ss / (cnt - 1).clamp(min=1)), torch.zeros_like(ss))
    return cnt[inv], mean[inv], std[inv]


def leave_one_out_mean(x: torch.Tensor, group_index: torch.Tensor, dp_group=None) -> torch.Tensor:
    """(B,) -> (B,) float64: the mean of ``x`` over the OTHER members of each sample's group (RLOO's
    baseline); 0 for a sample alone in its group."""
    cnt, mean, _ = group_stats(x, group_index, dp_group)
    return torch.where(cnt > 1, (cnt * mean - x.to(torch.float64)) / (cnt - 1).clamp(min=1), torch.zeros_like(mean))


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EstimatorSpec:
    name: str
    fn: Callable
    needs_critic: bool = False     # uses values (the run builds a critic)
    group_relative: bool = False   # compares samples of one prompt (needs rollout.n > 1)
    needs_baseline: bool = False   # needs a per-sample baseline score (ReMax)
    inputs: tuple[str, ...] = ()   # further compute_advantages arguments it needs (see ESTIMATOR_INPUTS)


ESTIMATOR_INPUTS = {
    "old_log_probs": "the actor's per-token log-probs of the response before the update (B, T)",
    "sum_pi_squared": "per-token sum over the vocabulary of pi^2 from the same forward pass as old_log_probs (B, T) "
                      "(megappo.distributed.sum_pi_squared_from_vocab_parallel_logits)",
    "reward_components": "a dict name -> per-sample score (B,) of every reward component named by "
                         "algorithm.gdpo_reward_keys",
}
"""Optional inputs of :func:`compute_advantages` that an estimator can require (``inputs=``)."""


_REGISTRY: dict[str, EstimatorSpec] = {}


def register_estimator(name: str, *, needs_critic: bool = False, group_relative: bool = False,
                       needs_baseline: bool = False, inputs: tuple[str, ...] = (), aliases: tuple[str, ...] = ()):
    """Decorator: register ``fn(**batch) -> (advantages, returns)`` under ``name`` (and aliases).

    The function receives keyword arguments token_level_rewards, response_mask, values,
    group_index, gamma, lam, norm_adv_by_std_in_grpo, baseline_scores, dp_group, old_log_probs,
    sum_pi_squared, rollout_is_weights, reward_components, reward_weights (None when not given);
    ``inputs`` names those of :data:`ESTIMATOR_INPUTS` it cannot do without.
    """
    unknown = [i for i in inputs if i not in ESTIMATOR_INPUTS]
    if unknown:
        raise ValueError(f"unknown estimator inputs {unknown}; known: {', '.join(ESTIMATOR_INPUTS)}")

    def deco(fn):
        for n in (name,) + tuple(aliases):
            if n in _REGISTRY:
                raise ValueError(f"advantage estimator {n!r} is already registered")
            _REGISTRY[n] = EstimatorSpec(n, fn, needs_critic, group_relative, needs_baseline, tuple(inputs))
        return fn
    return deco


def get_estimator(name: str) -> EstimatorSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown advantage estimator {name!r}; registered: {', '.join(list_estimators())}") from None


def list_estimators() -> list[str]:
    return sorted(_REGISTRY)


def compute_advantages(estimator: str, *, token_level_rewards, response_mask, values=None, group_index=None,
                       gamma: float = 1.0, lam: float = 1.0, norm_adv_by_std_in_grpo: bool = True,
                       baseline_scores=None, dp_group=None, old_log_probs=None, sum_pi_squared=None,
                       rollout_is_weights=None, reward_components=None, reward_weights=None,
                       gae_adv_norm: str = "batch", critic_lam=None, lam_length_alpha=None, cv_memory=None,
                       critic_target: str = "return"):
    """Dispatch to a registered estimator; returns ``(advantages, returns)``, both (B, T).

    Optional inputs, used by the estimators that ask for them (others ignore them):
    ``old_log_probs`` and ``sum_pi_squared`` (B, T) and ``rollout_is_weights`` (B, T, rollout
    correction's truncated IS weights) for optimal_token_baseline; ``reward_components`` (dict
    name -> (B,) scores) and ``reward_weights`` (one weight per component, None: all 1) for gdpo.
    """
    spec = get_estimator(estimator)
    if spec.needs_critic and values is None:
        raise ValueError(f"advantage estimator {estimator!r} needs values (a critic)")
    if spec.group_relative and group_index is None:
        raise ValueError(f"advantage estimator {estimator!r} needs group_index (one id per prompt)")
    if spec.needs_baseline and baseline_scores is None:
        raise ValueError(f"advantage estimator {estimator!r} needs baseline_scores (the greedy rollout's scores)")
    given = {"old_log_probs": old_log_probs, "sum_pi_squared": sum_pi_squared, "reward_components": reward_components}
    for name in spec.inputs:
        if given[name] is None:
            raise ValueError(f"advantage estimator {estimator!r} needs {name}: {ESTIMATOR_INPUTS[name]}")
    return spec.fn(token_level_rewards=token_level_rewards, response_mask=response_mask, values=values,
                   group_index=group_index, gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
                   baseline_scores=baseline_scores, dp_group=dp_group, old_log_probs=old_log_probs,
                   sum_pi_squared=sum_pi_squared, rollout_is_weights=rollout_is_weights,
                   reward_components=reward_components, reward_weights=reward_weights,
                   gae_adv_norm=gae_adv_norm, critic_lam=critic_lam, lam_length_alpha=lam_length_alpha,
                   cv_memory=cv_memory, critic_target=critic_target)


def _outcome(scores: torch.Tensor, response_mask, dtype) -> torch.Tensor:
    """Broadcast a per-sample advantage (B,) over its response tokens."""
    return _zero_masked(scores.to(dtype)[:, None].expand(response_mask.shape), response_mask)


def _scores(token_level_rewards, response_mask):
    return (token_level_rewards.to(torch.float64) * response_mask.to(torch.float64)).sum(-1)


GAE_ADV_NORMS = ("batch", "group", "group_shift", "group_centred", "group_cv")
# the normalisations whose advantages are unchanged when a sample's values all move by one
# constant (they use V(s_t) - V(s_0) only): the critic may learn its values on any per-sample level
SHIFT_FREE_ADV_NORMS = ("group_shift", "group_centred", "group_cv")
CRITIC_TARGETS = ("return", "group_relative")


def group_relative_rewards(token_level_rewards, response_mask, group_index, gamma: float, dp_group=None):
    """(B, T) the rewards behind the critic's targets with ``critic_target=group_relative``.

    Each sample's rewards are shifted so that every return G_t drops by c_i, the mean return
    from the prompt of the OTHER samples of its group (leave-one-out; 0 for a sample alone):
    r'_t = r_t - (1 - gamma) c_i at each response token and a further -gamma c_i at the last one
    (gamma = 1: only the last reward moves). GAE's targets on these rewards are the usual ones
    minus c_i at every lambda when the values are level-shifted by c_i (the TD errors are equal).
    Why: the samples of the group are drawn independently given the prompt, so E[c_i | s_t] =
    V(s_0) and the critic learns V(s_t) - V(s_0), the part of the value that differs within a
    prompt group. That is all the group-normalised advantages use (SHIFT_FREE_ADV_NORMS); trained
    on the whole return, the critic spends its fit (and, through Adam's second moment, its step
    size) on each prompt's difficulty, which the group's mean score replaces anyway. Measured
    (benchmarks/critic_probe.py --target mc_centred, 15,360 samples, within-group slope of the
    values on the right words so far; 1.0 = exact per-token credit): pick_first 0.31 and 0.21
    against 0.075 and 0.17 (seeds 0, 1), copy 0.20 against 0.005. In PPO the policy learnt
    faster for it on pick_first only (docs/benchmarks.md), so it is an option."""
    r = token_level_rewards.to(torch.float64)
    m = response_mask.to(torch.float64)
    first = response_mask.to(torch.int64).argmax(1, keepdim=True)
    g0 = discounted_returns(r, response_mask, gamma).gather(1, first).squeeze(1)   # return from the prompt
    c = leave_one_out_mean(g0, group_index, dp_group)
    last = (m * torch.arange(1, m.shape[1] + 1, dtype=torch.float64, device=m.device)).argmax(1, keepdim=True)
    shift = (1 - gamma) * c[:, None] * m
    shift.scatter_add_(1, last, (gamma * c * m.gather(1, last).squeeze(1))[:, None])
    return (r - shift).to(token_level_rewards.dtype)


def length_adaptive_lam(response_mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive policy lambda, per sample: lam = 1 - 1 / (alpha * l) for a
    response of l tokens, clamped to [0, 1] (short responses give a negative value: 0, TD(0)).
    (B, T) mask -> (B,) float64."""
    length = response_mask.to(torch.float64).sum(-1).clamp(min=1)
    return (1.0 - 1.0 / (alpha * length)).clamp(0.0, 1.0)


def gae_per_sample_lam(token_level_rewards, values, response_mask, gamma: float, lam: torch.Tensor):
    """:func:`gae` with one lambda per sample (``lam`` (B,)): the rows sharing a lambda go
    through :func:`gae` together. Returns ``(advantages, returns)`` (B, T)."""
    dtype = torch.promote_types(values.dtype, token_level_rewards.dtype)
    adv = torch.zeros(values.shape, dtype=dtype, device=values.device)
    ret = torch.zeros_like(adv)
    for v in torch.unique(lam).tolist():
        rows = torch.nonzero(lam == v).squeeze(-1).to(values.device)
        a, r = gae(token_level_rewards[rows], values[rows], response_mask[rows], gamma, v)
        adv[rows], ret[rows] = a, r
    return adv, ret


def group_normalised_gae(adv, values, token_level_rewards, response_mask, group_index, dp_group=None,
                         eps: float = 1e-6):
    """GAE advantages on the group's baseline and scale (PPO with a critic, n samples per prompt).

    adv (B, T) unwhitened GAE advantages, values (B, T) the critic's (column 0 is V(s_0), the
    value of the prompt), group_index (B,) one id per prompt. Per sample i of group g:
        A'_it = (A_it + V_i(s_0) - mean_g(score)) / std_g(score)        (0 where std_g = 0)
    With lambda = 1, A_it = score_i - V(s_t), so A'_it = (score_i - mean_g - (V(s_t) - V(s_0))) / std_g:
    GRPO's baseline and scale for the sequence, the critic's change of value since the prompt
    as a per-token baseline (it depends on the state, not on the action taken there: no bias).
    Why: whitening over the batch divides by the std of R - V, which is the critic's error once
    the critic predicts each prompt's outcome; that error, scaled to unit size, then rewards the
    responses of prompts the policy always gets wrong (measured: the policy collapsed onto them).
    Here a group whose samples all score the same gets exactly 0, as in GRPO. Returns (B, T).
    """
    score = _scores(token_level_rewards, response_mask)
    _, mean, std = group_stats(score, group_index, dp_group)
    a = adv.to(torch.float64) + (_prompt_value(values, response_mask) - mean)[:, None]
    return _zero_masked(_on_group_scale(a, std, eps).to(adv.dtype), response_mask)


def _prompt_value(values, response_mask) -> torch.Tensor:
    """(B,) float64 V(s_0), the critic's value of the prompt (0 for an empty response)."""
    v0 = values[:, 0].to(torch.float64)
    return torch.where(response_mask[:, 0].bool(), v0, torch.zeros_like(v0))


def _on_group_scale(a: torch.Tensor, std: torch.Tensor, eps: float) -> torch.Tensor:
    """(B, T) advantages divided by their group's score std; 0 for a group that scored alike."""
    return torch.where((std > eps)[:, None], a / (std[:, None] + eps), torch.zeros_like(a))


def _shifted_gae(token_level_rewards, values, response_mask, group_index, gamma, lam, dp_group):
    """(GAE on values shifted per sample so that V(s_0) = the group's mean score (B, T) float64,
    and each sample's score, group mean, group std (B,))."""
    score = _scores(token_level_rewards, response_mask)
    _, mean, std = group_stats(score, group_index, dp_group)
    shifted = _zero_masked(values.to(torch.float64) + (mean - _prompt_value(values, response_mask))[:, None],
                           response_mask)
    adv, _ = gae(token_level_rewards.to(torch.float64), shifted, response_mask, gamma, lam)
    return adv, score, mean, std


def group_shifted_gae(token_level_rewards, values, response_mask, group_index, gamma: float, lam: float,
                      dp_group=None, eps: float = 1e-6):
    """GAE(lambda) on the group's baseline and scale, consistent for every lambda.

    Each sample's values are shifted by one constant so that its V(s_0) becomes its prompt
    group's mean score (V'_t = V_t - V(s_0) + mean_g), GAE(gamma, lambda) runs on V', and the
    result is divided by the group's score std (0 for a group whose samples all score alike):
        A'_t = (A_t - lam^k_t (mean_g - V(s_0))) / std_g      (gamma = 1; k_t: response tokens after t)
    i.e. the group's correction of the critic's prompt value enters through the last token's
    residual. lambda = 1 (gamma = 1): exactly :func:`group_normalised_gae`
    ((score - mean_g - (V_t - V_0)) / std_g, GRPO with the critic's change of value as a per-token
    baseline); lambda = 0: the critic's TD residuals (r_t + V_{t+1} - V_t) on the group's scale,
    the last one with the group's baseline. :func:`group_normalised_gae` at lambda < 1 adds the
    whole (V_0 - mean_g) to every token instead (a bias on early tokens). Returns (B, T).
    """
    adv, _, _, std = _shifted_gae(token_level_rewards, values, response_mask, group_index, gamma, lam, dp_group)
    return _zero_masked(_on_group_scale(adv, std, eps).to(values.dtype), response_mask)


def _centred_parts(token_level_rewards, values, response_mask, group_index, gamma, lam, dp_group):
    """(o, d, std): the outcome's part of the advantage before its scale, o = GAE(gamma, lambda)
    with every V(s_t) = the group's mean score (B, T): what a critic that knows nothing beyond the
    prompt gives (GRPO's score_i - mean_g at gamma = lambda = 1 with the reward at the last token);
    the critic's within-group correction d_it = C_it - mean_{j in g, t}(C_jt) (B, T), where
    C = (the group_shift advantage) - o is the part that comes from V(s_t) - V(s_0) (GAE is
    linear in the values); both float64 and masked; and each sample's group score std (B,).
    Why o is not score - mean_g at lambda < 1: GAE(lambda) of a constant critic is
    lambda^k (score - mean_g) (k: tokens after t), and counting the (lambda^k - 1)(score - mean_g)
    as the critic's correction made group_cv's fit see knowledge where there is none (beta_hat 4.5
    at lambda 0.95 for a critic that outputs 0). See :func:`group_centred_gae`."""
    x, score, mean, std = _shifted_gae(token_level_rewards, values, response_mask, group_index, gamma, lam, dp_group)
    m = response_mask.to(torch.float64)
    o, _ = gae(token_level_rewards.to(torch.float64), mean[:, None] * m, response_mask, gamma, lam)
    o = o * m
    c = (x - o) * m
    T = Tg = c.shape[1]
    if dp_group is not None:   # the ranks may hold different widths T: sum over the widest one's columns
        width = torch.tensor([T], dtype=torch.int64, device=c.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=dp_group)
        Tg = int(width.item())
    pad = (lambda z: torch.nn.functional.pad(z, (0, Tg - T))) if Tg > T else (lambda z: z)
    sums = group_sums(torch.cat([pad(c), pad(m)], 1), group_index, dp_group)
    common = sums[:, :T] / sums[:, Tg:Tg + T].clamp(min=1)
    return o, (c - common) * m, std


def group_centred_gae(token_level_rewards, values, response_mask, group_index, gamma: float, lam: float,
                      dp_group=None, eps: float = 1e-6):
    """:func:`group_shifted_gae` keeping only the part of the critic's correction that differs
    between the samples of a prompt group.

    With O_it the outcome's part (GAE(lambda) of a critic that knows only the group's mean score:
    score_i - mean_g, GRPO's advantage before its scale, at gamma = lambda = 1) and X_it the
    unnormalised group_shift advantage, the critic's correction is C_it = X_it - O_it; its mean
    over the group's samples that have a response token at t is a per-position baseline common
    to the whole group (zero expected gradient: variance only), so it is removed:
        A_it = (O_it + C_it - mean_{j in g, t}(C_jt)) / std_g          (0 where std_g = 0)
    A critic that knows nothing beyond the prompt (any V(s_t) shared by the group) gives exactly
    GRPO at lambda = 1 (below 1, with one response length: lambda^k (score_i - mean_g)); what is
    left is the critic's per-token knowledge (V(s_t) differs between samples only through their
    earlier tokens). Returns (B, T)."""
    o, d, std = _centred_parts(token_level_rewards, values, response_mask, group_index, gamma, lam, dp_group)
    return _zero_masked(_on_group_scale(o + d, std, eps).to(values.dtype), response_mask)


class CvMemory:
    """The least-squares sums behind ``group_cv``'s beta, carried from step to step.

    The critic's per-token skill changes slowly, but one batch measures it badly exactly where it
    matters: early (few groups with varied scores) and late (almost every sample right), where a
    single batch's beta jumped between 0 and 1 from one step to the next (measured on the CPU main
    job: 0/1 on alternate steps once the score passed 0.97). Each step's sums are added to the
    previous ones times ``decay`` (0: this batch only), and the clustered variance of their
    numerator times decay^2, so beta and its standard error are those of the least-squares fit over
    the recent batches, batch k back weighted decay^k. Every rank holds the same sums (they are
    DP-global); they go into the trainer's checkpoint, so a resumed run continues bit for bit."""

    def __init__(self, decay: float = 0.0, beta_max: float = 1.0, min_t: float = 1.0):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        if not beta_max > 0.0:
            raise ValueError(f"beta_max must be > 0, got {beta_max!r}")
        if not min_t >= 1.0:
            raise ValueError(f"min_t must be >= 1, got {min_t!r}")
        self.decay, self.beta_max, self.min_t = float(decay), float(beta_max), float(min_t)
        self.t = 0.0                                       # the last fit's t-statistic (critic/advantages/cv_t)
        self.sums = torch.zeros(4, dtype=torch.float64)   # sum xy, sum xx, sum yy, clustered var of sum xy
        self.beta = 0.0                                    # the last beta used (critic/advantages/cv_beta)
        self.beta_fit = 0.0                                # its least-squares fit (critic/advantages/cv_beta_fit)
        self.share = 0.0                                   # the last batch's outcome share (critic/advantages/cv_share)
        self.gain = 0.0                                    # the last batch's variance removed (critic/advantages/cv_gain)
        self._batch = torch.zeros(3, dtype=torch.float64)  # the last batch's own sum xy, sum xx, sum yy

    def state_dict(self) -> dict:
        return {"decay": self.decay, "sums": [float(v) for v in self.sums], "beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        sums = torch.tensor([float(v) for v in state["sums"]], dtype=torch.float64)
        if sums.shape != (4,):
            raise ValueError(f"gae_cv sums must hold 4 numbers, got {len(sums)}")
        self.sums, self.beta = sums, float(state["beta"])


def critic_cv_fit(o, d, std, response_mask, group_index, dp_group=None, eps: float = 1e-6,
                  memory: CvMemory | None = None):
    """(beta_hat, se): the least-squares coefficient of the outcome on the critic's within-group
    correction, beta_hat = -sum(o d w) / sum(d^2 w) with w = 1 / std_g^2 over the response tokens of
    groups whose scores differ (DP-global), and its standard error clustered by prompt group (a
    group's tokens share one outcome noise: counting tokens as independent would make the error
    look tens of times smaller than it is). (0.0, inf) when d is 0 there (or at rounding level).
    With ``memory`` the sums are those of :class:`CvMemory` (this batch's added; memory updated), and
    ``memory.share`` is this batch's sum(x y) / sum(y y) with x = -d / std_g, y = o / std_g: the share
    of the outcome's within-group deviation that the critic's correction carries (the regression
    the other way round). The fit alone cannot tell a critic that carries the outcome from one whose
    tiny values merely point its way (both can fit 1 or more); the share can: 0 for a critic that
    knows only the prompt, at most the part of the outcome knowable before each token for an exact
    one (echo, decided by the first of 4 tokens: 3/4). :func:`critic_cv_coefficient` then sets
    ``memory.gain`` from this batch's sums."""
    live = (std > eps).to(torch.float64)[:, None] * response_mask.to(torch.float64)
    scale = live / (std.to(torch.float64)[:, None] + eps)
    y, x = o * scale, -d * scale
    t = torch.stack([(x * y).sum(), (x * x).sum(), (y * y).sum()])
    if dp_group is not None:
        dist.all_reduce(t, group=dp_group)
    if memory is not None:
        memory.share = float(t[0] / t[2]) if float(t[2]) > 0 else 0.0
        memory._batch = t.detach().cpu().clone()
    # the recent batches' sums, batch k back weighted decay^k (their clustered variance decay^2k)
    prev, k = (torch.zeros(4, dtype=torch.float64), 0.0) if memory is None else (memory.sums, memory.decay)
    t = t.cpu() + k * prev[:3]
    # d at rounding level (a critic whose values the group shares: GAE over different lengths
    # rounds differently) is no correction at all; its ratio would be arbitrary
    if float(t[1]) <= 1e-12 * float(t[2]):
        if memory is not None:
            memory.sums = torch.cat([t, k * k * prev[3:]])
        return 0.0, float("inf")
    beta = t[0] / t[1]
    per_sample = (x * (y - beta.to(x.device) * x)).sum(-1)
    totals = group_sums(torch.stack([per_sample, torch.ones_like(per_sample)], 1), group_index, dp_group)
    v = (totals[:, 0] ** 2 / totals[:, 1]).sum()      # sum over groups of (group score)^2, each once
    if dp_group is not None:
        dist.all_reduce(v, group=dp_group)
    v = v.cpu() + k * k * prev[3]
    if memory is not None:
        memory.sums = torch.cat([t, v.view(1)])
    return float(beta), float(v.sqrt() / t[1])


def critic_cv_coefficient(o, d, std, response_mask, group_index, dp_group=None, eps: float = 1e-6,
                          memory: CvMemory | None = None) -> float:
    """The weight beta in [0, beta_max] of the critic's within-group correction: :func:`critic_cv_fit`'s
    beta_hat shrunk by its own noise, beta_hat * max(0, 1 - (se / beta_hat)^2) (positive-part
    James-Stein), then clamped to [0, beta_max]; 0 when beta_hat <= 0. ``beta_max``: the
    ``memory``'s (:class:`CvMemory`), 1 without one. With ``memory`` also ``memory.gain``: the share
    of this batch's within-group advantage sum of squares (GRPO's, on the groups with varied scores)
    that the correction at this beta removes, 1 - sum((o + beta d)^2 / std^2) / sum(o^2 / std^2);
    negative when the correction adds more than it removes. It follows the policy gradient's own
    variance reduction (benchmarks/pg_variance.py, 42 checkpoints of six runs: within 0.006 where
    neither moved by 1%; where the critic removed more, both said so, within 0.05 on 14 of 16),
    so it says what the critic buys per sample.

    At lambda = 1, d_t = -(V(s_t) - V(s_0) minus its group mean at t): a state-dependent baseline,
    so ANY beta keeps the policy gradient unbiased, and the least-squares beta -- the regression of
    the outcome (O_i / std_g) on the critic's correction -- minimises the advantages' variance. A
    critic with exact per-token values gets beta = 1; one whose within-group values are noise gets
    0. The shrinkage is needed because the estimate is noisy exactly when the critic knows least:
    early on few groups have varied scores, and an unshrunk beta clamped at 0 is positive on
    about half the batches of a critic that knows nothing (measured on pick_first: 0.3-1.0 on
    single batches while the critic's per-token credit was nil). A beta_hat above 1 is a critic
    whose within-group values point the right way at too small a size (measured on copy with
    critic_target=group_relative: 1.5-5 from step ~60); beta_max > 1 lets the weight scale it up.
    The ``memory``'s ``min_t`` (1 without one) gates the weight: 0 until the fit's t-statistic
    beta_hat / se reaches it (the shrinkage alone opens at 1)."""
    beta, se = critic_cv_fit(o, d, std, response_mask, group_index, dp_group, eps, memory)
    beta_max, min_t = (1.0, 1.0) if memory is None else (memory.beta_max, memory.min_t)
    t = beta / se if se > 0.0 else (float("inf") if beta > 0.0 else 0.0)
    out = 0.0 if beta <= 0.0 or t < min_t else min(beta_max, beta * max(0.0, 1.0 - (se / beta) ** 2))
    if memory is not None:
        # an exact fit (se 0) logs a large finite t: JSON has no infinity, and 0 would read as no evidence
        memory.beta, memory.beta_fit, memory.t = out, beta, min(t, 1e9)
        # sum (y - beta x)^2 = sum yy - 2 beta sum xy + beta^2 sum xx: the advantages' sum of squares
        # over the groups with varied scores, against GRPO's (beta 0)
        xy, xx, yy = (float(v) for v in memory._batch)
        memory.gain = (2 * out * xy - out * out * xx) / yy if yy > 0 else 0.0
    return out


def group_cv_gae(token_level_rewards, values, response_mask, group_index, gamma: float, lam: float,
                 dp_group=None, eps: float = 1e-6, memory: CvMemory | None = None):
    """:func:`group_centred_gae` with the critic's within-group correction weighted by how much of
    the outcome it explains on this batch (:func:`critic_cv_coefficient`):
        A_it = (O_i + beta d_it) / std_g                           (0 where std_g = 0)
    Why: group_centred adds the critic's correction at full weight whatever its quality, so a
    critic that has not yet learned per-token values adds pure noise to GRPO's advantage (measured
    on pick_first: slightly behind GRPO on most seeds); here its weight follows the evidence, from
    GRPO (beta 0) to group_centred (beta 1). ``memory``: beta from this and the recent batches
    (:class:`CvMemory`). Returns (advantages (B, T), beta)."""
    o, d, std = _centred_parts(token_level_rewards, values, response_mask, group_index, gamma, lam, dp_group)
    beta = critic_cv_coefficient(o, d, std, response_mask, group_index, dp_group, eps, memory)
    return _zero_masked(_on_group_scale(o + beta * d, std, eps).to(values.dtype), response_mask), beta


def critic_cv_beta(token_level_rewards, values, response_mask, group_index, gamma: float, lam: float,
                   dp_group=None, eps: float = 1e-6) -> float:
    """:func:`critic_cv_coefficient` of this batch (the ``critic/advantages/cv_beta`` metric): how
    much per-token credit the critic has learned, from 0 (its within-group values explain none of
    the outcome) to 1 (they are the outcome's conditional expectations)."""
    o, d, std = _centred_parts(token_level_rewards, values, response_mask, group_index, gamma, lam, dp_group)
    return critic_cv_coefficient(o, d, std, response_mask, group_index, dp_group, eps)


def equal_score_share(advantages, token_level_rewards, response_mask, group_index, dp_group=None) -> float:
    """Share of the advantages' squared size (over response tokens, DP-global) that sits on
    samples whose prompt group scored all alike: where the outcome gives no contrast, so the
    advantage is the critic's opinion alone (GRPO puts exactly 0 there). Near 1 with a flat
    score means the actor is following the critic's noise."""
    score = _scores(token_level_rewards, response_mask)
    _, _, std = group_stats(score, group_index, dp_group)
    a2 = (advantages.to(torch.float64) ** 2 * response_mask.to(torch.float64)).sum(-1)
    t = torch.stack([(a2 * (std <= 1e-12)).sum(), a2.sum()])
    if dp_group is not None:
        dist.all_reduce(t, group=dp_group)
    return float(t[0] / t[1]) if t[1] > 0 else 0.0


@register_estimator("gae", needs_critic=True)
def _gae_estimator(*, token_level_rewards, response_mask, values, gamma, lam, dp_group, group_index=None,
                   gae_adv_norm: str = "batch", critic_lam=None, lam_length_alpha=None, cv_memory=None,
                   critic_target: str = "return", **_):
    """GAE. ``gae_adv_norm``: ``batch`` whitens the advantages over the (DP-global) batch (verl);
    ``group`` is :func:`group_normalised_gae`. ``critic_lam`` (None: ``lam``): the lambda of the
    critic's targets (VAPO's decoupled GAE: 1.0 makes them Monte-Carlo returns);
    ``lam_length_alpha`` (None: off): the policy's lambda per sample is
    :func:`length_adaptive_lam`; ``cv_memory`` (:class:`CvMemory`, None: this batch only): the
    running sums of group_cv's beta; ``critic_target``: ``return`` (the critic's targets are the
    returns) or ``group_relative`` (the returns minus the leave-one-out mean return of the prompt's
    group: :func:`group_relative_rewards`; only with SHIFT_FREE_ADV_NORMS). Returns (advantages,
    returns = critic-lambda advantage + values: the critic's targets)."""
    if gae_adv_norm not in GAE_ADV_NORMS:
        raise ValueError(f"gae_adv_norm must be one of {GAE_ADV_NORMS}, got {gae_adv_norm!r}")
    if critic_target not in CRITIC_TARGETS:
        raise ValueError(f"critic_target must be one of {CRITIC_TARGETS}, got {critic_target!r}")
    if critic_target == "group_relative" and gae_adv_norm not in SHIFT_FREE_ADV_NORMS:
        raise ValueError(f"critic_target='group_relative' needs gae_adv_norm in {SHIFT_FREE_ADV_NORMS} (advantages that "
                         f"use only V(s_t) - V(s_0)), got {gae_adv_norm!r}")
    if lam_length_alpha is not None:
        adv, ret = gae_per_sample_lam(token_level_rewards, values, response_mask, gamma,
                                      length_adaptive_lam(response_mask, lam_length_alpha))
    else:
        adv, ret = gae(token_level_rewards, values, response_mask, gamma, lam)
    critic_lam = lam if critic_lam is None else critic_lam
    if critic_target == "group_relative":
        if group_index is None:
            raise ValueError("critic_target='group_relative' needs group_index (one id per prompt)")
        _, ret = gae(group_relative_rewards(token_level_rewards, response_mask, group_index, gamma, dp_group), values,
                     response_mask, gamma, critic_lam)
    elif critic_lam != lam or lam_length_alpha is not None:
        _, ret = gae(token_level_rewards, values, response_mask, gamma, critic_lam)
    if gae_adv_norm != "batch":
        if group_index is None:
            raise ValueError(f"gae_adv_norm={gae_adv_norm!r} needs group_index (one id per prompt)")
        if gae_adv_norm != "group":
            if lam_length_alpha is not None:
                raise ValueError(f"gae_adv_norm={gae_adv_norm!r} takes one lambda (algorithm.lam), not lam_length_alpha")
            if gae_adv_norm == "group_cv":
                return group_cv_gae(token_level_rewards, values, response_mask, group_index, gamma, lam, dp_group,
                                    memory=cv_memory)[0], ret
            fn = group_shifted_gae if gae_adv_norm == "group_shift" else group_centred_gae
            return fn(token_level_rewards, values, response_mask, group_index, gamma, lam, dp_group), ret
        return group_normalised_gae(adv, values, token_level_rewards, response_mask, group_index, dp_group), ret
    return masked_whiten(adv, response_mask, group=dp_group), ret


@register_estimator("grpo", group_relative=True, aliases=("grpo_vectorized",))
def _grpo(*, token_level_rewards, response_mask, group_index, norm_adv_by_std_in_grpo, dp_group, **_):
    """A_i = (s_i - mean_g) / (std_g + 1e-6) (unbiased std); singleton group: mean 0, std 1.
    ``norm_adv_by_std_in_grpo=False``: A_i = s_i - mean_g (Dr.GRPO)."""
    a = _grpo_normalised(_scores(token_level_rewards, response_mask), group_index, norm_adv_by_std_in_grpo, dp_group)
    out = _outcome(a, response_mask, token_level_rewards.dtype)
    return out, out


def _grpo_normalised(s: torch.Tensor, group_index, norm_by_std: bool, dp_group) -> torch.Tensor:
    """(B,) float64 -> (s - mean_g) / (std_g + 1e-6), or s - mean_g; a singleton: mean 0, std 1."""
    cnt, mean, std = group_stats(s, group_index, dp_group)
    single = cnt <= 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return (s - mean) / (std + 1e-6) if norm_by_std else s - mean


@register_estimator("rloo", group_relative=True, aliases=("rloo_vectorized",))
def _rloo(*, token_level_rewards, response_mask, group_index, dp_group, **_):
    """A_i = s_i - mean of the other members of the group = n/(n-1) (s_i - mean_g); a singleton
    keeps its score (there is no other member to compare with)."""
    s = _scores(token_level_rewards, response_mask)
    a = s - leave_one_out_mean(s, group_index, dp_group)
    out = _outcome(a, response_mask, token_level_rewards.dtype)
    return out, out


@register_estimator("reinforce_plus_plus")
def _rpp(*, token_level_rewards, response_mask, gamma, dp_group, **_):
    """Discounted return-to-go G_t, whitened over the batch; returns = G."""
    ret = discounted_returns(token_level_rewards, response_mask, gamma)
    return masked_whiten(ret, response_mask, group=dp_group), ret


@register_estimator("reinforce_plus_plus_baseline", group_relative=True)
def _rpp_baseline(*, token_level_rewards, response_mask, group_index, dp_group, **_):
    """s_i - group mean (a singleton: its raw score), broadcast over tokens, then whitened over
    the batch."""
    s = _scores(token_level_rewards, response_mask)
    cnt, mean, _ = group_stats(s, group_index, dp_group)
    mean = torch.where(cnt <= 1, torch.zeros_like(mean), mean)
    a = _outcome(s - mean, response_mask, token_level_rewards.dtype)
    return masked_whiten(a, response_mask, group=dp_group), a


@register_estimator("remax", needs_baseline=True)
def _remax(*, token_level_rewards, response_mask, baseline_scores, **_):
    """Return-to-go (gamma 1) minus the greedy baseline's score; returns = return-to-go."""
    ret = discounted_returns(token_level_rewards, response_mask, 1.0)
    a = _zero_masked(ret - baseline_scores.to(ret.dtype)[:, None], response_mask)
    return a, ret


@register_estimator("opo", group_relative=True)
def _opo(*, token_level_rewards, response_mask, group_index, dp_group, **_):
    """OPO (arXiv 2505.23585): A_i = s_i - b_g with the length-weighted group baseline
    b_g = sum_j |y_j| s_j / sum_j |y_j| (|y| = response tokens); a singleton: b = 0."""
    s = _scores(token_level_rewards, response_mask)
    n = response_mask.to(torch.float64).sum(-1)
    sums = group_sums(torch.stack([torch.ones_like(s), n * s, n], dim=1), group_index, dp_group)
    b = torch.where(sums[:, 0] > 1, sums[:, 1] / sums[:, 2].clamp(min=1e-12), torch.zeros_like(s))
    out = _outcome(s - b, response_mask, token_level_rewards.dtype)
    return out, out


@register_estimator("gpg", group_relative=True)
def _gpg_estimator(*, token_level_rewards, response_mask, group_index, dp_group, **_):
    """GPG (arXiv 2504.02546): A_i = alpha (s_i - mean_g), alpha = B / #(s != 0) over the whole
    batch (every DP rank), correcting for groups that carry no signal; a singleton: mean 0."""
    s = _scores(token_level_rewards, response_mask)
    cnt, mean, _ = group_stats(s, group_index, dp_group)
    mean = torch.where(cnt <= 1, torch.zeros_like(mean), mean)
    counts = torch.tensor([float(s.numel()), float((s != 0).sum())], dtype=torch.float64, device=s.device)
    if dp_group is not None:
        dist.all_reduce(counts, group=dp_group)
    alpha = counts[0] / counts[1].clamp(min=1)
    out = _outcome(alpha * (s - mean), response_mask, token_level_rewards.dtype)
    return out, out


@register_estimator("grpo_passk", group_relative=True)
def _grpo_passk(*, token_level_rewards, response_mask, group_index, norm_adv_by_std_in_grpo, dp_group, **_):
    """Pass@k (arXiv 2503.19595): only each group's best sample gets an advantage,
    r_max - r_second (divided by the group's std + 1e-6 unless norm_adv_by_std_in_grpo=false);
    ties go to the first best sample in batch order (over DP: rank, then row). Groups need at
    least 2 samples."""
    s = _scores(token_level_rewards, response_mask)
    gid = group_index.to(torch.int64)
    rank = dist.get_rank(dp_group) if dp_group is not None else 0
    mine = torch.stack([gid.to(torch.float64), s, torch.full_like(s, rank), torch.arange(s.numel(), dtype=torch.float64)], 1)
    if dp_group is not None:   # one row per sample of the batch: (group, score, rank, row)
        parts = [None] * dist.get_world_size(dp_group)
        dist.all_gather_object(parts, mine.cpu(), group=dp_group)
        every = torch.cat(parts).to(s.device)
    else:
        every = mine
    _, _, std = group_stats(s, group_index, dp_group)
    adv = torch.zeros_like(s)
    for g in torch.unique(every[:, 0]).tolist():
        members = every[every[:, 0] == g]
        if members.shape[0] < 2:
            raise ValueError(f"grpo_passk needs at least 2 samples per group; group {int(g)} has {members.shape[0]}")
        order = sorted(range(members.shape[0]), key=lambda i: (-float(members[i, 1]), float(members[i, 2]), float(members[i, 3])))
        best, second = members[order[0]], members[order[1]]
        if int(best[2]) == rank:
            row = int(best[3])
            a = best[1] - second[1]
            adv[row] = a / (std[row] + 1e-6) if norm_adv_by_std_in_grpo else a
    out = _outcome(adv, response_mask, token_level_rewards.dtype)
    return out, out


@register_estimator("optimal_token_baseline", group_relative=True, inputs=("old_log_probs", "sum_pi_squared"))
def _optimal_token_baseline(*, token_level_rewards, response_mask, group_index, old_log_probs, sum_pi_squared,
                            rollout_is_weights=None, dp_group=None, handle_zero_tail: bool = True,
                            epsilon: float = 1e-8, **_):
    """Optimal Token Baseline (verl's OTB, arXiv 2602.07078): a baseline per group and position.

    G_{i,t} = sum_{s >= t} r_{i,s}                    (undiscounted reward-to-go)
    w_{i,t} = 1 - 2 pi_{i,t} + sum_v pi_v^2          (= ||onehot(y_t) - pi||^2, the logit-gradient proxy;
                                                      pi_{i,t} = exp(old_log_prob); times rho_{i,t}^2 with
                                                      rollout correction's IS weights)
    W_{i,t} = sum_{s <= t} w_{i,s}                    (cumulative over response tokens)
    B_{g,t} = sum_{i in g} G_{i,t} W_{i,t} / (sum_{i in g} W_{i,t} + epsilon)   (response tokens at t)
    A_{i,t} = G_{i,t} - B_{g(i),t};  returns = G.

    A singleton group has B = 0 (A = its reward-to-go). ``handle_zero_tail`` (verl's default
    True): when a group's longest response is unique, its baseline is 0 from column L2 (the
    second-longest length) on, where it is the only member left and B would cancel its return.
    Sums over every DP rank's members (``dp_group``); the ranks may hold different widths T.
    """
    shape = response_mask.shape
    for name, x in (("old_log_probs", old_log_probs), ("sum_pi_squared", sum_pi_squared),
                    ("rollout_is_weights", rollout_is_weights)):
        if x is not None and tuple(x.shape) != tuple(shape):
            raise ValueError(f"optimal_token_baseline: {name} has shape {tuple(x.shape)}, the response mask {tuple(shape)}")
    f64, m = torch.float64, response_mask.bool()
    B, T = shape
    zero = torch.zeros((), dtype=f64, device=response_mask.device)
    r = torch.where(m, token_level_rewards.to(f64), zero)
    G = r.flip(-1).cumsum(-1).flip(-1)
    w = 1.0 - 2.0 * torch.exp(old_log_probs.to(f64)) + sum_pi_squared.to(f64)
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.to(f64) ** 2
    W = torch.where(m, w, zero).cumsum(-1)
    Wm = torch.where(m, W, zero)
    # per (group, position) sums; with DP every rank pads its columns to the widest rank's T
    Tg = T
    if dp_group is not None:
        width = torch.tensor([T], dtype=torch.int64, device=response_mask.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=dp_group)
        Tg = int(width.item())
    pad = (lambda x: torch.nn.functional.pad(x, (0, Tg - T))) if Tg > T else (lambda x: x)
    sums = group_sums(torch.cat([pad(G * Wm), pad(Wm), torch.ones(B, 1, dtype=f64, device=G.device)], 1),
                      group_index, dp_group)
    num, den, cnt = sums[:, :T], sums[:, Tg:Tg + T], sums[:, 2 * Tg]
    base = torch.where(cnt[:, None] > 1, num / (den + epsilon), zero)
    if handle_zero_tail:
        n = m.to(f64).sum(-1)
        longest = group_max(n, group_index, dp_group)
        at_max = (n == longest).to(f64)
        n_longest = group_sums(at_max[:, None], group_index, dp_group)[:, 0]
        second = group_max(torch.where(n < longest, n, torch.full_like(n, -1.0)), group_index, dp_group)
        alone = (cnt > 1) & (n_longest == 1) & (n == longest)
        cols = torch.arange(T, device=G.device, dtype=f64)
        base = torch.where(alone[:, None] & (cols[None, :] >= second[:, None]), zero, base)
    dt = token_level_rewards.dtype
    return _zero_masked(G - base, m).to(dt), _zero_masked(G, m).to(dt)


@register_estimator("tir_optimal_token_baseline", group_relative=True, inputs=("old_log_probs", "sum_pi_squared"))
def _tir_optimal_token_baseline(*, token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                rollout_is_weights=None, **kw):
    """optimal_token_baseline for multi-turn responses (verl's TIR variant): positions are counted
    over the response tokens only, so the baseline at a sample's k-th response token averages the
    group's k-th response tokens, whatever tool/observation tokens (masked) sit between them.
    Identical to optimal_token_baseline when no masked token lies inside a response."""
    m = response_mask.bool()
    # the response tokens of each row moved to the front, in order (stable sort on "is masked")
    order = torch.sort((~m).to(torch.int8), dim=-1, stable=True).indices
    take = lambda x: None if x is None else x.gather(-1, order)  # noqa: E731
    adv, ret = _optimal_token_baseline(token_level_rewards=take(token_level_rewards), response_mask=take(response_mask),
                                       old_log_probs=take(old_log_probs), sum_pi_squared=take(sum_pi_squared),
                                       rollout_is_weights=take(rollout_is_weights), **kw)
    back = lambda x: torch.zeros_like(x).scatter(-1, order, x)  # noqa: E731
    return back(adv), back(ret)


@register_estimator("gdpo", group_relative=True, inputs=("reward_components",))
def _gdpo(*, token_level_rewards, response_mask, group_index, norm_adv_by_std_in_grpo, reward_components,
          reward_weights=None, dp_group=None, **_):
    """GDPO (arXiv 2601.05242): each reward component normalised within its group on its own,
    then a weighted sum, then whitened over the batch's response tokens:

    a_{k,i} = (s_{k,i} - mean_g(s_k)) / (std_g(s_k) + 1e-6)   (as grpo: unbiased std; a singleton:
                                                                mean 0, std 1; Dr.GRPO without std)
    A_i     = sum_k w_k a_{k,i}                                (w = reward_weights, default all 1)
    adv     = masked_whiten(A_i broadcast over i's tokens)     (token-weighted, DP-global); returns = adv.

    ``reward_components``: name -> (B,) per-sample scores, in algorithm.gdpo_reward_keys order.
    As in verl, ``token_level_rewards`` is not used (no KL-in-reward, no overlong penalty).
    """
    comps = list(reward_components.items())
    if not comps:
        raise ValueError("gdpo needs at least one reward component (algorithm.gdpo_reward_keys)")
    weights = [1.0] * len(comps) if reward_weights is None else [float(x) for x in reward_weights]
    if len(weights) != len(comps):
        raise ValueError(f"gdpo: {len(weights)} reward weights (algorithm.gdpo_reward_weights) for "
                         f"{len(comps)} reward components ({', '.join(k for k, _ in comps)})")
    B = response_mask.shape[0]
    total = torch.zeros(B, dtype=torch.float64, device=response_mask.device)
    for (name, scores), wk in zip(comps, weights):
        s = torch.as_tensor(scores, dtype=torch.float64, device=response_mask.device)
        if tuple(s.shape) != (B,):
            raise ValueError(f"gdpo: reward component {name!r} has shape {tuple(s.shape)}, expected ({B},): one score per sample")
        total = total + wk * _grpo_normalised(s, group_index, norm_adv_by_std_in_grpo, dp_group)
    out = masked_whiten(_outcome(total, response_mask, torch.float64), response_mask, group=dp_group)
    out = out.to(token_level_rewards.dtype)
    return out, out
