"""The training model's weights written as a HuggingFace folder, in process (verl's
``checkpoint.save_contents`` with ``hf_model``).

Every rank walks the model's HF tensors in step (:func:`~megappo.convert.iter_hf_tensors`: the TP
all-gathers, PP and EP broadcasts the weight sync makes); one rank writes them, streaming, into
safetensors files planned from the HF config: peak memory is one full tensor. A LoRA model is
written merged (``W + (alpha / r) B A``), so the folder serves as it is; a critic as
``*ForTokenClassification`` with one label, as the converter writes it.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from megappo.models import ModelDesc

from .hf_io import iter_hf_tensors
from .names import param_maps

__all__ = ["write_live_hf", "live_hf_writer", "hf_dtype"]


def hf_dtype(config_json: dict, chunks) -> torch.dtype:
    """The dtype the folder is written in: the source config's (as the converter's default), else
    the model's parameters'."""
    from .hf_export import _source_dtype

    return _source_dtype(config_json) or next(chunks[0].parameters()).dtype


def write_live_hf(chunks, desc: ModelDesc, out: str, config_json: dict, *, coords=None, write: bool,
                  max_shard_size="5GB", adapter_dir: Optional[str] = None,
                  base_model: Optional[str] = None) -> Optional[dict]:
    """Write ``chunks``' weights into the HF folder ``out`` (config.json from ``config_json``, the
    source model's, with the dtype and, for a critic, the head rewritten; safetensors files and
    their index). ``coords``: this rank's place in the model's groups (default: megatron's).
    Collective: every rank of the model's groups calls it; the rank with ``write`` writes (its
    folder must exist). A write that fails (disk full) stops writing but the walk
    goes on to its end, so the other ranks' collectives still pair up; the error is raised
    after it, on the writing rank. Returns the writer's summary (None elsewhere). A LoRA model's
    adapters also go to ``adapter_dir`` as a PEFT adapter folder on ``base_model``, when given."""
    from megappo.layout import RankCoords
    from megappo.models import (export_lora_tensors, has_lora, lora_spec_of, merged_hf_tensors, uses_te,
                                write_peft_adapter)

    from .hf_export import ShardWriter, _check_space, _hf_config_json, _numel, parse_size, plan_shards

    te = uses_te(chunks)
    dt = hf_dtype(config_json, chunks)
    # the files cut in the order iter_hf_tensors yields the tensors (each file is written front to back)
    shards = plan_shards(desc, te, dt, parse_size(max_shard_size), maps=param_maps(desc, te))
    where = {name: i for i, sh in enumerate(shards) for name, _ in sh.tensors}
    item = torch.empty((), dtype=dt).element_size()
    total = sum(item * _numel(s) for sh in shards for _, s in sh.tensors)
    err: Optional[BaseException] = None
    writers: dict[int, ShardWriter] = {}
    if write:
        try:
            _check_space(out, total + 64 * 1024 * (len(shards) + 1))
            with open(os.path.join(out, "config.json"), "w") as f:
                json.dump(_hf_config_json(config_json, desc, dt, desc.value_head), f, indent=2)
        except Exception as e:  # noqa: BLE001 - raised after the walk (the collectives must finish)
            err = e
    named = iter_hf_tensors(chunks, desc, coords or RankCoords.from_megatron(chunks[0].config), te)
    if has_lora(chunks):
        adapters, spec = export_lora_tensors(chunks), lora_spec_of(chunks)
        named = merged_hf_tensors(named, adapters, spec)
        if write and err is None and adapter_dir is not None:
            try:
                write_peft_adapter(adapter_dir, adapters, spec, base_model_name_or_path=base_model)
            except Exception as e:  # noqa: BLE001 - raised after the walk
                err = e
    for name, t in named:
        if not write or err is not None:
            continue
        try:
            i = where[name]
            if i not in writers:
                writers[i] = ShardWriter(os.path.join(out, shards[i].file), shards[i].tensors, dt)
            writers[i].write(name, t.detach().to(device="cpu", dtype=dt))
            if not writers[i].pending:
                writers[i].close()
        except Exception as e:  # noqa: BLE001
            err = e
    for w in writers.values():
        if not w.f.closed:
            w.f.close()
    if err is not None:
        raise err
    if not write:
        return None
    missing = [sh.file for i, sh in enumerate(shards) if i not in writers]
    if missing:
        raise RuntimeError(f"{out}: the model yielded no tensors for {', '.join(missing)}")
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {n: shards[i].file for n, i in where.items()}}
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return {"out": out, "files": [s.file for s in shards], "bytes": total, "dtype": str(dt), "tensors": len(where)}


def live_hf_writer(chunks, desc: ModelDesc, base_model: Optional[str] = None):
    """``writer(folder, write)`` for :func:`megappo.checkpoint.save_checkpoint`'s ``hf_weights``:
    the weights of ``chunks`` into ``folder``, whose config.json (the source model's, copied there
    by the writing rank) it reads and rewrites. A LoRA policy's adapters also go beside it, to
    ``lora_adapter/`` (PEFT's folder on ``base_model``: what vLLM serves and PEFT loads)."""
    def writer(folder: str, write: bool) -> None:
        config, err = {}, None
        if write:
            try:
                with open(os.path.join(folder, "config.json")) as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:   # raised after the walk: the other ranks' gathers must pair up
                err = e
        adapters = None if desc.value_head else os.path.join(os.path.dirname(folder), "lora_adapter")
        write_live_hf(chunks, desc, folder, config, write=write and err is None, adapter_dir=adapters,
                      base_model=base_model)
        if err is not None:
            raise err

    return writer
