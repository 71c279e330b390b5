"""Megatron checkpoints -> HuggingFace folders, and HF folders -> Megatron checkpoints (one process).

Export streams: the shard plan (which HF tensor goes to which safetensors file, at which
offset) follows from the HF config alone, so every file's header is written before its data and
each tensor is appended as soon as its decoder layer has been read. Peak memory is one decoder
layer (or the embedding) in megatron and HF form; no shard is ever held whole.

Both directions write into a hidden sibling folder (``.tmp_<name>``) renamed into place at the
end, check free disk space against the size to be written first, and remove the partial output
when a write fails (ENOSPC included).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import struct
from typing import Optional

import torch

from .megatron_ckpt import (DTYPES, ConvertError, checkpoint_desc, checkpoint_tensors, hf_config_dir,
                            is_out_of_space, iter_hf_groups, layer_groups, read_json, resolve_checkpoint,
                            save_from_hf, single_process_group)
from .names import full_shape, hf_shapes, param_maps
from megappo.models import ModelDesc

__all__ = ["export_hf", "import_hf", "plan_shards", "parse_size", "ShardWriter", "Shard"]

# Copied next to the weights: the source model's generation config and tokenizer.
AUX_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")
_ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_CONFIG_DTYPE = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_TOKEN_CLASSIFICATION = {"qwen3": "Qwen3ForTokenClassification", "qwen2": "Qwen2ForTokenClassification",
                         "llama": "LlamaForTokenClassification", "qwen3_moe": "Qwen3MoeForTokenClassification"}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def parse_size(text) -> int:
    """``"5GB"`` (decimal units, as transformers), ``"512MiB"``, or a byte count."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", str(text).lower())
    if not m:
        raise ConvertError(f"--max-shard-size: expected a size such as 5GB or 500MB, got {text!r}")
    n = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if n <= 0:
        raise ConvertError(f"--max-shard-size: must be positive, got {text!r}")
    return n


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


@dataclasses.dataclass
class Shard:
    file: str
    tensors: list  # [(name, shape)], in the order they are produced


def plan_shards(desc: ModelDesc, te: bool, dtype: torch.dtype, max_bytes: int, maps=None) -> list[Shard]:
    """HF tensors in production order, cut into files of at most ``max_bytes`` (a tensor larger
    than that gets a file of its own). One file is ``model.safetensors``. ``maps``: the ParamMaps
    in the order their tensors come (default: the checkpoint reader's, layer by layer)."""
    item = torch.empty((), dtype=dtype).element_size()
    shards, cur, size = [], [], 0
    for group in ([maps] if maps is not None else layer_groups(desc, te)):
        for pm in group:
            for name, shape in hf_shapes(pm, desc).items():
                n = item * _numel(shape)
                if cur and size + n > max_bytes:
                    shards.append(cur)
                    cur, size = [], 0
                cur.append((name, tuple(shape)))
                size += n
    shards.append(cur)
    k = len(shards)
    names = ["model.safetensors"] if k == 1 else [f"model-{i + 1:05d}-of-{k:05d}.safetensors" for i in range(k)]
    return [Shard(f, t) for f, t in zip(names, shards)]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class ShardWriter:
    """One safetensors file written front to back: the header (names, dtypes, shapes, offsets)
    from the plan first, then each tensor's bytes as it arrives, in plan order."""

    def __init__(self, path: str, tensors: list, dtype: torch.dtype):
        self.path, self.dtype = path, dtype
        item = torch.empty((), dtype=dtype).element_size()
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in tensors:
            n = item * _numel(shape)
            header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self.pending = list(tensors)
        self.nbytes = 8 + len(raw) + off
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(raw)))
        self.f.write(raw)

    def write(self, name: str, t: torch.Tensor) -> None:
        want_name, want_shape = self.pending[0]
        if name != want_name or tuple(t.shape) != want_shape or t.dtype != self.dtype:
            raise RuntimeError(f"{self.path}: expected {want_name} {want_shape} {self.dtype}, got {name} "
                               f"{tuple(t.shape)} {t.dtype}")
        self.pending.pop(0)
        self.f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> None:
        if self.pending:
            raise RuntimeError(f"{self.path}: {len(self.pending)} tensors were never written")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def _check_space(target: str, need: int) -> None:
    probe = os.path.abspath(target)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    if free < need:
        raise ConvertError(f"{target}: not enough free disk space (the output needs about {human(need)}, "
                           f"{human(free)} free on that filesystem)")


