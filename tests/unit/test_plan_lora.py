"""The memory planner with LoRA (megappo.plan): the adapters' parameters against PEFT's and a hand
count, what a LoRA role holds (frozen base: weights only; adapters: weights, gradients, Adam
state), the reference as the actor's base, and the one-node Qwen3-32B LoRA recipe's verdict
beside full fine-tuning's."""
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megappo import plan as P
from megappo.models import LORA_MODULES

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30
sys.path.insert(0, str(ROOT / "tests"))
from tiny_models import hf_config, save_tiny_model  # noqa: E402

ALL = tuple(LORA_MODULES)
# the small Qwen3-style model of test_plan.py (its hand count: 18592 parameters per layer at TP2)
SMALL = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
         "tie_word_embeddings": False}
LORA_YAML = str(ROOT / "parallel_configs" / "qwen3_32b_lora.yaml")


def _peft_trainable(cfg, targets, r):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(cfg), LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets)))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("targets", [ALL, ("q_proj", "v_proj"), ("o_proj", "down_proj", "up_proj")])
def test_adapter_parameters_at_tp1_are_pefts(targets):
    """At TP1 nothing is sharded or replicated: a layer's adapters are PEFT's trainable
    parameters divided by the layers."""
    cfg = hf_config("qwen3")
    m = P.model_shape(cfg.to_dict())
    assert P.lora_layer_params(m, 8, targets, 1) * m.layers == _peft_trainable(cfg, targets, 8)


def test_adapter_parameters_on_moe_are_pefts():
    """The attention's adapters on a Mixture-of-Experts model (what LoRA adapts there): PEFT's
    trainable parameters with the same targets."""
    cfg = hf_config("qwen3_moe", mlp_only_layers=[])
    m = P.model_shape(cfg.to_dict())
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    o = P.PlanOptions(tp=1, pp=1, dp=1, gpu_memory_gb=1.0, actor=P.RoleOptions(lora_rank=8, lora_modules=attention))
    assert P.stage_lora_params(m, o, o.actor) == _peft_trainable(cfg, attention, 8)


def test_adapter_parameters_at_tp2_by_hand():
    m = P.model_shape(SMALL)
    # r = 8, hidden 64, q 4 x 16 = 64, k/v 2 x 16 = 32, FFN 128; TP2.
    # column (A whole, B's rows / 2): q 8x64 + 8x64/2 = 768; k, v 512 + 128 = 640; gate, up 512 + 512 = 1024
    # row (A's columns / 2, B whole): o 8x64/2 + 8x64 = 768; down 8x128/2 + 8x64 = 1024
    assert P.lora_layer_params(m, 8, ALL, 2) == 768 + 640 + 640 + 768 + 1024 + 1024 + 1024 == 5888
    assert P.lora_layer_params(m, 8, ("q_proj", "down_proj"), 2) == 768 + 1024
    # over the two ranks: PEFT's total plus the replicated halves once more
    full = P.lora_layer_params(m, 8, ALL, 1)
    replicated = 8 * 64 * 5 + 8 * 64 * 2      # the five column modules' A (in = hidden), the two row modules' B (out = hidden)
    assert 2 * P.lora_layer_params(m, 8, ALL, 2) == full + replicated


def _lora_options(**actor):
    return P.PlanOptions(tp=2, pp=2, dp=4, gpu_memory_gb=1.0, vllm_fraction=0.5, micro_batches=8,
                         actor=P.RoleOptions(train_tokens=100, forward_tokens=200, lora_rank=8, lora_modules=ALL, **actor),
                         ref=P.RoleOptions(trains=False, forward_tokens=300, shares_actor=True))


def test_lora_actor_trains_the_adapters_only_and_the_reference_is_its_base():
    m = P.model_shape(SMALL)
    o = _lora_options()
    p = P.plan(m, o)
    n0 = 2 * 18592 + 32768            # stage 0's base (test_plan.py's hand count)
    a = 2 * 5888                      # its two layers' adapters
    row = p.table[0]["update_actor"]
    assert row["actor weights"] == 2 * (n0 + a)          # bf16 base + adapters
    assert row["actor grads"] == 4 * a                   # fp32 gradients of the adapters only
    assert row["actor optimizer"] == 12 * a // 4         # fp32 main + Adam moments of the adapters, over DP4
    # the adapters' saved tensors beyond the layer's (TP2, SP): A x of 5 column modules for every
    # token (8 each), of 2 row modules over SP (8 / 2 each), the gathered inputs of linear_qkv and
    # linear_fc1 (2 x 64), bf16: 2 x (40 + 8 + 128) = 352 B per token per layer
    assert P.lora_activation_bytes_per_token(m, o, o.actor) == 352
    assert row["activations"] == (1336 + 352) * 100 * 2 * 2 + 512 * 100
    assert row["optimizer step"] == 0 and P.optimizer_step_bytes(a, o, o.actor) == a
    # no reference state at all; its pass (300 tokens) runs over the actor's weights
    assert not any(k.startswith("ref ") for s in p.table for ph in p.table[s] for k in p.table[s][ph])
    ref = p.table[1]["ref"]
    assert ref["actor weights"] == 2 * (2 * 18592 + 64 + 32768 + a)
    assert ref["logits"] == 300 * 512 * 2 + 300 * 512 * 4 * 2
    # offloaded: the actor's weights (frozen base included) come back for the reference pass
    off = P.plan(m, replace(o, actor=replace(o.actor, param_offload=True, grad_offload=True, optimizer_offload=True)))
    assert off.table[0]["rollout"]["actor weights"] == 0
    assert off.table[0]["ref"]["actor weights"] == 2 * (n0 + a) and off.table[0]["ref"]["actor grads"] == 0
    # a separate reference (full fine-tuning) holds a copy of the base
    full = P.plan(m, replace(o, actor=replace(o.actor, lora_rank=0, lora_modules=()), ref=replace(o.ref, shares_actor=False)))
    assert full.table[0]["rollout"]["ref weights"] == 2 * n0 and full.table[0]["rollout"]["actor grads"] == 4 * n0


