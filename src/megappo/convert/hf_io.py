"""Stream HF safetensors into megatron model chunks, and stream full HF-named tensors out of them.

Loading reads, for each local parameter, only this rank's slice of each HF tensor it is made from
(safetensors slices), so a rank holds at most its own shard plus the pieces being fused. All
missing, unexpected and mis-shaped tensors are reported together, naming them, before any weight
is copied.

Exporting (:func:`iter_hf_tensors`) walks every parameter of the model in a fixed order on every
rank: the owning pipeline stage all-gathers it over TP, broadcasts it over PP, and every rank
yields the full HF-named tensors. The vLLM weight sync and the HF exporter both use it.
"""
from __future__ import annotations

import json
import os
import re
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from .names import ParamMap, full_shape, hf_shapes, param_maps, to_hf, to_megatron

from megappo.models import ModelDesc
from megappo.layout import RankCoords

from .parallel import tp_gather, tp_rows, to_global_name

__all__ = ["WeightLoadError", "SafetensorsCheckpoint", "load_hf_weights", "iter_hf_tensors", "plan_shared_gather",
           "gather_full", "local_params"]


class WeightLoadError(ValueError):
    """The checkpoint does not match the model: names every missing, unexpected or mis-shaped tensor."""


# Tensors some HF checkpoints carry that no megatron parameter corresponds to.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


class SafetensorsCheckpoint:
    """A (possibly sharded) safetensors checkpoint folder: tensor names, shapes and sliced reads."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = os.path.expanduser(path)
        index = os.path.join(self.path, "model.safetensors.index.json")
        single = os.path.join(self.path, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(single):
            weight_map = None
        else:
            raise WeightLoadError(f"{path}: no model.safetensors or model.safetensors.index.json")
        self._open = safe_open
        self._files: dict = {}
        self.file_of: dict[str, str] = {}
        if weight_map is None:
            for k in self._handle("model.safetensors").keys():
                self.file_of[k] = "model.safetensors"
        else:
            self.file_of = dict(weight_map)

    def _handle(self, fname: str):
        if fname not in self._files:
            p = os.path.join(self.path, fname)
            if not os.path.isfile(p):
                raise WeightLoadError(f"{self.path}: shard file {fname} listed in the index is missing")
            self._files[fname] = self._open(p, framework="pt", device="cpu")
        return self._files[fname]

    def names(self) -> set[str]:
        return set(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.file_of[name]).get_slice(name).get_shape())

    def read(self, name: str, dim: Optional[int] = None, sl: Optional[slice] = None) -> torch.Tensor:
        """The tensor, or only ``sl`` along ``dim`` (0 or 1) of it."""
        s = self._handle(self.file_of[name]).get_slice(name)
        if dim is None:
            return s[:]
        return s[sl] if dim == 0 else s[:, sl]


def _check(ckpt: SafetensorsCheckpoint, maps: list[ParamMap], desc: ModelDesc) -> None:
    have = ckpt.names()
    expected: dict[str, tuple] = {}
    for pm in maps:
        expected.update(hf_shapes(pm, desc))
    optional = {"score.weight", "score.bias"} if desc.value_head else set()
    problems = []
    missing = sorted(n for n in expected if n not in have and n not in optional)
    if missing:
        problems.append("missing tensors: " + ", ".join(missing))
    ignorable = set()
    if desc.tie_word_embeddings or desc.value_head:
        ignorable.add("lm_head.weight")  # tied copy, or an LM head the critic does not use
    extra = sorted(n for n in have - set(expected) - ignorable if not n.endswith(_IGNORABLE_SUFFIXES))
    if extra:
        problems.append("unexpected tensors: " + ", ".join(extra))
    for n, shp in expected.items():
        if n in have and ckpt.shape(n) != tuple(shp):
            problems.append(f"{n}: shape {ckpt.shape(n)} in the checkpoint, the model expects {tuple(shp)}")
    if problems:
        raise WeightLoadError(f"{ckpt.path} does not match the {desc.arch} model: " + "; ".join(problems))


def _read_shard(pm: ParamMap, read: Callable, desc: ModelDesc, rank: int, size: int) -> torch.Tensor:
    """This TP rank's piece of the megatron tensor, reading only the needed HF slices."""
    if pm.partition_dim is None or size == 1:
        return to_megatron(pm, {n: read(n) for n in pm.hf}, desc)
    if pm.kind == "qkv":
        g = desc.num_groups // size
        per = desc.num_heads // desc.num_groups
        d = desc.head_dim
        q, k, v = pm.hf
        parts = {q: read(q, 0, tp_rows(desc.num_heads * d, rank, size)),
                 k: read(k, 0, tp_rows(desc.num_groups * d, rank, size)),
                 v: read(v, 0, tp_rows(desc.num_groups * d, rank, size))}
        assert parts[q].shape[0] == g * per * d
        return to_megatron(pm, parts, desc, groups=g)
    if pm.kind == "gate_up":
        s = tp_rows(desc.ffn_hidden_size, rank, size)
        return to_megatron(pm, {n: read(n, 0, s) for n in pm.hf}, desc)
    if pm.kind == "vocab":
        s = tp_rows(desc.padded_vocab_size, rank, size)
        real = slice(min(s.start, desc.vocab_size), min(s.stop, desc.vocab_size))
        rows = read(pm.hf[0], 0, real) if real.stop > real.start else None
        if rows is None:
            return torch.zeros(s.stop - s.start, desc.hidden_size)
        return to_megatron(pm, {pm.hf[0]: rows}, desc, pad_rows=s.stop - s.start)
    s = tp_rows(full_shape(pm, desc)[pm.partition_dim], rank, size)
    return read(pm.hf[0], pm.partition_dim, s)


