"""Qwen3-MoE as a megatron MoE GPTModel: built from the HF config (router
renormalisation, dense and expert layers mixed by mlp_only_layers), each expert-parallel rank
loading only its experts from the HF checkpoint, HF -> megatron -> HF bit-exact (experts gathered
over the EP group), and per-token log-probs equal to transformers' at EP1, EP2, TP2 x EP2
(sequence parallel) and PP2 x EP2, with norm_topk_prob on and off."""
import os
import sys

import pytest
import torch

from harness import raise_if_failed, spawn_each
from mcore import token_log_probs

pytestmark = pytest.mark.distributed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_models import VOCAB, save_tiny_model  # noqa: E402


def _worker(rank, world, path, tp, pp, ep):
    from megappo import megatron_cpu

    megatron_cpu.install()
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from megappo.convert import load_hf_weights

    from megappo.layout import RankCoords
    from megappo.models import build_model, describe, initialize_parallel, load_hf_config, transformer_config

    initialize_parallel(tp, pp, ep=ep)
    info = describe(load_hf_config(path), tp=tp)
    assert info.desc.num_experts == 4 and info.desc.moe_layers == (1, 2, 3)
    cfg = transformer_config(info, tp=tp, pp=pp, sequence_parallel=tp > 1, cpu=True, ep=ep)
    chunks = build_model(info, cfg)
    coords = RankCoords.from_megatron()
    assert (coords.ep, coords.ep_rank) == (ep, ps.get_expert_model_parallel_rank())
    # each EP rank holds only its experts: 4 / EP of them in every MoE layer it builds
    names = [n for n, _ in chunks[0].named_parameters()]
    experts = {n.split(".local_experts.")[1].split(".")[0] for n in names if ".local_experts." in n}
    assert experts == {str(k) for k in range(4 // ep)}, experts
    load_hf_weights(chunks, path, info.desc, coords)
    # megatron -> HF: every tensor of the checkpoint back, bit for bit, on every rank (experts from
    # the EP rank holding them, layers from their stage)
    from megappo.convert import SafetensorsCheckpoint, iter_hf_tensors

    ckpt = SafetensorsCheckpoint(path)
    out = dict(iter_hf_tensors(chunks, info.desc, coords))
    assert set(out) == ckpt.names(), sorted(set(out) ^ ckpt.names())[:6]
    bad = [n for n, t in out.items() if not torch.equal(t, ckpt.read(n))]
    assert not bad, bad[:6]
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, VOCAB, (2, 24), generator=g) for _ in range(2)]
    got = token_log_probs(chunks, info, batches)
    if not ps.is_pipeline_last_stage():
        return
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for ids, lp in zip(batches, got):
        with torch.no_grad():
            ref = torch.log_softmax(hf(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        diff = (lp - ref).abs().max().item()
        assert diff < 1e-5, f"TP{tp} PP{pp} EP{ep}: |megatron - transformers| log-prob {diff}"


LAYOUTS = [(1, 1, 1, True, 1), (1, 1, 2, False, 2), (2, 1, 2, True, 4), (1, 2, 2, True, 4)]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """Every run of this file in one spawned world per world size. case -> its error file."""
    root = tmp_path_factory.mktemp("moe")
    for norm in (True, False):
        save_tiny_model("qwen3_moe", root / f"moe_{norm}", norm_topk_prob=norm)
    save_tiny_model("qwen3_moe", root / "moe_2layers", num_hidden_layers=2)
    calls, errors = {}, {}
    for tp, pp, ep, norm, world in LAYOUTS:
        errors[(tp, pp, ep, norm)] = str(root / f"lp_{tp}_{pp}_{ep}_{norm}.error")
        calls.setdefault(world, []).append((_worker, (str(root / f"moe_{norm}"), tp, pp, ep), errors[(tp, pp, ep, norm)]))
    for ep in (1, 2):
        errors[("grad", ep)] = str(root / f"grad_{ep}.error")
        calls[ep].append((_grad_worker, (str(root / "moe_2layers"), ep), errors[("grad", ep)]))
    for world, world_calls in sorted(calls.items()):
        spawn_each(world, world_calls)
    return errors


@pytest.mark.parametrize("tp, pp, ep, norm_topk_prob, world", LAYOUTS)
def test_moe_log_probs_equal_transformers(tp, pp, ep, norm_topk_prob, world, worlds):
    raise_if_failed(worlds[(tp, pp, ep, norm_topk_prob)])


def _grad_worker(rank, world, path, ep):
    """One backward of -sum(log-probs), each rank on its own batch; against transformers' backward
    of the same loss over every rank's batch: the router's and embedding's gradients summed over
    ranks, each expert's on the rank that holds it (its tokens arrive from every rank)."""
    from megappo import megatron_cpu

    megatron_cpu.install()
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from megappo.convert import load_hf_weights, local_params

    from megappo.layout import RankCoords
    from megappo.models import build_model, describe, initialize_parallel, load_hf_config, transformer_config

    initialize_parallel(1, 1, ep=ep)
    info = describe(load_hf_config(path))
    chunks = build_model(info, transformer_config(info, cpu=True, ep=ep))
    coords = RankCoords.from_megatron()
    load_hf_weights(chunks, path, info.desc, coords)
    batches = [torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]

    def nll(logits, ids):   # over the real vocabulary (megatron's logits carry the padding rows too)
        return -torch.log_softmax(logits[:, :-1, :VOCAB].float(), -1).gather(-1, ids[:, 1:, None]).sum()

    ids = batches[rank]
    nll(chunks[0](ids, torch.arange(ids.shape[1])[None].expand_as(ids), attention_mask=None), ids).backward()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sum(nll(hf(b).logits, b) for b in batches).backward()
    hp = dict(hf.named_parameters())
    local = local_params(chunks, info.desc, coords)
    V = info.desc.vocab_size

    def summed(t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    worst = {}
    for layer in info.desc.moe_layers:
        m, h = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
        worst["router"] = max(worst.get("router", 0), (summed(local[m + "router.weight"].grad)
                                                       - hp[h + "gate.weight"].grad).abs().max().item())
        for e in range(rank * 4 // ep, (rank + 1) * 4 // ep):      # this rank's experts
            fc1 = local[f"{m}experts.local_experts.{e}.linear_fc1.weight"].grad
            fc2 = local[f"{m}experts.local_experts.{e}.linear_fc2.weight"].grad
            worst["experts"] = max(worst.get("experts", 0),
                                   (fc1 - hp[h + "experts.gate_up_proj"].grad[e]).abs().max().item(),
                                   (fc2 - hp[h + "experts.down_proj"].grad[e]).abs().max().item())
    emb = summed(local["embedding.word_embeddings.weight"].grad)[:V]
    worst["embedding"] = (emb - hp["model.embed_tokens.weight"].grad).abs().max().item()
    scale = max(p.grad.abs().max().item() for p in hf.parameters() if p.grad is not None)
    assert all(v < 1e-5 for v in worst.values()), (worst, scale)   # measured <= 4.8e-6 (grads up to ~9)


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_gradients_equal_transformers(ep, worlds):
    raise_if_failed(worlds[("grad", ep)])
