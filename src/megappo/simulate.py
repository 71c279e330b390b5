"""Simulate a recipe's step at full model size on fake tensors, on a CPU: ``python -m megappo.plan --simulate``.

For one pipeline stage of the recipe's real layout, in one process: torch.distributed on the
"fake" backend at the real world size with the rank of that stage, megatron's parallel state of
that rank, then each role (actor, critic, reference) built at full size under
``FakeTensorMode`` (shapes, dtypes and storages, never data), with megatron's DDP buffers and
distributed optimizer for the training roles, and each phase at the recipe's token budget
through megatron's pipeline schedule (updates: up to 2 x PP micro-batches, the schedule's steady
state): log-prob forward, reference forward, values forward, critic update and actor update
(forward, backward and an optimizer step). Every storage created is accounted
by a dispatch mode (:class:`LiveBytes`), so each phase's peak is what that rank would hold.

The figures are simulated, not measured on a GPU: no CUDA context, NCCL buffers or allocator
fragmentation (the planner's reserve stands for those), and offload is accounted, not run: a
role's state counts in a phase by the planner's rules (what ``megatron.*_offload`` leaves on the
device while the role is idle).

What megatron-core 0.16.1 or the CPU adaptation does that fake tensors cannot, and what this
module does instead, only while a simulation runs (:func:`simulation_patches`; the training path
never sees these):

- the RNG tracker's ``fork`` compares CPU generator states with ``.item()``: forking is skipped
  (random values do not change what is allocated);
- gloo groups cannot form over the fake store: megatron's gloo groups are made on the fake
  backend; ``all_gather_object`` (optimizer parameter groups) returns this rank's object for every
  rank (the ranks of a stage hold the same parameter groups);
- DDP's coalesced reduce-scatter has no fake kernel: collectives run one by one, in place;
- the gradient norm ends in ``.item()``: it is reported as 0 (clipping scales in place);
- pipeline stages exchange shapes with ``.tolist()``: every micro-batch has one shape
  (``variable_seq_lengths=False``);
- ``model.cuda()`` cannot swap fake parameters: models are built with CPU initialisation (the
  CPU adaptation puts every device tensor on the CPU anyway);
- megatron's local layer spec materialises the [s, s] attention scores, which the GPU path's
  flash attention (TransformerEngine) never does: core attention is
  ``scaled_dot_product_attention``, whose fake kernel keeps what flash attention keeps (the
  output and the log-sum-exp); under context parallelism it keeps no mask either (the CPU
  path's explicit [s_local, S] causal mask is dropped: the products count as full ones, as
  torch's formulas count them anyway);
- megatron's global memory buffer (the local spec's sequence-parallel all-gathers) persists
  from the first pass on: it is released before each simulated pass, so that each pass's peak
  counts it (:func:`_release_gather_buffer`);
- Mixture-of-Experts: the alltoall dispatcher sizes its buffers from token counts read back
  from the device (``.numpy()``, ``.tolist()``): routing is taken as balanced
  (:class:`BalancedDispatch`).
"""
from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes", "BalancedDispatch", "RoleBytes", "StageResult", "simulation_patches",
           "fake_world", "stage_rank", "simulate_stage", "FlopCount", "SIMULATED_PHASES", "LABEL"]

