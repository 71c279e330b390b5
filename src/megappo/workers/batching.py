"""Micro-batching: a fixed number of samples, or a token budget (``use_dynamic_bsz``)."""
from __future__ import annotations

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
