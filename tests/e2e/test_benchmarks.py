"""Benchmarks keep running and keep their output contract (figures are printed, never asserted)."""
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def quick_figures(script: str, timeout: int) -> dict:
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--quick"], capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
def test_kernels_benchmark_quick_ends_with_json():
    figures = quick_figures("kernels.py", 600)
    for key in ("gae_speedup", "gae_max_rel_diff", "logprob_parallel_s", "logprob_parallel_entropy_metric_s",
                "logprob_naive_peak_rss_mib"):
        assert key in figures
    # correctness is asserted (speed is not): the fast paths agree with their references
    assert figures["gae_max_rel_diff"] < 1e-5
    assert figures["logprob_max_abs_diff"] < 1e-10


@pytest.mark.e2e
def test_rollout_benchmark_quick_ends_with_json():
    figures = quick_figures("rollout.py", 900)
    for key in ("wrapper_vs_raw", "gen_vs_hf", "sync_s_tiny", "sync_s_100m", "sync_gbps_100m", "sync_vs_engine_reload"):
        assert figures[key] > 0


@pytest.mark.e2e
def test_gpu_step_benchmark_quick_on_cpu_under_the_device_check():
    """benchmarks/gpu_step.py --quick on CPU with a simulated cuda:0 (MEGAPPO_CHECK_DEVICES=1): the
    benchmark's own code keeps the GPU's device discipline before it runs on a GPU box."""
    import os

    env = {**os.environ, "MEGAPPO_CHECK_DEVICES": "1", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_step.py"), "--quick"], capture_output=True,
                       text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    figures = json.loads(p.stdout.strip().splitlines()[-1])
    assert figures["device_name"] == "cpu (device check: simulated cuda:0)"
    for key in ("step_time_s", "tokens_per_s", "update_policy_s", "update_critic_s", "compute_log_prob_s"):
        assert figures[key] > 0
    assert figures["logprob_parity_max_abs_diff"] < 1e-4  # float32 on CPU


@pytest.fixture(scope="module")
def gae_quick(tmp_path_factory):
    """One benchmarks/learning.py --quick run (echo, gae, 3 steps, a checkpoint at 3): its output
    and folder, read by the learning harness's test and pg_variance's."""
    out = tmp_path_factory.mktemp("learning")
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "learning.py"), "--quick", "--tasks", "echo",
                        "--methods", "gae", "--out", str(out), "--extra", "trainer.save_freq=3"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout, out


@pytest.mark.e2e
def test_learning_benchmark_quick_ends_with_json(gae_quick):
    """benchmarks/learning.py's harness (one megappo run, 3 steps): curves parsed, summary keys."""
    stdout, _ = gae_quick
    figures = json.loads(stdout.strip().splitlines()[-1])
    assert set(figures) == {"wall_s", "echo_gae_samples_to_target_median", "echo_gae_samples_to_target_per_seed",
                            "echo_gae_collapsed_runs", "echo_gae_score_at_budget_per_seed",
                            "echo_gae_score_at_budget_se_per_seed"}
    assert figures["echo_gae_samples_to_target_per_seed"] == [None]   # 3 steps reach no target
    assert figures["echo_gae_collapsed_runs"] == 0
    rows = [ln.split() for ln in stdout.splitlines() if ln.startswith("echo/gae/s0")]
    assert len(rows) == 3 and all(0.0 <= float(r[2]) <= 1.0 and float(r[3]) > 0 for r in rows)  # score, entropy
    # all 3 steps lie within the budget: the score at budget is their mean (printed to 3 places)
    assert figures["echo_gae_score_at_budget_per_seed"][0] == pytest.approx(
        sum(float(r[2]) for r in rows) / 3, abs=1e-3)
    # and its standard error is the 3 steps' spread / sqrt(3) (scores printed to 3 places)
    sd = statistics.stdev(float(r[2]) for r in rows)
    assert figures["echo_gae_score_at_budget_se_per_seed"][0] == pytest.approx(sd / math.sqrt(3), abs=2e-3)


@pytest.mark.e2e
def test_pg_variance_reads_a_gae_runs_checkpoint(gae_quick):
    """benchmarks/pg_variance.py on a 3-step gae run's checkpoint: actor and critic exported, the
    run's beta read from its metrics, and the variance figures consistent with it."""
    _, out = gae_quick
    run = out / "echo_gae_s0"
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "pg_variance.py"), "--run", str(run), "--setup",
                        str(out / "setup_echo_s0"), "--task", "echo", "--steps", "3", "--batches", "4",
                        "--prompts", "4", "--oracle"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    (row,) = json.loads(p.stdout.strip().splitlines()[-1])["rows"]
    assert (run / "hf" / "step3_actor" / "config.json").exists() and (run / "hf" / "step3_critic" / "config.json").exists()
    step3 = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert step3["step"] == 3 and row["run_beta"] == step3["critic/advantages/cv_beta"]
    assert row["step"] == 3 and 0.0 <= row["score"] <= 1.0
    assert all(isinstance(row[k], float) and row[k] == row[k] for k in ("critic_V_ratio_at_1", "oracle_V_ratio_at_1",
                                                                         "critic_beta_star", "snr_grpo"))
    if row["run_beta"] == 0.0:      # GRPO's advantage exactly: nothing removed, by either measure
        assert row["critic_V_ratio_at_run_beta"] == 1.0 and row["token_ratio_at_run_beta"] == 1.0
    assert "| step |" in p.stdout


@pytest.mark.e2e
def test_lora_benchmark_quick_ends_with_json(tmp_path):
    """benchmarks/lora.py --quick (full fine-tuning and LoRA, 3 steps each): the sync bytes it
    reports are the whole model's and the adapters' (computed here from the model's config)."""
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "lora.py"), "--quick", "--methods", "gae_batch,gae_lora",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    figures = json.loads(p.stdout.strip().splitlines()[-1])
    c = json.loads((tmp_path / "setup_s0" / "model" / "config.json").read_text())
    h, f, L, hd = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = [(q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f)]
    full = 4 * (L * (sum(o * i for o, i in shapes) + 2 * h + 2 * hd) + 2 * c["vocab_size"] * h + h)
    assert figures["gae_batch_sync_bytes"] == full
    assert figures["gae_lora_sync_bytes"] == 4 * L * sum(8 * (o + i) for o, i in shapes)
    assert figures["gae_lora_sync_share_of_full"] == pytest.approx(figures["gae_lora_sync_bytes"] / full, abs=1e-4)
    assert figures["echo_gae_lora_samples_to_target_per_seed"] == [None] and figures["gae_lora_step_s"] > 0


@pytest.mark.e2e
def test_async_benchmark_quick_ends_with_json():
    """benchmarks/async.py --quick: one-step-off on a training core and a rollout core (torchrun,
    the split placement's rank entry): its figures parsed, the lag one behind after step 1."""
    figures = quick_figures("async.py", 600)["one_step_off"]
    assert figures["step_s"] > 0 and figures["tokens_per_s"] > 0
    assert figures["lag"] == [0.0, 1.0, 1.0]


@pytest.mark.e2e
def test_simulate_recipes_benchmark_quick_ends_with_json():
    figures = quick_figures("simulate_recipes.py", 600)
    assert set(figures) == {"qwen2.5_0.5b"} and "error" not in figures["qwen2.5_0.5b"]
    assert figures["qwen2.5_0.5b"]["max_gap_pct"] >= 0 and figures["qwen2.5_0.5b"]["over_10pct"] == {}
