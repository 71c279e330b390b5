"""Layer specs: TransformerEngine's on GPU when TE is installed, megatron's local spec otherwise.

The local spec's torch norm wrapper refuses sequence parallelism; :class:`RMSNorm` here computes
exactly what HF's RMSNorm computes (in float32) and tags its weight ``sequence_parallel`` so
megatron all-reduces its gradient over TP when SP is on.
"""
from __future__ import annotations

import copy
import math
from typing import Optional

import torch

__all__ = ["RMSNorm", "QKRMSNorm", "SdpaCoreAttention", "ValueHead", "te_available", "layer_spec"]


def init_device(config):
    """Where megatron creates parameters: the current CUDA device unless use_cpu_initialization."""
    return "cpu" if config.use_cpu_initialization else torch.cuda.current_device()


class RMSNorm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=init_device(config)))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class QKRMSNorm(RMSNorm):
    """Per-head q/k norm: works on TP-split heads, not on sequence shards (megatron reduces
    q_layernorm/k_layernorm grads over TP by name)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **kw):
        super().__init__(config, hidden_size, eps, **kw)
        setattr(self.weight, "sequence_parallel", False)


class ValueHead(torch.nn.Module):
    """The critic's scalar head, used in place of the output layer of a GPTModel.

    ``weight`` (1, hidden) and ``bias`` (1,) map to HF's ``score.weight`` / ``score.bias``.
    Replicated on every TP rank (one output cannot be split); under sequence parallelism the
    hidden states are gathered first. Init: N(0, std^2) from a CPU generator seeded with ``seed``
    so every rank holds the same head, then placed where megatron places parameters (the current
    CUDA device unless ``use_cpu_initialization``).
    """

    def __init__(self, config, seed: int, std: float = 0.0):
        super().__init__()
        self.config = config
        self.sequence_parallel = bool(config.sequence_parallel)
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(1, config.hidden_size, generator=g, dtype=torch.float32) * std
        device = init_device(config)
        self.weight = torch.nn.Parameter(w.to(device=device, dtype=config.params_dtype))
        # transformers' token-classification head (a one-label reward model, the critic export)
        # has a bias; starting at zero it changes nothing until a checkpoint sets it.
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype, device=device))

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def uses_te(chunks) -> bool:
    """Whether model chunks were built with TransformerEngine's layer spec (build_model marks them)."""
    return any(getattr(c, "megappo_te_spec", False) for c in chunks)


def packs_sequences(chunks) -> bool:
    """Whether model chunks' attention takes packed sequences (THD, megatron's PackedSeqParams):
    TransformerEngine's, or :class:`SdpaCoreAttention` in every layer of the local spec."""
    if uses_te(chunks):
        return True
    attention = [m for c in chunks for name, m in c.named_modules() if name.endswith("core_attention")]
    return bool(attention) and all(isinstance(m, SdpaCoreAttention) for m in attention)


def te_available() -> bool:
    """Whether megatron itself can use TransformerEngine. A broken TE install still imports
    (its ``__init__`` swallows the error) while megatron's own import of TE's pieces fails and
    sets ``HAVE_TE = False``; asking for the TE spec then would build a spec without TE."""
    if not torch.cuda.is_available():
        return False
    from megatron.core.extensions import transformer_engine as mte
    from megatron.core.models.gpt import gpt_layer_specs

    return bool(gpt_layer_specs.HAVE_TE and mte.HAVE_TE)


