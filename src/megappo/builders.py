"""Builders: each component of a run from its config section (docs/architecture.md).

The trainer calls them in a fixed order: the rollout engine first (vLLM's start-up reseeds
RNGs, and under the external launcher every rank must construct it at the same point), then the
actor, the reference, the critic and the reward model. Each returns None when the run does not
need it.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from megappo import watchdog
from megappo.config import (CriticModelConfig, MegatronConfig, ModelConfig, OptimConfig, PPOConfig, RefMegatronConfig,
                            critic_enabled)


# vLLM's start (weights, compilation, CUDA graphs) may hold the interpreter for minutes
def import_external_lib(cfg: PPOConfig) -> None:
    """actor_rollout_ref.model.external_lib: imported before anything is loaded, so the classes
    it registers with transformers exist."""
    import importlib

    name = cfg.actor_rollout_ref.model.external_lib
    if name:
        try:
            importlib.import_module(name)
        except Exception as e:
            raise ImportError(f"actor_rollout_ref.model.external_lib: importing {name!r} failed: "
                              f"{type(e).__name__}: {e}") from e


def model_folder(model: ModelConfig | CriticModelConfig) -> str:
    """The HF folder a role's model section reads: its path, or with override_config.model_config
    the process's merged folder (megappo.models.overrides), so that the megatron build, vLLM and
    each checkpoint's huggingface/ see the same config.json."""
    from megappo.models import overridden_folder

    return overridden_folder(os.path.expanduser(model.path), model.override_config.model_config)


def load_tokenizer(cfg: PPOConfig):
    """The actor's tokenizer (model.path), as data.trust_remote_code allows, with
    actor_rollout_ref.model.custom_chat_template in place of its own when set."""
    from transformers import AutoTokenizer

    m = cfg.actor_rollout_ref.model
    tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(m.path), trust_remote_code=cfg.data.trust_remote_code)
    if m.custom_chat_template is not None:
        tokenizer.chat_template = m.custom_chat_template
    return tokenizer


@watchdog.in_phase("engine_start", watchdog.SLOW)
def build_engine(cfg: PPOConfig):
    """The rollout engine (actor_rollout_ref.rollout), loaded with dummy weights: the first
    weight sync fills them from the actor."""
    from megappo.rollout import VLLMRollout, engine_failure, vllm_engine_kwargs

    arr, d, tr = cfg.actor_rollout_ref, cfg.data, cfg.trainer
    ro = arr.rollout
    engines = {"vllm": VLLMRollout}  # rollout.name (validated: vllm only today)
    vllm_engine_kwargs(ro.engine_kwargs.vllm, d.max_prompt_length + d.max_response_length)   # named, before the start
    try:
        return engines[ro.name](
            model_folder(arr.model), device=tr.device, tensor_parallel_size=ro.tensor_model_parallel_size,
            dtype="float32" if tr.device == "cpu" else ro.dtype, max_model_len=d.max_prompt_length + d.max_response_length,
            max_num_seqs=ro.max_num_seqs, max_num_batched_tokens=ro.max_num_batched_tokens,
            gpu_memory_utilization=ro.gpu_memory_utilization,
            enforce_eager=enforce_eager(cfg),
            free_cache_engine=ro.free_cache_engine, seed=arr.actor.megatron.seed, lora_rank=engine_lora_rank(cfg),
            engine_kwargs=ro.engine_kwargs.vllm, trust_remote_code=arr.model.trust_remote_code)
    except Exception as e:   # named: the phase, and the memory settings when memory ran out
        raise engine_failure("its start", e, ro.gpu_memory_utilization) from e


def engine_lora_rank(cfg: PPOConfig) -> int:
    """The rank of the adapters the engine serves: the actor's LoRA rank, or 0 (no adapters:
    full weights, or adapters synced merged; see megappo.sync). Merged: a rank vLLM cannot serve,
    and Mixture-of-Experts models (vLLM's LoRA swaps the experts' method for one whose in-place
    weight reload megappo has not verified; its checks refuse it)."""
    from megappo.models import load_hf_config, lora_spec_from_config
    from megappo.rollout import VLLM_MAX_LORA_RANK

    spec = lora_spec_from_config(cfg.actor_rollout_ref.model)
    if spec is None or spec.rank > VLLM_MAX_LORA_RANK:
        return 0
    m = cfg.actor_rollout_ref.model
    return 0 if getattr(load_hf_config(model_folder(m), m.trust_remote_code), "num_experts", 0) else spec.rank


