"""PPO on a tiny Qwen3-MoE end to end: the trainer at TP2 x EP2 on 4 CPU processes
(actor, reference and critic on the MoE backbone, vLLM TP2 receiving the experts every step), a
checkpoint at step 2, and a run resumed from it whose step 3 repeats the uninterrupted run's; all
under the CPU device check. The same at CP2 x EP2 (over DP2) with packed sequences, and at TP2 x
EP2 with LoRA adapters on the attention of actor and critic (the engines get the merged weights
every step)."""
import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))

VOLATILE = ("timing_s/", "perf/")
A = "actor_rollout_ref.actor."


def _run(rank, world, setup, run_dir, steps, extra):
    import os

    # under the CPU device check (a simulated GPU per rank): MoE's router weight, made on the host
    # by megatron, once reached the workers there and would have failed the first GPU step
    os.environ["MEGAPPO_CHECK_DEVICES"] = "1"
    from megappo.config import load_config, validate
    from megappo.trainer import PPOTrainer, init_distributed

    cfg = load_config([f"actor_rollout_ref.model.path={setup['model']}", f"data.train_files=[{setup['train']}]",
                       f"data.val_files=[{setup['test']}]", "trainer.logger=[file]", f"trainer.n_gpus_per_node={world}",
                       f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={steps}",
                       "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=2",
                       "data.train_batch_size=4", A + "ppo_mini_batch_size=4", "data.max_response_length=6",
                       A + "optim.lr=1e-3", A + "megatron.tensor_model_parallel_size=2",
                       A + "megatron.expert_model_parallel_size=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                       A + "use_kl_loss=true", A + "megatron.override_transformer_config.moe_aux_loss_coeff=0.01",
                       A + "megatron.override_transformer_config.moe_z_loss_coeff=0.001"] + list(extra), ["tiny_cpu"])
    validate(cfg, check_paths=True, world_size=world)
    init_distributed(cfg)
    PPOTrainer(cfg).fit()


def _rows(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _adapters_only(step_dir, rows, model):
    """A LoRA run on the MoE model: the checkpoints hold adapters (and the critic's value head)
    only, every sync sends the whole model with the adapters merged in, and the reference is the
    base (a KL once the adapters moved)."""
    from megatron.core import dist_checkpointing
    from safetensors.torch import load_file

    for role, trained in (("actor", ("lora_",)), ("critic", ("lora_", "output_layer"))):
        keys = [k for k in dist_checkpointing.load_tensors_metadata(str(step_dir / role)) if not k.startswith("optimizer")]
        assert keys and all(any(t in k for t in trained) for k in keys), (role, keys[:8])
        assert any("linear_qkv.lora.lora_B.q_proj" in k for k in keys) and not any("experts" in k for k in keys)
    full = sum(t.numel() * 4 for t in load_file(str(Path(model) / "model.safetensors")).values())
    assert all(r["rollout/sync_bytes"] == full for r in rows), ([r["rollout/sync_bytes"] for r in rows], full)
    assert rows[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-9) and rows[-1]["actor/kl_loss"] > 1e-6


def _converts_to_peft_and_merged(run, out):
    """The converter's PEFT folder of the MoE run's last checkpoint loads in PEFT on transformers'
    model, and its merged folder computes the same logits (megappo's merge against PEFT's forward)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megappo.convert.cli import convert_to_hf_main

    for name, extra in (("adapter", []), ("merged", ["--merge"])):
        assert convert_to_hf_main(["--ckpt", str(run), "--out", str(out / name), "--quiet", *extra]) == 0
    assert sorted(json.loads((out / "adapter" / "adapter_config.json").read_text())["target_modules"]) == [
        "k_proj", "o_proj", "q_proj", "v_proj"]
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    model = json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, str(out / "adapter")).eval()(ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(str(out / "merged"), dtype=torch.float32)(ids).logits
    assert (peft_logits - merged_logits).abs().max() < 1e-5
    assert (peft_logits - base_logits).abs().max() > 1e-4   # the trained adapters are in both


CP2_PACKED = [A + "megatron.tensor_model_parallel_size=1", A + "megatron.context_parallel_size=2",
              "actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true"]


LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16", "critic.model.lora_rank=8",
        "actor_rollout_ref.model.target_modules=[q_proj, k_proj, v_proj, o_proj]",
        "critic.model.target_modules=[q_proj, k_proj, v_proj, o_proj]", A + "optim.lr=1e-2"]


@pytest.mark.e2e
@pytest.mark.parametrize("layout", [[], CP2_PACKED, LORA], ids=["TP2xEP2", "CP2xEP2-packed", "TP2xEP2-LoRA"])
def test_ppo_on_moe_with_resume(tmp_path, layout):
    from harness import spawn

    from megappo.data.tiny import make_tiny_setup

    # words: a random policy scores partly, so the default advantage (GRPO's group baseline with
    # the critic's correction) is not 0 everywhere and the actor moves from the first step
    setup = make_tiny_setup(str(tmp_path / "tiny"), n_train=64, n_test=8, arch="qwen3_moe", task="words")
    run = tmp_path / "straight"
    spawn(_run, 4, setup, str(run), 3, layout)
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:   # router losses and expert load reported; the critic (GAE) and the reference ran on it
        assert r["actor/moe_aux_loss"] > 0 and r["actor/moe_z_loss"] > 0, r
        assert r["actor/moe_expert_load_max"] >= 1.0 >= r["actor/moe_expert_load_min"] >= 0.0
        assert r["critic/moe_expert_load_max"] >= 1.0 and "critic/vf_loss" in r and "actor/kl_loss" in r
    # the weights moved, and vLLM sampled from them: its log-probs track the actor's every step
    assert rows[0]["actor/pg_loss"] != rows[1]["actor/pg_loss"]
    assert all(r["training/rollout_probs_diff_max"] < 1e-4 for r in rows), [
        r["training/rollout_probs_diff_max"] for r in rows]
    assert (run / "global_step_2" / "actor").is_dir() and (run / "latest").read_text() == "3"   # and the last step
    if layout is LORA:
        _adapters_only(run / "global_step_2", rows, setup["model"])
        _converts_to_peft_and_merged(run, tmp_path / "converted")

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(run / "global_step_2", resumed / "global_step_2")
    (resumed / "latest").write_text("2")
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    spawn(_run, 4, setup, str(resumed), 3, layout + ["trainer.resume_mode=auto"])
    again = _rows(resumed)
    assert [r["step"] for r in again] == [1, 2, 3]

    def stable(r):
        return {k: v for k, v in r.items() if not k.startswith(VOLATILE)}

    assert stable(again[2]) == stable(rows[2]), sorted(
        k for k in stable(rows[2]) if stable(again[2]).get(k) != stable(rows[2])[k])
