"""Direct-shard weight sync, pure parts: megatron's TP shard in vLLM's layout equals the shard
vLLM's own loader cuts from the HF tensors (built here another way), the plan's choices and the
reasons it gives when it cannot apply, and buckets that never mix the two reload formats."""
import pytest
import torch

from megappo.layout import RankCoords
from megappo.convert import full_shape, param_maps, to_megatron
from megappo.models import ModelDesc
from megappo.convert import tp_shard, tp_shard_shape
from megappo.convert import layer_buckets
from megappo.convert import SyncTensor, kernel_name, kernel_shard, plan_shard_sync

DESC = ModelDesc(arch="qwen2", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_heads=8, num_groups=4,
                 head_dim=8, vocab_size=300, padded_vocab_size=512, tie_word_embeddings=False, qkv_bias=True,
                 qk_layernorm=False)


def _rows(t, rank, size):
    k = t.shape[0] // size
    return t[rank * k:(rank + 1) * k]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_kernel_shard_is_what_vllm_cuts_from_hf_tensors(tp):
    """vLLM's QKVParallelLinear gives TP rank r the rows of its query heads, then of its key heads,
    then of its value heads; MergedColumnParallelLinear gives [gate rows of r; up rows of r]."""
    g = torch.Generator().manual_seed(0)
    for pm in param_maps(DESC):
        if pm.kind not in ("qkv", "gate_up") and pm.partition_dim is None:
            continue
        hf = {n: torch.randn(s, generator=g) for n, s in _hf_shapes(pm).items()}
        full = to_megatron(pm, hf, DESC)
        for r in range(tp):
            got = kernel_shard(pm, tp_shard(full, pm, r, tp), DESC, tp)
            if pm.kind in ("qkv", "gate_up"):
                want = torch.cat([_rows(hf[n], r, tp) for n in pm.hf])
            elif pm.kind == "vocab":
                want = _rows(full, r, tp)  # same padded table on both sides (the plan checks the size)
            else:  # row-parallel o_proj / down_proj: columns
                k = hf[pm.hf[0]].shape[1] // tp
                want = hf[pm.hf[0]][:, r * k:(r + 1) * k]
            assert torch.equal(got, want), (pm.megatron, r)
            assert tuple(got.shape) == tp_shard_shape(full_shape(pm, DESC), pm, tp)


def _hf_shapes(pm):
    from megappo.convert import hf_shapes

    return hf_shapes(pm, DESC)


def test_kernel_names_are_vllms():
    names = {kernel_name(pm) for pm in param_maps(DESC)}
    assert "model.layers.1.self_attn.qkv_proj.weight" in names
    assert "model.layers.1.self_attn.qkv_proj.bias" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert "model.layers.0.self_attn.o_proj.weight" in names and "lm_head.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n or ".k_proj." in n for n in names)


def _engine_params(desc, tp, vocab_rows=None):
    """What vLLM's worker on one TP rank holds, by name and shape."""
    out = {}
    for pm in param_maps(desc):
        shape = tp_shard_shape(full_shape(pm, desc), pm, tp)
        if pm.kind == "vocab" and vocab_rows is not None:
            shape = (vocab_rows, shape[1])
        out[kernel_name(pm)] = shape
    return out


def test_plan_takes_every_tensor_when_layouts_agree():
    coords = RankCoords(tp=2, tp_rank=1)
    plan, why = plan_shard_sync(DESC, coords, False, _engine_params(DESC, 2), 2, 1, element_size=2)
    assert why == "" and plan.gathered == ()
    assert plan.direct == {pm.megatron for pm in param_maps(DESC)}
    want = sum(2 * torch.Size(tp_shard_shape(full_shape(pm, DESC), pm, 2)).numel() for pm in param_maps(DESC))
    assert plan.direct_bytes == want


def test_plan_gathers_a_vocabulary_padded_differently():
    # vLLM pads 300 tokens to 320 (160 per rank at TP2), megatron to 512 (256 per rank)
    plan, _ = plan_shard_sync(DESC, RankCoords(tp=2), False, _engine_params(DESC, 2, vocab_rows=160), 2, 0)
    assert set(plan.gathered) == {"embedding.word_embeddings.weight", "output_layer.weight"}
    assert len(plan.direct) == len(param_maps(DESC)) - 2


