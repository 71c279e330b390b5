"""The memory planner: will a config fit its GPUs? ``python -m megappo.plan [--config ...] [key=value ...]``

Computed from the model's HF ``config.json``, the layout and the options -- no weights, no GPU.
For a hub id the config.json comes from the HF cache, else from the configs shipped in
megappo/model_configs, else it alone is downloaded (the only network use, never weights). For every pipeline stage and phase of a step (rollout, the forward passes, the critic
and actor updates) it adds up what one GPU of that stage holds: weights, gradients and optimizer
state of each role (less what is offloaded while the role is idle), activations kept for the
backward pass (with and without recomputation), the logits of the log-prob pass, and vLLM's
share. Against ``trainer.gpu_memory_gb`` it gives a verdict and, when it does not fit, the
cheapest settings that would.

The arithmetic (bytes per GPU; P = parameters of the stage on this rank, t = TP, d = DP):
- weights: bf16 2P (fp32 4P). Gradients: megatron's DDP buffer in fp32 (grad_reduce_in_fp32), 4P.
  Optimizer: fp32 main weights + Adam's two moments, 12P, divided by d with the distributed
  optimizer (fp32 weights: only the moments, 8P).
- activations per token per layer (layer_activation_bytes_per_token: counted from what autograd
  saves in megatron's layer, for TransformerEngine's spec on a GPU or the local spec on a CPU and
  in megappo.simulate): flash attention (no s^2 term), RoPE's rotated q/k, the unfused SwiGLU's
  5 x FFN / t, the norms (TE: input and output; local: also an fp32 copy). Full recomputation
  keeps only each recomputed block's input (h, /t under SP) and rebuilds one block at a time. A
  1F1B pipeline stage s holds PP - s micro-batches in flight; the interleaved schedule
  (PP-1-s)*2 + (VPP-1)*PP + 1 chunks. A layer's backward adds its gradients at the SwiGLU.
- logits of the last stage: the output layer's [tokens, V/t] in the compute dtype, its gradient
  in training, and the log-prob/entropy kernel's fp32 work of a token chunk
  (megappo.distributed.LOGITS_CHUNK_TOKENS; verl and megappo before chunking: the whole
  micro-batch). A pass peaks at the larger of a layer's working set and the logits pass (never
  alive together), on top of the kept activations.
- the optimizer step: torch's foreach Adam holds an fp32 copy of the rank's shard after the pass
  (only what exceeds the pass's peak adds).
- vLLM: rollout.gpu_memory_utilization of the GPU while it generates and while it receives the
  actor's weights (sync: the actor's weights are back on the device then); nothing while asleep
  (rollout.free_cache_engine), all of it throughout otherwise.
- a fixed reserve per GPU for the CUDA context, NCCL buffers and allocator slack (RESERVE_GB).
- LoRA (a role's lora_rank > 0; megappo.models.lora): the base weights stay (frozen: no gradient
  buffer, no optimizer state), the adapters of each decoder layer are trained (weights, fp32
  gradients, Adam state as above; a LoRA critic's value head too); the reference is the actor's base
  with the adapters off, so it holds nothing of its own and its pass runs over the actor's weights.
  The adapters need megatron's local layer spec, so LoRA is planned with it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from megappo import hub
from megappo.layout import PipelineSplit, pipeline_split, split_problems, stage_layers
from megappo.models import padded_vocab_size  # megatron's padding (128 x TP), as the models are built

GiB = 2**30
RESERVE_GB = 3.0                 # CUDA context (~0.5), NCCL buffers (~1), allocator slack
# fp32 [chunk, V/t] temporaries of megappo.distributed's log-prob kernel alive at once (counted by
# megappo.simulate's accounting of the kernel alone): forward only, the upcast (and on the TP rank
# holding the padded end of the vocabulary, the copy that masks it); log-probs + entropy with
# their backward, five either way.
LOGITS_FP32_COPIES_FORWARD = 1
LOGITS_FP32_COPIES_TRAIN = 5
MODEL_CONFIGS = Path(__file__).parent / "model_configs"
GAP_TOLERANCE = 0.10              # the planner against the simulation: flagged beyond this
SHIPPED_ORG = "Qwen"             # whose published configs model_configs/ holds; other orgs: download

__all__ = ["ModelShape", "PlanOptions", "Plan", "model_shape", "stage_params", "lora_layer_params", "stage_lora_params",
           "role_params", "lora_of", "lora_lines", "plan", "plan_from_config", "resident",
           "LayoutError", "layout_problems", "simulated_totals", "local_spec_plan", "optimizer_step_bytes", "render_simulation", "simulate_plan", "step_flops", "compute_lines", "find_model_config", "padded_vocab_size", "main"]


# ---------------------------------------------------------------------------------------------
# The model, from its config.json
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    hidden: int
    ffn: int                     # dense MLP width (or each expert's, for MoE layers see moe_ffn)
    layers: int
    heads: int
    groups: int                  # key/value heads
    head_dim: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    experts: int = 0             # 0: dense
    experts_per_token: int = 0
    moe_ffn: int = 0
    name: str = ""


def model_shape(hf: dict, name: str = "") -> ModelShape:
    """The numbers the planner needs from an HF config.json mapping."""
    arch = (hf.get("architectures") or [""])[0]
    heads = hf["num_attention_heads"]
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)   # the latter: transformers 5's saved name
    return ModelShape(
        hidden=hf["hidden_size"], ffn=hf["intermediate_size"], layers=hf["num_hidden_layers"], heads=heads,
        groups=hf.get("num_key_value_heads") or heads, head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        vocab=hf["vocab_size"], tied=bool(hf.get("tie_word_embeddings", False)), qkv_bias=arch.startswith("Qwen2"),
        qk_norm=arch.startswith("Qwen3"), experts=experts, experts_per_token=int(hf.get("num_experts_per_tok") or 0),
        moe_ffn=int(hf.get("moe_intermediate_size") or 0), name=name)


def find_model_config(path: str) -> Path:
    """config.json of ``path``: a config.json file, a model folder holding one, a hub id
    (``org/name[@rev]``: the cached config.json, else a shipped one of that name, else a download
    of config.json alone), or a model named like one of the configs shipped in
    megappo/model_configs (``Qwen/Qwen3-8B``, ``~/models/Qwen2.5-0.5B-Instruct``: the longest
    shipped name the folder's name starts with)."""
    p = Path(os.path.expanduser(path))
    if p.is_file():
        return p
    if (p / "config.json").is_file():
        return p / "config.json"
    if hub.is_hub_id(path):
        return _hub_model_config(path)
    shipped = _shipped_config(p.name)
    if shipped is not None:
        return shipped
    names = ", ".join(sorted(c.stem for c in MODEL_CONFIGS.glob("*.json")))
    raise FileNotFoundError(f"no config.json for model '{path}': not a file or a folder with config.json, and no "
                            f"shipped config matches its name (shipped: {names}); pass --model-config PATH")


def _shipped_config(name: str) -> Optional[Path]:
    base = name.lower()
    names = sorted((c for c in MODEL_CONFIGS.glob("*.json") if base.startswith(c.stem.lower())),
                   key=lambda c: -len(c.stem))
    return names[0] if names else None


def _hub_model_config(path: str) -> Path:
    """A hub id's config.json: cached, else shipped (an id of SHIPPED_ORG without a revision), else
    downloaded alone (hub.HubError naming the id when it cannot be had)."""
    cached = hub.cached_file(path, "config.json")
    if cached:
        return Path(cached)
    repo, rev = hub.split_id(path)
    org, name = repo.split("/")
    shipped = _shipped_config(name) if rev is None and org == SHIPPED_ORG else None
    return shipped or Path(hub.resolve_file(path, "config.json"))


def _layer_params(m: ModelShape, tp: int) -> int:
    """Parameters of one decoder layer on one TP rank (norms are replicated), experts excluded."""
    h, d = m.hidden, m.head_dim
    q, kv = m.heads * d, m.groups * d
    attn = h * (q + 2 * kv) // tp + (q + 2 * kv) // tp * m.qkv_bias + q * h // tp
    norms = 2 * h + (2 * d if m.qk_norm else 0)
    mlp = h * m.experts if m.experts else 3 * h * m.ffn // tp    # MoE: the router (replicated)
    return attn + norms + mlp


def lora_layer_params(m: ModelShape, rank: int, modules, tp: int) -> int:
    """Adapter parameters of one decoder layer on one TP rank (megappo.models.lora's sharding, as
    megatron shards the linear each HF module lives in): a column-parallel module (q, k, v, gate,
    up) keeps A (r x in) whole and its 1/t of B's output rows; a row-parallel one (o, down) its 1/t
    of A's input columns and B (out x r) whole. Per-rank counts differ from PEFT's total only
    in the replicated halves."""
    h, q, kv = m.hidden, m.heads * m.head_dim, m.groups * m.head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, m.ffn), "up_proj": (h, m.ffn), "down_proj": (m.ffn, h)}   # (in, out)
    row = ("o_proj", "down_proj")
    n = 0
    for mod in modules:
        fan_in, fan_out = shapes[mod]
        n += rank * fan_in // tp + rank * fan_out if mod in row else rank * fan_in + rank * fan_out // tp
    return n