def test_lora_critic_trains_its_adapters_and_value_head():
    m = P.model_shape(SMALL)
    o = replace(_lora_options(), critic=P.RoleOptions(train_tokens=100, forward_tokens=100, lora_rank=8,
                                                      lora_modules=("q_proj", "v_proj")))
    p = P.plan(m, o)
    a = 2 * (768 + 640)
    last = p.table[1]["update_critic"]
    base = 2 * 18592 + 64 + 64 + 1                     # layers, final norm, value head (weight + bias)
    assert last["critic weights"] == 2 * (base + a)
    assert last["critic grads"] == 4 * (a + 65)          # the new value head trains with the adapters
    assert last["critic optimizer"] == 12 * (a + 65) // 4
    assert p.table[0]["update_critic"]["critic grads"] == 4 * a   # no head on the first stage


def test_options_from_config_reads_the_lora_keys(tmp_path):
    from megappo.config import load_config

    cfg = load_config([], [LORA_YAML])          # load_config does not validate (validation refuses LoRA for now)
    o = P.options_from_config(cfg, gpu_memory_gb=80)
    assert (o.actor.lora_rank, o.actor.lora_modules) == (64, ALL)
    assert o.ref.present and o.ref.shares_actor and not o.critic.present
    assert o.layer_spec == "local"              # the adapters need megatron's local layer spec
    cfg = load_config(["actor_rollout_ref.model.target_modules=[q_proj,gate_proj]",
                       "actor_rollout_ref.model.exclude_modules=[gate_proj]"], [LORA_YAML])
    assert P.options_from_config(cfg, 80).actor.lora_modules == ("q_proj",)
    off = P.options_from_config(load_config(["actor_rollout_ref.model.lora_rank=0"], [LORA_YAML]), 80)
    assert not off.actor.lora and not off.ref.shares_actor and off.layer_spec == "te"
    # an adapter folder gives its own rank and modules; one not there yet plans with lora_rank
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    save_tiny_model("qwen3", tmp_path / "base")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
    get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "o_proj"])).save_pretrained(str(tmp_path / "peft"))
    there = load_config([f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'peft'}"], [LORA_YAML])
    assert P.lora_of(there.actor_rollout_ref.model) == (4, ("k_proj", "o_proj"))
    missing = load_config([f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'none'}"], [LORA_YAML])
    assert P.lora_of(missing.actor_rollout_ref.model) == (64, ALL)


def _plan_cli(*args):
    return subprocess.run([sys.executable, "-m", "megappo.plan", *args], capture_output=True, text=True, cwd=ROOT)


def test_32b_lora_fits_one_node_where_full_fine_tuning_does_not():
    """Qwen3-32B on 8 x 80 GiB at TP8: with LoRA the frozen base (8 GiB a GPU) and the adapters'
    state fit beside vLLM's half; full fine-tuning of the same layout (and a reference of its own)
    does not, with any offload or vLLM share."""
    from megappo.config import load_config

    m = P.model_shape(__import__("json").loads((P.MODEL_CONFIGS / "Qwen3-32B.json").read_text()))
    # per layer (TP1): q 64 x (5120 + 8192), k and v 64 x (5120 + 1024), o 64 x (8192 + 5120),
    # gate/up/down 64 x (5120 + 25600): 8,388,608; x 64 layers = 537M adapter parameters (PEFT's count)
    assert P.lora_layer_params(m, 64, ALL, 1) * 64 == 536_870_912
    lora = P.plan(m, P.options_from_config(load_config([], [LORA_YAML]), gpu_memory_gb=80))
    peak, _, phase = lora.peak()
    assert lora.fits() and phase == "rollout" and 45 * GiB < peak < 55 * GiB, peak / GiB
    full_opts = P.options_from_config(load_config(["actor_rollout_ref.model.lora_rank=0"], [LORA_YAML]), gpu_memory_gb=80)
    full = P.plan(m, full_opts)
    assert not full.fits() and full.peak()[0] > 100 * GiB, full.peak()[0] / GiB
    assert P.cheapest_fix(m, full_opts) is None
    r = _plan_cli("--config", LORA_YAML, "trainer.gpu_memory_gb=80")
    assert r.returncode == 0 and ": FITS" in r.stdout, r.stdout + r.stderr
    assert "LoRA r=64 on 7 modules" in r.stdout and "195.6M adapter parameters per GPU" in r.stdout, r.stdout
    assert "reference: the actor's base with the adapters off" in r.stdout
    r = _plan_cli("--config", LORA_YAML, "trainer.gpu_memory_gb=80", "actor_rollout_ref.model.lora_rank=0")
    assert r.returncode == 1 and "DOES NOT FIT" in r.stdout and "LoRA" not in r.stdout, r.stdout
