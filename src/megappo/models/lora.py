"""LoRA adapters on megappo's megatron models, numerically PEFT's LoRA on the transformers model.

Each adapted HF module ``m`` (q_proj ... down_proj) gets its own pair ``A_m`` (r, in), ``B_m``
(out, r), and the megatron linear that holds ``m`` computes ``base(x) + (alpha / r) * B_m(A_m(x))``
(PEFT's ``lora_alpha / r`` scaling, no dropout, no rsLoRA, no DoRA). One pair per HF module, not
per megatron linear, because users name HF modules: ``q_proj`` alone adapts only the Q rows of
the fused ``linear_qkv``. The pairs are stored in HF's layout (a TP shard of a pair is a contiguous
slice of PEFT's tensor); their outputs are put into megatron's fused layout when the layer runs,
with the same maps the weight converter uses (:mod:`megappo.convert.tensor_maps`).

Tensor parallelism (as megatron treats its own weights):
- column-parallel (``linear_qkv``, ``linear_fc1``): A replicated, B sharded along its output
  rows (this rank's query groups / FFN rows). ``A x`` is computed on every rank and its gradient
  all-reduced over TP (r values per token), so A's gradient and the branch's input gradient are
  complete on every rank.
- row-parallel (``linear_proj``, ``linear_fc2``): A sharded along its input columns, B
  replicated; the partial ``A_r x_r`` (r values per token) is all-reduced over TP, or
  reduce-scattered over the sequence under sequence parallelism, where the base's output is.
Under sequence parallelism the column-parallel branch all-gathers its input itself (megatron's
layer gathers inside its matmul, out of reach), and a row-parallel B sees only this rank's tokens:
it is tagged ``sequence_parallel`` like the norms' weights, so ``finalize_model_grads`` sums its
gradient over TP.

Base weights are frozen (``requires_grad=False``: megatron's frozen-weight linear computes no
weight gradient, its DDP allocates no buffer and its optimizer no state for them). Adapters are
parameters of the model's ``params_dtype``, like every other trained weight: in a bf16 run
megatron's mixed-precision optimizer keeps their fp32 master copies (in fp32 runs they are fp32).

Only megatron's local layer spec: TransformerEngine's ``linear_qkv``/``linear_fc1`` fuse the
preceding norm into the linear, so their input is not the HF module's input.

On Mixture-of-Experts models only the attention is adapted (``q_proj`` ... ``o_proj``): the
experts, the router and the dense layers' MLPs stay frozen without adapters. (PEFT on transformers
5 adapts experts and router too, as LoRA over their fused 3D parameters; megappo does not build
those yet, so it refuses MLP modules on such a model rather than train a different set.)
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

__all__ = ["ATTENTION_MODULES", "LORA_MODULES", "LoRAError", "LoRASpec", "lora_spec_from_config", "parse_lora_modules", "lora_targets", "apply_lora",
           "lora_parameters", "peft_name", "load_lora_tensors", "export_lora_tensors", "set_lora_enabled",
           "read_peft_adapter", "write_peft_adapter", "has_lora", "lora_spec_of", "merged_hf_tensors"]

# HF module -> (megatron linear under a layer, its part of a fused linear, TP kind)
LORA_MODULES = {
    "q_proj": ("self_attention.linear_qkv", "q", "column"),
    "k_proj": ("self_attention.linear_qkv", "k", "column"),
    "v_proj": ("self_attention.linear_qkv", "v", "column"),
    "o_proj": ("self_attention.linear_proj", None, "row"),
    "gate_proj": ("mlp.linear_fc1", "gate", "column"),
    "up_proj": ("mlp.linear_fc1", "up", "column"),
    "down_proj": ("mlp.linear_fc2", None, "row"),
}
ALL_LINEAR = "all-linear"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
_HF_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class LoRAError(ValueError):
    """A LoRA setting or adapter that megappo cannot apply; the message names it."""


def parse_lora_modules(value: Union[None, str, Sequence[str]]) -> list[str]:
    """verl's target_modules/exclude_modules values as a list of entries: ``all-linear``, a
    comma-separated string, or a list (whose items may be comma-separated too). None -> []."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    return [p.strip() for item in items for p in str(item).split(",") if p.strip()]


