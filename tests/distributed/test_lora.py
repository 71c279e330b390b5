"""LoRA adapters on megatron models (megappo.models.lora) compute what PEFT's LoRA computes on the
transformers model: the same log-probs and the same adapter gradients, no gradient on the base
weights; at TP1, TP2 (with and without sequence parallelism) and TP2 x PP2 (gloo, spawned); the attention's adapters on a
Mixture-of-Experts model (experts and router frozen) at TP1, TP2 and EP2.

PEFT starts B at zero; the tests give every adapter tensor random non-zero values first, so the
fused-QKV / gate-up placement, the scaling and the TP reductions all show in the numbers."""
import json
import os
import sys

import pytest
import torch

from harness import raise_if_failed, spawn_each
from mcore import build, run_schedule, setup

pytestmark = pytest.mark.distributed
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
from tiny_models import VOCAB, save_tiny_model  # noqa: E402

RANK, ALPHA = 8, 16
CASES = {"all": "all-linear", "qv": "q_proj,v_proj", "gate": "gate_proj"}


def _batch():
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, VOCAB, (2, 24), generator=g)
    weights = torch.randn(2, 23, generator=g)
    return ids, weights


def _peft_reference(path, targets, seed):
    """PEFT's LoRA on the HF model, adapters set to random values: log-probs of the batch, the
    adapter tensors and the gradients of sum(log-prob x weight), all by PEFT's saved names."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    modules = targets if targets == "all-linear" else targets.split(",")
    model = get_peft_model(hf, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=modules, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ids, weights = _batch()
    lp = torch.log_softmax(model(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    (lp * weights).sum().backward()
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    grads = {}
    for n, p in model.named_parameters():
        if "lora_" in n:
            grads[n.replace(".default", "")] = p.grad.detach().clone()
        else:
            assert p.grad is None, n
    return lp.detach(), tensors, grads


def _worker(rank, world, tp, pp, sp, path, case, tensors_file, out_file, ep=None):
    setup(tp, pp, ep=ep)
    from megatron.core import parallel_state as ps

    from megappo.distributed import log_probs_from_logits
    from megappo.models import (LoRAError, LoRASpec, apply_lora, export_lora_tensors, load_lora_tensors, lora_targets,
                                set_lora_enabled)

    tp_group = ps.get_tensor_model_parallel_group()
    info, cfg, chunks = build(path, tp, pp, sp=sp, ep=ep or 1)
    ids, weights = _batch()

    def run(backward):
        def loss(output, ids_):
            lp = log_probs_from_logits(output[:, :-1], ids_[:, 1:], tp_group, vocab_size=info.desc.vocab_size)
            value = (lp * weights).sum()
            return value, {"lp": lp.detach()}

        if backward:
            return run_schedule(chunks, [ids], loss, forward_only=False)
        with torch.no_grad():
            return run_schedule(chunks, [ids], loss)

    base = run(False)
    if case == "moe":   # refused before anything is frozen
        with pytest.raises(LoRAError, match="gate_proj, up_proj, down_proj: on a Mixture-of-Experts model LoRA adapts "
                                            "the attention only"):
            apply_lora(chunks, info.desc, LoRASpec(RANK, ALPHA, tuple(lora_targets("all-linear"))))
    apply_lora(chunks, info.desc, LoRASpec(RANK, ALPHA, tuple(lora_targets(CASES.get(case, MOE_TARGETS)))))
    fresh = run(False)   # B starts at zero: exactly the base model
    with pytest.raises(LoRAError, match="has adapters already"):
        apply_lora(chunks, info.desc, LoRASpec(RANK, ALPHA, ("q_proj",)))
    load_lora_tensors(chunks, torch.load(tensors_file))
    set_lora_enabled(chunks, False)
    off = run(False)     # adapters off (the reference policy): exactly the base model
    set_lora_enabled(chunks, True)
    out = run(True)
    if sp and tp > 1:   # what finalize_model_grads does for weights that see one sequence shard
        for c in chunks:
            for p in c.parameters():
                if p.requires_grad and getattr(p, "sequence_parallel", False) and p.grad is not None:
                    torch.distributed.all_reduce(p.grad, group=tp_group)
    for c in chunks:
        for n, p in c.named_parameters():
            if ".lora." in n:
                assert p.requires_grad, n
            else:
                assert not p.requires_grad and p.grad is None, f"base parameter {n} trains or got a gradient"
    grads = export_lora_tensors(chunks, grads=True)
    if ps.is_pipeline_last_stage():
        for a, b, c, d in zip(base, fresh, off, out):
            assert torch.equal(a["lp"], b["lp"]) and torch.equal(a["lp"], c["lp"])
            assert (d["lp"] - a["lp"]).abs().max() > 1e-2   # the adapters matter
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        torch.save({"lp": out[0]["lp"], "grads": grads}, out_file)


LAYOUTS = {1: [(1, 1, False, c) for c in CASES], 2: [(2, 1, True, c) for c in CASES] + [(2, 1, False, "all")],
           4: [(2, 2, True, "all"), (2, 2, True, "qv")]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """PEFT's reference per case, and every layout's results, in one spawned world per world size."""
    root = tmp_path_factory.mktemp("lora")
    path = str(root / "model")
    save_tiny_model("qwen3", path)
    refs = {}
    for i, (case, targets) in enumerate(CASES.items()):
        lp, tensors, grads = _peft_reference(path, targets, seed=100 + i)
        torch.save(tensors, root / f"{case}.tensors.pt")
        refs[case] = (lp, tensors, grads)
    results = {}
    for world, layouts in LAYOUTS.items():
        calls = []
        for tp, pp, sp, case in layouts:
            key = (tp, pp, sp, case)
            results[key] = (str(root / f"out_{tp}_{pp}_{sp}_{case}.pt"), str(root / f"err_{tp}_{pp}_{sp}_{case}"))
            calls.append((_worker, (tp, pp, sp, path, case, str(root / f"{case}.tensors.pt"), results[key][0]),
                          results[key][1]))
        spawn_each(world, calls)
    return refs, results


def _compare(refs, results, key):
    out_file, err = results[key]
    raise_if_failed(err)
    case = key[3]
    lp_ref, tensors, grads_ref = refs[case]
    got = torch.load(out_file)
    assert set(got["grads"]) == set(grads_ref) == set(tensors)   # PEFT's names, PEFT's coverage
    lp_diff = (got["lp"] - lp_ref).abs().max().item()
    rel = {n: ((got["grads"][n] - g).abs().max() / g.abs().max()).item() for n, g in grads_ref.items()}
    worst = max(rel, key=rel.get)
    print(f"{key}: max |log-prob diff| {lp_diff:.2e}; worst adapter-gradient relative diff {rel[worst]:.2e} ({worst})")
    assert lp_diff < 1e-5, lp_diff
    assert rel[worst] < 1e-5, (worst, rel[worst])
    return got


@pytest.mark.parametrize("case", list(CASES))
def test_lora_tp1_equals_peft(runs, case):
    _compare(*runs, (1, 1, False, case))


@pytest.mark.parametrize("key", LAYOUTS[2] + LAYOUTS[4], ids=lambda k: f"tp{k[0]}pp{k[1]}{'sp' if k[2] else ''}_{k[3]}")
def test_lora_parallel_layouts_equal_tp1_and_peft(runs, key):
    got = _compare(*runs, key)
    tp1 = torch.load(runs[1][(1, 1, False, key[3])][0])
    assert (got["lp"] - tp1["lp"]).abs().max().item() < 1e-5
    for n, g in tp1["grads"].items():
        assert (got["grads"][n] - g).abs().max().item() <= 1e-5 * g.abs().max().item(), n


def _train_worker(rank, world, tp, sp, recompute, path, tensors_file, out_file):
    """One real update with megatron's DDP, finalize_model_grads (which sums the sequence-parallel
    B gradients) and optimizer (gradient clipping reads the adapters' TP attributes)."""
    setup(tp, 1)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megappo.convert import load_hf_weights
    from megappo.layout import RankCoords
    from megappo.models import (LoRASpec, apply_lora, build_model, describe, export_lora_tensors, load_hf_config,
                                load_lora_tensors, lora_targets, transformer_config)
    from mcore import train_step

    info = describe(load_hf_config(path), tp=tp)
    cfg = transformer_config(info, tp=tp, sequence_parallel=sp, cpu=True,
                             recompute=("full", "uniform", 1) if recompute else None)
    chunks = build_model(info, cfg)
    load_hf_weights(chunks, path, info.desc, RankCoords.from_megatron())
    adapters = apply_lora(chunks, info.desc, LoRASpec(RANK, ALPHA, tuple(lora_targets("all-linear"))))
    load_lora_tensors(chunks, torch.load(tensors_file))
    base = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters() if not p.requires_grad}
    ddp = [DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=False), c) for c in chunks]
    # SGD with the update clipped to a small global norm: the step is the gradient scaled by the
    # norm megatron computes over all ranks, so a piece counted twice (or not at all) shows
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=10.0, sgd_momentum=0.0, clip_grad=1e-3), ddp)
    in_opt = [p for g in opt.param_groups for p in g["params"]]
    assert len(in_opt) == len(adapters) and {id(p) for p in in_opt} == {id(p) for p in adapters}
    ids, _ = _batch()
    train_step(ddp, opt, info, [ids])
    for c in chunks:
        for n, p in c.named_parameters():
            if n in base:
                assert torch.equal(p, base[n]), f"base parameter {n} changed"
    after = export_lora_tensors(chunks)
    if ps.get_tensor_model_parallel_rank() == 0:
        torch.save(after, out_file)