# an expert's local index in its name: SequentialMLP (local_experts.L.) or TE's grouped experts (weightL)
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.(?:local_experts\.(\d+)\.|linear_fc[12]\.weight(\d+)$)")


def local_params(chunks, desc: ModelDesc, coords: RankCoords) -> dict[str, torch.nn.Parameter]:
    """Global megatron name -> this rank's parameter, over all its VPP chunks."""
    out = {}
    per_rank = desc.num_experts // coords.ep if desc.num_experts else 0
    for vp, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            name = to_global_name(name, coords.pp_rank, vp, desc.num_layers, coords.pp, coords.vpp, coords.split)
            m = _LOCAL_EXPERT.search(name)
            if m:   # this EP rank's k-th expert is the model's (ep_rank x experts per rank + k)-th
                g = 1 if m.group(1) is not None else 2
                name = f"{name[:m.start(g)]}{coords.ep_rank * per_rank + int(m.group(g))}{name[m.end(g):]}"
            out[name] = p
    return out


def _maps_for(desc: ModelDesc, te: bool, local: dict) -> dict[str, ParamMap]:
    maps = {pm.megatron: pm for pm in param_maps(desc, te)}
    if desc.tie_word_embeddings and not desc.value_head and "output_layer.weight" in local:
        # The last stage's copy of the tied embedding (pipeline parallel): loaded from the embedding.
        maps["output_layer.weight"] = ParamMap("output_layer.weight", ("model.embed_tokens.weight",), "vocab", 0,
                                               where="last")
    return maps


def _te(chunks, te: Optional[bool]) -> bool:
    from megappo.models import uses_te

    return bool(te) if te is not None else uses_te(chunks)