def lora_targets(target_modules, exclude_modules=None) -> list[str]:
    """The HF modules to adapt, in LORA_MODULES order. ``all-linear`` is every linear of the
    decoder layers (PEFT's meaning: all but the output layer). Unknown names raise, naming the
    accepted ones."""
    targets, excluded = parse_lora_modules(target_modules), parse_lora_modules(exclude_modules)
    accepted = [ALL_LINEAR, *LORA_MODULES]
    for what, names in (("target_modules", targets), ("exclude_modules", excluded)):
        bad = [n for n in names if n not in accepted]
        if bad:
            raise LoRAError(f"{what}: unknown module name{'s' if len(bad) > 1 else ''} {', '.join(map(repr, bad))}; "
                            f"accepted: {', '.join(accepted)}")
    chosen = set(LORA_MODULES) if ALL_LINEAR in targets else set(targets)
    chosen -= set(LORA_MODULES) if ALL_LINEAR in excluded else set(excluded)
    return [m for m in LORA_MODULES if m in chosen]


@dataclass(frozen=True)
class LoRASpec:
    rank: int
    alpha: float
    modules: tuple[str, ...]      # HF module names, LORA_MODULES order

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def lora_spec_from_config(model: "ModelConfig" | "CriticModelConfig") -> Optional[LoRASpec]:
    """The adapters a role's model section (verl's keys) asks for; None: full fine-tuning. With
    ``lora_adapter_path`` the adapter folder's own rank, alpha and modules win, as in verl (which
    loads it with PEFT). (Validation refuses LoRA while the trainer does not build adapters.)"""
    path = model.lora_adapter_path if hasattr(model, "lora_adapter_path") else None   # the critic has none
    if path:
        return read_peft_adapter(path)[0]
    if model.lora_rank <= 0:
        return None
    excluded = model.exclude_modules if hasattr(model, "exclude_modules") else None
    return LoRASpec(int(model.lora_rank), float(model.lora_alpha), tuple(lora_targets(model.target_modules, excluded)))


def peft_name(layer: int, module: str, which: str) -> str:
    """PEFT's saved name (adapter_model.safetensors) of a causal LM's adapter tensor; ``which``: A or B."""
    return f"base_model.model.model.layers.{layer}.{_HF_PARENT[module]}.{module}.lora_{which}.weight"