LABEL = "simulated, not measured on a GPU"
SIMULATED_PHASES = ("old_log_prob", "ref", "values", "update_critic", "update_actor")
_PHASE_ROLE = {"old_log_prob": "actor", "ref": "ref", "values": "critic", "update_critic": "critic",
               "update_actor": "actor"}


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created while active that are still alive, and their peak.

    Views share their base's storage, so each storage counts once; a storage leaves the count
    when its last tensor dies. Enter it before anything it should see is created: a storage first
    seen as the output of an in-place op would count from then on."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out

    def _add(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        key = id(s)
        if key in self.live:
            return
        n = s.nbytes()
        self.live[key] = n
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(s, self._drop, key)

    def _drop(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def reset_peak(self) -> int:
        self.peak = self.current
        return self.current


@contextlib.contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


class BalancedDispatch:
    """The alltoall token dispatcher's steps with every expert receiving an equal share of the
    routed tokens: megatron sizes its permutation and all-to-all buffers by token counts read
    back from the device (``.numpy()``, ``.tolist()``), which fake tensors do not have. Each step
    makes a buffer of the size megatron's makes under balanced routing (T x top-k tokens per
    rank); the routing itself (router logits, top-k, probabilities) runs as in training."""

    @staticmethod
    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.view(-1, self.hidden_shape[-1])
        k = self.config.moe_router_topk
        self.sim_index = torch.arange(hidden.shape[0] * k, device=hidden.device) // k    # token of each copy
        return hidden.index_select(0, self.sim_index), probs.reshape(-1)[: self.sim_index.numel()] * 1.0

    @staticmethod
    def token_dispatch(self, hidden_states, probs):
        return hidden_states.clone(), probs.clone()      # the all-to-all's received buffers

    @staticmethod
    def dispatch_postprocess(self, hidden_states, probs):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        n, e = hidden_states.shape[0], self.num_local_experts
        with unset_fake_temporarily():                   # a host-side count, as megatron's after its sync
            counts = torch.tensor([n // e + (i < n % e) for i in range(e)])
        return hidden_states.clone(), counts, probs.clone()   # sorted by local expert

    @staticmethod
    def combine_preprocess(self, hidden_states):
        return hidden_states.clone()                     # unsorted

    @staticmethod
    def token_combine(self, hidden_states, *args, **kwargs):
        return hidden_states.clone()                     # the all-to-all back

    @staticmethod
    def combine_postprocess(self, hidden_states):
        t = self.sim_index.numel() // self.config.moe_router_topk
        out = torch.zeros(t, hidden_states.shape[-1], dtype=hidden_states.dtype, device=hidden_states.device)
        return out.index_add(0, self.sim_index, hidden_states).view(self.hidden_shape)


@contextlib.contextmanager
def simulation_patches():
    """megatron-core and torch.distributed, adapted to fake tensors for the duration (the module
    docstring says why each one)."""
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer import optimizer as mopt
    from megatron.core.tensor_parallel import random as mrandom

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        yield

    class _Done:
        def wait(self):
            pass

    @contextlib.contextmanager
    def one_by_one(group=None, device=None, async_ops=False):
        yield _Done()

    new_group = dist.new_group

    def fake_new_group(*args, **kwargs):
        if kwargs.get("backend") == "gloo":
            kwargs["backend"] = None
        return new_group(*args, **kwargs)

    def gather_object(out, obj, group=None):
        out[:] = [obj] * len(out)

    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    moe = [(MoEAlltoAllTokenDispatcher, name, getattr(BalancedDispatch, name))
           for name in ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "combine_preprocess",
                        "token_combine", "combine_postprocess")]
    from megappo.models import SdpaCoreAttention

    with contextlib.ExitStack() as stack:
        for obj, name, value in moe + [(SdpaCoreAttention, "_cp_causal_mask", lambda self, n, device: None),(mrandom.CudaRNGStatesTracker, "fork", fork),
                                 (param_and_grad_buffer, "_coalescing_manager", one_by_one),
                                 (mopt, "get_grad_norm_fp32", lambda *a, **k: 0.0),
                                 (dist, "new_group", fake_new_group), (dist, "all_gather_object", gather_object)]:
            stack.enter_context(_patched(obj, name, value))
        yield


def stage_rank(stage: int, world: int, pp: int, tp: int = 1) -> int:
    """The global rank of the last TP rank, CP and DP rank 0 of a pipeline stage (megatron's default
    order tp-cp-ep-dp-pp: the pipeline rank is the slowest, the TP rank the fastest). The last TP
    rank holds the padded end of the vocabulary, whose masking costs the log-prob kernel one more
    temporary: the stage's largest rank."""
    return stage * (world // pp) + tp - 1


@contextlib.contextmanager
def fake_world(world: int, rank: int, tp: int, pp: int, vpp: Optional[int] = None, ep: Optional[int] = None,
               cp: int = 1):
    """torch.distributed on the fake backend as ``rank`` of ``world``, and megatron's parallel
    state of that rank; both torn down on exit."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megappo import megatron_cpu

    megatron_cpu.install()
    if dist.is_initialized():
        raise RuntimeError("simulate: torch.distributed is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        expert = dict(expert_model_parallel_size=ep, expert_tensor_parallel_size=1) if ep else {}
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp, **expert)
        model_parallel_cuda_manual_seed(1)
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


@dataclass
class RoleBytes:
    """What building a role added to the live bytes. ``grads``: what megatron's DDP adds (its
    fp32 gradient buffer, and its padded parameter buffer less the weights that move into it);
    ``optimizer``: the distributed optimizer's fp32 main weights and Adam's moments (after one
    step) and step counters. ``buffer_elements``: the elements of DDP's gradient buffers (padded)."""
    weights: int = 0
    grads: int = 0
    optimizer: int = 0
    buffer_elements: int = 0


@dataclass
class StageResult:
    """One pipeline stage's simulated figures: each role's state (bytes) and, per phase, the
    pass's transient peak above the state (activations, logits, the kernel's work, the optimizer
    step's temporaries) and its total by the planner's residency rules."""
    stage: int
    rank: int
    state: dict = field(default_factory=dict)          # role -> RoleBytes
    parameters: dict = field(default_factory=dict)     # role -> parameters on this rank
    transient: dict = field(default_factory=dict)      # phase -> bytes (the larger of the two below)
    passes: dict = field(default_factory=dict)         # phase -> bytes of the schedule's pass
    steps: dict = field(default_factory=dict)          # update phase -> bytes of the optimizer step
    flops: dict = field(default_factory=dict)          # phase -> this rank's FLOPs in the pass
    tokens: dict = field(default_factory=dict)         # phase -> tokens the pass ran through this rank
    seconds: float = 0.0


@dataclass
class _Role:
    chunks: list
    ddp_chunks: list
    optimizer: object
    config: object
    vocab_size: int
    critic: bool


def _hf_config(hf: dict):
    import transformers

    return transformers.AutoConfig.for_model(**hf)


def _recompute(r) -> Optional[tuple]:
    if r.recompute == "full":
        return "full", "uniform", r.recompute_num_layers
    return ("selective", None, None) if r.recompute == "selective" else None


def _build_role(hf: dict, o, r, value_head: bool, mem: LiveBytes) -> tuple[_Role, RoleBytes]:
    """One role at full size (fake), its DDP buffers and optimizer when it trains, and what each
    added to the live bytes. The optimizer's Adam moments appear at its first step: one step of
    zero gradients is taken here, so that they count as the role's state."""
    from megappo.models import SdpaCoreAttention, build_model, describe, transformer_config

    info = describe(_hf_config(hf), tp=o.tp, value_head=value_head)
    moe = info.desc.num_experts > 0
    cfg = transformer_config(info, tp=o.tp, pp=o.pp, vpp=o.vpp, sequence_parallel=o.sequence_parallel,
                             params_dtype=torch.bfloat16 if o.param_bytes == 2 else torch.float32, cpu=True,
                             recompute=_recompute(r) if r.trains else None, ep=o.ep if moe else 1, cp=o.cp,
                             split=o.split)
    cfg.variable_seq_lengths = False
    out = RoleBytes()
    before = mem.current
    chunks = build_model(info, cfg, value_head=value_head, core_attention=SdpaCoreAttention)
    out.weights = mem.current - before
    role = _Role(chunks, list(chunks), None, cfg, info.desc.vocab_size, value_head)
    if not r.trains:
        return role, out
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    before = mem.current
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=r.distributed_optimizer, grad_reduce_in_fp32=True)
    role.ddp_chunks = [DistributedDataParallel(cfg, ddp_cfg, c) for c in chunks]
    cfg.finalize_model_grads_func = finalize_model_grads
    out.grads = mem.current - before
    out.buffer_elements = sum(b.grad_data.numel() for c in role.ddp_chunks for b in c.buffers + c.expert_parallel_buffers)
    before = mem.current
    role.optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-6, bf16=cfg.bf16, params_dtype=cfg.params_dtype, clip_grad=1.0,
                        use_distributed_optimizer=r.distributed_optimizer), role.ddp_chunks)
    for opt in getattr(role.optimizer, "chained_optimizers", [role.optimizer]):
        for group in getattr(getattr(opt, "optimizer", None), "param_groups", []):
            group["foreach"] = True     # as the workers run torch's Adam (its temporaries differ per form)
    role.optimizer.step()
    out.optimizer = mem.current - before
    return role, out