TRAIN = {1: [(1, False, False)], 2: [(2, True, False), (2, True, True), (2, False, False)]}


def test_lora_update_trains_only_adapters_equal_on_every_layout(tmp_path):
    """One SGD step (gradients clipped, so the global gradient norm must count each adapter
    piece once) gives the same adapters at TP1 and at TP2 with and without sequence parallelism
    and with full recomputation; base weights stay bit-exact and have no optimizer state."""
    path = str(tmp_path / "model")
    save_tiny_model("qwen3", path)
    _, tensors, _ = _peft_reference(path, "all-linear", seed=7)
    torch.save(tensors, tmp_path / "tensors.pt")
    for world, layouts in TRAIN.items():
        calls = [(_train_worker, (tp, sp, rc, path, str(tmp_path / "tensors.pt"), str(tmp_path / f"t_{tp}_{sp}_{rc}.pt")),
                  str(tmp_path / f"err_{tp}_{sp}_{rc}")) for tp, sp, rc in layouts]
        spawn_each(world, calls)
        for tp, sp, rc in layouts:
            raise_if_failed(str(tmp_path / f"err_{tp}_{sp}_{rc}"))
    ref = torch.load(tmp_path / "t_1_False_False.pt")
    moved = max((ref[n] - tensors[n]).abs().max().item() for n in tensors)
    assert moved > 1e-3, moved   # the step changed the adapters
    for tp, sp, rc in TRAIN[2]:
        got = torch.load(tmp_path / f"t_{tp}_{sp}_{rc}.pt")
        diff = max((got[n] - ref[n]).abs().max().item() for n in ref)
        print(f"TP{tp} sp={sp} recompute={rc}: adapters after one step differ from TP1's by at most {diff:.2e} "
              f"(the step moved them by up to {moved:.2e})")
        assert diff < 1e-4 * moved, (tp, sp, rc, diff)


