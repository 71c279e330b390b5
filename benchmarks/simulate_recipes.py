"""Every shipped recipe's step simulated at full size on fake tensors (megappo.simulate), beside
the memory planner's arithmetic: per pipeline stage and phase, GiB per GPU and the planner's gap
(planned / simulated - 1, the plan for the local layer spec the simulation builds), flagged ``!``
beyond 10%; the pass's peak and the optimizer step's temporary beside it.

    python benchmarks/simulate_recipes.py [--recipes qwen3_8b qwen3_14b ...] [--quick] [--gpu-memory-gb 80]

Simulated, not measured on a GPU. Each recipe runs in a process of its own (a simulation holds
torch.distributed's fake world and megatron's parallel state); ``--quick`` simulates the
smallest recipe only. Ends with one JSON line: per recipe its wall time, the largest gap and
the error when the simulation failed, and the phases beyond 10%.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
# What a recipe's launch script sets beyond its parallel config (launch/qwen2_5_0_5b_gsm8k.sh: the
# model and its 16k-token budget; the Qwen3 configs name their models and budgets themselves).
_BUDGET = ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "critic.ppo_max_token_len_per_gpu",
           "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
           "critic.forward_max_token_len_per_gpu"]
LAUNCH_OVERRIDES = {"qwen2.5_0.5b": ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",
                                     "critic.model.path=Qwen/Qwen2.5-0.5B-Instruct", "data.max_prompt_length=512",
                                     "data.max_response_length=512", "data.train_batch_size=256",
                                     "actor_rollout_ref.actor.ppo_mini_batch_size=64"]
                    + [f"{k}=16384" for k in _BUDGET]}

# Layouts beyond the recipes' own, so that the simulated shapes reach PP4 with virtual stages and
# context parallelism: name -> (the recipe it starts from, what it changes)
_PP = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")
EXTRA_LAYOUTS = {"qwen3_32b_tp4_pp4_vpp2": ("qwen3_32b", [f"{role}.megatron.{k}={v}" for role in (
    "actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic") for k, v in zip(_PP, (4, 4, 2))]),
                 # two nodes: TP2 PP2 CP2 DP2, the recipe's 24k-token budget per GPU (48k-token micro-batches)
                 "qwen3_8b_cp2": ("qwen3_8b", ["trainer.nnodes=2",
                                               "actor_rollout_ref.actor.megatron.context_parallel_size=2"])}

ONE = """
import json, sys
from megappo import plan as P
from megappo.config import load_config
cfg = load_config([f"trainer.gpu_memory_gb={sys.argv[2]}"] + json.loads(sys.argv[3]), [sys.argv[1]])
p, path = P.plan_from_config(cfg)
p = P.local_spec_plan(p)
rows = []
for r in P.simulate_plan(p, json.loads(path.read_text())):
    for phase, total in P.simulated_totals(p, r).items():
        row = p.table[r.stage][phase]
        rows.append([r.stage, phase, total, p.total(r.stage, phase), r.passes[phase],
                     row["activations"] + row["logits"], r.steps.get(phase, 0), row.get("optimizer step", 0), r.seconds])
print(json.dumps(rows))
"""


def simulate(recipe: str, gpu_memory_gb: float) -> dict:
    start = time.monotonic()
    base, extra = EXTRA_LAYOUTS.get(recipe, (recipe, []))
    p = subprocess.run([sys.executable, "-c", ONE, str(REPO / "parallel_configs" / f"{base}.yaml"), str(gpu_memory_gb),
                        json.dumps(LAUNCH_OVERRIDES.get(base, []) + extra)], capture_output=True, text=True, cwd=REPO)
    out = {"seconds": round(time.monotonic() - start, 1)}
    if p.returncode != 0:
        lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
        out["error"] = lines[-1][:300] if lines else f"exit {p.returncode}"
        return out
    out["rows"] = json.loads(p.stdout.strip().splitlines()[-1])
    gaps = {f"{stage} {phase}": round((plan / sim - 1) * 100, 1) for stage, phase, sim, plan, *_ in out["rows"]}
    out["max_gap_pct"] = max(abs(g) for g in gaps.values())
    out["over_10pct"] = {k: g for k, g in gaps.items() if abs(g) > 10}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", nargs="*", help="parallel_configs/ names or EXTRA_LAYOUTS' (default: all)")
    ap.add_argument("--quick", action="store_true", help="the smallest recipe only")
    ap.add_argument("--gpu-memory-gb", type=float, default=80.0)
    args = ap.parse_args()
    recipes = args.recipes or sorted(p.stem for p in (REPO / "parallel_configs").glob("*.yaml")) + list(EXTRA_LAYOUTS)
    if args.quick:
        recipes = ["qwen2.5_0.5b"]
    summary = {}
    print(f"{'recipe':<16} {'stage':>5} {'phase':<14} {'simulated':>9} {'planned':>9} {'gap':>6}  {'pass':>11}  "
          f"{'step':>11}  (GiB per GPU, simulated / planned; step: simulated / planned beyond the pass's peak; "
          "simulated, not measured on a GPU)")
    for recipe in recipes:
        res = simulate(recipe, args.gpu_memory_gb)
        if "error" in res:
            print(f"{recipe:<16} simulation failed after {res['seconds']} s: {res['error']}")
        for stage, phase, sim, plan, sim_pass, plan_pass, sim_step, plan_step, _ in res.get("rows", []):
            gap = (plan / sim - 1) * 100
            print(f"{recipe:<16} {stage:>5} {phase:<14} {sim / GiB:9.1f} {plan / GiB:9.1f} {gap:+5.1f}%"
                  f"{'!' if abs(gap) > 10 else ' '} {sim_pass / GiB:5.1f}/{plan_pass / GiB:<5.1f} "
                  f"{sim_step / GiB:5.1f}/{plan_step / GiB:<5.1f}")
        summary[recipe] = {k: v for k, v in res.items() if k != "rows"}
        print(f"{recipe:<16} wall time {res['seconds']} s", flush=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
