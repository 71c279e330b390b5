"""LoRA against full fine-tuning on the CPU main task (echo, PPO with GAE and a critic; one process
per run), over seeds: samples to the target, bytes per weight sync, seconds per step.

    python benchmarks/lora.py                     # 3 seeds, the methods below, 2 runs at a time
    python benchmarks/lora.py --quick             # 3 steps, one seed: checks the harness

Methods (benchmarks/learning.py's MEGAPPO; gae_batch's settings otherwise):
  gae_batch      full fine-tuning (lr 1e-3)
  gae_lora       LoRA rank 8, alpha 16, all-linear; the base frozen, the reference = base
  gae_lora_attn  LoRA rank 8 on q_proj, k_proj, v_proj, o_proj only

The base model. The task's tiny model is random-init: its output layer's weights have std 0.02,
so over the final norm's output (length sqrt(hidden) = 11.3) a logit spans about +-0.7, and
with the output layer and the final norm frozen (LoRA adapts the decoder's linears only) no
policy can put more than ~0.1 probability on one of the 128 tokens: LoRA on it plateaus at
echo's chance-level score ~0.1 whatever its learning rate (measured: lr 1e-3 to 2e-1 all end at
entropy ~4.67 of a uniform 4.85), while full fine-tuning rescales the head. A pretrained base
has a trained head; this benchmark stands one in by multiplying the final norm's weight by
--head-gain (every run, full fine-tuning included, starts from that base).

Prints per method the median [min, max] over seeds of the samples to target (a seed that never
reaches it counts as infinite), the bytes each sync moves (after the first, which sends the base
to the engine) against the full model's, and the mean seconds per step; ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

import learning  # noqa: E402

TASK = "echo"
METHODS = ("gae_batch", "gae_lora", "gae_lora_attn")


def scaled_base(paths: dict, gain: float) -> None:
    """The model's final norm weight times ``gain``, in place (see the module docstring)."""
    from safetensors.torch import load_file, save_file

    for f in Path(paths["model"]).glob("*.safetensors"):
        t = load_file(str(f))
        if "model.norm.weight" in t:
            t["model.norm.weight"] = t["model.norm.weight"] * gain
            save_file(t, str(f), metadata={"format": "pt"})


def run_facts(run_dir: Path) -> dict:
    """Bytes per sync (steps after the first: the adapters alone for LoRA) and seconds per step."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    syncs = [r["rollout/sync_bytes"] for r in rows[1:] if "rollout/sync_bytes" in r] or \
            [r["rollout/sync_bytes"] for r in rows if "rollout/sync_bytes" in r]
    steps = [r["timing_s/step"] for r in rows[1:] if "timing_s/step" in r] or [r["timing_s/step"] for r in rows]
    return {"sync_bytes": statistics.median(syncs), "step_s": statistics.mean(steps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--quick", action="store_true", help="3 steps, one seed: checks the harness, measures nothing")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--budget", type=int, default=12_800, help="samples per run at most (256 per step)")
    ap.add_argument("--head-gain", type=float, default=3.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from megappo.data.tiny import make_tiny_setup

    out = Path(args.out or tempfile.mkdtemp(prefix="megappo-lora-"))
    out.mkdir(parents=True, exist_ok=True)
    methods = args.methods.split(",")
    seeds = [int(s) for s in args.seeds.split(",")][:1 if args.quick else None]
    steps = 3 if args.quick else args.budget // learning.SAMPLES_PER_STEP["gae_batch"]
    target = learning.TASKS[TASK]["target"]
    paths = {}
    for seed in seeds:
        paths[seed] = make_tiny_setup(str(out / f"setup_s{seed}"), task=TASK, n_train=8192, seed=seed)
        scaled_base(paths[seed], args.head_gain)
    jobs = [(m, s) for m in methods for s in seeds]

    def run(job):
        method, seed = job
        return learning.run_megappo(method, TASK, paths[seed], out, steps, seed, stop_at_target=not args.quick)

    t0 = time.time()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        curves = dict(zip(jobs, pool.map(run, jobs)))
    flat = {"wall_s": round(time.time() - t0, 1), "head_gain": args.head_gain, "budget_samples": steps * 256}
    head = f"samples to {target}: median [min, max]"
    print(f"\n{'method':<15} {head:>36} {'sync bytes':>12} {'of full':>8} {'s/step':>7}")
    full_bytes = None
    rows = []
    for method in methods:
        reached = [learning.summarise(curves[method, s], target, steps * 256)["samples_to_target"] for s in seeds]
        facts = [run_facts(out / f"{TASK}_{method}_s{s}") for s in seeds]
        med, lo, hi = learning.median_spread(reached)
        sync = statistics.median(f["sync_bytes"] for f in facts)
        step_s = statistics.mean(f["step_s"] for f in facts)
        if method == "gae_batch":
            full_bytes = sync
        rows.append((method, med, lo, hi, sync, step_s))
        flat[f"{TASK}_{method}_samples_to_target_median"] = med
        flat[f"{TASK}_{method}_samples_to_target_per_seed"] = reached
        flat[f"{method}_sync_bytes"] = sync
        flat[f"{method}_step_s"] = round(step_s, 3)
    for method, med, lo, hi, sync, step_s in rows:
        share = sync / full_bytes if full_bytes else None
        if share is not None and method != "gae_batch":
            flat[f"{method}_sync_share_of_full"] = round(share, 4)
        print(f"{method:<15} {str(med):>18} [{lo}, {hi}]{'':>8} {int(sync):>12} "
              f"{'' if share is None else f'{100 * share:.1f}%':>8} {step_s:>7.2f}")
    print(json.dumps(flat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
