"""The single-GPU checks, as plain functions of ``device`` and ``dtype``.

The same code runs
- on a real GPU (``tests/gpu/test_gpu_path.py``): ``device=cuda:0``, NCCL at world size 1,
  bfloat16 weights, transformers' reference on the same GPU;
- on CPU under the device check (``tests/gpu/test_gpu_path_cpu_check.py``): one process with
  ``megatron_cpu.install(check_devices=True)`` before gloo, ``device=cuda:0`` simulated, float32,
  transformers' reference on the host (``hf_device=cpu``). Every tensor megappo hands to the model,
  a loss or a collective must then be where it would be on the GPU, or DeviceCheckError is raised.

Each ``check_*`` asserts and returns a dict of figures (names with units or plain ratios); with
``MEGAPPO_GPU_FIGURES=<file>`` each dict is also appended to that file as one JSON line, which
``benchmarks/gpu_check.sh`` folds into its final JSON.

Only torch is imported at module level: megatron-core, transformers and megappo's model code are
imported inside the functions, so test collection never fails where they are missing.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from tiny_models import VOCAB, hf_config, save_tiny_model  # noqa: E402

# Realistic-ish lengths for a tiny model: two sequences of up to 256 tokens, different prompt and
# response lengths (right padding, a shorter response), split into two micro-batches.
PROMPT_LENS = (64, 48)
RESPONSE_LEN = 192
SHORT_RESPONSE = 150
# initializer_range 0.05 instead of transformers' 0.02: logits spread over several nats, so
# log-probs are not all ~log(1/VOCAB) and a wrong layer shows up as a large difference.
INIT_RANGE = 0.05

FIGURES_ENV = "MEGAPPO_GPU_FIGURES"


# -- set-up --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world(device: torch.device) -> None:
    """torch.distributed at world size 1 as the trainer does it: NCCL with the current CUDA device
    set on a GPU, gloo otherwise (on CPU call ``megatron_cpu.install`` first). Idempotent."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    real_cuda = device.type == "cuda" and torch.cuda.is_available()
    if real_cuda:
        torch.cuda.set_device(device.index or 0)
    dist.init_process_group("nccl" if real_cuda else "gloo", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))


def ensure_parallel() -> None:
    """megatron's parallel state TP1 PP1 (DP1), created once per process."""
    from megatron.core import parallel_state as ps

    from megappo.models import initialize_parallel

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() != 1 \
            or ps.get_pipeline_model_parallel_world_size() != 1:
        initialize_parallel(1, 1)


def te_reason() -> Optional[str]:
    """None when the TransformerEngine spec can be built here, else why not."""
    if not torch.cuda.is_available():
        return "TransformerEngine needs CUDA"
    try:
        from megappo.models import te_available
    except ImportError as e:
        return f"megatron-core is not importable ({e})"
    return None if te_available() else "TransformerEngine is not installed (or megatron cannot use it)"


def record(figures: dict) -> dict:
    path = os.environ.get(FIGURES_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(figures) + "\n")
    print(json.dumps(figures))
    return figures


def finish(fig: dict, conditions) -> dict:
    """Record the figures first (they reach gpu_check.sh's JSON even when a bound fails), then
    assert every ``(ok, what)`` condition, naming all that failed."""
    record(fig)
    failed = [what for ok, what in conditions if not ok]
    assert not failed, f"{fig['check']}: {'; '.join(failed)}\n{json.dumps(fig)}"
    return fig


# -- models and data -----------------------------------------------------------------------------
def model_dirs(root) -> dict:
    """The HF folders the checks use, made once under ``root``: the policy (float32 and bfloat16
    copies of the same weights) and a one-label reward model."""
    root = Path(root)
    dirs = {"policy": root / "policy", "policy_bf16": root / "policy_bf16", "rm": root / "rm"}
    if not (dirs["policy"] / "config.json").exists():
        hf = save_tiny_model("qwen3", dirs["policy"], seed=0, initializer_range=INIT_RANGE)
        # The same weights rounded to bfloat16: importing them into a bf16 model and exporting
        # again must give these bits back.
        hf.to(torch.bfloat16).save_pretrained(str(dirs["policy_bf16"]), safe_serialization=True)
    if not (dirs["rm"] / "config.json").exists():
        from transformers import AutoModelForTokenClassification

        torch.manual_seed(4)
        cfg = hf_config("qwen3", num_labels=1, initializer_range=INIT_RANGE)
        cfg.architectures = ["Qwen3ForTokenClassification"]
        rm = AutoModelForTokenClassification.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for n, p in rm.named_parameters():
                if "norm" in n:
                    p.add_(torch.randn_like(p) * 0.1)
            rm.score.weight.normal_(0, 0.5)  # a non-trivial head
            if getattr(rm.score, "bias", None) is not None:
                rm.score.bias.fill_(0.25)
        rm.save_pretrained(str(dirs["rm"]), safe_serialization=True)
    return {k: str(v) for k, v in dirs.items()}


