"""The rank layout, in one place: how a job's ranks divide into tensor, pipeline and data
parallel groups and into training and rollout ranks, which pipeline rank holds which decoder
layer, and this rank's own coordinates. Config validation, the placement, conversion and the
workers all read it from here.

- :class:`ParallelLayout` / :func:`parallel_layout`: the sizes a config implies (DP derived from
  the world size: world = TP x CP x PP x DP); :func:`split_worlds`: training and rollout ranks; :func:`train_ranks_of`:
  which global ranks train under the split placement (as the launchers lay a job out).
- :func:`layers_per_chunk`, :func:`layer_owner`, :func:`global_layer`: PP/VPP placement of
  layers. The decoder's layers are split evenly into ``pp * vpp`` chunks; chunk
  ``c = vp_stage * pp + pp_rank`` holds layers ``[c * n, (c + 1) * n)`` with
  ``n = num_layers / (pp * vpp)`` (megatron's interleaved assignment).
- :class:`RankCoords`: this rank's TP/PP/VPP/EP sizes, ranks and groups (from megatron's
  parallel state, or given).

Nothing here imports another part of megappo: every package may depend on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["ParallelLayout", "parallel_layout", "split_worlds", "train_ranks_of", "layers_per_chunk", "layer_owner",
           "global_layer", "RankCoords"]


@dataclass
class ParallelLayout:
    world_size: int
    tp: int
    pp: int
    vpp: Optional[int]
    dp: int
    rollout_tp: int
    rollout_dp: int
    split: bool = False          # actor_rollout_ref.hybrid_engine=False: separate rollout ranks
    train_world: int = 0         # ranks that train (the whole world when colocated)
    rollout_world: int = 0       # ranks that roll out (the whole world when colocated)
    cp: int = 1                  # context parallelism: CP ranks share a DP rank's rows


def split_worlds(cfg) -> tuple[int, int]:
    """(training ranks, rollout ranks) the config asks for; colocated: the same ranks do both."""
    tr, ro = cfg.trainer, cfg.rollout
    train = tr.nnodes * tr.n_gpus_per_node
    return (train, ro.nnodes * ro.n_gpus_per_node) if not cfg.actor_rollout_ref.hybrid_engine else (train, train)


def parallel_layout(cfg, world_size: Optional[int] = None) -> ParallelLayout:
    """The rank layout the config (a :class:`~megappo.config.PPOConfig`) implies (DP derived
    from the world size; ``world_size``: the whole job's, rollout ranks included under the split
    placement)."""
    m = cfg.actor_rollout_ref.actor.megatron
    split = not cfg.actor_rollout_ref.hybrid_engine
    train, rollout = split_worlds(cfg)
    world = train + rollout if split else train
    if world_size is not None:
        train, world = (world_size - rollout, world_size) if split else (world_size, world_size)
        rollout = rollout if split else world_size
    mp = max(1, m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size)
    rtp = max(1, cfg.actor_rollout_ref.rollout.tensor_model_parallel_size)
    return ParallelLayout(world, m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                          m.virtual_pipeline_model_parallel_size, train // mp, rtp, rollout // rtp, split, train, rollout,
                          max(1, m.context_parallel_size))


def train_ranks_of(train_nnodes: int, train_per_node: int, rollout_nnodes: int, rollout_per_node: int) -> list[int]:
    """Global ranks that train, as the launchers lay out a split job (``trainer.*`` / ``rollout.*``
    nodes and ranks per node): with as many rollout nodes as training nodes, every node's first
    ``train_per_node`` local ranks train and its last ``rollout_per_node`` roll out; otherwise the
    training nodes come first (whole nodes) and the rollout nodes after them."""
    if rollout_nnodes == train_nnodes:
        per = train_per_node + rollout_per_node
        return [n * per + i for n in range(train_nnodes) for i in range(train_per_node)]
    return list(range(train_nnodes * train_per_node))


def layers_per_chunk(num_layers: int, pp: int, vpp: Optional[int]) -> int:
    chunks = pp * (vpp or 1)
    if num_layers % chunks:
        raise ValueError(f"num_hidden_layers ({num_layers}) must be divisible by pipeline_model_parallel_size x "
                         f"virtual stages ({pp} x {vpp or 1} = {chunks})")
    return num_layers // chunks


def layer_owner(layer: int, num_layers: int, pp: int, vpp: Optional[int]) -> tuple[int, int, int]:
    """Global layer index -> (pp_rank, vp_stage, chunk-local index)."""
    n = layers_per_chunk(num_layers, pp, vpp)
    chunk, local = divmod(layer, n)
    vp_stage, pp_rank = divmod(chunk, pp)
    return pp_rank, vp_stage, local


def global_layer(pp_rank: int, vp_stage: int, local: int, num_layers: int, pp: int, vpp: Optional[int]) -> int:
    n = layers_per_chunk(num_layers, pp, vpp)
    return (vp_stage * pp + pp_rank) * n + local


class RankCoords:
    """This rank's coordinates: TP and PP sizes/ranks, VPP size; EP size/rank (MoE experts)."""

    def __init__(self, tp: int = 1, tp_rank: int = 0, pp: int = 1, pp_rank: int = 0, vpp: Optional[int] = None,
                 tp_group=None, pp_group=None, mp_group=None, ep: int = 1, ep_rank: int = 0, ep_group=None):
        self.tp, self.tp_rank, self.pp, self.pp_rank, self.vpp = tp, tp_rank, pp, pp_rank, vpp
        self.tp_group, self.pp_group, self.mp_group = tp_group, pp_group, mp_group
        self.ep, self.ep_rank, self.ep_group = ep, ep_rank, ep_group

    @classmethod
    def from_megatron(cls) -> "RankCoords":
        from megatron.core import parallel_state as ps

        return cls(tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                   pp=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                   vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
                   tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
                   mp_group=ps.get_model_parallel_group(), ep=ps.get_expert_model_parallel_world_size(),
                   ep_rank=ps.get_expert_model_parallel_rank(),
                   ep_group=ps.get_expert_model_parallel_group(check_initialized=False))

    def owner(self, pm, num_layers: int) -> int:
        """Pipeline rank holding the parameter ``pm`` (a :class:`~megappo.convert.ParamMap`)."""
        if pm.layer is not None:
            return layer_owner(pm.layer, num_layers, self.pp, self.vpp)[0]
        return 0 if pm.where == "first" else self.pp - 1