@torch.no_grad()
def load_hf_weights(chunks, model_dir: str, desc: ModelDesc, coords: RankCoords = None, te: Optional[bool] = None) -> None:
    """Copy an HF safetensors checkpoint into this rank's megatron chunks (streamed, sliced).
    ``te``: TransformerEngine parameter names (default: as the chunks were built)."""
    coords = coords or RankCoords()
    te = _te(chunks, te)
    ckpt = SafetensorsCheckpoint(model_dir)
    _check(ckpt, param_maps(desc, te), desc)
    local = local_params(chunks, desc, coords)
    maps = _maps_for(desc, te, local)
    unknown = sorted(n for n in local if n not in maps)
    if unknown:
        raise WeightLoadError(f"model parameters with no HF counterpart: {', '.join(unknown)}")
    have = ckpt.names()
    for name, param in local.items():
        pm = maps[name]
        if not all(n in have for n in pm.hf):  # an optional tensor (the critic's head): keep its init
            continue
        shard = _read_shard(pm, ckpt.read, desc, coords.tp_rank, coords.tp)
        if tuple(shard.shape) != tuple(param.shape):
            raise WeightLoadError(f"{name}: built a shard of shape {tuple(shard.shape)} for a parameter of shape "
                                  f"{tuple(param.shape)}")
        param.copy_(shard.to(param.dtype))


def plan_shared_gather(chunks, desc: ModelDesc, coords: RankCoords, te: Optional[bool] = None):
    """A :class:`~megappo.convert.shm.SharedHFModel` for :func:`iter_hf_tensors` when the whole
    model-parallel group shares one host and holds CPU tensors, else ``None``. Collective over
    ``coords.mp_group``; plan once per model (parameters keep their storage)."""
    from .shm import SharedHFModel

    return SharedHFModel.plan(local_params(chunks, desc, coords), desc, coords, _te(chunks, te))


@torch.no_grad()
def iter_hf_tensors(chunks, desc: ModelDesc, coords: RankCoords = None, te: Optional[bool] = None,
                    dtype: Optional[torch.dtype] = None, shared=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for every HF tensor of the model, on every rank.

    Collective: every rank of the model-parallel group must iterate it to the end, in step.
    ``shared`` (from :func:`plan_shared_gather`) replaces the per-tensor TP all-gather and PP
    broadcast: each rank writes its shards into a shared copy of the HF model and the tensors
    yielded are views of it, valid until the next call (consume them, as a weight sync does).
    Without it, a tensor needing no gather is the parameter itself.
    """
    if shared is not None:
        shared.publish()
        for name, t in shared.tensors():
            yield name, (t if dtype is None else t.to(dtype))
        return
    coords = coords or RankCoords()
    local = local_params(chunks, desc, coords)
    for pm in param_maps(desc, _te(chunks, te)):
        for name, t in to_hf(pm, gather_full(pm, local, desc, coords), desc).items():
            yield name, (t if dtype is None else t.to(dtype))


def gather_full(pm: ParamMap, local: dict, desc: ModelDesc, coords: RankCoords) -> torch.Tensor:
    """The full megatron tensor of ``pm`` on every rank of the model-parallel group: a TP
    all-gather on the owning stage, then a broadcast over the pipeline. ``local``: this rank's
    parameters by global name (:func:`local_params`). Collective over TP and PP groups; an
    expert's tensor comes first from the EP rank holding it (broadcast over the EP group)."""
    owner = coords.owner(pm, desc.num_layers)
    any_param = next(iter(local.values()))
    if pm.expert is not None and coords.ep > 1 and owner == coords.pp_rank:
        holder = pm.expert // (desc.num_experts // coords.ep)
        full = (local[pm.megatron].detach().contiguous() if holder == coords.ep_rank else
                torch.empty(full_shape(pm, desc), dtype=any_param.dtype, device=any_param.device))
        dist.broadcast(full, src=dist.get_global_rank(coords.ep_group, holder), group=coords.ep_group)
    elif owner == coords.pp_rank:
        shard = local[pm.megatron].detach()
        if pm.partition_dim is not None and coords.tp > 1:
            pieces = [torch.empty_like(shard) for _ in range(coords.tp)]
            dist.all_gather(pieces, shard.contiguous(), group=coords.tp_group)
            full = tp_gather(pieces, pm)
        else:
            full = shard
    else:
        full = torch.empty(full_shape(pm, desc), dtype=any_param.dtype, device=any_param.device)
    if coords.pp > 1:
        full = full.contiguous()
        dist.broadcast(full, src=dist.get_global_rank(coords.pp_group, owner), group=coords.pp_group)
    return full
