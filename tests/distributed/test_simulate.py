"""megappo.simulate: a small but real simulation (a tiny Qwen3 at TP2 x PP2 x DP2 on a fake world
of 8 ranks, one process). Its state bytes against a hand count of the model's parameters and the
bytes per parameter megatron's buffers hold; its accounting of fake tensors against the same
run on real tensors; context parallelism's gathered keys and values against a hand count; and
``python -m megappo.plan --simulate``'s output."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
H, F, L, HEADS, GROUPS, D, V = 256, 512, 4, 4, 2, 64, 1000
TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": H, "intermediate_size": F,
        "num_hidden_layers": L, "num_attention_heads": HEADS, "num_key_value_heads": GROUPS, "head_dim": D,
        "vocab_size": V, "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "rope_theta": 10000.0}

SCRIPT = """
import dataclasses, json, sys
from megappo import plan as P, simulate as S
hf, tp, pp, dp, fake, cp = json.loads(sys.argv[1]), *map(int, sys.argv[2:7])
role = lambda **kw: P.RoleOptions(train_tokens=512, forward_tokens=512, **kw)
o = P.PlanOptions(tp=tp, pp=pp, dp=dp, cp=cp, micro_batches=4, actor=role(), critic=role(recompute="full"))
print(json.dumps([dataclasses.asdict(S.simulate_stage(hf, o, s, fake=bool(fake))) for s in range(pp)]))
"""


def _simulate(tp, pp, dp, fake=True, cp=1):
    r = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(TINY), str(tp), str(pp), str(dp), str(int(fake)),
                        str(cp)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _hand_count(tp, stage, pp, critic):
    """Parameters of one TP rank of a stage, from the config's shapes: q, k, v and o projections,
    SwiGLU's three matrices (split over TP), the two layer norms and the q/k norms (whole); the
    embedding (vocabulary padded to 128 x TP) on the first stage; the final norm and the output
    layer (the critic: a (1, H) head and its bias) on the last."""
    layer = (H * HEADS * D + 2 * H * GROUPS * D + HEADS * D * H + 3 * H * F) // tp + 2 * H + 2 * D
    vocab = -(-V // (128 * tp)) * 128 * tp // tp
    n = L // pp * layer
    if stage == 0:
        n += vocab * H
    if stage == pp - 1:
        n += H + (H + 1 if critic else vocab * H)
    return n


@pytest.fixture(scope="module")
def tp2pp2dp2():
    return _simulate(2, 2, 2)


def test_state_bytes_equal_a_hand_count_of_the_parameters(tp2pp2dp2):
    assert [r["rank"] for r in tp2pp2dp2] == [1, 5]        # the last TP rank, DP rank 0 of each stage
    for r in tp2pp2dp2:
        for role, st in r["state"].items():
            n = _hand_count(2, r["stage"], 2, role == "critic")
            assert r["parameters"][role] == n, (r["stage"], role)
            # bf16 weights (the fake mode adds one 4-byte scalar once, with the first model)
            assert 0 <= st["weights"] - 2 * n <= 4, (r["stage"], role, st)
            # DDP: an fp32 gradient buffer and a bf16 parameter buffer of N >= n elements (padded
            # to multiples of 128), the weights moving into the latter
            N = st["buffer_elements"]
            assert N % 128 == 0 and n <= N < n + 128 * 16, (n, N)
            assert st["grads"] == 4 * N + 2 * N - 2 * n
            # distributed optimizer over DP2: fp32 main weights + Adam's two moments of this
            # rank's N / 2 elements less the padding among them, and a 4-byte step counter per
            # parameter tensor of the shard
            assert 12 * (N // 2 - (N - n)) <= st["optimizer"] <= 12 * N // 2 + 4 * 16, st


def test_phases_have_their_passes_peaks(tp2pp2dp2):
    last = tp2pp2dp2[1]
    # the last stage's log-prob pass holds at least the bf16 logits of 512 tokens x V / TP
    assert last["passes"]["old_log_prob"] >= 512 * (1024 // 2) * 2
    for r in tp2pp2dp2:
        assert set(r["transient"]) == {"old_log_prob", "values", "update_critic", "update_actor"}
        # full recomputation keeps less of the critic's layers than the actor keeps without it
        assert r["passes"]["update_critic"] < r["passes"]["update_actor"]
        assert r["steps"]["update_actor"] > 0


def test_fake_tensors_account_as_real_tensors_allocate():
    fake, real = _simulate(1, 1, 1), _simulate(1, 1, 1, fake=False)
    for key in ("parameters", "transient", "passes", "steps"):
        assert fake[0][key] == real[0][key], key
    for role in ("actor", "critic"):
        f, r = fake[0]["state"][role], real[0]["state"][role]
        assert 0 <= f.pop("weights") - r.pop("weights") <= 4 and f == r


@pytest.fixture(scope="module")
def cp2():
    return _simulate(1, 1, 1, cp=2)


def test_fake_tensors_account_as_real_tensors_allocate_at_cp2(cp2):
    """Context parallelism's gathers (keys and values, per-token outputs) on the fake backend:
    fake and real tensors account alike."""
    fake, real = cp2, _simulate(1, 1, 1, fake=False, cp=2)
    for key in ("parameters", "transient", "passes", "steps", "flops"):
        assert fake[0][key] == real[0][key], key


def test_context_parallelism_keeps_the_gathered_keys_and_values(cp2):
    """The same 512 tokens per GPU at CP2 and at CP4 (world 2 and 4): each layer of the actor's
    update keeps, for its backward, the keys and values gathered from the other CP ranks
    ((CP - 1) x 512 tokens x 2 x GROUPS x D, bf16) and the gather's reordering index (int64, one
    per position of the CP x 512-token row, for k and for v): CP4 keeps 2 x 512 tokens' more of
    each than CP2, and nothing else more at the pass's peak. The distributed optimizer's state
    is sharded over DP x CP."""
    cp4 = _simulate(1, 1, 1, cp=4)
    a, b, T = cp2[0], cp4[0], 512
    kv = L * (4 - 2) * T * 2 * GROUPS * D * 2
    index = L * 2 * (4 - 2) * T * 8
    assert b["passes"]["update_actor"] - a["passes"]["update_actor"] == kv + index
    # attention's products against the keys of 2 more ranks' tokens (4 b h s_q s_k d forward,
    # full products, as torch's formulas count them)
    assert b["flops"]["old_log_prob"] - a["flops"]["old_log_prob"] == L * 4 * HEADS * T * (4 - 2) * T * D
    for res, cp in ((a, 2), (b, 4)):
        n, N = res["parameters"]["actor"], res["state"]["actor"]["buffer_elements"]
        # a 4-byte step counter per parameter tensor of the shard (35 in the model: 8 per layer,
        # the embedding, the final norm and the output layer)
        assert 12 * (N // cp - (N - n)) <= res["state"]["actor"]["optimizer"] <= 12 * N // cp + 4 * 35, cp


@pytest.mark.parametrize("cp", [1, 2])
def test_plan_simulate_prints_simulated_beside_planned(tmp_path, cp):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    r = subprocess.run([sys.executable, "-m", "megappo.plan", "--simulate", "--stage", "1", "--config",
                        "parallel_configs/qwen3_8b.yaml", "--model-config", str(tmp_path / "config.json"),
                        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512", "critic.ppo_max_token_len_per_gpu=512",
                        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=512",
                        "critic.forward_max_token_len_per_gpu=512", "trainer.gpu_memory_gb=80",
                        f"actor_rollout_ref.actor.megatron.context_parallel_size={cp}"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    layout = "TP2 PP2 DP2, world 8" if cp == 1 else "TP2 PP2 CP2 DP1, world 8"
    assert "simulated memory per GPU (simulated, not measured on a GPU)" in out and layout in out
    assert "pipeline stage 1 (rank 5" in out and "pipeline stage 0 (rank" not in out
    assert "compute per GPU per step (the training passes at full lengths" in out and "(a planning figure)" in out
    for phase in ("old_log_prob", "values", "update_critic", "update_actor"):
        assert any(line.split()[:1] == [phase] and line.count("GiB") == 2 for line in out.splitlines()
                   if "rank" not in line), phase


def test_mixture_of_experts_simulates_with_balanced_routing():
    """A tiny Qwen3-MoE at EP2 over DP2 (world 2): each rank holds half the experts, whole; the
    distributed optimizer shards the dense parameters over DP2 and the experts over their
    expert-data-parallel group (TP x DP / EP = 1 rank); the passes run on balanced routing."""
    E, K, FE = 4, 2, 128
    moe = dict(TINY, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=E,
               num_experts_per_tok=K, moe_intermediate_size=FE, mlp_only_layers=[], decoder_sparse_step=1)
    script = SCRIPT.replace("P.PlanOptions(tp=tp", "P.PlanOptions(ep=2, tp=tp").replace(
        ", critic=role(recompute=\"full\")", "")
    r = subprocess.run([sys.executable, "-c", script, json.dumps(moe), "1", "1", "2", "1", "1"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    (res,) = json.loads(r.stdout.strip().splitlines()[-1])
    experts = L * (E // 2) * 3 * H * FE
    dense = L * (H * HEADS * D + 2 * H * GROUPS * D + HEADS * D * H + 2 * H + 2 * D + H * E) + 2 * 1024 * H + H
    assert res["parameters"]["actor"] == dense + experts
    st = res["state"]["actor"]
    # bf16 weights, plus the router's small per-layer buffers (token counts per expert)
    assert 0 <= st["weights"] - 2 * (dense + experts) <= 4 + L * 64
    assert 12 * (dense // 2 + experts) <= st["optimizer"] <= 12 * (dense // 2 + experts) + 12 * 128 * 4 + 4 * 64
    assert set(res["transient"]) == {"old_log_prob", "update_actor"} and res["passes"]["update_actor"] > 0


PLANNED = """
import json, sys
from dataclasses import replace
from megappo import plan as P, simulate as S
hf, cp = json.loads(sys.argv[1]), int(sys.argv[2])
role = lambda **kw: P.RoleOptions(train_tokens=4096, forward_tokens=4096, **kw)
o = P.PlanOptions(tp=2, pp=2, dp=2 // cp, cp=cp, micro_batches=4, layer_spec="local", actor=role(), critic=role(recompute="full"),
                  ref=role(trains=False))
