"""Learning speed: how many samples each method needs on tiny synthetic tasks (CPU), over seeds.

    python benchmarks/learning.py                 # every task x method x 3 seeds, 2 runs at a time
    python benchmarks/learning.py --quick         # 3 steps, one seed: a smoke test of the harness
    python benchmarks/learning.py --tasks pick_first --methods gae,gae_group,grpo --seeds 0,1,2

Tasks (megappo.rewards.synthetic; a tiny random-init Qwen3-style model per task and seed):
  words       reward spread over the response: the share of 8 word slots filled with words of
              the category the prompt names (each right word adds 1/8)
  echo        reward on one token: the first response word must be the first word of the prompt
  pick_first  8 random words t10..t41 (vocabulary 64, 2 layers); every one of the 8 response
              words should be the prompt's FIRST word (each adds 1/8, paid at the last token)
  copy        the same prompts; response word i should be prompt word i (a different target at
              each position: per-token credit)
  pick_last   the same prompts; every response word should be the prompt's LAST word (added after
              the PPO defaults were chosen, to check them on a task they were not measured on)
  pick_first_warm  pick_first from a warm start (not in the default list): the model fine-tuned
              for 32 supervised steps to answer the first word (~1/4 of its words right at step 0),
              actor, reference and critic all from it; target 0.8
  copy_warm   the same for copy (fine-tuned 32 steps on the prompt's 8 words)
  pick_first_warm16, copy_warm16  the same after 16 supervised steps (~0.045 at step 0; budget 38,400)
  lookup      multi-turn with a tool (not in the default list): "lookup: t13"; the answer is a word
              v0..v7 drawn per row that only the row's `lookup` tool knows; the model must call it
              (one token ends its turn), read "= v5" in the tool turn and answer v5 (score 1; a
              call with a wrong answer 0.1, the tool's calc_reward); target 0.8
  lookup_notools  the same data and model with multi-turn off: the answer cannot be seen, the
              best possible expected score is ~0.16 (lookup_ceiling_without_tools)
    python benchmarks/learning.py --tasks lookup,lookup_notools --methods gae_batch,grpo
Methods (see MEGAPPO and TRL_ARGS):
  gae        megappo PPO with GAE and a critic, n=8 (batch 32 x 8, one epoch, lr 1e-3): GRPO's settings,
             every other key at megappo's default (for gae with n > 1: gae_adv_norm group_cv, lam 1,
             critic betas 0.9/0.95, one critic pass; until 2026-12-05 8 passes: gae_cv_fit;
             the critic's weight up to gae_cv_beta_max 3, 1 until 2026-12-06; 0 until the fit's
             t-statistic reaches gae_cv_min_t 3, 1 until 2026-12-06)
  gae_batch  what gae was before those defaults: verl's batch whitening, lam 0.95, one critic pass
  gae_group  the same with algorithm.gae_adv_norm=group (the group's baseline and scale)
  gae_centred  the same with algorithm.gae_adv_norm=group_centred and lam 1: GRPO's advantage plus
             only the part of the critic's per-token baseline that differs within the prompt group
  gae_centred_fit  gae_centred with the critic fitted harder on each batch (critic.ppo_epochs=8,
             critic.optim.betas=[0.9,0.95])
  gae_cv     algorithm.gae_adv_norm=group_cv, lam 1: gae_centred with the critic's correction
             weighted by how much of the outcome it explains on the batch (0 = GRPO's advantage)
  gae_cv_fit gae_cv with gae_centred_fit's critic settings (the defaults until 2026-12-05: 8 critic passes)
  gae_cv_b95, gae_cv_fit4   gae_cv with the critic's betas 0.9/0.95 only (the same run as gae); and with 4 passes
  gae_cmb4, gae_cmb2   gae_cv_b95 with the critic's one pass in mini-batches of 4 or 2 prompts (8 or 16
             critic optimizer steps per batch at one pass's compute)
  gae_inc    gae with critic.value_mode=increments (V(s_t) = V(s_0) + the running sum of one head
             output per response token before t)
  grpo       megappo GRPO (no critic), n=8
  gae1       megappo PPO with GAE and a critic, one sample per prompt (batch 32, 4 epochs of 2
             mini-batches, TRL's lr for the task (3e-4; 1e-4 on echo) for actor and critic, no
             gradient clipping, KL 0.01 in the reward): TRL's PPO settings
  gae1_clip  gae1 with megappo's (verl's) defaults where TRL's differ: clip 1.0, critic lr 1e-3
  gae1_trl   gae1 with TRL's choices in every other key verl sets otherwise: value clip 0.2, a
             random value head, weight decay 0, no dual clip, mini-batches shuffled every epoch
  trl        TRL 1.12's PPOTrainer (GAE, separate value model) at those settings, from its own
             venv, which a full run creates when missing (bash benchmarks/setup_trl.sh; TRL_VENV
             to put it elsewhere); --quick skips TRL, saying so, when the venv is missing
  gspo, cispo, sapo   GRPO's advantages and settings with another policy loss
  dapo       GRPO + clip-higher (0.28) + dynamic sampling (score must vary within a group); its
             samples count every generated sample, kept or filtered
  grpo_is    GRPO with rollout correction (token-level truncated importance weights, threshold 2)
  gae_lora, gae_lora_attn, grpo_lora   LoRA rank 8 (all-linear; attention only), lr 3e-3: see
             benchmarks/lora.py, which runs them on a base whose output can be peaked (a random-
             init head caps a frozen-head policy near uniform)

Each megappo run is one process (`python -m megappo.train`, world size 1); --jobs of them run at
once. By default a run stops once it reaches its task's target (a 5-step running mean of the
score): only the samples to target are measured (--full-budget runs every method to the budget).
Prints the curves (score and actor entropy), per task and method the median [min, max] over
seeds of the samples to target (a seed that never reaches it counts as infinite), how many runs
collapsed (entropy under half its start while the score stayed under twice its start and, for a
run that starts competent, gained less than a quarter of the way to its best samples), the
comparisons megappo gae <= grpo, gae1 <= trl and gae1_trl <= trl (medians, and seed by seed with a sign
test: with updates as alike as these, a 3-seed median is often one seed's luck; where neither reaches
the target the scores at the budget decide, and the line says when their gap is under two standard
errors of the 5-step windows' own noise), and ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))   # this checkout's megappo (tasks, CollapseWatch), not the venv's install

# lookup: one tool call, its answer, the model's answer (max_assistant_turns 2); lr 3e-4 for every
# method (at 1e-3 GRPO and PPO peaked near 0.8 and fell back as entropy collapsed). Without tools
# the same data and model: the model cannot see the answer (its best is ~1/8, see
# megappo.rewards.synthetic.lookup_ceiling_without_tools).
_MT = "actor_rollout_ref.rollout.multi_turn."
LOOKUP_NO_TOOLS = ["actor_rollout_ref.actor.optim.lr=3e-4"]
LOOKUP_TOOLS = LOOKUP_NO_TOOLS + ["data.return_raw_chat=true", f"{_MT}enable=true", f"{_MT}max_assistant_turns=2",
                                  f"{_MT}tool_config_path={ROOT / 'examples' / 'tools' / 'lookup.yaml'}"]

TASKS = {
    # max_response_length, target score, sample budget
    "words": dict(response=8, target=0.5, budget=6_400),
    "echo": dict(response=4, target=0.8, budget=6_400),
    "pick_first": dict(response=8, target=0.5, budget=38_400),
    "copy": dict(response=8, target=0.5, budget=38_400),
    "pick_last": dict(response=8, target=0.5, budget=38_400),
    # pick_first from a warm start: the model first fine-tuned (supervised, 32 steps of 64 prompts,
    # benchmarks/critic_probe.py's _fine_tuned) to answer the first word, so it samples right words
    # ~1/4 of the time at step 0 (random init: 1/32), as RL post-training starts from a model that
    # has the skill in part; actor, reference and critic all start from that model
    "pick_first_warm": dict(response=8, target=0.8, budget=25_600, setup="pick_first", warm_sft_steps=32),
    # less warm: 16 supervised steps leave the model at ~0.045 (random init: 0.03), but its trunk
    # has begun the lookup; runs of 50-150 steps give the critic room to matter
    "pick_first_warm16": dict(response=8, target=0.8, budget=38_400, setup="pick_first", warm_sft_steps=16),
    "copy_warm16": dict(response=8, target=0.8, budget=38_400, setup="copy", warm_sft_steps=16),
    # copy from a warm start (a different right word at each position: per-token credit)
    "copy_warm": dict(response=8, target=0.8, budget=25_600, setup="copy", warm_sft_steps=32),
    # multi-turn with a tool (megappo.rewards.synthetic: lookup); not in the default task list
    "lookup": dict(response=12, target=0.8, budget=64_000, setup="lookup", extra=LOOKUP_TOOLS),
    "lookup_notools": dict(response=12, target=0.8, budget=64_000, setup="lookup", extra=LOOKUP_NO_TOOLS),
}
DEFAULT_TASKS = ("words", "echo", "pick_first", "copy")

# Settings per method. Both megappo methods see batch x n samples per step.
MEGAPPO = {
    # megappo's PPO with a critic as a user gets it at GRPO's settings: every other key at its
    # default (for gae with n > 1: gae_adv_norm group_cv, lam 1, critic betas 0.9/0.95, one critic
    # pass; megappo.config.GAE_GROUP_DEFAULTS)
    "gae": ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=8", "data.train_batch_size=32",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.optim.lr=1e-3", "critic.optim.lr=1e-3"],
    # what "gae" meant before those defaults: verl's batch whitening, lam 0.95, one critic pass
    "gae_batch": ["algorithm.adv_estimator=gae", "algorithm.lam=0.95", "algorithm.gamma=1.0", "algorithm.gae_adv_norm=batch",
                  "actor_rollout_ref.rollout.n=8", "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                  "actor_rollout_ref.actor.optim.lr=1e-3", "critic.optim.lr=1e-3"],
    # TRL's PPO settings (one sample per prompt, 4 epochs of 2 mini-batches, KL in the reward; one
    # optimizer for policy and value model, so one lr, and no gradient clipping: TRL's PPO loop
    # clips none). megappo's own defaults (verl's clip 1.0, critic lr 1e-3) needed 1.2x TRL's samples
    # on words (2026-12-05): that is the "gae1_clip" method.
    "gae1": ["algorithm.adv_estimator=gae", "algorithm.lam=0.95", "algorithm.gamma=1.0",
             "actor_rollout_ref.rollout.n=1", "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
             "actor_rollout_ref.actor.ppo_epochs=4", "actor_rollout_ref.actor.optim.lr=3e-4", "critic.optim.lr=3e-4",
             "actor_rollout_ref.actor.optim.clip_grad=0", "critic.optim.clip_grad=0",
             "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.01"],
    "grpo": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=8", "data.train_batch_size=32",
             "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.optim.lr=1e-3"],
}
# gae1 with megappo's (verl's) defaults where TRL's differ: gradient-norm clip 1.0, critic lr 1e-3
MEGAPPO["gae1_clip"] = [o for o in MEGAPPO["gae1"] if "clip_grad" not in o and not o.startswith("critic.optim.lr")] + [
    "critic.optim.lr=1e-3"]
# gae1 with every other setting where TRL's PPOTrainer differs from verl's defaults: value clip 0.2
# (verl 0.5), a random value head (std 0.02, as a new AutoModelForSequenceClassification head; verl's
# starts at 0), no weight decay (verl 0.01), no dual clip (verl 3.0), and a new random order of the
# batch for every epoch's mini-batches (verl: the same mini-batches every epoch)
MEGAPPO["gae1_trl"] = MEGAPPO["gae1"] + [
    "critic.cliprange_value=0.2", "critic.model.value_head_init_std=0.02", "actor_rollout_ref.actor.optim.weight_decay=0",
    "critic.optim.weight_decay=0", "actor_rollout_ref.actor.clip_ratio_c=1e9", "actor_rollout_ref.actor.shuffle=true"]
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
_BATCH = [o for o in MEGAPPO["gae_batch"] if not o.startswith("algorithm.gae_adv_norm")]
MEGAPPO["gae_group"] = _BATCH + ["algorithm.gae_adv_norm=group"]
MEGAPPO["gae_centred"] = _BATCH + ["algorithm.gae_adv_norm=group_centred", "algorithm.lam=1.0"]
# the critic fitted harder on each batch: 8 passes, Adam's second moment over ~20 steps instead of ~1000
# (benchmarks/critic_probe.py: per-token values are learnt from repeated passes, not from more steps)
MEGAPPO["gae_centred_fit"] = MEGAPPO["gae_centred"] + ["critic.ppo_epochs=8", "critic.optim.betas=[0.9,0.95]"]
# the critic's within-group correction weighted by a least-squares control-variate fit (0 = GRPO)
MEGAPPO["gae_cv"] = _BATCH + ["algorithm.gae_adv_norm=group_cv", "algorithm.lam=1.0"]
MEGAPPO["gae_cv_fit"] = MEGAPPO["gae_cv"] + ["critic.ppo_epochs=8", "critic.optim.betas=[0.9,0.95]"]
# the critic's values as running sums of per-token increments (critic.value_mode)
MEGAPPO["gae_inc"] = MEGAPPO["gae"] + ["critic.value_mode=increments"]
# how much of the fit the passes buy: the short second-moment memory alone, and 4 passes
MEGAPPO["gae_cv_b95"] = MEGAPPO["gae_cv"] + ["critic.optim.betas=[0.9,0.95]"]
MEGAPPO["gae_cv_fit4"] = MEGAPPO["gae_cv"] + ["critic.ppo_epochs=4", "critic.optim.betas=[0.9,0.95]"]
# one critic pass in smaller mini-batches: the optimizer steps of several passes at one pass's
# compute (critic.ppo_mini_batch_size 4 or 2 prompts: 8 or 16 critic steps per batch of 32 prompts)
MEGAPPO["gae_cmb4"] = MEGAPPO["gae_cv_b95"] + ["critic.ppo_mini_batch_size=4"]
MEGAPPO["gae_cmb2"] = MEGAPPO["gae_cv_b95"] + ["critic.ppo_mini_batch_size=2"]
# the critic also trains on the rows of its last 3 (1) batches: 4x (2x) its optimizer steps, on
# more data rather than the same batch again (critic.replay_batches)
MEGAPPO["gae_replay3"] = MEGAPPO["gae"] + ["critic.replay_batches=3"]
MEGAPPO["gae_replay1"] = MEGAPPO["gae"] + ["critic.replay_batches=1"]
# LoRA (rank 8, alpha 16) on gae's settings: the actor's base frozen, adapters at 3x the full
# fine-tuning lr (benchmarks/lora.py: on echo 3e-3 reached the target first of 1e-3 and 3e-3);
# all-linear, or attention only (q, k, v, o)
_LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
         "actor_rollout_ref.actor.optim.lr=3e-3"]
MEGAPPO["gae_lora"] = MEGAPPO["gae_batch"] + _LORA
MEGAPPO["gae_lora_attn"] = MEGAPPO["gae_lora"] + ["actor_rollout_ref.model.target_modules=q_proj,k_proj,v_proj,o_proj"]
MEGAPPO["grpo_lora"] = MEGAPPO["grpo"] + _LORA
SAMPLES_PER_STEP = {"gae_lora": 256, "gae_lora_attn": 256, "grpo_lora": 256, "gae": 256, "gae_batch": 256, "gae_group": 256, "gae_centred": 256, "gae_centred_fit": 256, "gae_cv": 256, "gae_cv_fit": 256, "gae_cv_b95": 256, "gae_cv_fit4": 256, "gae_cmb4": 256, "gae_cmb2": 256, "gae_inc": 256, "gae_replay3": 256, "gae_replay1": 256, "gae1": 32, "gae1_clip": 32, "gae1_trl": 32, "grpo": 256, "gspo": 256, "cispo": 256, "sapo": 256, "dapo": 256,
                    "grpo_is": 256}
TRL_BATCH = 32
# TRL's lr per task, tuned for TRL (see trl_ppo.py): 3e-4, and 1e-4 on echo; KL 0.01 in the reward.
# No multi-turn tasks: TRL's PPOTrainer has no tool rollouts.
TRL_ARGS = {task: ["--lr", "1e-4" if task == "echo" else "3e-4", "--kl-coef", "0.01"]
            for task in TASKS if not task.startswith("lookup")}


def _poll(proc: subprocess.Popen, out_file: Path, read, target: float, stop_at_target: bool) -> list[dict]:
    """Wait for ``proc``; with ``stop_at_target`` end it once its curve (``read()``) reaches the
    target (a 5-step running mean), which saves the rest of the budget's steps."""
    while proc.poll() is None:
        time.sleep(1.0)
        if stop_at_target and out_file.exists():
            try:
                curve = read()
            except (json.JSONDecodeError, KeyError):   # a line being written
                continue
            if summarise(curve, target, 10**12)["samples_to_target"] is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                return read()
    # a run that failed before its first step has no curve: its caller reports the log
    return read() if out_file.exists() else []


