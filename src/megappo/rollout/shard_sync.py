"""Weight sync without the tensor-parallel gather when rollout and training shard alike.

The general sync (:func:`~megappo.convert.hf_io.iter_hf_tensors`) gives every rank every FULL
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
engine), and agreed by every rank: vLLM's CPU backend repacks linear weights into oneDNN handles
and leaves empty parameters, so on CPU the plan falls back to the general path unless that
repacking is off (as in the test).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megappo.convert.hf_io import RankCoords, gather_full, local_params
from megappo.convert.names import ModelDesc, ParamMap, full_shape, param_maps, to_hf
from megappo.convert.parallel import tp_shard_shape
from megappo.convert.tensor_maps import qkv_group_views

log = logging.getLogger(__name__)

__all__ = ["SyncTensor", "ShardSyncPlan", "plan_shard_sync", "agree", "plan_for_engine", "iter_sync_tensors",
           "kernel_name", "kernel_shard"]


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


def agree(plan: Optional[ShardSyncPlan], reason: str, group=None, device=None) -> tuple[Optional[ShardSyncPlan], str]:
    """Every rank takes the direct path or none does (their collectives must pair up). ``device``:
    where the vote lives, the group's device (a CUDA tensor on NCCL)."""
    ok = torch.tensor([0 if plan is None else 1], dtype=torch.int32, device=device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if plan is not None and not ok.item():
        return None, "another rank cannot take the direct path"
    return plan, reason


def plan_for_engine(engine, chunks, desc: ModelDesc, coords: RankCoords) -> Optional[ShardSyncPlan]:
    """The plan for the actor ``chunks`` and the rollout ``engine`` (a :class:`VLLMRollout`),
    agreed by every rank; the choice and its reason are logged once. Collective (world)."""
    from megappo.models.layers import uses_te

    params, tp, tp_rank = engine.kernel_layout()
    any_param = next(chunks[0].parameters())
    plan, why = agree(*plan_shard_sync(desc, coords, uses_te(chunks), params, tp, tp_rank,
                                       element_size=any_param.element_size()), device=any_param.device)
    if not dist.is_initialized() or dist.get_rank() == 0:
        if plan is None:
            log.info("weight sync: full tensors gathered over TP (%s)", why)
        else:
            log.info("weight sync: each rank sends its own shards (%.1f MiB), %d tensors gathered in full",
                     plan.direct_bytes / 2**20, len(plan.gathered))
    return plan


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