def _loss(role: _Role, forward_only: bool, gather, ids, output):
    """The workers' per-token outputs of a pass summed; under context parallelism (``gather``)
    computed at this rank's positions and all-gathered over the sequence, as the workers do."""
    from megatron.core import parallel_state as ps

    from megappo.distributed import log_probs_and_entropy, log_probs_from_logits

    whole = gather or (lambda x: x)
    if role.critic:
        return whole(output[..., 0].float())[:, :-1].sum(), {}
    # the workers' labels: the next token of every held position (under CP), else of all but the last
    logits, labels = (output, ids) if gather else (output[:, :-1], ids[:, 1:])
    tp = ps.get_tensor_model_parallel_group()
    if forward_only:
        return whole(log_probs_from_logits(logits, labels, tp, role.vocab_size)).sum(), {}
    lp, ent = log_probs_and_entropy(logits, labels, tp, role.vocab_size)
    return (whole(lp) + whole(ent)).sum(), {}


class FlopCount(TorchDispatchMode):
    """FLOPs of the ops run under it, by torch's formulas (torch.utils.flop_counter's registry:
    matrix products, convolutions, attention), taught the CPU's attention kernel, which the
    registry lacks: the same two (forward) and five (backward) products as flash attention. Like
    torch's formulas it counts attention as full, not causal, products. Unlike torch's
    FlopCounterMode it keeps no module hooks and no reference to any tensor: it sits inside the
    memory accounting without changing what is live."""

    def __init__(self):
        super().__init__()
        from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

        aten = torch.ops.aten
        self.total = 0
        self.formulas = {**flop_registry,
                         aten._scaled_dot_product_flash_attention_for_cpu: shape_wrapper(
                             lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)),
                         aten._scaled_dot_product_flash_attention_for_cpu_backward: shape_wrapper(
                             lambda g, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(g, q, k, v))}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


