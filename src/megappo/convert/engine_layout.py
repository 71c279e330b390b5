"""Megatron shards in the rollout engine's layout: weight sync without the tensor-parallel
gather when rollout and training shard alike (the sync itself is :mod:`megappo.sync`).

The general sync (:func:`~megappo.convert.iter_hf_tensors`) gives every rank every FULL
HF tensor, and vLLM's ``load_weights`` slices out its own shard again: each rank receives the
whole model through the TP group. When the rollout's TP size equals training's and a rank's vLLM
TP rank equals its megatron TP rank (both put TP groups on consecutive ranks), the rank already
holds exactly the rows vLLM's worker needs. It then hands vLLM its own shard in vLLM's kernel
format (``reload_weights(is_checkpoint_format=False)``: named, fused and sharded as vLLM's
parameters are, copied in place), after one local relayout:

- ``linear_qkv``: megatron interleaves [q; k; v] per query group, vLLM's ``qkv_proj`` stacks
  [q; k; v] of the rank's groups;
- ``linear_fc1`` = [gate_r; up_r] is vLLM's ``gate_up_proj`` shard as it is; the row-parallel
  ``o_proj``/``down_proj`` and the replicated norms are too;
- the vocabulary is sharded alike only when both pad it to the same size (megatron pads to a
  multiple of 128 x TP, vLLM to 64): otherwise embedding and head take the general path.

Layers held by another pipeline stage travel as shards (a broadcast over the pipeline group of
the same TP rank), so a rank receives 1/TP of what the general path sends.

Mixture-of-Experts models always take the general path (see :func:`plan_shard_sync`).

The plan is checked against the parameters the engine really has (names and shapes, from the
engine), and agreed by every rank (:mod:`megappo.sync`): vLLM's CPU backend repacks linear weights into oneDNN handles
and leaves empty parameters, so on CPU the plan falls back to the general path unless that
repacking is off (as in the test).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from megappo.layout import RankCoords
from megappo.models import ModelDesc

from .hf_io import gather_full, local_params
from .names import ParamMap, full_shape, param_maps, to_hf
from .parallel import tp_shard_shape
from megappo.models import qkv_group_views

__all__ = ["SyncTensor", "ShardSyncPlan", "plan_shard_sync", "iter_sync_tensors", "kernel_name", "kernel_shard",
           "layer_buckets"]


@dataclass(frozen=True)
class SyncTensor:
    """One tensor for the engine: an HF-named full tensor (``kernel=False``) or a vLLM-named
    shard in the engine's own layout (``kernel=True``)."""

    name: str
    tensor: torch.Tensor
    kernel: bool = False


def kernel_name(pm: ParamMap) -> str:
    """vLLM's parameter name for the megatron tensor ``pm`` (Qwen2/Qwen3/Llama fuse q/k/v and gate/up)."""
    if pm.kind == "qkv":
        return pm.hf[0].replace(".q_proj.", ".qkv_proj.")
    if pm.kind == "gate_up":
        return pm.hf[0].replace(".gate_proj.", ".gate_up_proj.")
    return pm.hf[0]


