"""Micro-batching: a fixed number of samples, or a token budget (``use_dynamic_bsz``)."""
from __future__ import annotations

__all__ = ["token_budget_groups", "micro_batch_groups"]


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