p = P.plan(P.model_shape(hf), o)
rows = []
for s in range(2):
    r = S.simulate_stage(hf, o, s)
    for phase, total in P.simulated_totals(p, r).items():
        row, name = p.table[s][phase], S._PHASE_ROLE[phase]
        n = P.stage_params(p.model, 2, 2, s, value_head=name == "critic")
        rows.append([s, phase, total, p.total(s, phase), r.passes[phase], row["activations"] + row["logits"],
                     r.steps.get(phase, 0), P.optimizer_step_bytes(n, o, getattr(o, name))])
print(json.dumps(rows))
"""


@pytest.mark.parametrize("cp", [1, 2])
def test_planner_is_within_ten_percent_of_the_simulation_at_real_width(cp):
    """Qwen3-8B's shapes (hidden 4096, FFN 12288, 32/8 heads, its 152k vocabulary) shrunk to 4
    layers, at TP2 x PP2 x DP2 (and TP2 x PP2 x CP2: 4k tokens per GPU of 8k-token sequences,
    the gathered keys and values kept) with 4k-token micro-batches per GPU: the actor without recomputation, the
    critic with full recomputation, a reference. Every phase of both stages: the planner's total
    (local layer spec, as simulated) within 10% of the simulated one, which the simulation
    measures by counting fake storages, not by the planner's formulas. The transient parts alone
    too: each pass's peak (activations and logits) and the optimizer step's temporary."""
    hf = json.loads((REPO / "src/megappo/model_configs/Qwen3-8B.json").read_text())
    hf["num_hidden_layers"] = 4
    r = subprocess.run([sys.executable, "-c", PLANNED, json.dumps(hf), str(cp)], capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert {(s, phase) for s, phase, *_ in rows} == {(s, p) for s in (0, 1) for p in
                                                     ("old_log_prob", "ref", "values", "update_critic", "update_actor")}
    for what, col in (("total", 2), ("pass", 4), ("optimizer step", 6)):
        gaps = {(row[0], row[1]): round(row[col + 1] / row[col] - 1, 3) for row in rows if row[col]}
        assert gaps and all(abs(g) <= 0.10 for g in gaps.values()), (what, gaps)


FLOPS = """
import json, sys, torch, transformers
from megappo import plan as P, simulate as S
hf = json.loads(sys.argv[1])
role = lambda **kw: P.RoleOptions(train_tokens=512, forward_tokens=512, **kw)
o = P.PlanOptions(tp=1, pp=1, dp=1, micro_batches=1, actor=role(), critic=role(recompute="full"),
                  step_tokens=4096, actor_epochs=2, critic_epochs=1)
