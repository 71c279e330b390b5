"""The rank layout, in one place: how a job's ranks divide into tensor, pipeline and data
parallel groups and into training and rollout ranks, which pipeline rank holds which decoder
layer, and this rank's own coordinates. Config validation, the placement, conversion and the
workers all read it from here.

- :class:`ParallelLayout` / :func:`parallel_layout`: the sizes a config implies (DP derived from
  the world size: world = TP x CP x PP x DP); :func:`split_worlds`: training and rollout ranks; :func:`train_ranks_of`:
  which global ranks train under the split placement (as the launchers lay a job out).
- :func:`layers_per_chunk`, :func:`layer_owner`, :func:`global_layer`, :func:`stage_layers`: PP/VPP
  placement of layers. Evenly, the decoder's layers are split into ``pp * vpp`` chunks; chunk
  ``c = vp_stage * pp + pp_rank`` holds layers ``[c * n, (c + 1) * n)`` with
  ``n = num_layers / (pp * vpp)`` (megatron's interleaved assignment); a :class:`PipelineSplit`
  gives the first/last stage other counts, or counts the embedding/loss as layers (megatron's
  uneven pipeline; tested equal to megatron's own placement).
- :class:`RankCoords`: this rank's TP/PP/VPP/EP sizes, ranks and groups (from megatron's
  parallel state, or given).

Nothing here imports another part of megappo: every package may depend on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["ParallelLayout", "parallel_layout", "split_worlds", "train_ranks_of", "layers_per_chunk", "layer_owner",
           "global_layer", "RankCoords", "PipelineSplit", "pipeline_split", "split_problems", "stage_layers"]


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


@dataclass(frozen=True)
class PipelineSplit:
    """An uneven split of the decoder's layers over the pipeline stages (megatron's
    TransformerConfig fields of these names, verl's ``override_transformer_config.*``): the
    first and/or last stage hold ``first`` / ``last`` layers and the middle ones share the rest
    evenly; or the embedding and/or the loss count as one layer each of the first / last stage."""
    first: Optional[int] = None    # num_layers_in_first_pipeline_stage
    last: Optional[int] = None     # num_layers_in_last_pipeline_stage
    embedding: bool = False        # account_for_embedding_in_pipeline_split
    loss: bool = False             # account_for_loss_in_pipeline_split

    @classmethod
    def of(cls, config) -> Optional["PipelineSplit"]:
        """The split a megatron TransformerConfig (or a section with these fields) asks for; None: even."""
        s = cls(getattr(config, "num_layers_in_first_pipeline_stage", None),
                getattr(config, "num_layers_in_last_pipeline_stage", None),
                bool(getattr(config, "account_for_embedding_in_pipeline_split", False)),
                bool(getattr(config, "account_for_loss_in_pipeline_split", False)))
        return None if s == cls() else s


def _split_of(o: "RecomputeConfig") -> Optional[PipelineSplit]:
    """A megatron section's ``override_transformer_config`` split; None when even."""
    split = PipelineSplit(o.num_layers_in_first_pipeline_stage, o.num_layers_in_last_pipeline_stage,
                          o.account_for_embedding_in_pipeline_split, o.account_for_loss_in_pipeline_split)
    return None if split == PipelineSplit() else split


def pipeline_split(cfg, section=None) -> Optional[PipelineSplit]:
    """The uneven pipeline split of a role (None: even): its megatron ``section``'s
    ``override_transformer_config.num_layers_in_{first,last}_pipeline_stage`` /
    ``account_for_{embedding,loss}_in_pipeline_split`` where it sets one, else the actor's (verl's
    critic and reference default to the actor's override_transformer_config)."""
    actor = _split_of(cfg.actor_rollout_ref.actor.megatron.override_transformer_config)
    own = getattr(section, "override_transformer_config", None)
    return (_split_of(own) if own is not None else None) or actor


def split_problems(num_layers: int, pp: int, vpp: Optional[int], split: Optional[PipelineSplit] = None) -> list[str]:
    """Why the layers cannot be placed (megatron's rules, in the keys' names); [] when they can."""
    vs, s = vpp or 1, split or PipelineSplit()
    if pp == 1:
        return []
    if s.first is not None or s.last is not None:
        if s.embedding or s.loss:
            return ["num_layers_in_first/last_pipeline_stage and account_for_embedding/loss_in_pipeline_split "
                    "cannot be set together"]
        problems = [f"num_layers_in_{k}_pipeline_stage must be at least 1, got {n}" for k, n in
                    (("first", s.first), ("last", s.last)) if n is not None and n < 1]
        problems += [f"num_layers_in_{k}_pipeline_stage ({n}) is not divisible by virtual stages ({vs})" for k, n in
                     (("first", s.first), ("last", s.last)) if n is not None and n >= 1 and n % vs]
        middle = num_layers - (s.first or 0) - (s.last or 0)
        stages = pp - (s.first is not None) - (s.last is not None)
        if stages == 0 and vpp:
            problems.append("num_layers_in_first_pipeline_stage and num_layers_in_last_pipeline_stage with no middle "
                            "stage and virtual stages: megatron-core cannot place that (its layer offset divides by "
                            "the number of middle stages)")
        elif middle < 0 or (stages == 0 and middle) or (stages and (middle % (stages * vs) or middle == 0)):
            problems.append(f"the {middle} layers left after the first and last stages' cannot be split evenly over "
                            f"the {stages} middle stage(s) x {vs} virtual stage(s) (num_hidden_layers {num_layers})")
        return problems
    total = num_layers + s.embedding + s.loss
    if total % (pp * vs):
        if s.embedding or s.loss:
            return [f"num_hidden_layers ({num_layers}) + the embedding and loss stages counted as layers ({total}) "
                    f"is not divisible by pipeline_model_parallel_size x virtual stages ({pp} x {vs})"]
        return [f"num_hidden_layers ({num_layers}) is not divisible by pipeline_model_parallel_size x "
                f"virtual stages ({pp} x {vs})"]
    return []


