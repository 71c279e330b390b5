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


def _batch(multi_turn: bool = False):
    """Three samples; ``multi_turn``: tool turns inside the responses (in the sequence, out of the
    response mask), as trainer.turns builds them."""
    from megappo.batch import RolloutBatch

    g = torch.Generator().manual_seed(1)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    if not multi_turn:
        responses = torch.randint(1, 40, (3, 4), generator=g)
        mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
        return RolloutBatch.from_prompts_and_responses(prompts, responses, mask, pad_token_id=PAD)
    responses = torch.randint(1, 40, (3, 9), generator=g)
    seq = torch.tensor([[1] * 7 + [0] * 2, [1] * 9, [1] * 3 + [0] * 6], dtype=torch.float32)
    model = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0, 0], [1, 0, 0, 1, 0, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0, 0, 0]],
                         dtype=torch.float32)
    return RolloutBatch.from_prompts_and_responses(prompts, responses, model, pad_token_id=PAD, sequence_mask=seq)


@pytest.mark.parametrize("multi_turn", [False, True], ids=["one_turn", "tool_turns"])
@pytest.mark.parametrize("align", [1, 2])
def test_packed_next_token_path_equals_the_padded_one(align, multi_turn):
    """Actor._log_probs / Critic._values through the packed layout (per-token logits: what
    attention does inside a sequence is the same packed or padded) equal the padded path, values
    and gradients; with tool turns the packed rows hold the whole conversations (tool tokens
    included) and only the model's tokens are read back."""
    batch = _batch(multi_turn)
    worker = MegatronWorker.__new__(MegatronWorker)   # the worker's own packing of a micro-batch
    worker.pad_token_id, worker.ddp_chunks = PAD, [None]
    packed_batch = worker._pack([batch], align)[0]
    if multi_turn:   # whole conversations, tool turns included, padding out
        assert packed_batch.lengths == [10, 11, 7]
    table = torch.randn(40, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    actor = Actor.__new__(Actor)
    actor.tp_group, actor.vocab_size = None, 40
    results = []
    for packed in (False, True):
        w = table.clone().requires_grad_(True)
        emb = w[:, :8] @ w[:, 8:].T[:8]            # (40, 40): a per-token "model" with parameters
        ids = packed_batch if packed else batch.input_ids
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
    if multi_turn:   # a model token after a tool turn reads its conversation: not what padding would give
        assert (results[1][0][batch.response_mask == 1] != 0).all()


def test_packing_needs_an_attention_that_takes_packed_sequences(capsys):
    """TransformerEngine's spec, or megappo's SdpaCoreAttention in every layer of the local spec;
    megatron's DotProductAttention (where the local spec keeps it) takes none."""
    from types import SimpleNamespace

    from megappo.builders import packing
    from megappo.models import SdpaCoreAttention

    def model(*attention):
        m = torch.nn.Module()
        m.layers = torch.nn.ModuleList()
        for a in attention:
            layer = torch.nn.Module()
            layer.core_attention = a
            m.layers.append(layer)
        return [m]

    sdpa = lambda: SdpaCoreAttention(SimpleNamespace(kv_channels=8, context_parallel_size=1))   # noqa: E731
    for chunks in ([torch.nn.Linear(2, 2)], model(sdpa(), torch.nn.Identity())):
        assert packing(True, chunks, "actor_rollout_ref.model.use_remove_padding") is False
        out = capsys.readouterr().out
        assert "use_remove_padding=true needs an attention that takes packed sequences" in out
        assert "so its micro-batches stay padded" in out
    chunks = model(sdpa(), sdpa())
    assert packing(True, chunks, "x") is True and packing(False, chunks, "x") is False
    chunks = [torch.nn.Linear(2, 2)]
    chunks[0].megappo_te_spec = True
    assert packing(True, chunks, "x") is True and packing(False, chunks, "x") is False


def test_packing_keeps_the_sequence_load_balancing_loss_per_sequence(capsys):
    """megatron's seq_aux_loss is computed per column of a [tokens, batch] micro-batch, which a
    packed row of many sequences would turn into one: with a non-zero weight on it the role stays
    padded, said once; other load-balancing losses, or a zero weight, pack."""
    from types import SimpleNamespace

    from megappo.builders import packing

    def moe(types, coeffs):
        m = torch.nn.Linear(2, 2)
        m.megappo_te_spec = True   # an attention that takes packed sequences
        m.config = SimpleNamespace(num_moe_experts=4, moe_router_load_balancing_type=types, moe_aux_loss_coeff=coeffs)
        return [m]

    assert packing(True, moe("seq_aux_loss", 0.01), "critic.model.use_remove_padding") is False
    out = capsys.readouterr().out
    assert "critic.model.use_remove_padding=true with moe_router_load_balancing_type=seq_aux_loss" in out
    assert packing(True, moe(["aux_loss", "seq_aux_loss"], [0.0, 1e-3]), None) is False
    for types, coeffs in (("seq_aux_loss", 0.0), ("aux_loss", 0.01), ("global_aux_loss", 0.01),
                          (["aux_loss", "seq_aux_loss"], [0.01, 0.0])):
        assert packing(True, moe(types, coeffs), "x") is True, (types, coeffs)
    assert capsys.readouterr().out == ""


def test_packed_attention_reads_the_row_layout_once_per_forward():
    """megappo's packed attention equals causal attention per sequence (computed here without the
    module); the row's bounds are read once for every layer sharing a forward's PackedSeqParams
    (no device-to-host copy per layer on a GPU), and again for new params."""
    import math
    from types import SimpleNamespace

    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megappo.models import SdpaCoreAttention

    g = torch.Generator().manual_seed(0)
    lengths, heads, groups, d = [3, 1, 6], 4, 2, 8
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (heads, groups, groups))
    cu = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=6, max_seqlen_kv=6)
    layers = [SdpaCoreAttention(SimpleNamespace(kv_channels=d, context_parallel_size=1)) for _ in range(2)]
    outs = [a(q, k, v, attn_mask_type=AttnMaskType.causal, packed_seq_params=params) for a in layers]
    bounds = params._megappo_layout[2]
    assert bounds == [0, 3, 4, 10] and torch.equal(outs[0], outs[1])
    layers[0](q, k, v, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    assert params._megappo_layout[2] is bounds   # read once, reused by every later layer
    want = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        kk, vv = (x[a:b].repeat_interleave(heads // groups, dim=1) for x in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[a:b], kk) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(b - a, b - a).triu(1).bool(), float("-inf"))
        want.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
    assert torch.allclose(outs[0], torch.cat(want).reshape(t, 1, heads * d), atol=1e-6)
    other = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 10], dtype=torch.int32),
                            cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                            max_seqlen_q=10, max_seqlen_kv=10)
    layers[1](q, k, v, attn_mask_type=AttnMaskType.causal, packed_seq_params=other)
    assert other._megappo_layout[2] == [0, 10]
