"""Pure HF <-> megatron layout maps, TP/PP placement, and the error paths of describe/load."""
import json
import os
import sys

import pytest
import torch

from megappo import convert, layout
from megappo.convert import WeightLoadError, load_hf_weights
from megappo.convert import hf_shapes
from megappo.models import ModelDesc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_models import hf_config, save_tiny_model  # noqa: E402


def desc(**over):
    base = dict(arch="qwen3", num_layers=4, hidden_size=16, ffn_hidden_size=24, num_heads=4, num_groups=2, head_dim=8,
                vocab_size=50, padded_vocab_size=64, tie_word_embeddings=False, qkv_bias=True, qk_layernorm=True)
    base.update(over)
    return ModelDesc(**base)


def test_fused_qkv_layout_is_grouped():
    H, G, d, hid = 4, 2, 3, 5
    # tag each row with (kind, head, row-in-head) so the layout can be read off
    q = torch.tensor([[100 + h * 10 + r] * hid for h in range(H) for r in range(d)], dtype=torch.float32)
    k = torch.tensor([[200 + g * 10 + r] * hid for g in range(G) for r in range(d)], dtype=torch.float32)
    v = torch.tensor([[300 + g * 10 + r] * hid for g in range(G) for r in range(d)], dtype=torch.float32)
    fused = convert.fuse_qkv(q, k, v, H, G, d)
    want = []
    for g in range(G):  # group g: its 2 query heads, then its key head, then its value head
        for h in (2 * g, 2 * g + 1):
            want += [100 + h * 10 + r for r in range(d)]
        want += [200 + g * 10 + r for r in range(d)]
        want += [300 + g * 10 + r for r in range(d)]
    assert fused[:, 0].tolist() == want
    q2, k2, v2 = convert.split_qkv(fused, H, G, d)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)
    # biases too
    b = convert.fuse_qkv(q[:, 0], k[:, 0], v[:, 0], H, G, d)
    assert b.tolist() == want