def _prepare_out(out: str) -> tuple[str, str]:
    """(final path, hidden temporary sibling). ``out`` must not exist or be an empty folder."""
    final = os.path.abspath(os.path.expanduser(out))
    if os.path.exists(final) and (not os.path.isdir(final) or os.listdir(final)):
        raise ConvertError(f"{out}: output path exists and is not an empty directory")
    tmp = os.path.join(os.path.dirname(final), f".tmp_{os.path.basename(final)}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
    except OSError as e:
        raise ConvertError(f"{out}: cannot create the output: {e}") from e
    return final, tmp


def _publish(tmp: str, final: str) -> None:
    if os.path.isdir(final):
        os.rmdir(final)  # empty (checked before)
    os.replace(tmp, final)


def _source_dtype(config: dict) -> Optional[torch.dtype]:
    name = config.get("dtype") or config.get("torch_dtype")
    return DTYPES.get(str(name)) if name else None


def _hf_config_json(src: dict, desc: ModelDesc, dtype: torch.dtype, critic: bool) -> dict:
    cfg = dict(src)
    cfg["dtype"] = _CONFIG_DTYPE[dtype]
    cfg.pop("torch_dtype", None)
    if critic:
        cfg["architectures"] = [_TOKEN_CLASSIFICATION[desc.arch]]
        cfg["id2label"] = {"0": "LABEL_0"}
        cfg["label2id"] = {"LABEL_0": 0}
        cfg.pop("num_labels", None)
    return cfg


def export_hf(ckpt: str, out: str, hf_config: Optional[str] = None, dtype: Optional[str] = None,
              max_shard_size="5GB", critic: bool = False, progress: bool = True) -> dict:
    """Write the megatron checkpoint ``ckpt`` as an HF model folder ``out``; returns a summary.

    ``ckpt``: see :func:`resolve_checkpoint`. ``hf_config``: the source model's folder or
    config.json (default: ``<ckpt>/huggingface``). ``dtype``: fp32/bf16/fp16 (default: the source
    config's). ``critic``: a value-model checkpoint, written as ``*ForTokenClassification`` with
    one label (``score.weight`` (1, hidden), ``score.bias`` (1,)).
    """
    from tqdm import tqdm

    from megappo.models import ModelConfigError, load_hf_config

    max_bytes = parse_size(max_shard_size)
    path = resolve_checkpoint(ckpt, critic=critic)
    cfg_dir = hf_config_dir(path, hf_config)
    src_json = read_json(os.path.join(cfg_dir, "config.json"))
    try:
        cfg = load_hf_config(cfg_dir)
    except (ModelConfigError, ValueError, OSError) as e:
        raise ConvertError(f"{cfg_dir}: cannot read the HF config: {e}") from e
    tensors = checkpoint_tensors(path)
    desc, te = checkpoint_desc(path, tensors, cfg, os.path.join(cfg_dir, "config.json"), value_head=critic)
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"--dtype: expected one of fp32, bf16, fp16, got {dtype!r}")
    dt = DTYPES[dtype] if dtype else (_source_dtype(src_json) or next(iter(tensors.values()))[1])
    shards = plan_shards(desc, te, dt, max_bytes)
    aux_dirs = [cfg_dir, os.path.join(path, "huggingface")]
    aux = {n: os.path.join(d, n) for d in reversed(aux_dirs) for n in AUX_FILES if os.path.isfile(os.path.join(d, n))}
    item = torch.empty((), dtype=dt).element_size()
    weights = sum(item * _numel(s) for sh in shards for _, s in sh.tensors)
    need = weights + sum(os.path.getsize(p) for p in aux.values()) + 64 * 1024 * (len(shards) + 1)
    _check_space(out, need)
    final, tmp = _prepare_out(out)
    written = 0
    writers: dict[int, ShardWriter] = {}
    bar = tqdm(total=weights, desc=f"export {os.path.basename(final)}", unit="B", unit_scale=True,
               disable=not progress)
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(_hf_config_json(src_json, desc, dt, critic), f, indent=2)
        for n, p in aux.items():
            shutil.copy2(p, os.path.join(tmp, n))
        where = {name: i for i, sh in enumerate(shards) for name, _ in sh.tensors}
        with single_process_group():
            for group in iter_hf_groups(path, desc, te, tensors, dtype=dt):
                for name, t in group:
                    i = where[name]
                    if i not in writers:
                        writers[i] = ShardWriter(os.path.join(tmp, shards[i].file), shards[i].tensors, dt)
                    writers[i].write(name, t)
                    bar.update(t.numel() * t.element_size())
                    if not writers[i].pending:
                        writers[i].close()
                        written += writers[i].nbytes
                del group
        if len(shards) > 1:
            index = {"metadata": {"total_size": weights}, "weight_map": {n: shards[i].file for n, i in where.items()}}
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        bar.close()
        _publish(tmp, final)
    except BaseException as e:
        bar.close()
        for w in writers.values():
            if not w.f.closed:
                w.f.close()
        _write_failed(out, tmp, e)
        raise
    return {"out": final, "ckpt": path, "files": [s.file for s in shards], "bytes": written, "dtype": str(dt),
            "tensors": len(where), "critic": critic}