def make_batch(seed: int = 0):
    """Two sequences of 256 and 198 tokens (prompt 64 / 48, response 192 / 150), on the host, with
    advantages and returns."""
    from megappo.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    responses = torch.randint(3, VOCAB, (len(PROMPT_LENS), RESPONSE_LEN), generator=g)
    mask = torch.ones(len(PROMPT_LENS), RESPONSE_LEN)
    mask[1, SHORT_RESPONSE:] = 0
    batch = RolloutBatch.from_prompts_and_responses(prompts, responses, mask, pad_token_id=0,
                                                    prompt_index=torch.arange(len(PROMPT_LENS)))
    batch.advantages = torch.randn(mask.shape, generator=g) * mask
    batch.returns = torch.randn(mask.shape, generator=g) * mask
    return batch


def build(path: str, device: torch.device, dtype: torch.dtype, use_te: bool, value_head: bool = False):
    """(info, TransformerConfig, chunks) of the HF folder ``path``; parameters where megatron
    puts them for ``device`` (the current CUDA device, or the CPU)."""
    from megappo.convert import load_hf_weights
    from megappo.layout import RankCoords
    from megappo.models import build_model, describe, load_hf_config, transformer_config

    ensure_parallel()
    info = describe(load_hf_config(path), value_head=value_head)
    cfg = transformer_config(info, params_dtype=dtype, cpu=device.type == "cpu")
    # a random head (not the trainer's zero default) so the critic checks see non-zero values
    chunks = build_model(info, cfg, value_head=value_head, use_te=use_te, value_head_std=(info.desc.hidden_size + 1) ** -0.5)
    assert chunks[0].megappo_te_spec == use_te
    load_hf_weights(chunks, path, info.desc, RankCoords.from_megatron())
    return info, cfg, chunks


def make_actor(path, device, dtype, use_te, **kw):
    from megappo.workers import Actor

    info, cfg, chunks = build(path, device, dtype, use_te)
    return Actor(chunks, cfg, device=device, vocab_size=info.desc.vocab_size, **kw)


def make_critic(path, device, dtype, use_te, cls=None, **kw):
    from megappo.workers import Critic

    _, cfg, chunks = build(path, device, dtype, use_te, value_head=True)
    return (cls or Critic)(chunks, cfg, device=device, **kw)


def assert_on(worker, device: torch.device) -> None:
    """Every parameter of the worker (value head included) on ``device``."""
    for chunk in worker.chunks:
        for name, p in chunk.named_parameters():
            assert p.device.type == device.type, f"{name} is on {p.device}, the worker computes on {device}"


def params(worker) -> dict:
    """Host float32 copies of every parameter (for comparisons after the weights moved on)."""
    return {n: p.detach().float().cpu().clone() for c in worker.chunks for n, p in c.named_parameters()}


