"""verl's ``<role>.model.override_config.model_config``: HF config entries set over the model
folder's config.json. verl applies them to the trained model's config only, so a changed RoPE
base or context length trains one model while vLLM samples from another. Here every reader of
the folder -- the megatron build, vLLM, the tokenizer, each checkpoint's ``huggingface/`` copy --
reads one folder: links to the source's files beside a merged config.json, in megappo's cache
(:func:`overridden_folder`). The tokenizer stays model.path's (its files are the same). Entries that would change the weights' shapes are
refused (the folder's weights would no longer load)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

from .hf import ModelConfigError, describe, load_hf_config

__all__ = ["SHAPE_KEYS", "merged_config", "override_problems", "check_overrides", "overridden_folder"]

# entries that change a weight's shape or which weights exist: the source's safetensors would not load
SHAPE_KEYS = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
              "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
              "attention_bias", "mlp_bias", "num_experts", "num_local_experts", "moe_intermediate_size",
              "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size", "num_labels")

_overlays: dict[tuple, str] = {}


def override_problems(overrides: Any) -> list[str]:
    """What is wrong with an override mapping, without reading any folder."""
    if not isinstance(overrides, dict):
        return [f"expected a mapping of config.json entries, got {overrides!r}"]
    return [f"{k}: changes the shapes of the model's weights (the folder's safetensors would not load); "
            f"entries that may be set are those that keep them (max_position_embeddings, rope_theta, "
            f"rope_scaling, rms_norm_eps, ...)" for k in overrides if k in SHAPE_KEYS]


def merged_config(source: dict, overrides: dict) -> dict:
    """config.json's entries with ``overrides`` over them; a mapping merges into a mapping entry
    key by key (``rope_scaling.factor``, ``text_config.<entry>``), as verl's nested overrides. A
    RoPE base given as ``rope_theta`` also lands in ``rope_parameters`` where the file has that
    (transformers 5 reads the base from there and ignores the top-level entry)."""
    out = dict(source)
    for k, v in overrides.items():
        out[k] = merged_config(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    if "rope_theta" in overrides and isinstance(out.get("rope_parameters"), dict):
        out["rope_parameters"] = {**out["rope_parameters"], "rope_theta": overrides["rope_theta"]}
    return out


def _read_config(path: str) -> dict:
    p = os.path.join(os.path.expanduser(path), "config.json")
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"{p}: cannot be read ({e})") from e


def _took_effect(config, key: str, value: Any) -> bool:
    if key in ("dtype", "torch_dtype"):   # read as a torch.dtype
        got = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        return str(got).replace("torch.", "") == str(value).replace("torch.", "")
    if key == "rope_theta":
        params = getattr(config, "rope_parameters", None) or {}
        got = params.get("rope_theta", getattr(config, "rope_theta", None))
        return got == value
    if key == "rope_scaling":
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        if value is None:
            return params.get("rope_type", params.get("type", "default")) == "default"
        return all(params.get("rope_type" if k == "type" else k) == v for k, v in value.items())
    got = getattr(config, key, None)
    if isinstance(value, dict):
        return all(_took_effect(got, k, v) if not isinstance(got, dict) else got.get(k) == v
                   for k, v in value.items())
    return got == value


def check_overrides(path: str, overrides: dict, trust_remote_code: bool = False):
    """The merged config as transformers reads it, each entry checked to have taken effect and
    the model to be one megappo builds (:func:`megappo.models.describe`); errors name the entry."""
    problems = override_problems(overrides)
    if problems:
        raise ModelConfigError("; ".join(problems))
    folder = overridden_folder(path, overrides)
    config = load_hf_config(folder, trust_remote_code)
    ignored = [k for k, v in overrides.items() if not _took_effect(config, k, v)]
    if ignored:
        raise ModelConfigError(f"{', '.join(ignored)}: set in config.json but not what transformers reads "
                               f"(not an entry of {type(config).__name__}, or one it derives from others)")
    describe(config)
    return config


def _cache_root() -> str:
    return os.environ.get("MEGAPPO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megappo")


def overridden_folder(path: str, overrides: dict) -> str:
    """``path`` itself without overrides; else ``<cache>/model_overrides/<hash>`` (``$MEGAPPO_CACHE``,
    default ``~/.cache/megappo``): links to every file of ``path`` but config.json, which is the
    merged one. Its name depends only on the source folder and the entries, so every rank and run
    with the same ones reads the same folder (vLLM's compile cache keys on the model's path), and a
    killed run leaves nothing behind that a later one would not reuse. Made once, atomically: ranks
    of one node racing to make it agree on one copy."""
    if not overrides:
        return path
    src = os.path.realpath(os.path.expanduser(path))
    key = (src, json.dumps(overrides, sort_keys=True))
    if key in _overlays and os.path.isfile(os.path.join(_overlays[key], "config.json")):
        return _overlays[key]
    digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]
    final = os.path.join(_cache_root(), "model_overrides", f"{os.path.basename(src)}-{digest}")
    merged = merged_config(_read_config(src), overrides)
    if not _same_overlay(final, src, merged):
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(final))
        for name in os.listdir(src):
            if name != "config.json":
                os.symlink(os.path.join(src, name), os.path.join(tmp, name))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(merged, f, indent=2)
        try:
            os.rename(tmp, final)
        except OSError:   # another rank made it first (or a stale copy is there): keep one that is right
            shutil.rmtree(tmp, ignore_errors=True)
            if not _same_overlay(final, src, merged):
                old = f"{final}.old-{os.getpid()}"
                os.rename(final, old)
                shutil.rmtree(old, ignore_errors=True)
                return overridden_folder(path, overrides)
    _overlays[key] = final
    return final


def _same_overlay(folder: str, src: str, merged: dict) -> bool:
    """``folder`` holds ``merged`` and a link to each file of ``src`` (the source may have changed)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            if json.load(f) != merged:
                return False
        names = set(os.listdir(src)) - {"config.json"}
        return names == set(os.listdir(folder)) - {"config.json"} and all(
            os.path.realpath(os.path.join(folder, n)) == os.path.realpath(os.path.join(src, n)) for n in names)
    except (OSError, ValueError):
        return False
