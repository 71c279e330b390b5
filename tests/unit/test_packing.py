"""Sequence packing (use_remove_padding): the THD layout by hand, the way back to the padded
layout, and the worker's next-token path giving the padded path's log-probs, entropies, values
and gradients for a per-token model (the packed attention itself is checked on a GPU with
TransformerEngine, tests/gpu)."""
import pytest
import torch

from megappo.workers import Actor, MegatronWorker
from megappo.workers.packing import pack

PAD = 0


def test_pack_by_hand():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    p = pack(ids, [3, 2, 4], PAD, align=2)
    # lengths 3, 2, 4 rounded up to a multiple of 2: 4, 2, 4
    assert p.ids.tolist() == [[5, 6, 7, 0, 8, 9, 1, 2, 3, 4]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 3]]
    assert p.next_ids.tolist() == [[6, 7, 0, 0, 9, 0, 2, 3, 4, 0]]   # never across a sequence
    assert p.cu_seqlens.tolist() == [0, 4, 6, 10] and p.cu_seqlens.dtype == torch.int32
    assert p.max_seqlen == 4 and p.width == 4 and p.lengths == [3, 2, 4]
    # a filler segment to a fixed total (the interleaved schedule's one shape)
    q = pack(ids, [3, 2, 4], PAD, align=2, total=14)
    assert q.ids.shape == (1, 14) and q.cu_seqlens.tolist() == [0, 4, 6, 10, 14]
    assert q.position_ids[0, 10:].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="total 9 must be >= 10 and a multiple of 2"):
        pack(ids, [3, 2, 4], PAD, align=2, total=9)


def test_rows_undo_the_packing():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (4, 9), generator=g)
    lengths = [9, 3, 6, 1]
    p = pack(ids, lengths, PAD, align=4)
    back = p.rows(p.ids[..., None].float())[..., 0].long()
    for b, n in enumerate(lengths):
        assert back[b, :n].tolist() == ids[b, :n].tolist() and (back[b, n:] == 0).all()
    assert p.rows(p.ids.float(), width=5).shape == (4, 5)


def _batch():
    from megappo.batch import RolloutBatch

    g = torch.Generator().manual_seed(1)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    responses = torch.randint(1, 40, (3, 4), generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    return RolloutBatch.from_prompts_and_responses(prompts, responses, mask, pad_token_id=PAD)


@pytest.mark.parametrize("align", [1, 2])
def test_packed_next_token_path_equals_the_padded_one(align):
    """Actor._log_probs / Critic._values through the packed layout (per-token logits: what
    attention does inside a sequence is the same packed or padded) equal the padded path, values
    and gradients."""
    batch = _batch()
    lengths = (batch.prompt_lengths + batch.response_mask.sum(-1).long()).tolist()
    table = torch.randn(40, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    actor = Actor.__new__(Actor)
    actor.tp_group, actor.vocab_size = None, 40
    results = []
    for packed in (False, True):
        w = table.clone().requires_grad_(True)
        emb = w[:, :8] @ w[:, 8:].T[:8]            # (40, 40): a per-token "model" with parameters
        ids = pack(batch.input_ids, lengths, PAD, align) if packed else batch.input_ids
        tokens = ids.ids if packed else ids
        output = emb[tokens]                        # (1, T, 40) or (B, S, 40)
        lp, ent = actor._log_probs(output, ids, batch, with_entropy=True)
        lp_only, _ = actor._log_probs(output, ids, batch, with_entropy=False)
        values = MegatronWorker._next_token(output[..., 0], ids)
        v = MegatronWorker._response_gather(actor, values[2](values[0]), batch)
        grad, = torch.autograd.grad((lp.sum() + ent.sum() + v.sum()), w)
        results.append((lp, ent, lp_only, v, grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert (results[0][0][batch.response_mask == 0] == 0).all()


def test_packing_needs_transformer_engine(capsys):
    from megappo.builders import packing

    chunks = [torch.nn.Linear(2, 2)]
    assert packing(True, chunks, "actor_rollout_ref.model.use_remove_padding") is False
    assert "use_remove_padding=true needs TransformerEngine's layer spec" in capsys.readouterr().out
    chunks[0].megappo_te_spec = True
    assert packing(True, chunks, "x") is True and packing(False, chunks, "x") is False
