"""Micro-batching: a fixed number of samples, or a token budget (``use_dynamic_bsz``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["token_budget_groups", "micro_batch_groups", "fit_to_multiple"]


def token_budget_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Partition sample indices into micro-batches whose padded size (count x longest) stays
    within ``max_tokens``. Longest first, first fit: few micro-batches, little padding. A sample
    longer than the budget is an error (validate() rejects such configs up front)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    longest: list[int] = []
    for i in order:
        n = lengths[i]
        if n > max_tokens:
            raise ValueError(f"a sequence of {n} tokens exceeds the micro-batch token budget {max_tokens}")
        for g, members in enumerate(groups):
            if (len(members) + 1) * max(longest[g], n) <= max_tokens:
                members.append(i)
                longest[g] = max(longest[g], n)
                break
        else:
            groups.append([i])
            longest.append(n)
    return [sorted(g) for g in groups]


def micro_batch_groups(n: int, lengths: list[int], micro_batch_size=None, max_tokens=None) -> list[list[int]]:
    if max_tokens is not None:
        return token_budget_groups(lengths, max_tokens)
    if micro_batch_size is None or n % micro_batch_size:
        raise ValueError(f"{n} samples do not split into micro-batches of {micro_batch_size}")
    return [list(range(i, i + micro_batch_size)) for i in range(0, n, micro_batch_size)]


def fit_to_multiple(groups: list[list[int]], lengths: list[int], multiple: int) -> list[list[int]]:
    """Micro-batch groups whose count is a multiple of ``multiple`` and at least ``multiple``
    (megatron's interleaved pipeline schedule needs both). The heaviest group (count x longest)
    is halved until the count fits; when every group is a single sample, empty groups (padding
    micro-batches) are appended."""
    groups = [list(g) for g in groups]
    target = max(multiple, -(-len(groups) // multiple) * multiple)
    while len(groups) < target:
        splittable = [i for i, g in enumerate(groups) if len(g) > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda i: (len(groups[i]) * max(lengths[j] for j in groups[i]), -i))
        g = sorted(groups[i], key=lambda j: -lengths[j])
        groups[i:i + 1] = [sorted(g[0::2]), sorted(g[1::2])]  # alternate: both halves keep long and short
    return groups + [[] for _ in range(target - len(groups))]


def balanced_partition(lengths: list[int], k: int) -> list[list[int]]:
    """Split indices into ``k`` equal-size parts with token sums as even as possible: longest
    first, each to the lightest part that still has room."""
    n = len(lengths)
    if n % k:
        raise ValueError(f"{n} samples do not split into {k} equal parts")
    size = n // k
    parts: list[list[int]] = [[] for _ in range(k)]
    load = [0] * k
    for i in sorted(range(n), key=lambda i: -lengths[i]):
        j = min((j for j in range(k) if len(parts[j]) < size), key=lambda j: load[j])
        parts[j].append(i)
        load[j] += lengths[i]
    return [sorted(p) for p in parts]


def deal_to_dp(lengths: list[int], mini_batch_size: int, dp: int, balance: bool = True) -> list[list[int]]:
    """Rows of the global batch for each DP rank. Rank r's k-th mini-batch is its part of the
    global k-th mini-batch (so updates do not depend on the DP size); with ``balance``
    (trainer.balance_batch) the parts of each mini-batch carry near-equal token counts."""
    n = len(lengths)
    if n % mini_batch_size or mini_batch_size % dp:
        raise ValueError(f"{n} samples in mini-batches of {mini_batch_size} do not deal evenly to {dp} DP ranks")
    ranks: list[list[int]] = [[] for _ in range(dp)]
    for start in range(0, n, mini_batch_size):
        rows = list(range(start, start + mini_batch_size))
        if balance:
            parts = balanced_partition([lengths[i] for i in rows], dp)
            parts = [[rows[i] for i in p] for p in parts]
        else:
            per = mini_batch_size // dp
            parts = [rows[r * per:(r + 1) * per] for r in range(dp)]
        for r in range(dp):
            ranks[r].extend(parts[r])
    return ranks


@dataclass(frozen=True)
class MicroBatching:
    """How one forward or training pass splits a rank's samples: a fixed count per micro-batch,
    or a token budget (verl's use_dynamic_bsz). ``kwargs()`` feeds the workers' passes."""
    micro_batch_size: Optional[int] = None
    max_token_len: Optional[int] = None

    @classmethod
    def of(cls, dynamic: bool, micro_batch_size: Optional[int], max_token_len: int) -> "MicroBatching":
        return cls(None, max_token_len) if dynamic else cls(micro_batch_size, None)

    def kwargs(self) -> dict:
        return {"micro_batch_size": self.micro_batch_size, "max_token_len": self.max_token_len}


@dataclass(frozen=True)
class PassBatching:
    """Each pass of a step with its own verl keys, resolved once from the config."""
    old_log_prob: MicroBatching   # actor_rollout_ref.rollout.log_prob_*
    ref: MicroBatching            # actor_rollout_ref.ref.log_prob_*
    values: MicroBatching         # critic.forward_* (critic.use_dynamic_bsz)
    reward: MicroBatching         # reward_model.*
    actor: MicroBatching          # actor_rollout_ref.actor.ppo_*
    critic: MicroBatching         # critic.ppo_*
    actor_mini_batch: int         # prompts per actor mini-batch, global (actor.ppo_mini_batch_size)
    critic_mini_batch: int        # prompts per critic mini-batch, global (critic.ppo_mini_batch_size)

    @classmethod
    def from_config(cls, cfg) -> "PassBatching":
        arr, ro, c, rm = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout, cfg.critic, cfg.reward_model
        act, ref = arr.actor, arr.ref
        return cls(
            old_log_prob=MicroBatching.of(ro.log_prob_use_dynamic_bsz, ro.log_prob_micro_batch_size_per_gpu,
                                          ro.log_prob_max_token_len_per_gpu),
            ref=MicroBatching.of(ref.log_prob_use_dynamic_bsz, ref.log_prob_micro_batch_size_per_gpu,
                                 ref.log_prob_max_token_len_per_gpu),
            values=MicroBatching.of(c.use_dynamic_bsz, c.forward_micro_batch_size_per_gpu, c.forward_max_token_len_per_gpu),
            reward=MicroBatching.of(rm.use_dynamic_bsz, rm.micro_batch_size_per_gpu, rm.forward_max_token_len_per_gpu),
            actor=MicroBatching.of(act.use_dynamic_bsz, act.ppo_micro_batch_size_per_gpu, act.ppo_max_token_len_per_gpu),
            critic=MicroBatching.of(c.use_dynamic_bsz, c.ppo_micro_batch_size_per_gpu, c.ppo_max_token_len_per_gpu),
            actor_mini_batch=act.ppo_mini_batch_size, critic_mini_batch=c.ppo_mini_batch_size,
        )