def enforce_eager(cfg: PPOConfig) -> bool:
    """rollout.enforce_eager, or by default: CUDA graphs on GPU, eager on CPU."""
    eager = cfg.actor_rollout_ref.rollout.enforce_eager
    return eager if eager is not None else cfg.trainer.device == "cpu"


def build_model(cfg: PPOConfig, model_path: str, mc: MegatronConfig | RefMegatronConfig, *, value_head: bool,
                device: torch.device, checkpointing: bool = False, section: Optional[str] = None, lora=None,
                lora_adapter_path: Optional[str] = None, trust_remote_code: bool = False):
    """One role's megatron model from its HF folder and its megatron section ``mc`` (the layout
    equals the actor's, validated; sequence parallelism, the seed and recomputation are the
    role's; ``checkpointing``: its model section's enable_gradient_checkpointing). The weights
    come from model.path, or from ``mc``'s dist_checkpointing_path when it sets
    use_dist_checkpointing (``section``: ``mc``'s key; None for the reward model, which borrows
    the critic's layout but always loads its own model.path). ``lora`` (a LoRASpec): adapters on
    the loaded weights, which are frozen (megatron's local layer spec: see megappo.models.lora),
    starting from ``lora_adapter_path``'s PEFT adapter when given; a critic's value head trains.
    Returns (HFModelInfo, TransformerConfig, model chunks)."""
    from megappo.convert import load_hf_weights
    from megappo.layout import RankCoords, pipeline_split
    from megappo.models import build_model as build_chunks
    from megappo.models import describe, load_hf_config, transformer_config

    path = os.path.expanduser(model_path)
    info = describe(load_hf_config(path, trust_remote_code), tp=mc.tensor_model_parallel_size, value_head=value_head)
    moe = info.desc.num_experts > 0   # a dense role beside an MoE actor ignores the expert layout
    tcfg = transformer_config(info, tp=mc.tensor_model_parallel_size, pp=mc.pipeline_model_parallel_size,
                              vpp=mc.virtual_pipeline_model_parallel_size, sequence_parallel=mc.sequence_parallel,
                              params_dtype=torch.float32 if cfg.trainer.device == "cpu" else torch.bfloat16,
                              cpu=device.type == "cpu", recompute=recompute_settings(mc, checkpointing),
                              ep=mc.expert_model_parallel_size if moe else 1, etp=mc.expert_tensor_parallel_size or 1,
                              moe=moe_options(cfg, mc), cp=mc.context_parallel_size, split=pipeline_split(cfg, mc))
    # the reference has no seed of its own: all its weights are loaded
    seed = cfg.actor_rollout_ref.actor.megatron.seed if isinstance(mc, RefMegatronConfig) else mc.seed
    chunks = build_chunks(info, tcfg, value_head=value_head, seed=seed,
                          value_head_std=cfg.critic.model.value_head_init_std, use_te=False if lora else None)
    if section is not None and mc.use_dist_checkpointing:
        start_from_checkpoint(chunks, mc, value_head=value_head, section=section)
    else:
        load_hf_weights(chunks, path, info.desc, RankCoords.from_megatron(tcfg))
    if lora is not None:
        add_adapters(chunks, info.desc, lora, seed, lora_adapter_path, value_head)
    return info, tcfg, chunks