@pytest.mark.parametrize("change, reason", [
    (dict(engine_tp=4), "rollout TP 4 differs from training TP 2"),
    (dict(engine_tp_rank=0), "vLLM TP rank 0 differs from megatron TP rank 1"),
    (dict(params=None), "the engine does not report its parameters"),
    # vLLM's CPU backend moves linear weights into oneDNN handles and leaves empty parameters
    (dict(empty="model.layers.0.mlp.down_proj.weight"),
     "engine parameter model.layers.0.mlp.down_proj.weight has shape (0,), the rank's shard of "
     "decoder.layers.0.mlp.linear_fc2.weight is (64, 48)"),
    (dict(drop="model.layers.1.self_attn.qkv_proj.bias"),
     "engine parameter model.layers.1.self_attn.qkv_proj.bias has shape None"),
])
def test_plan_refuses_with_the_reason(change, reason):
    params = _engine_params(DESC, 2)
    if "empty" in change:
        params[change["empty"]] = (0,)
    if "drop" in change:
        del params[change["drop"]]
    args = dict(params=params, engine_tp=2, engine_tp_rank=1)
    args.update({k: v for k, v in change.items() if k in args})
    plan, why = plan_shard_sync(DESC, RankCoords(tp=2, tp_rank=1), False, args["params"], args["engine_tp"],
                                args["engine_tp_rank"])
    assert plan is None and why.startswith(reason), why


def test_buckets_never_mix_full_tensors_and_kernel_shards():
    t = torch.zeros(4)
    items = [SyncTensor("model.embed_tokens.weight", t)] + [
        SyncTensor(f"model.layers.{i}.{p}", t, kernel=True) for i in range(3) for p in ("a", "b")] + [
        SyncTensor("model.norm.weight", t, kernel=True), SyncTensor("lm_head.weight", t)]
    buckets = list(layer_buckets(items, bucket_bytes=1 << 20))
    assert [[i.name for i in b] for b in buckets] == [
        ["model.embed_tokens.weight"], [i.name for i in items[1:-1]], ["lm_head.weight"]]
    assert [len(b) for b in layer_buckets(items, bucket_bytes=1)] == [1, 2, 2, 3, 1]
    # plain (name, tensor) pairs still bucket as before
    pairs = [(i.name, i.tensor) for i in items]
    assert [len(b) for b in layer_buckets(pairs, bucket_bytes=1)] == [3, 2, 4]


MOE = ModelDesc(arch="qwen3_moe", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_heads=8, num_groups=4,
                head_dim=8, vocab_size=500, padded_vocab_size=512, tie_word_embeddings=False, qkv_bias=False,
                qk_layernorm=True, num_experts=4, moe_ffn_hidden_size=32, moe_topk=2, moe_layers=(1,))


def test_plan_declines_mixture_of_experts():
    """Even an engine reporting a shard of every megatron tensor under the names the dense path would
    use: MoE takes the full gather (vLLM's experts are stacked and TP-sharded, megatron's are whole per
    EP rank), with that reason."""
    params = _engine_params(MOE, 2)
    assert any(".mlp.experts.3." in n for n in params)  # the expert tensors are in the map
    plan, why = plan_shard_sync(MOE, RankCoords(tp=2, tp_rank=1, ep=2, ep_rank=1), False, params, 2, 1)
    assert plan is None and why.startswith("a Mixture-of-Experts model"), why
    # the same layout without experts would have been taken whole
    dense = ModelDesc(**{**MOE.__dict__, "arch": "qwen3", "num_experts": 0, "moe_ffn_hidden_size": 0,
                         "moe_topk": 0, "moe_layers": ()})
    plan, why = plan_shard_sync(dense, RankCoords(tp=2, tp_rank=1), False, _engine_params(dense, 2), 2, 1)
    assert plan is not None and why == ""
