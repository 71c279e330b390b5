"""Qwen3-MoE configs (issue 6/7, first slice): what describe() reads, what megatron's config gets,
the shipped Qwen3-30B-A3B config, and the trainer's refusal until the MoE weight sync exists."""
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


def test_the_trainer_refuses_moe_until_its_weight_sync_exists(tmp_path):
    from megappo import builders
    from megappo.config import load_config
    from megappo.models import ModelConfigError

    save_tiny_model("qwen3_moe", tmp_path / "moe", num_hidden_layers=2)
    cfg = load_config([f"actor_rollout_ref.model.path={tmp_path / 'moe'}"], ["tiny_cpu"])
    with pytest.raises(ModelConfigError, match="Mixture-of-Experts models build and load .* do not train yet"):
        builders.build_model(cfg, str(tmp_path / "moe"), cfg.actor_rollout_ref.actor.megatron, value_head=False,
                             device=torch.device("cpu"))
