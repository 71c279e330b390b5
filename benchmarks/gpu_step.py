"""One PPO training step on one GPU: speed, MFU, peak memory, and the actor's log-prob parity with
transformers, for a random-init Qwen3-shaped model (no HF weights needed).

    python benchmarks/gpu_step.py                       # qwen3-0.6b shape, bf16, cuda:0
    python benchmarks/gpu_step.py --preset qwen3-1.5b   # hidden 1536, 28 layers, 12 heads / 2 KV groups
    python benchmarks/gpu_step.py --dry-run             # the plan only; CUDA is not touched
    python benchmarks/gpu_step.py --quick               # tiny model, CUDA if present else CPU (smoke run)
    MEGAPPO_CHECK_DEVICES=1 python benchmarks/gpu_step.py --tiny --device cpu
                                                        # CPU under the device check (simulated cuda:0)

A step is what the trainer does after rollout: the actor's old log-probs, the critic's values,
one critic update and one policy update (one mini-batch = the batch, PPO epochs 1), with
token-budget micro-batches. Sequences are a prompt plus a response of random length (random
tokens), right-padded, as the rollout hands them over. World size 1 (NCCL on a GPU, gloo on CPU).

MFU uses megappo.metrics.mfu (6 FLOPs per parameter per token for a training pass, 2 for a
forward-only pass; attention FLOPs not counted) against megappo.metrics.peak_flops of the GPU's
name. Log-prob parity: the actor's log-probs vs transformers' Qwen3ForCausalLM holding the same
weights (exported with iter_hf_tensors), on a short batch, both in the run's dtype.

Prints a table and ends with one line of JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Qwen3 shapes (HF config fields). qwen3-0.6b is Qwen3-0.6B's shape; qwen3-1.5b is a Qwen3-style
# model of Qwen2.5-1.5B's size.
PRESETS = {
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       head_dim=128, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=256, vocab_size=1000, tie_word_embeddings=True),
}
# Realistic lengths for the full presets; small ones for the tiny smoke run.
FULL = dict(batch=16, prompt_len=512, response_len=1536, fwd_tokens=8192, train_tokens=4096, warmup=2, steps=3,
            parity_batch=2, parity_len=256)
TINY = dict(batch=4, prompt_len=32, response_len=64, fwd_tokens=512, train_tokens=256, warmup=1, steps=2,
            parity_batch=2, parity_len=64)


def count_params(c: dict, critic: bool = False) -> int:
    """Parameters of the HF-shaped model (the actor; ``critic``: value head instead of the LM head)."""
    h, L, d = c["hidden_size"], c["num_hidden_layers"], c["head_dim"]
    q, kv, ffn, V = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["intermediate_size"], c["vocab_size"]
    layer = h * q + 2 * h * kv + q * h + 3 * h * ffn + 2 * h + 2 * d  # attention, SwiGLU MLP, 2 norms, q/k norms
    head = (h + 1) if critic else (0 if c["tie_word_embeddings"] else V * h)
    return V * h + L * layer + h + head


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-0.6b")
    ap.add_argument("--tiny", action="store_true", help="the tiny preset with short sequences (smoke run)")
    ap.add_argument("--quick", action="store_true", help="--tiny on CUDA if present, else on CPU")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--batch", type=int, help="sequences per step")
    ap.add_argument("--prompt-len", type=int, help="prompt tokens per sequence")
    ap.add_argument("--response-len", type=int, help="longest response; lengths are uniform in [half, this]")
    ap.add_argument("--fwd-tokens", type=int, help="token budget of a forward-only micro-batch (count x longest)")
    ap.add_argument("--train-tokens", type=int, help="token budget of a training micro-batch")
    ap.add_argument("--warmup", type=int, help="untimed steps first")
    ap.add_argument("--steps", type=int, help="timed steps")
    ap.add_argument("--no-critic", action="store_true", help="actor only (no values, no critic update)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="print the plan; touch no device")
    a = ap.parse_args(argv)
    if a.quick:
        a.tiny = True
    if a.tiny:
        a.preset = "tiny"
    if a.device is None:
        a.device = "cpu" if a.quick and not _cuda_available(a.dry_run) else "cuda"
    if a.dtype is None:
        a.dtype = "bf16" if a.device == "cuda" else "fp32"
    for k, v in (TINY if a.preset == "tiny" else FULL).items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    return a


def _cuda_available(dry_run: bool) -> bool:
    if dry_run:
        return False
    import torch

    return torch.cuda.is_available()


def plan(a) -> dict:
    c = PRESETS[a.preset]
    seq = a.prompt_len + a.response_len
    return {"preset": a.preset, "device": a.device, "dtype": a.dtype, **{k: c[k] for k in c},
            "params_actor": count_params(c), "params_critic": 0 if a.no_critic else count_params(c, critic=True),
            "batch": a.batch, "prompt_len": a.prompt_len, "response_len_max": a.response_len, "seq_len_max": seq,
            "fwd_token_budget": a.fwd_tokens, "train_token_budget": a.train_tokens, "warmup_steps": a.warmup,
            "timed_steps": a.steps, "critic": not a.no_critic,
            "parity_batch": f"{a.parity_batch} x {a.parity_len} tokens"}


def print_plan(p: dict) -> None:
    print(f"plan: {p['preset']} ({p['params_actor'] / 1e6:.1f}M parameters actor"
          + (f", {p['params_critic'] / 1e6:.1f}M critic" if p["critic"] else "") + f"), {p['dtype']} on {p['device']}")
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size", "tie_word_embeddings", "batch", "prompt_len", "response_len_max",
              "fwd_token_budget", "train_token_budget", "warmup_steps", "timed_steps", "parity_batch"):
        print(f"  {k:22s} {p[k]}")
    states = 2 + 4 + 4 + 8 if p["dtype"] == "bf16" else 4 + 4 + 8  # weights, fp32 grads, main copy, Adam
    total = (p["params_actor"] + p["params_critic"]) * states
    print(f"  {'weights+grads+Adam':22s} ~{total / 2**30:.1f} GiB (before activations)")
    print("  step = actor log-probs, critic values, critic update, policy update (PPO epochs 1, one mini-batch)")


# -- set-up ----------------------------------------------------------------------------------------
def setup(a):
    """Initialise torch.distributed (world size 1) and megatron; return (device, dtype)."""
    import torch
    import torch.distributed as dist

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if a.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("gpu_step.py: no CUDA device (use --device cpu --tiny for a CPU smoke run)")
        torch.cuda.set_device(0)
        backend = "nccl"
    else:
        from megappo import device_check, megatron_cpu

        megatron_cpu.install(check_devices=device_check.enabled_by_env())
        backend = "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=300))
    from megappo.distributed import process_device
    from megappo.models import initialize_parallel

    initialize_parallel(1, 1, seed=a.seed)
    device = process_device(a.device)  # cuda:0, cpu, or the simulated cuda:0 of the device check
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    return device, dtype


def hf_config(a):
    from transformers import Qwen3Config

    cfg = Qwen3Config(**PRESETS[a.preset], max_position_embeddings=max(4096, a.prompt_len + a.response_len),
                      rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def build_workers(a, device, dtype, cfg):
    import torch

    from megappo.models import build_model, describe, transformer_config
    from megappo.workers import Actor, Critic

    cpu = device.type == "cpu"
    info = describe(cfg)
    tcfg = transformer_config(info, params_dtype=dtype, cpu=cpu)
    chunks = build_model(info, tcfg, use_te=False if cpu else None, seed=a.seed)  # random init (megatron's)
    actor = Actor(chunks, tcfg, device=device, vocab_size=info.desc.vocab_size, lr=1e-6, clip_grad=1.0)
    critic = None
    if not a.no_critic:
        cinfo = describe(cfg, value_head=True)
        ccfg = transformer_config(cinfo, params_dtype=dtype, cpu=cpu)
        cchunks = build_model(cinfo, ccfg, value_head=True, use_te=False if cpu else None, seed=a.seed,
                              value_head_std=0.02)
        critic = Critic(cchunks, ccfg, device=device, lr=1e-6, clip_grad=1.0)
    n = sum(p.numel() for c in chunks for p in c.parameters())
    nc = sum(p.numel() for c in critic.chunks for p in c.parameters()) if critic else 0
    torch.manual_seed(a.seed)
    return info, actor, critic, n, nc


def make_batch(a, vocab: int, seed: int, n: int = None, prompt_len: int = None, response_len: int = None):
    import torch

    from megappo.batch import RolloutBatch

    n = n or a.batch
    prompt_len = prompt_len or a.prompt_len
    response_len = response_len or a.response_len
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(n)]
    lengths = torch.randint(response_len // 2, response_len + 1, (n,), generator=g)
    lengths[0] = response_len  # one full-length response: the longest sequence is prompt + response_len
    responses = torch.randint(3, vocab, (n, response_len), generator=g)
    mask = (torch.arange(response_len)[None] < lengths[:, None]).float()
    b = RolloutBatch.from_prompts_and_responses(prompts, responses, mask, pad_token_id=0,
                                                prompt_index=torch.arange(n))
    b.advantages = torch.randn(mask.shape, generator=g) * mask
    b.returns = torch.randn(mask.shape, generator=g) * mask
    return b


def sync(device):
    import torch

    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()


# -- the figures -----------------------------------------------------------------------------------
def parity(a, info, actor, cfg, device, dtype) -> dict:
    """Actor log-probs vs transformers' Qwen3ForCausalLM with the same weights, same dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    from megappo.convert import iter_hf_tensors

    from megappo.layout import RankCoords

    hf_device = device if torch.cuda.is_available() and device.type == "cuda" else torch.device("cpu")
    with torch.device(hf_device):  # random init straight on the GPU (its weights are overwritten below)
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    sd = {n: t for n, t in iter_hf_tensors(actor.chunks, info.desc, RankCoords.from_megatron())}
    res = hf.load_state_dict(sd, strict=False)
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    assert not res.unexpected_keys and set(res.missing_keys) <= tied, res
    del sd
    b = make_batch(a, cfg.vocab_size, seed=a.seed + 100, n=a.parity_batch, prompt_len=a.parity_len // 4,
                   response_len=a.parity_len - a.parity_len // 4)
    lp = actor.compute_log_prob(b, max_token_len=a.fwd_tokens)
    with torch.no_grad():
        ids = b.input_ids.to(hf_device)
        logits = hf(input_ids=ids).logits[:, :-1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        ref = (ref.gather(1, b.response_positions.to(hf_device)) * b.response_mask.to(hf_device)).cpu()
    del hf, logits
    if hf_device.type == "cuda":
        torch.cuda.empty_cache()
    m = b.response_mask.bool()
    d = (lp[m] - ref[m]).abs()
    return {"max": float(d.max()), "mean": float(d.mean()), "tokens": int(m.sum())}


def step(a, actor, critic, batch, device) -> dict:
    """One PPO step after rollout; seconds per phase."""
    t = {}

    def timed(name, fn):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        t[name] = time.perf_counter() - t0
        return out

    b = batch.select(slice(None))
    b.old_log_prob = timed("compute_log_prob", lambda: actor.compute_log_prob(b, max_token_len=a.fwd_tokens))
    if critic is not None:
        b.values = timed("compute_values", lambda: critic.compute_values(b, max_token_len=a.fwd_tokens))
        timed("update_critic", lambda: critic.update_critic(b, mini_batch_size=len(b), max_token_len=a.train_tokens))
    timed("update_policy", lambda: actor.update_policy(b, mini_batch_size=len(b), max_token_len=a.train_tokens))
    t["step"] = sum(t.values())
    return t


def run(a) -> dict:
    import torch

    from megappo.metrics import mfu, peak_flops

    device, dtype = setup(a)
    real_cuda = device.type == "cuda" and torch.cuda.is_available()
    gpu_name = torch.cuda.get_device_name(device) if real_cuda else ("cpu (device check: simulated cuda:0)"
                                                                       if device.type == "cuda" else "cpu")
    peak = peak_flops(gpu_name) if real_cuda else None
    cfg = hf_config(a)
    t0 = time.perf_counter()
    info, actor, critic, n_actor, n_critic = build_workers(a, device, dtype, cfg)
    build_s = time.perf_counter() - t0
    par = parity(a, info, actor, cfg, device, dtype)
    batch = make_batch(a, cfg.vocab_size, seed=a.seed)
    tokens = int((batch.prompt_lengths + batch.response_mask.sum(-1).long()).sum())
    for _ in range(a.warmup):
        step(a, actor, critic, batch, device)
    if real_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    runs = [step(a, actor, critic, batch, device) for _ in range(a.steps)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if real_cuda else None

    def m(n, tok, s):
        return mfu(n, tok, s, 1, peak) if peak else None

    # forward-only passes count 2 FLOPs per parameter per token: a third of a training pass
    fl_tokens = {"compute_log_prob": (n_actor, tokens / 3), "update_policy": (n_actor, tokens),
                 "compute_values": (n_critic, tokens / 3), "update_critic": (n_critic, tokens)}
    step_mfu = (sum(mfu(n, tok, med["step"], 1, peak) for k, (n, tok) in fl_tokens.items() if k in med)
                if peak else None)
    print(f"\none PPO step on {gpu_name}: {a.preset} ({n_actor / 1e6:.1f}M parameters"
          + (f", critic {n_critic / 1e6:.1f}M" if critic else "") + f"), {a.dtype}, {a.batch} sequences, "
          f"{tokens} tokens (prompt {a.prompt_len} + response {a.response_len // 2}-{a.response_len}), micro-batch "
          f"token budgets {a.fwd_tokens} (forward) / {a.train_tokens} (training); median of {a.steps} steps after "
          f"{a.warmup} warm-up; build {build_s:.1f} s")
    print(f"{'phase':18s} {'seconds':>9s} {'tokens/s':>10s} {'MFU':>7s}")
    for k in ("compute_log_prob", "compute_values", "update_critic", "update_policy", "step"):
        if k not in med:
            continue
        u = (m(*fl_tokens[k], med[k]) if k != "step" else step_mfu)
        print(f"{k:18s} {med[k]:9.3f} {tokens / med[k]:10.0f} {'' if u is None else f'{100 * u:6.1f}%':>7s}")
    print(f"peak memory: {'n/a (not CUDA)' if peak_gib is None else f'{peak_gib:.2f} GiB'}; "
          f"MFU: {'n/a (unknown peak FLOP/s)' if peak is None else f'peak {peak / 1e12:.0f} TFLOP/s bf16 dense, attention FLOPs not counted'}")
    print(f"log-prob parity vs transformers ({a.dtype}, {par['tokens']} tokens): max |diff| {par['max']:.3g}, "
          f"mean {par['mean']:.3g} nats")

    def r(x, k=4):
        return None if x is None else round(x, k)

    def sig(x):  # 3 significant digits (parity figures span 1e-7 .. 1e-1)
        return float(f"{x:.3g}")

    return {"device_name": gpu_name, "preset": a.preset, "dtype": a.dtype, "params_m": round(n_actor / 1e6, 1),
            "critic_params_m": round(n_critic / 1e6, 1), "tokens_per_step": tokens,
            "step_time_s": r(med["step"]), "tokens_per_s": round(tokens / med["step"], 1), "mfu": r(step_mfu),
            "mfu_update_policy": r(m(n_actor, tokens, med["update_policy"])),
            "compute_log_prob_s": r(med["compute_log_prob"]), "update_policy_s": r(med["update_policy"]),
            "compute_values_s": r(med.get("compute_values")), "update_critic_s": r(med.get("update_critic")),
            "peak_memory_gib": r(peak_gib, 2), "logprob_parity_max_abs_diff": sig(par["max"]),
            "logprob_parity_mean_abs_diff": sig(par["mean"]), "build_s": r(build_s, 1)}


def main(argv=None) -> int:
    a = parse_args(argv)
    p = plan(a)
    print_plan(p)
    if a.dry_run:
        print(json.dumps({"dry_run": True, **{k: p[k] for k in ("preset", "device", "dtype", "params_actor",
                                                              "params_critic", "batch", "seq_len_max",
                                                              "fwd_token_budget", "train_token_budget",
                                                              "warmup_steps", "timed_steps")}}))
        return 0
    try:
        import megappo  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.join(REPO, "src"))
    figures = run(a)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
