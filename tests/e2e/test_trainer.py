"""The trainer end to end on CPU: the README's main job (torchrun, DP2), and GRPO with both KL
forms; metrics land in metrics.jsonl with verl's names."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))

REQUIRED = ["critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "critic/returns/mean",
            "response_length/mean", "response_length/clip_ratio", "prompt_length/mean", "actor/pg_loss",
            "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
            "training/rollout_probs_diff_max", "timing_s/gen", "timing_s/step", "perf/throughput"]


def read_metrics(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


MAIN_JOB = REQUIRED + [
    "actor/kl_loss", "critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var", "critic/grad_norm",
    "critic/score/max", "critic/score/min", "critic/rewards/max", "critic/rewards/min", "critic/advantages/max",
    "critic/advantages/min", "critic/returns/max", "critic/returns/min", "critic/values/mean", "critic/values/max",
    "critic/values/min", "critic/values/std", "critic/returns/std", "critic/advantages_returns_corr",
    "critic/advantages/cv_beta_fit", "critic/advantages/cv_share", "critic/advantages/cv_gain", "critic/advantages/cv_t",
    "response_length/max", "prompt_length/max", "prompt_length/min",
    "timing_s/reward", "timing_s/old_log_prob", "timing_s/values", "timing_s/adv", "timing_s/update_critic",
    "timing_s/update_actor", "timing_s/sync", "perf/max_memory_allocated_gb"]
VAL = "val-core/synthetic/echo/reward/mean@1"


@pytest.mark.e2e
def test_tiny_cpu_main_job(tmp_path):
    """The README's main job as shipped: TP2PP2 on 4 processes, PPO with GAE and a critic."""
    import time

    out = tmp_path / "tiny"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    t0 = time.time()
    p = subprocess.run(["bash", str(REPO / "launch" / "tiny_cpu.sh")], capture_output=True, text=True,
                       timeout=1200, env=env, cwd=str(tmp_path))
    print(f"main job wall time: {time.time() - t0:.0f} s")  # the budget is 10 minutes
    assert p.returncode == 0, p.stderr[-4000:]
    assert "TP=2 PP=2 DP=1" in p.stdout
    rows = read_metrics(out / "run")
    train = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in train] == list(range(1, 61))
    for key in MAIN_JOB:
        assert all(key in r and math.isfinite(r[key]) for r in train), key
    score = [r["critic/score/mean"] for r in train]
    assert sum(score[:3]) / 3 < 0.2, score[:3]           # near chance: ~1/128 tokens is right
    assert sum(score[-5:]) / 5 >= 0.8, score[-5:]
    # The value head starts at zero: at step 1 every value is 0 and explains none of the returns'
    # variance. A random head of std 1/sqrt(hidden) gave values of std ~1 against returns of std
    # ~0.1: the actor then followed the critic's noise. With gae's defaults at n > 1
    # (group_cv) a critic that knows nothing adds nothing: step 1's advantage is GRPO's exactly
    # (its within-group correction weighted 0, nothing on groups that all scored alike), and the
    # critic's per-token correction enters once it explains part of the outcome.
    first = train[0]
    assert first["critic/values/max"] == first["critic/values/min"] == 0.0, first
    assert first["critic/advantages/cv_beta"] == 0.0 and first["critic/advantages/equal_score_share"] == 0.0, first
    assert first["critic/advantages/cv_share"] == 0.0, first   # values all 0 carry none of the outcome
    assert first["critic/advantages/cv_gain"] == 0.0, first    # and remove none of GRPO's variance
    assert max(r["critic/advantages/cv_beta"] for r in train) > 0.5, [r["critic/advantages/cv_beta"] for r in train]
    # the gate (algorithm.gae_cv_min_t 3): no weight on a fit whose t-statistic is below 3
    gated = [(r["step"], r["critic/advantages/cv_t"], r["critic/advantages/cv_beta"]) for r in train]
    assert all(b == 0.0 for _, t, b in gated if t < 3.0) and any(b > 0.0 for _, t, b in gated), gated
    var_r = first["critic/returns/std"] ** 2   # verl's formula has +1e-5 in the denominator
    assert first["critic/vf_explained_var"] == pytest.approx(1 - var_r / (var_r + 1e-5), abs=1e-6), first
    ev = [r["critic/vf_explained_var"] for r in train]
    best = max(sum(ev[i:i + 5]) / 5 for i in range(len(ev) - 4))
    # then the critic learns to predict the return while the policy learns (it falls back
    # towards 0 once every response is right and the returns have no variance left)
    assert best > 0.3, ev
    # Sturdier than the window above (which reads 0.48 on the job as shipped, 0.31-0.32 with
    # gae_cv_beta_max 1): the critic's mean value follows the policy's mean score as it climbs from
    # 0.03 to ~0.96. Measured over data.seed 1-7 (2026-12-06): a mean gap of 0.029-0.050 over steps
    # 11-60 (with gae_cv_beta_max 3: 0.024-0.052); a critic that does
    # not learn (values stuck at the zero head's 0) would leave a gap of the mean score, 0.6-0.75.
    gap = [abs(r["critic/values/mean"] - r["critic/score/mean"]) for r in train[10:]]
    assert sum(gap) / len(gap) < 0.1, gap
    assert max(r["training/rollout_probs_diff_max"] for r in train) < 1e-3
    val = {r["step"]: r[VAL] for r in rows if VAL in r}
    assert sorted(val) == [0, 10, 20, 30, 40, 50, 60] and val[60] > val[0]
    assert (out / "run" / "latest").read_text() == "60"
    assert sorted(d for d in os.listdir(out / "run") if d.startswith("global_step_")) == [
        "global_step_30", "global_step_60"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(out / "run" / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert set(MAIN_JOB + [VAL]) <= tags, sorted(set(MAIN_JOB + [VAL]) - tags)
    assert len(ea.Scalars("critic/score/mean")) == 60
    assert "step [60/60]" in p.stdout
    # the console: one line per step; vLLM's per-step INFO lines (weight reloads, prefix-cache
    # resets) are hidden at the default trainer.log_level=warning
    after = (p.stdout + p.stderr).split("step [1/60]", 1)[1]
    assert " INFO " not in after, [line for line in after.splitlines() if " INFO " in line][:5]


def _grpo_worker(rank, world, model, train, test, run_dir):
    from megappo.config import load_config, validate
    from megappo.trainer import PPOTrainer, init_distributed

    cfg = load_config([f"actor_rollout_ref.model.path={model}", f"data.train_files=[{train}]",
                       f"data.val_files=[{test}]", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
                       "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true",
                       "algorithm.kl_ctrl.type=adaptive", "trainer.logger=[file]", f"trainer.default_local_dir={run_dir}",
                       "data.max_response_length=6", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                       "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "actor_rollout_ref.rollout.val_kwargs.n=2",
                       f"trainer.rollout_data_dir={run_dir}/rollouts", f"trainer.validation_data_dir={run_dir}/val",
                       # verl's batch reward manager: the echo reward, one call per batch, with an argument
                       f"custom_reward_function.path={Path(run_dir).parent / 'judge.py'}",
                       "custom_reward_function.name=judge", "reward_model.reward_manager=batch",
                       "custom_reward_function.reward_kwargs.scale=1.0"],
                      ["tiny_cpu"])
    validate(cfg, check_paths=True, world_size=world)
    init_distributed(cfg)
    trainer = PPOTrainer(cfg)
    trainer.fit(3)
    if rank == 0:   # what the dump says of validation at step 3, before the calls below rewrite it
        import shutil

        shutil.copy(f"{run_dir}/val/3.jsonl", f"{run_dir}/val_step3.jsonl")
    # data.val_batch_size splits validation into several generate calls; sampled validation
    # gives the same scores (seeds follow each prompt's place in the whole set)
    whole = trainer.validate()
    cfg.data.val_batch_size = 7
    assert trainer.validate() == whole, whole
    from megappo.rollout import SamplingConfig

    sampling = SamplingConfig.from_config(cfg.actor_rollout_ref.rollout, 6, validation=True)
    items = [trainer.val_data[i] for i in range(20)]
    gen, step = trainer.generation, trainer.step_no
    one, _ = gen.rollout(items, sampling, step, salt=1)
    parts = [gen.rollout(items[lo:lo + 7], sampling, step, salt=1, offset=lo)[0] for lo in range(0, 20, 7)]
    got = torch.cat([torch.nn.functional.pad(p.responses, (0, one.responses.shape[1] - p.responses.shape[1]))
                     for p in parts])
    assert torch.equal(got, one.responses)   # the same samples, drawn in three calls
    again, _ = gen.rollout(items, sampling, step, salt=2)
    assert not torch.equal(again.responses, one.responses)   # (sampling is really on)


@pytest.mark.e2e
def test_grpo_with_kl_loss_and_kl_in_reward(tmp_path):
    from harness import spawn

    from megappo.data.tiny import make_tiny_setup

    p = make_tiny_setup(str(tmp_path / "tiny"))
    (tmp_path / "judge.py").write_text(
        "from megappo.rewards import get_reward_fn\n"
        "def judge(data_sources, solution_strs, ground_truths, extra_infos, scale):\n"
        "    return [{'score': scale * get_reward_fn(d)(s, g, e), 'batch': len(solution_strs)}\n"
        "            for d, s, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos)]\n")
    spawn(_grpo_worker, 2, p["model"], p["train"], p["test"], str(tmp_path / "run"))
    rows = read_metrics(tmp_path / "run")
    val2 = VAL.replace("@1", "@2")
    assert rows[0] == {"step": 0, val2: rows[0][val2], val2.replace("mean", "best"): rows[0][val2.replace("mean", "best")]}
    rows = rows[1:]
    assert len(rows) == 3
    for key in REQUIRED + ["actor/kl_loss", "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"]:
        assert key in rows[-1] and math.isfinite(rows[-1][key]), key
    assert "critic/vf_loss" not in rows[-1]  # GRPO builds no critic
    # at step 1 the rollout policy is the reference: no KL in the reward; later the policy moved
    assert rows[0]["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    assert rows[-1]["actor/reward_kl_penalty"] > 0 and rows[-1]["actor/kl_loss"] > 0
    assert rows[1]["actor/reward_kl_penalty_coeff"] != rows[0]["actor/reward_kl_penalty_coeff"]  # adaptive
    # trainer.rollout_data_dir / validation_data_dir: every sample as verl dumps it, each score the
    # reward function's on the dumped output and ground truth, their mean the logged metric
    from megappo.rewards import get_reward_fn

    def dumped(path):
        recs = [json.loads(line) for line in open(path)]
        for r in recs:
            assert list(r)[:5] == ["input", "output", "gts", "score", "step"], list(r)
            assert r["score"] == pytest.approx(get_reward_fn("synthetic/echo")(r["output"], r["gts"]))
        return recs

    assert sorted(os.listdir(tmp_path / "run" / "rollouts")) == ["1.jsonl", "2.jsonl", "3.jsonl"]
    for step, row in zip((1, 2, 3), rows):
        recs = dumped(tmp_path / "run" / "rollouts" / f"{step}.jsonl")
        assert len(recs) == 8 * 4 and {r["step"] for r in recs} == {step}
        assert {r["batch"] for r in recs} == {8 * 4}        # the batch function saw the step's whole batch
        assert sum(r["score"] for r in recs) / len(recs) == pytest.approx(row["critic/score/mean"], abs=1e-6)
        assert all(r["input"].startswith("echo") for r in recs)
    first = read_metrics(tmp_path / "run")[0]
    for step, path, metrics in ((0, tmp_path / "run" / "val" / "0.jsonl", first),
                                (3, tmp_path / "run" / "val_step3.jsonl", rows[-1])):
        recs = dumped(path)
        assert {r["step"] for r in recs} == {step}
        assert sum(r["score"] for r in recs) / len(recs) == pytest.approx(metrics[val2], abs=1e-6)


def _rm_worker(rank, world, model, rm, train, run_dir):
    from megappo.config import load_config, validate
    from megappo.trainer import PPOTrainer, init_distributed

    cfg = load_config([f"actor_rollout_ref.model.path={model}", f"data.train_files=[{train}]", "data.val_files=[]",
                       "reward_model.enable=true", f"reward_model.model.path={rm}", "algorithm.adv_estimator=grpo",
                       "actor_rollout_ref.rollout.n=4", "trainer.logger=[file]", f"trainer.default_local_dir={run_dir}",
                       "trainer.save_freq=-1", "trainer.test_freq=-1", "reward_model.model.use_remove_padding=true"],
                      ["tiny_cpu"])
    validate(cfg, check_paths=True, world_size=world)
    init_distributed(cfg)
    trainer = PPOTrainer(cfg)
    assert trainer.reward_model.pack_sequences and not trainer.actor.pack_sequences
    trainer.fit(2)


@pytest.mark.e2e
def test_reward_model_replaces_the_rule_reward(tmp_path):
    """reward_model.enable: every response is scored by the model, on packed micro-batches
    (reward_model.model.use_remove_padding; the scores' numbers against transformers':
    tests/distributed/test_reward_model.py). The head is set to a constant (zero weight, bias
    0.75), so every score must be exactly 0.75 -- the echo rule would give 0/1."""
    import torch
    from harness import spawn
    from transformers import AutoConfig, AutoModelForTokenClassification

    from megappo.data.tiny import make_tiny_setup

    p = make_tiny_setup(str(tmp_path / "tiny"))
    cfg = AutoConfig.from_pretrained(p["model"], num_labels=1)
    cfg.architectures = ["Qwen3ForTokenClassification"]
    rm = AutoModelForTokenClassification.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        rm.score.weight.zero_()
        rm.score.bias.fill_(0.75)
    rm.save_pretrained(str(tmp_path / "rm"), safe_serialization=True)
    spawn(_rm_worker, 2, p["model"], str(tmp_path / "rm"), p["train"], str(tmp_path / "run"))
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2
    for r in rows:
        assert r["critic/score/mean"] == pytest.approx(0.75) and r["critic/score/min"] == pytest.approx(0.75)
        assert r["critic/score/max"] == pytest.approx(0.75) and "timing_s/reward" in r


def _nan_rm_worker(rank, world, model, rm, train, run_dir):
    from megappo.config import load_config, validate
    from megappo.trainer import PPOTrainer, init_distributed

    cfg = load_config([f"actor_rollout_ref.model.path={model}", f"data.train_files=[{train}]", "data.val_files=[]",
                       "reward_model.enable=true", f"reward_model.model.path={rm}", "trainer.logger=[file]",
                       f"trainer.default_local_dir={run_dir}", "trainer.save_freq=1", "trainer.test_freq=-1"],
                      ["tiny_cpu"])
    validate(cfg, check_paths=True, world_size=world)
    init_distributed(cfg)
    PPOTrainer(cfg).fit(2)


@pytest.mark.e2e
def test_nan_reward_stops_the_run_before_any_checkpoint(tmp_path):
    """A reward model that outputs NaN: the run stops at step 1, stage reward, on every rank,
    with no metrics line and no checkpoint written (save_freq=1)."""
    import torch
    from harness import spawn
    from transformers import AutoConfig, AutoModelForTokenClassification

    from megappo.data.tiny import make_tiny_setup

    p = make_tiny_setup(str(tmp_path / "tiny"))
    cfg = AutoConfig.from_pretrained(p["model"], num_labels=1)
    cfg.architectures = ["Qwen3ForTokenClassification"]
    rm = AutoModelForTokenClassification.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        rm.score.bias.fill_(float("nan"))
    rm.save_pretrained(str(tmp_path / "rm"), safe_serialization=True)
    run = tmp_path / "run"
    with pytest.raises(Exception) as e:
        spawn(_nan_rm_worker, 2, p["model"], str(tmp_path / "rm"), p["train"], str(run))
    assert "FloatingPointError: step 1, stage reward: non-finite scores; stopping before anything is saved" in str(e.value)
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip()
    assert not any(d.name.startswith(("global_step_", ".tmp_global_step_", "latest")) for d in run.iterdir())


def _exploding_worker(rank, world, model, train, run_dir):
    from megappo.config import load_config, validate
    from megappo.trainer import PPOTrainer, init_distributed

    # A learning rate that sends the actor's weights to inf within step 1's update while every
    # loss it logs is still finite (they are computed before the last optimizer step): without
    # the weight check this state was synced and checkpointed (save_freq=1), and only step 2's
    # old log-probs showed the NaN.
    cfg = load_config([f"actor_rollout_ref.model.path={model}", f"data.train_files=[{train}]", "data.val_files=[]",
                       "actor_rollout_ref.actor.optim.lr=1e30", "actor_rollout_ref.actor.optim.clip_grad=1e30",
                       "algorithm.adv_estimator=grpo",
                       "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.optim.betas=[0.0,0.0]",
                       "trainer.logger=[file]", f"trainer.default_local_dir={run_dir}", "trainer.save_freq=1",
                       "trainer.test_freq=-1"], ["tiny_cpu"])
    validate(cfg, check_paths=True, world_size=world)
    init_distributed(cfg)
    PPOTrainer(cfg).fit(2)


@pytest.mark.e2e
def test_inf_weights_stop_the_run_at_the_update_stage_before_any_checkpoint(tmp_path):
    from harness import spawn

    from megappo.data.tiny import make_tiny_setup

    p = make_tiny_setup(str(tmp_path / "tiny"))
    run = tmp_path / "run"
    with pytest.raises(Exception) as e:
        spawn(_exploding_worker, 2, p["model"], p["train"], str(run))
    assert "FloatingPointError: step 1, stage update_actor: non-finite actor_weights; stopping before anything is saved" \
        in str(e.value), str(e.value)[-2000:]
    assert not any(d.name.startswith(("global_step_", "latest")) for d in run.iterdir())


def _checked_worker(rank, world, model, train, test, run_dir):
    os.environ["MEGAPPO_CHECK_DEVICES"] = "1"
    from megappo.config import load_config, validate
    from megappo.trainer import PPOTrainer, init_distributed

    m = "actor_rollout_ref.actor.megatron."
    budget = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64",
              "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=64",
              "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
              "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=64"]
    cfg = load_config([f"actor_rollout_ref.model.path={model}", f"data.train_files=[{train}]",
                       f"data.val_files=[{test}]", "trainer.n_gpus_per_node=4", f"{m}tensor_model_parallel_size=2",
                       f"{m}pipeline_model_parallel_size=2", f"{m}virtual_pipeline_model_parallel_size=2",
                       f"{m}sequence_parallel=true", "actor_rollout_ref.actor.use_kl_loss=true",
                       "algorithm.use_kl_in_reward=true", "data.max_prompt_length=16", "data.max_response_length=6",
                       "trainer.logger=[file]", f"trainer.default_local_dir={run_dir}", "trainer.save_freq=2",
                       "trainer.test_freq=2",
                       # the device-side pieces of the policy losses: Clip-Cov's mini-batch selection (a forward
                       # pass and DP collectives in the worker), rollout IS weights and rejection
                       "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
                       "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.05",
                       "algorithm.rollout_correction.rollout_is=token",
                       "algorithm.rollout_correction.rollout_rs=token_k3",
                       "algorithm.rollout_correction.rollout_rs_threshold=0.5"] + budget, ["tiny_cpu"])
    validate(cfg, check_paths=True, world_size=world)
    device = init_distributed(cfg)
    assert device.type == "cuda" and device.index == rank  # the simulated GPU of this rank
    trainer = PPOTrainer(cfg)
    assert trainer.actor.device == device and trainer.critic.device == device and trainer.ref.device == device
    trainer.fit(2)


@pytest.mark.e2e
def test_gpu_discipline_on_cpu_32b_layout(tmp_path):
    """The whole step (rollout, old/ref log-probs, values, KL in reward, GAE, critic and actor
    updates, weight sync, validation, checkpoint) under the CPU device check, on the 32B recipe's
    layout shrunk to 4 processes: TP2 x PP2 x VPP2 with sequence parallelism and token-budget
    micro-batches. A batch left on the host, a CPU tensor on a (GPU: NCCL) group or a weight
    left on the CPU fails this test as it would fail the first GPU step."""
    from harness import spawn

    from megappo.data.tiny import make_tiny_setup

    p = make_tiny_setup(str(tmp_path / "tiny"))
    spawn(_checked_worker, 4, p["model"], p["train"], p["test"], str(tmp_path / "run"))
    rows = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    for key in MAIN_JOB + ["actor/kl_loss", "actor/reward_kl_penalty"]:
        assert all(key in r and math.isfinite(r[key]) for r in rows), key
    # the engine got the simulated GPU's weights: its log-probs are the actor's
    assert max(r["training/rollout_probs_diff_max"] for r in rows) < 1e-4
    assert (tmp_path / "run" / "latest").read_text() == "2"