class _LoRABranch(torch.nn.Module):
    """The adapters of one megatron linear: ``lora_A.<m>`` / ``lora_B.<m>`` per HF module ``m``
    it holds, this TP rank's pieces. Runs as a forward hook of the linear, so the linear's own
    parameters, names and forward stay megatron's (weight loading and checkpoints see them as
    before; activation recomputation re-runs the hook with the layer)."""

    def __init__(self, linear, kind: str, modules: list[str], shapes: dict, spec: LoRASpec, config, tp: int,
                 fused: Optional[dict] = None):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.kind, self.modules, self.scaling, self.tp = kind, list(modules), spec.scaling, tp
        self.fused = fused   # column-parallel fused linears: how B rows go into megatron's layout
        self.sequence_parallel = bool(config.sequence_parallel) and tp > 1
        self.enabled = True
        dev = next(linear.parameters()).device
        self.lora_A, self.lora_B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for m in modules:
            out_local, in_local = shapes[m]
            a = torch.nn.Parameter(torch.zeros(spec.rank, in_local, dtype=config.params_dtype, device=dev))
            b = torch.nn.Parameter(torch.zeros(out_local, spec.rank, dtype=config.params_dtype, device=dev))
            # megatron's grad-norm and checkpoint code read these: a sharded piece counts on every
            # rank, a replicated one once
            column = kind == "column"
            set_tensor_model_parallel_attributes(a, is_parallel=not column and tp > 1, dim=1, stride=1)
            set_tensor_model_parallel_attributes(b, is_parallel=column and tp > 1, dim=0, stride=1)
            if not column and self.sequence_parallel:
                b.sequence_parallel = True   # sees this rank's tokens only: summed over TP by finalize_model_grads
            self.lora_A[m], self.lora_B[m] = a, b

    def _fused_B(self) -> torch.Tensor:
        """B of all this linear's modules as one (out_local, k*r) matrix in megatron's row layout:
        module j's B in columns j*r:(j+1)*r of its own rows, zero elsewhere (rows of modules that
        are not adapted stay zero)."""
        from .tensor_maps import fuse_gate_up, fuse_qkv

        any_b = next(iter(self.lora_B.values()))
        r, k, f = any_b.shape[1], len(self.modules), self.fused
        blocks = {}
        for part, rows in f["rows"].items():
            blk = any_b.new_zeros(rows, k * r)
            m = f["module_of"][part]
            if m in self.lora_B:
                j = self.modules.index(m)
                blk = torch.cat([blk[:, :j * r], self.lora_B[m], blk[:, (j + 1) * r:]], dim=1)
            blocks[part] = blk
        if f["kind"] == "qkv":
            return fuse_qkv(blocks["q"], blocks["k"], blocks["v"], f["heads"], f["groups"], f["head_dim"])
        return fuse_gate_up(blocks["gate"], blocks["up"])

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as mtp

        if self.kind == "column":
            if self.sequence_parallel:
                # the complete input gradient of this branch is on every rank (see below): split it
                x = mtp.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
            a = torch.cat([self.lora_A[m] for m in self.modules], dim=0)
            h = x @ a.t()
            if self.tp > 1:   # each rank back-propagates through its B rows only: sum the r-wide gradients
                h = mtp.copy_to_tensor_model_parallel_region(h)
            b = self._fused_B() if self.fused else self.lora_B[self.modules[0]]
            return (h @ b.t()) * self.scaling
        m = self.modules[0]
        h = x @ self.lora_A[m].t()
        if self.sequence_parallel:
            h = mtp.reduce_scatter_to_sequence_parallel_region(h)
        elif self.tp > 1:
            h = mtp.reduce_from_tensor_model_parallel_region(h)
        return (h @ self.lora_B[m].t()) * self.scaling


def _hook(branch: _LoRABranch):
    def hook(module, args, output):
        if not branch.enabled:
            return output
        out, bias = output
        return out + branch.delta(args[0]).to(out.dtype), bias
    return hook


def _input_requires_grad(module, args, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)
    return output


def _layers(chunk):
    """(chunk-local index, layer) of a GPTModel chunk's decoder layers."""
    return list(enumerate(chunk.decoder.layers))


def _global_layer(chunk, local: int) -> int:
    return int(chunk.decoder.layers[local].layer_number) - 1   # megatron numbers layers from 1, globally


def _module(root, path: str):
    for p in path.split("."):
        root = getattr(root, p)
    return root


