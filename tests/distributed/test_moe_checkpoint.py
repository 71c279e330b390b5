"""Checkpoints and converters of Qwen3-MoE actors with expert parallelism.

An actor (Adam; distributed optimizer on and off) trained two steps on the tiny MoE at EP2
(world 2, TP1) is saved and loaded (a) at EP2 again, (b) at EP1 on the same two ranks, (c) at
TP2 x EP2 with sequence parallelism and at PP2 x EP2 (world 4); one saved at EP1 loads at EP2.
The reference for each comparison is the saving actor's own weights (full HF tensors gathered
with iter_hf_tensors) before and after one more optimizer step: a step on zero gradients (Adam
moves every weight by lr * m_hat / (sqrt(v_hat) + eps): it depends on exp_avg, exp_avg_sq and
the step count only, elementwise, so it is bit-exact at any layout) and, at the saving layout,
one more real update. The converter exports an EP2 and a TP2 x EP2 checkpoint to HF folders that
transformers loads (per-expert names) with tensors equal to the actor's, bit for bit; an HF ->
megatron import loads at TP2 x EP2 bit-exact and verifies against transformers; mismatched
expert counts fail with one line naming the tensor."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from harness import spawn
from mcore import safetensors_tensors

pytestmark = pytest.mark.distributed
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
from tiny_models import hf_config, save_tiny_model  # noqa: E402

VARIANTS = (("distopt", True), ("adam", False))   # megatron's distributed optimizer on / off
_IDS = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(17))


def _actor(path, tp, ep, dist_opt=None, weights=True, pp=1):
    """The MoE actor at TP x PP x EP (sequence parallel with TP > 1), with the HF weights unless
    not ``weights``; no optimizer when ``dist_opt`` is None."""
    from megappo.convert import load_hf_weights
    from megappo.layout import RankCoords
    from megappo.models import build_model, describe, initialize_parallel, load_hf_config, transformer_config
    from megappo.workers import Actor

    initialize_parallel(tp, pp, ep=ep)
    info = describe(load_hf_config(path), tp=tp)
    cfg = transformer_config(info, tp=tp, pp=pp, sequence_parallel=tp > 1, cpu=True, ep=ep)
    chunks = build_model(info, cfg)
    if weights:
        load_hf_weights(chunks, path, info.desc, RankCoords.from_megatron())
    kw = {} if dist_opt is None else dict(lr=1e-2, clip_grad=1.0, use_distributed_optimizer=dist_opt)
    return info, Actor(chunks, cfg, vocab_size=info.desc.vocab_size, **kw)


def _hf(actor, info):
    """Every HF tensor of the model, full, on every rank (experts from their EP rank)."""
    from megappo.convert import iter_hf_tensors
    from megappo.layout import RankCoords

    return {k: v.clone() for k, v in iter_hf_tensors(actor.chunks, info.desc, RankCoords.from_megatron())}


def _batch():
    from megatron.core import parallel_state as ps
    from test_workers import _global_batch

    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    return _global_batch().select(list(range(r * 8 // dp, (r + 1) * 8 // dp)))


def _update(actor, batch):
    batch.old_log_prob = actor.compute_log_prob(batch, 2)
    actor.update_policy(batch, mini_batch_size=len(batch), micro_batch_size=2)   # one optimizer step


def _zero_grad_step(actor):
    actor._zero_grad()
    ok, _, _ = actor.optimizer.step()
    assert ok


def _diff(ref, got):
    """Names whose tensors differ (and the largest difference); the name sets must agree."""
    assert set(ref) == set(got), sorted(set(ref) ^ set(got))[:5]
    bad = {k: (ref[k] - got[k]).abs().max().item() for k in ref if not torch.equal(ref[k], got[k])}
    return {"n": len(bad), "max": max(bad.values(), default=0.0), "names": sorted(bad)[:4]}


def _optim_steps(actor):
    from megappo.checkpoint import _inner_states

    return sorted({float(st["step"]) for st in _inner_states(actor)})


def _run(root, name):
    return os.path.join(root, "runs", name)


def _save_at_ep2(rank, world, src, root):
    """World 2, TP1 x EP2 (DP 2, expert-DP 1): train, save, continue; load back at EP2 and EP1."""
    from megappo import megatron_cpu

    megatron_cpu.install()
    from megappo.checkpoint import load_checkpoint, save_checkpoint

    out = {}
    for name, dist_opt in VARIANTS:
        info, a = _actor(src, 1, 2, dist_opt)
        batch = _batch()
        _update(a, batch)
        _update(a, batch)   # Adam's step 2: a load that kept a fresh optimizer's step (1) shows
        save_checkpoint(_run(root, name), 1, {"actor": a}, {"variant": name}, hf_sources={"actor": src})
        r = {"steps_saved": _optim_steps(a), "sched_saved": a.scheduler.num_steps}
        saved = _hf(a, info)
        _zero_grad_step(a)
        probed = _hf(a, info)
        _update(a, batch)
        continued = _hf(a, info)
        r["probe_moved"] = _diff(saved, probed)["n"]
        r["update_moved"] = _diff(probed, continued)["n"]
        if rank == 0:
            torch.save({"saved": saved, "probed": probed}, os.path.join(root, f"{name}.pt"))
        for ep in (2, 1):   # EP1: every expert on both ranks, dense and expert optimizers one
            info, b = _actor(src, 1, ep, dist_opt)
            state = load_checkpoint(os.path.join(_run(root, name), "global_step_1"), {"actor": b})
            r[f"ep{ep}_state"] = state
            r[f"ep{ep}_load"] = _diff(saved, _hf(b, info))
            r[f"ep{ep}_steps"] = _optim_steps(b)
            r[f"ep{ep}_sched"] = b.scheduler.num_steps
            r[f"ep{ep}_chain"] = len(getattr(b.optimizer, "chained_optimizers", [b.optimizer]))
            _zero_grad_step(b)
            r[f"ep{ep}_probe"] = _diff(probed, _hf(b, info))
            _update(b, batch)
            r[f"ep{ep}_update"] = _diff(continued, _hf(b, info))
        # and back: saved at EP1 (one optimizer, step 4), loaded at EP2 (a chain of two)
        save_checkpoint(_run(root, f"{name}_ep1"), 3, {"actor": b}, {})
        saved, steps = _hf(b, info), _optim_steps(b)
        _zero_grad_step(b)
        probed = _hf(b, info)
        info, d = _actor(src, 1, 2, dist_opt)
        load_checkpoint(os.path.join(_run(root, f"{name}_ep1"), "global_step_3"), {"actor": d})
        r["back_load"], r["back_steps"] = _diff(saved, _hf(d, info)), [steps, _optim_steps(d)]
        _zero_grad_step(d)
        r["back_probe"] = _diff(probed, _hf(d, info))
        out[name] = r
    # a critic on the MoE backbone (random value head, no optimizer): its values on fixed tokens
    from megappo.models import build_model, describe, load_hf_config, transformer_config
    from megappo.convert import load_hf_weights
    from megappo.layout import RankCoords
    from megappo.workers import Critic
    from mcore import run_schedule

    info = describe(load_hf_config(src), value_head=True)
    cfg = transformer_config(info, cpu=True, ep=2)
    chunks = build_model(info, cfg, value_head=True, value_head_std=(info.desc.hidden_size + 1) ** -0.5)
    load_hf_weights(chunks, src, info.desc, RankCoords.from_megatron())
    save_checkpoint(_run(root, "critic"), 1, {"critic": Critic(chunks, cfg)}, {}, hf_sources={"critic": src})
    with torch.no_grad():
        values = run_schedule(chunks, [_IDS], lambda o, ids: (o.sum() * 0.0, {"v": o[..., 0].detach()}))[0]["v"]
    if rank == 0:
        torch.save(values, os.path.join(root, "critic_values.pt"))
        with open(os.path.join(root, "ep2.json"), "w") as f:
            json.dump(out, f)


def _load_at_tp2ep2(rank, world, src, src8, imported, root):
    """World 4, TP2 x EP2 with sequence parallel (DP 2, expert-DP 2): load both checkpoints, then
    save one of this layout (for the converter); load at PP2 x EP2; load the HF import; fail on
    8 experts."""
    from megappo import megatron_cpu

    megatron_cpu.install()
    from megappo.checkpoint import CheckpointError, load_checkpoint, load_worker, save_checkpoint
    from megappo.convert import SafetensorsCheckpoint

    out = {}
    for name, dist_opt in VARIANTS:
        ref = torch.load(os.path.join(root, f"{name}.pt"))
        info, a = _actor(src, 2, 2, dist_opt)
        load_checkpoint(os.path.join(_run(root, name), "global_step_1"), {"actor": a})
        r = {"load": _diff(ref["saved"], _hf(a, info)), "steps": _optim_steps(a),
             "chain": len(getattr(a.optimizer, "chained_optimizers", [a.optimizer]))}
        _zero_grad_step(a)
        r["probe"] = _diff(ref["probed"], _hf(a, info))
        out[name] = r
        if name == "distopt":   # a checkpoint saved at this layout, one update further
            _update(a, _batch())
            save_checkpoint(_run(root, "tp2ep2"), 1, {"actor": a}, {}, hf_sources={"actor": src})
            weights = _hf(a, info)
            if rank == 0:
                torch.save(weights, os.path.join(root, "tp2ep2.pt"))
    # PP2 x EP2 (layers 0-1 and 2-3 on two stages, DP 2, expert-DP 1)
    ref = torch.load(os.path.join(root, "distopt.pt"))
    info, a = _actor(src, 1, 2, True, pp=2)
    load_checkpoint(os.path.join(_run(root, "distopt"), "global_step_1"), {"actor": a})
    out["pp2ep2"] = {"load": _diff(ref["saved"], _hf(a, info)), "steps": _optim_steps(a)}
    _zero_grad_step(a)
    out["pp2ep2"]["probe"] = _diff(ref["probed"], _hf(a, info))
    # convert_from_hf's checkpoint (model weights only, experts stored whole) at TP2 x EP2
    info, m = _actor(src, 2, 2, weights=False)
    load_worker(m, imported)
    st = SafetensorsCheckpoint(src)
    out["imported"] = _diff({n: st.read(n) for n in st.names()}, _hf(m, info))
    # a model with 8 experts per layer cannot take a checkpoint of 4
    _, m8 = _actor(src8, 2, 2, weights=False)
    try:
        load_checkpoint(os.path.join(_run(root, "distopt"), "global_step_1"), {"actor": m8})
        out["error8"] = None
    except CheckpointError as e:
        out["error8"] = str(e)
    if rank == 0:
        with open(os.path.join(root, "tp2ep2.json"), "w") as f:
            json.dump(out, f)


_CLI = """
import sys
from megappo.convert.cli import convert_from_hf_main, verify_main
rc = convert_from_hf_main(["--hf", sys.argv[1], "--out", sys.argv[2], "--tp", "2", "--ep", "2", "--quiet"])
assert rc == 0, rc
assert convert_from_hf_main(["--hf", sys.argv[1], "--out", sys.argv[3], "--ep", "3", "--quiet"]) == 2
sys.exit(verify_main(["--ckpt", sys.argv[2], "--hf", sys.argv[1]]))
"""


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_ckpt")
    src, src8, imported = root / "hf", root / "hf8", root / "imported"
    save_tiny_model("qwen3_moe", src, seed=5)
    hf_config("qwen3_moe", num_experts=8).save_pretrained(str(src8))   # a config only
    times = {}
    t = time.time()
    cli = subprocess.run([sys.executable, "-c", _CLI, str(src), str(imported), str(root / "ep3")], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES=""), timeout=300)
    times["convert_from_hf + verify"] = time.time() - t
    t = time.time()
    spawn(_save_at_ep2, 2, str(src), str(root))
    times["EP2 save, EP2/EP1 load"] = time.time() - t
    t = time.time()
    spawn(_load_at_tp2ep2, 4, str(src), str(src8), str(imported), str(root))
    times["TP2xEP2 load and save"] = time.time() - t
    print("moe checkpoint fixture:", {k: round(v, 1) for k, v in times.items()})
    return {"root": root, "src": src, "src8": src8, "imported": imported, "cli": cli,
            "ep2": json.loads((root / "ep2.json").read_text()),
            "tp2ep2": json.loads((root / "tp2ep2.json").read_text())}


def _exact(r):
    assert r["n"] == 0, r


@pytest.mark.parametrize("variant", [v for v, _ in VARIANTS])
def test_resume_at_ep2_and_load_at_ep1(moe, variant):
    r = moe["ep2"][variant]
    # the references move: the zero-gradient step and the update each moved all 77 HF tensors
    assert r["probe_moved"] == 77 and r["update_moved"] == 77, r
    assert r["steps_saved"] == [2.0] and r["sched_saved"] == 2
    for ep in (2, 1):
        assert r[f"ep{ep}_state"] == {"step": 1, "variant": variant}
        _exact(r[f"ep{ep}_load"])                                   # weights, bit for bit
        assert r[f"ep{ep}_steps"] == [2.0] and r[f"ep{ep}_sched"] == 2, r
        _exact(r[f"ep{ep}_probe"])                                  # Adam's m, v and step carried over
    assert r["ep2_chain"] == 2 and r["ep1_chain"] == 1             # dense + expert optimizers vs one
    _exact(r["ep2_update"])                                         # same layout: the same next update
    # EP1 sums the expert gradients in another order: the same update up to round-off (<= 2.8e-7)
    assert r["ep1_update"]["max"] < 1e-5, r["ep1_update"]
    # saved at EP1, loaded at EP2
    assert r["back_steps"] == [[4.0], [4.0]], r["back_steps"]
    _exact(r["back_load"])
    _exact(r["back_probe"])


@pytest.mark.parametrize("variant", [v for v, _ in VARIANTS])
def test_load_at_tp2_ep2(moe, variant):
    r = moe["tp2ep2"][variant]
    assert r["chain"] == 2 and r["steps"] == [2.0], r
    _exact(r["load"])
    _exact(r["probe"])


def test_load_at_pp2_ep2(moe):
    r = moe["tp2ep2"]["pp2ep2"]
    assert r["steps"] == [2.0], r
    _exact(r["load"])
    _exact(r["probe"])


def _load_hf(folder):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


@pytest.mark.parametrize("which", ["ep2", "tp2ep2"])
def test_export_to_hf(moe, tmp_path, which):
    from megappo.convert.cli import convert_to_hf_main

    run = moe["root"] / "runs" / ("distopt" if which == "ep2" else "tp2ep2")
    ref = torch.load(moe["root"] / "distopt.pt")["saved"] if which == "ep2" else torch.load(moe["root"] / "tp2ep2.pt")
    out = tmp_path / "hf"
    assert convert_to_hf_main(["--ckpt", str(run / "global_step_1"), "--out", str(out), "--quiet"]) == 0
    got, src = safetensors_tensors(out), safetensors_tensors(moe["src"])
    # transformers 5's on-disk names (what save_pretrained wrote for the source), one tensor per expert
    assert set(got) == set(src) == set(ref)
    assert "model.layers.3.mlp.experts.3.down_proj.weight" in got and "model.layers.1.mlp.gate.weight" in got
    _exact(_diff(ref, got))
    moved = [k for k in got if ".experts." in k and not torch.equal(got[k], src[k])]
    assert len(moved) >= 12, moved                                  # trained experts, not the source again
    # transformers fuses them on load: [gate; up] per expert, then down
    model = _load_hf(out)
    for layer in (1, 2, 3):
        experts = model.model.layers[layer].mlp.experts
        for e in range(4):
            h = f"model.layers.{layer}.mlp.experts.{e}."
            fused = torch.cat([got[h + "gate_proj.weight"], got[h + "up_proj.weight"]])
            assert torch.equal(experts.gate_up_proj[e], fused)
            assert torch.equal(experts.down_proj[e], got[h + "down_proj.weight"])
        assert torch.equal(model.model.layers[layer].mlp.gate.weight, got[f"model.layers.{layer}.mlp.gate.weight"])


def test_export_critic(moe, tmp_path):
    from transformers import AutoModelForTokenClassification

    from megappo.convert.cli import convert_to_hf_main

    out = tmp_path / "critic"
    assert convert_to_hf_main(["--ckpt", str(moe["root"] / "runs" / "critic" / "global_step_1"), "--critic",
                               "--out", str(out), "--quiet"]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3MoeForTokenClassification"]
    model, info = AutoModelForTokenClassification.from_pretrained(str(out), dtype=torch.float32,
                                                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        values = model.eval()(_IDS).logits[..., 0]
    diff = (values - torch.load(moe["root"] / "critic_values.pt")).abs().max().item()
    assert diff < 1e-5, f"MoE critic: |megatron - transformers| value {diff}"


def test_import_and_verify_cli(moe, tmp_path):
    from megappo.convert.cli import convert_to_hf_main

    cli = moe["cli"]
    assert cli.returncode == 0, (cli.stdout, cli.stderr[-3000:])
    # convert_from_hf --ep 3 refused: 4 experts do not split over 3 ranks (one line, the key named)
    assert "num_experts (4) is not divisible by expert_model_parallel_size (--ep 3)" in cli.stderr, cli.stderr[-2000:]
    assert "max |log-prob difference|" in cli.stdout and "OK" in cli.stdout, cli.stdout
    meta = json.loads((moe["imported"] / "megappo_import.json").read_text())
    assert (meta["tp"], meta["ep"]) == (2, 2)
    # the import loaded at TP2 x EP2 gives the source back, bit for bit; so does its export
    _exact(moe["tp2ep2"]["imported"])
    assert convert_to_hf_main(["--ckpt", str(moe["imported"]), "--out", str(tmp_path / "back"), "--quiet"]) == 0
    src, back = safetensors_tensors(moe["src"]), safetensors_tensors(tmp_path / "back")
    assert set(src) == set(back)
    _exact(_diff(src, back))


def test_expert_count_mismatch_errors(moe, tmp_path, capsys):
    from megappo.convert.cli import convert_to_hf_main

    err = moe["tp2ep2"]["error8"]
    assert err is not None and "\n" not in err
    assert "the checkpoint does not match the model" in err and "decoder.layers.1.mlp.router.weight is (4, 128) " \
        "in the checkpoint, the model has (8, 128)" in err, err
    capsys.readouterr()
    rc = convert_to_hf_main(["--ckpt", str(moe["root"] / "runs" / "distopt"), "--out", str(tmp_path / "x"),
                             "--hf-config", str(moe["src8"]), "--quiet"])
    msg = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in msg and "Traceback" not in msg, msg
    assert "architecture mismatch" in msg and "decoder.layers.1.mlp.router.weight is (4, 128) in the checkpoint, " \
        "the config gives (8, 128)" in msg, msg
    assert not (tmp_path / "x").exists()