def add_adapters(chunks, desc, spec, seed: int, adapter_path: Optional[str], value_head: bool) -> None:
    """LoRA adapters on a role's loaded model (its base frozen), from a PEFT adapter folder when
    given; a value head stays trainable (a LoRA critic)."""
    from megappo.models import apply_lora, load_lora_tensors, read_peft_adapter

    apply_lora(chunks, desc, spec, seed=seed)
    if adapter_path:
        load_lora_tensors(chunks, read_peft_adapter(os.path.expanduser(adapter_path))[1])
    if value_head:
        for c in chunks:
            if getattr(c, "post_process", False):
                for p in c.output_layer.parameters():
                    p.requires_grad_(True)


def start_from_checkpoint(chunks, mc: MegatronConfig | RefMegatronConfig, *, value_head: bool, section: str) -> None:
    """A role's weights from its dist_checkpointing_path (verl's use_dist_checkpointing) instead
    of model.path's HF weights; a mismatch is an error naming ``section``'s key and the tensors."""
    from megappo.checkpoint import load_start_weights

    notes = load_start_weights(chunks, os.path.expanduser(mc.dist_checkpointing_path),
                               prefix=mc.dist_checkpointing_prefix, value_head=value_head,
                               key=f"{section}.dist_checkpointing_path")
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        for note in [f"{section}: weights from {mc.dist_checkpointing_path}"] + notes:
            print(f"[megappo] {note}", flush=True)


def moe_options(cfg: PPOConfig, mc: MegatronConfig | RefMegatronConfig):
    """A role's Mixture-of-Experts router settings (its override_transformer_config.moe_*). The
    forward-only reference has no losses and routes in the actor's precision, so that its
    log-probs start equal to the actor's."""
    from megappo.models import MoEOptions, te_available

    grouped = te_available()   # TE's layer spec (models.build_model) comes with its grouped experts
    if isinstance(mc, RefMegatronConfig):
        actor = cfg.actor_rollout_ref.actor.megatron.override_transformer_config
        return MoEOptions(router_dtype=actor.moe_router_dtype, grouped_gemm=grouped)
    r = mc.override_transformer_config
    return MoEOptions(aux_loss_coeff=r.moe_aux_loss_coeff, load_balancing_type=r.moe_router_load_balancing_type,
                      z_loss_coeff=r.moe_z_loss_coeff, router_dtype=r.moe_router_dtype, grouped_gemm=grouped)


def recompute_settings(mc: MegatronConfig | RefMegatronConfig, checkpointing: bool) -> Optional[tuple[str, str, int]]:
    """megatron's (granularity, method, num_layers) for a training role: its
    override_transformer_config.recompute_*, or enable_gradient_checkpointing (verl's key, here
    full recomputation of every layer; verl's Megatron backend ignores it); None without recomputation (and for the forward-only reference)."""
    if isinstance(mc, RefMegatronConfig):
        return None
    r = mc.override_transformer_config
    if r.recompute_granularity is not None:
        return r.recompute_granularity, r.recompute_method, r.recompute_num_layers
    return ("full", "uniform", 1) if checkpointing else None


def _optimizer(o: OptimConfig, total_steps: int, use_distributed_optimizer: bool) -> dict:
    """A worker's optimizer and schedule settings from its optim section."""
    warm = o.lr_warmup_steps if o.lr_warmup_steps >= 0 else int(o.lr_warmup_steps_ratio * total_steps)
    return dict(lr=o.lr, weight_decay=o.weight_decay, clip_grad=o.clip_grad, betas=tuple(o.betas),
                use_distributed_optimizer=use_distributed_optimizer, lr_warmup_steps=warm,
                lr_decay_steps=total_steps, lr_decay_style=o.lr_decay_style, min_lr=o.min_lr)


def packing(requested: bool, chunks, key: Optional[str]) -> bool:
    """Whether a role packs its micro-batches: use_remove_padding and an attention that takes
    packed sequences (THD: TransformerEngine's, or megappo's in the local spec; with context
    parallelism too), and no per-sequence MoE load-balancing loss. Requested where it cannot be,
    it is said once and ignored: padded micro-batches compute the same numbers."""
    from megappo.models import packs_sequences

    say = key and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0)
    if requested and not packs_sequences(chunks):
        if say:
            print(f"megappo: {key}=true needs an attention that takes packed sequences (TransformerEngine's, or "
                  "megappo's where the local spec can use it: no sliding window, attention sink or dropout); this "
                  "model has megatron's DotProductAttention, so its micro-batches stay padded", flush=True)
        return False
    if requested and _seq_aux_loss(chunks):
        if say:
            print(f"megappo: {key}=true with moe_router_load_balancing_type=seq_aux_loss: megatron computes that "
                  "loss over each column of a micro-batch, which packing makes one row of many sequences; the "
                  "micro-batches stay padded, so that it stays a per-sequence loss", flush=True)
        return False
    return requested


def _seq_aux_loss(chunks) -> bool:
    """Whether a Mixture-of-Experts model weighs megatron's per-sequence load-balancing loss."""
    c = getattr(chunks[0], "config", None)
    if c is None or not getattr(c, "num_moe_experts", None):
        return False
    types, coeffs = c.moe_router_load_balancing_type, c.moe_aux_loss_coeff
    types = types if isinstance(types, (list, tuple)) else [types]
    coeffs = coeffs if isinstance(coeffs, (list, tuple)) else [coeffs] * len(types)
    return any(t == "seq_aux_loss" and w > 0 for t, w in zip(types, coeffs))


def _set_offload(worker, mc: MegatronConfig) -> None:
    """megatron.param_offload / grad_offload / optimizer_offload of a training role."""
    worker.set_offload(params=mc.param_offload, grads=mc.grad_offload, optimizer=mc.optimizer_offload)


def build_actor(cfg: PPOConfig, device: torch.device, pad_id: int, total_steps: int):
    """(HFModelInfo, Actor) of the policy (actor_rollout_ref.model, .actor)."""
    from megappo.workers import Actor

    from megappo.models import lora_spec_from_config

    arr = cfg.actor_rollout_ref
    info, tcfg, chunks = build_model(cfg, model_folder(arr.model), arr.actor.megatron, value_head=False, device=device,
                                     trust_remote_code=arr.model.trust_remote_code,
                                     checkpointing=arr.model.enable_gradient_checkpointing,
                                     section="actor_rollout_ref.actor.megatron",
                                     lora=lora_spec_from_config(arr.model), lora_adapter_path=arr.model.lora_adapter_path)
    actor = Actor(chunks, tcfg, device=device, vocab_size=info.desc.vocab_size, pad_token_id=pad_id,
                  **_optimizer(arr.actor.optim, total_steps, arr.actor.megatron.use_distributed_optimizer))
    actor.desc = info.desc
    _set_offload(actor, arr.actor.megatron)
    actor.pack_sequences = packing(arr.model.use_remove_padding, chunks, "actor_rollout_ref.model.use_remove_padding")
    return info, actor


def build_reference(cfg: PPOConfig, device: torch.device, pad_id: int, actor=None):
    """The frozen reference policy, when a KL term needs it (actor.use_kl_loss or
    algorithm.use_kl_in_reward); else None. A LoRA ``actor``'s reference is its own base with the
    adapters switched off (no second copy of the weights)."""
    from megappo.models import has_lora
    from megappo.workers import Actor, AdaptersOff

    arr = cfg.actor_rollout_ref
    if not (arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward):
        return None
    if actor is not None and has_lora(actor.chunks):
        return AdaptersOff(actor)
    info, tcfg, chunks = build_model(cfg, model_folder(arr.model), arr.ref.megatron, value_head=False, device=device,
                                     trust_remote_code=arr.model.trust_remote_code,
                                     section="actor_rollout_ref.ref.megatron")
    ref = Actor(chunks, tcfg, device=device, vocab_size=info.desc.vocab_size, pad_token_id=pad_id)
    ref.set_offload(params=arr.ref.megatron.param_offload)
    # (use_remove_padding is the actor's model section's)
    ref.pack_sequences = packing(arr.model.use_remove_padding, chunks, None)
    return ref