def _offset(num_layers: int, pp: int, vpp: Optional[int], s: PipelineSplit, pp_rank: int, vp: int) -> int:
    """The global index of chunk (pp_rank, vp)'s first layer, as megatron's get_transformer_layer_offset."""
    vs = vpp or 1
    if s.first is not None or s.last is not None:
        f, l = s.first or 0, s.last or 0
        stages = pp - (s.first is not None) - (s.last is not None)
        middle_rank = pp_rank - (s.first is not None)
        per_middle = (num_layers - f - l) // vs // stages if stages else 0
        per_vp = f // vs + (num_layers - f - l) // vs + l // vs
        return vp * per_vp + (0 if pp_rank == 0 else f // vs + middle_rank * per_middle)
    total = num_layers + s.embedding + s.loss
    per = total // pp // vs
    return vp * (total // vs) + pp_rank * per - (1 if s.embedding and (pp_rank, vp) != (0, 0) else 0)


def stage_layers(num_layers: int, pp: int, vpp: Optional[int],
                 split: Optional[PipelineSplit] = None) -> dict[tuple[int, int], tuple[int, int]]:
    """(pp_rank, vp_stage) -> (first global layer, layer count) of every model chunk. Chunks hold
    consecutive layers in (vp_stage, pp_rank) order (megatron's interleaved assignment); evenly,
    ``num_layers / (pp x vpp)`` each. ValueError naming the problem when they cannot be placed."""
    problems = split_problems(num_layers, pp, vpp, split)
    if problems:
        raise ValueError("; ".join(problems))
    order = [(r, v) for v in range(vpp or 1) for r in range(pp)]
    if pp == 1:
        n = num_layers // len(order)
        return {c: (i * n, n) for i, c in enumerate(order)}
    s = split or PipelineSplit()
    starts = [_offset(num_layers, pp, vpp, s, r, v) for r, v in order] + [num_layers]
    return {c: (starts[i], starts[i + 1] - starts[i]) for i, c in enumerate(order)}


def layers_per_chunk(num_layers: int, pp: int, vpp: Optional[int]) -> int:
    """Layers of each chunk under an even split; ValueError when they do not divide."""
    chunks = pp * (vpp or 1)
    if num_layers % chunks:
        raise ValueError(f"num_hidden_layers ({num_layers}) must be divisible by pipeline_model_parallel_size x "
                         f"virtual stages ({pp} x {vpp or 1} = {chunks})")
    return num_layers // chunks


def layer_owner(layer: int, num_layers: int, pp: int, vpp: Optional[int],
                split: Optional[PipelineSplit] = None) -> tuple[int, int, int]:
    """Global layer index -> (pp_rank, vp_stage, chunk-local index)."""
    if split is None:
        n = layers_per_chunk(num_layers, pp, vpp)
        chunk, local = divmod(layer, n)
        vp_stage, pp_rank = divmod(chunk, pp)
        return pp_rank, vp_stage, local
    for (pp_rank, vp), (first, count) in stage_layers(num_layers, pp, vpp, split).items():
        if first <= layer < first + count:
            return pp_rank, vp, layer - first
    raise ValueError(f"layer {layer} is not one of the model's {num_layers}")


def global_layer(pp_rank: int, vp_stage: int, local: int, num_layers: int, pp: int, vpp: Optional[int],
                 split: Optional[PipelineSplit] = None) -> int:
    if split is None:
        n = layers_per_chunk(num_layers, pp, vpp)
        return (vp_stage * pp + pp_rank) * n + local
    return stage_layers(num_layers, pp, vpp, split)[(pp_rank, vp_stage)][0] + local


class RankCoords:
    """This rank's coordinates: TP and PP sizes/ranks, VPP size; EP size/rank (MoE experts)."""

    def __init__(self, tp: int = 1, tp_rank: int = 0, pp: int = 1, pp_rank: int = 0, vpp: Optional[int] = None,
                 tp_group=None, pp_group=None, mp_group=None, ep: int = 1, ep_rank: int = 0, ep_group=None,
                 split: Optional[PipelineSplit] = None):
        self.tp, self.tp_rank, self.pp, self.pp_rank, self.vpp = tp, tp_rank, pp, pp_rank, vpp
        self.tp_group, self.pp_group, self.mp_group = tp_group, pp_group, mp_group
        self.ep, self.ep_rank, self.ep_group = ep, ep_rank, ep_group
        self.split = split   # an uneven pipeline split (None: even)

    @classmethod
    def from_megatron(cls, config=None) -> "RankCoords":
        """From megatron's parallel state; ``config``: the model's TransformerConfig, whose
        pipeline split (if uneven) places the layers."""
        from megatron.core import parallel_state as ps

        return cls(split=PipelineSplit.of(config) if config is not None else None,
                   tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                   pp=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                   vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
                   tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
                   mp_group=ps.get_model_parallel_group(), ep=ps.get_expert_model_parallel_world_size(),
                   ep_rank=ps.get_expert_model_parallel_rank(),
                   ep_group=ps.get_expert_model_parallel_group(check_initialized=False))

    def owner(self, pm, num_layers: int) -> int:
        """Pipeline rank holding the parameter ``pm`` (a :class:`~megappo.convert.ParamMap`)."""
        if pm.layer is not None:
            return layer_owner(pm.layer, num_layers, self.pp, self.vpp, self.split)[0]
        return 0 if pm.where == "first" else self.pp - 1
