"""Layouts that cannot be built for the model, at real size: the planner (and so DRY_RUN=1 of
every launch recipe) refuses them with the reason before any job is queued; the recipes' own
layouts pass."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megappo import plan as P

REPO = Path(__file__).resolve().parents[2]
A = "actor_rollout_ref.actor.megatron."


@pytest.mark.parametrize("overrides,reason", [
    # Qwen3-8B has 8 key/value heads: TP16 would split a head
    (["trainer.n_gpus_per_node=16", A + "tensor_model_parallel_size=16", A + "pipeline_model_parallel_size=1"],
     "num_key_value_heads (8) is not divisible by tensor_model_parallel_size (16)"),
    # 36 layers over PP2 x VPP5 = 10 chunks
    ([A + "virtual_pipeline_model_parallel_size=5"],
     "num_hidden_layers (36) is not divisible by pipeline_model_parallel_size x virtual stages (2 x 5)"),
])
def test_a_layout_bug_at_real_size_is_named_by_the_planner(overrides, reason, capsys):
    rc = P.main(["--config", str(REPO / "parallel_configs/qwen3_8b.yaml")] + overrides)
    err = capsys.readouterr().err
    assert rc == 2
    assert f"megappo.plan: the layout cannot be built for Qwen3-8B: {reason}" in err


def test_layout_problems_lists_every_reason():
    m = P.model_shape({"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 8,
                       "num_key_value_heads": 2, "vocab_size": 100, "num_experts": 6, "num_experts_per_tok": 2,
                       "moe_intermediate_size": 32})
    assert P.layout_problems(m, P.PlanOptions(tp=2, pp=3, ep=2)) == []
    assert P.layout_problems(m, P.PlanOptions(tp=4, pp=2, vpp=2, ep=4)) == [
        "num_key_value_heads (2) is not divisible by tensor_model_parallel_size (4)",
        "num_hidden_layers (6) is not divisible by pipeline_model_parallel_size x virtual stages (2 x 2)",
        "num_experts (6) is not divisible by expert_model_parallel_size (4)"]


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "parallel_configs").glob("*.yaml")))
def test_shipped_recipes_have_buildable_layouts(config):
    from megappo.config import load_config

    p, _ = P.plan_from_config(load_config([], [str(REPO / "parallel_configs" / config)]), gpu_memory_gb=80)
    assert P.layout_problems(p.model, p.options) == []


def test_dry_run_of_a_launch_recipe_stops_on_the_layout_bug():
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable)
    r = subprocess.run(["bash", str(REPO / "launch" / "qwen3_8b.sh"), A + "virtual_pipeline_model_parallel_size=5"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "num_hidden_layers (36) is not divisible by pipeline_model_parallel_size x virtual stages (2 x 5)" in r.stderr


def test_train_dry_run_names_the_layout_bug_before_anything_starts(capsys):
    """python -m megappo.train --dry-run reads the model's config.json (here the shipped
    Qwen3-8B one, by the recipe's hub id) and refuses TP16 for 8 key/value heads with the key."""
    from megappo.train import main

    rc = main(["--dry-run", "--config", str(REPO / "parallel_configs/qwen3_8b.yaml"), "trainer.n_gpus_per_node=16",
               A + "tensor_model_parallel_size=16", A + "pipeline_model_parallel_size=1"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert ("actor_rollout_ref.actor.megatron: the layout cannot be built for Qwen/Qwen3-8B: num_key_value_heads (8) "
            "is not divisible by tensor_model_parallel_size (16)") in err
    assert main(["--dry-run", "--config", str(REPO / "parallel_configs/qwen3_8b.yaml")]) == 0
