"""benchmarks/critic_probe.py's yardstick: the within-group slope reads 1 for per-token values and
0 for values that know only the prompt, whatever the groups' levels (else its figures mean nothing)."""
import importlib.util
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("critic_probe_bench", REPO / "benchmarks" / "critic_probe.py")
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def _rollouts(groups=6, n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.tensor([0.2, 0.5, 0.8])[torch.arange(groups) % 3].repeat_interleave(n)
    right = (torch.rand(groups * n, probe.N_WORDS, generator=g) < p[:, None]).float()
    before = torch.cumsum(right, 1) - right
    return before, p, torch.arange(groups).repeat_interleave(n)


def test_exact_values_have_slope_one():
    before, p, group = _rollouts()
    assert abs(probe.within_group_slope(probe.exact_values(before, p), before, group) - 1.0) < 1e-5


def test_prompt_only_values_have_slope_zero():
    before, p, group = _rollouts()
    prompt_only = (p[:, None] + 0.1 * group[:, None].float()).expand(-1, probe.N_WORDS)   # a level per group
    assert abs(probe.within_group_slope(prompt_only, before, group)) < 1e-6


def test_half_credit_reads_one_half():
    before, p, group = _rollouts()
    half = (0.5 * before + p[:, None] * 4) / probe.N_WORDS + group[:, None].float()
    assert abs(probe.within_group_slope(half, before, group) - 0.5) < 1e-5