def apply_lora(chunks, desc, spec: LoRASpec, seed: int = 0) -> list[torch.nn.Parameter]:
    """Freeze every parameter of ``chunks`` and add adapters for ``spec.modules`` to each decoder
    layer. A starts as PEFT's default (Kaiming-uniform, drawn for the whole HF tensor from a
    generator seeded by ``seed``, layer and module, then sliced: every layout starts equal), B at
    zero, so the model computes exactly the base model until B moves. Returns the adapter
    parameters (the trainable ones)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if spec.rank <= 0:
        raise LoRAError(f"lora_rank must be positive, got {spec.rank}")
    if not spec.modules:
        raise LoRAError("no module to adapt (target_modules minus exclude_modules is empty)")
    mlp = [m for m in spec.modules if m not in ATTENTION_MODULES]
    if desc.num_experts and mlp:
        raise LoRAError(f"{', '.join(mlp)}: on a Mixture-of-Experts model LoRA adapts the attention only "
                        f"({', '.join(ATTENTION_MODULES)}); the experts' and router's adapters are not built")
    if any(getattr(c, "megappo_te_spec", False) for c in chunks):
        raise LoRAError("LoRA needs megatron's local layer spec: TransformerEngine's linear_qkv / linear_fc1 "
                        "include the preceding norm, so their input is not the HF module's")
    if has_lora(chunks):
        raise LoRAError("the model has adapters already (apply_lora runs once per model)")
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for c in chunks:
        for p in c.parameters():
            p.requires_grad_(False)
    d = desc
    shapes_full = {"q_proj": (d.num_heads * d.head_dim, d.hidden_size), "k_proj": (d.num_groups * d.head_dim, d.hidden_size),
                   "v_proj": (d.num_groups * d.head_dim, d.hidden_size), "o_proj": (d.hidden_size, d.num_heads * d.head_dim),
                   "gate_proj": (d.ffn_hidden_size, d.hidden_size), "up_proj": (d.ffn_hidden_size, d.hidden_size),
                   "down_proj": (d.hidden_size, d.ffn_hidden_size)}
    by_linear: dict[str, list[str]] = {}
    for m in spec.modules:
        by_linear.setdefault(LORA_MODULES[m][0], []).append(m)
    params = []
    for chunk in chunks:
        chunk.megappo_lora = spec   # a pipeline stage holding no adapted layer still knows the run is LoRA
        config = chunk.config
        if getattr(chunk, "embedding", None) is not None:
            # With the embedding frozen its output needs no gradient, and megatron's recomputation
            # (a reentrant autograd function) gives no gradient to anything inside a checkpointed
            # layer whose inputs need none: the adapters would silently never learn
            # (PEFT's enable_input_require_grads, for the same reason).
            chunk.embedding.register_forward_hook(_input_requires_grad)
        for local, layer in _layers(chunk):
            g = _global_layer(chunk, local)
            for path, modules in by_linear.items():
                linear = _module(layer, path)
                kind = LORA_MODULES[modules[0]][2]
                want = ColumnParallelLinear if kind == "column" else RowParallelLinear
                if type(linear) is not want:
                    raise LoRAError(f"layer {g} {path}: expected megatron's {want.__name__}, found "
                                    f"{type(linear).__name__}")
                if kind == "column" and linear.gather_output:
                    raise LoRAError(f"layer {g} {path}: a column-parallel linear that gathers its output")
                shapes = {}
                for m in modules:
                    out, inp = shapes_full[m]
                    shapes[m] = (out // tp, inp) if kind == "column" else (out, inp // tp)
                fused = None
                if path.endswith("linear_qkv"):
                    fused = dict(kind="qkv", heads=d.num_heads // tp, groups=d.num_groups // tp, head_dim=d.head_dim,
                                 rows={"q": shapes_full["q_proj"][0] // tp, "k": shapes_full["k_proj"][0] // tp,
                                       "v": shapes_full["v_proj"][0] // tp},
                                 module_of={"q": "q_proj", "k": "k_proj", "v": "v_proj"})
                elif path.endswith("linear_fc1"):
                    fused = dict(kind="gate_up", rows={"gate": d.ffn_hidden_size // tp, "up": d.ffn_hidden_size // tp},
                                 module_of={"gate": "gate_proj", "up": "up_proj"})
                branch = _LoRABranch(linear, kind, modules, shapes, spec, config, tp, fused)
                with torch.no_grad():
                    for m in modules:
                        full = _peft_init_A(spec.rank, shapes_full[m][1], seed, g, m)
                        branch.lora_A[m].copy_(full if kind == "column" else _tp_slice(full, 1, tp_rank, tp))
                linear.lora = branch   # a submodule: its parameters are the linear's lora.lora_A.<m> ...
                linear.register_forward_hook(_hook(branch))
                linear.sharded_state_dict = _sharded_state_dict(linear, branch)
                params += [*branch.lora_A.values(), *branch.lora_B.values()]
    return params


def _sharded_state_dict(linear, branch: _LoRABranch):
    """The linear's ``sharded_state_dict`` with its adapters sharded as they are: megatron's own
    method labels every tensor it does not know as replicated over TP, which would save one TP
    rank's B rows (column-parallel) or A columns (row-parallel) as the whole tensor."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    if branch.kind == "column":
        axes = {"weight": 0, "bias": 0, **{f"lora.lora_B.{m}": 0 for m in branch.modules}}
    else:
        axes = {"weight": 1, **{f"lora.lora_A.{m}": 1 for m in branch.modules}}

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        return make_sharded_tensors_for_checkpoint(linear.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                   sharded_offsets, tp_group=linear.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])
    return sharded_state_dict


def has_lora(chunks) -> bool:
    """Whether these chunks carry adapters (:func:`apply_lora`)."""
    return any(getattr(c, "megappo_lora", None) is not None for c in chunks)


def lora_spec_of(chunks) -> LoRASpec:
    """The spec :func:`apply_lora` built these chunks' adapters with."""
    spec = next((c.megappo_lora for c in chunks if getattr(c, "megappo_lora", None) is not None), None)
    if spec is None:
        raise LoRAError("the model has no adapters")
    return spec


def merged_hf_tensors(named, adapters: dict[str, torch.Tensor], spec: LoRASpec):
    """``named`` HF ``(name, tensor)`` pairs of the base model with each adapted module's weight
    replaced by ``W + (alpha / r) B A`` (``adapters``: full PEFT-named tensors): the weights a
    merged model serves. Tensors are yielded in ``named``'s order; unadapted ones unchanged."""
    for name, t in named:
        m = _HF_WEIGHT.match(name)
        if m is not None:
            stem = f"base_model.model.{name[:-len('.weight')]}"
            a, b = adapters.get(f"{stem}.lora_A.weight"), adapters.get(f"{stem}.lora_B.weight")
            if a is not None and b is not None:
                t = (t.float() + spec.scaling * (b.float() @ a.float())).to(t.dtype)
        yield name, t


_HF_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")


def _peft_init_A(rank: int, fan_in: int, seed: int, layer: int, module: str) -> torch.Tensor:
    """PEFT's default A: torch's Kaiming-uniform with a=sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + layer * 101 + list(LORA_MODULES).index(module)) & 0x7FFFFFFF)
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def _tp_slice(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return torch.chunk(t, size, dim=dim)[rank]   # shapes were checked to divide


def _branches(chunks):
    """(global layer, HF module, branch) for every adapted module of these chunks."""
    for chunk in chunks:
        for local, layer in _layers(chunk):
            g = _global_layer(chunk, local)
            for path in dict.fromkeys(v[0] for v in LORA_MODULES.values()):
                try:
                    branch = getattr(_module(layer, path), "lora", None)
                except AttributeError:   # an MoE layer has no linear_fc1 / linear_fc2
                    continue
                if branch is not None:
                    for m in branch.modules:
                        yield g, m, branch


def lora_parameters(chunks) -> dict[str, torch.nn.Parameter]:
    """PEFT name -> this rank's piece of every adapter tensor of these chunks."""
    out = {}
    for g, m, branch in _branches(chunks):
        out[peft_name(g, m, "A")] = branch.lora_A[m]
        out[peft_name(g, m, "B")] = branch.lora_B[m]
    return out


def set_lora_enabled(chunks, enabled: bool) -> None:
    """Adapters off: the chunks compute the base model exactly (the reference policy)."""
    for _, _, branch in _branches(chunks):
        branch.enabled = enabled


def _split(branch, which: str) -> Optional[int]:
    """The TP split dim of an adapter tensor (None: replicated)."""
    if branch.tp == 1:
        return None
    if branch.kind == "column":
        return 0 if which == "B" else None
    return 1 if which == "A" else None