def _run_pass(role: _Role, tokens: int, micro_batches: int, forward_only: bool) -> int:
    """``micro_batches`` micro-batches of ``tokens`` tokens per rank (one row; under context
    parallelism this rank's two chunks of a CP x longer row) through megatron's schedule
    (forward and backward when training; the optimizer step is the caller's). Returns the tokens
    that went through this rank."""
    from functools import partial

    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megappo.models import CPSequence, local_positions

    tp, cp = role.config.tensor_model_parallel_size, role.config.context_parallel_size
    unit = tp * (2 if cp > 1 else 1)     # sequence parallelism splits the row over TP; CP holds two chunks
    width = -(-tokens // unit) * unit
    if cp > 1:
        held = local_positions(width * cp, cp, ps.get_context_parallel_rank())
        pos, gather = held[None], CPSequence(None, ps.get_context_parallel_group(), held, 0).gather
    else:
        pos, gather = torch.arange(width)[None], None

    def forward_step(data_iterator, model):
        next(data_iterator)
        ids = torch.zeros(1, width, dtype=torch.long)
        return model(ids, pos, attention_mask=None), partial(_loss, role, forward_only, gather, ids)

    models = role.ddp_chunks if not forward_only else role.chunks
    if not forward_only:
        for c in role.ddp_chunks:
            c.zero_grad_buffer()
        role.optimizer.zero_grad()
    its = [iter(range(micro_batches)) for _ in models] if len(models) > 1 else iter(range(micro_batches))
    with torch.no_grad() if forward_only else contextlib.nullcontext():    # as the workers' forward passes
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=its,
                                    model=models if len(models) > 1 else models[0],
                                    num_microbatches=micro_batches, seq_length=width * cp, micro_batch_size=1,
                                    forward_only=forward_only)
    return width * micro_batches