class SdpaCoreAttention(torch.nn.Module):
    """Core attention through torch's ``scaled_dot_product_attention``, in megatron's core-attention
    interface: q [s, b, heads, d], k/v [s, b, groups, d] in, [s, b, heads x d] out.

    megatron's local ``DotProductAttention`` runs a dozen ops per layer (GQA copies, baddbmm, a
    mask built every call, softmax, dropout, bmm, permutes); this is one kernel (flash or
    memory-efficient on GPU, flash on CPU). On the tiny CPU models of the test suite and the
    learning benchmark a PPO step took 10% less time with it. The local spec uses it only where
    it computes what DotProductAttention computes (:meth:`supports`); DotProductAttention stays
    the reference it is tested against."""

    def __init__(self, config, layer_number=None, attn_mask_type=None, attention_type=None, softmax_scale=None,
                 cp_comm_type=None, pg_collection=None, **_):
        super().__init__()
        self.scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        self.attn_mask_type = attn_mask_type
        self.cp = config.context_parallel_size
        self.cp_group = None
        if self.cp > 1:
            from megatron.core import parallel_state as ps

            self.cp_group = getattr(pg_collection, "cp", None) or ps.get_context_parallel_group()

    @staticmethod
    def supports(config) -> bool:
        """False where DotProductAttention does more than causal softmax attention: sliding
        windows, attention sinks, query-key layer scaling, attention dropout. (Context
        parallelism, which DotProductAttention refuses, is this module's own: see forward.)"""
        return (config.window_size is None and getattr(config, "softmax_type", "vanilla") == "vanilla"
                and not config.apply_query_key_layer_scaling and not config.attention_dropout)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from megatron.core.transformer.enums import AttnMaskType

        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("SdpaCoreAttention: an explicit attention mask or bias needs megatron's "
                             "DotProductAttention or TransformerEngine's (megappo passes none)")
        if mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(f"SdpaCoreAttention: attention mask type {mask_type} without a mask tensor")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, mask_type == AttnMaskType.causal)
        causal, mask = mask_type == AttnMaskType.causal, None
        if self.cp > 1:
            # Context parallelism (megappo.models.context_parallel's layout): this rank's
            # queries are two chunks of the sequence; they attend to every rank's keys and values,
            # gathered (the all-gather form of CP: its memory is the sequence's K/V, which GQA keeps
            # small), under the causal mask of their positions in the whole sequence.
            from .context_parallel import gather_kv

            key, value = gather_kv(key, self.cp_group), gather_kv(value, self.cp_group)
            if causal:
                mask, causal = self._cp_causal_mask(key.shape[0], query.device), False
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))   # [b, heads, s, d]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=k.shape[1] != q.shape[1])
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _packed(self, query, key, value, params, causal: bool) -> torch.Tensor:
        """Packed sequences (THD: q [t, heads, d], k/v [t, groups, d], the sequences end to end as
        ``params.cu_seqlens_q_padded`` marks them): each sequence attends within itself, one
        kernel call per sequence (no [t, t] mask: on a GPU without TransformerEngine a packed
        micro-batch of 24k tokens would need a 0.6 GB mask per layer). Under context
        parallelism the bounds are the whole row's and this rank holds two chunks of each
        sequence (:func:`~megappo.models.context_parallel.packed_local_positions`): keys and values
        are gathered for the row, and each sequence's queries attend to its keys under the
        causal mask of their positions in it."""
        if params.qkv_format != "thd":
            raise ValueError(f"SdpaCoreAttention: packed sequences in format {params.qkv_format!r}; megappo packs 'thd'")
        bounds, order = self._packed_layout(params, query.device)
        if self.cp > 1:
            from .context_parallel import gather_kv

            key, value = gather_kv(key, self.cp_group, order), gather_kv(value, self.cp_group, order)
        outs, held = [], 0
        for a, b in zip(bounds[:-1], bounds[1:]):
            n = (b - a) // self.cp        # this rank's tokens of the sequence
            q = query[held:held + n].permute(1, 0, 2)[None]    # [1, heads, n, d]
            k, v = (x[a:b].permute(1, 0, 2)[None] for x in (key, value))
            held += n
            mask, is_causal = None, causal
            if causal and self.cp > 1:
                mask, is_causal = self._cp_causal_mask(b - a, query.device), False
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale, enable_gqa=k.shape[1] != q.shape[1])
            outs.append(out[0].permute(1, 0, 2))
        return torch.cat(outs).reshape(query.shape[0], 1, -1)

    def _packed_layout(self, params, device) -> tuple[list, Optional[torch.Tensor]]:
        """(the row's sequence bounds, the CP ranks' gathered tokens in natural order (None
        without CP)), read once per forward: the same ``params`` reach every layer of a forward
        (and its recomputation), so the bounds' device-to-host copy and the order's sort are not
        repeated per layer. Kept on ``params`` with the tensor they were read from."""
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        layout = getattr(params, "_megappo_layout", None)
        if layout is None or layout[0] is not cu or layout[1] != (self.cp, device):
            bounds, order = cu.tolist(), None
            if self.cp > 1:
                from .context_parallel import natural_order, packed_local_positions

                order = natural_order([packed_local_positions(bounds, self.cp, r) for r in range(self.cp)]).to(device)
            layout = (cu, (self.cp, device), bounds, order)
            params._megappo_layout = layout
        return layout[2], layout[3]

    def _cp_causal_mask(self, seq_len: int, device) -> torch.Tensor:
        """[s_local, S] True where this rank's query may attend to a key: at or before its
        position in the whole sequence (megappo.simulate replaces it: the flash kernel of a GPU
        keeps no mask)."""
        from .context_parallel import local_positions

        qpos = local_positions(seq_len, self.cp, self.cp_group.rank(), device=device)
        return torch.arange(seq_len, device=device)[None, :] <= qpos[:, None]


def layer_spec(config, qk_layernorm: bool, use_te: bool, vp_stage=None, pp_rank=None, core_attention=None):
    """Block spec for this stage: TE's layer spec, or the local spec with megappo's RMSNorm and,
    where it computes the same, :class:`SdpaCoreAttention` (``core_attention``: a module class in
    place of either; megappo.simulate passes SdpaCoreAttention for any config)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    experts = config.num_moe_experts
    if use_te:
        if experts:   # per-layer dense/MoE specs with TE's grouped experts
            # this builder takes q/k norms from config.qk_layernorm, not from an argument
            if bool(config.qk_layernorm) != qk_layernorm:
                raise ValueError(f"layer_spec: qk_layernorm={qk_layernorm} but the TransformerConfig says "
                                 f"{config.qk_layernorm}")
            return specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm",
                                                    vp_stage=vp_stage, pp_rank=pp_rank)
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)

    def local(num_experts):
        spec = copy.deepcopy(specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                                            normalization="RMSNorm", qk_layernorm=qk_layernorm))
        sub = spec.submodules
        sub.input_layernorm = RMSNorm
        sub.pre_mlp_layernorm = RMSNorm
        if core_attention is not None:
            sub.self_attention.submodules.core_attention = core_attention
        elif SdpaCoreAttention.supports(config):
            sub.self_attention.submodules.core_attention = SdpaCoreAttention
        if qk_layernorm:
            sub.self_attention.submodules.q_layernorm = QKRMSNorm
            sub.self_attention.submodules.k_layernorm = QKRMSNorm
        return spec

    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if not experts:
        return TransformerBlockSubmodules(layer_specs=[local(None)] * n, layer_norm=RMSNorm)
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    # MoE models mix dense and expert layers (moe_layer_freq, from mlp_only_layers / decoder_sparse_step)
    first = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    moe, dense = local(experts), local(None)
    freq = config.moe_layer_freq
    layer_specs = [moe if freq[first + i] else dense for i in range(n)]
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=RMSNorm)
