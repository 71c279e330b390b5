"""HuggingFace config -> the numbers megappo builds and converts with, and megatron's TransformerConfig."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["ModelDesc", "ModelConfigError", "SUPPORTED_ARCHITECTURES", "HFModelInfo", "MoEOptions", "describe", "load_hf_config",
           "transformer_config", "padded_vocab_size"]

SUPPORTED_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama",
                           "Qwen3MoeForCausalLM": "qwen3_moe"}
# Scalar-head models (critics, reward models): the same backbones with a one-label ``score``
# head, which only a value-head build can use. verl's critics are token classifiers, hub reward
# models and TRL's value models sequence classifiers -- the same weights (a sequence classifier
# reads the head at the last token, which is where a reward is read).
SCALAR_HEAD_ARCHITECTURES = {f"{name}For{kind}Classification": arch
                             for name, arch in (("Qwen3", "qwen3"), ("Qwen2", "qwen2"), ("Llama", "llama"),
                                                ("Qwen3Moe", "qwen3_moe"))
                             for kind in ("Token", "Sequence")}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelDesc:
    """The numbers the conversion needs (read from an HF config by :func:`describe`)."""

    arch: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_groups: int              # key/value heads
    head_dim: int
    vocab_size: int              # HF rows of embed_tokens / lm_head
    padded_vocab_size: int       # megatron rows (TP-divisible)
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_layernorm: bool
    value_head: bool = False     # critic: a (1, hidden) head replaces the LM head
    # Mixture-of-Experts (Qwen3-MoE): experts per MoE layer, their FFN size, routed per token,
    # router renormalisation, and which layers are MoE (the others are dense, ffn_hidden_size)
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple = ()


class ModelConfigError(ValueError):
    """An HF model megappo cannot build (unsupported architecture/feature, or a layout that does not fit)."""


@dataclass
class HFModelInfo:
    desc: ModelDesc
    hf_config: object
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    inv_freq: torch.Tensor  # RoPE inverse frequencies exactly as transformers computes them


def load_hf_config(path: str, trust_remote_code: bool = False):
    """The folder's config.json through transformers (``trust_remote_code``: the folder's own
    config class may run)."""
    from transformers import AutoConfig

    p = os.path.expanduser(path)
    if not os.path.isfile(os.path.join(p, "config.json")):
        raise ModelConfigError(f"{path}: no config.json (expected a HuggingFace model folder)")
    return AutoConfig.from_pretrained(p, trust_remote_code=trust_remote_code)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron pads the vocabulary so that each TP rank gets an equal, aligned slice."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def _rope_inv_freq(hf_config, arch: str) -> tuple[torch.Tensor, float, str]:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_type" not in params and params:
        # per-layer-type rope parameters (sliding/full attention models) are not supported
        raise ModelConfigError(f"per-layer RoPE parameters are not supported: {params}")
    rope_type = (params or {}).get("rope_type", "default")
    if rope_type not in _ROPE_TYPES:
        raise ModelConfigError(f"RoPE type {rope_type!r} is not supported; supported: {', '.join(_ROPE_TYPES)}")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    cls = {"qwen3": Qwen3RotaryEmbedding, "qwen2": Qwen2RotaryEmbedding, "llama": LlamaRotaryEmbedding,
           "qwen3_moe": Qwen3MoeRotaryEmbedding}[arch]
    rot = cls(hf_config)
    if float(rot.attention_scaling) != 1.0:
        raise ModelConfigError(f"RoPE type {rope_type!r} with attention scaling {rot.attention_scaling} is not supported")
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    return rot.inv_freq.detach().clone().float(), theta, rope_type


def describe(hf_config, tp: int = 1, value_head: bool = False, vocab_divisible_by: int = 128) -> HFModelInfo:
    """Check that megappo supports the model and the TP size; collect the numbers. Errors name them."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    scalar = next((a for a in archs if a in SCALAR_HEAD_ARCHITECTURES), None)
    if arch is None and scalar is not None:
        if not value_head:
            raise ModelConfigError(f"{scalar} is a scalar-head model (critic or reward model); a policy needs a "
                                   f"causal LM ({', '.join(SUPPORTED_ARCHITECTURES)})")
        if getattr(hf_config, "num_labels", 1) != 1:
            raise ModelConfigError(f"{scalar} with num_labels={hf_config.num_labels}; a value or reward head has one label")
        arch = SCALAR_HEAD_ARCHITECTURES[scalar]
    if arch is None:
        raise ModelConfigError(f"unsupported architecture {archs or getattr(hf_config, 'model_type', '?')}; "
                               f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    c = hf_config
    act = getattr(c, "hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"hidden_act={act!r} is not supported (SwiGLU with silu only)")
    if getattr(c, "use_sliding_window", False):
        raise ModelConfigError("use_sliding_window=True is not supported")
    if arch == "llama" and getattr(c, "mlp_bias", False):
        raise ModelConfigError("Llama with mlp_bias=True is not supported")
    if arch in ("llama", "qwen3", "qwen3_moe") and getattr(c, "attention_bias", False):
        raise ModelConfigError(f"{archs[0]} with attention_bias=True (biased o_proj) is not supported")
    heads, groups = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    problems = []
    for what, n in (("num_attention_heads", heads), ("num_key_value_heads", groups),
                    ("intermediate_size", c.intermediate_size)):
        if n % tp:
            problems.append(f"{what} ({n}) is not divisible by tensor_model_parallel_size ({tp})")
    if heads % groups:
        problems.append(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({groups})")
    if problems:
        raise ModelConfigError("; ".join(problems))
    moe = _moe_fields(c) if arch == "qwen3_moe" else {}
    inv_freq, theta, _ = _rope_inv_freq(c, arch)
    desc = ModelDesc(
        arch=arch, num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size,
        num_heads=heads, num_groups=groups, head_dim=head_dim, vocab_size=c.vocab_size,
        padded_vocab_size=padded_vocab_size(c.vocab_size, tp, vocab_divisible_by),
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)), qkv_bias=arch == "qwen2",
        qk_layernorm=arch in ("qwen3", "qwen3_moe"), value_head=value_head, **moe)
    return HFModelInfo(desc=desc, hf_config=c, rms_norm_eps=float(c.rms_norm_eps),
                       max_position_embeddings=int(c.max_position_embeddings), rope_theta=theta, inv_freq=inv_freq)


def _moe_fields(c) -> dict:
    """Qwen3-MoE's expert settings; a layer is MoE unless listed in mlp_only_layers, and only
    every decoder_sparse_step-th (transformers' rule)."""
    E, k = int(c.num_experts), int(c.num_experts_per_tok)
    if not 0 < k <= E:
        raise ModelConfigError(f"num_experts_per_tok ({k}) must be in 1..num_experts ({E})")
    if getattr(c, "shared_expert_intermediate_size", 0):
        raise ModelConfigError("shared experts are not supported (Qwen3-MoE has none)")
    step, dense = int(getattr(c, "decoder_sparse_step", 1) or 1), set(getattr(c, "mlp_only_layers", None) or [])
    layers = tuple(i for i in range(c.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    return dict(num_experts=E, moe_ffn_hidden_size=int(c.moe_intermediate_size), moe_topk=k,
                norm_topk_prob=bool(getattr(c, "norm_topk_prob", False)), moe_layers=layers)


@dataclass(frozen=True)
class MoEOptions:
    """A Mixture-of-Experts role's router settings (megatron.override_transformer_config.moe_*).
    ``grouped_gemm``: TransformerEngine's grouped expert GEMMs (TEGroupedMLP) instead of one
    linear pair per expert (SequentialMLP); the builders turn it on with TE's layer spec."""
    aux_loss_coeff: float = 0.0
    load_balancing_type: str = "aux_loss"
    z_loss_coeff: Optional[float] = None
    router_dtype: Optional[str] = "fp32"
    grouped_gemm: bool = False


def transformer_config(info: HFModelInfo, *, tp: int = 1, pp: int = 1, vpp: Optional[int] = None,
                       sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                       cpu: bool = False, recompute: Optional[tuple[str, str, int]] = None, ep: int = 1,
                       etp: int = 1, moe: MoEOptions = MoEOptions(), cp: int = 1, split=None):
    """megatron TransformerConfig for the model and layout. CPU and GPU differ only in where
    parameters are initialised (``use_cpu_initialization``). ``recompute``: (granularity,
    method, num_layers) of megatron's activation recomputation; selective takes no method or
    layer count. ``ep``, ``moe``: expert parallelism and router settings (MoE models only); ``cp``: context
    parallelism; ``split``: an uneven pipeline split (megappo.layout.PipelineSplit; None: even)."""
    from megatron.core.transformer import TransformerConfig

    from megappo.layout import PipelineSplit, split_problems

    d = info.desc
    problems = split_problems(d.num_layers, pp, vpp, split)
    if problems:
        raise ModelConfigError("; ".join(problems))
    split = split or PipelineSplit()
    experts = {}
    if etp != 1:
        raise ModelConfigError(f"expert_tensor_parallel_size must be 1 (each expert whole on its EP rank), got {etp}")
    if d.num_experts:
        if d.num_experts % ep:
            raise ModelConfigError(f"num_experts ({d.num_experts}) is not divisible by expert_model_parallel_size ({ep})")
        if tp > 1 and not sequence_parallel:
            raise ModelConfigError("Mixture-of-Experts with tensor_model_parallel_size > 1 needs sequence_parallel "
                                   "(megatron's MoE layer refuses to train without it)")
        # HF's router: softmax over all experts, top-k, renormalised when norm_topk_prob; megatron's
        # softmax over the top-k logits is the same renormalised distribution (pre_softmax=False).
        experts = dict(num_moe_experts=d.num_experts, moe_router_topk=d.moe_topk, moe_ffn_hidden_size=d.moe_ffn_hidden_size,
                   moe_router_score_function="softmax", moe_router_pre_softmax=not d.norm_topk_prob,
                   moe_router_load_balancing_type=moe.load_balancing_type if moe.aux_loss_coeff > 0 else "none",
                   moe_aux_loss_coeff=moe.aux_loss_coeff, moe_z_loss_coeff=moe.z_loss_coeff,
                   moe_router_dtype=moe.router_dtype, moe_grouped_gemm=moe.grouped_gemm,
                   moe_layer_freq=[1 if i in d.moe_layers else 0 for i in range(d.num_layers)],
                   expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    elif ep != 1:
        raise ModelConfigError(f"expert_model_parallel_size={ep} needs a Mixture-of-Experts model")
    return TransformerConfig(**experts,
        num_layers=d.num_layers, hidden_size=d.hidden_size, ffn_hidden_size=d.ffn_hidden_size,
        num_attention_heads=d.num_heads, num_query_groups=d.num_groups, kv_channels=d.head_dim,
        normalization="RMSNorm", layernorm_epsilon=info.rms_norm_eps, qk_layernorm=d.qk_layernorm,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=d.qkv_bias, hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=vpp, sequence_parallel=bool(sequence_parallel and tp > 1),
        num_layers_in_first_pipeline_stage=split.first if pp > 1 else None,
        num_layers_in_last_pipeline_stage=split.last if pp > 1 else None,
        account_for_embedding_in_pipeline_split=split.embedding and pp > 1,
        account_for_loss_in_pipeline_split=split.loss and pp > 1,
        params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16, use_cpu_initialization=cpu,
        recompute_granularity=recompute[0] if recompute else None,
        recompute_method=recompute[1] if recompute and recompute[0] == "full" else None,
        recompute_num_layers=recompute[2] if recompute and recompute[0] == "full" else None,
        # megatron-core 0.16.1 marks tensor-parallel weights (tensor_model_parallel, partition_dim)
        # only inside its weight-init functions: with perform_initialization=False the gradient
        # norm treats every TP shard as a duplicate (wrong clipping) and checkpoints lose the
        # layout. The random init is overwritten by the HF weights right after.
        perform_initialization=True,
        # Pipeline stages exchange shapes per micro-batch (packed/dynamic batches vary in length);
        # megatron checks the MoE dispatcher against it even for dense models. Not under VPP:
        # the interleaved schedule's shape exchange sends both ways at once and deadlocks on
        # gloo, so the worker gives all micro-batches of a pass one shape instead. VPP also
        # needs megatron's unbatched p2p: with PP=2 the previous and next stage are one rank,
        # and batched sends in both directions to it are matched in the wrong order.
        variable_seq_lengths=not vpp, batch_p2p_comm=not vpp, moe_token_dispatcher_type="alltoall",
        # Fused kernels come from apex/TransformerEngine; the unfused paths are exact and portable.
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )
