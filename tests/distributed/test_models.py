"""Megatron actor/critic built from HF checkpoints compute what transformers computes, on every
layout (gloo, spawned processes); weights round-trip HF -> Megatron -> HF bit for bit."""
import contextlib
import os
import sys

import pytest
import torch

from harness import raise_if_failed, spawn_each
from mcore import SEQ, build, run_schedule, setup

pytestmark = pytest.mark.distributed
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
from tiny_models import VOCAB, save_tiny_model  # noqa: E402

ARCHS = ("qwen3", "qwen2", "llama")
DEEPER = (("qwen3", 6), ("qwen2", 6), ("qwen2", 5))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    for i, arch in enumerate(ARCHS):
        save_tiny_model(arch, root / arch, seed=i)
    for arch, layers in DEEPER:   # for uneven pipelines that 4 layers cannot show
        save_tiny_model(arch, root / f"{arch}_{layers}l", seed=layers, num_hidden_layers=layers)
    return str(root)


def _batches(dp_rank, n_micro=2, mbs=2):
    g = torch.Generator().manual_seed(100 + dp_rank)
    return [torch.randint(0, VOCAB, (mbs, SEQ), generator=g) for _ in range(n_micro)]


def _logprob_worker(rank, world, tp, pp, vpp, dirs, split=None, archs=ARCHS):
    setup(tp, pp, vpp)
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from megappo.distributed import log_probs_from_logits

    tp_group = ps.get_tensor_model_parallel_group()
    for arch in archs:
        path = os.path.join(dirs, arch)
        info, cfg, chunks = build(path, tp, pp, vpp, split=split)
        if split is not None:
            _check_uneven(chunks, info, cfg, path, arch, split)
        batches = _batches(ps.get_data_parallel_rank())

        def loss(output, ids):
            lp = log_probs_from_logits(output[:, :-1], ids[:, 1:], tp_group, vocab_size=info.desc.vocab_size)
            return lp.sum() * 0.0, {"lp": lp.detach()}

        with torch.no_grad():
            out = run_schedule(chunks, batches, loss)
        if ps.is_pipeline_last_stage():
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for got, ids in zip(out, batches):
                with torch.no_grad():
                    ref = torch.log_softmax(hf(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
                diff = (got["lp"] - ref).abs().max().item()
                assert diff < 1e-5, f"{arch} TP{tp}PP{pp}VPP{vpp} {split}: max log-prob diff {diff}"


def _check_uneven(chunks, info, cfg, path, arch, split):
    """An uneven pipeline: each chunk holds the layers megappo.layout places there (megatron's
    layer numbers say which), and the weights come back out bit for bit under their HF names."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from megappo.convert import iter_hf_tensors
    from megappo.layout import RankCoords, stage_layers

    table = stage_layers(info.desc.num_layers, cfg.pipeline_model_parallel_size,
                         cfg.virtual_pipeline_model_parallel_size, split)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    for vp, chunk in enumerate(chunks):
        first, count = table[(pp_rank, vp)]
        got = [layer.layer_number - 1 for layer in chunk.decoder.layers]   # megatron's global numbers
        assert got == list(range(first, first + count)), (arch, split, pp_rank, vp, got, (first, count))
    original = load_file(os.path.join(path, "model.safetensors"))
    seen = {}
    for name, t in iter_hf_tensors(chunks, info.desc, RankCoords.from_megatron(cfg)):
        assert torch.equal(t, original[name]), f"{arch} {split}: {name} differs"
        seen[name] = t
    assert set(seen) == set(original) - ({"lm_head.weight"} if info.desc.tie_word_embeddings else set()), arch


LAYOUTS = [(1, 1, 1, None), (2, 2, 1, None), (2, 1, 2, None), (4, 2, 2, None), (2, 1, 1, None), (2, 1, 2, 2)]
# uneven pipelines (megatron's num_layers_in_first/last_pipeline_stage, account_for_*_in_pipeline_split)
# on the 4-layer models: (world, tp, pp, vpp, split)
UNEVEN = [(2, 1, 2, None, dict(first=1), ARCHS), (4, 2, 2, None, dict(last=1), ARCHS),
          (4, 1, 4, None, dict(first=1, last=1), ("qwen3_6l", "qwen2_6l")),
          (4, 1, 2, 2, dict(embedding=True, loss=True), ("qwen3_6l", "qwen2_6l")),
          (2, 1, 2, None, dict(embedding=True), ("qwen2_5l",))]


@pytest.fixture(scope="module")
def worlds(model_dirs, tmp_path_factory):
    """Every run of this file in one spawned world per world size (each run sets up its own
    parallel state). case -> its error file."""
    root = tmp_path_factory.mktemp("runs")
    calls, errors = {}, {}
    for world, tp, pp, vpp in LAYOUTS:
        errors[(world, tp, pp, vpp)] = str(root / f"lp_{world}_{tp}_{pp}_{vpp}.error")
        calls.setdefault(world, []).append((_logprob_worker, (tp, pp, vpp, model_dirs), errors[(world, tp, pp, vpp)]))
    for world, tp, pp, vpp, split, archs in UNEVEN:
        from megappo.layout import PipelineSplit

        key = (world, tp, pp, vpp, tuple(sorted(split.items())))
        errors[key] = str(root / f"uneven_{len(errors)}.error")
        calls.setdefault(world, []).append(
            (_logprob_worker, (tp, pp, vpp, model_dirs, PipelineSplit(**split), archs), errors[key]))
    errors["roundtrip"] = str(root / "roundtrip.error")
    errors["sdpa"] = str(root / "sdpa.error")
    calls[1].append((_sdpa_worker, (model_dirs,), errors["sdpa"]))
    calls[4].append((_roundtrip_and_critic_worker, (model_dirs,), errors["roundtrip"]))
    for world, world_calls in sorted(calls.items()):
        spawn_each(world, world_calls)
    return errors


@pytest.mark.parametrize("world, tp, pp, vpp", LAYOUTS,
                         ids=["TP1PP1", "TP2PP1", "TP1PP2", "TP2PP2", "TP1PP1xDP2", "TP1PP2VPP2"])
def test_actor_log_probs_equal_transformers(worlds, world, tp, pp, vpp):
    raise_if_failed(worlds[(world, tp, pp, vpp)])


@pytest.mark.parametrize("world, tp, pp, vpp, split, archs", UNEVEN,
                         ids=["PP2first1", "TP2PP2last1", "PP4first1last1", "PP2VPP2embloss", "PP2emb"])
def test_uneven_pipeline_places_and_computes_what_transformers_computes(worlds, world, tp, pp, vpp, split, archs):
    raise_if_failed(worlds[(world, tp, pp, vpp, tuple(sorted(split.items())))])


def _roundtrip_and_critic_worker(rank, world, dirs):
    setup(2, 2)
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from megappo.convert import iter_hf_tensors

    from megappo.layout import RankCoords

    # HF -> Megatron (TP2PP2) -> per-tensor generator -> HF: bit for bit, on every rank
    for arch in ARCHS:
        path = os.path.join(dirs, arch)
        info, cfg, chunks = build(path, 2, 2)
        # megatron must know which parameters are TP-split (grad norm, checkpoints)
        from megappo.convert import param_maps
        split = {pm.megatron for pm in param_maps(info.desc) if pm.partition_dim is not None}
        split.add("output_layer.weight")  # vocab-parallel, also as the tied copy on the last stage
        for name, p in chunks[0].named_parameters():
            g = name.split(".")
            is_split = any(n.endswith(".".join(g[3:])) for n in split) if name.startswith("decoder.layers.") \
                else name in split
            assert bool(getattr(p, "tensor_model_parallel", False)) == is_split, name
        original = load_file(os.path.join(path, "model.safetensors"))
        seen = set()
        for name, t in iter_hf_tensors(chunks, info.desc, RankCoords.from_megatron()):
            assert name in original, f"{arch}: generator yielded unknown tensor {name}"
            assert t.dtype == original[name].dtype and torch.equal(t, original[name]), f"{arch}: {name} differs"
            seen.add(name)
        expected = set(original) - ({"lm_head.weight"} if info.desc.tie_word_embeddings else set())
        assert seen == expected, f"{arch}: missing from the generator: {sorted(expected - seen)}"
        _check_shared_gather(chunks, info, original, arch)

    # Critic: values (B, S) and a gradient on every backbone parameter and the head
    path = os.path.join(dirs, "qwen3")
    info, cfg, chunks = build(path, 2, 2, value_head=True)
    batches = _batches(0)

    def loss(output, ids):
        assert output.shape == (ids.shape[0], ids.shape[1], 1), output.shape
        values = output[..., 0]
        return (values.float() ** 2).mean(), {"values": values.detach()}

    out = run_schedule(chunks, batches, loss, forward_only=False)
    if ps.is_pipeline_last_stage():
        assert len(out) == len(batches) and out[0]["values"].shape == (2, SEQ)
        assert chunks[0].output_layer.weight.shape == (1, info.desc.hidden_size)
    for name, p in chunks[0].named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient reached {name}"


def _check_shared_gather(chunks, info, original, arch):
    """The shared-memory gather yields what the collectives yield, picks up changed weights at
    every sync, and leaves no file behind."""
    from unittest import mock

    import torch.distributed as dist

    from megappo.convert import shm
    from megappo.convert import iter_hf_tensors, plan_shared_gather
    from megappo.layout import RankCoords

    coords = RankCoords.from_megatron()
    shared = plan_shared_gather(chunks, info.desc, coords)
    assert shared is not None, "4 CPU ranks on one host must use shared memory"
    assert not [f for f in os.listdir(shm.SHM_DIR) if shared.token in f], "segment file left in /dev/shm"
    first = [(n, t.clone()) for n, t in iter_hf_tensors(chunks, info.desc, coords, shared=shared)]
    assert [n for n, _ in first] == [n for n, _ in iter_hf_tensors(chunks, info.desc, coords)]
    for name, t in first:
        assert torch.equal(t, original[name]), f"{arch}: {name} differs through shared memory"
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.add_(1.0)
    for name, t in iter_hf_tensors(chunks, info.desc, coords, shared=shared, dtype=torch.float64):
        assert t.dtype == torch.float64
        assert torch.equal(t, (original[name] + 1).double()), f"{arch}: {name} is stale after the second sync"
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.sub_(1.0)
    # One rank without room in /dev/shm: the whole group falls back to collectives together.
    full = os.statvfs_result((4096,) * 2 + (0,) * 8)
    with mock.patch.object(shm.os, "statvfs", return_value=full) if dist.get_rank() == 1 else contextlib.nullcontext():
        assert plan_shared_gather(chunks, info.desc, coords) is None


def test_roundtrip_bit_exact_and_critic_gradients_tp2pp2(worlds):
    raise_if_failed(worlds["roundtrip"])


def _sdpa_worker(rank, world, dirs):
    """SdpaCoreAttention against megatron's DotProductAttention (the reference it replaces in the
    local spec): outputs and q/k/v gradients, causal and unmasked, grouped and plain heads; and
    which one the local spec picks."""
    setup(1, 1)
    import dataclasses

    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megappo.models import SdpaCoreAttention, describe, layer_spec, load_hf_config, transformer_config

    info = describe(load_hf_config(os.path.join(dirs, "qwen3")))
    base = transformer_config(info, cpu=True)
    g = torch.Generator().manual_seed(3)
    for groups in (base.num_query_groups, base.num_attention_heads):
        config = dataclasses.replace(base, num_query_groups=groups)
        for mask in (AttnMaskType.causal, AttnMaskType.no_mask):
            kw = dict(config=config, layer_number=1, attn_mask_type=mask, attention_type="self")
            ref, fast = DotProductAttention(**kw), SdpaCoreAttention(**kw)
            s, b, d = 9, 3, config.kv_channels
            q = torch.randn(s, b, config.num_attention_heads, d, generator=g)
            k, v = (torch.randn(s, b, groups, d, generator=g) for _ in range(2))
            outs, grads = [], []
            for attn in (ref, fast):
                leaves = [x.clone().requires_grad_() for x in (q, k, v)]
                out = attn(*leaves, attention_mask=None)
                (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
                outs.append(out.detach())
                grads.append([x.grad for x in leaves])
            assert outs[0].shape == outs[1].shape == (s, b, config.num_attention_heads * d)
            diff = (outs[0] - outs[1]).abs().max().item()
            assert diff < 1e-5, f"{groups} groups, {mask}: output diff {diff}"
            for name, a, c in zip("qkv", *grads):
                gd = (a - c).abs().max().item()
                assert gd < 1e-5, f"{groups} groups, {mask}: d{name} diff {gd}"
    try:
        fast(q, k, v, attention_mask=torch.ones(b, 1, s, s, dtype=torch.bool))
    except ValueError as e:
        assert "explicit attention mask" in str(e)
    else:
        raise AssertionError("a mask tensor was ignored")

    def core(config):
        spec = layer_spec(config, info.desc.qk_layernorm, use_te=False)
        return spec.layer_specs[0].submodules.self_attention.submodules.core_attention

    assert core(base) is SdpaCoreAttention
    for change in (dict(window_size=(4, 0)), dict(attention_dropout=0.1), dict(apply_query_key_layer_scaling=True)):
        assert core(dataclasses.replace(base, **change)) is DotProductAttention, change


def test_sdpa_core_attention_equals_megatrons(worlds):
    raise_if_failed(worlds["sdpa"])