def _write_failed(out: str, tmp: str, e: BaseException) -> None:
    """Remove the partial output; turn disk-full and other OS errors into a ConvertError naming ``out``."""
    shutil.rmtree(tmp, ignore_errors=True)
    if is_out_of_space(e):
        raise ConvertError(f"{out}: out of disk space while writing ({_errstr(e)}); the partial output was "
                           f"removed") from e
    if isinstance(e, OSError):
        raise ConvertError(f"{out}: cannot write: {e}; the partial output was removed") from e


def _errstr(e: BaseException) -> str:
    while e is not None and not isinstance(e, OSError):
        e = e.__cause__ or e.__context__
    return e.strerror if isinstance(e, OSError) and e.strerror else "No space left on device"


def import_hf(hf_dir: str, out: str, tp: int = 1, pp: int = 1, dtype: Optional[str] = None,
              progress: bool = True, ep: int = 1) -> dict:
    """Write the HF model folder ``hf_dir`` as a megatron checkpoint folder ``out``: model
    weights only (no optimizer or trainer state), the vocabulary padded for ``tp``, plus
    ``huggingface/`` (config, generation config, tokenizer) as the trainer's checkpoints carry.
    ``tp``/``pp``/``ep`` are checked against the model; the tensors themselves are stored whole
    (experts by global index) and dist_checkpointing cuts them for whatever layout loads them."""
    from megappo.checkpoint import copy_hf_files
    from megappo.layout import layers_per_chunk
    from megappo.models import ModelConfigError, describe, load_hf_config

    src = os.path.abspath(os.path.expanduser(hf_dir))
    if not os.path.isdir(src):
        raise ConvertError(f"{hf_dir}: not an HF model directory (it does not exist)")
    try:
        cfg = load_hf_config(src)
        info = describe(cfg, tp=tp)
        desc = info.desc
        layers_per_chunk(desc.num_layers, pp, None)
        if ep > 1 and not desc.num_experts:
            raise ValueError(f"expert_model_parallel_size (--ep {ep}) needs a Mixture-of-Experts model")
        if desc.num_experts and desc.num_experts % ep:
            raise ValueError(f"num_experts ({desc.num_experts}) is not divisible by expert_model_parallel_size "
                             f"(--ep {ep})")
    except (ModelConfigError, ValueError) as e:
        raise ConvertError(f"{hf_dir}: {e}") from e
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"--dtype: expected one of fp32, bf16, fp16, got {dtype!r}")
    dt = DTYPES[dtype] if dtype else torch.float32
    item = torch.empty((), dtype=dt).element_size()
    need = sum(item * _numel(full_shape(pm, desc)) for pm in param_maps(desc, te=False)) + 1024 * 1024
    _check_space(out, need)
    final, tmp = _prepare_out(out)
    try:
        with single_process_group():
            total = save_from_hf(src, tmp, info, dtype=dt, progress=progress)
        copy_hf_files(src, os.path.join(tmp, "huggingface"))
        with open(os.path.join(tmp, "megappo_import.json"), "w") as f:
            json.dump({"source": src, "tp": tp, "pp": pp, "ep": ep, "padded_vocab_size": desc.padded_vocab_size,
                       "dtype": _CONFIG_DTYPE[dt], "contents": "model weights only"}, f, indent=2)
        _publish(tmp, final)
    except BaseException as e:
        _write_failed(out, tmp, e)
        raise
    return {"out": final, "bytes": total, "dtype": str(dt), "padded_vocab_size": desc.padded_vocab_size}