def stage_layer_count(m: ModelShape, pp: int, stage: int, vpp: Optional[int] = None, split=None) -> int:
    """Decoder layers pipeline stage ``stage`` holds over its virtual chunks (megappo.layout's
    placement: an uneven ``split`` gives the first/last stage their own counts)."""
    if split is None:
        return m.layers // pp
    return sum(n for (r, _), (_, n) in stage_layers(m.layers, pp, vpp, split).items() if r == stage)


def stage_expert_params(m: ModelShape, pp: int, ep: int, layers: Optional[int] = None) -> int:
    """Expert parameters one rank of a stage holds: its E / EP experts of each layer, whole
    (megappo's expert-TP is 1: TP does not divide them). ``layers``: the stage's (default: an
    even share)."""
    layers = m.layers // pp if layers is None else layers
    return layers * (m.experts // ep) * 3 * m.hidden * m.moe_ffn if m.experts else 0


def stage_params(m: ModelShape, tp: int, pp: int, stage: int, value_head: bool = False, ep: int = 1,
                 layers: Optional[int] = None) -> int:
    """Parameters one rank of pipeline stage ``stage`` holds (all its virtual chunks together),
    its experts included (``ep``: expert-parallel size). First stage: the embedding; last stage:
    the final norm and the output layer (a (1, h) value head with a bias for the critic; with tied
    embeddings and PP > 1 megatron keeps a copy of the embedding there). ``layers``: the stage's
    decoder layers (default: an even share; :func:`stage_layer_count` for an uneven split)."""
    layers = m.layers // pp if layers is None else layers
    n = layers * _layer_params(m, tp) + stage_expert_params(m, pp, ep, layers)
    vp = padded_vocab_size(m.vocab, tp)
    if stage == 0:
        n += vp * m.hidden // tp
    if stage == pp - 1:
        n += m.hidden
        if value_head:
            n += m.hidden + 1                       # (1, h) weight and a bias, as transformers' score layer
        elif not (m.tied and pp == 1):
            n += vp * m.hidden // tp
    return n


# ---------------------------------------------------------------------------------------------
# Options and the plan
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RoleOptions:
    present: bool = True
    trains: bool = True
    distributed_optimizer: bool = True
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    recompute: Optional[str] = None      # None | "full" | "selective"
    recompute_num_layers: int = 1
    train_tokens: int = 0                # a micro-batch's tokens on one GPU in the update
    forward_tokens: int = 0              # ... and in its forward-only pass
    # LoRA: adapters of this rank on these HF modules of every decoder layer; 0: full fine-tuning
    lora_rank: int = 0
    lora_modules: tuple[str, ...] = ()
    # the reference of a LoRA actor: the actor's base with its adapters off (no state of its own;
    # its pass runs over the actor's weights)
    shares_actor: bool = False

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0 or bool(self.lora_modules)


@dataclass(frozen=True)
class PlanOptions:
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    dp: int = 1
    cp: int = 1                          # context parallelism (the roles' token counts are per GPU already)
    split: Optional[PipelineSplit] = None   # an uneven pipeline split of the layers (megappo.layout)
    ep: int = 1                          # expert parallelism (MoE): experts over EP of a stage's TP x DP ranks
    sequence_parallel: bool = True
    param_bytes: int = 2                 # bf16
    gpu_memory_gb: float = 80.0
    vllm_fraction: float = 0.5
    vllm_sleeps: bool = True
    micro_batches: int = 1               # micro-batches per mini-batch (bounds the in-flight count)
    lean_logits: bool = True             # chunked log-prob/entropy kernel
    # the decoder layer's spec: "te" (TransformerEngine's, a GPU with TE) or "local" (megatron's
    # local spec with megappo's RMSNorm: CPU, a GPU without TE, and megappo.simulate)
    layer_spec: str = "te"
    logits_chunk_tokens: int = 1024             # megappo.distributed.LOGITS_CHUNK_TOKENS
    # what one GPU's passes cover per step (the step's compute, megappo.plan --simulate): its DP
    # rank's share of the batch's samples at full prompt + response length (/ CP), and the update epochs
    step_tokens: int = 0
    actor_epochs: int = 1
    critic_epochs: int = 1
    actor: RoleOptions = field(default_factory=RoleOptions)
    critic: RoleOptions = field(default_factory=lambda: RoleOptions(present=False))
    ref: RoleOptions = field(default_factory=lambda: RoleOptions(present=False, trains=False))


PHASES = ("rollout", "old_log_prob", "ref", "values", "update_critic", "update_actor", "sync")
ACTIVE = {"rollout": (), "old_log_prob": ("actor",), "ref": ("ref",), "values": ("critic",),
          "update_critic": ("critic",), "update_actor": ("actor",), "sync": ()}


@dataclass
class Plan:
    options: PlanOptions
    model: ModelShape
    # stage -> phase -> {item: bytes}
    table: dict = field(default_factory=dict)

    def total(self, stage: int, phase: str) -> int:
        return sum(self.table[stage][phase].values())

    def peak(self) -> tuple[int, int, str]:
        """(bytes, stage, phase) of the largest total (the first stage and phase of a tie)."""
        best = None
        for s in self.table:
            for p in self.table[s]:
                if best is None or self.total(s, p) > best[0]:
                    best = (self.total(s, p), s, p)
        return best

    @property
    def budget(self) -> float:
        return (self.options.gpu_memory_gb - RESERVE_GB) * GiB

    def fits(self) -> bool:
        return self.peak()[0] <= self.budget


def _state_bytes(n: int, o: PlanOptions, r: RoleOptions, active: bool, training: bool, experts: int = 0,
                 trained: Optional[int] = None, trained_experts: Optional[int] = None) -> dict[str, int]:
    """Weights, gradients and optimizer state of a role on one GPU (``n`` parameters, of which
    ``experts`` are MoE experts; ``trained`` of them have gradients and optimizer state, all by
    default: with LoRA only the adapters, the base is frozen); offloaded parts are absent while
    the role is idle (weights come back for its forward passes, gradients and optimizer state for
    its update only). The distributed optimizer shards dense state over DP (x CP) and expert state
    over the expert-data-parallel ranks (TP x CP x DP / EP: the ranks holding the same experts)."""
    trained = n if trained is None else trained
    trained_experts = experts if trained_experts is None else trained_experts
    kept = resident(r, active, training)
    out = {"weights": o.param_bytes * n if kept["weights"] else 0}
    if r.trains:
        out["grads"] = 4 * trained if kept["grads"] else 0
        b = 12 if o.param_bytes < 4 else 8
        edp = max(1, o.tp * o.cp * o.dp // o.ep)
        # megatron's distributed optimizer shards dense state over DP x CP (the ranks whose gradients it sums)
        per = (b * (trained - trained_experts) // (o.dp * o.cp) + b * trained_experts // edp if r.distributed_optimizer
               else b * trained)
        out["optimizer"] = per if kept["optimizer"] else 0
    return out


def stage_lora_params(m: ModelShape, o: PlanOptions, r: RoleOptions, stage: int = 0) -> int:
    """Adapter parameters one rank of pipeline stage ``stage`` holds: its layers' adapters (the
    embedding and output layer get none)."""
    layers = stage_layer_count(m, o.pp, stage, o.vpp, o.split)
    return layers * lora_layer_params(m, r.lora_rank, r.lora_modules, o.tp) if r.lora else 0


def role_params(m: ModelShape, o: PlanOptions, r: RoleOptions, stage: int, value_head: bool = False) -> tuple[int, int, int, int]:
    """(weights, of which experts, trained, of which experts) of a role on one rank of a stage.
    Full fine-tuning trains every weight. LoRA keeps the frozen base and trains the adapters
    (and a critic's value head, which is new to the model: it cannot be frozen)."""
    layers = stage_layer_count(m, o.pp, stage, o.vpp, o.split)
    base = stage_params(m, o.tp, o.pp, stage, value_head=value_head, ep=o.ep, layers=layers)
    experts = stage_expert_params(m, o.pp, o.ep, layers)
    if not r.lora:
        return base, experts, base, experts
    adapters = stage_lora_params(m, o, r, stage)
    head = m.hidden + 1 if value_head and stage == o.pp - 1 else 0
    return base + adapters, experts, adapters + head, 0


def resident(r: RoleOptions, active: bool, training: bool) -> dict[str, bool]:
    """Which of a role's weights, gradients and optimizer state are on the device in a phase:
    offloaded parts only while the role needs them (weights for any pass of its own, gradients
    and optimizer state for its update)."""
    return {"weights": not (r.param_offload and not active),
            "grads": not (r.grad_offload and not (active and training)),
            "optimizer": not (r.optimizer_offload and not (active and training))}


def _widths(m: ModelShape, o: PlanOptions) -> tuple[float, float, float]:
    """(sequence-parallel divisor of hidden-sized tensors, the MLP's width per token on this TP
    rank (MoE: each token's top-k experts), attention heads on this rank)."""
    sh = o.tp if (o.sequence_parallel and o.tp > 1) else 1
    width = (m.experts_per_token * m.moe_ffn if m.experts else m.ffn) / o.tp
    return sh, width, m.heads / o.tp


def layer_activation_bytes_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Bytes one decoder layer keeps per token for its backward pass (compute dtype b, flash
    attention: no [s, s] term), by the layer spec in use (``o.layer_spec``). Counted from the
    tensors autograd saves in megatron-core 0.16.1's layer (megappo sets
    bias_activation_fusion=False and apply_rope_fusion=False on either spec):

    - attention, both specs: RoPE's rotated q and k (a + g) x head_dim, the fused qkv projection's
      output (a + 2g) x head_dim, which v stays a view of, and the attention output a x head_dim
      (all / TP); flash attention's fp32 log-sum-exp (a / TP); RoPE's cos and sin for q and for k
      (4 x head_dim, whole);
    - SwiGLU, both specs (megatron's unfused torch path): the fc1 output (2 x FFN), the SiLU's
      output, the product's other factor and the product itself (3 x FFN): 5 x FFN / TP;
    - norms, local spec (megappo's RMSNorm, fp32 like HF's): each of the two keeps an fp32 copy of
      its input, the normalised bf16 tensor and its output (the next linear's input, kept before
      the sequence-parallel gather): 4 + 2b bytes x hidden / SP each; q/k norms the same per
      head: (4 + b) x (a + g) x head_dim / TP (their outputs go into RoPE, which keeps only
      cos/sin);
    - norms, TransformerEngine's spec: the fused norm+linear keeps the norm's input and output
      (2b x hidden / SP) and an fp32 1/rms per token; the q/k norms keep their input (a view of the
      qkv output) and 1/rms;
    - context parallelism (CP > 1; the tokens counted are the rank's 1/CP of each sequence): the
      attention keeps the keys and values gathered from the other CP ranks, (CP - 1) x 2g x
      head_dim / TP per own token (megappo's attention; TransformerEngine's holds the same
      chunks for its backward).
    """
    sh, width, heads = _widths(m, o)
    b, hd = o.param_bytes, m.head_dim
    attention = b * ((3 * m.heads + 3 * m.groups) * hd / o.tp) + 4 * heads + 4 * b * hd
    attention += b * (o.cp - 1) * 2 * m.groups * hd / o.tp
    mlp = b * 5 * width
    moe = b * m.hidden * m.experts_per_token / o.tp if m.experts else 0    # the tokens permuted into the experts
    if o.layer_spec == "local":
        norms = 2 * (4 + 2 * b) * m.hidden / sh + (4 + b) * (m.heads + m.groups) * hd / o.tp * m.qk_norm
    else:
        norms = 2 * (2 * b * m.hidden + 4) / sh + 4 * (m.heads + m.groups) / o.tp * m.qk_norm
    return attention + mlp + moe + norms


def layer_backward_bytes_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Gradients alive together at a layer's backward peak, beyond what it saved: at the SwiGLU,
    the gradient of the fc1 output (2 x FFN) and of its two halves (2 x FFN), compute dtype."""
    return o.param_bytes * 4 * _widths(m, o)[1]


def layer_forward_bytes_per_token(m: ModelShape, o: PlanOptions) -> float:
    """A forward-only pass's peak working set per token (no_grad: tensors die when unused), at the
    SwiGLU: fc1's output (2 x FFN), the SiLU, the sum and the product (3 x FFN), with four
    hidden-sized tensors alive in the callers (the stage's input, the layer's input, the residual
    after attention and the MLP norm's output; / SP). The local spec under sequence parallelism
    also all-gathers each linear's input into megatron's global memory buffer, [tokens, hidden],
    which stays allocated from the first pass on (so the simulation sees it in its first pass)."""
    sh, width, _ = _widths(m, o)
    gather = m.hidden if o.layer_spec == "local" and sh > 1 else 0
    return o.param_bytes * (5 * width + 4 * m.hidden / sh + gather)


def lora_activation_bytes_per_token(m: ModelShape, o: PlanOptions, r: RoleOptions) -> float:
    """What a layer's adapters keep per token for the backward pass beyond the layer's own tensors
    (megappo.models.lora's branch, read from its code): the r-wide product A x that B's matmul
    keeps, for every token in a column-parallel branch (it gathers the sequence) and 1/SP of them
    in a row-parallel one; under sequence parallelism the column branches' own all-gather of
    their input, [tokens, hidden] for linear_qkv and for linear_fc1. The branch's input is
    otherwise a tensor the layer count has (a trained linear keeps it; megatron's frozen linear
    keeps none, so a layer without adapters on a linear is over-counted by that input).
    Training passes only: with the adapters off (the reference) nothing changes."""
    if not r.lora:
        return 0.0
    sh = _widths(m, o)[0]
    row = [x for x in r.lora_modules if x in ("o_proj", "down_proj")]
    col = [x for x in r.lora_modules if x not in row]
    gathered = len({"qkv" if x in ("q_proj", "k_proj", "v_proj") else "fc1" for x in col}) if sh > 1 else 0
    return o.param_bytes * (r.lora_rank * len(col) + r.lora_rank * len(row) / sh + gathered * m.hidden)


def _in_flight(o: PlanOptions, stage: int) -> float:
    """Micro-batches (in units of a whole stage's layers) whose activations a stage holds."""
    if o.vpp and o.vpp > 1:
        chunks = (o.pp - 1 - stage) * 2 + (o.vpp - 1) * o.pp + 1
        return min(chunks, o.micro_batches * o.vpp) / o.vpp
    return min(o.pp - stage, o.micro_batches)


def _kept(m: ModelShape, o: PlanOptions, r: RoleOptions, stage: int, tokens: int) -> int:
    """Activations a stage keeps across its layers during an update: every in-flight
    micro-batch's saved layers, or with full recomputation only each recomputed block's input."""
    layers = stage_layer_count(m, o.pp, stage, o.vpp, o.split)
    if r.recompute == "full":
        sh = _widths(m, o)[0]
        return int(o.param_bytes * m.hidden / sh * tokens * -(-layers // max(1, r.recompute_num_layers))
                   * _in_flight(o, stage))
    per_layer = layer_activation_bytes_per_token(m, o) + lora_activation_bytes_per_token(m, o, r)
    return int(per_layer * tokens * layers * _in_flight(o, stage))


def _layer_working_set(m: ModelShape, o: PlanOptions, r: RoleOptions, tokens: int) -> int:
    """Beyond the kept activations, the most one layer's backward adds: a recomputed block is
    rebuilt (its layers' saved tensors) and then differentiated (the gradients at the SwiGLU);
    without recomputation only the gradients are new."""
    per_layer = layer_activation_bytes_per_token(m, o) + lora_activation_bytes_per_token(m, o, r)
    rebuilt = max(1, r.recompute_num_layers) * per_layer if r.recompute == "full" else 0
    return int((rebuilt + layer_backward_bytes_per_token(m, o)) * tokens)


def _logits(m: ModelShape, o: PlanOptions, tokens: int, training: bool) -> int:
    """The last stage's logits pass: the output layer's [tokens, V/t] logits in the compute dtype
    (and in training their gradient, and the gradient of the output layer's input: [tokens,
    hidden], gathered under SP; the local spec under SP also all-gathers its input into megatron's
    global buffer), and the log-prob kernel's fp32 work of a token chunk: the
    upcast (and the padded vocabulary's mask) forward only; with the entropy and the backward,
    LOGITS_FP32_COPIES_TRAIN of them."""
    vocab = padded_vocab_size(m.vocab, o.tp) // o.tp
    kept = tokens * vocab * o.param_bytes * (2 if training else 1)    # logits (+ their gradient)
    if training:
        kept += tokens * m.hidden * o.param_bytes
    if o.layer_spec == "local" and _widths(m, o)[0] > 1:   # the output layer's input, all-gathered
        kept += tokens * m.hidden * o.param_bytes           # into megatron's global buffer
    work_tokens = min(tokens, o.logits_chunk_tokens) if o.lean_logits else tokens
    padded = padded_vocab_size(m.vocab, o.tp) > m.vocab     # the last TP rank masks its padding
    copies = LOGITS_FP32_COPIES_TRAIN if training else LOGITS_FP32_COPIES_FORWARD + padded
    return kept + work_tokens * vocab * 4 * copies


def optimizer_step_bytes(n: int, o: PlanOptions, r: RoleOptions, experts: int = 0) -> int:
    """torch's foreach Adam(W) holds one fp32 temporary per element of the rank's optimizer shard
    while it steps (``_foreach_sqrt`` of the second moment, for the update's denominator);
    TransformerEngine's fused Adam would not, but megatron-core falls back to torch's without
    TE or apex. Only the main weights' shard: the gradients are views of DDP's buffer."""
    if not r.trains:
        return 0
    edp = max(1, o.tp * o.cp * o.dp // o.ep)
    return 4 * ((n - experts) // (o.dp * o.cp) + experts // edp) if r.distributed_optimizer else 4 * n


def _pass_items(m: ModelShape, o: PlanOptions, r: RoleOptions, stage: int, tokens: int, training: bool,
                logits: bool) -> dict[str, int]:
    """A pass's transient memory. Its peak is the larger of the layers' working set and the
    logits pass (the last stage's logits and their gradient are freed before the layers'
    backward starts; in a forward-only pass a layer's tensors are freed before the output layer
    runs): the smaller of the two is left out of the row."""
    if training:
        kept, layer = _kept(m, o, r, stage, tokens), _layer_working_set(m, o, r, tokens)
    else:
        kept, layer = 0, int(layer_forward_bytes_per_token(m, o) * tokens)
    lg = _logits(m, o, tokens, training) if logits else 0
    return {"activations": kept + (layer if layer >= lg else 0), "logits": lg if lg > layer else 0}


def _active(o: PlanOptions, name: str, phase: str) -> bool:
    """Whether a role's weights are needed in a phase: its own passes, and the actor's in the
    reference pass when the reference is the actor's base (LoRA)."""
    return name in ACTIVE[phase] or (name == "actor" and phase == "ref" and o.ref.shares_actor)


def plan(m: ModelShape, o: PlanOptions) -> Plan:
    """Bytes per GPU of every pipeline stage in every phase of a step."""
    out = Plan(o, m)
    roles = {"actor": o.actor, "critic": o.critic, "ref": o.ref}
    for s in range(o.pp):
        out.table[s] = {}
        counts = {name: role_params(m, o, r, s, value_head=name == "critic") for name, r in roles.items()}
        for phase in PHASES:
            if any(not roles[name].present for name in ACTIVE[phase]):
                continue
            row: dict[str, int] = {}
            for name, r in roles.items():
                if r.present and not r.shares_actor:
                    n, experts, trained, trained_experts = counts[name]
                    for k, v in _state_bytes(n, o, r, _active(o, name, phase), training=phase.startswith("update"),
                                             experts=experts, trained=trained, trained_experts=trained_experts).items():
                        row[f"{name} {k}"] = v
            if phase == "sync":   # the engine is awake and the actor's weights are streamed into it
                row["actor weights"] = o.param_bytes * counts["actor"][0]
            if phase in ("rollout", "sync"):
                row["vLLM"] = int(o.vllm_fraction * o.gpu_memory_gb * GiB)
            else:
                row["vLLM"] = 0 if o.vllm_sleeps else int(o.vllm_fraction * o.gpu_memory_gb * GiB)
                name = ACTIVE[phase][0]
                r = roles[name]
                training = phase.startswith("update")
                tokens = r.train_tokens if training else r.forward_tokens
                row.update(_pass_items(m, o, r, s, tokens, training, logits=s == o.pp - 1 and name != "critic"))
                if training:   # the step runs after the pass: only what it holds beyond the pass adds
                    _, _, trained, trained_experts = counts[name]
                    step = optimizer_step_bytes(trained, o, r, trained_experts)
                    row["optimizer step"] = max(0, step - row["activations"] - row["logits"])
            out.table[s][phase] = row
    return out


# ---------------------------------------------------------------------------------------------
# From a megappo config
# ---------------------------------------------------------------------------------------------

def lora_of(model) -> tuple[int, tuple[str, ...]]:
    """(rank, HF modules) of a role's model section (verl's keys); (0, ()): full fine-tuning. A
    ``lora_adapter_path`` folder that exists gives its own rank and modules (as the trainer loads
    it); one not there yet plans with lora_rank and the target_modules keys."""
    from megappo.models import lora_targets, read_peft_adapter

    path = getattr(model, "lora_adapter_path", None)   # the critic's section has none
    if path and os.path.isdir(os.path.expanduser(path)):
        spec = read_peft_adapter(path)[0]
        return spec.rank, tuple(spec.modules)
    if model.lora_rank <= 0 and not path:
        return 0, ()
    return int(model.lora_rank), tuple(lora_targets(model.target_modules, getattr(model, "exclude_modules", None)))


def options_from_config(cfg, gpu_memory_gb: Optional[float] = None) -> PlanOptions:
    """PlanOptions of a PPOConfig (the same keys the trainer reads)."""
    from megappo.config import critic_enabled
    from megappo.layout import parallel_layout

    arr, c, d = cfg.actor_rollout_ref, cfg.critic, cfg.data
    act, ro, m = arr.actor, arr.rollout, arr.actor.megatron
    lay = parallel_layout(cfg)
    seq = d.max_prompt_length + d.max_response_length

    def budget(dynamic: bool, tokens: int, micro: Optional[int]) -> int:
        """A micro-batch's tokens on one GPU: a token budget is per GPU (under context parallelism
        a micro-batch holds CP x the budget, as in verl); a fixed count of samples is split over
        the CP ranks."""
        return tokens if dynamic else -(-(micro or 1) * seq // lay.cp)

    def role(mc, present, trains, train_tokens, forward_tokens, ckpt_flag=False):
        gran = mc.override_transformer_config.recompute_granularity if trains else None
        return RoleOptions(
            present=present, trains=trains, distributed_optimizer=getattr(mc, "use_distributed_optimizer", True),
            param_offload=mc.param_offload, grad_offload=getattr(mc, "grad_offload", False),
            optimizer_offload=getattr(mc, "optimizer_offload", False),
            recompute=gran or ("full" if ckpt_flag else None),
            recompute_num_layers=mc.override_transformer_config.recompute_num_layers if trains else 1,
            train_tokens=train_tokens, forward_tokens=forward_tokens)

    uses_ref = bool(act.use_kl_loss or cfg.algorithm.use_kl_in_reward)
    actor_lora, critic_lora = lora_of(arr.model), lora_of(c.model)
    actor = role(m, True, True, budget(act.use_dynamic_bsz, act.ppo_max_token_len_per_gpu, act.ppo_micro_batch_size_per_gpu),
                 budget(ro.log_prob_use_dynamic_bsz, ro.log_prob_max_token_len_per_gpu, ro.log_prob_micro_batch_size_per_gpu),
                 arr.model.enable_gradient_checkpointing)
    critic = role(c.megatron, critic_enabled(cfg), True,
                  budget(c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu, c.ppo_micro_batch_size_per_gpu),
                  budget(c.use_dynamic_bsz, c.forward_max_token_len_per_gpu, c.forward_micro_batch_size_per_gpu),
                  c.model.enable_gradient_checkpointing)
    rf = arr.ref
    ref = role(rf.megatron, uses_ref, False, 0,
               budget(rf.log_prob_use_dynamic_bsz, rf.log_prob_max_token_len_per_gpu, rf.log_prob_micro_batch_size_per_gpu))
    actor = replace(actor, lora_rank=actor_lora[0], lora_modules=actor_lora[1])
    critic = replace(critic, lora_rank=critic_lora[0], lora_modules=critic_lora[1])
    ref = replace(ref, shares_actor=actor.lora)
    samples_per_rank = act.ppo_mini_batch_size * ro.n // max(1, lay.dp)
    micro = (max(1, samples_per_rank * seq // max(1, actor.train_tokens * lay.cp)) if act.use_dynamic_bsz
             else max(1, samples_per_rank // (act.ppo_micro_batch_size_per_gpu or 1)))
    gpu = gpu_memory_gb if gpu_memory_gb is not None else cfg.trainer.gpu_memory_gb
    if gpu is None:
        gpu = device_memory_gb() or 80.0
    return PlanOptions(
        tp=lay.tp, pp=lay.pp, vpp=lay.vpp, dp=max(1, lay.dp), cp=lay.cp, ep=m.expert_model_parallel_size,
        split=pipeline_split(cfg), sequence_parallel=m.sequence_parallel,
        param_bytes=4 if cfg.trainer.device == "cpu" else 2, gpu_memory_gb=float(gpu),
        # a GPU run is planned with TransformerEngine's layers (megappo uses them wherever TE
        # imports); the CPU path runs the local spec
        # (the adapters need the local spec: TE's linears fuse the norm before them)
        layer_spec="local" if cfg.trainer.device == "cpu" or actor.lora or critic.lora else "te",
        # split placement: vLLM has GPUs of its own; the plan is of a training GPU
        vllm_fraction=0.0 if lay.split else ro.gpu_memory_utilization, vllm_sleeps=ro.free_cache_engine,
        micro_batches=micro,
        step_tokens=d.train_batch_size * ro.n * seq // max(1, lay.dp * lay.cp),
        actor_epochs=act.ppo_epochs, critic_epochs=c.ppo_epochs,
        actor=actor, critic=critic, ref=ref)


def device_memory_gb() -> Optional[float]:
    """This machine's GPU memory in GiB (the first device), or None without one."""
    try:
        import torch
    except ImportError:   # pragma: no cover - torch is a dependency
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / GiB


# Settings the planner may suggest, cheapest first: (label, change of PlanOptions, the overrides).
def _suggestions():
    A, C, R = "actor_rollout_ref.actor.megatron.", "critic.megatron.", "actor_rollout_ref.ref.megatron."

    def roles(**kw):
        return lambda o: replace(o, actor=replace(o.actor, **kw), critic=replace(o.critic, **kw))

    return [
        ("offload optimizer state while idle", roles(optimizer_offload=True),
         [A + "optimizer_offload=True", C + "optimizer_offload=True"]),
        ("offload gradients while idle", roles(grad_offload=True), [A + "grad_offload=True", C + "grad_offload=True"]),
        ("offload weights while idle", lambda o: replace(roles(param_offload=True)(o), ref=replace(o.ref, param_offload=True)),
         [A + "param_offload=True", C + "param_offload=True", R + "param_offload=True"]),
        ("full activation recomputation", roles(recompute="full", recompute_num_layers=1),
         [A + "override_transformer_config.recompute_granularity=full",
          C + "override_transformer_config.recompute_granularity=full"]),
    ]


def cheapest_fix(m: ModelShape, o: PlanOptions) -> Optional[tuple[list[str], list[str], Plan]]:
    """The first combination of suggestions (fewest, then cheapest) that fits, then the same
    with vLLM's share lowered in steps of 0.05 down to 0.3."""
    sugg = _suggestions()
    fractions = [o.vllm_fraction] + [f / 100 for f in range(int(o.vllm_fraction * 100) - 5, 29, -5)]
    for frac in fractions:
        for k in range(0, len(sugg) + 1):
            for combo in itertools.combinations(sugg, k):
                opt = replace(o, vllm_fraction=frac)
                for _, change, _ in combo:
                    opt = change(opt)
                p = plan(m, opt)
                if p.fits():
                    labels = [c[0] for c in combo]
                    overrides = [x for c in combo for x in c[2]]
                    if frac != o.vllm_fraction:
                        labels.append(f"vLLM's share {o.vllm_fraction} -> {frac:.2f} (smaller KV cache)")
                        overrides.append(f"actor_rollout_ref.rollout.gpu_memory_utilization={frac:.2f}")
                    return labels, overrides, p
    return None


def render(p: Plan) -> str:
    o, m = p.options, p.model
    lines = [f"memory plan: {m.name or 'model'} ({stage_params(m, 1, 1, 0) / 1e9:.2f}B parameters), "
             f"TP{o.tp} PP{o.pp}" + (f" VPP{o.vpp}" if o.vpp else "") + (f" CP{o.cp}" if o.cp > 1 else "") + f" DP{o.dp}"
             + (f" EP{o.ep}" if m.experts else "")
             + ", "
             f"{o.gpu_memory_gb:g} GiB per GPU ({RESERVE_GB:g} GiB reserved), vLLM {o.vllm_fraction:g}"]
    lines += lora_lines(p)
    for s in p.table:
        layers = stage_layer_count(m, o.pp, s, o.vpp, o.split)
        lines.append(f"  pipeline stage {s} ({stage_params(m, o.tp, o.pp, s, ep=o.ep, layers=layers) / 1e9:.2f}B actor "
                     f"parameters per GPU{f', {layers} layers' if o.split else ''}):")
        for phase, row in p.table[s].items():
            parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in row.items() if v)
            lines.append(f"    {phase:<14} {p.total(s, phase) / GiB:7.1f} GiB  ({parts})")
    peak, s, phase = p.peak()
    verdict = "FITS" if p.fits() else "DOES NOT FIT"
    lines.append(f"  peak {peak / GiB:.1f} GiB (stage {s}, {phase}) of {p.budget / GiB:.1f} GiB usable: {verdict}")
    return "\n".join(lines)


def lora_lines(p: Plan) -> list[str]:
    """The header's LoRA lines: per LoRA role its rank, modules and adapter parameters per GPU
    (the most loaded stage), and what the reference is; none for full fine-tuning."""
    o, m = p.options, p.model
    lines = []
    for name, r in (("actor", o.actor), ("critic", o.critic)):
        if r.present and r.lora:
            n = max(stage_lora_params(m, o, r, st) for st in range(o.pp))
            rank = f"r={r.lora_rank}" if r.lora_rank else "r unknown (lora_adapter_path not there yet)"
            lines.append(f"  LoRA {rank} on {len(r.lora_modules)} modules ({', '.join(r.lora_modules)}) of the {name}: "
                         f"{n / 1e6:.1f}M adapter parameters per GPU trained, its base frozen (no gradients, "
                         f"no optimizer state)")
    if o.ref.present and o.ref.shares_actor:
        lines.append("  reference: the actor's base with the adapters off (no weights of its own)")
    return lines


def simulated_totals(p: Plan, result) -> dict[str, int]:
    """Per phase of one stage's simulation (a megappo.simulate.StageResult): each role's simulated
    state that is on the device in that phase by the planner's offload rules, the pass's
    transient peak, and vLLM's share as planned (the simulation has no vLLM)."""
    o = p.options
    roles = {"actor": o.actor, "critic": o.critic, "ref": o.ref}
    out = {}
    for phase, transient in result.transient.items():
        total = transient + p.table[result.stage][phase].get("vLLM", 0)
        for name, state in result.state.items():
            kept = resident(roles[name], name in ACTIVE[phase], phase.startswith("update"))
            total += sum(getattr(state, k) for k, on in kept.items() if on)
        out[phase] = total
    return out


def local_spec_plan(p: Plan) -> Plan:
    """Plan ``p`` for megatron's local layer spec, the one megappo.simulate builds (its layers
    keep more than TransformerEngine's: fp32 norm copies): the plan to compare a simulation with."""
    return p if p.options.layer_spec == "local" else plan(p.model, replace(p.options, layer_spec="local"))


def render_simulation(p: Plan, results: list) -> str:
    """The simulated peak of each phase beside the plan's (for the local layer spec the
    simulation builds), per simulated stage."""
    from megappo.simulate import LABEL

    p = local_spec_plan(p)
    o = p.options
    lines = [f"simulated memory per GPU ({LABEL}): {p.model.name or 'model'}, TP{o.tp} PP{o.pp}"
             + (f" VPP{o.vpp}" if o.vpp else "") + (f" CP{o.cp}" if o.cp > 1 else "") + f" DP{o.dp}"
             + (f" EP{o.ep}" if p.model.experts else "") + f", world {o.tp * o.pp * o.cp * o.dp}"]
    for r in results:
        lines.append(f"  pipeline stage {r.stage} (rank {r.rank}, simulated in {r.seconds:.0f} s):")
        for name, st in r.state.items():
            lines.append(f"    {name:<7} state  weights {st.weights / GiB:.2f}, grads {st.grads / GiB:.2f}, "
                         f"optimizer {st.optimizer / GiB:.2f} GiB ({r.parameters[name] / 1e9:.3f}B parameters)")
        lines.append(f"    {'phase':<14} {'simulated':>9} {'planned':>9} {'gap':>5}   pass peak (simulated / planned "
                     "activations + logits; local layer spec)")
        totals = simulated_totals(p, r)
        for phase, total in totals.items():
            row = p.table[r.stage][phase]
            planned_pass = row.get("activations", 0) + row.get("logits", 0)
            step = (f", optimizer step {r.steps[phase] / GiB:.1f} / {row.get('optimizer step', 0) / GiB:.1f} beyond the pass"
                    if phase in r.steps else "")
            gap = p.total(r.stage, phase) / total - 1
            lines.append(f"    {phase:<14} {total / GiB:7.1f} GiB {p.total(r.stage, phase) / GiB:5.1f} GiB {gap:+5.0%}"
                         f"{'!' if abs(gap) > GAP_TOLERANCE else ' '}  {r.passes[phase] / GiB:.1f} / {planned_pass / GiB:.1f}{step}")
    lines += compute_lines(o, results)
    return "\n".join(lines)


PLANNING_MFU = 0.4
PLANNING_GPU = "H100 SXM"


def step_flops(o: PlanOptions, r) -> float:
    """One simulated stage rank's FLOPs in a step: each phase's FLOPs per token in the simulated
    pass times the tokens its DP rank runs per step (full lengths), the updates once per epoch.
    The rollout's generation is not included."""
    epochs = {"update_actor": o.actor_epochs, "update_critic": o.critic_epochs}
    return sum(r.flops[ph] / r.tokens[ph] * o.step_tokens * epochs.get(ph, 1) for ph in r.flops if r.tokens[ph])


def compute_lines(o: PlanOptions, results: list, gpu: str = PLANNING_GPU, mfu: float = PLANNING_MFU) -> list:
    """The step's training compute per GPU from the simulated passes, and what it takes at
    ``mfu`` of ``gpu``'s dense bf16 peak: a planning figure, not a measurement."""
    from megappo.metrics import peak_flops

    if not o.step_tokens or not results:
        return []
    peak = peak_flops(gpu)
    worst = max(results, key=lambda r: step_flops(o, r))
    flops = step_flops(o, worst)
    return [f"  compute per GPU per step (the training passes at full lengths with their "
            f"recomputation, generation not included; attention as full products): {flops / 1e12:,.0f} TFLOP on pipeline stage {worst.stage}; at {mfu:.0%} MFU of an "
            f"{gpu} ({peak / 1e12:,.0f} TFLOP/s dense bf16) this step takes {flops / (mfu * peak):,.1f} s "
            f"(a planning figure)"]


def simulate_plan(p: Plan, hf: dict, stages=None) -> list:
    """megappo.simulate's figures for the stages of plan ``p`` (all by default)."""
    from megappo.simulate import simulate_stage

    return [simulate_stage(hf, p.options, s) for s in (stages if stages is not None else range(p.options.pp))]


class LayoutError(ValueError):
    """A parallel layout that cannot be built for the model (megatron would refuse it at start-up)."""


def layout_problems(m: ModelShape, o: PlanOptions) -> list[str]:
    """Why the layout cannot be built, in the words megappo.models uses when it builds one (its
    checks run only once the job has its GPUs; these run before it is queued)."""
    problems = [f"{what} ({n}) is not divisible by tensor_model_parallel_size ({o.tp})"
                for what, n in (("num_attention_heads", m.heads), ("num_key_value_heads", m.groups),
                                ("intermediate_size", m.ffn)) if n % o.tp]
    problems += split_problems(m.layers, o.pp, o.vpp, o.split)
    if m.experts and m.experts % o.ep:
        problems.append(f"num_experts ({m.experts}) is not divisible by expert_model_parallel_size ({o.ep})")
    return problems


def plan_from_config(cfg, model_config: Optional[str] = None, gpu_memory_gb: Optional[float] = None):
    """(Plan, the HF config.json used) of a megappo config; LayoutError when the layout cannot
    be built for the model."""
    source = model_config or cfg.actor_rollout_ref.model.path
    path = find_model_config(source)
    name = (path.stem if path.parent == MODEL_CONFIGS else source.split("@")[0] if hub.is_hub_id(source)
            else path.parent.name)
    shape = model_shape(json.loads(path.read_text()), name=name)
    options = options_from_config(cfg, gpu_memory_gb)
    problems = layout_problems(shape, options)
    if problems:
        raise LayoutError(f"the layout cannot be built for {name}: " + "; ".join(problems))
    return plan(shape, options), path


def main(argv: Optional[list[str]] = None) -> int:
    from megappo.config import ConfigError, load_config
    from megappo.models import LoRAError

    ap = argparse.ArgumentParser(prog="python -m megappo.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--config", action="append", default=[], help="YAML file or preset (repeatable)")
    ap.add_argument("--model-config", help="config.json (or model folder) to plan for, instead of the config's model path")
    ap.add_argument("--simulate", action="store_true",
                    help="also simulate each pipeline stage's step at full size on fake tensors (CPU, minutes) and "
                         "print its per-phase peak beside the plan's (megappo.simulate)")
    ap.add_argument("--stage", type=int, action="append", help="with --simulate: only this pipeline stage (repeatable)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, as for megappo.train")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.overrides, args.config)
        p, path = plan_from_config(cfg, args.model_config)
    except (ConfigError, FileNotFoundError, KeyError, hub.HubError, LayoutError, LoRAError) as e:
        print(f"megappo.plan: {e}", file=sys.stderr)
        return 2
    print(f"model config: {path}")
    print(render(p))
    if not p.fits():
        fix = cheapest_fix(p.model, p.options)
        if fix is None:
            print("  no offload/recomputation/vLLM-share setting makes it fit: more GPUs (larger TP or PP) or a "
                  "smaller token budget (ppo_max_token_len_per_gpu)")
        else:
            labels, overrides, fixed = fix
            print(f"  cheapest fix: {'; '.join(labels)} -> peak {fixed.peak()[0] / GiB:.1f} GiB")
            print("    " + " ".join(overrides))
    if args.simulate and (p.options.actor.lora or p.options.critic.lora):
        print("  --simulate: the simulation builds no adapters (full fine-tuning), so it is not run for a LoRA plan")
    elif args.simulate:   # after the plan's verdict, which it does not change
        print(render_simulation(p, simulate_plan(p, json.loads(path.read_text()), args.stage)))
    return 0 if p.fits() else 1


if __name__ == "__main__":
    sys.exit(main())
