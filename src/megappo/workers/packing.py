"""Sequence packing (verl's ``use_remove_padding``): a micro-batch's sequences laid end to end in
one row, THD format, so no compute is spent on padding.

A padded micro-batch is ``(B, S)`` token ids with each row's real length; packed, it is
``(1, T)`` with T = sum of the lengths, each rounded up to ``align`` (the TP size under sequence
parallelism: megatron splits the packed row over TP ranks). ``cu_seqlens`` marks where each
sequence starts; positions restart at 0 in each; attention (TransformerEngine's THD kernels via
megatron's ``PackedSeqParams``, or megappo's SdpaCoreAttention on the local spec: the CPU) stays
inside a sequence. The padding of a sequence comes after its real tokens, so causal attention
keeps it out of every real token's output.

Pure tensor code, tested on CPU by hand; the packed forward and update on CPU equal the padded
ones (tests/distributed/test_workers.py, the trainer in tests/e2e/test_context_parallel_run.py);
on TransformerEngine a ``gpu`` test compares them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from megappo.models import gather_positions, natural_order, packed_local_positions

__all__ = ["Packed", "pack"]


@dataclass
class Packed:
    ids: torch.Tensor           # (1, T) long: the sequences end to end, each padded to a multiple of align
    position_ids: torch.Tensor  # (1, T) long: 0.. within each sequence
    next_ids: torch.Tensor      # (1, T) long: the token each position predicts (pad id past a sequence's end)
    cu_seqlens: torch.Tensor    # (n + 1,) int32: start of each (padded) sequence, then T
    lengths: list[int]          # real length of each of the B rows (a filler segment is not a row)
    width: int                  # S, the padded micro-batch's width (rows() returns this many positions)
    max_seqlen: int             # longest padded sequence
    # under context parallelism (on_cp_rank): the CP group, the row positions this rank holds
    # ((T / CP,) long: two chunks of each sequence) and the order that puts the ranks' parts back
    cp_group: object = None
    held: Optional[torch.Tensor] = None
    order: Optional[torch.Tensor] = None

    @property
    def starts(self) -> list[int]:
        return self.cu_seqlens[:len(self.lengths)].tolist()

    def to(self, device, non_blocking: bool = False) -> "Packed":
        moved = {k: getattr(self, k).to(device, non_blocking=non_blocking)
                 for k in ("ids", "position_ids", "next_ids", "cu_seqlens", "held", "order") if getattr(self, k) is not None}
        return replace(self, **moved)

    def on_cp_rank(self, group) -> "Packed":
        """This packing as a CP rank of ``group`` holds it: two chunks of every sequence (each a
        multiple of 2 x CP long: ``pack``'s align), the layout TransformerEngine's THD attention
        and megatron's THD RoPE read under CP; ``cu_seqlens`` stay the whole row's."""
        cp, bounds = group.size(), self.cu_seqlens.tolist()
        held = [packed_local_positions(bounds, cp, r) for r in range(cp)]
        device = self.ids.device
        return replace(self, cp_group=group, held=held[group.rank()].to(device), order=natural_order(held).to(device))

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """(1, T, ...) per row position -> this rank's positions (all of them without CP)."""
        return x if self.held is None else x.index_select(1, self.held)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(1, T / CP, ...) at this rank's positions -> (1, T, ...) the whole row on every CP rank
        (megappo.models.gather_positions: the backward keeps this rank's part)."""
        return x if self.held is None else gather_positions(x, self.cp_group, self.held, self.order)

    def params(self):
        """megatron's PackedSeqParams for the THD kernels."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens.to(torch.int32)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                               cu_seqlens_kv_padded=cu, max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)

    def rows(self, packed: torch.Tensor, width: Optional[int] = None) -> torch.Tensor:
        """(1, T, ...) per-position values -> (B, width, ...) in the padded layout: row b's
        positions 0 .. min(len_b, width) - 1, zeros past them. Differentiable (a gather)."""
        width = self.width if width is None else width
        B = len(self.lengths)
        starts = torch.tensor(self.starts, device=packed.device)
        pos = torch.arange(width, device=packed.device)
        real = pos[None, :] < torch.tensor(self.lengths, device=packed.device)[:, None]
        index = (starts[:, None] + pos[None, :]).clamp(max=packed.shape[1] - 1)
        flat = packed[0].index_select(0, index.reshape(-1)).reshape(B, width, *packed.shape[2:])
        mask = real.reshape(B, width, *([1] * (packed.dim() - 2))).to(flat.dtype)
        return flat * mask


def pack(ids: torch.Tensor, lengths: list[int], pad_id: int, align: int = 1, total: Optional[int] = None) -> Packed:
    """Pack the rows of ``ids`` (B, S), row b's first ``lengths[b]`` tokens real. ``total``:
    make the packed row exactly this long with a filler segment (the interleaved pipeline
    schedule needs one shape for all micro-batches)."""
    B, S = ids.shape
    padded = [-(-max(1, n) // align) * align for n in lengths]
    T = sum(padded)
    if total is not None:
        if total < T or total % align:
            raise ValueError(f"total {total} must be >= {T} and a multiple of {align}")
    out_ids = torch.full((T if total is None else total,), pad_id, dtype=ids.dtype)
    nxt = torch.full_like(out_ids, pad_id)
    pos = torch.zeros_like(out_ids)
    cu = [0]
    for b, (n, m) in enumerate(zip(lengths, padded)):
        s = cu[-1]
        out_ids[s:s + n] = ids[b, :n]
        nxt[s:s + n - 1] = ids[b, 1:n]
        pos[s:s + m] = torch.arange(m)
        cu.append(s + m)
    if total is not None and total > T:
        pos[T:] = torch.arange(total - T)
        cu.append(total)
    max_seqlen = max(cu[i + 1] - cu[i] for i in range(len(cu) - 1))
    return Packed(out_ids[None], pos[None], nxt[None], torch.tensor(cu, dtype=torch.int32), list(lengths), S,
                  max_seqlen)
