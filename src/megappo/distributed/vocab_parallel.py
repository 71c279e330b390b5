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

__all__ = ["log_probs_from_logits", "entropy_from_vocab_parallel_logits", "log_probs_and_entropy", "log_probs_reference",
           "sum_pi_squared_from_vocab_parallel_logits", "LOGITS_CHUNK_TOKENS"]


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


LOGITS_CHUNK_TOKENS = 1024
"""Tokens per chunk of the kernels' fp32 work: the full-vocabulary temporaries (the upcast, the
exponentials, the gradient before its cast) exist for this many tokens at a time, never for a whole
micro-batch (at TP2 with Qwen's vocabulary: 0.3 GiB per temporary instead of 7 GiB for 24k tokens)."""


def _chunks(n: int, chunk: Optional[int]):
    step = n if not chunk or chunk >= n else chunk
    return [slice(i, min(i + step, n)) for i in range(0, max(n, 1), step)] if n else []


def _combine_lse(local: torch.Tensor, tp_group, world: int) -> torch.Tensor:
    """Global logsumexp from each rank's local one: per-token scalars cross the group only."""
    if world == 1:
        return local
    m = local.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    s = torch.exp(local - m)
    dist.all_reduce(s, group=tp_group)
    return torch.log(s) + m


def _flat(logits: torch.Tensor) -> torch.Tensor:
    return logits.reshape(-1, logits.shape[-1])


def _local_lse(logits: torch.Tensor, rank: int, vocab_size, chunk) -> torch.Tensor:
    """(N,) logsumexp over this rank's (unpadded) vocabulary shard, chunk by chunk."""
    flat = _flat(logits)
    out = torch.empty(flat.shape[0], dtype=_work_dtype(logits), device=logits.device)
    for sl in _chunks(flat.shape[0], chunk):
        out[sl] = torch.logsumexp(_masked_padding(flat[sl], rank, vocab_size), dim=-1)
    return out


def _work_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype


def _targets(logits: torch.Tensor, labels: torch.Tensor, rank: int, dtype: torch.dtype):
    """(N,) logit of each label on this rank's shard (0 where another rank holds it), the
    label's local index (0 where outside) and whether it is inside this shard."""
    v_local = logits.shape[-1]
    local = labels.reshape(-1) - rank * v_local
    inside = (local >= 0) & (local < v_local)
    safe = torch.where(inside, local, torch.zeros_like(local))
    target = _flat(logits).gather(-1, safe.unsqueeze(-1)).squeeze(-1).to(dtype)
    return torch.where(inside, target, torch.zeros_like(target)), safe, inside


def _probs(flat: torch.Tensor, sl: slice, lse: torch.Tensor, rank: int, vocab_size):
    """(z, softmax) of one chunk of tokens: fp32 work of this chunk only."""
    z = _masked_padding(flat[sl], rank, vocab_size)
    return z, torch.sub(z, lse[sl].unsqueeze(-1)).exp_()


def _local_pz(logits: torch.Tensor, lse: torch.Tensor, rank: int, vocab_size, chunk) -> torch.Tensor:
    """(N,) sum_j p_j z_j over this rank's shard."""
    flat = _flat(logits)
    pz = torch.empty_like(lse)
    for sl in _chunks(flat.shape[0], chunk):
        z, p = _probs(flat, sl, lse, rank, vocab_size)
        zero = p == 0                                   # padded ids: 0 * -inf -> 0
        pz[sl] = p.mul_(z).masked_fill_(zero, 0).sum(-1)
    return pz


