"""Log-probabilities and entropy over vocabulary-parallel logits, without gathering the vocabulary.

Under tensor parallelism megatron's output layer leaves each TP rank with a contiguous slice of
the (padded) vocabulary: ``logits (..., V_local)`` holds global ids
``[rank * V_local, (rank + 1) * V_local)``. Both functions all-reduce only per-token scalars
(max, sum of exps, target logit, sum of p*z), so memory and traffic stay O(tokens), and their
backward passes are written out so no rank ever materialises the full vocabulary.

``vocab_size`` is the real vocabulary size: ids at or beyond it (megatron's padding for TP
divisibility) are excluded from the softmax, as the HF model they came from has no such rows.
With ``tp_group=None`` (or a group of one rank) the plain single-device computation is used.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["log_probs_from_logits", "entropy_from_vocab_parallel_logits", "log_probs_reference"]


def _tp(tp_group) -> tuple[int, int]:
    if tp_group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def _masked_padding(logits: torch.Tensor, rank: int, vocab_size: Optional[int]) -> torch.Tensor:
    """Logits (float32 or wider) with padded vocabulary ids set to -inf."""
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if vocab_size is None:
        return z
    v_local = z.shape[-1]
    start = rank * v_local
    if start + v_local <= vocab_size:
        return z
    ids = torch.arange(start, start + v_local, device=z.device)
    return z.masked_fill(ids >= vocab_size, float("-inf"))


def _lse(z: torch.Tensor, tp_group, world: int) -> torch.Tensor:
    """Global logsumexp over the last dim of vocab shards (detached): each rank's fused local
    logsumexp, combined across ranks through per-token scalars only."""
    with torch.no_grad():
        local = torch.logsumexp(z, dim=-1)
        if world == 1:
            return local
        m = local.clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
        s = torch.exp(local - m)
        dist.all_reduce(s, group=tp_group)
        return torch.log(s) + m


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, tp_group, vocab_size):
        world, rank = _tp(tp_group)
        z = _masked_padding(logits, rank, vocab_size)
        lse = _lse(z, tp_group, world)
        v_local = z.shape[-1]
        local = labels - rank * v_local
        inside = (local >= 0) & (local < v_local)
        safe = torch.where(inside, local, torch.zeros_like(local))
        target = z.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        target = torch.where(inside, target, torch.zeros_like(target))
        if world > 1:
            dist.all_reduce(target, group=tp_group)
        ctx.save_for_backward(logits, lse, safe, inside)
        ctx.tp = (tp_group, vocab_size, rank)
        return (target - lse).to(logits.dtype if logits.dtype == torch.float64 else torch.float32)

    @staticmethod
    def backward(ctx, grad_out):
        logits, lse, safe, inside = ctx.saved_tensors
        tp_group, vocab_size, rank = ctx.tp
        z = _masked_padding(logits, rank, vocab_size)
        # d logp(y) / d z_j = 1[j = y] - softmax_j
        g = grad_out.to(z.dtype).unsqueeze(-1)
        grad = torch.sub(z, lse.unsqueeze(-1)).exp_().mul_(-g)
        grad.scatter_add_(-1, safe.unsqueeze(-1), torch.where(inside.unsqueeze(-1), g, torch.zeros_like(g)))
        return grad.to(logits.dtype), None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tp_group, vocab_size):
        world, rank = _tp(tp_group)
        z = _masked_padding(logits, rank, vocab_size)
        lse = _lse(z, tp_group, world)
        p = torch.exp(z - lse.unsqueeze(-1))
        pz = torch.where(p > 0, p * z, torch.zeros_like(p)).sum(-1)   # padded ids: 0 * -inf -> 0
        if world > 1:
            dist.all_reduce(pz, group=tp_group)
        ctx.save_for_backward(logits, lse, pz)
        ctx.tp = (vocab_size, rank)
        return (lse - pz).to(logits.dtype if logits.dtype == torch.float64 else torch.float32)

    @staticmethod
    def backward(ctx, grad_out):
        logits, lse, pz = ctx.saved_tensors
        vocab_size, rank = ctx.tp
        z = _masked_padding(logits, rank, vocab_size)
        p = torch.exp(z - lse.unsqueeze(-1))
        # dH/dz_j = p_j (sum_k p_k z_k - z_j)
        diff = torch.where(p > 0, pz.unsqueeze(-1) - z, torch.zeros_like(p))
        grad = p * diff * grad_out.unsqueeze(-1).to(p.dtype)
        return grad.to(logits.dtype), None, None


def log_probs_from_logits(vocab_parallel_logits: torch.Tensor, labels: torch.Tensor, tp_group=None,
                          vocab_size: Optional[int] = None) -> torch.Tensor:
    """log softmax(z)[label] for each position. logits (..., V_local) shard, labels (...) global ids.

    Returns float32 (float64 for float64 logits) of shape ``labels.shape``; differentiable w.r.t.
    the logits shard. Equal to :func:`log_probs_reference` on the gathered logits.
    """
    return _VocabParallelLogProb.apply(vocab_parallel_logits, labels, tp_group, vocab_size)


def entropy_from_vocab_parallel_logits(vocab_parallel_logits: torch.Tensor, tp_group=None,
                                       vocab_size: Optional[int] = None) -> torch.Tensor:
    """Entropy of softmax(z) over the whole (unpadded) vocabulary, (..., V_local) -> (...)."""
    return _VocabParallelEntropy.apply(vocab_parallel_logits, tp_group, vocab_size)


def log_probs_reference(logits: torch.Tensor, labels: torch.Tensor, vocab_size: Optional[int] = None) -> torch.Tensor:
    """The naive full-vocabulary computation: log_softmax over the real vocabulary, then gather."""
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if vocab_size is not None:
        z = z[..., :vocab_size]
    return torch.log_softmax(z, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
