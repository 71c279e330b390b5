"""Overlapped generation (split placement, one-step off-policy): step time and tokens/s of one job on 2 CPU cores, placed three ways.

    python benchmarks/async.py            # colocated, split synchronous, split one-step-off (~6 min on 2 cores)
    python benchmarks/async.py --quick    # 3 steps of one-step-off only: a smoke test of the harness

The tiny words task (GAE with a critic, 16 prompts x 4 samples of up to 24 tokens per step) with
two ranks, each pinned to a core of its own so that the two groups really run side by side:
  colocated      both ranks train and generate (they take turns, as today's default)
  split_sync     rank 0 trains, rank 1 generates; each waits for the other (staleness 0)
  one_step_off   rank 0 trains on batch k while rank 1 generates batch k+1 with the weights
                 one update behind (training/weight_version_lag = 1)
Each run is `torch.distributed.run --nproc_per_node 2` of this file's rank entry (megappo.train's
code plus the core pinning). Prints a table and one JSON line: per placement the mean step time
over the steps after the first, tokens (prompt + response) per second of the job, and the lag.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMON = ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=4", "data.train_batch_size=16",
          "actor_rollout_ref.actor.ppo_mini_batch_size=16", "data.max_response_length=24",
          "actor_rollout_ref.actor.optim.lr=1e-3", "critic.optim.lr=1e-3", "trainer.logger=[file]",
          "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
          "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
          "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
          "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
PLACEMENTS = {
    "colocated": ["trainer.n_gpus_per_node=2"],
    "split_sync": ["trainer.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false", "rollout.n_gpus_per_node=1"],
    "one_step_off": ["trainer.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false", "rollout.n_gpus_per_node=1",
                     "trainer.async_mode=one_step_off"],
}


def rank_entry(overrides: list[str]) -> None:
    """One rank: megappo.train's start-up, then this rank pinned to one core by its role."""
    import torch

    from megappo.config import load_config, validate
    from megappo.distributed import split
    from megappo.trainer import PPOTrainer, init_distributed

    cfg = load_config(overrides, ["tiny_cpu"])
    validate(cfg, check_paths=True, world_size=int(os.environ["WORLD_SIZE"]))
    init_distributed(cfg)
    groups = split.current()
    core = int(os.environ["RANK"]) if groups is None else (0 if groups.role == "train" else 1)
    os.sched_setaffinity(0, {core % os.cpu_count()})
    torch.set_num_threads(1)
    if groups is not None and groups.role == "rollout":
        from megappo.trainer import serve

        serve(cfg, groups)
    else:
        PPOTrainer(cfg).fit()


def run(name: str, setup: dict, out: Path, steps: int) -> dict:
    run_dir = out / name
    args = [f"actor_rollout_ref.model.path={setup['model']}", f"data.train_files=[{setup['train']}]",
            "data.val_files=[]", f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={steps}",
            *COMMON, *PLACEMENTS[name]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(_free_port()), __file__, "--rank-entry", *args], capture_output=True, text=True, env=env,
                       timeout=1800)
    if p.returncode:
        raise SystemExit(f"{name}: the run failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows
    step_s = sum(r["timing_s/step"] for r in later) / len(later)
    return {"step_s": round(step_s, 3),
            "tokens_per_s": round(sum(r["perf/throughput"] * 2 for r in later) / len(later), 1),
            "lag": [r.get("training/weight_version_lag", 0.0) for r in rows],
            "score": round(rows[-1]["critic/score/mean"], 3)}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-entry":
        rank_entry(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 steps of one_step_off only")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--placements", nargs="*", default=list(PLACEMENTS), choices=list(PLACEMENTS))
    args = ap.parse_args()
    steps, placements = (3, ["one_step_off"]) if args.quick else (args.steps, args.placements)
    sys.path.insert(0, str(ROOT / "src"))
    from megappo.data.tiny import make_tiny_setup

    with tempfile.TemporaryDirectory() as tmp:
        setup = make_tiny_setup(os.path.join(tmp, "words"), n_train=256, n_test=8, task="words")
        results = {name: run(name, setup, Path(tmp), steps) for name in placements}
    print(f"{'placement':<14} {'step s':>8} {'tokens/s':>10}  lag per step")
    for name, r in results.items():
        print(f"{name:<14} {r['step_s']:>8.2f} {r['tokens_per_s']:>10.1f}  {r['lag']}")
    if "split_sync" in results and "one_step_off" in results:
        speedup = results["split_sync"]["step_s"] / results["one_step_off"]["step_s"]
        print(f"one_step_off vs split_sync: {speedup:.2f}x per step")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