def _log_prob_grad(p: torch.Tensor, g: torch.Tensor, safe: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """d logp(y) / d z_j times g = g (1[j = y] - p_j); overwrites ``p``."""
    part = p.mul_(-g)
    return part.scatter_add_(-1, safe.unsqueeze(-1), torch.where(inside.unsqueeze(-1), g, torch.zeros_like(g)))


def _entropy_grad(p: torch.Tensor, z: torch.Tensor, pz: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """dH / dz_j times g = g p_j (sum_k p_k z_k - z_j) (0 on padded ids)."""
    return torch.sub(pz.unsqueeze(-1), z).masked_fill_(p == 0, 0).mul_(p).mul_(g)


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, tp_group, vocab_size, chunk):
        world, rank = _tp(tp_group)
        with torch.no_grad():
            lse = _combine_lse(_local_lse(logits, rank, vocab_size, chunk), tp_group, world)
        target, safe, inside = _targets(logits, labels, rank, lse.dtype)
        if world > 1:
            dist.all_reduce(target, group=tp_group)
        ctx.save_for_backward(logits, lse, safe, inside)
        ctx.tp = (vocab_size, rank, chunk)
        out = (target - lse).to(logits.dtype if logits.dtype == torch.float64 else torch.float32)
        return out.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_out):
        logits, lse, safe, inside = ctx.saved_tensors
        vocab_size, rank, chunk = ctx.tp
        flat = _flat(logits)
        grad = torch.empty_like(flat)
        g_all = grad_out.reshape(-1).to(lse.dtype)
        for sl in _chunks(flat.shape[0], chunk):
            _, p = _probs(flat, sl, lse, rank, vocab_size)
            grad[sl] = _log_prob_grad(p, g_all[sl].unsqueeze(-1), safe[sl], inside[sl]).to(grad.dtype)
        return grad.view(logits.shape), None, None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tp_group, vocab_size, chunk):
        world, rank = _tp(tp_group)
        with torch.no_grad():
            lse = _combine_lse(_local_lse(logits, rank, vocab_size, chunk), tp_group, world)
            pz = _local_pz(logits, lse, rank, vocab_size, chunk)
            if world > 1:
                dist.all_reduce(pz, group=tp_group)
        ctx.save_for_backward(logits, lse, pz)
        ctx.tp = (vocab_size, rank, chunk)
        out = (lse - pz).to(logits.dtype if logits.dtype == torch.float64 else torch.float32)
        return out.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out):
        logits, lse, pz = ctx.saved_tensors
        vocab_size, rank, chunk = ctx.tp
        flat = _flat(logits)
        grad = torch.empty_like(flat)
        g_all = grad_out.reshape(-1)
        for sl in _chunks(flat.shape[0], chunk):
            z, p = _probs(flat, sl, lse, rank, vocab_size)
            grad[sl] = _entropy_grad(p, z, pz[sl], g_all[sl].unsqueeze(-1).to(p.dtype)).to(grad.dtype)
        return grad.view(logits.shape), None, None, None


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """Both at once: one logsumexp pass, and ONE logits-sized gradient in backward (two separate
    functions would each return a full gradient, and autograd would add them: 3x the logits).
    An output the loss does not use (the entropy at entropy_coeff 0: a metric only) gets no
    gradient pass: its terms would be zeros, and they are most of the backward's work."""

    @staticmethod
    def forward(ctx, logits, labels, tp_group, vocab_size, chunk):
        ctx.set_materialize_grads(False)   # an unused output's gradient arrives as None
        world, rank = _tp(tp_group)
        with torch.no_grad():
            lse = _combine_lse(_local_lse(logits, rank, vocab_size, chunk), tp_group, world)
            pz = _local_pz(logits, lse, rank, vocab_size, chunk)
            target, safe, inside = _targets(logits, labels, rank, lse.dtype)
            if world > 1:   # two reductions, as the separate kernels do (a ring over a joined
                dist.all_reduce(target, group=tp_group)   # buffer would add in another order)
                dist.all_reduce(pz, group=tp_group)
        ctx.save_for_backward(logits, lse, pz, safe, inside)
        ctx.tp = (vocab_size, rank, chunk)
        dt = logits.dtype if logits.dtype == torch.float64 else torch.float32
        return (target - lse).to(dt).view(labels.shape), (lse - pz).to(dt).view(labels.shape)

    @staticmethod
    def backward(ctx, grad_lp, grad_h):
        logits, lse, pz, safe, inside = ctx.saved_tensors
        vocab_size, rank, chunk = ctx.tp
        if grad_lp is None and grad_h is None:
            return None, None, None, None, None
        flat = _flat(logits)
        grad = torch.empty_like(flat)
        g_lp = grad_lp.reshape(-1).to(lse.dtype) if grad_lp is not None else None
        g_h = grad_h.reshape(-1).to(lse.dtype) if grad_h is not None else None
        # the two gradients exactly as the separate functions form them, added once: the same
        # bits as autograd adding theirs (for float32 logits)
        for sl in _chunks(flat.shape[0], chunk):
            z, p = _probs(flat, sl, lse, rank, vocab_size)
            ent = None if g_h is None else _entropy_grad(p, z, pz[sl], g_h[sl].unsqueeze(-1))  # before p is overwritten
            if g_lp is None:
                grad[sl] = ent.to(grad.dtype)
                continue
            part = _log_prob_grad(p, g_lp[sl].unsqueeze(-1), safe[sl], inside[sl])
            grad[sl] = (part if ent is None else part.add_(ent)).to(grad.dtype)
        return grad.view(logits.shape), None, None, None, None