@torch.no_grad()
def load_lora_tensors(chunks, tensors: dict[str, torch.Tensor]) -> None:
    """Copy full PEFT-named adapter tensors (``peft_name`` names, e.g. a PEFT adapter's
    safetensors) into this rank's pieces. Every missing, unexpected or mis-shaped name is
    reported together before anything is copied; tensors of layers other stages hold are ignored."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    local = {}
    for g, m, branch in _branches(chunks):
        for which in "AB":
            local[peft_name(g, m, which)] = (branch, m, which)
    problems = [f"missing: {n}" for n in sorted(local) if n not in tensors]
    bad = [n for n in tensors if not _PEFT_NAME.match(n)]
    if bad:
        problems.append("unexpected tensors: " + ", ".join(sorted(bad)))
    plan = []
    for name, (branch, m, which) in local.items():
        if name not in tensors:
            continue
        p = (branch.lora_A if which == "A" else branch.lora_B)[m]
        dim = _split(branch, which)
        full_shape = list(p.shape)
        if dim is not None:
            full_shape[dim] *= branch.tp
        t = tensors[name]
        if list(t.shape) != full_shape:
            problems.append(f"{name}: shape {tuple(t.shape)}, the model expects {tuple(full_shape)}")
            continue
        plan.append((p, t if dim is None else _tp_slice(t, dim, tp_rank, branch.tp)))
    if problems:
        raise LoRAError("adapter tensors do not match the model's adapters: " + "; ".join(problems))
    for p, t in plan:
        p.copy_(t.to(p.dtype))


_PEFT_NAME = re.compile(r"^base_model\.model\.model\.layers\.\d+\.(self_attn|mlp)\.(" + "|".join(LORA_MODULES)
                        + r")\.lora_[AB]\.weight$")


@torch.no_grad()
def export_lora_tensors(chunks, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full PEFT-named adapter tensors (or, with ``grads``, their gradients; zeros where none) of
    the whole model, on every rank. Collective over the TP group, then the pipeline group; the
    adapters are small, so the pipeline exchange sends each stage's dict as one object."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp, tp_group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    mine = {}
    for g, m, branch in _branches(chunks):
        for which in "AB":
            p = (branch.lora_A if which == "A" else branch.lora_B)[m]
            t = (p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p
            t = t.detach().float().contiguous()
            dim = _split(branch, which)
            if dim is not None:
                pieces = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(pieces, t, group=tp_group)
                t = torch.cat(pieces, dim=dim)
            mine[peft_name(g, m, which)] = t.clone()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        stages = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, mine, group=ps.get_pipeline_model_parallel_group())
        mine = {k: v for s in stages for k, v in s.items()}
    return mine


ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def read_peft_adapter(path: str) -> tuple[LoRASpec, dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter folder (``save_pretrained``'s adapter_config.json and
    adapter_model.safetensors) as the spec megappo builds and its tensors by PEFT's names. What
    megappo's adapters cannot compute (rsLoRA, DoRA, trained biases, per-module ranks or alphas,
    extra trained modules, a subset of layers, modules other than the decoder's linears) is
    refused, named."""
    import json
    import os

    from safetensors.torch import load_file

    folder = os.path.expanduser(path)
    cfg_file, weights = os.path.join(folder, ADAPTER_CONFIG), os.path.join(folder, ADAPTER_WEIGHTS)
    for f in (cfg_file, weights):
        if not os.path.isfile(f):
            raise LoRAError(f"{path}: no {os.path.basename(f)} (expected a PEFT LoRA adapter folder)")
    with open(cfg_file) as fh:
        c = json.load(fh)
    problems = []
    if c.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {c.get('peft_type')!r} (LORA only)")
    for key, fine in (("use_rslora", False), ("use_dora", False), ("bias", "none")):
        if c.get(key, fine) != fine:
            problems.append(f"{key}={c[key]!r} (megappo computes {key}={fine!r})")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform", "layer_replication"):
        if c.get(key):
            problems.append(f"{key}={c[key]!r} is not supported")
    targets = c.get("target_modules")
    try:
        modules = lora_targets(targets if isinstance(targets, str) else sorted(targets or []), c.get("exclude_modules"))
    except LoRAError as e:
        problems.append(str(e))
        modules = []
    if problems:
        raise LoRAError(f"{path}: " + "; ".join(problems))
    return LoRASpec(int(c["r"]), float(c["lora_alpha"]), tuple(modules)), load_file(weights)


def write_peft_adapter(path: str, tensors: dict[str, torch.Tensor], spec: LoRASpec,
                       base_model_name_or_path: Optional[str] = None, task_type: str = "CAUSAL_LM") -> None:
    """Write ``tensors`` (PEFT names, e.g. :func:`export_lora_tensors`) as a PEFT adapter folder
    that ``PeftModel.from_pretrained`` loads."""
    import json
    import os

    from safetensors.torch import save_file

    bad = sorted(n for n in tensors if not _PEFT_NAME.match(n))
    if bad:
        raise LoRAError("not PEFT adapter names: " + ", ".join(bad))
    os.makedirs(path, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": task_type, "r": spec.rank, "lora_alpha": spec.alpha,
              "target_modules": list(spec.modules), "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
              "use_dora": False, "fan_in_fan_out": False, "inference_mode": True,
              "base_model_name_or_path": base_model_name_or_path}
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as fh:
        json.dump(config, fh, indent=2)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, os.path.join(path, ADAPTER_WEIGHTS))
