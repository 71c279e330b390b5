"""RL kernel figures on CPU: vectorised GAE vs the reverse loop, and the vocab-parallel log-prob
vs a naive full-vocabulary log_softmax (time and peak memory).

    python benchmarks/kernels.py            # B=512, T=4096 float32 (the issue's sizes)
    python benchmarks/kernels.py --quick    # smaller, for a smoke run

Prints a table and ends with one JSON line of figures.
"""
import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch


def timed(fn, repeats, warmup=10):
    # Steady state, as in a training loop that calls the kernel every step. The first calls in a
    # fresh process are slower: glibc hands fresh multi-MB buffers back to the OS until its
    # mmap threshold adapts, so they page-fault (reported separately as *_first_call_s).
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def bench_gae(B, T, repeats):
    from megappo.algo import gae, gae_reference

    g = torch.Generator().manual_seed(0)
    r = torch.randn(B, T, generator=g)
    v = torch.randn(B, T, generator=g)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()      # right-padded responses
    holes = mask * (torch.rand(B, T, generator=g) > 0.1).float()      # + multi-turn observation spans
    out = {}
    t = time.perf_counter()
    gae(r, v, mask, 1.0, 0.95)
    out["first_call"] = time.perf_counter() - t
    for name, m in (("padded", mask), ("holes", holes)):
        t_fast = timed(lambda: gae(r, v, m, 1.0, 0.95), repeats)
        t_ref = timed(lambda: gae_reference(r, v, m, 1.0, 0.95), max(1, repeats // 5), warmup=1)
        a, _ = gae(r, v, m, 1.0, 0.95)
        a64, _ = gae_reference(r.double(), v.double(), m.double(), 1.0, 0.95)
        diff = (a.double() - a64).abs().max().item()
        out[name] = dict(t_ref=t_ref, t_fast=t_fast, diff=diff, rel=diff / a64.abs().max().item())
    return out


_LOGPROB_CHILD = r"""
import json, resource, sys, time, torch
from megappo import algo
from megappo.distributed import (entropy_from_vocab_parallel_logits, log_probs_and_entropy, log_probs_from_logits,
                                 log_probs_reference)
kind, N, V = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
logits = torch.randn(N, V).requires_grad_(True)
labels = torch.randint(0, V, (N,))
grad_out = torch.randn(N)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # the logits are allocated
def step():
    if kind.startswith("fwd"):   # the old-log-prob pass: forward only
        with torch.no_grad():
            return log_probs_from_logits(logits, labels, chunk_tokens=None if kind == "fwd_whole" else 1024), None
    # the actor's update: log-probs and entropy, forward and backward
    if kind == "naive":
        lp, h = log_probs_reference(logits, labels), algo.entropy_from_logits(logits)
    elif kind in ("parallel", "parallel_metric"):   # megappo now: fused, 1024-token chunks
        lp, h = log_probs_and_entropy(logits, labels)
        if kind == "parallel_metric":   # entropy_coeff 0 (the default): the entropy is a metric only
            g, = torch.autograd.grad((lp * grad_out).sum(), logits)
            return lp, g
    else:                      # the reference form: two kernels, the whole micro-batch at once
        lp = log_probs_from_logits(logits, labels, chunk_tokens=None)
        h = entropy_from_vocab_parallel_logits(logits, chunk_tokens=None)
    g, = torch.autograd.grad((lp * grad_out).sum() + (h * grad_out).sum(), logits)
    return lp, g
step()
ts = []
for _ in range(5):
    t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
ts.sort()
peak_extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
print(json.dumps({"t": ts[len(ts) // 2], "rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "extra_kb": peak_extra}))
"""


def bench_logprob(N, V):
    """Each variant in a fresh process: forward + backward, median time and peak RSS."""
    res = {}
    for kind in ("parallel", "parallel_metric", "whole", "naive", "fwd_chunked", "fwd_whole"):
        p = subprocess.run([sys.executable, "-c", _LOGPROB_CHILD, kind, str(N), str(V)], capture_output=True,
                           text=True, check=True)
        res[kind] = json.loads(p.stdout.strip().splitlines()[-1])
    # agreement, in this process
    from megappo.distributed import log_probs_from_logits, log_probs_reference
    torch.manual_seed(0)
    z = torch.randn(256, V, dtype=torch.float64)
    y = torch.randint(0, V, (256,))
    diff = (log_probs_from_logits(z, y) - log_probs_reference(z, y)).abs().max().item()
    z = torch.randn(3000, 512)
    y = torch.randint(0, 512, (3000,))
    chunked = log_probs_from_logits(z, y, chunk_tokens=1024) - log_probs_from_logits(z, y, chunk_tokens=None)
    return res, diff, chunked.abs().max().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    B, T, reps = (64, 1024, 5) if args.quick else (512, 4096, 10)
    N, V = (1024, 8192) if args.quick else (4096, 32768)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    g = bench_gae(B, T, reps)
    lp, lp_diff, chunk_diff = bench_logprob(N, V)
    logits_mb = N * V * 4 / 2**20

    print(f"GAE  B={B} T={T} float32, threads={torch.get_num_threads()} (median of {reps}, after 10 warm-up calls)")
    print(f"{'mask':<8} {'gae_reference s':>16} {'gae s':>10} {'speedup':>8} {'max|diff|':>11} {'rel':>9}")
    for name, x in g.items():
        if name == "first_call":
            continue
        print(f"{name:<8} {x['t_ref']:>16.4f} {x['t_fast']:>10.4f} {x['t_ref'] / x['t_fast']:>8.1f} "
              f"{x['diff']:>11.2e} {x['rel']:>9.1e}")
    print(f"first gae call in a fresh process: {g['first_call']:.4f} s")
    print(f"\nlog-prob + entropy fwd+bwd  N={N} tokens V={V} float32 (logits {logits_mb:.0f} MiB), fresh process each")
    print(f"{'variant':<34} {'time s':>8} {'peak RSS MiB':>13} {'above logits MiB':>17}")
    for kind, label in (("parallel", "fused, 1024-token chunks"),
                        ("parallel_metric", "fused, entropy a metric (coeff 0)"), ("whole", "two kernels, whole batch"),
                        ("naive", "naive log_softmax"), ("fwd_chunked", "forward only, 1024-token chunks"),
                        ("fwd_whole", "forward only, whole batch")):
        print(f"{label:<34} {lp[kind]['t']:>8.4f} {lp[kind]['rss_kb'] / 1024:>13.0f} {lp[kind]['extra_kb'] / 1024:>17.0f}")
    print(f"max |diff| vs naive (float64): {lp_diff:.1e}; chunked vs whole batch (float32): {chunk_diff:.1e}")

    figures = {
        "gae_ref_s": round(g["padded"]["t_ref"], 4),
        "gae_s": round(g["padded"]["t_fast"], 5),
        "gae_speedup": round(g["padded"]["t_ref"] / g["padded"]["t_fast"], 1),
        "gae_first_call_s": round(g["first_call"], 4),
        "gae_max_abs_diff": float(f"{g['padded']['diff']:.3g}"),
        "gae_max_rel_diff": float(f"{g['padded']['rel']:.3g}"),
        "gae_holes_speedup": round(g["holes"]["t_ref"] / g["holes"]["t_fast"], 1),
        "gae_holes_max_rel_diff": float(f"{g['holes']['rel']:.3g}"),
        "logprob_parallel_s": round(lp["parallel"]["t"], 4),
        "logprob_parallel_entropy_metric_s": round(lp["parallel_metric"]["t"], 4),
        "logprob_naive_s": round(lp["naive"]["t"], 4),
        "logprob_parallel_peak_rss_mib": round(lp["parallel"]["rss_kb"] / 1024),
        "logprob_naive_peak_rss_mib": round(lp["naive"]["rss_kb"] / 1024),
        "logprob_max_abs_diff": float(f"{lp_diff:.3g}"),
        "logprob_whole_batch_s": round(lp["whole"]["t"], 4),
        "logprob_chunked_extra_mib": round(lp["parallel"]["extra_kb"] / 1024),
        "logprob_whole_batch_extra_mib": round(lp["whole"]["extra_kb"] / 1024),
        "logprob_chunked_vs_whole_max_abs_diff": float(f"{chunk_diff:.3g}"),
        "logprob_forward_chunked_extra_mib": round(lp["fwd_chunked"]["extra_kb"] / 1024),
        "logprob_forward_whole_batch_extra_mib": round(lp["fwd_whole"]["extra_kb"] / 1024),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
