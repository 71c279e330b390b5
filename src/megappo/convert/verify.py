"""A megatron checkpoint and an HF model compute the same thing: per-token log-probs (actor) or
per-position values (critic) on a few random sequences, both in float32, in one CPU process."""
from __future__ import annotations

import dataclasses
import os

import torch

from .megatron_ckpt import (ConvertError, quiet_warnings, checkpoint_desc, checkpoint_tensors, load_model_weights,
                            resolve_checkpoint, single_process_group)

__all__ = ["compare_checkpoint_with_hf", "hf_outputs"]


def _sequences(vocab_size: int, num_seqs: int, seq_len: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_seqs, seq_len), generator=g)


def _token_log_probs(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    lp = torch.log_softmax(logits[..., :vocab_size].float(), dim=-1)[:, :-1]
    return lp.gather(-1, ids[:, 1:, None])[..., 0]


@torch.no_grad()
def hf_outputs(hf_dir: str, ids: torch.Tensor, critic: bool, vocab_size: int) -> torch.Tensor:
    """(B, S-1) log-probs of tokens 1.. (causal LM) or (B, S) values (token classification)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    cls = AutoModelForTokenClassification if critic else AutoModelForCausalLM
    try:
        model, info = cls.from_pretrained(hf_dir, dtype=torch.float32, output_loading_info=True)
    except Exception as e:
        raise ConvertError(f"{hf_dir}: transformers cannot load it as {cls.__name__}: "
                           f"{' '.join(str(e).split())[:300]}") from e
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise ConvertError(f"{hf_dir}: loading reports " + "; ".join(f"{k}: {sorted(map(str, v))[:5]}" for k, v in bad.items()))
    out = model.eval()(ids).logits.float()
    return out[..., 0] if critic else _token_log_probs(out, ids, vocab_size)


@torch.no_grad()
def _megatron_outputs(path: str, cfg, desc, ids: torch.Tensor, critic: bool) -> torch.Tensor:
    with quiet_warnings():
        from megatron.core import parallel_state as ps

    from megappo import megatron_cpu
    from megappo.models import build_model, describe, initialize_parallel, transformer_config

    if not torch.cuda.is_available():
        megatron_cpu.install()
    info = describe(cfg, tp=1, value_head=critic)
    info.desc = dataclasses.replace(info.desc, padded_vocab_size=desc.padded_vocab_size)
    initialize_parallel(1, 1)
    try:
        with quiet_warnings():
            tcfg = transformer_config(info, tp=1, pp=1, cpu=True)
            chunks = build_model(info, tcfg, value_head=critic, use_te=False)
        load_model_weights(chunks, path)
        model = chunks[0].eval()
        pos = torch.arange(ids.shape[1])[None].expand_as(ids)
        out = model(ids, pos, attention_mask=None).float()
    finally:
        ps.destroy_model_parallel()
    return out[..., 0] if critic else _token_log_probs(out, ids, desc.vocab_size)


def compare_checkpoint_with_hf(ckpt: str, hf: str, critic: bool = False, num_seqs: int = 4, seq_len: int = 32,
                               seed: int = 0) -> dict:
    """Run both models on the same random sequences; returns ``max_abs_diff`` and the shapes."""
    from megappo.models import ModelConfigError, load_hf_config

    path = resolve_checkpoint(ckpt, critic=critic)
    hf_dir = os.path.abspath(os.path.expanduser(hf))
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ConvertError(f"{hf}: not an HF model directory (no config.json)")
    try:
        cfg = load_hf_config(hf_dir)
    except (ModelConfigError, ValueError, OSError) as e:
        raise ConvertError(f"{hf}: cannot read the HF config: {e}") from e
    desc, _ = checkpoint_desc(path, checkpoint_tensors(path), cfg, os.path.join(hf_dir, "config.json"),
                              value_head=critic)
    ids = _sequences(desc.vocab_size, num_seqs, seq_len, seed)
    ref = hf_outputs(hf_dir, ids, critic, desc.vocab_size)
    with single_process_group():
        got = _megatron_outputs(path, cfg, desc, ids, critic)
    return {"max_abs_diff": (got - ref).abs().max().item(), "what": "value" if critic else "log-prob",
            "num_seqs": num_seqs, "positions": int(ref.shape[1]), "ckpt": path, "hf": hf_dir}
