"""Single-device (tp_group=None) vocab-parallel log-prob/entropy: equal to the naive computation,
padded vocabulary ids excluded, low-precision logits handled in float32."""
import pytest
import torch

from megappo import algo
from megappo.distributed import entropy_from_vocab_parallel_logits, log_probs_from_logits, log_probs_reference


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
