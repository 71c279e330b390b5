"""The entry point as a user runs it: python -m megappo.train ..."""
import subprocess
import sys

import yaml

from megappo.config import load_config, to_dict


def run(*args, env=None, cwd=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "megappo.train", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def test_dry_run_prints_the_resolved_default_config():
    """No --config: verl's defaults (one GPU node of 8), not the CPU preset. As in verl, the
    micro-batch sizes have no default: the error says so, and where the value came from."""
    p = run("--dry-run", "actor_rollout_ref.actor.clip_ratio_c=0.5")
    assert p.returncode == 2
    assert ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: must be set when "
            "actor_rollout_ref.actor.use_dynamic_bsz is false [value from the defaults]") in p.stderr, p.stderr
    assert "clip_ratio_c: dual-clip constant must be > 1, got 0.5 [value from the command line]" in p.stderr, p.stderr
    micro = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]
    p = run("--dry-run", *micro)
    assert p.returncode == 0, p.stderr
    printed = yaml.safe_load(p.stdout)
    assert printed == to_dict(load_config(micro, []))
    assert printed["trainer"]["device"] == "cuda" and printed["actor_rollout_ref"]["rollout"]["n"] == 1
    assert "# layout: world=8" in p.stdout
    p = run("--dry-run", "--config", "tiny_cpu")
    assert p.returncode == 0, p.stderr
    assert yaml.safe_load(p.stdout) == to_dict(load_config([], ["tiny_cpu"]))
    assert "# layout: world=2" in p.stdout and "DP=2" in p.stdout


def test_dry_run_applies_overrides_and_files(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("trainer:\n  experiment_name: fromfile\n")
    p = run("--dry-run", "--config", "tiny_cpu", "--config", str(f), "data.seed=7")
    assert p.returncode == 0, p.stderr
    printed = yaml.safe_load(p.stdout)
    assert printed["trainer"]["experiment_name"] == "fromfile"
    assert printed["data"]["seed"] == 7


def test_bad_value_fails_fast_naming_the_key():
    p = run("actor_rollout_ref.actor.clip_ratio_c=0.5")
    assert p.returncode == 2
    assert "actor_rollout_ref.actor.clip_ratio_c" in p.stderr
    assert "must be > 1" in p.stderr
    assert p.stdout == ""  # nothing resolved or started


def test_typo_is_named_with_suggestion():
    p = run("actor_rollout_ref.actor.clip_ratoi=0.1")
    assert p.returncode == 2
    assert "actor_rollout_ref.actor.clip_ratoi" in p.stderr
    assert "did you mean 'actor_rollout_ref.actor.clip_ratio'" in p.stderr


def test_several_problems_reported_together():
    p = run("--dry-run", "--config", "tiny_cpu", "actor_rollout_ref.actor.clip_ratio_c=0.5", "trainer.save_freq=0", "data.seed=x",
            "data.bogus=1")
    assert p.returncode == 2
    for frag in ("clip_ratio_c", "trainer.save_freq", "data.seed", "data.bogus", "4 configuration errors"):
        assert frag in p.stderr, p.stderr


def test_real_start_checks_paths_and_world_size(tmp_path):
    # The preset's paths are relative: run where they do not exist (the README's main command
    # creates them in the repository root).
    p = run("--config", "tiny_cpu", cwd=tmp_path)
    assert p.returncode == 2
    assert "data.train_files: file not found" in p.stderr
    assert "actor_rollout_ref.model.path: model directory not found" in p.stderr
    import os
    env = dict(os.environ, WORLD_SIZE="5", RANK="0")
    p = run("--config", "tiny_cpu", env=env, cwd=tmp_path)
    assert p.returncode == 2 and "WORLD_SIZE=5" in p.stderr


def test_without_a_launcher_one_process_runs_and_more_are_told_how_to_start(tmp_path):
    """`python -m megappo.train` with no launcher: a one-process config simply runs (world size 1
    on a free local port); a larger one says in one line how to start it."""
    import os

    from megappo.data.tiny import make_tiny_setup

    p = make_tiny_setup(str(tmp_path / "tiny"), n_train=16, n_test=4)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    paths = ["--config", "tiny_cpu", f"actor_rollout_ref.model.path={p['model']}", f"data.train_files=[{p['train']}]",
             f"data.val_files=[{p['test']}]", f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[file]"]
    two = run(*paths, env=env, cwd=tmp_path)
    assert two.returncode == 2
    assert "runs 2 processes" in two.stderr and "torchrun --nproc_per_node 2 -m megappo.train" in two.stderr
    assert "Traceback" not in two.stderr
    one = run(*paths, "trainer.n_gpus_per_node=1", "trainer.total_training_steps=1", "trainer.val_before_train=false",
              "trainer.save_freq=-1", "trainer.test_freq=-1", env=env, cwd=tmp_path, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1 and '"step": 1' in rows[0]
