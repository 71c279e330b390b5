"""Single-device (tp_group=None) vocab-parallel log-prob/entropy/sum pi^2: equal to the naive computation,
padded vocabulary ids excluded, low-precision logits handled in float32."""
import pytest
import torch

from megappo import algo
from megappo.distributed import (entropy_from_vocab_parallel_logits, log_probs_and_entropy, log_probs_from_logits,
                                 log_probs_reference, sum_pi_squared_from_vocab_parallel_logits)


@pytest.mark.parametrize("vocab, padded", [(37, 37), (37, 40)])
def test_values_and_grads_equal_naive(vocab, padded):
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(4, 6, padded, generator=g, dtype=torch.float64) * 5).requires_grad_(True)
    y = torch.randint(0, vocab, (4, 6), generator=g)
    w1, w2 = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, 6, generator=g, dtype=torch.float64)
    lp = log_probs_from_logits(z, y, vocab_size=vocab if padded != vocab else None)
    h = entropy_from_vocab_parallel_logits(z, vocab_size=vocab if padded != vocab else None)
    ga, = torch.autograd.grad((lp * w1).sum() + (h * w2).sum(), z)
    ref_lp = log_probs_reference(z, y, vocab)
    ref_h = algo.entropy_from_logits(z[..., :vocab])
    gb, = torch.autograd.grad((ref_lp * w1).sum() + (ref_h * w2).sum(), z)
    torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(h, ref_h, atol=1e-12, rtol=0)
    torch.testing.assert_close(ga, gb, atol=1e-12, rtol=0)
    assert (ga[..., vocab:] == 0).all()


def test_padding_would_change_the_answer_if_not_excluded():
    z = torch.zeros(1, 4)
    y = torch.tensor([0])
    assert log_probs_from_logits(z, y, vocab_size=2).item() == pytest.approx(-torch.log(torch.tensor(2.0)).item())
    assert log_probs_from_logits(z, y).item() == pytest.approx(-torch.log(torch.tensor(4.0)).item())


def test_bf16_logits_computed_in_float32():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(8, 300, generator=g) * 8
    y = torch.randint(0, 300, (8,), generator=g)
    lp = log_probs_from_logits(z.bfloat16(), y)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, log_probs_reference(z.bfloat16().float(), y), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_kernels_equal_the_whole_batch_form(dtype):
    """The fp32 work in chunks of tokens (LOGITS_CHUNK_TOKENS; 5 here, the last chunk partial)
    gives exactly the values and gradients of the one-shot form."""
    g = torch.Generator().manual_seed(2)
    z = (torch.randn(3, 9, 64, generator=g) * 4).to(dtype)
    y = torch.randint(0, 60, (3, 9), generator=g)
    w = torch.randn(3, 9, generator=g)
    out = []
    for chunk in (None, 5, 1000):
        x = z.clone().requires_grad_(True)
        lp = log_probs_from_logits(x, y, vocab_size=60, chunk_tokens=chunk)
        h = entropy_from_vocab_parallel_logits(x, vocab_size=60, chunk_tokens=chunk)
        grad, = torch.autograd.grad((lp * w).sum() + (h * w).sum(), x)
        assert grad.dtype == dtype and lp.shape == y.shape == h.shape
        out.append((lp, h, grad))
    for other in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out[0], other))


