"""The trainer end to end on CPU: the README's main job (torchrun, DP2), and GRPO with both KL
forms; metrics land in metrics.jsonl with verl's names."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))

REQUIRED = ["critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "critic/returns/mean",
            "response_length/mean", "response_length/clip_ratio", "prompt_length/mean", "actor/pg_loss",
            "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
            "training/rollout_probs_diff_max", "timing_s/gen", "timing_s/step", "perf/throughput"]


def read_metrics(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


@pytest.mark.e2e
def test_tiny_cpu_main_job(tmp_path):
    out = tmp_path / "tiny"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    p = subprocess.run(["bash", str(REPO / "launch" / "tiny_cpu.sh"), "trainer.total_training_steps=4",
                        "trainer.logger=[console,file,tensorboard]", "algorithm.adv_estimator=gae",
                        "actor_rollout_ref.rollout.n=2"], capture_output=True, text=True, timeout=600,
                       env=env, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-4000:]
    rows = read_metrics(out / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in REQUIRED + ["critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean", "critic/vf_explained_var",
                           "timing_s/update_critic", "timing_s/values"]:
        assert key in rows[-1], key
        assert all(math.isfinite(r[key]) for r in rows if key in r)
    # rollout and trainer agree on the log-probs of the sampled tokens (fresh weights every step)
    assert max(r["training/rollout_probs_diff_max"] for r in rows) < 1e-3
    assert list((out / "run" / "tensorboard").iterdir())
    assert "step [4/4]" in p.stdout


def _grpo_worker(rank, world, model, train, test, run_dir):
    from megappo.config import load_config, validate
    from megappo.trainer import PPOTrainer, init_distributed

    cfg = load_config([f"actor_rollout_ref.model.path={model}", f"data.train_files=[{train}]",
                       f"data.val_files=[{test}]", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
                       "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true",
                       "algorithm.kl_ctrl.type=adaptive", "trainer.logger=[file]", f"trainer.default_local_dir={run_dir}",
                       "data.max_response_length=6"], ["tiny_cpu"])
    validate(cfg, check_paths=True, world_size=world)
    init_distributed(cfg)
    PPOTrainer(cfg).fit(3)


@pytest.mark.e2e
def test_grpo_with_kl_loss_and_kl_in_reward(tmp_path):
    from harness import spawn

    from megappo.data.tiny import make_tiny_setup

    p = make_tiny_setup(str(tmp_path / "tiny"))
    spawn(_grpo_worker, 2, p["model"], p["train"], p["test"], str(tmp_path / "run"))
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 3
    for key in REQUIRED + ["actor/kl_loss", "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"]:
        assert key in rows[-1] and math.isfinite(rows[-1][key]), key
    assert "critic/vf_loss" not in rows[-1]  # GRPO builds no critic
    # at step 1 the rollout policy is the reference: no KL in the reward; later the policy moved
    assert rows[0]["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    assert rows[-1]["actor/reward_kl_penalty"] > 0 and rows[-1]["actor/kl_loss"] > 0
    assert rows[1]["actor/reward_kl_penalty_coeff"] != rows[0]["actor/reward_kl_penalty_coeff"]  # adaptive