@pytest.mark.parametrize("tp", [1, 2])
def test_tp_shard_of_fused_qkv_is_the_fusion_of_the_ranks_groups(tp):
    H, G, d, hid = 8, 4, 2, 3
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * d, hid, generator=g) for n in (H, G, G))
    full = convert.fuse_qkv(q, k, v, H, G, d)
    pm = convert.ParamMap("x.linear_qkv.weight", ("q", "k", "v"), "qkv", 0, 0)
    for r in range(tp):
        rows_q, rows_kv = convert.tp_rows(H * d, r, tp), convert.tp_rows(G * d, r, tp)
        local = convert.fuse_qkv(q[rows_q], k[rows_kv], v[rows_kv], H // tp, G // tp, d)
        assert torch.equal(convert.tp_shard(full, pm, r, tp), local)


def test_gate_up_split_per_half():
    gate = torch.arange(8.0)[:, None].expand(8, 2)
    up = 100 + torch.arange(8.0)[:, None].expand(8, 2)
    full = convert.fuse_gate_up(gate, up)
    pm = convert.ParamMap("x.linear_fc1.weight", ("g", "u"), "gate_up", 0, 0)
    s1 = convert.tp_shard(full, pm, 1, 2)
    assert s1[:, 0].tolist() == [4, 5, 6, 7, 104, 105, 106, 107]   # [gate_1; up_1], not rows 8..15
    shards = [convert.tp_shard(full, pm, r, 4) for r in range(4)]
    assert torch.equal(convert.tp_gather(shards, pm), full)
    g2, u2 = convert.split_gate_up(full)
    assert torch.equal(g2, gate) and torch.equal(u2, up)


@pytest.mark.parametrize("dim", [0, 1, None])
def test_tp_gather_inverts_shard(dim):
    full = torch.randn(8, 12)
    pm = convert.ParamMap("w", ("w",), "copy", dim)
    for tp in (1, 2, 4):
        assert torch.equal(convert.tp_gather([convert.tp_shard(full, pm, r, tp) for r in range(tp)], pm), full)
    with pytest.raises(ValueError, match="does not divide over 3"):
        convert.tp_shard(full, convert.ParamMap("w", ("w",), "copy", 0), 0, 3)


def test_vocab_padding():
    w = torch.randn(50, 4)
    p = convert.pad_vocab(w, 64)
    assert p.shape == (64, 4) and torch.equal(p[:50], w) and (p[50:] == 0).all()
    assert torch.equal(convert.unpad_vocab(p, 50), w)
    with pytest.raises(ValueError, match="exceeds the padded size"):
        convert.pad_vocab(w, 32)


@pytest.mark.parametrize("pp, vpp", [(1, None), (2, None), (4, None), (2, 2), (2, 4), (4, 2)])
def test_layer_placement_matches_megatron(pp, vpp):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    L = 16
    cfg = TransformerConfig(num_layers=L, hidden_size=8, num_attention_heads=1, pipeline_model_parallel_size=pp,
                            virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32)
    n = layout.layers_per_chunk(L, pp, vpp)
    seen = set()
    for r in range(pp):
        for v in range(vpp or 1):
            offset = get_transformer_layer_offset(cfg, vp_stage=v if vpp else None, pp_rank=r)
            for local in range(n):
                g = layout.global_layer(r, v, local, L, pp, vpp)
                assert g == offset + local
                assert layout.layer_owner(g, L, pp, vpp) == (r, v, local)
                name, where = convert.to_local_name(f"decoder.layers.{g}.mlp.linear_fc1.weight", L, pp, vpp)
                assert name == f"decoder.layers.{local}.mlp.linear_fc1.weight" and where == (r, v)
                assert convert.to_global_name(name, r, v, L, pp, vpp) == f"decoder.layers.{g}.mlp.linear_fc1.weight"
                seen.add(g)
    assert seen == set(range(L))
    with pytest.raises(ValueError, match=r"num_hidden_layers \(16\) must be divisible .* \(3 x 1 = 3\)"):
        layout.layers_per_chunk(16, 3, None)


def test_param_maps_local_and_te_names():
    d = desc()
    local = {pm.megatron for pm in convert.param_maps(d)}
    te = {pm.megatron for pm in convert.param_maps(d, te=True)}
    assert "decoder.layers.0.input_layernorm.weight" in local
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.3.mlp.linear_fc1.layer_norm_weight" in te
    assert local - te == {f"decoder.layers.{i}.{n}" for i in range(4) for n in ("input_layernorm.weight",
                                                                            "pre_mlp_layernorm.weight")}
    tied = {pm.megatron for pm in convert.param_maps(desc(tie_word_embeddings=True))}
    assert "output_layer.weight" not in tied and "output_layer.weight" in local
    critic = [pm for pm in convert.param_maps(desc(value_head=True)) if pm.megatron == "output_layer.weight"]
    assert critic[0].hf == ("score.weight",) and convert.full_shape(critic[0], d) == (1, 16)
    # every HF tensor is used exactly once
    hf = [n for pm in convert.param_maps(d) for n in pm.hf]
    assert len(hf) == len(set(hf))


def test_to_megatron_to_hf_roundtrip():
    d = desc()
    g = torch.Generator().manual_seed(1)
    for pm in convert.param_maps(d):
        hf = {n: torch.randn(s, generator=g) for n, s in hf_shapes(pm, d).items()}
        full = convert.to_megatron(pm, hf, d)
        assert tuple(full.shape) == convert.full_shape(pm, d), pm.megatron
        back = convert.to_hf(pm, full, d)
        assert back.keys() == hf.keys() and all(torch.equal(back[n], hf[n]) for n in hf), pm.megatron


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("value_head", [False, True])
def test_shards_written_into_hf_tensors_equal_gather_then_split(tp, value_head):
    """shard_into_hf (each rank writes its piece in place) == to_hf(tp_gather(pieces)), the
    independent reference; padding rows of the vocabulary are dropped, never written."""
    from megappo.convert.parallel import shard_into_hf
    from megappo.convert import tp_gather, tp_shard

    d = desc(value_head=value_head)
    g = torch.Generator().manual_seed(2)
    for pm in convert.param_maps(d):
        full = torch.randn(convert.full_shape(pm, d), generator=g)
        pieces = [tp_shard(full, pm, r, tp).clone() for r in range(tp)]
        expected = convert.to_hf(pm, tp_gather(pieces, pm), d)
        dest = {n: torch.full(s, float("nan")) for n, s in hf_shapes(pm, d).items()}
        for r in reversed(range(tp)):  # any order: the pieces are disjoint
            shard_into_hf(pm, pieces[r], d, r, tp, dest)
        assert dest.keys() == expected.keys(), pm.megatron
        for n in expected:
            assert torch.equal(dest[n], expected[n]), f"{pm.megatron} -> {n} at TP{tp}"


def test_shard_into_hf_qkv_at_tp4():
    from megappo.convert.parallel import shard_into_hf
    from megappo.convert import tp_shard

    d = desc(num_heads=8, num_groups=4)
    pm = next(p for p in convert.param_maps(d) if p.kind == "qkv")
    full = torch.randn(convert.full_shape(pm, d))
    dest = {n: torch.zeros(s) for n, s in hf_shapes(pm, d).items()}
    for r in range(4):
        shard_into_hf(pm, tp_shard(full, pm, r, 4), d, r, 4, dest)
    for n, t in convert.to_hf(pm, full, d).items():
        assert torch.equal(dest[n], t), n


# ------------------------------------------------------------------------------------------
# error paths
# ------------------------------------------------------------------------------------------

def test_describe_errors():
    from transformers import GPT2Config

    from megappo.models import ModelConfigError, describe

    c = GPT2Config()
    c.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ModelConfigError, match=r"unsupported architecture \['GPT2LMHeadModel'\]; supported: Qwen3"):
        describe(c)
    with pytest.raises(ModelConfigError, match=r"num_key_value_heads \(2\) is not divisible by tensor_model_parallel_size \(4\)"):
        describe(hf_config("qwen3"), tp=4)
    with pytest.raises(ModelConfigError, match=r"num_attention_heads \(4\) is not divisible by tensor_model_parallel_size \(3\)"):
        describe(hf_config("llama"), tp=3)
    with pytest.raises(ModelConfigError, match="RoPE type 'yarn' is not supported"):
        describe(hf_config("llama", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                     "original_max_position_embeddings": 64}))
    with pytest.raises(ModelConfigError, match="hidden_act='gelu'"):
        describe(hf_config("qwen2", hidden_act="gelu"))
    info = describe(hf_config("qwen3"), tp=2)
    assert info.desc.padded_vocab_size == 512 and info.desc.vocab_size == 500


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "qwen3"
    save_tiny_model("qwen3", path)
    return path