def exact_params(worker) -> dict:
    """Host copies in the parameters' own dtype (for bit-exact comparisons)."""
    return {n: p.detach().cpu().clone() for c in worker.chunks for n, p in c.named_parameters()}


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask.bool()]


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-30))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# -- transformers references ---------------------------------------------------------------------
@torch.no_grad()
def hf_log_probs(path: str, batch, dtype: torch.dtype, device) -> torch.Tensor:
    """(B, T) response log-probs from transformers' forward of the padded batch (causal mask only,
    right padding: exactly the positions megappo uses), on the host."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ids = batch.input_ids.to(device)
    logits = hf(input_ids=ids).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    out = lp.gather(1, batch.response_positions.to(device)) * batch.response_mask.to(device)
    del hf
    return out.cpu()


@torch.no_grad()
def hf_scores(path: str, batch, dtype: torch.dtype, device) -> torch.Tensor:
    """(B, T) the token-classification model's output at each response's last token, on the host."""
    from transformers import AutoModelForTokenClassification

    hf = AutoModelForTokenClassification.from_pretrained(path, dtype=dtype).to(device).eval()
    out = hf(input_ids=batch.input_ids.to(device)).logits[..., 0].float().cpu()
    n = batch.response_mask.sum(-1).long()
    want = torch.zeros(batch.response_mask.shape)
    for i in range(len(batch)):
        want[i, n[i] - 1] = out[i, batch.prompt_lengths[i] + n[i] - 1]
    del hf
    return want


# -- 1. actor log-probs vs transformers ----------------------------------------------------------
def check_actor_log_probs(root, device: torch.device, dtype: torch.dtype, use_te: bool = False,
                          hf_device=None) -> dict:
    """``Actor.compute_log_prob`` (two micro-batches, then a token budget) against transformers'
    forward of the same weights.

    float32: |megappo - transformers| < 1e-4 (the two differ only in summation order).
    bfloat16: there is no exact answer to compare to. bf16 keeps 8 significant bits (relative
    rounding 2^-9 ~ 2e-3 per op), and the implementations round at different points: megatron
    fuses QKV and gate/up into one GEMM, computes RMSNorm in float32 (TE: fused kernels), runs its
    own attention (softmax in float32) where transformers uses SDPA kernels, and rounds logits at
    a different place. So both are compared with transformers in float32 (the truth for these
    weights), and megappo's bf16 error must be of the size of transformers' own bf16 error:
    max |megappo_bf16 - hf_fp32| <= 3 * max |hf_bf16 - hf_fp32| + 0.02 and
    mean |megappo_bf16 - hf_fp32| <= 3 * mean |hf_bf16 - hf_fp32| + 2e-3 (log-probs in nats;
    a wrong layer, norm or RoPE gives differences of order 1).
    """
    hf_device = hf_device or device
    dirs = model_dirs(root)
    batch = make_batch(0)
    actor = make_actor(dirs["policy"], device, dtype, use_te)
    assert_on(actor, device)
    lp = actor.compute_log_prob(batch, micro_batch_size=1)
    lp_tok = actor.compute_log_prob(batch, max_token_len=300)  # token budget: the same numbers
    assert lp.device.type == "cpu" and lp.shape == batch.responses.shape and lp.dtype == torch.float32
    assert torch.isfinite(lp).all()
    assert (lp[batch.response_mask == 0] == 0).all()
    m = batch.response_mask
    ref32 = hf_log_probs(dirs["policy"], batch, torch.float32, hf_device)
    d32 = (_masked(lp, m) - _masked(ref32, m)).abs()
    fig = {"check": "actor_log_probs", "spec": "te" if use_te else "local", "dtype": str(dtype).split(".")[-1],
           "tokens": int(m.sum()), "logprob_max_abs_diff_vs_hf_fp32": float(d32.max()),
           "logprob_mean_abs_diff_vs_hf_fp32": float(d32.mean()),
           "logprob_max_abs_diff_micro_vs_token_budget": float((lp - lp_tok).abs().max())}
    if dtype == torch.float32:
        return finish(fig, [
            (fig["logprob_max_abs_diff_vs_hf_fp32"] < 1e-4, "float32 log-probs differ from transformers by >= 1e-4"),
            (fig["logprob_max_abs_diff_micro_vs_token_budget"] < 1e-5, "micro-batch split changes the log-probs")])
    ref16 = hf_log_probs(dirs["policy"], batch, dtype, hf_device)
    h = (_masked(ref16, m) - _masked(ref32, m)).abs()
    d16 = (_masked(lp, m) - _masked(ref16, m)).abs()
    fig.update(logprob_max_abs_diff_vs_hf_bf16=float(d16.max()), logprob_mean_abs_diff_vs_hf_bf16=float(d16.mean()),
               hf_bf16_max_abs_diff_vs_hf_fp32=float(h.max()), hf_bf16_mean_abs_diff_vs_hf_fp32=float(h.mean()))
    return finish(fig, [
        (fig["logprob_max_abs_diff_vs_hf_fp32"] <= 3 * float(h.max()) + 0.02,
         "max error vs transformers-fp32 > 3x transformers' own bf16 error + 0.02"),
        (fig["logprob_mean_abs_diff_vs_hf_fp32"] <= 3 * float(h.mean()) + 2e-3,
         "mean error vs transformers-fp32 > 3x transformers' own bf16 error + 2e-3"),
        # Same weights, another micro-batch split (GEMM shapes differ, so bf16 rounding may too).
        (fig["logprob_max_abs_diff_micro_vs_token_budget"] < 0.05, "micro-batch split changes the log-probs")])


def check_packed_log_probs(root, device: torch.device, dtype: torch.dtype, use_te: bool = True) -> dict:
    """Sequence packing (use_remove_padding, THD: TransformerEngine's attention, or megappo's on
    the local spec): the packed forward's log-probs and values equal the padded path's within
    bf16 rounding (the packed GEMMs have other shapes), and the packed pass computes fewer tokens."""
    import time

    dirs = model_dirs(root)
    batch = make_batch(0)
    out = {}
    for packed in (False, True):
        actor = make_actor(dirs["policy"], device, dtype, use_te)
        critic = make_critic(dirs["policy"], device, dtype, use_te)
        actor.pack_sequences = critic.pack_sequences = packed
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        lp = actor.compute_log_prob(batch, max_token_len=300)
        torch.cuda.synchronize()
        out[packed] = dict(lp=lp, values=critic.compute_values(batch, max_token_len=300), s=time.perf_counter() - t0)
    m = batch.response_mask
    d_lp = (_masked(out[True]["lp"], m) - _masked(out[False]["lp"], m)).abs()
    d_v = (_masked(out[True]["values"], m) - _masked(out[False]["values"], m)).abs()
    tokens = int((batch.prompt_lengths + m.sum(-1)).sum())
    fig = {"check": "packed_log_probs", "spec": "te" if use_te else "local", "dtype": str(dtype).split(".")[-1],
           "logprob_max_abs_diff_packed_vs_padded": float(d_lp.max()), "value_max_abs_diff_packed_vs_padded": float(d_v.max()),
           "tokens": tokens, "padded_s": out[False]["s"], "packed_s": out[True]["s"],
           "padded_tokens_per_s": tokens / out[False]["s"], "packed_tokens_per_s": tokens / out[True]["s"]}
    return finish(fig, [
        (fig["logprob_max_abs_diff_packed_vs_padded"] < (1e-4 if dtype == torch.float32 else 0.05),
         "packed log-probs differ from the padded forward's"),
        (fig["value_max_abs_diff_packed_vs_padded"] < (1e-4 if dtype == torch.float32 else 0.05),
         "packed values differ from the padded forward's")])


# -- 2. one policy and one critic update ---------------------------------------------------------
LR = 2e-4


def _policy_step(path, device, dtype, use_te, batch):
    """Old log-probs, one Adam update (mini-batch = the batch, two micro-batches), new log-probs,
    and the PPO loss on the same batch before and after."""
    from megappo import algo

    actor = make_actor(path, device, dtype, use_te, lr=LR, clip_grad=1.0)
    assert_on(actor, device)
    b = batch.select(slice(None))
    b.old_log_prob = actor.compute_log_prob(b, micro_batch_size=1)
    before = params(actor)
    m = actor.update_policy(b, mini_batch_size=len(b), micro_batch_size=1, loss=algo.PolicyLossSpec(entropy_coeff=0.0))
    after = params(actor)
    lp = actor.compute_log_prob(b, micro_batch_size=1)
    new_loss, _ = algo.policy_loss(b.old_log_prob, lp, b.advantages, b.response_mask)
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    return dict(metrics=m, old=b.old_log_prob, new=lp, new_loss=float(new_loss), moved=moved, names=list(before),
                dims={n: t.dim() for n, t in before.items()})


def _critic_step(path, device, dtype, use_te, batch, dist_opt):
    critic = make_critic(path, device, dtype, use_te, lr=LR, clip_grad=1.0, use_distributed_optimizer=dist_opt)
    assert_on(critic, device)
    head = critic.chunks[0].output_layer
    assert head.weight.device.type == device.type, f"the value head is on {head.weight.device}"
    b = batch.select(slice(None))
    b.values = critic.compute_values(b, micro_batch_size=1)
    before = params(critic)
    m = critic.update_critic(b, mini_batch_size=len(b), micro_batch_size=1)
    after = params(critic)
    v = critic.compute_values(b, micro_batch_size=1)
    mask = b.response_mask

    def mse(x):
        return float(0.5 * (((x - b.returns) ** 2) * mask).sum() / mask.sum())

    moved = [n for n in before if not torch.equal(before[n], after[n])]
    return dict(metrics=m, old=b.values, new=v, old_loss=mse(b.values), new_loss=mse(v), moved=moved,
                names=list(before), dims={n: t.dim() for n, t in before.items()})


def check_updates(root, device: torch.device, dtype: torch.dtype, use_te: bool = False,
                  dist_opt: bool = True, reference: bool = True) -> dict:
    """One ``update_policy`` and one ``update_critic`` (Adam, lr 2e-4, mini-batch = the batch):
    losses finite, every weight tensor moves, the PPO loss and the value loss on the same batch go
    down, and (``reference``) the change of the log-probs / values agrees with the same update in
    float32 on the same device: cosine >= 0.9 and relative difference <= 0.5.

    Why those bounds: Adam's first step is lr * g / (|g| + eps), about lr * sign(g) per element;
    bf16 gradients flip the sign only of elements whose gradient is within rounding of zero, and
    the bf16 weights (the optimizer's main copy is float32) round each update to 8 bits. The
    direction of the change is what must survive; a wrong gradient (a missing term, a layer that
    does not train, a stale micro-batch) gives a cosine near 0 or negative.
    The critic runs with megatron's distributed optimizer (``dist_opt``) or the plain one; the
    actor always with the distributed optimizer (the trainer's default).
    """
    dirs = model_dirs(root)
    batch = make_batch(1)
    pol = _policy_step(dirs["policy"], device, dtype, use_te, batch)
    cri = _critic_step(dirs["policy"], device, dtype, use_te, batch, dist_opt)
    pm, cm = pol["metrics"], cri["metrics"]
    pg0 = pm["actor/pg_loss_per_minibatch"][0]
    vf0 = cri["old_loss"]
    fig = {"check": "updates", "spec": "te" if use_te else "local", "dtype": str(dtype).split(".")[-1],
           "critic_distributed_optimizer": dist_opt, "pg_loss_before": pg0, "pg_loss_after": pol["new_loss"],
           "actor_grad_norm": pm["actor/grad_norm"], "vf_loss_before": vf0, "vf_loss_after": cri["new_loss"],
           "critic_grad_norm": cm["critic/grad_norm"],
           "actor_params_moved": f"{len(pol['moved'])}/{len(pol['names'])}",
           "critic_params_moved": f"{len(cri['moved'])}/{len(cri['names'])}"}
    mask = batch.response_mask
    if reference and dtype != torch.float32:
        pol32 = _policy_step(dirs["policy"], device, torch.float32, use_te, batch)
        cri32 = _critic_step(dirs["policy"], device, torch.float32, use_te, batch, dist_opt)
        dlp, dlp32 = _masked(pol["new"] - pol["old"], mask), _masked(pol32["new"] - pol32["old"], mask)
        dv, dv32 = _masked(cri["new"] - cri["old"], mask), _masked(cri32["new"] - cri32["old"], mask)
        fig.update(logprob_change_cos_vs_fp32=_cos(dlp, dlp32), logprob_change_rel_diff_vs_fp32=_rel(dlp, dlp32),
                   value_change_cos_vs_fp32=_cos(dv, dv32), value_change_rel_diff_vs_fp32=_rel(dv, dv32),
                   pg_loss_after_fp32=pol32["new_loss"], vf_loss_after_fp32=cri32["new_loss"])
    # Every weight tensor of both models moved (the value head too). In bfloat16 a norm weight near
    # 1.0 has a rounding step of 2^-8 = 0.0039 on either side, larger than this Adam step (2e-4):
    # the optimizer's float32 main copy moves, the bf16 weight may not. So there only the
    # matrices (and the value head's bias, which starts at 0) must move.
    still = {}
    for name, st in (("actor", pol), ("critic", cri)):
        left = sorted(set(st["names"]) - set(st["moved"]))
        if dtype != torch.float32:
            left = [n for n in left if st["dims"][n] > 1 or n.endswith("output_layer.bias")]
        still[name] = left
    finite = all(math.isfinite(fig[k]) for k in ("pg_loss_before", "pg_loss_after", "actor_grad_norm",
                                                   "vf_loss_before", "vf_loss_after", "critic_grad_norm"))
    conditions = [
        (finite, "a loss or gradient norm is not finite"),
        (finite and pm["actor/grad_norm"] > 0 and cm["critic/grad_norm"] > 0, "a gradient norm is 0"),
        (abs(cm["critic/vf_loss"] - vf0) < 1e-3 + 1e-3 * abs(vf0),
         f"the critic's reported loss {cm['critic/vf_loss']} is not the value loss of its inputs {vf0}"),
        (not still["actor"], f"actor weights that did not move: {still['actor']}"),
        (not still["critic"], f"critic weights that did not move: {still['critic']}"),
        (pol["new_loss"] < pg0, "the PPO loss on the trained batch did not go down"),
        (cri["new_loss"] < vf0, "the value loss on the trained batch did not go down"),
    ]
    if "logprob_change_cos_vs_fp32" in fig:
        # bounds explained in the docstring
        conditions += [
            (fig["logprob_change_cos_vs_fp32"] >= 0.9 and fig["logprob_change_rel_diff_vs_fp32"] <= 0.5,
             "the policy update in bf16 does not follow the float32 one"),
            (fig["value_change_cos_vs_fp32"] >= 0.9 and fig["value_change_rel_diff_vs_fp32"] <= 0.5,
             "the critic update in bf16 does not follow the float32 one")]
    return finish(fig, conditions)


# -- 3. reward model vs transformers -------------------------------------------------------------
def check_reward_model(root, device: torch.device, dtype: torch.dtype, use_te: bool = False,
                       hf_device=None) -> dict:
    """``RewardModel.compute_scores`` against transformers' AutoModelForTokenClassification (one
    label) at each response's last token. float32: < 1e-4. bfloat16: as for the log-probs, the
    error against transformers in float32 is at most 3x transformers' own bf16 error + 0.02 (the
    head's outputs are O(1): the score weights are N(0, 0.5))."""
    from megappo.workers import RewardModel

    hf_device = hf_device or device
    dirs = model_dirs(root)
    batch = make_batch(2)
    rm = make_critic(dirs["rm"], device, dtype, use_te, cls=RewardModel)
    assert_on(rm, device)
    got = rm.compute_scores(batch, micro_batch_size=1)
    assert got.device.type == "cpu" and got.shape == batch.responses.shape
    assert (got != 0).sum(-1).tolist() == [1] * len(batch)  # one score per response, at its last token
    ref32 = hf_scores(dirs["rm"], batch, torch.float32, hf_device)
    fig = {"check": "reward_model", "spec": "te" if use_te else "local", "dtype": str(dtype).split(".")[-1],
           "score_max_abs_diff_vs_hf_fp32": float((got - ref32).abs().max()),
           "score_scale": float(ref32.abs().max())}
    if dtype == torch.float32:
        return finish(fig, [(fig["score_max_abs_diff_vs_hf_fp32"] < 1e-4, "float32 scores differ from transformers")])
    ref16 = hf_scores(dirs["rm"], batch, dtype, hf_device)
    h = float((ref16 - ref32).abs().max())
    fig.update(score_max_abs_diff_vs_hf_bf16=float((got - ref16).abs().max()), hf_bf16_score_max_abs_diff_vs_fp32=h)
    return finish(fig, [(fig["score_max_abs_diff_vs_hf_fp32"] <= 3 * h + 0.02,
                         "error vs transformers-fp32 > 3x transformers' own bf16 error + 0.02")])


# -- 4. checkpoint round trip --------------------------------------------------------------------
def _train_step(actor, critic, batch):
    b = batch.select(slice(None))
    b.old_log_prob = actor.compute_log_prob(b, micro_batch_size=1)
    b.values = critic.compute_values(b, micro_batch_size=1)
    a = actor.update_policy(b, mini_batch_size=len(b), micro_batch_size=1)
    c = critic.update_critic(b, mini_batch_size=len(b), micro_batch_size=1)
    return a["actor/pg_loss_per_minibatch"] + c["critic/vf_loss_per_minibatch"]


def _max_change(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _norm_diff(a: dict, b: dict) -> float:
    return float(sum(float((a[n].double() - b[n].double()).square().sum()) for n in a) ** 0.5)


def check_checkpoint(root, device: torch.device, dtype: torch.dtype, use_te: bool = False) -> dict:
    """save_checkpoint / load_checkpoint of an Actor (distributed optimizer) and a Critic (plain
    optimizer) whose weights and Adam states live on ``device``: the loaded weights equal the saved
    ones bit for bit, and the next update from the loaded state equals the update of the workers
    that never stopped: the same losses (the same weights, data and kernels) and the same weights
    after the step up to GPU round-off, at most 10% of the step itself (megatron 0.16.1's
    torch-Adam step-count bug, see megappo.checkpoint, would make it ~75%)."""
    from megappo.checkpoint import load_checkpoint, save_checkpoint

    dirs = model_dirs(root)
    ck = Path(root) / f"ckpt_{'te' if use_te else 'local'}_{str(dtype).split('.')[-1]}"
    batch = make_batch(3)
    kw = dict(lr=LR, clip_grad=1.0)

    def workers():
        a = make_actor(dirs["policy"], device, dtype, use_te, use_distributed_optimizer=True, **kw)
        c = make_critic(dirs["policy"], device, dtype, use_te, use_distributed_optimizer=False, **kw)
        return a, c

    actor, critic = workers()
    _train_step(actor, critic, batch)
    save_checkpoint(str(ck), 1, {"actor": actor, "critic": critic}, {"data": {"epoch": 0}},
                    hf_sources={"actor": dirs["policy"]})
    saved = {"actor": exact_params(actor), "critic": exact_params(critic)}
    w1 = {"actor": params(actor), "critic": params(critic)}
    losses_straight = _train_step(actor, critic, batch)
    w2 = {"actor": params(actor), "critic": params(critic)}

    actor2, critic2 = workers()
    state = load_checkpoint(str(ck / "global_step_1"), {"actor": actor2, "critic": critic2})
    assert state == {"step": 1, "data": {"epoch": 0}}, state
    for name, w in (("actor", actor2), ("critic", critic2)):
        assert_on(w, device)
        got = exact_params(w)
        assert got.keys() == saved[name].keys()
        bad = [n for n in got if got[n].dtype != saved[name][n].dtype or not torch.equal(got[n], saved[name][n])]
        assert not bad, f"{name}: loaded weights differ from the saved ones: {bad[:5]}"
    losses_resumed = _train_step(actor2, critic2, batch)
    w2r = {"actor": params(actor2), "critic": params(critic2)}
    fig = {"check": "checkpoint", "spec": "te" if use_te else "local", "dtype": str(dtype).split(".")[-1],
           "losses_straight": losses_straight, "losses_resumed": losses_resumed,
           "resume_loss_max_abs_diff": max(abs(a - b) for a, b in zip(losses_straight, losses_resumed))}
    conditions = []
    for name in ("actor", "critic"):
        step = _norm_diff(w2[name], w1[name])
        off = _norm_diff(w2r[name], w2[name])
        fig[f"{name}_resume_weight_diff_vs_step"] = off / max(step, 1e-30)
        conditions += [(step > 0, f"{name}: the update after the save did not move the weights"),
                       (off <= 0.1 * step, f"{name}: the update after loading differs from the uninterrupted one "
                                           f"by more than 10% of the step")]
    conditions.append((all(abs(a - b) <= 1e-5 + 1e-4 * abs(a) for a, b in zip(losses_straight, losses_resumed)),
                       "the losses after loading differ from the uninterrupted run"))
    return finish(fig, conditions)


# -- 5. HF export from device weights ------------------------------------------------------------
def check_hf_export(root, device: torch.device, dtype: torch.dtype, use_te: bool = False,
                    converter: bool = True) -> dict:
    """Import an HF folder stored in ``dtype`` into a ``dtype`` model on ``device``, export it again
    with ``iter_hf_tensors`` (tensors come off the device) and, with ``converter``, through a
    checkpoint and ``checkpoints_tools/convert_to_hf.py`` (a CPU process, as users run it): both
    equal the HF folder's tensors bit for bit (same dtype in and out: no rounding anywhere)."""
    from safetensors.torch import load_file

    from megappo.checkpoint import save_checkpoint
    from megappo.convert import iter_hf_tensors
    from megappo.layout import RankCoords

    dirs = model_dirs(root)
    src = dirs["policy_bf16"] if dtype == torch.bfloat16 else dirs["policy"]
    want = load_file(os.path.join(src, "model.safetensors"))
    assert all(t.dtype == dtype for t in want.values())
    info, cfg, chunks = build(src, device, dtype, use_te)
    from megappo.workers import Actor

    actor = Actor(chunks, cfg, device=device, vocab_size=info.desc.vocab_size)
    assert_on(actor, device)
    got = {}
    for name, t in iter_hf_tensors(chunks, info.desc, RankCoords.from_megatron()):
        assert t.device.type == device.type, f"{name} came out on {t.device}"
        got[name] = t.detach().cpu().clone()
    assert got.keys() == want.keys(), (sorted(set(got) ^ set(want)))
    bad = [n for n in want if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])]
    assert not bad, f"iter_hf_tensors differs from the imported HF tensors: {bad[:5]}"
    fig = {"check": "hf_export", "spec": "te" if use_te else "local", "dtype": str(dtype).split(".")[-1],
           "tensors": len(got), "iter_hf_tensors_bit_exact": True}
    if converter:
        ck = Path(root) / f"export_{'te' if use_te else 'local'}_{str(dtype).split('.')[-1]}"
        save_checkpoint(str(ck), 1, {"actor": actor}, {}, hf_sources={"actor": src})
        out = ck / "hf"
        env = {k: v for k, v in os.environ.items() if k != "MEGAPPO_CHECK_DEVICES"}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        p = subprocess.run([sys.executable, str(REPO / "checkpoints_tools" / "convert_to_hf.py"),
                            "--ckpt", str(ck / "global_step_1" / "actor"), "--out", str(out), "--quiet"],
                           capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
        files = sorted(out.glob("*.safetensors"))
        exported = {}
        for f in files:
            exported.update(load_file(str(f)))
        assert exported.keys() == want.keys(), sorted(set(exported) ^ set(want))
        bad = [n for n in want if exported[n].dtype != want[n].dtype or not torch.equal(exported[n], want[n])]
        assert not bad, f"convert_to_hf output differs from the imported HF tensors: {bad[:5]}"
        fig["converter_bit_exact"] = True
    return record(fig)


# -- 6. offload round trip ----------------------------------------------------------------------
def _pinned_bytes() -> Optional[int]:
    """Bytes held by torch's pinned host allocator (active + cached), where this torch reports it."""
    if not torch.cuda.is_available():
        return None
    st = torch.cuda.host_memory_stats()
    for key in ("allocated_bytes.current", "reserved_bytes.current", "allocated_bytes.all.current"):
        if key in st:
            return int(st[key])
    return None


def check_offload(root, device: torch.device, dtype: torch.dtype, use_te: bool = False) -> dict:
    """``set_offload(params, grads, optimizer)`` on an Actor (distributed optimizer) after one
    update: offloading frees at least 90% of the offloaded bytes on the device; the host side is
    ONE buffer of about the offloaded size (page-locked in place on a GPU), reused by a second
    round trip; the weights come back bit for bit; and the next update (the worker reloads what
    it uses itself) equals the update of a twin that never offloaded: the same losses and weights
    within 1% of the step. On a GPU it also measures what torch's pinned allocator would hold for
    the same storages pinned one by one (the layout the offload replaced: rounded up and cached)."""
    dirs = model_dirs(root)
    batch = make_batch(5)
    kw = dict(lr=LR, clip_grad=1.0, use_distributed_optimizer=True)
    cuda = device.type == "cuda" and torch.cuda.is_available()

    def step(w):
        b = batch.select(slice(None))
        b.old_log_prob = w.compute_log_prob(b, micro_batch_size=1)
        return w.update_policy(b, mini_batch_size=len(b), micro_batch_size=1)["actor/pg_loss_per_minibatch"]

    def allocated():
        if cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated(device)
        return None

    actor = make_actor(dirs["policy"], device, dtype, use_te, **kw)
    twin = make_actor(dirs["policy"], device, dtype, use_te, **kw)
    actor.set_offload(params=True, grads=True, optimizer=True)
    step(actor), step(twin)   # Adam state exists from here on
    saved = exact_params(actor)
    so = actor.state_offload
    a0 = allocated()
    actor.offload()
    a1 = allocated()
    sizes = [n for _, _, n in so._params.host] + [n for _, _, n in so._optimizer.host]
    offloaded = sum(sizes)
    host = sum(s.buffer.numel() for s in (so._params, so._optimizer) if s.buffer is not None)
    assert all(s.nbytes() == 0 for s, _, _ in so._params.host + so._optimizer.host), "an offloaded storage kept its memory"
    fig = {"check": "offload", "spec": "te" if use_te else "local", "dtype": str(dtype).split(".")[-1],
           "offloaded_bytes": offloaded, "offloaded_storages": len(sizes), "host_buffer_bytes": host,
           # torch's caching host allocator rounds each request up to a power of two
           "pinned_per_storage_pow2_bytes": sum(1 << max(n - 1, 0).bit_length() for n in sizes)}
    if cuda:
        fig["device_bytes_freed"] = a0 - a1
        # What the replaced layout would pin: one pinned tensor per storage from torch's allocator.
        p0 = _pinned_bytes()
        if p0 is not None:
            naive = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
            fig["pinned_per_storage_bytes"] = _pinned_bytes() - p0
            print("host_memory_stats:", json.dumps(torch.cuda.host_memory_stats()))
            del naive
            fig["pinned_per_storage_cached_after_free_bytes"] = _pinned_bytes() - p0
    so.ensure(params=True)
    back = exact_params(actor)
    bad = [n for n in saved if back[n].dtype != saved[n].dtype or not torch.equal(back[n], saved[n])]
    w1 = params(actor)         # (never read a parameter while it is offloaded: its storage is empty)
    actor.offload()            # a second round trip: the same host buffers, nothing new allocated
    allocations = so._params.allocations + so._optimizer.allocations
    l_off = step(actor)        # the worker reloads params, grads and optimizer state itself
    l_twin = step(twin)
    w2, w2t = params(actor), params(twin)
    fig.update(host_buffer_allocations=allocations, loss_offloaded=l_off[0], loss_twin=l_twin[0],
               weight_diff_vs_step=_norm_diff(w2, w2t) / max(_norm_diff(w2t, w1), 1e-30),
               weights_bit_exact_vs_twin=all(torch.equal(w2[n], w2t[n]) for n in w2))
    conditions = [
        (not bad, f"weights after a round trip differ from the saved ones: {bad[:5]}"),
        (offloaded > 0 and host <= 1.1 * offloaded + 4096, "the host side is not one buffer of the offloaded size"),
        (allocations == 2, f"{allocations} host buffers made for params + optimizer over two round trips (want 2)"),
        (all(abs(a - b) <= 1e-6 + 1e-5 * abs(b) for a, b in zip(l_off, l_twin)),
         "the update after an offload sees other losses than the twin's"),
        (fig["weight_diff_vs_step"] <= 0.01, "the update after an offload differs from the twin's"),
    ]
    if cuda:
        conditions.append((fig["device_bytes_freed"] >= 0.9 * offloaded,
                           "offloading freed less than 90% of the offloaded bytes on the device"))
    return finish(fig, conditions)


# -- the CPU device-check run (one process) ------------------------------------------------------
def cpu_check_main(root: str, dtype: torch.dtype = torch.float32) -> None:
    """Every check with device=cuda:0 simulated on CPU, local spec, transformers' references on
    the simulated device too (as on the GPU: their inputs must be moved there). Trainer-style
    start: the megatron CPU adaptation with the device check first, then gloo at world size 1,
    then megatron's parallel state. float32 by default (exact bounds); ``--bf16`` runs the GPU
    test's bfloat16 bounds on CPU arithmetic (slower, informative)."""
    from megappo import megatron_cpu

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    megatron_cpu.install(check_devices=True)
    init_world(torch.device("cpu"))  # gloo: the device check treats its groups as NCCL's
    ensure_parallel()
    from megappo.distributed import process_device

    device = process_device("cpu")
    assert device == torch.device("cuda", 0), f"the device check is not on: process device {device}"
    # The check is live: a host batch handed to a model on the (simulated) GPU fails, as on a GPU.
    from megappo.device_check import DeviceCheckError

    _, _, chunks = build(model_dirs(root)["policy"], device, dtype, False)
    try:
        with torch.no_grad():
            chunks[0](torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None], attention_mask=None)
    except DeviceCheckError:
        pass
    else:
        raise AssertionError("the device check is not live: a host batch ran on a device model")
    del chunks
    check_actor_log_probs(root, device, dtype)
    check_updates(root, device, dtype, dist_opt=True)
    check_updates(root, device, dtype, dist_opt=False)
    check_reward_model(root, device, dtype)
    check_checkpoint(root, device, dtype)
    check_hf_export(root, device, dtype, converter=True)
    check_offload(root, device, dtype)
    check_packed_log_probs(root, device, dtype, use_te=False)
    print("CPU_CHECK_OK")


if __name__ == "__main__":
    # python tests/gpu/gpu_checks.py ROOT [--bf16]   (run by test_gpu_path_cpu_check.py)
    cpu_check_main(sys.argv[1], torch.bfloat16 if "--bf16" in sys.argv[2:] else torch.float32)