r = S.simulate_stage(hf, o, 0)
cfg = transformers.AutoConfig.for_model(**hf)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
m = transformers.AutoModelForCausalLM.from_config(cfg)
ids = torch.randint(0, hf["vocab_size"], (1, 512))
from torch.utils.flop_counter import FlopCounterMode
aten = torch.ops.aten
cpu = {aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *a, out_shape=None, **kw: 4 * q[0] * q[1] * q[2] * k[2] * q[3],
       aten._scaled_dot_product_flash_attention_for_cpu_backward:
           lambda g, q, k, v, *a, out_shape=None, **kw: 10 * q[0] * q[1] * q[2] * k[2] * q[3]}
with FlopCounterMode(display=False, custom_mapping=cpu) as fwd, torch.no_grad():   # torch's own counter
    m(ids)
with FlopCounterMode(display=False, custom_mapping=cpu) as train:
    m(ids).logits.float().log_softmax(-1).sum().backward()
print(json.dumps({"sim": r.flops, "tokens": r.tokens, "hf_fwd": fwd.get_total_flops(),
                  "hf_train": train.get_total_flops(), "step": P.step_flops(o, r),
                  "lines": P.compute_lines(o, [r])}))
"""


def test_simulated_flops_equal_transformers_counted_the_same_way():
    """The simulated passes' FLOPs (megatron's layers, fake tensors, megappo's counting mode)
    against transformers' model of the same config run on real tensors under torch's
    FlopCounterMode (attention: 4 b h s s d forward, 10 backward, as its flash formulas): the
    actor's log-prob pass
    equals its forward, the actor's update its forward and backward; the critic's forward has a
    one-unit head instead of the vocabulary, its update one more forward of the layers (full
    recomputation). The step's figure is those per token times the tokens and epochs."""
    hf = dict(TINY, vocab_size=1024)   # no vocabulary padding: the same output layer on both sides
    r = subprocess.run([sys.executable, "-c", FLOPS, json.dumps(hf)], capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    sim, T = got["sim"], 512
    assert got["tokens"] == dict.fromkeys(sim, T)
    assert sim["old_log_prob"] == got["hf_fwd"] > 0
    assert sim["update_actor"] == got["hf_train"] > 2.9 * got["hf_fwd"]
    head = 2 * T * H * 1024
    assert sim["values"] == got["hf_fwd"] - head + 2 * T * H
    layers = got["hf_fwd"] - head          # the forward of the decoder layers alone
    assert sim["update_critic"] == got["hf_train"] - 3 * head + 3 * 2 * T * H + layers
    per_token = {k: v / T for k, v in sim.items()}
    want = 4096 * (per_token["old_log_prob"] + per_token["values"] + 2 * per_token["update_actor"]
                   + per_token["update_critic"])
    assert got["step"] == pytest.approx(want, rel=1e-12)
    (line,) = got["lines"]
    assert f"{want / 1e12:,.0f} TFLOP on pipeline stage 0; at 40% MFU of an H100 SXM (989 TFLOP/s" in line
    assert line.endswith(f"this step takes {want / (0.4 * 989.4e12):,.1f} s (a planning figure)")
