"""A LoRA run's checkpoint (adapters only, :mod:`megappo.checkpoint`) as a PEFT adapter folder,
or, merged into its base model's weights, as an HF model folder (one process).

The checkpoint's ``lora.json`` names the adapters' rank, alpha and modules and the base they go
on; the adapter tensors are read whole from the dist_checkpointing folder (they are small) and
named as PEFT saves them. The merged export streams the base's safetensors files one at a time:
each adapted weight becomes ``W + (alpha / r) B A`` (computed in fp32), everything else is copied.
Output goes to a hidden sibling folder renamed into place at the end, as the full export does.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

import torch

from .megatron_ckpt import DTYPES, ConvertError, checkpoint_tensors, quiet_warnings, resolve_checkpoint, single_process_group

__all__ = ["export_lora", "read_checkpoint_adapters"]

# a stacked (decoder.layers.<linear>...) or per-layer (decoder.layers.<i>.<linear>...) adapter key
_KEY = re.compile(r"^decoder\.layers\.(?:(\d+)\.)?[\w.]+\.lora\.lora_([AB])\.(\w+)$")


def read_checkpoint_adapters(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(lora.json's facts, full adapter tensors by PEFT name) of a LoRA worker checkpoint."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from megappo.checkpoint import read_lora_file
    from megappo.models import peft_name

    facts = read_lora_file(path)
    if facts is None:
        raise ConvertError(f"{path}: not a LoRA checkpoint (no lora.json): it holds full weights; export it without "
                           f"--merge / --peft")
    keys = {k: v for k, v in checkpoint_tensors(path).items() if _KEY.match(k)}
    if not keys:
        raise ConvertError(f"{path}: lora.json is there but the checkpoint holds no adapter tensors")
    request = {k: ShardedTensor.from_rank_offsets(k, torch.empty(shape, dtype=dt), replica_id=0)
               for k, (shape, dt) in keys.items()}
    with single_process_group(), quiet_warnings():
        try:
            state = dist_checkpointing.load(request, path, validate_access_integrity=False)
        except Exception as e:
            raise ConvertError(f"{path}: cannot read the adapters: {type(e).__name__}: {e}") from e
    out = {}
    for k in keys:   # (the loaded state holds the checkpoint's common objects too)
        t = state[k]
        layer, which, module = _KEY.match(k).groups()
        if layer is not None:
            out[peft_name(int(layer), module, which)] = t.float().contiguous()
        else:   # stacked over the layers (megatron's dense layer offsets)
            for i in range(t.shape[0]):
                out[peft_name(i, module, which)] = t[i].float().contiguous()
    return facts, out


def export_lora(ckpt: str, out: str, merge: bool = False, base: Optional[str] = None, dtype: Optional[str] = None) -> dict:
    """Write the LoRA checkpoint ``ckpt`` (as :func:`resolve_checkpoint` takes it) as a PEFT adapter
    folder ``out``, or with ``merge`` as the HF model ``base`` (default: the base the checkpoint's
    lora.json names) with the adapters merged in. ``dtype``: fp32/bf16/fp16 of the merged weights
    (default: the base's). Returns a summary."""
    from megappo.models import LoRASpec, lora_targets, write_peft_adapter

    from .hf_export import AUX_FILES, _prepare_out, _publish, _write_failed

    path = resolve_checkpoint(ckpt)
    facts, adapters = read_checkpoint_adapters(path)
    spec = LoRASpec(int(facts["r"]), float(facts["lora_alpha"]), tuple(lora_targets(facts["target_modules"])))
    base_dir = os.path.expanduser(base or facts.get("base_model_name_or_path") or "")
    if merge and not os.path.isfile(os.path.join(base_dir, "config.json")):
        raise ConvertError(f"{path}: the base model {base_dir or '(none named in lora.json)'} is not an HF model "
                           f"folder here; pass --base <the base model's folder>")
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"--dtype: expected one of fp32, bf16, fp16, got {dtype!r}")
    final, tmp = _prepare_out(out)
    try:
        if not merge:
            write_peft_adapter(tmp, adapters, spec, base_model_name_or_path=facts.get("base_model_name_or_path"))
            n_bytes = os.path.getsize(os.path.join(tmp, "adapter_model.safetensors"))
            files = ["adapter_model.safetensors"]
        else:
            n_bytes, files = _write_merged(base_dir, tmp, adapters, spec, DTYPES[dtype] if dtype else None)
            for name in AUX_FILES + ("config.json", "model.safetensors.index.json"):
                src = os.path.join(base_dir, name)
                if os.path.isfile(src) and not os.path.exists(os.path.join(tmp, name)):
                    shutil.copy2(src, os.path.join(tmp, name))
            if dtype:
                _set_config_dtype(os.path.join(tmp, "config.json"), DTYPES[dtype])
        _publish(tmp, final)
    except BaseException as e:
        _write_failed(out, tmp, e)
        raise
    return {"out": final, "ckpt": path, "files": files, "bytes": n_bytes, "adapters": len(adapters) // 2,
            "merged": merge, "rank": spec.rank}


def _write_merged(base_dir: str, tmp: str, adapters: dict, spec, dtype: Optional[torch.dtype]) -> tuple[int, list]:
    """Each safetensors file of the base, in turn, with the adapters merged into its weights."""
    from safetensors.torch import load_file, save_file

    from megappo.models import merged_hf_tensors

    files = sorted(f for f in os.listdir(base_dir) if f.endswith(".safetensors"))
    if not files:
        raise ConvertError(f"{base_dir}: no .safetensors files (the merged export needs the base weights)")
    merged, n_bytes = 0, 0
    for f in files:
        tensors = load_file(os.path.join(base_dir, f))
        out = {}
        for name, t in merged_hf_tensors(tensors.items(), adapters, spec):
            merged += t is not tensors[name]
            out[name] = (t if dtype is None or not t.is_floating_point() else t.to(dtype)).contiguous()
        save_file(out, os.path.join(tmp, f), metadata={"format": "pt"})
        n_bytes += os.path.getsize(os.path.join(tmp, f))
        del tensors, out
    if merged != len(adapters) // 2:
        raise ConvertError(f"{base_dir}: {merged} of the {len(adapters) // 2} adapted weights were found in the base "
                           f"(is it the model the run trained on?)")
    return n_bytes, files


def _set_config_dtype(config_json: str, dtype: torch.dtype) -> None:
    with open(config_json) as f:
        c = json.load(f)
    c["dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    c.pop("torch_dtype", None)
    with open(config_json, "w") as f:
        json.dump(c, f, indent=2)