def _release_gather_buffer() -> None:
    """Drop megatron's global memory buffer (the local spec's sequence-parallel all-gathers land
    in it, [tokens, hidden]): it stays allocated from a rank's first pass on, so every pass after
    the first holds it; released before each simulated pass, each pass's peak counts it, as the
    planner does, instead of the first pass alone."""
    from megatron.core import parallel_state as ps

    ps.get_global_memory_buffer().buffer.clear()


def _micro_batches(o, training: bool) -> int:
    """Micro-batches a pass runs: enough for the 1F1B/interleaved schedule's steady state (the
    most a stage holds in flight), no more than a mini-batch has."""
    if not training:
        return o.pp if o.vpp else 1
    n = min(o.micro_batches, 2 * o.pp)
    return -(-n // o.pp) * o.pp if o.vpp else n   # the interleaved schedule wants a multiple of PP


def simulate_stage(hf: dict, o, stage: int, phases=SIMULATED_PHASES, fake: bool = True) -> StageResult:
    """One pipeline stage of layout ``o`` (a megappo.plan.PlanOptions) for the model of HF
    config.json mapping ``hf``: each present role's state and each phase's transient peak.
    ``fake=False`` allocates real tensors instead (a tiny model at world size 1: the check that
    fake tensors account as real ones allocate)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    start = time.monotonic()
    world = o.tp * o.pp * o.cp * o.dp
    rank = stage_rank(stage, world, o.pp, o.tp)
    result = StageResult(stage=stage, rank=rank)
    mem = LiveBytes()
    moe = bool(hf.get("num_experts"))
    with simulation_patches(), fake_world(world, rank, o.tp, o.pp, o.vpp, o.ep if moe else None, o.cp):
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(), mem:
            roles = {}
            for name, r, head in (("actor", o.actor, False), ("critic", o.critic, True), ("ref", o.ref, False)):
                if r.present:
                    roles[name], result.state[name] = _build_role(hf, o, r, head, mem)
                    result.parameters[name] = sum(p.numel() for c in roles[name].chunks for p in c.parameters())
            for phase in phases:
                name = _PHASE_ROLE[phase]
                if name not in roles:
                    continue
                r = getattr(o, name)
                training = phase.startswith("update")
                _release_gather_buffer()
                base = mem.reset_peak()
                with FlopCount() as flops:
                    result.tokens[phase] = _run_pass(roles[name], r.train_tokens if training else r.forward_tokens,
                                                     _micro_batches(o, training), forward_only=not training)
                result.flops[phase] = flops.total
                result.passes[phase] = mem.peak - base
                if training:   # the gradients stay in their buffers; the step's temporaries come on top
                    base = mem.reset_peak()
                    roles[name].optimizer.step()
                    result.steps[phase] = mem.peak - base
                result.transient[phase] = max(result.passes[phase], result.steps.get(phase, 0))
    result.seconds = time.monotonic() - start
    return result

