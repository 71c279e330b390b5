"""The actor's weights into the rollout engine, in place (no disk), chosen once per run.

Methods (the tensors' source; the destination is the engine, or the split placement's bridge):

- **shard-direct** (``actor_rollout_ref.rollout.shard_sync``, colocated only): when rollout and
  training shard alike, each rank hands the engine its own shards in the engine's layout
  (:func:`megappo.convert.iter_sync_tensors`); the plan is checked against the parameters the
  engine really has and agreed by every rank (:func:`plan_for_engine`), else the run falls back
  to a full gather.
- **shared memory** (every rank of the model-parallel group on one host, CPU tensors): each rank
  writes its shards into one shared copy of the HF model (:func:`megappo.convert.plan_shared_gather`).
- **full gather** (the general path): the owning stage all-gathers each tensor over TP and
  broadcasts it over PP; every rank yields full HF tensors (:func:`megappo.convert.iter_hf_tensors`).
- **the split placement's bridge**: the engine is a :class:`megappo.trainer.RemoteRollout`;
  full HF tensors go from global rank 0 to the rollout ranks with the policy version
  (:func:`megappo.distributed.split.send_weights`); a LoRA actor's adapters go the same way,
  and the rollout ranks' engines serve them (:meth:`megappo.trainer.RemoteRollout.sync_lora`).
- **LoRA adapters** (an actor with adapters, :mod:`megappo.models.lora`): the frozen base goes
  once, by one of the paths above; every push after that sends only the adapters (full
  PEFT-named tensors, gathered over TP and PP), which the engine serves as a new in-memory
  adapter (:meth:`megappo.rollout.VLLMRollout.sync_lora`). Where vLLM cannot serve the adapters
  (ranks above 512, vLLM's largest ``max_lora_rank``) each push sends the full weights with the
  adapters merged in (``W + alpha/r B A``), by the full gather.

Around every push each role's offloadable state leaves the device: the reference's and the
critic's before the engine wakes, the actor's weights after they were streamed.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from megappo.convert import ShardSyncPlan, iter_hf_tensors, iter_sync_tensors, plan_shard_sync, plan_shared_gather
from megappo.layout import RankCoords
from megappo.models import ModelDesc, export_lora_tensors, has_lora, lora_spec_of, merged_hf_tensors, uses_te

log = logging.getLogger(__name__)

__all__ = ["WeightSync", "agree", "plan_for_engine"]


class WeightSync:
    """``push(version)``: the actor's current weights into ``engine``. ``others``: workers whose
    offloadable state leaves the device first (reference, critic). Every training rank calls it
    (the gathers are collective)."""

    def __init__(self, actor, desc: ModelDesc, engine, others=(), shard_direct: bool = False, remote: bool = False):
        self.actor, self.desc, self.engine = actor, desc, engine
        # (a LoRA actor's reference is the actor itself: nothing of its own to offload)
        self.others = [w for w in others if w is not None and getattr(w, "actor", None) is not actor]
        self.remote = remote                     # the split placement: the bridge carries the tensors
        self.lora = lora_spec_of(actor.chunks) if has_lora(actor.chunks) else None
        # adapters to the engine, or (where it cannot serve them) merged full weights every push
        self.lora_mode = None if self.lora is None else ("adapter" if getattr(engine, "lora_rank", 0) else "merged")
        self.base_sent = False
        # the kernel layout of a LoRA engine names its wrapped linears differently; the base goes once anyway
        self.shard_direct = shard_direct and not remote and self.lora is None
        self.plan: Optional[ShardSyncPlan] = None   # shard-direct's plan, made at the first push
        self.shared = None                       # the shared-memory gather's plan (None: full gather)
        self.planned = False

    def push(self, version: int) -> dict:
        """Sync the actor's weights; ``version``: the updates they have had (the rollout ranks
        record it as the policy version of what they generate next)."""
        for w in self.others:
            w.offload()
        self.actor.offload(params=False)
        self.actor.state_offload.ensure(params=True)
        coords = RankCoords.from_megatron(self.actor.chunks[0].config)
        out = {}
        if self.lora_mode == "adapter" and self.base_sent:
            out = {"rollout/sync_s": 0.0, "rollout/sync_bytes": 0}
        else:
            out = self._push_weights(coords, version)
            self.base_sent = True
        if self.lora_mode == "adapter":
            adapters = export_lora_tensors(self.actor.chunks)
            s = self.engine.sync_lora(adapters, self.lora.rank, self.lora.alpha, self.lora.modules, version)
            # (the bridge reports its figures on global rank 0 only)
            out = {k: out.get(k, 0) + s.get(k, 0) for k in ("rollout/sync_s", "rollout/sync_bytes")}
        self.actor.offload()
        return out

    def _push_weights(self, coords: RankCoords, version: int) -> dict:
        """The full weights (a LoRA actor's base, or its merged weights) by the path chosen once."""
        if not self.planned:   # decided once, by all ranks together
            self.plan = plan_for_engine(self.engine, self.actor.chunks, self.desc, coords) if self.shard_direct else None
            if self.plan is None:  # CPU ranks of one host: gather through shared memory
                self.shared = plan_shared_gather(self.actor.chunks, self.desc, coords)
            self.planned = True
        if self.plan is not None:
            named = iter_sync_tensors(self.actor.chunks, self.desc, coords, self.plan, uses_te(self.actor.chunks))
        else:
            named = iter_hf_tensors(self.actor.chunks, self.desc, coords, shared=self.shared)
        if self.lora_mode == "merged":
            named = merged_hf_tensors(named, export_lora_tensors(self.actor.chunks), self.lora)
        return self.engine.sync_weights(named, policy_version=version) if self.remote else self.engine.sync_weights(named)


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


