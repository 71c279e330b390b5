"""Memory options end to end: a PPO run with a critic and a reference, everything
offloaded while idle and activations recomputed, gives the metrics of the same run without them
(2 processes, DP2, 3 steps, with a checkpoint saved while the state is offloaded)."""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))

MEMORY = [f"{s}.megatron.{k}=true" for s in ("actor_rollout_ref.actor", "critic")
          for k in ("param_offload", "grad_offload", "optimizer_offload")] + [
    "actor_rollout_ref.ref.megatron.param_offload=true", "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    "critic.megatron.override_transformer_config.recompute_granularity=full"]


def _worker(rank, world, model, train, run_dir, extra):
    from megappo.config import load_config, validate
    from megappo.trainer import PPOTrainer, init_distributed

    cfg = load_config([f"actor_rollout_ref.model.path={model}", f"data.train_files=[{train}]", "data.val_files=[]",
                       "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
                       "actor_rollout_ref.rollout.n=2", "trainer.logger=[file]", f"trainer.default_local_dir={run_dir}",
                       "trainer.save_freq=2", "trainer.test_freq=-1", *extra], ["tiny_cpu"])
    validate(cfg, check_paths=True, world_size=world)
    init_distributed(cfg)
    trainer = PPOTrainer(cfg)
    trainer.fit(3)
    if extra:   # the options are on in this run: the roles really were built with them
        assert trainer.actor.config.recompute_granularity == "full" and trainer.critic.config.recompute_method == "uniform"
        assert all(bool(w.state_offload) for w in (trainer.actor, trainer.critic, trainer.ref))


@pytest.mark.e2e
def test_offload_and_recomputation_keep_the_metrics(tmp_path):
    from harness import spawn

    from megappo.data.tiny import make_tiny_setup

    p = make_tiny_setup(str(tmp_path / "tiny"))
    runs = {}
    for name, extra in (("plain", []), ("memory", MEMORY)):
        spawn(_worker, 2, p["model"], p["train"], str(tmp_path / name), extra)
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in rows]
    assert len(runs["plain"]) == 3 and "actor/kl_loss" in runs["plain"][-1] and "critic/vf_loss" in runs["plain"][-1]
    assert runs["memory"] == runs["plain"]
    assert (tmp_path / "memory" / "global_step_2").is_dir()
