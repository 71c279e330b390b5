"""Command lines of checkpoints_tools/: argument parsing and error reporting only.

A problem with the inputs (a path that is not a checkpoint, an unfinished save, a config that
does not match the tensors, no disk space) ends the program with exit code 2 and one line on
stderr naming the path and the problem; a verification above tolerance exits with 1.

An HF model argument may be a hub id (``org/name[@rev]``, see megappo.hub): it is resolved into the
HF cache first (--hf-config without the weights, which it does not need).
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

__all__ = ["convert_to_hf_main", "convert_from_hf_main", "verify_main"]

_DTYPE_CHOICES = ("fp32", "bf16", "fp16")


def _local(path: Optional[str], weights: bool = True) -> Optional[str]:
    """``path`` itself, or a hub id's folder in the HF cache (downloaded once per node)."""
    from megappo import hub

    if path is None or not hub.is_hub_id(path):
        return path
    return hub.resolve(path, ignore_patterns=None if weights else hub.WEIGHT_PATTERNS)


def _run(prog: str, body: Callable[[], int]) -> int:
    from megappo.hub import HubError

    from .megatron_ckpt import ConvertError

    try:
        return body()
    except (ConvertError, HubError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def convert_to_hf_main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(
        prog="convert_to_hf.py", description="Export a megappo (Megatron) checkpoint as a HuggingFace model folder.")
    p.add_argument("--ckpt", required=True,
                   help="<run_dir>/global_step_N/actor (or .../critic with --critic); a global_step_N folder or a run "
                        "folder (its latest step) also work")
    p.add_argument("--out", required=True, help="output folder (must not exist, or be empty)")
    p.add_argument("--hf-config", default=None,
                   help="source HF model folder, its config.json, or a hub id org/name[@rev] (default: "
                        "<ckpt>/huggingface, saved by the trainer)")
    p.add_argument("--dtype", choices=_DTYPE_CHOICES, default=None, help="weights dtype (default: the source config's)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    p.add_argument("--critic", action="store_true",
                   help="export the critic (value model) as *ForTokenClassification with one label")
    p.add_argument("--merge", action="store_true",
                   help="a LoRA checkpoint: write the base model with the adapters merged in (default: a PEFT adapter "
                        "folder, adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--base", default=None,
                   help="a LoRA checkpoint's base model folder or hub id (default: the one its lora.json names)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)

    def body() -> int:
        from .hf_export import export_hf, human
        from .lora_export import export_lora

        if not a.critic and _lora_checkpoint(a.ckpt):
            r = export_lora(a.ckpt, a.out, merge=a.merge, base=_local(a.base), dtype=a.dtype)
            what = (f"the base with rank-{r['rank']} adapters merged in, {human(r['bytes'])} in {len(r['files'])} "
                    f"safetensors file(s)" if r["merged"] else
                    f"a PEFT adapter (rank {r['rank']}, {r['adapters']} modules, {human(r['bytes'])})")
            print(f"wrote {r['out']}: {what} (from {r['ckpt']})")
            return 0
        if a.merge or a.base:
            from .megatron_ckpt import ConvertError

            raise ConvertError(f"{a.ckpt}: --merge/--base are for LoRA checkpoints (with lora.json); this one holds "
                               f"{'a critic' if a.critic else 'full weights'}")

        r = export_hf(a.ckpt, a.out, hf_config=_local(a.hf_config, weights=False), dtype=a.dtype,
                      max_shard_size=a.max_shard_size, critic=a.critic, progress=not a.quiet)
        print(f"wrote {r['out']}: {r['tensors']} tensors, {human(r['bytes'])} in {len(r['files'])} safetensors "
              f"file(s), {r['dtype']} (from {r['ckpt']})")
        return 0

    return _run("convert_to_hf", body)


def _lora_checkpoint(ckpt: str) -> bool:
    """Whether ``ckpt`` resolves to a LoRA run's checkpoint (a lora.json); a path that does not
    resolve is not one (the full export reports what is wrong with it)."""
    from megappo.checkpoint import read_lora_file

    from .megatron_ckpt import ConvertError, resolve_checkpoint

    try:
        return read_lora_file(resolve_checkpoint(ckpt)) is not None
    except ConvertError:
        return False


def convert_from_hf_main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(
        prog="convert_from_hf.py",
        description="Write a HuggingFace model as an initial megappo (Megatron) checkpoint: model weights only.")
    p.add_argument("--hf", required=True, help="HF model folder (config.json + safetensors) or hub id org/name[@rev]")
    p.add_argument("--out", required=True, help="output checkpoint folder (must not exist, or be empty)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size it is meant for (vocabulary padding, checks)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size it is meant for (checks)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size it is meant for (Mixture-of-Experts models; checks)")
    p.add_argument("--dtype", choices=_DTYPE_CHOICES, default="fp32", help="stored dtype (default fp32)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    if a.tp < 1 or a.pp < 1 or a.ep < 1:
        p.error("--tp, --pp and --ep must be at least 1")

    def body() -> int:
        from .hf_export import human, import_hf

        r = import_hf(_local(a.hf), a.out, tp=a.tp, pp=a.pp, ep=a.ep, dtype=a.dtype, progress=not a.quiet)
        print(f"wrote {r['out']}: {human(r['bytes'])} of model weights, {r['dtype']}, vocabulary padded to "
              f"{r['padded_vocab_size']}")
        return 0

    return _run("convert_from_hf", body)


def verify_main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(
        prog="verify.py", description="Compare a megappo checkpoint with an HF model on a few random sequences.")
    p.add_argument("--ckpt", required=True, help="checkpoint folder (as for convert_to_hf.py)")
    p.add_argument("--hf", required=True, help="HF model folder or hub id org/name[@rev]")
    p.add_argument("--critic", action="store_true", help="compare the critic's values with a token-classification model")
    p.add_argument("--atol", type=float, default=None,
                   help="largest allowed difference (default 1e-5 for fp32 HF weights, 1e-1 for bf16/fp16)")
    p.add_argument("--num-seqs", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    def body() -> int:
        import json
        import os

        from .verify import compare_checkpoint_with_hf

        r = compare_checkpoint_with_hf(a.ckpt, _local(a.hf), critic=a.critic, num_seqs=a.num_seqs, seq_len=a.seq_len,
                                       seed=a.seed)
        atol = a.atol
        if atol is None:
            with open(os.path.join(r["hf"], "config.json")) as f:
                stored = json.load(f).get("dtype") or "float32"
            atol = 1e-5 if stored in ("float32", None) else 1e-1
        ok = r["max_abs_diff"] <= atol
        print(f"max |{r['what']} difference| = {r['max_abs_diff']:.3e} over {r['num_seqs']} sequences x "
              f"{r['positions']} positions (atol {atol:g}): {'OK' if ok else 'FAIL'}")
        return 0 if ok else 1

    return _run("verify", body)
