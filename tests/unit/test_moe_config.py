"""Qwen3-MoE configs: what describe() reads, what megatron's config gets,
the shipped Qwen3-30B-A3B config, each role's router settings, and TE's grouped expert names."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_models import hf_config, save_tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_describe_reads_the_experts_and_which_layers_are_moe():
    from megappo.models import describe

    d = describe(hf_config("qwen3_moe", mlp_only_layers=[0, 2], decoder_sparse_step=1)).desc
    assert (d.arch, d.num_experts, d.moe_topk, d.moe_ffn_hidden_size, d.norm_topk_prob) == ("qwen3_moe", 4, 2, 64, True)
    assert d.moe_layers == (1, 3) and d.qk_layernorm and not d.qkv_bias
    # transformers' rule: every decoder_sparse_step-th layer, counting from 1
    assert describe(hf_config("qwen3_moe", mlp_only_layers=[], decoder_sparse_step=2)).desc.moe_layers == (1, 3)


def test_megatron_config_of_the_router_and_the_layers():
    from megappo.models import ModelConfigError, describe, transformer_config

    info = describe(hf_config("qwen3_moe", norm_topk_prob=False))
    cfg = transformer_config(info, cpu=True)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (4, 2, 64)
    assert cfg.moe_layer_freq == [0, 1, 1, 1] and cfg.moe_router_score_function == "softmax"
    assert cfg.moe_router_pre_softmax is True      # norm_topk_prob=False: softmax over all, no renormalisation
    assert cfg.moe_router_pre_softmax is not transformer_config(describe(hf_config("qwen3_moe")), cpu=True).moe_router_pre_softmax
    with pytest.raises(ModelConfigError, match=r"num_experts \(4\) is not divisible by expert_model_parallel_size \(3\)"):
        transformer_config(info, cpu=True, ep=3)
    with pytest.raises(ModelConfigError, match="needs sequence_parallel"):
        transformer_config(info, tp=2, cpu=True)
    with pytest.raises(ModelConfigError, match="expert_model_parallel_size=2 needs a Mixture-of-Experts model"):
        transformer_config(describe(hf_config("qwen3")), cpu=True, ep=2)


def test_the_shipped_qwen3_30b_a3b_config():
    from transformers import Qwen3MoeConfig

    from megappo.models import describe

    src = REPO / "src" / "megappo" / "model_configs" / "Qwen3-30B-A3B.json"
    raw = json.loads(src.read_text())
    cfg = Qwen3MoeConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    cfg.architectures = raw["architectures"]
    d = describe(cfg, tp=4).desc
    assert (d.num_experts, d.moe_topk, d.num_layers, len(d.moe_layers)) == (128, 8, 48, 48)
    assert d.norm_topk_prob is True and d.moe_ffn_hidden_size == 768


def test_each_role_gets_its_router_settings_and_the_layout(tmp_path):
    """override_transformer_config.moe_* reach megatron's config per role: the actor's and the
    critic's losses, the reference without losses but in the actor's router precision; a dense
    critic beside an MoE actor is built without experts (ep ignored)."""
    from megappo import builders
    from megappo.config import load_config
    from megappo.models import describe, load_hf_config, transformer_config

    save_tiny_model("qwen3_moe", tmp_path / "moe", num_hidden_layers=2)
    A = "actor_rollout_ref.actor.megatron."
    cfg = load_config([f"actor_rollout_ref.model.path={tmp_path / 'moe'}", A + "expert_model_parallel_size=2",
                       "+" + A + "override_transformer_config.moe_aux_loss_coeff=0.01",
                       "+" + A + "override_transformer_config.moe_router_load_balancing_type=seq_aux_loss",
                       "+" + A + "override_transformer_config.moe_z_loss_coeff=0.001",
                       "+" + A + "override_transformer_config.moe_router_dtype=fp64"], ["tiny_cpu"])
    assert cfg.critic.megatron.expert_model_parallel_size == 2     # the layout is inherited
    info = describe(load_hf_config(str(tmp_path / "moe")))
    actor = transformer_config(info, cpu=True, ep=2, moe=builders.moe_options(cfg, cfg.actor_rollout_ref.actor.megatron))
    assert (actor.moe_aux_loss_coeff, actor.moe_router_load_balancing_type, actor.moe_z_loss_coeff,
            actor.moe_router_dtype, actor.expert_model_parallel_size) == (0.01, "seq_aux_loss", 0.001, "fp64", 2)
    ref = transformer_config(info, cpu=True, moe=builders.moe_options(cfg, cfg.actor_rollout_ref.ref.megatron))
    assert (ref.moe_aux_loss_coeff, ref.moe_router_load_balancing_type, ref.moe_z_loss_coeff,
            ref.moe_router_dtype) == (0.0, "none", None, "fp64")
    critic = transformer_config(info, cpu=True, moe=builders.moe_options(cfg, cfg.critic.megatron))
    assert (critic.moe_aux_loss_coeff, critic.moe_router_load_balancing_type, critic.moe_router_dtype) == (0.0, "none", "fp32")
    assert not actor.moe_grouped_gemm      # no TransformerEngine here: SequentialMLP
    with pytest.raises(Exception, match="expert_tensor_parallel_size must be 1"):
        transformer_config(info, cpu=True, etp=2)


def test_te_grouped_expert_names_map_to_global_experts():
    """TransformerEngine's grouped experts name their weights experts.linear_fc1.weightL (and its
    MoE layers keep a separate pre-MLP norm): the HF name map and the local -> global expert index
    follow, as for SequentialMLP's local_experts.L."""
    import torch.nn as nn

    from megappo.convert import local_params

    from megappo.layout import RankCoords
    from megappo.convert import param_maps
    from megappo.models import describe

    desc = describe(hf_config("qwen3_moe", num_hidden_layers=2, mlp_only_layers=[0])).desc
    te = {pm.megatron: pm for pm in param_maps(desc, te=True)}
    local = {pm.megatron: pm for pm in param_maps(desc, te=False)}
    assert te["decoder.layers.1.mlp.experts.linear_fc1.weight3"].hf == local[
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"].hf == (
        "model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight")
    assert te["decoder.layers.1.mlp.experts.linear_fc2.weight0"].expert == 0
    from megappo.convert import full_shape, hf_shapes

    for name in ("decoder.layers.1.mlp.experts.linear_fc2.weight2", "decoder.layers.1.mlp.experts.linear_fc1.weight2"):
        assert full_shape(te[name], desc) == full_shape(local[name.replace("experts.", "experts.local_experts.2.")
                                                         .replace("weight2", "weight")], desc)
        assert hf_shapes(te[name], desc) == hf_shapes(local[name.replace("experts.", "experts.local_experts.2.")
                                                          .replace("weight2", "weight")], desc)
    assert te["decoder.layers.1.pre_mlp_layernorm.weight"].hf == ("model.layers.1.post_attention_layernorm.weight",)
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te      # the dense layer fuses it
    assert len(te) == len(local)

    class Chunk(nn.Module):   # parameter names as TE's grouped experts / SequentialMLP register them, 2 per rank
        def named_parameters(self, *a, **kw):
            for k in range(2):
                yield f"decoder.layers.1.mlp.experts.linear_fc1.weight{k}", nn.Parameter(torch.zeros(1))
                yield f"decoder.layers.1.mlp.experts.local_experts.{k}.linear_fc2.weight", nn.Parameter(torch.zeros(1))

    names = set(local_params([Chunk()], desc, RankCoords(ep=2, ep_rank=1)))
    assert names == {"decoder.layers.1.mlp.experts.linear_fc1.weight2", "decoder.layers.1.mlp.experts.linear_fc1.weight3",
                     "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight",
                     "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"}