def _cp_worker(rank, world, cp, path, tensors_file, out_file, packed=False):
    """One PPO update of a LoRA actor (the trainer's worker, its DDP and optimizer hold only the
    adapters) with each sequence split over ``cp`` context-parallel ranks (``packed``: each
    micro-batch's sequences end to end in one row)."""
    setup(1, 1, cp=cp)
    from megappo.convert import load_hf_weights
    from megappo.layout import RankCoords
    from megappo.models import (LoRASpec, apply_lora, build_model, describe, export_lora_tensors, load_hf_config,
                                load_lora_tensors, lora_targets, transformer_config)
    from megappo.workers import Actor
    from mcore import random_batch

    info = describe(load_hf_config(path))
    cfg = transformer_config(info, cpu=True, cp=cp)
    chunks = build_model(info, cfg, use_te=False)
    load_hf_weights(chunks, path, info.desc, RankCoords.from_megatron())
    apply_lora(chunks, info.desc, LoRASpec(RANK, ALPHA, tuple(lora_targets("all-linear"))))
    load_lora_tensors(chunks, torch.load(tensors_file))
    actor = Actor(chunks, cfg, vocab_size=info.desc.vocab_size, lr=10.0, clip_grad=1e-3, optimizer="sgd",
                  use_distributed_optimizer=False)
    actor.pack_sequences = packed
    batch = random_batch(4, 5, (5, 13), (3, 11), VOCAB)
    batch.old_log_prob = actor.compute_log_prob(batch, 2)
    actor.update_policy(batch, mini_batch_size=4, micro_batch_size=2)
    if rank == 0:
        torch.save({"old": batch.old_log_prob, "adapters": export_lora_tensors(chunks)}, out_file)


