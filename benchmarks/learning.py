"""Learning speed: how many samples each method needs on tiny synthetic tasks (CPU).

    python benchmarks/learning.py                 # every task x method, ~12 min on 2 cores
    python benchmarks/learning.py --quick         # a few steps each: a smoke test of the harness

Tasks (megappo.rewards.synthetic, a tiny random-init Qwen3-style model per task):
  words  reward spread over the response: the share of 8 word slots filled with words of the
         category the prompt names (each right word adds 1/8)
  echo   reward on one token: the first response word must be the first word of the prompt
Methods (tuned settings each; see MEGAPPO and TRL_ARGS):
  gae1   megappo PPO with GAE and a critic, one sample per prompt (batch 32, 4 epochs of 2
         mini-batches, lr 3e-4, critic lr 1e-3, KL 0.01 in the reward): TRL's PPO settings
  gae    megappo PPO with GAE and a critic, n=8 (batch 32 x 8, one epoch, lr 1e-3): GRPO's settings
  grpo   megappo GRPO (no critic), n=8
  gspo, cispo, sapo   GRPO's advantages and settings with another policy loss (--methods to pick them)
  dapo   GRPO + clip-higher (0.28) + dynamic sampling (score must vary within a group); its
         samples count every generated sample, kept or filtered
  grpo_is  GRPO with rollout correction (token-level truncated importance weights, threshold 2)
  trl    TRL 1.12's PPOTrainer (GAE, separate value model), from its own venv, which a full
         run creates when missing (bash benchmarks/setup_trl.sh; TRL_VENV to put it elsewhere);
         --quick skips TRL, saying so, when the venv is missing

Each megappo run is one process (`python -m megappo.train`, world size 1). Prints the curves as a
table and ends with one JSON line: per task and method, the samples and seconds to the task's
target score (a 5-step running mean) and the score after the sample budget (mean of the last 5
steps within it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TASKS = {
    # max_response_length, target score, sample budget
    "words": dict(response=8, target=0.5, budget=6_400),
    "echo": dict(response=4, target=0.8, budget=6_400),
}

# Settings per method. Both megappo methods see batch x n samples per step.
MEGAPPO = {
    "gae": ["algorithm.adv_estimator=gae", "algorithm.lam=0.95", "algorithm.gamma=1.0",
            "actor_rollout_ref.rollout.n=8", "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "actor_rollout_ref.actor.optim.lr=1e-3", "critic.optim.lr=1e-3"],
    # TRL's PPO settings (one sample per prompt, 4 epochs of 2 mini-batches, KL in the reward)
    "gae1": ["algorithm.adv_estimator=gae", "algorithm.lam=0.95", "algorithm.gamma=1.0",
             "actor_rollout_ref.rollout.n=1", "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
             "actor_rollout_ref.actor.ppo_epochs=4", "actor_rollout_ref.actor.optim.lr=3e-4", "critic.optim.lr=1e-3",
             "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.01"],
    "grpo": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=8", "data.train_batch_size=32",
             "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.optim.lr=1e-3"],
}
# Other policy losses (actor.policy_loss.loss_mode) on GRPO's advantages and settings; GSPO with
# its paper's clip ranges (its ratio is a per-token mean, so they are ~1000x smaller than PPO's).
for _mode, _extra in (("gspo", ["actor_rollout_ref.actor.clip_ratio_low=3e-4", "actor_rollout_ref.actor.clip_ratio_high=4e-4"]),
                      ("cispo", ["actor_rollout_ref.actor.clip_ratio_high=4.0"]), ("sapo", [])):
    MEGAPPO[_mode] = MEGAPPO["grpo"] + [f"actor_rollout_ref.actor.policy_loss.loss_mode={_mode}", *_extra]
# DAPO: clip-higher and dynamic sampling (rounds of 32 prompts until 32 with varied scores are kept);
# its samples count every GENERATED sample, filtered or not. grpo_is: GRPO with rollout correction
# (token-level truncated importance weights from the engine's log-probs).
MEGAPPO["dapo"] = MEGAPPO["grpo"] + ["actor_rollout_ref.actor.clip_ratio_high=0.28", "algorithm.filter_groups.enable=true",
                                     "algorithm.filter_groups.metric=score", "data.gen_batch_size=32"]
MEGAPPO["grpo_is"] = MEGAPPO["grpo"] + ["algorithm.rollout_correction.rollout_is=token",
                                        "algorithm.rollout_correction.rollout_is_threshold=2.0"]
SAMPLES_PER_STEP = {"gae": 256, "gae1": 32, "grpo": 256, "gspo": 256, "cispo": 256, "sapo": 256, "dapo": 256,
                    "grpo_is": 256}
TRL_BATCH = 32
TRL_ARGS = {"words": ["--lr", "3e-4", "--kl-coef", "0.01"], "echo": ["--lr", "1e-4", "--kl-coef", "0.01"]}  # tuned (see trl_ppo.py)


def run_megappo(method: str, task: str, paths: dict, out: Path, steps: int, seed: int, extra=()) -> list[dict]:
    run_dir = out / f"{task}_{method}"
    spec = TASKS[task]
    args = [sys.executable, "-m", "megappo.train", "--config", "tiny_cpu", "trainer.n_gpus_per_node=1",
            f"actor_rollout_ref.model.path={paths['model']}", f"data.train_files=[{paths['train']}]",
            f"data.val_files=[{paths['test']}]", f"trainer.default_local_dir={run_dir}", "trainer.logger=[file]",
            "trainer.resume_mode=disable", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "trainer.save_freq=-1", f"trainer.total_training_steps={steps}", "trainer.total_epochs=1000",
            "data.max_prompt_length=16", f"data.max_response_length={spec['response']}", f"data.seed={seed}",
            "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048",
            "critic.ppo_max_token_len_per_gpu=2048", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=4096", *MEGAPPO[method], *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    t0 = time.time()
    p = subprocess.run(args, capture_output=True, text=True, env=env, cwd=str(out))
    if p.returncode != 0:
        raise RuntimeError(f"{task}/{method} failed:\n{p.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) > 0 and "critic/score/mean" in r]
    # samples per step from the overrides actually passed (--extra may change n or the batch)
    last = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if "=" in a}
    n = int(last["actor_rollout_ref.rollout.n"])
    per_step = n * int(last["data.train_batch_size"])
    per_round = n * int(last.get("data.gen_batch_size", last["data.train_batch_size"]))
    curve, elapsed, samples = [], 0.0, 0
    for r in rows:
        elapsed += r.get("timing_s/step", 0.0)
        # dynamic sampling generates rounds until enough groups are kept: count what was generated
        samples += int(r["train/num_gen_batches"]) * per_round if "train/num_gen_batches" in r else per_step
        # the score of everything generated (dynamic sampling's critic/score/mean is of the kept groups)
        score = r.get("train/generated_score_mean", r["critic/score/mean"])
        curve.append({"step": r["step"], "samples": samples, "score": score, "seconds": elapsed})
    print(f"  {task}/{method}: {len(curve)} steps in {time.time() - t0:.0f} s", flush=True)
    return curve


def trl_python() -> Path | None:
    py = Path(os.environ.get("TRL_VENV", ROOT / ".venv-trl")) / "bin" / "python"
    return py if py.exists() else None


def run_trl(task: str, paths: dict, out: Path, steps: int, seed: int) -> list[dict]:
    f = out / f"{task}_trl.jsonl"
    args = [str(trl_python()), str(ROOT / "benchmarks" / "trl_ppo.py"), "--model", paths["model"],
            "--train", paths["train"], "--task", task, "--steps", str(steps), "--batch-size", str(TRL_BATCH),
            "--max-new-tokens", str(TASKS[task]["response"]), "--seed", str(seed), "--out", str(f), *TRL_ARGS[task]]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    t0 = time.time()
    p = subprocess.run(args, capture_output=True, text=True, env=env, cwd=str(out))
    if p.returncode != 0:
        raise RuntimeError(f"{task}/trl failed:\n{p.stderr[-3000:]}")
    curve = [json.loads(x) for x in f.read_text().splitlines()]
    print(f"  {task}/trl: {len(curve)} steps in {time.time() - t0:.0f} s", flush=True)
    return curve


def summarise(curve: list[dict], target: float, budget: int) -> dict:
    """Samples/seconds at the first step whose 5-step running mean reaches ``target``; the mean
    score of the last 5 steps within ``budget`` samples."""
    hit = None
    for i in range(len(curve)):
        window = curve[max(0, i - 4):i + 1]
        if len(window) == 5 and sum(r["score"] for r in window) / 5 >= target:
            hit = curve[i]
            break
    within = [r for r in curve if r["samples"] <= budget][-5:]
    return {"samples_to_target": hit["samples"] if hit else None,
            "seconds_to_target": round(hit["seconds"], 1) if hit else None,
            "score_at_budget": round(sum(r["score"] for r in within) / len(within), 4) if within else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="words,echo")
    ap.add_argument("--methods", default="gae1,gae,grpo,trl")
    ap.add_argument("--quick", action="store_true", help="3 steps per run: checks the harness, measures nothing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE",
                    help="an override added to every megappo run (to try a setting)")
    args = ap.parse_args(argv)
    import tempfile

    from megappo.data.tiny import make_tiny_setup

    out = Path(args.out or tempfile.mkdtemp(prefix="megappo-learning-"))
    out.mkdir(parents=True, exist_ok=True)
    results, curves = {}, {}
    for task in args.tasks.split(","):
        spec = TASKS[task]
        paths = make_tiny_setup(str(out / f"setup_{task}"), task=task, n_train=2048, seed=args.seed)
        for method in args.methods.split(","):
            if method == "trl":
                if trl_python() is None and not args.quick:
                    # TRL lives in a venv of its own (never in megappo's dependencies)
                    print("  installing TRL 1.12 into its own venv: bash benchmarks/setup_trl.sh", flush=True)
                    subprocess.run(["bash", str(ROOT / "benchmarks" / "setup_trl.sh")], check=False)
                if trl_python() is None:
                    print(f"  {task}/trl: skipped: no TRL venv (bash benchmarks/setup_trl.sh)", flush=True)
                    continue
                steps = 3 if args.quick else spec["budget"] // TRL_BATCH
                curve = run_trl(task, paths, out, steps, args.seed)
            else:
                steps = 3 if args.quick else spec["budget"] // SAMPLES_PER_STEP[method]
                curve = run_megappo(method, task, paths, out, steps, args.seed, args.extra)
            curves[f"{task}/{method}"] = curve
            results[f"{task}/{method}"] = summarise(curve, spec["target"], spec["budget"])

    print(f"\n{'run':<12} {'samples':>8} {'score':>6}   (every ~10% of the budget)")
    for name, curve in curves.items():
        stride = max(1, len(curve) // 10)
        for r in curve[stride - 1::stride]:
            print(f"{name:<12} {r['samples']:>8} {r['score']:>6.3f}")
    print(f"\n{'run':<12} {'target':>6} {'samples to target':>18} {'s to target':>12} {'score at budget':>16}")
    for name, r in results.items():
        print(f"{name:<12} {TASKS[name.split('/')[0]]['target']:>6} {str(r['samples_to_target']):>18} "
              f"{str(r['seconds_to_target']):>12} {str(r['score_at_budget']):>16}")
    flat = {}
    for name, r in results.items():
        task, method = name.split("/")
        for k, v in r.items():
            flat[f"{task}_{method}_{k}"] = v
    # megappo's PPO with a critic (its best setting here) against TRL's PPO and its own GRPO
    print()
    for task in args.tasks.split(","):
        ppo = [results[f"{task}/{m}"]["samples_to_target"] for m in ("gae1", "gae") if f"{task}/{m}" in results]
        ppo = min((x for x in ppo if x is not None), default=None)
        for other in ("trl", "grpo"):
            theirs = results.get(f"{task}/{other}", {}).get("samples_to_target")
            if ppo is not None and theirs:
                flat[f"{task}_ppo_over_{other}_samples"] = round(ppo / theirs, 3)
                print(f"{task}: megappo PPO+critic needs {ppo / theirs:.2f}x the samples of {other}")
    print(json.dumps(flat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
