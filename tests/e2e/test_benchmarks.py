"""Benchmarks keep running and keep their output contract (figures are printed, never asserted)."""
import json
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
    for key in ("gae_speedup", "gae_max_rel_diff", "logprob_parallel_s", "logprob_naive_peak_rss_mib"):
        assert key in figures
    # correctness is asserted (speed is not): the fast paths agree with their references
    assert figures["gae_max_rel_diff"] < 1e-5
    assert figures["logprob_max_abs_diff"] < 1e-10


@pytest.mark.e2e
def test_rollout_benchmark_quick_ends_with_json():
    figures = quick_figures("rollout.py", 900)
    for key in ("wrapper_vs_raw", "gen_vs_hf", "sync_s_tiny", "sync_s_100m", "sync_gbps_100m", "sync_vs_engine_reload"):
        assert figures[key] > 0