@pytest.mark.parametrize("chunk", [None, 4])
def test_fused_log_probs_and_entropy_equal_the_separate_kernels(chunk):
    """One function, one gradient: the same bits as the two kernels whose gradients autograd adds
    (float32), so switching the actor to it changes no metric."""
    g = torch.Generator().manual_seed(4)
    z = torch.randn(2, 7, 50, generator=g) * 3
    y = torch.randint(0, 47, (2, 7), generator=g)
    w1, w2 = torch.randn(2, 7, generator=g), torch.randn(2, 7, generator=g)
    a = z.clone().requires_grad_(True)
    lp, h = log_probs_and_entropy(a, y, vocab_size=47, chunk_tokens=chunk)
    ga, = torch.autograd.grad((lp * w1).sum() + (h * w2).sum(), a)
    b = z.clone().requires_grad_(True)
    lp2 = log_probs_from_logits(b, y, vocab_size=47, chunk_tokens=chunk)
    h2 = entropy_from_vocab_parallel_logits(b, vocab_size=47, chunk_tokens=chunk)
    gb, = torch.autograd.grad((lp2 * w1).sum() + (h2 * w2).sum(), b)
    assert torch.equal(lp, lp2) and torch.equal(h, h2) and torch.equal(ga, gb)
    # only one of the two outputs used: that one's gradient, bit for bit, and no pass for the other
    import megappo.distributed.vocab_parallel as vp

    calls = []
    real = vp._entropy_grad
    vp._entropy_grad = lambda *args: calls.append(1) or real(*args)
    try:
        gc, = torch.autograd.grad((log_probs_and_entropy(a, y, vocab_size=47, chunk_tokens=chunk)[1] * w2).sum(), a)
        gd, = torch.autograd.grad((entropy_from_vocab_parallel_logits(b, vocab_size=47, chunk_tokens=chunk) * w2).sum(), b)
        assert torch.equal(gc, gd)
        calls.clear()
        ge, = torch.autograd.grad((log_probs_and_entropy(a, y, vocab_size=47, chunk_tokens=chunk)[0] * w1).sum(), a)
        gf, = torch.autograd.grad((log_probs_from_logits(b, y, vocab_size=47, chunk_tokens=chunk) * w1).sum(), b)
        assert torch.equal(ge, gf) and not calls   # the entropy unused: its gradient terms never formed
        lp, h = log_probs_and_entropy(a, y, vocab_size=47, chunk_tokens=chunk)
        gg, = torch.autograd.grad((lp * w1).sum() - 0.0 * h.sum(), a)   # weighted 0: formed (zeros), added
        assert calls and torch.equal(gg, gf)
    finally:
        vp._entropy_grad = real


@pytest.mark.parametrize("vocab, padded", [(37, 37), (37, 40)])
def test_sum_pi_squared_equals_plain_softmax(vocab, padded):
    """sum_v pi_v^2 over the real vocabulary, chunked or not (same bits), forward only; with
    large logits (a peaked softmax: sum pi^2 near 1) and small ones (near 1/V)."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(4, 6, padded, generator=g, dtype=torch.float64) * 5
    z[0] *= 20
    z[1] *= 0.01
    z[..., vocab:] = 30.0      # padding rows with large logits: would dominate if not excluded
    ref = torch.softmax(z[..., :vocab], dim=-1).pow(2).sum(-1)
    out = [sum_pi_squared_from_vocab_parallel_logits(z.clone().requires_grad_(True), vocab_size=vocab, chunk_tokens=c)
           for c in (None, 5, 1000)]
    torch.testing.assert_close(out[0], ref, atol=1e-12, rtol=1e-12)
    assert all(torch.equal(out[0], o) for o in out[1:])
    assert out[0].shape == (4, 6) and not out[0].requires_grad
    assert out[0][0].min().item() > 0.5 and out[0][1].max().item() < 1.5 / vocab
    # with the log-probs of the same logits: w = 1 - 2 pi_y + sum pi^2 = ||onehot(y) - pi||^2 >= 0
    y = torch.randint(0, vocab, (4, 6), generator=g)
    w = 1 - 2 * log_probs_from_logits(z, y, vocab_size=vocab).exp() + out[0]
    p = torch.softmax(z[..., :vocab], dim=-1)
    torch.testing.assert_close(w, (torch.nn.functional.one_hot(y, vocab) - p).pow(2).sum(-1), atol=1e-12, rtol=0)


def test_sum_pi_squared_bf16_logits_in_float32():
    g = torch.Generator().manual_seed(6)
    z = (torch.randn(8, 300, generator=g) * 8).bfloat16()
    out = sum_pi_squared_from_vocab_parallel_logits(z, chunk_tokens=3)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.softmax(z.float(), dim=-1).pow(2).sum(-1), atol=1e-6, rtol=1e-5)