def test_lora_update_at_cp2_equals_cp1(tmp_path):
    """Context parallelism under LoRA, padded and packed: the log-probs and the adapters after
    one clipped SGD step at CP2 are those of CP1 (the base weights frozen, the gradient norm over
    the adapters)."""
    path = str(tmp_path / "model")
    save_tiny_model("qwen3", path)
    _, tensors, _ = _peft_reference(path, "all-linear", seed=7)
    torch.save(tensors, tmp_path / "tensors.pt")
    for cp, packed in ((1, False), (2, False), (2, True)):
        name = f"cp{cp}{'_packed' if packed else ''}"
        spawn_each(cp, [(_cp_worker, (cp, path, str(tmp_path / "tensors.pt"), str(tmp_path / f"{name}.pt"), packed),
                         str(tmp_path / f"err_{name}"))])
        raise_if_failed(str(tmp_path / f"err_{name}"))
    one = torch.load(tmp_path / "cp1.pt")
    moved = max((one["adapters"][n] - tensors[n]).abs().max().item() for n in tensors)
    assert moved > 1e-4, moved   # the step (norm lr x 1e-3 over all adapters) changed them
    for name in ("cp2", "cp2_packed"):
        two = torch.load(tmp_path / f"{name}.pt")
        assert (one["old"] - two["old"]).abs().max() < 1e-5, name
        diff = max((one["adapters"][n] - two["adapters"][n]).abs().max().item() for n in tensors)
        print(f"{name}: adapters after one step differ from CP1's by at most {diff:.2e} (moved up to {moved:.2e})")
        assert diff < 1e-3 * moved, (name, diff, moved)


MOE_TARGETS = "q_proj,k_proj,v_proj,o_proj"
MOE_LAYOUTS = {1: [(1, 1)], 2: [(2, 1), (1, 2)]}   # world -> (TP, EP)


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """The attention's adapters on the tiny Qwen3-MoE (layer 0 dense, the others 4 experts):
    PEFT's reference, and megatron's at TP1, TP2 and EP2."""
    root = tmp_path_factory.mktemp("lora_moe")
    path = str(root / "moe")
    save_tiny_model("qwen3_moe", path)
    lp, tensors, grads = _peft_reference(path, MOE_TARGETS, seed=200)
    torch.save(tensors, root / "tensors.pt")
    results = {}
    for world, layouts in MOE_LAYOUTS.items():
        calls = []
        for tp, ep in layouts:
            results[(tp, ep)] = (str(root / f"out_{tp}_{ep}.pt"), str(root / f"err_{tp}_{ep}"))
            calls.append((_worker, (tp, 1, tp > 1, path, "moe", str(root / "tensors.pt"), results[(tp, ep)][0], ep),
                          results[(tp, ep)][1]))
        spawn_each(world, calls)
    return {"moe": (lp, tensors, grads)}, results


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2sp", "ep2"])
def test_lora_on_moe_equals_peft(moe_runs, tp, ep):
    """Gradients reach the attention's adapters through the frozen router and experts as in
    transformers' model; an MLP module is refused, named."""
    refs, results = moe_runs
    got = _compare(refs, {(tp, 1, tp > 1, "moe"): results[(tp, ep)]}, (tp, 1, tp > 1, "moe"))
    assert len(got["grads"]) == 4 * 4 * 2   # 4 layers x q, k, v, o x A, B