def build_critic(cfg: PPOConfig, device: torch.device, pad_id: int, total_steps: int):
    """The critic (critic.*) when the estimator needs one (or critic.enable); else None."""
    from megappo.workers import Critic

    if not critic_enabled(cfg):
        return None
    from megappo.models import lora_spec_from_config

    c = cfg.critic
    info, tcfg, chunks = build_model(cfg, model_folder(c.model), c.megatron, value_head=True, device=device,
                                  trust_remote_code=c.model.trust_remote_code,
                                  checkpointing=c.model.enable_gradient_checkpointing, section="critic.megatron",
                                  lora=lora_spec_from_config(c.model))
    critic = Critic(chunks, tcfg, device=device, pad_token_id=pad_id, value_mode=c.value_mode,
                    **_optimizer(c.optim, total_steps, c.megatron.use_distributed_optimizer))
    critic.desc = info.desc
    _set_offload(critic, c.megatron)
    critic.pack_sequences = packing(c.model.use_remove_padding, chunks, "critic.model.use_remove_padding")
    return critic


def build_reward_model(cfg: PPOConfig, device: torch.device, pad_id: int, tokenizer) -> Optional[object]:
    """The reward model (reward_model.enable, .model.path) on the critic's layout; else None."""
    from megappo.workers import RewardModel

    rm = cfg.reward_model
    if not rm.enable:
        return None
    info, tcfg, chunks = build_model(cfg, rm.model.path, cfg.critic.megatron, value_head=True, device=device,
                                     trust_remote_code=rm.model.trust_remote_code)
    if info.desc.vocab_size < len(tokenizer):
        raise ValueError(f"reward_model.model.path: its vocabulary ({info.desc.vocab_size}) is smaller than "
                         f"the actor tokenizer's ({len(tokenizer)}); the reward model must share it")
    model = RewardModel(chunks, tcfg, device=device, pad_token_id=pad_id)
    model.pack_sequences = packing(rm.model.use_remove_padding, chunks, "reward_model.model.use_remove_padding")
    return model


def loss_specs(cfg: PPOConfig):
    """(PolicyLossSpec, ValueLossSpec): the actor's and the critic's loss settings, resolved once.
    A null clip_ratio_low/high falls back to clip_ratio (verl); seq-mean-token-sum-norm divides
    by data.max_response_length; rollout_correction.loss_type=reinforce in bypass mode selects the
    reinforce loss, with rollout_is / rollout_is_threshold as its weights."""
    from megappo import algo

    act, c, norm = cfg.actor_rollout_ref.actor, cfg.critic, cfg.data.max_response_length
    pl, rc = act.policy_loss, cfg.algorithm.rollout_correction
    # bypass mode's REINFORCE (verl's rollout_correction.loss_type) is the policy loss itself
    loss_mode = "reinforce" if rc.bypass_mode and rc.loss_type == "reinforce" else pl.loss_mode
    policy = algo.PolicyLossSpec(
        clip_ratio_low=act.clip_ratio_low if act.clip_ratio_low is not None else act.clip_ratio,
        clip_ratio_high=act.clip_ratio_high if act.clip_ratio_high is not None else act.clip_ratio,
        clip_ratio_c=act.clip_ratio_c, loss_agg_mode=act.loss_agg_mode, entropy_coeff=act.entropy_coeff,
        use_kl_loss=act.use_kl_loss, kl_loss_coef=act.kl_loss_coef, kl_loss_type=act.kl_loss_type, norm_factor=norm,
        loss_mode=loss_mode, tau_pos=act.tau_pos, tau_neg=act.tau_neg,
        dro_beta=act.policy_loss.dro_beta, clip_cov_ratio=pl.clip_cov_ratio, clip_cov_lb=pl.clip_cov_lb,
        clip_cov_ub=pl.clip_cov_ub, kl_cov_ratio=pl.kl_cov_ratio, ppo_kl_coef=pl.ppo_kl_coef,
        rollout_is=rc.rollout_is, rollout_is_threshold=rc.rollout_is_threshold,
        bypass_rejection=(rc.rollout_rs, rc.rollout_rs_threshold) if rc.bypass_mode and rc.rollout_rs else None)
    value = algo.ValueLossSpec(cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode, norm_factor=norm)
    return policy, value