def kernel_shard(pm: ParamMap, shard: torch.Tensor, desc: ModelDesc, tp: int) -> torch.Tensor:
    """A megatron TP shard in vLLM's layout for the same TP rank."""
    if pm.kind == "qkv":
        views = qkv_group_views(shard, desc.num_heads // tp, desc.num_groups // tp, desc.head_dim)
        return torch.cat([v.reshape(-1, *shard.shape[1:]) for v in views], dim=0)
    return shard


@dataclass(frozen=True)
class ShardSyncPlan:
    direct: frozenset  # megatron names sent as the rank's own shard; the rest is gathered
    direct_bytes: int  # this rank's bytes per sync on the direct path
    gathered: tuple    # megatron names that take the general path, for the log


def plan_shard_sync(desc: ModelDesc, coords: RankCoords, te: bool, engine_params: Optional[dict],
                    engine_tp: int, engine_tp_rank: int, element_size: int = 2) -> tuple[Optional[ShardSyncPlan], str]:
    """This rank's plan, or ``None`` and why not. ``engine_params``: the engine's parameter
    shapes by name on this rank (``None``: the engine cannot tell). Pure: no collective; the
    caller agrees over ranks (:func:`agree`)."""
    if engine_params is None:
        return None, "the engine does not report its parameters"
    if engine_tp != coords.tp:
        return None, f"rollout TP {engine_tp} differs from training TP {coords.tp}"
    if engine_tp_rank != coords.tp_rank:
        return None, f"vLLM TP rank {engine_tp_rank} differs from megatron TP rank {coords.tp_rank}"
    if desc.value_head:
        return None, "a value model has no rollout engine"
    if desc.num_experts:
        # No rank holds its vLLM shard of an expert: vLLM stacks every expert of a layer in one
        # w13/w2 parameter and cuts each expert's FFN dimension over its TP ranks, megatron keeps
        # whole experts on their EP rank. And vLLM re-processes expert layers only on a
        # checkpoint-format reload (the CPU experts' prepack, megappo.rollout.engine).
        return None, ("a Mixture-of-Experts model: vLLM shards each expert over its TP ranks, megatron holds "
                      "whole experts per EP rank")
    direct, gathered, nbytes = set(), [], 0
    for pm in param_maps(desc, te):
        want = tp_shard_shape(full_shape(pm, desc), pm, coords.tp)
        have = engine_params.get(kernel_name(pm))
        if have is not None and tuple(have) == tuple(want):
            direct.add(pm.megatron)
            nbytes += element_size * torch.Size(want).numel()
        elif pm.kind == "vocab" and have is not None and len(have) == 2 and have[1] == want[1] and have[0]:
            gathered.append(pm.megatron)  # vLLM pads the vocabulary to another size: HF path
        else:
            return None, (f"engine parameter {kernel_name(pm)} has shape {None if have is None else tuple(have)}, "
                          f"the rank's shard of {pm.megatron} is {want}")
    if not direct:
        return None, "no tensor is sharded alike"
    return ShardSyncPlan(frozenset(direct), nbytes, tuple(gathered)), ""


@torch.no_grad()
def iter_sync_tensors(chunks, desc: ModelDesc, coords: RankCoords, plan: ShardSyncPlan,
                      te: bool) -> Iterator[SyncTensor]:
    """The actor's weights for the engine, in :func:`param_maps` order: the planned tensors as
    this rank's shard (broadcast over the pipeline from their stage), the others gathered in full.
    Collective over TP and PP groups, like :func:`~megappo.convert.hf_io.iter_hf_tensors`."""
    local = local_params(chunks, desc, coords)
    any_param = next(iter(local.values()))
    for pm in param_maps(desc, te):
        if pm.megatron not in plan.direct:
            for name, t in to_hf(pm, gather_full(pm, local, desc, coords), desc).items():
                yield SyncTensor(name, t)
            continue
        owner = coords.owner(pm, desc.num_layers)
        if owner == coords.pp_rank:
            shard = local[pm.megatron].detach()
        else:
            shard = torch.empty(tp_shard_shape(full_shape(pm, desc), pm, coords.tp), dtype=any_param.dtype,
                                device=any_param.device)
        if coords.pp > 1:
            shard = shard.contiguous()
            dist.broadcast(shard, src=dist.get_global_rank(coords.pp_group, owner), group=coords.pp_group)
        yield SyncTensor(kernel_name(pm), kernel_shard(pm, shard, desc, coords.tp), kernel=True)


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def layer_buckets(named: Iterable, bucket_bytes: int) -> Iterator[list]:
    """Group a stream of tensors into lists of at most ~``bucket_bytes`` that never split a
    decoder layer (a layer larger than the bound travels alone). Tensors outside the layers
    (embedding, final norm, head) join the bucket of the nearest layer. Items are ``(name,
    tensor)`` pairs or :class:`SyncTensor`; a bucket never mixes
    full HF tensors with kernel-format shards (they take different reload calls)."""
    bucket: list = []
    size = 0
    cur_layer = cur_kind = None
    for item in named:
        name, t = (item.name, item.tensor) if hasattr(item, "kernel") else item
        kind = getattr(item, "kernel", False)
        m = _LAYER.search(name)
        layer = int(m.group(1)) if m else None
        if bucket and kind != cur_kind:
            yield bucket
            bucket, size = [], 0
        elif layer is not None and layer != cur_layer:
            if cur_layer is not None and size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if layer is not None:
            cur_layer = layer
        cur_kind = kind
        bucket.append(item)
        size += t.numel() * t.element_size()
    if bucket:
        yield bucket
