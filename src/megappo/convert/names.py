"""HF <-> megatron-core parameter names per architecture (Qwen3, Qwen2/2.5, Llama-3).

``param_maps(desc)`` lists every megatron parameter of the model (global layer indices) with the
HF tensors it is made from and how. Local-spec and TransformerEngine-spec names differ only in
where the pre-attention and pre-MLP norms live (TE fuses them into the following linear).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megappo.models import ModelDesc, fuse_gate_up, fuse_qkv, pad_vocab, split_gate_up, split_qkv, unpad_vocab

__all__ = ["ParamMap", "param_maps", "to_megatron", "to_hf", "full_shape"]

ARCHS = ("qwen3", "qwen2", "llama", "qwen3_moe")


@dataclass(frozen=True)
class ParamMap:
    megatron: str                 # megatron name with the GLOBAL layer index
    hf: tuple[str, ...]           # HF tensors it is built from, in fusing order
    kind: str                     # copy | qkv | gate_up | vocab
    partition_dim: Optional[int]  # TP split dimension of the megatron tensor; None = replicated
    layer: Optional[int] = None   # global layer index; None for embedding / final norm / head
    where: str = "layer"          # layer | first (embedding) | last (final norm, output layer)
    expert: Optional[int] = None  # GLOBAL expert index of an expert's tensor (its name says it too)


def param_maps(desc: ModelDesc, te: bool = False) -> list[ParamMap]:
    if desc.arch not in ARCHS:
        raise ValueError(f"unsupported architecture {desc.arch!r}; supported: {', '.join(ARCHS)}")
    maps = [ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0, where="first")]
    in_norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"
    for i in range(desc.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        att = h + "self_attn."
        maps.append(ParamMap(m + in_norm, (h + "input_layernorm.weight",), "copy", None, i))
        maps.append(ParamMap(m + "self_attention.linear_qkv.weight",
                             (att + "q_proj.weight", att + "k_proj.weight", att + "v_proj.weight"), "qkv", 0, i))
        if desc.qkv_bias:
            maps.append(ParamMap(m + "self_attention.linear_qkv.bias",
                                 (att + "q_proj.bias", att + "k_proj.bias", att + "v_proj.bias"), "qkv", 0, i))
        if desc.qk_layernorm:
            maps.append(ParamMap(m + "self_attention.q_layernorm.weight", (att + "q_norm.weight",), "copy", None, i))
            maps.append(ParamMap(m + "self_attention.k_layernorm.weight", (att + "k_norm.weight",), "copy", None, i))
        maps.append(ParamMap(m + "self_attention.linear_proj.weight", (att + "o_proj.weight",), "copy", 1, i))
        moe = i in desc.moe_layers
        # TE's MoE layers keep their own pre-MLP norm (no linear_fc1 to fuse it into)
        maps.append(ParamMap(m + ("pre_mlp_layernorm.weight" if moe else mlp_norm),
                             (h + "post_attention_layernorm.weight",), "copy", None, i))
        if moe:
            # router replicated; each expert whole on its expert-parallel rank (expert-TP 1), named
            # here by its global index (hf_io maps it to the rank's local one). SequentialMLP:
            # experts.local_experts.E.linear_fc1.weight; TE's grouped experts: experts.linear_fc1.weightE
            maps.append(ParamMap(m + "mlp.router.weight", (h + "mlp.gate.weight",), "copy", None, i))
            for e in range(desc.num_experts):
                fc1, fc2 = ((f"{m}mlp.experts.linear_fc1.weight{e}", f"{m}mlp.experts.linear_fc2.weight{e}") if te else
                            (f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight",
                             f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"))
                hx = f"{h}mlp.experts.{e}."
                maps.append(ParamMap(fc1, (hx + "gate_proj.weight", hx + "up_proj.weight"), "gate_up", None, i, expert=e))
                maps.append(ParamMap(fc2, (hx + "down_proj.weight",), "copy", None, i, expert=e))
            continue
        maps.append(ParamMap(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                             "gate_up", 0, i))
        maps.append(ParamMap(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "copy", 1, i))
    maps.append(ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None, where="last"))
    if desc.value_head:
        maps.append(ParamMap("output_layer.weight", ("score.weight",), "copy", None, where="last"))
        maps.append(ParamMap("output_layer.bias", ("score.bias",), "copy", None, where="last"))
    elif not desc.tie_word_embeddings:
        maps.append(ParamMap("output_layer.weight", ("lm_head.weight",), "vocab", 0, where="last"))
    return maps


def full_shape(pm: ParamMap, desc: ModelDesc) -> tuple[int, ...]:
    """Shape of the full (TP=1) megatron tensor."""
    name, d = pm.megatron, desc
    if pm.kind == "vocab":
        return (d.padded_vocab_size, d.hidden_size)
    if pm.kind == "qkv":
        rows = (d.num_heads + 2 * d.num_groups) * d.head_dim
        return (rows,) if name.endswith("bias") else (rows, d.hidden_size)
    ffn = d.moe_ffn_hidden_size if pm.expert is not None else d.ffn_hidden_size
    if pm.kind == "gate_up":
        return (2 * ffn, d.hidden_size)
    if name.endswith("linear_proj.weight"):
        return (d.hidden_size, d.num_heads * d.head_dim)
    if name.endswith("linear_fc2.weight") or (pm.expert is not None and ".linear_fc2.weight" in name):
        return (d.hidden_size, ffn)        # the latter: TE's grouped experts (linear_fc2.weight{E})
    if name.endswith("mlp.router.weight"):
        return (d.num_experts, d.hidden_size)
    if "q_layernorm" in name or "k_layernorm" in name:
        return (d.head_dim,)
    if name == "output_layer.weight":  # value head
        return (1, d.hidden_size)
    if name == "output_layer.bias":
        return (1,)
    return (d.hidden_size,)


def hf_shapes(pm: ParamMap, desc: ModelDesc) -> dict[str, tuple[int, ...]]:
    """Expected shape of each HF tensor ``pm`` is built from."""
    d = desc
    if pm.kind == "vocab":
        return {pm.hf[0]: (d.vocab_size, d.hidden_size)}
    if pm.kind == "qkv":
        tail = () if pm.megatron.endswith("bias") else (d.hidden_size,)
        q, k, v = pm.hf
        return {q: (d.num_heads * d.head_dim, *tail), k: (d.num_groups * d.head_dim, *tail),
                v: (d.num_groups * d.head_dim, *tail)}
    if pm.kind == "gate_up":
        ffn = d.moe_ffn_hidden_size if pm.expert is not None else d.ffn_hidden_size
        return {n: (ffn, d.hidden_size) for n in pm.hf}
    return {pm.hf[0]: full_shape(pm, desc)}


def to_megatron(pm: ParamMap, hf: dict[str, torch.Tensor], desc: ModelDesc, groups: Optional[int] = None,
                pad_rows: Optional[int] = None) -> torch.Tensor:
    """Build the megatron tensor from HF tensors. ``groups``/``pad_rows`` let callers fuse a TP
    shard from sliced HF tensors (a rank's query groups; the rank's vocabulary rows)."""
    if pm.kind == "qkv":
        g = desc.num_groups if groups is None else groups
        return fuse_qkv(*(hf[n] for n in pm.hf), g * (desc.num_heads // desc.num_groups), g, desc.head_dim)
    if pm.kind == "gate_up":
        return fuse_gate_up(hf[pm.hf[0]], hf[pm.hf[1]])
    if pm.kind == "vocab":
        return pad_vocab(hf[pm.hf[0]], desc.padded_vocab_size if pad_rows is None else pad_rows)
    return hf[pm.hf[0]]


def to_hf(pm: ParamMap, full: torch.Tensor, desc: ModelDesc) -> dict[str, torch.Tensor]:
    """Split a full megatron tensor back into its HF tensors."""
    if pm.kind == "qkv":
        return dict(zip(pm.hf, split_qkv(full, desc.num_heads, desc.num_groups, desc.head_dim)))
    if pm.kind == "gate_up":
        return dict(zip(pm.hf, split_gate_up(full)))
    if pm.kind == "vocab":
        return {pm.hf[0]: unpad_vocab(full, desc.vocab_size)}
    return {pm.hf[0]: full}