def megappo_curve(metrics_file: Path, per_step: int, per_round: int) -> list[dict]:
    rows = [json.loads(x) for x in metrics_file.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("step", 0) > 0 and "critic/score/mean" in r]
    curve, elapsed, samples = [], 0.0, 0
    for r in rows:
        elapsed += r.get("timing_s/step", 0.0)
        # dynamic sampling generates rounds until enough groups are kept: count what was generated
        samples += int(r["train/num_gen_batches"]) * per_round if "train/num_gen_batches" in r else per_step
        # the score of everything generated (dynamic sampling's critic/score/mean is of the kept groups)
        score = r.get("train/generated_score_mean", r["critic/score/mean"])
        curve.append({"step": r["step"], "samples": samples, "score": score, "seconds": elapsed,
                      "score_max": r.get("critic/score/max"),
                      "entropy": r.get("actor/entropy"),
                      # multi-turn: the share of the step's samples that called a tool (about: a sample may call twice)
                      "calls": r["tools/calls"] / per_step if "tools/calls" in r else None})
    return curve


def megappo_args(method: str, task: str, paths: dict, run_dir: Path, steps: int, seed: int, extra=()) -> list[str]:
    """The command line of one megappo run (``python -m megappo.train`` and its overrides)."""
    spec = TASKS[task]
    return [sys.executable, "-m", "megappo.train", "--config", "tiny_cpu", "trainer.n_gpus_per_node=1",
            f"actor_rollout_ref.model.path={paths['model']}", f"data.train_files=[{paths['train']}]",
            f"data.val_files=[{paths['test']}]", f"trainer.default_local_dir={run_dir}", "trainer.logger=[file]",
            "trainer.resume_mode=disable", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "trainer.save_freq=-1", f"trainer.total_training_steps={steps}", "trainer.total_epochs=1000",
            "data.max_prompt_length=16", f"data.max_response_length={spec['response']}", f"data.seed={seed}",
            "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048",
            "critic.ppo_max_token_len_per_gpu=2048", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=4096", *MEGAPPO[method],
            *trl_lr(method, task), *spec.get("extra", ()), *extra]


