"""Context parallelism (CP): the ranks of a CP group each hold a part of every sequence.

The layout is megatron's load-balanced one: a sequence of S tokens (S a multiple of 2 x CP) is cut
into 2 x CP chunks and CP rank r holds chunks r and 2 x CP - 1 - r, so that every rank gets the
same share of causal attention's work (an early chunk attends to little, a late one to much).
megatron's RoPE cuts its table in this layout (``rope_utils.get_pos_emb_on_this_cp_rank``); the
workers cut the tokens the same way (:func:`local_positions`). A packed row (sequence packing) is
cut sequence by sequence (:func:`packed_local_positions`: TransformerEngine's THD layout under CP,
which megatron's THD RoPE slices to).

Two gathers along the sequence, each an autograd function over the CP group:

- :func:`gather_kv` (attention): every rank's queries attend to the whole sequence's keys and
  values, so the forward all-gathers them and the backward sums each chunk's gradient from
  every rank's queries back onto the rank that holds it (reduce-scatter).
- :func:`gather_positions` (per-token outputs: log-probs, entropies, values): every CP rank then
  computes the same loss over the whole sequence, so the gradient that reaches a rank's own
  positions is already the loss's; the backward keeps that slice and sends nothing. The
  data-parallel gradient reduction (megatron's DDP, over DP x CP) adds the ranks' parts.

Process groups are arguments; nothing here reads megatron's parallel state.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["local_positions", "packed_local_positions", "natural_order", "gather_kv", "gather_positions", "CPSequence"]


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """(2 x seq_len / (2 x cp),) the positions CP rank ``rank`` holds, ascending."""
    if seq_len % (2 * cp):
        raise ValueError(f"context parallelism: a sequence of {seq_len} tokens is not a multiple of 2 x "
                         f"context_parallel_size = {2 * cp}")
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, last])


def packed_local_positions(cu_seqlens: list[int], cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions of a packed row (sequences end to end, ``cu_seqlens`` their bounds, each a
    multiple of 2 x cp long) that CP rank ``rank`` holds: each sequence's two chunks, sequence
    after sequence (TransformerEngine's THD layout under CP)."""
    return torch.cat([a + local_positions(b - a, cp, rank, device=device)
                      for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])])


def natural_order(held: list[torch.Tensor]) -> torch.Tensor:
    """Index into the ranks' concatenated local positions (``held[r]``: rank r's) that puts
    them in row order."""
    return torch.argsort(torch.cat(held))


def _natural_order(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """:func:`natural_order` of one sequence of ``seq_len`` tokens."""
    return natural_order([local_positions(seq_len, cp, r) for r in range(cp)]).to(device)


def _gather_in_order(x: torch.Tensor, group, dim: int, order: torch.Tensor | None = None) -> torch.Tensor:
    """Every CP rank's ``x`` (this rank's positions along ``dim``) joined along ``dim`` in
    sequence order (``order``: :func:`natural_order` of the ranks' positions; default: one
    sequence)."""
    cp = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    if order is None:
        order = _natural_order(cp * x.shape[dim], cp, x.device)
    return torch.cat(parts, dim=dim).index_select(dim, order)


class _GatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, order):   # x [s_local, ...] in the rank's layout -> [S, ...] in sequence order
        # the backward allocates on the forward input's device: under the CPU device check a
        # gradient from autograd's engine is untracked (it would read as host memory)
        cp = dist.get_world_size(group)
        if order is None:
            order = _natural_order(cp * x.shape[0], cp, x.device)
        ctx.group, ctx.device, ctx.order = group, x.device, order
        return _gather_in_order(x, group, 0, order)

    @staticmethod
    def backward(ctx, grad):
        cp = dist.get_world_size(ctx.group)
        held = torch.empty(grad.shape, dtype=grad.dtype, device=ctx.device)
        held[ctx.order] = grad   # back to the ranks' concatenated layout
        out = torch.empty((grad.shape[0] // cp, *grad.shape[1:]), dtype=grad.dtype, device=ctx.device)
        dist.reduce_scatter_tensor(out, held.contiguous(), group=ctx.group)
        return out, None, None


def gather_kv(x: torch.Tensor, group, order: torch.Tensor | None = None) -> torch.Tensor:
    """[s_local, ...] (sequence first, this rank's chunks) -> [S, ...] in sequence order, every
    rank's chunks; gradients flow back to the rank that holds each chunk, summed over ranks.
    ``order``: :func:`natural_order` of a packed row's positions (default: one sequence)."""
    return _GatherKV.apply(x, group, order)


class _GatherPositions(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, positions, order):   # x [B, s_local, ...] -> [B, S, ...] in sequence order
        ctx.positions = positions
        return _gather_in_order(x, group, 1, order)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(1, ctx.positions), None, None, None


def gather_positions(x: torch.Tensor, group, positions: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """[B, s_local, ...] per-position values at this rank's ``positions`` -> [B, S, ...] for the
    whole sequence (or packed row: ``order``, as for :func:`gather_kv`), on every CP rank. For a
    loss every CP rank computes alike from the result: the backward keeps this rank's positions
    of the (identical) gradient."""
    return _GatherPositions.apply(x, group, positions, order)


class CPSequence:
    """A micro-batch's token ids under context parallelism: ``ids`` (B, S) whole, the model saw
    ``ids[:, positions]``. What a loss function receives in place of the ids tensor."""

    def __init__(self, ids: torch.Tensor, group, positions: torch.Tensor, pad_token_id: int):
        self.ids, self.group, self.positions = ids, group, positions
        self.pad_token_id = pad_token_id

    @property
    def local_ids(self) -> torch.Tensor:
        return self.ids.index_select(1, self.positions)

    def next_ids(self) -> torch.Tensor:
        """(B, s_local) the token after each held position (a pad id after the last one, whose
        prediction nothing reads)."""
        nxt = torch.nn.functional.pad(self.ids[:, 1:], (0, 1), value=self.pad_token_id)
        return nxt.index_select(1, self.positions)

    def gather(self, per_position: torch.Tensor) -> torch.Tensor:
        """(B, s_local, ...) at the held positions -> (B, S, ...), see :func:`gather_positions`."""
        return gather_positions(per_position, self.group, self.positions)
