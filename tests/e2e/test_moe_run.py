"""PPO on a tiny Qwen3-MoE end to end: the trainer at TP2 x EP2 on 4 CPU processes
(actor, reference and critic on the MoE backbone, vLLM TP2 receiving the experts every step), a
checkpoint at step 2, and a run resumed from it whose step 3 repeats the uninterrupted run's; all
under the CPU device check. The same at CP2 x EP2 (over DP2) with packed sequences."""
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


CP2_PACKED = [A + "megatron.tensor_model_parallel_size=1", A + "megatron.context_parallel_size=2",
              "actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true"]


@pytest.mark.e2e
@pytest.mark.parametrize("layout", [[], CP2_PACKED], ids=["TP2xEP2", "CP2xEP2-packed"])
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
