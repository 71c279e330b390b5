"""Rollout replicas: prompts split over the vLLM replicas (never splitting a prompt's samples),
results gathered in prompt order on every rank."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megappo.seeds import prompt_seed

from .engine import RolloutOutput

__all__ = ["rollout_replica", "prompt_slice", "gather_outputs", "generate_replicated"]


def generate_replicated(engine, prompts: list, sampling, rank: int, world: int, rollout_tp: int,
                        group=None) -> RolloutOutput:
    """All replicas' outputs for ``prompts``, in prompt order, on every rank of ``group``: this
    rank's replica generates its contiguous slice. ``sampling.seed`` is the seed of the first
    prompt; prompt i's samples start at seed + i x n, so what is sampled does not depend on the
    number of replicas (colocated and split placements alike). ``sampling`` is not changed."""
    import copy

    replica, n_rep = rollout_replica(rank, world, rollout_tp)
    sl = prompt_slice(len(prompts), replica, n_rep)
    mine = copy.copy(sampling)
    mine.seed = prompt_seed(sampling.seed, sl.start, sampling.n)
    return gather_outputs(engine.generate(prompts[sl], mine), sl.start, rollout_tp, engine.pad_token_id, group)


def rollout_replica(rank: int, world: int, rollout_tp: int) -> tuple[int, int]:
    """(replica index, number of replicas): blocks of ``rollout_tp`` consecutive ranks form one
    vLLM replica (the external-launcher layout with vLLM's own DP = 1)."""
    if world % rollout_tp:
        raise ValueError(f"world size {world} is not divisible by the rollout TP size {rollout_tp}")
    return rank // rollout_tp, world // rollout_tp


def prompt_slice(n_prompts: int, replica: int, n_replicas: int) -> slice:
    """Contiguous prompts of one replica; the first ``n_prompts % n_replicas`` replicas get one more."""
    base, extra = divmod(n_prompts, n_replicas)
    start = replica * base + min(replica, extra)
    return slice(start, start + base + (1 if replica < extra else 0))


def _pad_to(t: torch.Tensor, T: int, value) -> torch.Tensor:
    if t.shape[1] == T:
        return t
    return torch.nn.functional.pad(t, (0, T - t.shape[1]), value=value)


def concat(outs: list[RolloutOutput], offsets: list[int], pad_token_id: int) -> RolloutOutput:
    T = max(o.responses.shape[1] for o in outs)
    return RolloutOutput(
        prompt_index=torch.cat([o.prompt_index + off for o, off in zip(outs, offsets)]),
        responses=torch.cat([_pad_to(o.responses, T, pad_token_id) for o in outs]),
        response_mask=torch.cat([_pad_to(o.response_mask, T, 0.0) for o in outs]),
        rollout_log_probs=torch.cat([_pad_to(o.rollout_log_probs, T, 0.0) for o in outs]),
        finish_reasons=[r for o in outs for r in o.finish_reasons])


def gather_outputs(local: RolloutOutput, prompt_offset: int, rollout_tp: int, pad_token_id: int,
                   group=None) -> RolloutOutput:
    """Every rank receives all replicas' samples in global prompt order (one copy per replica:
    the TP peers of a replica hold identical outputs)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return concat([local], [prompt_offset], pad_token_id)
    world = dist.get_world_size(group)
    objs = [None] * world
    dist.all_gather_object(objs, (prompt_offset, local), group=group)
    firsts = [objs[r] for r in range(0, world, rollout_tp)]
    return concat([o for _, o in firsts], [off for off, _ in firsts], pad_token_id)
