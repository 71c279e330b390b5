"""Context parallelism through the trainer: PPO with GAE, a critic and a KL loss at CP2 takes the
steps of the same run at TP2 (the same world, so the same vLLM replicas and samples): only the
training layout differs, and with it the order of the sums. The CP2 run runs under the CPU device
check (MEGAPPO_CHECK_DEVICES=1) and packs its sequences (use_remove_padding: each micro-batch's
sequences end to end in one row, each CP rank two chunks of every sequence, attention kept within
each), so the two runs also compare packed with padded micro-batches through the trainer. A CP2
run resumed from its step-1 checkpoint repeats step 2."""
import math
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))


def _worker(rank, world, model, train, run_dir, layout, extra=(), check_devices=False):
    if check_devices:   # the CPU device check: a device mix-up in the CP path fails here as on a GPU
        os.environ["MEGAPPO_CHECK_DEVICES"] = "1"
    from megappo.config import load_config, validate
    from megappo.trainer import PPOTrainer, init_distributed

    m = "actor_rollout_ref.actor.megatron."
    cfg = load_config([f"actor_rollout_ref.model.path={model}", f"data.train_files=[{train}]", "data.val_files=[]",
                       "trainer.logger=[file]", f"trainer.default_local_dir={run_dir}", "trainer.save_freq=-1",
                       "trainer.test_freq=-1", "actor_rollout_ref.actor.use_kl_loss=true",
                       "actor_rollout_ref.actor.entropy_coeff=0.01", "trainer.total_training_steps=2",
                       # token budgets (per GPU: at CP2 a micro-batch holds twice the tokens of TP2's)
                       "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=128",
                       "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=128", *layout,
                       *extra], ["tiny_cpu"])
    validate(cfg, check_paths=True, world_size=world)
    init_distributed(cfg)
    from megatron.core import parallel_state as ps

    want_cp = 2 if f"{m}context_parallel_size=2" in layout else 1
    assert ps.get_context_parallel_world_size() == want_cp and ps.get_data_parallel_world_size() == 1
    trainer = PPOTrainer(cfg)
    packed = "actor_rollout_ref.model.use_remove_padding=true" in layout + list(extra)
    assert trainer.actor.pack_sequences == trainer.critic.pack_sequences == trainer.ref.pack_sequences == packed
    trainer.fit()


@pytest.mark.e2e
def test_a_cp2_run_takes_the_tp2_runs_steps(tmp_path):
    from harness import spawn
    from test_trainer import read_metrics

    from megappo.data.tiny import make_tiny_setup

    p = make_tiny_setup(str(tmp_path / "tiny"))
    m = "actor_rollout_ref.actor.megatron."
    runs = {}
    packed = ["actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true"]
    for name, layout in (("cp2", [f"{m}context_parallel_size=2", *packed]), ("tp2", [f"{m}tensor_model_parallel_size=2"])):
        spawn(_worker, 2, p["model"], p["train"], str(tmp_path / name), layout,
              ["trainer.save_freq=1"] if name == "cp2" else [], name == "cp2")
        runs[name] = read_metrics(tmp_path / name)
    cp2, tp2 = runs["cp2"], runs["tp2"]
    assert len(cp2) == len(tp2) == 2
    compared = 0
    for a, b in zip(cp2, tp2):
        for key, want in b.items():
            if key.startswith(("timing", "perf", "time")) or not isinstance(want, float) or key not in a:
                continue
            assert math.isclose(a[key], want, rel_tol=1e-3, abs_tol=1e-5), (a["step"], key, a[key], want)
            compared += 1
    assert compared > 60
    for key in ("actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "actor/entropy"):
        assert key in cp2[-1]
    assert cp2[-1]["actor/kl_loss"] > 0   # the policy moved at step 1
    # resumed at CP2 from the step-1 checkpoint (model, Adam state sharded over DP x CP, trainer state)
    resumed = tmp_path / "resumed"
    spawn(_worker, 2, p["model"], p["train"], str(resumed), [f"{m}context_parallel_size=2", *packed],
          [f"trainer.resume_mode={tmp_path / 'cp2' / 'global_step_1'}"])
    again = read_metrics(resumed)
    assert [r["step"] for r in again] == [2]
    bad = {k: (v, again[0][k]) for k, v in cp2[1].items() if isinstance(v, float)
           and not k.startswith(("timing", "perf", "time")) and not math.isclose(v, again[0][k], rel_tol=0, abs_tol=1e-6)}
    assert not bad, bad