def trl_lr(method: str, task: str) -> list[str]:
    """At TRL's settings megappo takes the lr TRL runs the task with (TRL_ARGS: tuned for TRL, 1e-4
    on echo), for policy and value model alike (TRL's one optimizer); gae1_clip for the policy only."""
    if method not in ("gae1", "gae1_clip", "gae1_trl") or task not in TRL_ARGS:
        return []
    lr = TRL_ARGS[task][TRL_ARGS[task].index("--lr") + 1]
    return [f"actor_rollout_ref.actor.optim.lr={lr}"] + ([f"critic.optim.lr={lr}"] if method != "gae1_clip" else [])


def _single_threaded(env: dict) -> dict:
    """``env`` with torch's intra-op threads at 1 unless OMP_NUM_THREADS is set already. A process
    otherwise takes one thread per core, and on models this small OpenMP's fork and join around
    each tiny op costs more than the op (a `gae1` step on words on 2 cores, 2026-12-06, bit-identical
    runs either way: alone 1.52-1.76 s with 2 threads, 1.15-1.17 s with 1; two runs at a time 1.25 s
    and 1.16 s; runs of 256 samples a step round differently with the thread count). torchrun makes
    the same choice for its workers."""
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_megappo(method: str, task: str, paths: dict, out: Path, steps: int, seed: int, extra=(),
                stop_at_target: bool = True) -> list[dict]:
    run_dir = out / f"{task}_{method}_s{seed}"
    spec = TASKS[task]
    args = megappo_args(method, task, paths, run_dir, steps, seed, extra)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    # this checkout's megappo, whatever the venv's editable install points at (PYTHONPATH kept after it)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if x)
    _single_threaded(env)
    # samples per step from the overrides actually passed (--extra may change n or the batch)
    last = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if "=" in a}
    n = int(last["actor_rollout_ref.rollout.n"])
    per_step = n * int(last["data.train_batch_size"])
    per_round = n * int(last.get("data.gen_batch_size", last["data.train_batch_size"]))
    metrics = run_dir / "metrics.jsonl"
    t0 = time.time()
    log = open(out / f"{task}_{method}_s{seed}.log", "w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(out))
    curve = _poll(proc, metrics, lambda: megappo_curve(metrics, per_step, per_round), spec["target"], stop_at_target)
    log.close()
    if proc.returncode not in (0, -15) or (proc.returncode == -15 and not stop_at_target):
        tail = (out / f"{task}_{method}_s{seed}.log").read_text()[-3000:]
        raise RuntimeError(f"{task}/{method}/seed {seed} failed:\n{tail}")
    print(f"  {task}/{method}/seed {seed}: {len(curve)} steps in {time.time() - t0:.0f} s", flush=True)
    return curve


def warm_start(paths: dict, sft_steps: int, task: str = "pick_first") -> dict:
    """``paths`` with its model fine-tuned for ``sft_steps`` supervised steps on ``task``'s answer
    (a folder beside the random-init one, made once per setup)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from critic_probe import _fine_tuned   # here: critic_probe imports this module

    dst = Path(paths["model"]).parent / f"model_sft{sft_steps}"
    if not (dst / "config.json").exists():
        _fine_tuned(paths["model"], str(dst), paths["train"], sft_steps, task)
    return dict(paths, model=str(dst))


def trl_python() -> Path | None:
    py = Path(os.environ.get("TRL_VENV", ROOT / ".venv-trl")) / "bin" / "python"
    return py if py.exists() else None


def run_trl(task: str, paths: dict, out: Path, steps: int, seed: int, stop_at_target: bool = True) -> list[dict]:
    f = out / f"{task}_trl_s{seed}.jsonl"
    args = [str(trl_python()), str(ROOT / "benchmarks" / "trl_ppo.py"), "--model", paths["model"],
            "--train", paths["train"], "--task", TASKS[task].get("setup", task), "--steps", str(steps), "--batch-size", str(TRL_BATCH),
            "--max-new-tokens", str(TASKS[task]["response"]), "--seed", str(seed), "--out", str(f), "--trl-metrics",
            *TRL_ARGS[task]]
    env = _single_threaded(dict(os.environ, PYTHONPATH=str(ROOT / "src")))

    def read():
        rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        return [dict(r, entropy=r.get("policy/entropy_avg")) for r in rows]
    t0 = time.time()
    log = open(out / f"{task}_trl_s{seed}.log", "w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(out))
    curve = _poll(proc, f, read, TASKS[task]["target"], stop_at_target)
    log.close()
    if proc.returncode not in (0, -15):
        raise RuntimeError(f"{task}/trl/seed {seed} failed:\n{(out / f'{task}_trl_s{seed}.log').read_text()[-3000:]}")
    print(f"  {task}/trl/seed {seed}: {len(curve)} steps in {time.time() - t0:.0f} s", flush=True)
    return curve


def summarise(curve: list[dict], target: float, budget: int) -> dict:
    """Samples/seconds at the first step whose 5-step running mean reaches ``target``; the mean
    score of the last 5 steps within ``budget`` samples; whether the policy collapsed: its
    entropy fell below half its start while the score (5-step running mean) gained less than
    megappo.metrics.CollapseWatch asks (its start's size, or a quarter of the way to the best
    sample score seen when the curve has ``score_max``)."""
    hit = None
    for i in range(len(curve)):
        window = curve[max(0, i - 4):i + 1]
        if len(window) == 5 and sum(r["score"] for r in window) / 5 >= target:
            hit = curve[i]
            break
    within = [r for r in curve if r["samples"] <= budget][-5:]
    from megappo.metrics import CollapseWatch   # the trainer's own rule, so the two cannot drift apart

    watch = CollapseWatch()
    collapsed = any(watch.update({"actor/entropy": r.get("entropy"), "critic/score/mean": r["score"],
                                  "critic/score/max": r.get("score_max")}) for r in curve)
    # the window's step-to-step spread: how far the 5-step mean moves with the draws alone
    se = statistics.stdev(r["score"] for r in within) / math.sqrt(len(within)) if len(within) > 1 else None
    return {"samples_to_target": hit["samples"] if hit else None,
            "seconds_to_target": round(hit["seconds"], 1) if hit else None,
            "score_at_budget": round(sum(r["score"] for r in within) / len(within), 4) if within else None,
            "score_at_budget_se": round(se, 4) if se is not None else None,
            "collapsed": collapsed}


def compare(mine: list[dict], theirs: list[dict]) -> tuple[bool, str]:
    """Whether one method's seeds (summarise's dicts) need no more samples to the target than
    another's, medians over seeds (a seed that never reaches it counts as infinite); when neither
    median reaches it, the median score at the budget decides (higher or equal is ok). The verdict
    is the rule's; the line also says when the gap is under two standard errors of the difference
    (each median's run's window spread, summarise's ``score_at_budget_se``), which at chance level
    is the whole gap: the rule then reports the draws, not the methods."""
    a, b = (median_spread([r["samples_to_target"] for r in rs])[0] for rs in (mine, theirs))
    if a is None and b is None:
        sa, sb = (statistics.median(r["score_at_budget"] or 0.0 for r in rs) for rs in (mine, theirs))
        line = f"and neither reaches the target; median score at the budget {sa:.3f} vs {sb:.3f}"
        se = gap_se(mine, theirs)
        if se is not None and abs(sa - sb) < 2 * se:
            line += f" (a gap under 2 standard errors, {2 * se:.3f}: noise)"
        return sa >= sb, line + " for"
    return a is not None and (b is None or a <= b), f"needs {a} samples (median), {b} for"


def gap_se(mine: list[dict], theirs: list[dict]) -> float | None:
    """The standard error of the difference of the two median scores at the budget, each taken
    as the standard error of the run whose score is the median (the middle seed's; for an even
    count the larger of the two middle runs'); None when a run has none."""
    def median_run_se(rs):
        order = sorted(rs, key=lambda r: r["score_at_budget"] or 0.0)
        mid = order[(len(order) - 1) // 2:len(order) // 2 + 1]
        ses = [r.get("score_at_budget_se") for r in mid]
        return None if any(x is None for x in ses) else max(ses)
    a, b = median_run_se(mine), median_run_se(theirs)
    return None if a is None or b is None else math.sqrt(a * a + b * b)


def paired(mine: list[dict], theirs: list[dict]) -> dict:
    """Seed by seed (the lists in the same seed order): how often one method is ahead of, level
    with or behind another (fewer samples to the target; a miss is infinite; when both miss, the
    higher score at the budget), and the two-sided sign test's p-value of the wins against the
    losses (ties dropped). A median of three seeds moves with one seed's draws: this says whether
    a difference is more than that."""
    def key(r):   # smaller is better
        n = r["samples_to_target"]
        return (0, n) if n is not None else (1, -(r["score_at_budget"] or 0.0))
    ahead = sum(key(a) < key(b) for a, b in zip(mine, theirs))
    behind = sum(key(a) > key(b) for a, b in zip(mine, theirs))
    level = min(len(mine), len(theirs)) - ahead - behind
    n, k = ahead + behind, min(ahead, behind)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0
    return {"ahead": ahead, "level": level, "behind": behind, "sign_test_p": round(p, 4)}


def median_spread(values: list) -> tuple:
    """(median, min, max) of samples-to-target over seeds; a seed that never reached the target
    counts as infinite (so the median is None when most seeds missed it)."""
    v = sorted(float("inf") if x is None else x for x in values)
    med = v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
    fix = lambda x: None if x == float("inf") else int(x)  # noqa: E731
    return fix(med), fix(v[0]), fix(v[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                    help=f"comma-separated, of {', '.join(TASKS)} (default: {', '.join(DEFAULT_TASKS)})")
    ap.add_argument("--methods", default="gae,grpo,gae1,trl")
    ap.add_argument("--quick", action="store_true", help="3 steps per run, one seed: checks the harness, measures nothing")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (task data and model init, sampling)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (each is one single-threaded process)")
    ap.add_argument("--full-budget", action="store_true",
                    help="run every method to the whole sample budget (default: stop a run once it reaches the target)")
    ap.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE",
                    help="an override added to every megappo run (to try a setting)")
    args = ap.parse_args(argv)
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from megappo.data.tiny import make_tiny_setup

    out = Path(args.out or tempfile.mkdtemp(prefix="megappo-learning-"))
    out.mkdir(parents=True, exist_ok=True)
    tasks, methods = args.tasks.split(","), args.methods.split(",")
    seeds = [int(x) for x in args.seeds.split(",")][:1 if args.quick else None]
    if "trl" in methods and trl_python() is None and not args.quick:
        # TRL lives in a venv of its own (never in megappo's dependencies)
        print("  installing TRL 1.12 into its own venv: bash benchmarks/setup_trl.sh", flush=True)
        subprocess.run(["bash", str(ROOT / "benchmarks" / "setup_trl.sh")], check=False)
    jobs, paths = [], {}
    for task in tasks:
        for seed in seeds:
            setup = TASKS[task].get("setup", task)
            paths[task, seed] = make_tiny_setup(str(out / f"setup_{setup}_s{seed}"), task=setup, n_train=8192, seed=seed)
            if TASKS[task].get("warm_sft_steps"):
                paths[task, seed] = warm_start(paths[task, seed], TASKS[task]["warm_sft_steps"], setup)
        for method in methods:
            if method == "trl" and task.startswith("lookup"):
                print(f"  {task}/trl: skipped: TRL's PPOTrainer has no multi-turn tool rollouts", flush=True)
                continue
            if method == "trl" and trl_python() is None:
                print(f"  {task}/trl: skipped: no TRL venv (bash benchmarks/setup_trl.sh)", flush=True)
                continue
            jobs += [(task, method, seed) for seed in seeds]

    def run(job):
        task, method, seed = job
        spec, stop = TASKS[task], not args.full_budget
        if method == "trl":
            return run_trl(task, paths[task, seed], out, 3 if args.quick else spec["budget"] // TRL_BATCH, seed, stop)
        steps = 3 if args.quick else spec["budget"] // SAMPLES_PER_STEP[method]
        return run_megappo(method, task, paths[task, seed], out, steps, seed, args.extra, stop)

    t0 = time.time()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        curves = dict(zip(jobs, pool.map(run, jobs)))
    wall = time.time() - t0

    print(f"\n{'run':<22} {'samples':>8} {'score':>6} {'entropy':>8}   (every ~10% of the run)")
    for (task, method, seed), curve in curves.items():
        stride = max(1, len(curve) // 10)
        for r in curve[stride - 1::stride]:
            e = r.get("entropy")
            print(f"{task}/{method}/s{seed:<8} {r['samples']:>8} {r['score']:>6.3f} {'' if e is None else f'{e:8.2f}'}")
    results, flat = {}, {"wall_s": round(wall, 1)}
    for (task, method, seed), curve in curves.items():
        results.setdefault((task, method), []).append(summarise(curve, TASKS[task]["target"], TASKS[task]["budget"]))
    print(f"\n{'task/method':<18} {'target':>6} {'samples to target: median [min, max]':>38} {'collapsed':>10}")
    for (task, method), rs in results.items():
        med, lo, hi = median_spread([r["samples_to_target"] for r in rs])
        n_coll = sum(r["collapsed"] for r in rs)
        print(f"{task + '/' + method:<18} {TASKS[task]['target']:>6} {str(med):>18} [{lo}, {hi}]{'':>6} {n_coll}/{len(rs)}")
        flat[f"{task}_{method}_samples_to_target_median"] = med
        flat[f"{task}_{method}_samples_to_target_per_seed"] = [r["samples_to_target"] for r in rs]
        flat[f"{task}_{method}_collapsed_runs"] = n_coll
        flat[f"{task}_{method}_score_at_budget_per_seed"] = [r["score_at_budget"] for r in rs]
        flat[f"{task}_{method}_score_at_budget_se_per_seed"] = [r["score_at_budget_se"] for r in rs]
    # megappo's PPO with a critic against its own GRPO (same settings) and TRL's PPO (TRL's settings)
    print()
    for task in (t for t in tasks if t != "lookup_notools"):   # that one reaches no target by construction
        for ppo, other in (("gae", "grpo"), ("gae1", "trl"), ("gae1_trl", "trl")):
            if (task, ppo) in results and (task, other) in results:
                ok, line = compare(results[task, ppo], results[task, other])
                pair = paired(results[task, ppo], results[task, other])
                flat[f"{task}_{ppo}_le_{other}"] = ok
                flat[f"{task}_{ppo}_vs_{other}_paired"] = pair
                print(f"{task}: megappo {ppo} {line} {other}: {'ok' if ok else 'NOT ok'}; by seed ahead on "
                      f"{pair['ahead']}, level on {pair['level']}, behind on {pair['behind']} "
                      f"(sign test p = {pair['sign_test_p']})")
    for method in methods:   # the tool is needed: the same run without it
        if ("lookup", method) in results and ("lookup_notools", method) in results:
            best = max((r["score"] for (t, m, _), c in curves.items() if (t, m) == ("lookup_notools", method)
                        for r in c), default=None)
            flat[f"lookup_notools_{method}_best_score"] = best
            calls = [(c[0]["calls"], c[-1]["calls"]) for (t, m, _), c in curves.items() if (t, m) == ("lookup", method)]
            flat[f"lookup_{method}_calls_per_sample_first_last_step"] = calls
            print(f"lookup/{method}: with the tool {flat[f'lookup_{method}_samples_to_target_median']} samples to "
                  f"{TASKS['lookup']['target']} (median); without it the best step scored {best}")
    print(f"\nwhole benchmark: {wall / 60:.1f} min")
    print(json.dumps(flat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
