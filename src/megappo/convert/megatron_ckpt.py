"""Megatron dist_checkpointing folders read and written in ONE process.

A megappo worker checkpoint (``global_step_N/actor``, ``global_step_N/critic``) stores every
model tensor under a layout-independent key: the decoder layers of one parameter are stacked
along a leading layer axis (``decoder.layers.mlp.linear_fc1.weight``: (layers, 2F, hidden)),
TP shards sit at their global offsets. Mixture-of-Experts models mix dense and expert layers,
which megatron keys one layer at a time (``decoder.layers.3.self_attention.linear_qkv.weight``);
an MoE layer's experts share one key with a leading global-expert axis
(``decoder.layers.3.mlp.experts.experts.linear_fc1.weight``: (experts, 2F, hidden)) whatever
the expert-parallel size and expert implementation (SequentialMLP, TE's grouped GEMM) were.
Whatever TP/PP/EP saved it, a single process can therefore request any piece at its full
(TP=1) shape and dist_checkpointing re-assembles it from the shards: :func:`iter_hf_groups`
reads one decoder layer at a time and turns it into HF tensors with the maps of
:mod:`megappo.convert.names`. :func:`save_from_hf` writes such a folder from an
HF model by building the model once at TP1PP1 and saving its sharded state dict, so the folder
holds exactly the keys a trainer's model asks for.

Path checks (:func:`resolve_checkpoint`) import neither megatron nor torch.distributed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import warnings
from typing import Iterator, Optional

import torch

from .names import ParamMap, full_shape, param_maps, to_hf

from megappo.models import ModelDesc

__all__ = ["ConvertError", "resolve_checkpoint", "checkpoint_tensors", "checkpoint_desc", "hf_config_dir",
           "iter_hf_groups", "save_from_hf", "load_model_weights", "single_process_group", "is_out_of_space",
           "DTYPES", "quiet_warnings", "read_json", "ckpt_key", "layer_groups", "CheckpointKeys"]

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
# Hidden siblings of a step folder: a save in progress (.tmp_), one being replaced (.old_), ...
_HIDDEN_STEP = re.compile(r"^\.[A-Za-z]+_global_step_\d+$")
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_TE_PROBE = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
# an expert's parameter: SequentialMLP's local_experts.L.linear_fcK.weight, TE's linear_fcK.weightL
_EXPERT_PARAM = re.compile(r"\.mlp\.experts\.(?:local_experts\.\d+\.linear_fc([12])\.weight"
                           r"|linear_fc([12])\.weight\d+)$")
# norms saved under the name of the linear TE fuses them into (the local spec's keys map does the
# same), or under their own (TE's MoE layers: no linear_fc1 to fuse the pre-MLP norm into)
_NORM_ALIASES = {".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
                 ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight"}
_NORM_ALIASES.update({v: k for k, v in _NORM_ALIASES.items()})


class ConvertError(RuntimeError):
    """A conversion that cannot go ahead: the message names the path and the problem (one line)."""


# -- which folder ------------------------------------------------------------------------------
def _is_worker_dir(p: str) -> bool:
    return any(os.path.exists(os.path.join(p, f)) for f in ("metadata.json", ".metadata", "common.pt"))


def _read_latest(run_dir: str) -> Optional[int]:
    f = os.path.join(run_dir, "latest")
    if not os.path.isfile(f):
        return None
    text = open(f).read().strip()
    if not text.isdigit():
        raise ConvertError(f"{f}: expected a step number, found {text!r}")
    return int(text)


def resolve_checkpoint(path: str, critic: bool = False) -> str:
    """The dist_checkpointing folder to read, checked to be a finished, published checkpoint.

    ``path`` is a worker folder (``<run_dir>/global_step_N/actor``), a ``global_step_N`` folder
    (its ``actor/``, or ``critic/`` with ``critic``), or a run folder (the step its ``latest``
    file names). A worker folder inside a trainer run must belong to a published step: not a
    ``.tmp_global_step_N`` save in progress, and ``<run_dir>/latest`` names N or a later step.
    A stand-alone folder (e.g. written by convert_from_hf) needs its ``metadata.json``, which
    dist_checkpointing writes last.
    """
    worker = "critic" if critic else "actor"
    p = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(p):
        raise ConvertError(f"{path}: not a checkpoint directory (it does not exist)")
    if not os.path.isdir(p):
        raise ConvertError(f"{path}: not a checkpoint directory (it is a file)")
    if not _is_worker_dir(p) and os.path.isfile(os.path.join(p, "latest")):  # a run folder
        step = _read_latest(p)
        p = os.path.join(p, f"global_step_{step}")
        if not os.path.isdir(p):
            raise ConvertError(f"{path}: latest names step {step}, but {p} does not exist")
    base = os.path.basename(p)
    if not _is_worker_dir(p) and (_STEP_DIR.match(base) or _HIDDEN_STEP.match(base) or base.startswith(".tmp_")):
        p = os.path.join(p, worker)
        if not os.path.isdir(p):
            raise ConvertError(f"{path}: not a checkpoint directory (no {worker}/ in it"
                               + ("" if critic else "; for the value model pass --critic") + ")")
    for part in p.split(os.sep):
        if part.startswith(".tmp_") or _HIDDEN_STEP.match(part):
            raise ConvertError(f"{path}: unfinished checkpoint ({part} is not a published step: a save in progress, "
                               f"an interrupted one or one being replaced; only global_step_N folders can be read)")
    if not os.path.isfile(os.path.join(p, "metadata.json")):
        if _is_worker_dir(p):
            raise ConvertError(f"{path}: unfinished checkpoint (no metadata.json: the save did not complete)")
        raise ConvertError(f"{path}: not a checkpoint directory (no metadata.json; expected a megatron "
                           f"dist_checkpointing folder such as <run_dir>/global_step_N/{worker})")
    parent = os.path.dirname(p)
    m = _STEP_DIR.match(os.path.basename(parent))
    if m:
        run_dir, step = os.path.dirname(parent), int(m.group(1))
        latest = _read_latest(run_dir)
        if latest is None:
            raise ConvertError(f"{path}: unfinished checkpoint (not published: {run_dir}/latest is missing)")
        if latest < step:
            raise ConvertError(f"{path}: unfinished checkpoint (not published: {run_dir}/latest names step "
                               f"{latest}, not {step} or later)")
    return p


def hf_config_dir(ckpt: str, hf_config: Optional[str]) -> str:
    """Folder holding the HF config.json to describe the checkpoint with (``--hf-config``: a
    folder or a config.json path; default: the checkpoint's own ``huggingface/``)."""
    if hf_config is None:
        d = os.path.join(ckpt, "huggingface")
        if not os.path.isfile(os.path.join(d, "config.json")):
            raise ConvertError(f"{ckpt}: no huggingface/config.json in the checkpoint; pass --hf-config "
                               f"<the source HF model folder>")
        return d
    p = os.path.abspath(os.path.expanduser(hf_config))
    if os.path.isfile(p) and os.path.basename(p) == "config.json":
        return os.path.dirname(p)
    if not os.path.isfile(os.path.join(p, "config.json")):
        raise ConvertError(f"{hf_config}: no config.json (expected an HF model folder or its config.json)")
    return p


# -- what the checkpoint holds -------------------------------------------------------------------
def checkpoint_tensors(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Model tensors of a worker checkpoint: key -> (global shape, dtype); optimizer state left out."""
    with quiet_warnings():
        from megatron.core import dist_checkpointing

        try:
            md = dist_checkpointing.load_tensors_metadata(path)
        except Exception as e:
            raise ConvertError(f"{path}: cannot read the checkpoint metadata: {_one_line(e)}") from e
    return {k: (tuple(v.global_shape), v.dtype) for k, v in md.items() if not k.startswith("optimizer.")}


def ckpt_key(pm: ParamMap, keys: Optional["CheckpointKeys"] = None) -> str:
    """Checkpoint key of a parameter: layers lose their index (it becomes the leading axis),
    unless ``keys`` says the checkpoint keys each layer; experts lose theirs (the leading axis)."""
    return (keys or CheckpointKeys(())).key(pm)


class CheckpointKeys:
    """How a worker checkpoint keys the model's tensors (from the keys it holds)."""

    def __init__(self, tensors):
        self.keys = set(tensors)
        # megatron keys each layer of a model whose layers differ (dense and MoE mixed)
        self.per_layer = any(_LAYER_KEY.match(k) for k in self.keys)

    def key(self, pm: ParamMap) -> str:
        name = pm.megatron
        if pm.expert is not None:
            m = _EXPERT_PARAM.search(name)
            name = f"{name[:m.start()]}.mlp.experts.experts.linear_fc{m.group(1) or m.group(2)}.weight"
        if not self.per_layer:
            m = _LAYER_KEY.match(name)
            if m:
                name = f"decoder.layers.{m.group(2)}"
        if name not in self.keys:
            for a, b in _NORM_ALIASES.items():
                if name.endswith(a) and name[:-len(a)] + b in self.keys:
                    return name[:-len(a)] + b
        return name

    def shape(self, pm: ParamMap, desc: ModelDesc) -> tuple[int, ...]:
        """Global shape of the checkpoint tensor holding ``pm``: its full (TP=1) shape after a
        layer axis (stacked layers) and an expert axis (experts)."""
        lead = (desc.num_layers,) if pm.layer is not None and not self.per_layer else ()
        return (*lead, *((desc.num_experts,) if pm.expert is not None else ()), *full_shape(pm, desc))

    def request(self, pm: ParamMap, desc: ModelDesc, dtype: torch.dtype):
        """A ShardedTensor asking for ``pm``'s full tensor: a (1, ..., 1, *shape) piece at its
        layer's and expert's offsets of the saved tensor."""
        from megatron.core.dist_checkpointing import ShardedTensor

        # (megatron's own prepend_axis form takes torch's legacy sharded-tensor path, which needs
        # every layer on some rank)
        offsets = []
        if pm.layer is not None and not self.per_layer:
            offsets.append((len(offsets), pm.layer, desc.num_layers))
        if pm.expert is not None:
            offsets.append((len(offsets), pm.expert, desc.num_experts))
        data = torch.empty((1,) * len(offsets) + tuple(full_shape(pm, desc)), dtype=dtype)
        return ShardedTensor.from_rank_offsets(self.key(pm), data, *offsets, replica_id=0)


def checkpoint_desc(path: str, tensors: dict, hf_config, config_path: str, value_head: bool) -> tuple[ModelDesc, bool]:
    """Describe the checkpoint with the HF config and check every tensor shape against it.
    Returns the description (its padded vocabulary as saved) and whether names are TE-style
    (MoE models: the local spec's names; their keys are the same for both specs)."""
    from megappo.models import ModelConfigError, describe

    try:
        desc = describe(hf_config, tp=1, value_head=value_head).desc
    except ModelConfigError as e:
        raise ConvertError(f"{config_path}: {e}") from e
    keys = CheckpointKeys(tensors)
    te = not desc.num_experts and (_TE_PROBE in tensors or "decoder.layers.input_layernorm.weight" not in tensors)
    emb = tensors.get("embedding.word_embeddings.weight")
    if emb is not None and len(emb[0]) == 2 and emb[0][0] >= desc.vocab_size:
        desc = dataclasses.replace(desc, padded_vocab_size=emb[0][0])
    problems, expected = [], set()
    for pm in param_maps(desc, te):
        key = keys.key(pm)
        if key in expected:
            continue
        expected.add(key)
        want = keys.shape(pm, desc)
        if key not in tensors:
            problems.append(f"{key} is missing from the checkpoint (the config expects shape {want})")
        elif tuple(tensors[key][0]) != tuple(want):
            problems.append(f"{key} is {tuple(tensors[key][0])} in the checkpoint, the config gives {want}")
    extra = sorted(k for k in tensors if k not in expected)
    if extra:
        problems.append("tensors the config does not describe: " + ", ".join(extra))
    if problems:
        hint = ""
        head = tensors.get("output_layer.weight")
        if not value_head and head is not None and head[0][0] == 1:
            hint = " (this looks like a critic checkpoint: pass --critic)"
        elif value_head and "output_layer.bias" not in tensors:
            hint = " (this does not look like a critic checkpoint: drop --critic)"
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ConvertError(f"{path}: architecture mismatch with {config_path}{hint}: " + "; ".join(problems[:3]) + more)
    return desc, te


def layer_groups(desc: ModelDesc, te: bool) -> list[list[ParamMap]]:
    """The parameters in reading order: embedding, one group per decoder layer, final norm + head."""
    groups: dict = {}
    for pm in param_maps(desc, te):
        key = pm.layer if pm.layer is not None else pm.where  # "first" / "last" outside the layers
        groups.setdefault(key, []).append(pm)
    return list(groups.values())


# -- reading -------------------------------------------------------------------------------------
@contextlib.contextmanager
def single_process_group():
    """A world of one (gloo, in-memory store) for dist_checkpointing, unless one already exists."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ConvertError("the converter runs in a single process; this one is part of a "
                               f"{dist.get_world_size()}-process job")
        yield
        return
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def iter_hf_groups(path: str, desc: ModelDesc, te: bool, tensors: dict,
                   dtype: Optional[torch.dtype] = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield the HF tensors of the checkpoint, one group (embedding, a decoder layer, the final
    norm and head) at a time, each group read with one partial dist_checkpointing load.
    Call inside :func:`single_process_group`."""
    from megatron.core import dist_checkpointing

    keys = CheckpointKeys(tensors)
    for group in layer_groups(desc, te):
        request = {pm.megatron: keys.request(pm, desc, tensors[keys.key(pm)][1]) for pm in group}
        with quiet_warnings():
            try:
                state = dist_checkpointing.load(request, path, validate_access_integrity=False)
            except Exception as e:
                raise ConvertError(f"{path}: cannot read {', '.join(sorted({keys.key(pm) for pm in group}))}"
                                   f"{'' if group[0].layer is None else f' (layer {group[0].layer})'}: "
                                   f"{_one_line(e)}") from e
        out = []
        for pm in group:
            full = state[pm.megatron].reshape(full_shape(pm, desc))
            for name, t in to_hf(pm, full, desc).items():
                out.append((name, (t if dtype is None else t.to(dtype)).contiguous()))
        del state, request
        yield out


# -- writing -------------------------------------------------------------------------------------
def save_from_hf(hf_dir: str, out: str, info, dtype: torch.dtype = torch.float32, progress: bool = True) -> int:
    """Write the HF safetensors model as a megatron checkpoint folder ``out``: model weights only,
    exactly what a trainer's ``save_worker`` writes for the model (the same keys, extra-state
    objects included), so it loads at any TP/PP whose padded vocabulary is the one ``info``
    describes. Builds the model once at TP1PP1 on the CPU and loads the HF weights into it
    (megappo's own loader); holds the whole model in memory. Returns the bytes of weights.
    Call inside :func:`single_process_group`; ``out`` must exist and be empty."""
    from tqdm import tqdm

    from megappo import megatron_cpu
    from megappo.checkpoint import in_process_write_results
    from megappo.layout import RankCoords
    from megappo.models import build_model, initialize_parallel, transformer_config

    from .hf_io import WeightLoadError, load_hf_weights

    bar = tqdm(total=3, desc="build model", disable=not progress)
    with quiet_warnings():
        from megatron.core import dist_checkpointing
        from megatron.core import parallel_state as ps

        if not torch.cuda.is_available():
            megatron_cpu.install()
        initialize_parallel(1, 1)
        try:
            cfg = transformer_config(info, tp=1, pp=1, params_dtype=dtype, cpu=True)
            chunks = build_model(info, cfg, use_te=False)
            bar.update()
            bar.set_description("load HF weights")
            try:
                load_hf_weights(chunks, hf_dir, info.desc, RankCoords(), te=False)
            except WeightLoadError as e:
                raise ConvertError(_one_line(e)) from e
            bar.update()
            bar.set_description("save checkpoint")
            in_process_write_results()   # no results server process for one synchronous save
            dist_checkpointing.save({"model": chunks[0].sharded_state_dict()}, out)
            bar.update()
        finally:
            ps.destroy_model_parallel()
    bar.close()
    return sum(p.numel() * p.element_size() for p in chunks[0].parameters())


def load_model_weights(chunks, path: str) -> None:
    """Load a checkpoint's model weights (a trainer checkpoint's ``actor``/``critic`` folder, or
    one written by convert_from_hf) into model chunks built at any TP/PP; optimizer state, if
    any, is left alone. Collective over the model's ranks, like megatron's load. The trainer's
    start-from-checkpoint reader does the work, so a checkpoint that does not match the model
    (a missing tensor, another shape, tensors the model lacks) is refused by name here too."""
    from megappo.checkpoint import CheckpointError, load_start_weights

    with quiet_warnings():
        try:
            load_start_weights(chunks, path)
        except CheckpointError as e:
            raise ConvertError(" ".join(str(e).split())) from e   # it names the path already


# -- small helpers -------------------------------------------------------------------------------
def is_out_of_space(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it, or a per-rank failure it carries) is ENOSPC/EDQUOT."""
    import errno

    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(x):
            return True
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [f for f in failures.values() if isinstance(f, BaseException)]
    return False


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if len(text) > 400:
        text = text[:400] + "..."
    return f"{type(e).__name__}: {text}" if not isinstance(e, (ConvertError, ValueError)) else text


@contextlib.contextmanager
def quiet_warnings():
    """megatron's import-time notices (no TE/apex) and torch DCP's deprecation notices."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path}: unreadable JSON: {e}") from e