def log_probs_and_entropy(vocab_parallel_logits: torch.Tensor, labels: torch.Tensor, tp_group=None,
                          vocab_size: Optional[int] = None, chunk_tokens: Optional[int] = LOGITS_CHUNK_TOKENS
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) as :func:`log_probs_from_logits` and
    :func:`entropy_from_vocab_parallel_logits`, fused: one pass for the logsumexp and one
    logits-sized gradient."""
    return _VocabParallelLogProbEntropy.apply(vocab_parallel_logits, labels, tp_group, vocab_size, chunk_tokens)


def log_probs_from_logits(vocab_parallel_logits: torch.Tensor, labels: torch.Tensor, tp_group=None,
                          vocab_size: Optional[int] = None, chunk_tokens: Optional[int] = LOGITS_CHUNK_TOKENS
                          ) -> torch.Tensor:
    """log softmax(z)[label] for each position. logits (..., V_local) shard, labels (...) global ids.

    Returns float32 (float64 for float64 logits) of shape ``labels.shape``; differentiable w.r.t.
    the logits shard. Equal to :func:`log_probs_reference` on the gathered logits. The fp32 work
    runs ``chunk_tokens`` tokens at a time (None: all at once, the slow-memory reference form;
    every token is computed alone, so both give the same bits).
    """
    return _VocabParallelLogProb.apply(vocab_parallel_logits, labels, tp_group, vocab_size, chunk_tokens)


def entropy_from_vocab_parallel_logits(vocab_parallel_logits: torch.Tensor, tp_group=None,
                                       vocab_size: Optional[int] = None,
                                       chunk_tokens: Optional[int] = LOGITS_CHUNK_TOKENS) -> torch.Tensor:
    """Entropy of softmax(z) over the whole (unpadded) vocabulary, (..., V_local) -> (...);
    chunked as :func:`log_probs_from_logits`."""
    return _VocabParallelEntropy.apply(vocab_parallel_logits, tp_group, vocab_size, chunk_tokens)


@torch.no_grad()
def sum_pi_squared_from_vocab_parallel_logits(vocab_parallel_logits: torch.Tensor, tp_group=None,
                                              vocab_size: Optional[int] = None,
                                              chunk_tokens: Optional[int] = LOGITS_CHUNK_TOKENS) -> torch.Tensor:
    """sum_v softmax(z)_v^2 over the whole (unpadded) vocabulary, (..., V_local) -> (...): the
    per-token input of the optimal_token_baseline estimator (w_t = 1 - 2 pi(y_t) + sum pi^2).

    Computed as exp(logsumexp(2z) - 2 logsumexp(z)): two per-token logsumexps, each combined over
    the TP group like the log-prob kernel's (only per-token scalars cross ranks), chunked by
    ``chunk_tokens``. Forward only: no gradient (an advantage input). float32 out (float64 for
    float64 logits). Padded vocabulary ids (>= ``vocab_size``) are excluded.
    """
    world, rank = _tp(tp_group)
    flat = _flat(vocab_parallel_logits)
    dt = _work_dtype(vocab_parallel_logits)
    lse = torch.empty(flat.shape[0], dtype=dt, device=flat.device)
    lse2 = torch.empty_like(lse)
    for sl in _chunks(flat.shape[0], chunk_tokens):
        z = _masked_padding(flat[sl], rank, vocab_size)
        lse[sl] = torch.logsumexp(z, dim=-1)
        lse2[sl] = torch.logsumexp(2.0 * z, dim=-1)
    lse = _combine_lse(lse, tp_group, world)
    lse2 = _combine_lse(lse2, tp_group, world)
    return torch.exp(lse2 - 2.0 * lse).view(vocab_parallel_logits.shape[:-1])


def log_probs_reference(logits: torch.Tensor, labels: torch.Tensor, vocab_size: Optional[int] = None) -> torch.Tensor:
    """The naive full-vocabulary computation: log_softmax over the real vocabulary, then gather."""
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if vocab_size is not None:
        z = z[..., :vocab_size]
    return torch.log_softmax(z, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