def _edited(saved, tmp_path, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(saved / "model.safetensors"))
    edit(tensors)
    out = tmp_path / "edited"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text((saved / "config.json").read_text())
    return out


def _desc_of(path):
    from megappo.models import describe, load_hf_config

    return describe(load_hf_config(str(path))).desc


def test_load_errors_name_the_tensors(saved, tmp_path):
    d = _desc_of(saved)

    def drop(t):
        del t["model.layers.1.self_attn.k_proj.weight"]
        t["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
        t["model.layers.0.mlp.down_proj.weight"] = torch.zeros(128, 255)

    bad = _edited(saved, tmp_path, drop)
    with pytest.raises(WeightLoadError) as ei:
        load_hf_weights([], str(bad), d)
    msg = str(ei.value)
    assert "missing tensors: model.layers.1.self_attn.k_proj.weight" in msg
    assert "unexpected tensors: model.layers.9.mlp.up_proj.weight" in msg
    assert "model.layers.0.mlp.down_proj.weight: shape (128, 255) in the checkpoint, the model expects (128, 256)" in msg
    with pytest.raises(WeightLoadError, match="no model.safetensors"):
        load_hf_weights([], str(tmp_path), d)


def test_sharded_checkpoint_index(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(saved / "model.safetensors"))
    names = sorted(tensors)
    out = tmp_path / "sharded"
    out.mkdir()
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(out / fname))
        weight_map.update({n: fname for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    from megappo.convert import SafetensorsCheckpoint

    ck = SafetensorsCheckpoint(str(out))
    assert ck.names() == set(names)
    n = "model.layers.2.mlp.gate_proj.weight"
    assert torch.equal(ck.read(n), tensors[n])
    assert torch.equal(ck.read(n, 0, slice(10, 20)), tensors[n][10:20])
    assert torch.equal(ck.read(n, 1, slice(4, 8)), tensors[n][:, 4:8])
    os.remove(out / "model-00002-of-00002.safetensors")
    with pytest.raises(WeightLoadError, match="shard file model-00002-of-00002.safetensors listed in the index is missing"):
        SafetensorsCheckpoint(str(out)).shape(names[-1])
