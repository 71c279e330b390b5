"""Pure tensor maps between HF tensors and megatron-core tensors, on FULL (unsharded) tensors (the
weight converter, megappo.convert, and the LoRA adapters' fused outputs, megappo.models.lora, use them).

Architecture facts (megatron-core 0.16, local and TE specs alike):
- ``linear_qkv`` stacks, for each query group g, that group's query heads, then its key head,
  then its value head: rows ``[q_g (heads/groups * d) ; k_g (d) ; v_g (d)]`` for g = 0..G-1.
  A contiguous split over TP therefore hands each rank whole groups.
- ``linear_fc1`` is ``[gate ; up]`` (SwiGLU); under TP each rank holds ``[gate_r ; up_r]``, so
  the TP split works on each half separately (see :mod:`megappo.convert.parallel`); a rank's
  own shard is the same maps applied to its groups / rows.
- The word embedding and output layer have the vocabulary padded to ``padded_vocab_size``.
"""
from __future__ import annotations

import torch

__all__ = ["fuse_qkv", "qkv_group_views", "split_qkv", "fuse_gate_up", "split_gate_up", "pad_vocab", "unpad_vocab"]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int,
             head_dim: int) -> torch.Tensor:
    """HF q (H*d, ...), k (G*d, ...), v (G*d, ...) -> megatron linear_qkv ((H+2G)*d, ...).

    Works for weights (rows x hidden) and biases (rows,)."""
    if num_heads % num_groups:
        raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_groups})")
    per = num_heads // num_groups
    rest = q.shape[1:]
    _expect(q, (num_heads * head_dim, *rest), "q")
    _expect(k, (num_groups * head_dim, *rest), "k")
    _expect(v, (num_groups * head_dim, *rest), "v")
    qg = q.reshape(num_groups, per * head_dim, *rest)
    kg = k.reshape(num_groups, head_dim, *rest)
    vg = v.reshape(num_groups, head_dim, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape((num_heads + 2 * num_groups) * head_dim, *rest)


def qkv_group_views(qkv: torch.Tensor, num_heads: int, num_groups: int, head_dim: int):
    """Views (no copy) of megatron linear_qkv's q, k, v per query group: shapes
    (G, H/G*d, ...), (G, d, ...), (G, d, ...). HF's q, k, v are these with the first two dims merged."""
    per = num_heads // num_groups
    rest = qkv.shape[1:]
    _expect(qkv, ((num_heads + 2 * num_groups) * head_dim, *rest), "linear_qkv")
    g = qkv.reshape(num_groups, (per + 2) * head_dim, *rest)
    return torch.split(g, [per * head_dim, head_dim, head_dim], dim=1)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_groups: int, head_dim: int):
    """Inverse of :func:`fuse_qkv`: megatron linear_qkv -> (q, k, v) in HF layout."""
    return tuple(t.reshape(-1, *qkv.shape[1:]).contiguous()
                 for t in qkv_group_views(qkv, num_heads, num_groups, head_dim))


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF gate_proj, up_proj (F, hidden) -> megatron linear_fc1 (2F, hidden) = [gate; up]."""
    if gate.shape != up.shape:
        raise ValueError(f"gate_proj {tuple(gate.shape)} and up_proj {tuple(up.shape)} differ in shape")
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor):
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def pad_vocab(w: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    """Append zero rows up to ``padded_vocab_size`` (megatron's TP-divisible vocabulary)."""
    if w.shape[0] > padded_vocab_size:
        raise ValueError(f"vocabulary of {w.shape[0]} rows exceeds the padded size {padded_vocab_size}")
    if w.shape[0] == padded_vocab_size:
        return w
    pad = torch.zeros(padded_vocab_size - w.shape[0], *w.shape[1:], dtype=w.dtype, device=w.device)
    return torch.cat([w, pad], dim=0)


def unpad_vocab(w: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return w[:vocab_size].contiguous()


def _expect(t: torch.Tensor, shape, what: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{what}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
