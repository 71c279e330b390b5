"""TP split/gather of megatron tensors, and parameter names between a pipeline chunk's local
layer numbering and the model's (the PP/VPP layer placement itself is :mod:`megappo.layout`'s).

TP: a tensor with ``partition_dim`` is cut into equal contiguous pieces along that dim, except
``linear_fc1`` ([gate; up]) whose halves are cut separately so each rank holds [gate_r; up_r].
Layer indices in a chunk's parameter names are chunk-local.
"""
from __future__ import annotations

import re
from typing import Optional

import torch

from megappo.layout import global_layer, layer_owner

from megappo.models import qkv_group_views
from .names import ParamMap

__all__ = ["tp_shard", "tp_shard_shape", "tp_gather", "tp_rows", "to_local_name", "to_global_name", "shard_into_hf"]


def tp_rows(n: int, rank: int, size: int) -> slice:
    if n % size:
        raise ValueError(f"dimension of size {n} does not divide over {size} tensor-parallel ranks")
    k = n // size
    return slice(rank * k, (rank + 1) * k)


def tp_shard(full: torch.Tensor, pm: ParamMap, rank: int, size: int) -> torch.Tensor:
    """This rank's piece of a full megatron tensor."""
    if pm.partition_dim is None or size == 1:
        return full
    if pm.kind == "gate_up":
        gate, up = torch.chunk(full, 2, dim=0)
        s = tp_rows(gate.shape[0], rank, size)
        return torch.cat([gate[s], up[s]], dim=0)
    s = tp_rows(full.shape[pm.partition_dim], rank, size)
    return full[s] if pm.partition_dim == 0 else full[:, s]


def tp_shard_shape(full: tuple[int, ...], pm: ParamMap, size: int) -> tuple[int, ...]:
    """Shape of one rank's piece of a full megatron tensor of shape ``full``."""
    if pm.partition_dim is None or size == 1:
        return tuple(full)
    out = list(full)
    tp_rows(out[pm.partition_dim], 0, size)  # raises when it does not divide
    out[pm.partition_dim] //= size
    return tuple(out)


def tp_gather(shards: list[torch.Tensor], pm: ParamMap) -> torch.Tensor:
    """Inverse of :func:`tp_shard` over all ranks' pieces (in rank order)."""
    if pm.partition_dim is None or len(shards) == 1:
        return shards[0]
    if pm.kind == "gate_up":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=pm.partition_dim)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def to_local_name(name: str, num_layers: int, pp: int, vpp: Optional[int],
                  split=None) -> tuple[str, Optional[tuple[int, int]]]:
    """Global megatron name -> (chunk-local name, (pp_rank, vp_stage) owning it or None if not a
    layer); ``split``: an uneven pipeline split (megappo.layout.PipelineSplit)."""
    m = _LAYER.match(name)
    if not m:
        return name, None
    pp_rank, vp_stage, local = layer_owner(int(m.group(1)), num_layers, pp, vpp, split)
    return f"decoder.layers.{local}." + name[m.end():], (pp_rank, vp_stage)


def to_global_name(name: str, pp_rank: int, vp_stage: int, num_layers: int, pp: int, vpp: Optional[int],
                   split=None) -> str:
    m = _LAYER.match(name)
    if not m:
        return name
    g = global_layer(pp_rank, vp_stage, int(m.group(1)), num_layers, pp, vpp, split)
    return f"decoder.layers.{g}." + name[m.end():]


def shard_into_hf(pm: ParamMap, shard: torch.Tensor, desc, rank: int, size: int, dest: dict) -> None:
    """Copy TP rank ``rank``'s megatron shard of ``pm`` straight into its place in the full HF
    tensors ``dest[hf_name]`` (contiguous): the per-rank form of ``to_hf(pm, tp_gather(...))``,
    with no full megatron tensor and no intermediate copy. A replicated tensor is written by
    rank 0 only; vocabulary padding rows are dropped."""
    if pm.partition_dim is None or size == 1:
        if rank:
            return
        rank, size = 0, 1
    if pm.kind == "qkv":  # the rank holds whole query groups: its q, k, v rows are contiguous in HF's
        groups = desc.num_groups // size
        views = qkv_group_views(shard, desc.num_heads // size, groups, desc.head_dim)
        for name, part in zip(pm.hf, views):
            out = dest[name]
            out[tp_rows(out.shape[0], rank, size)].view(part.shape).copy_(part)
    elif pm.kind == "gate_up":
        gate, up = (dest[n] for n in pm.hf)
        half = shard.shape[0] // 2
        gate[tp_rows(gate.shape[0], rank, size)].copy_(shard[:half])
        up[tp_rows(up.shape[0], rank, size)].copy_(shard[half:])
    elif pm.kind == "vocab":
        out = dest[pm.hf[0]]
        rows = tp_rows(desc.padded_vocab_size, rank, size)
        hi = min(rows.stop, out.shape[0])
        if hi > rows.start:
            out[rows.start:hi].copy_(shard[:hi - rows.start])
    else:
        out = dest[pm.hf[0]]
        cols = tp_rows(out.shape[pm.partition_dim], rank, size) if size > 1 else slice(None)
        (out[cols] if pm.partition_dim in (0, None) else out[:, cols]).copy_(shard)
