"""A multi-turn sample in the batch: tool turns sit in the sequence (lengths, positions, the
input ids the model attends to) and outside the response mask every loss, advantage and KL
reads; one-turn batches keep one mask for both."""
import torch

from megappo import algo
from megappo.batch import RolloutBatch

PAD = 0


def _multi_turn_batch():
    # row 0: model [11 12] tool [91 92 93] model [13 14]; row 1: model [21 22 23] (no call)
    responses = torch.tensor([[11, 12, 91, 92, 93, 13, 14], [21, 22, 23, PAD, PAD, PAD, PAD]])
    model = torch.tensor([[1, 1, 0, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0, 0]], dtype=torch.float)
    seq = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0]], dtype=torch.float)
    return RolloutBatch.from_prompts_and_responses([[5, 6], [7]], responses, model, PAD, sequence_mask=seq,
                                                   prompt_index=torch.tensor([0, 1]))


def test_tool_tokens_are_in_the_sequence_and_out_of_the_loss_mask():
    b = _multi_turn_batch()
    assert b.input_ids.tolist() == [[5, 6, 11, 12, 91, 92, 93, 13, 14], [7, 21, 22, 23, PAD, PAD, PAD, PAD, PAD]]
    assert b.response_lengths.tolist() == [7, 3]
    assert b.loss_mask.tolist() == b.response_mask.tolist() == [[1, 1, 0, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0, 0]]
    # each response token (model or tool) is predicted at its own position of the whole sequence
    assert b.response_positions[0].tolist() == [1, 2, 3, 4, 5, 6, 7]
    # the second mask travels with the rows
    sel = RolloutBatch.concat([b.select([1]), b.select([0])], PAD)
    assert sel.sequence_mask.tolist() == [b.sequence_mask[1].tolist(), b.sequence_mask[0].tolist()]
    assert sel.response_lengths.tolist() == [3, 7]


def test_a_one_turn_batch_has_one_mask():
    responses = torch.tensor([[11, 12, 2, PAD], [21, 2, PAD, PAD]])
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float)
    b = RolloutBatch.from_prompts_and_responses([[5], [6, 7]], responses, m, PAD)
    assert b.sequence_mask is None and b.valid_mask is b.response_mask
    assert b.response_lengths.tolist() == [3, 2]


def test_the_policy_loss_ignores_tool_tokens():
    """Whatever sits at a tool token (log-probs, advantages) changes neither the loss nor its
    gradient; the token-mean counts model tokens only."""
    b = _multi_turn_batch()
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 7, generator=g)
    adv = torch.randn(2, 7, generator=g)
    lp = (old + 0.1 * torch.randn(2, 7, generator=g)).requires_grad_()
    loss, _ = algo.compute_policy_loss("vanilla", old, lp, adv, b.loss_mask)
    loss.backward()
    tool = (b.valid_mask - b.response_mask).bool()
    assert tool.sum() == 3 and (lp.grad[tool] == 0).all()
    junk = torch.where(tool, torch.full_like(adv, 1e3), adv)
    lp2 = torch.where(tool, torch.full_like(lp, -50.0), lp.detach())
    loss2, _ = algo.compute_policy_loss("vanilla", old, lp2, junk, b.loss_mask)
    assert torch.equal(loss.detach(), loss2)
    # token-mean over the 7 model tokens, by hand
    ratio = torch.exp(lp.detach() - old)
    per = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    assert torch.allclose(loss.detach(), (per * b.response_mask).sum() / 7)
