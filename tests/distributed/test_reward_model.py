"""The reward model worker reads a token-classification checkpoint (one label) and scores each
response at its last token, as transformers computes it, under TP and PP; with tool turns in the
response, at its last model token over the whole conversation (tool tokens included)."""
import json
import os
import sys

import pytest
import torch

from harness import spawn
from mcore import build, setup

pytestmark = pytest.mark.distributed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_models import hf_config  # noqa: E402
from test_workers import _global_batch  # noqa: E402


def _multi_turn_batch():
    """The same sequences with tool turns: in each response, tokens 1-2 (1 in 3-token responses)
    are a tool turn, and row 0 also ends with one (megappo's loop never does; it pins down where
    the score goes then)."""
    b = _global_batch()
    b.sequence_mask = b.response_mask.clone()
    for i, n in enumerate(b.response_lengths.tolist()):
        b.response_mask[i, 1:min(3, n - 1)] = 0
    b.response_mask[0, int(b.response_lengths[0]) - 1] = 0
    return b


def _worker(rank, world, tp, pp, path, out_file, cp=1, packed=False):
    setup(tp, pp, cp=cp)
    from megappo.workers import RewardModel

    info, cfg, chunks = build(path, tp, pp, value_head=True, cp=cp)
    rm = RewardModel(chunks, cfg)
    rm.pack_sequences = packed
    scores = rm.compute_scores(_global_batch(), micro_batch_size=4)
    turns = rm.compute_scores(_multi_turn_batch(), micro_batch_size=4)
    if rank == 0:
        torch.save((scores, turns), out_file)


@pytest.mark.parametrize("tp, pp, cp, packed", [(2, 1, 1, False), (1, 2, 1, False), (1, 1, 2, False), (2, 1, 1, True),
                                               (1, 1, 2, True)], ids=["TP2", "PP2", "CP2", "TP2-packed", "CP2-packed"])
def test_reward_model_scores_equal_transformers(tmp_path, tp, pp, cp, packed):
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(4)
    cfg = hf_config("qwen3", num_labels=1)
    cfg.architectures = ["Qwen3ForTokenClassification"]
    hf = AutoModelForTokenClassification.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        hf.score.weight.normal_(0, 0.5)  # a non-trivial head
    hf.save_pretrained(str(tmp_path / "rm"), safe_serialization=True)

    out = str(tmp_path / "s.pt")
    spawn(_worker, tp * pp * cp, tp, pp, str(tmp_path / "rm"), out, cp, packed)
    got, got_turns = torch.load(out)

    batch = _global_batch()
    n = batch.response_mask.sum(-1).long()
    want = torch.zeros_like(got)
    with torch.no_grad():
        for i in range(len(batch)):
            L = int(batch.prompt_lengths[i] + n[i])
            logits = hf(input_ids=batch.input_ids[i:i + 1, :L]).logits[0, :, 0]
            want[i, n[i] - 1] = logits[-1]
    assert got.shape == batch.responses.shape
    assert (got != 0).sum(-1).tolist() == [1] * len(batch)  # one score per response, at its last token
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()

    # tool turns: transformers over the whole conversation up to the last model token
    mt = _multi_turn_batch()
    want = torch.zeros_like(got_turns)
    with torch.no_grad():
        for i in range(len(mt)):
            end = int(torch.nonzero(mt.response_mask[i]).max())
            assert end + 1 > mt.response_mask[i].sum()   # a tool turn before it: the count is no position
            logits = hf(input_ids=mt.input_ids[i:i + 1, :int(mt.prompt_lengths[i]) + end + 1]).logits[0, :, 0]
            want[i, end] = logits[-1]
    assert (got_turns != 0).sum(-1).tolist() == [1] * len(mt)
    assert torch.allclose(got_turns, want, atol=1e-4), (got_turns - want).abs().max()
    # where the conversation ends with a model turn (every row but 0) that is the one-turn score
    # of the same token ids: tool tokens are read like any other, only the mask differs
    assert torch.equal(got_turns[1:], got[1:])


def test_a_sequence_classifier_checkpoint_scores_as_transformers_reads_it(tmp_path):
    """Hub reward models (and TRL's value models) are *ForSequenceClassification: the same trunk
    and one-label head, read at the last token."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(5)
    cfg = hf_config("qwen3", num_labels=1)
    cfg.architectures = ["Qwen3ForSequenceClassification"]
    hf = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        hf.score.weight.normal_(0, 0.5)
    hf.save_pretrained(str(tmp_path / "rm"), safe_serialization=True)

    out = str(tmp_path / "s.pt")
    spawn(_worker, 2, 2, 1, str(tmp_path / "rm"), out)
    got, _ = torch.load(out)
    batch = _global_batch()
    n = batch.response_mask.sum(-1).long()
    with torch.no_grad():
        for i in range(len(batch)):
            L = int(batch.prompt_lengths[i] + n[i])
            want = hf(input_ids=batch.input_ids[i:i + 1, :L]).logits[0, 0]
            assert torch.allclose(got[i, n[i] - 1], want, atol=1e-4), (i, got[i], want)
    assert (got != 0).sum(-1).tolist() == [1] * len(batch)
