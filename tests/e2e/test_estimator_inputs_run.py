"""Estimators that need more than rewards, end to end on the tiny task (2 processes, DP2):
optimal_token_baseline gets sum pi^2 from the actor's old-log-prob pass (a property check: pi(y)^2 <=
sum pi^2 <= 1 at every response token), and gdpo gets the reward function's components (the values
the function returned, for this rank's rows). The runs train with KL-Cov and Clip-Cov, whose token
selection needs each sample's place in the global batch."""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))

COMPONENTS = '''
def reward(data_source, solution, ground_truth, extra_info=None):
    words = solution.split()
    first = float(bool(words) and words[0] == ground_truth.split()[0])
    brevity = 1.0 / (1 + len(words))
    return {"score": first + brevity, "first": first, "brevity": brevity}
'''


def _worker(rank, world, model, train, run_dir, extra):
    import torch

    from megappo import algo
    from megappo.config import load_config, validate
    from megappo.trainer import PPOTrainer, init_distributed

    seen = []
    original = algo.compute_advantages

    def capture(estimator, **kw):
        seen.append({k: (v.clone() if isinstance(v, torch.Tensor) else
                         {n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v) for k, v in kw.items()})
        return original(estimator, **kw)

    algo.compute_advantages = capture
    cfg = load_config([f"actor_rollout_ref.model.path={model}", f"data.train_files=[{train}]", "data.val_files=[]",
                       "actor_rollout_ref.rollout.n=4", "data.train_batch_size=4",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.logger=[file]",
                       f"trainer.default_local_dir={run_dir}", "trainer.save_freq=-1", "trainer.test_freq=-1", *extra],
                      ["tiny_cpu"])
    validate(cfg, check_paths=True, world_size=world)
    init_distributed(cfg)
    trainer = PPOTrainer(cfg)
    trainer.fit(1)
    kw = seen[0]
    mask = kw["response_mask"] > 0
    out = {"rows": int(mask.shape[0])}
    if kw["sum_pi_squared"] is not None:
        spq, lp = kw["sum_pi_squared"][mask], kw["old_log_probs"][mask]
        out["spq_ok"] = bool(((torch.exp(2 * lp) <= spq + 1e-6) & (spq <= 1 + 1e-6)).all())
        out["spq_range"] = [float(spq.min()), float(spq.max())]
    if kw["reward_components"] is not None:
        out["components"] = {k: v.tolist() for k, v in kw["reward_components"].items()}
        out["scores"] = kw["token_level_rewards"].sum(-1).tolist()
    Path(run_dir, f"seen_{rank}.json").write_text(json.dumps(out))


@pytest.mark.e2e
def test_optimal_token_baseline_and_gdpo_get_their_inputs(tmp_path):
    from harness import spawn

    from megappo.data.tiny import make_tiny_setup

    p = make_tiny_setup(str(tmp_path / "tiny"))
    reward = tmp_path / "components.py"
    reward.write_text(COMPONENTS)
    pl = "actor_rollout_ref.actor.policy_loss."
    # the two runs also train with KL-Cov and Clip-Cov (their selection through the trainer's batch)
    spawn(_worker, 2, p["model"], p["train"], str(tmp_path / "otb"),
          ["algorithm.adv_estimator=optimal_token_baseline", pl + "loss_mode=kl_cov", pl + "kl_cov_ratio=0.05"])
    spawn(_worker, 2, p["model"], p["train"], str(tmp_path / "gdpo"),
          ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[first,brevity]",
           "algorithm.gdpo_reward_weights=[1.0,0.5]", f"custom_reward_function.path={reward}",
           "custom_reward_function.name=reward", pl + "loss_mode=clip_cov", pl + "clip_cov_ratio=0.05",
           pl + "clip_cov_lb=-100"])
    for rank in (0, 1):
        otb = json.loads((tmp_path / "otb" / f"seen_{rank}.json").read_text())
        assert otb["rows"] == 8 and otb["spq_ok"], otb          # each rank its 8 of the 16 samples
        lo, hi = otb["spq_range"]
        assert 0 < lo < hi <= 1, otb                            # a random policy over the tiny vocabulary
        g = json.loads((tmp_path / "gdpo" / f"seen_{rank}.json").read_text())
        first, brevity = g["components"]["first"], g["components"]["brevity"]
        assert len(first) == len(brevity) == 8
        # the components are this rank's rows of what the function returned: score = first + brevity
        assert all(abs(a + b - s) < 1e-6 for a, b, s in zip(first, brevity, g["scores"])), g
        assert set(first) <= {0.0, 1.0} and all(0 < b <= 1 for b in brevity)
    for name in ("otb", "gdpo"):
        row = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
        assert row["step"] == 1 and row["critic/advantages/max"] > row["critic/advantages/min"], row
        # the share of tokens Clip-Cov / KL-Cov selected over the whole mini-batch (both ranks);
        # pg_clipfrac is that share for Clip-Cov (verl's meaning), 0 for KL-Cov (nothing is clipped)
        assert 0 < row["actor/cov_selected_fraction"] <= 0.1, row
        assert row["actor/pg_clipfrac"] == pytest.approx(row["actor/cov_selected_fraction"] if name == "gdpo" else 0.0,
                                                         abs=1e-6), row
