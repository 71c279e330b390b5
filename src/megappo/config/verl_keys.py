"""verl keys that are not megappo settings: what a verl launch command may pass and what happens.

verl users bring their launch scripts. Keys megappo has a field for are settings (megappo.config);
the keys here are verl's too, but either mean nothing for a Megatron-only, colocated trainer
(accepted, silently when the value is what megappo does anyway, with a one-line warning when it
asks for something megappo does not do yet) or name a feature megappo lacks (an error that says
so, and what to use instead). A key in neither place is an unknown key (with suggestions).
"""
from __future__ import annotations

import fnmatch
import re
from typing import Any, Callable, Optional

import yaml

MEGATRON_ONLY = ("megappo is Megatron-only: FSDP settings do not apply (the layout: "
                 "actor_rollout_ref.actor.megatron.tensor_model_parallel_size / pipeline_model_parallel_size)")

BRIDGE_LORA = ("is verl's Megatron-Bridge LoRA setting, which megappo does not read: its LoRA keys are verl's "
               "HF-model ones (actor_rollout_ref.model.lora_rank, lora_alpha, target_modules with HF module names, "
               "exclude_modules, lora_adapter_path; critic.model.lora_rank, lora_alpha, target_modules)")

# (key pattern, check(value) -> None when accepted silently, ("warn", text) or ("error", text))
Rule = Callable[[Any], Optional[tuple[str, str]]]


def _when(bad: Callable[[Any], bool], kind: str, text: str) -> Rule:
    return lambda v: (kind, text) if bad(v) else None


def _always(kind: str, text: str) -> Rule:
    return lambda v: (kind, text)


def _note(text: str) -> Rule:
    """A warning that a value other than verl's default changes nothing here (at the default: silent)."""
    return lambda v: ("note", text)


def _truthy(v: Any) -> bool:
    return v not in (False, None, 0, "false", "False")


# verl values megappo runs with another of its own, with a warning naming the substitution
# (none where the two mean the same): (key, verl's value) -> (megappo's value, why or None)
SUBSTITUTED = {
    # verl's generated config writes null for megatron's defaults of the full recomputation
    **{(f"{role}.megatron.override_transformer_config.{k}", "null"): (v, None)
       for role in ("actor_rollout_ref.actor", "critic") for k, v in (("recompute_method", "uniform"),
                                                                      ("recompute_num_layers", 1))},
    ("data.seed", "null"): (1, "verl's null shuffles unseeded (another order every run); megappo's runs are "
                               "reproducible and resume exactly, so the shuffle takes seed 1 (set data.seed to choose)"),
    ("actor_rollout_ref.rollout.name", "sglang"): (
        "vllm", "megappo rolls out with vLLM, not SGLang (the same sampling settings: n, temperature, top_p, "
                "top_k; multi-turn tool calls run in megappo's own loop over the vLLM engine)"),
}


def substitute(path: str, value: Any, warnings: Optional[list]) -> Any:
    """The value megappo runs with for ``path=value`` (verl's value unless SUBSTITUTED names it);
    a substitution appends its warning."""
    if value is not None and not isinstance(value, str):   # every substituted value is a name or null
        return value
    key = (path, "null" if value is None else value.strip().strip("'\""))
    if key not in SUBSTITUTED:
        return value
    ours, why = SUBSTITUTED[key]
    if why is None:
        return ours
    text = f"{path}={key[1]} runs as {path}={ours}: {why}"
    if warnings is not None and text not in warnings:   # a config file and the command line may both say it
        warnings.append(text)
    return ours


# verl keys that name a megappo setting by another name: the value goes to megappo's key
FUSION = ("has no effect: megappo runs megatron's unfused paths for this (exact on every device; the fused kernels "
          "come from apex or TransformerEngine and are not switched on)")
RENAMED = {"reward_model.forward_micro_batch_size_per_gpu": "reward_model.micro_batch_size_per_gpu",
           # verl's DAPO reward manager's arguments: megappo's overlong penalty
           **{f"reward_model.reward_kwargs.overlong_buffer_cfg.{k}": f"reward_model.overlong_buffer.{k}"
              for k in ("enable", "len", "penalty_factor")},
           "reward_model.reward_kwargs.max_resp_len": "reward_model.overlong_buffer.max_resp_len",
           # verl's FSDP actor and critic clip gradients here; its Megatron ones (and megappo) in optim
           "actor_rollout_ref.actor.grad_clip": "actor_rollout_ref.actor.optim.clip_grad",
           "critic.grad_clip": "critic.optim.clip_grad",
           # vLLM's own arguments, which verl names in its rollout section
           **{f"actor_rollout_ref.rollout.{k}": f"actor_rollout_ref.rollout.engine_kwargs.vllm.{k}"
              for k in ("max_model_len", "enable_prefix_caching", "disable_log_stats", "cudagraph_capture_sizes",
                        "scheduling_policy")}}

RULES: list[tuple[str, Rule]] = [
    # accepted: what megappo does anyway, or a no-op until the feature lands
    ("actor_rollout_ref.model.use_fused_kernels", _when(_truthy, "warn", "has no effect: megappo computes log-probs and entropy with its own vocab-parallel kernel")),
    ("actor_rollout_ref.*.use_torch_compile", _when(_truthy, "warn", "has no effect: megappo does not torch.compile; its log-prob and entropy kernel is its own (vocab-parallel, chunked) and megatron's fused layers run as they are")),
    ("*.megatron.use_mbridge", _when(_truthy, "warn", "has no effect: megappo converts HF weights itself")),
    ("reward_model.megatron.dist_checkpointing_*", lambda v: None),
    # the reference is forward-only with loaded weights: no optimizer, no seeded initialisation
    ("actor_rollout_ref.ref.megatron.use_distributed_optimizer", lambda v: None),
    ("actor_rollout_ref.ref.megatron.seed", lambda v: None),
    ("actor_rollout_ref.rollout.enable_chunked_prefill", _when(lambda v: not _truthy(v), "warn", "has no effect: vLLM's chunked prefill stays on")),
    ("actor_rollout_ref.rollout.mode", lambda v: None if v == "sync" else ("warn", "runs as sync: megappo generates each step's batch in one call to its colocated engines; single-turn samples are drawn the same way (agent loops are not supported)") if v == "async" else ("error", "must be sync or async")),
    ("model_engine", _when(lambda v: v != "megatron", "error", "must be megatron: megappo is Megatron-only")),
    ("actor_rollout_ref.actor.strategy", _when(lambda v: v != "megatron", "error", MEGATRON_ONLY)),
    ("actor_rollout_ref.ref.strategy", _when(lambda v: v != "megatron", "error", MEGATRON_ONLY)),
    ("critic.strategy", _when(lambda v: v != "megatron", "error", MEGATRON_ONLY)),
    ("reward_model.strategy", _when(lambda v: v != "megatron", "error", MEGATRON_ONLY)),
    # verl's FSDP configs: what megappo's Megatron keys say instead
    *((f"*.optim.{k}", _always("error", "is verl's FSDP optimizer setting; megappo's (megatron's) schedule keys are "
                                        "<role>.optim.lr_warmup_steps, lr_warmup_steps_ratio, lr_decay_style and min_lr"))
      for k in ("optimizer_impl", "lr_scheduler_type", "warmup_style", "num_cycles", "min_lr_ratio")),
    ("*.optim.optimizer", _when(lambda v: str(v).lower() not in ("adam", "adamw"), "error",
                                "is not supported: megappo trains with megatron's Adam (AdamW: decoupled weight decay)")),
    ("*.entropy_from_logits_with_chunking", _note("has no effect: megappo's log-prob and entropy kernel is vocab-parallel "
                                                  "and chunked already (docs/memory.md)")),
    ("*.entropy_checkpointing", _note("has no effect: megappo's log-prob and entropy kernel is vocab-parallel and "
                                      "chunked already (docs/memory.md)")),
    ("actor_rollout_ref.actor.use_remove_padding", lambda v: None),   # verl's copy of model.use_remove_padding
    ("*.model.use_fused_kernels", _when(_truthy, "warn", "has no effect: megappo computes log-probs and entropy with its own vocab-parallel kernel")),
    ("reward_model.model.override_config", _when(lambda v: v not in (None, {}), "error", "is not supported for the reward model: edit config.json in a copy of its folder (the policy's and the critic's are <section>.model.override_config.model_config)")),
    ("*.optim.override_optimizer_config", _when(lambda v: v not in (None, {}), "error", "is not supported: megatron's optimizer CPU offload and precision-aware optimizer are not wired")),
    ("*.model.enable_activation_offload", _when(_truthy, "error", "is not supported: megappo offloads parameters, gradients and optimizer state between phases (<role>.megatron.*_offload) and recomputes activations (<role>.megatron.override_transformer_config.recompute_*)")),
    ("*.model.tiled_mlp.enabled", _when(_truthy, "error", "is not supported: megappo recomputes activations instead (<role>.megatron.override_transformer_config.recompute_*)")),
    ("*.model.tiled_mlp.num_shards", lambda v: None),
    ("trainer.use_legacy_worker_impl", lambda v: None),
    # megappo computes sum pi^2 in the old-log-prob pass whenever the estimator needs it (forward only)
    ("actor_rollout_ref.actor.calculate_sum_pi_squared", lambda v: None),
    ("actor_rollout_ref.actor.sum_pi_squared_checkpointing", lambda v: None),
    ("*.checkpoint.async_save", _when(_truthy, "error", "is not supported: megappo saves synchronously (every rank writes its shards of the dist_checkpointing save at once; the step resumes when the save is published)")),
    ("trainer.default_hdfs_dir", _when(lambda v: v is not None, "error", "must be null: HDFS copies are not supported; checkpoints go to trainer.default_local_dir")),
    ("ray_kwargs.*", _when(lambda v: v not in (None, {}, []), "warn", "is read by verl's Ray driver only; megappo.train ignores it (start Ray jobs with python -m megappo.launch.ray)")),
    # verl's plumbing: what megappo does anyway, or has no part that the key could change
    ("*._target_", lambda v: None),                         # Hydra's class for the section: megappo reads the keys
    ("*.rollout_n", lambda v: None),                        # verl copies rollout.n there
    ("*.load_weight", lambda v: None),
    ("*.megatron.forward_only", lambda v: None),
    ("actor_rollout_ref.actor.calculate_entropy", lambda v: None),   # megappo's actor/entropy is logged every step
    ("actor_rollout_ref.rollout.calculate_log_probs", lambda v: None),   # the engine's log-probs are always kept
    ("actor_rollout_ref.rollout.skip_tokenizer_init", lambda v: None),   # megappo's engine takes token ids
    ("actor_rollout_ref.rollout.layer_name_map.*", lambda v: None),
    ("actor_rollout_ref.model.fused_kernel_options.*", lambda v: None),
    *((k, _note("has no effect: megappo has no profiler hooks (run a rank under nsys or py-spy; per-phase seconds "
                "are the timing/* metrics)")) for k in ("*.profiler.*", "global_profiler.*")),
    ("*.nccl_timeout", _note("has no effect: megappo's timeout for start-up and collectives is trainer.dist_timeout_s")),
    ("*.megatron.vanilla_mbridge", _note("has no effect: megappo converts HF weights itself")),
    ("*.megatron.use_remove_padding", _note("has no effect: megappo's sequence packing switch is "
                                                      "<role>.model.use_remove_padding")),
    ("*.use_shm", _note("has no effect: megappo reads model and data files where they are")),
    *((k, _note("has no effect: megappo tokenizes every row once at start, in the trainer process"))
      for k in ("data.dataloader_num_workers", "data.filter_overlong_prompts_workers")),
    ("data.validation_shuffle", _note("has no effect: validation runs its prompts in file order")),
    ("data.return_raw_input_ids", lambda v: None),
    ("data.return_full_prompt", lambda v: None),
    ("data.return_multi_modal_inputs", lambda v: None),
    ("data.tool_config_path", lambda v: None),   # verl's copy of rollout.multi_turn.tool_config_path
    ("actor_rollout_ref.rollout.multi_stage_wake_up", _note("has no effect: megappo wakes vLLM's weights and KV cache as its memory plan says (docs/memory.md)")),
    ("actor_rollout_ref.rollout.load_format", _note("has no effect: megappo starts vLLM with dummy weights and syncs the actor's into it before the first rollout")),
    ("actor_rollout_ref.rollout.layered_summon", _note("has no effect: megappo syncs weights layer by layer in buckets (shard-direct where the layouts allow)")),
    *((f"actor_rollout_ref.rollout.engine_kwargs.{engine}.*", _note(
        "has no effect: megappo rolls out with vLLM (its arguments: actor_rollout_ref.rollout.engine_kwargs.vllm)"))
      for engine in ("sglang", "trtllm")),
    ("actor_rollout_ref.rollout.trace.*", _note("has no effect: megappo has no rollout tracing (trainer.rollout_data_dir writes every step's samples)")),
    ("actor_rollout_ref.rollout.prometheus.*", _note("has no effect: megappo does not serve vLLM's Prometheus metrics")),
    ("actor_rollout_ref.rollout.agent.num_workers", _note("has no effect: megappo runs no agent-loop workers (multi-turn rollouts run in the trainer's ranks)")),
    ("actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes", _note("has no effect: megappo sizes its weight-sync buckets itself (docs/rollout.md)")),
    ("actor_rollout_ref.model.use_liger", _note("has no effect: megappo computes log-probs and entropy with its own vocab-parallel kernel")),
    ("trainer.ray_wait_register_center_timeout", _note("is read by verl's Ray driver only")),
    ("trainer.esi_redundant_time", _note("has no effect: megappo saves every trainer.save_freq steps; a job stopped by its scheduler resumes from the last checkpoint")),
    # verl's global micro-batch sizes (deprecated there): megappo's are per GPU
    *((k, _when(lambda v: v is not None, "error", f"is not supported: set {k}_per_gpu (samples per micro-batch on each rank)"))
      for k in ("actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.ref.log_prob_micro_batch_size",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size", "critic.ppo_micro_batch_size",
                "critic.forward_micro_batch_size")),
    ("actor_rollout_ref.rollout.prompt_length", _always("error", "is not a setting here: megappo's is data.max_prompt_length")),
    ("actor_rollout_ref.rollout.response_length", _always("error", "is not a setting here: megappo's is data.max_response_length")),
    ("data.tokenizer", _when(lambda v: v is not None, "error", "is not supported: the tokenizer is actor_rollout_ref.model.path's")),
    # features megappo lacks
    # verl's Megatron-Bridge LoRA block: meaningless while its rank is 0; megappo's LoRA keys are verl's HF-model ones
    ("*.model.lora.rank", _when(lambda v: v not in (0, None), "error", BRIDGE_LORA)),
    ("*.model.lora.adapter_path", _when(lambda v: v is not None, "error", BRIDGE_LORA)),
    ("*.model.lora.*", lambda v: None),
    # (the actor's, reference's and critic's are megappo keys; the reward model runs on the critic's layout)
    ("*.megatron.context_parallel_size", _when(lambda v: v not in (1, None), "error", "must be 1: this role runs on the critic's layout (set critic.megatron.context_parallel_size)")),
    ("reward_model.megatron.use_dist_checkpointing", _when(_truthy, "error", "must be False: the reward model loads from the HF folder in reward_model.model.path (convert a Megatron checkpoint with checkpoints_tools/convert_to_hf.py)")),
    # MoE performance switches of verl's Megatron recipes: what megappo does, or a note that it does not
    ("*.megatron.override_transformer_config.moe_grouped_gemm", _when(lambda v: not _truthy(v), "warn", "has no effect: megappo uses TransformerEngine's grouped expert GEMMs whenever TransformerEngine is installed (SequentialMLP otherwise)")),
    ("*.megatron.override_transformer_config.moe_token_dispatcher_type", _when(lambda v: v != "alltoall", "warn", "has no effect: megappo dispatches tokens to experts with megatron's alltoall dispatcher")),
    ("*.megatron.override_transformer_config.moe_permute_fusion", _when(_truthy, "warn", "has no effect: megappo uses megatron's unfused token permutation")),
    ("*.megatron.override_transformer_config.moe_enable_deepep", _when(_truthy, "warn", "has no effect: DeepEP dispatch is not supported; megappo uses the alltoall dispatcher")),
    # fused kernels of verl's Megatron recipes (apex / TransformerEngine): megappo runs megatron's unfused paths
    *((f"*.megatron.override_transformer_config.{k}", _when(_truthy, "warn", FUSION))
      for k in ("apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                "gradient_accumulation_fusion", "persist_layer_norm")),
    ("*.megatron.override_transformer_config.deallocate_pipeline_outputs", _when(_truthy, "warn", "has no effect: megappo keeps megatron's default (a stage's output stays allocated until its backward pass: the in-flight micro-batches' activations of one layer width)")),
    ("*.megatron.override_transformer_config.*", _always("error", "is not supported: megappo derives megatron's TransformerConfig from the HF config.json (MoE dispatch included); of its keys only recompute_granularity, recompute_method, recompute_num_layers, the uneven pipeline's num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage, account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split, and (Mixture-of-Experts) moe_aux_loss_coeff, moe_router_load_balancing_type, moe_z_loss_coeff and moe_router_dtype are settings")),
    ("*.optim.override_optimizer_config.*", _always("error", "is not supported: megatron's optimizer CPU offload and precision-aware optimizer are not wired; megappo keeps an idle role's optimizer state in host memory with <section>.megatron.optimizer_offload=true")),
    ("*.model.override_config.moe_config.freeze_moe_router", _when(_truthy, "error", "is not supported: megappo trains a Mixture-of-Experts model's router with its experts")),
    # verl's multi-turn keys megappo has no setting for: verl's default value is what megappo does
    ("actor_rollout_ref.rollout.multi_turn.use_inference_chat_template", _when(_truthy, "error", "is not supported: megappo's multi-turn samples continue from the token ids the model produced (verl's false); re-rendering earlier turns with the chat template would change the trained tokens")),
    ("actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode", lambda v: None if v in ("strict", "ignore_strippable", "disable") else ("error", "must be strict, ignore_strippable or disable")),
    ("actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts", _when(lambda v: v is not None, "error", "is not supported: samples per prompt are actor_rollout_ref.rollout.n")),
    ("actor_rollout_ref.rollout.multi_turn.completion_callback", _when(lambda v: v is not None, "error", "is not supported: completion callbacks are not implemented")),
    ("actor_rollout_ref.rollout.multi_turn.*", _always("error", "is not supported: megappo's multi-turn settings are enable, max_assistant_turns, max_user_turns, max_parallel_calls, max_tool_response_length, tool_response_truncate_side, tool_config_path, function_tool_path and format")),
    ("reward_model.num_workers", _note("has no effect: megappo scores each sample once, the batch spread over the "
                                       "training ranks (reward_model.reward_manager=prime adds reward_model.prime_workers "
                                       "worker processes per rank)")),
    ("reward_model.launch_reward_fn_async", _note("has no effect: megappo scores the batch right after generation, "
                                                  "spread over the training ranks")),
    ("reward_model.use_reward_loop", lambda v: None),   # verl's two reward code paths; megappo has one
    ("reward_model.overlong_buffer.log", lambda v: None),   # megappo always logs the penalty's batch metrics
    ("reward_model.reward_kwargs.overlong_buffer_cfg.log", lambda v: None),   # (the same)
    ("reward_model.reward_kwargs.overlong_buffer_cfg.*", _always("error", "is not supported: DAPO's overlong penalty takes enable, len, penalty_factor and log (reward_model.overlong_buffer.* here)")),
    ("reward_model.reward_kwargs.*", _always("error", "is not supported: megappo's scorers take no extra arguments")),
    # FSDP: say which megatron key replaces the setting
    ("*.fsdp_config.param_offload", _always("error", MEGATRON_ONLY.replace("(the layout:", "(the same setting: <section>.megatron.param_offload; the layout:"))),
    ("*.fsdp_config.optimizer_offload", _always("error", MEGATRON_ONLY.replace("(the layout:", "(the same setting: <section>.megatron.optimizer_offload; the layout:"))),
    ("*.fsdp_config.*", _always("error", MEGATRON_ONLY)),
    ("*.ulysses_sequence_parallel_size", _when(lambda v: v not in (1, None), "error", MEGATRON_ONLY + " (Ulysses sequence parallelism is FSDP's)")),
]


_SELECT = re.compile(r"^\$\{oc\.select:[^,]*,(.*)\}$", re.S)


def _role(key: str) -> str:
    """The megappo section a verl key's role is configured in (for messages)."""
    for prefix, role in (("critic.", "critic"), ("reward_model.", "critic"), ("actor_rollout_ref.ref.", "actor_rollout_ref.ref")):
        if key.startswith(prefix):
            return role
    return "actor_rollout_ref.actor"


def parse_value(value: Any) -> Any:
    """A value from the command line parsed as YAML, which approximates hydra's override grammar
    (verl's parser) on numbers, booleans, null and lists; the two are not checked to agree.
    verl's ``${oc.select:other.key,default}`` (a key megappo has no field for) is judged by its
    default."""
    if isinstance(value, str) and _SELECT.match(value.strip()):
        value = _SELECT.match(value.strip()).group(1).strip()
    if isinstance(value, str):
        from megappo.config.yamlio import yaml_load

        try:
            return yaml_load(value)
        except yaml.YAMLError:
            return value
    return value


def check(key: str, value: Any) -> Optional[tuple[str, str]]:
    """For a key megappo has no field for: None if it is not a known verl key; ("ok", ""),
    ("warn", message) or ("error", message) otherwise. Messages start with the key. A key of
    verl's Megatron trainer config at verl's default asks for nothing: never refused (a rule's
    warning still says what megappo does instead; megappo.config.verl_defaults); set otherwise
    and named by no rule here, it is refused."""
    from megappo.config import verl_defaults

    v = parse_value(value)
    default = verl_defaults.is_default(key, v) or (isinstance(value, str) and verl_defaults.is_default(key, value))
    for pattern, rule in RULES:
        if fnmatch.fnmatchcase(key, pattern):
            got = rule(v)
            if got is None or (default and got[0] in ("error", "note")):   # a warning still says what differs
                return ("ok", "")
            kind, text = ("warn", got[1]) if got[0] == "note" else got
            section = key.split(".fsdp_config")[0].replace(".model", "") if ".fsdp_config" in key else ""
            text = text.replace("<section>", section or "actor_rollout_ref.actor")
            text = text.replace("<role>", _role(key))
            return (kind, f"{key}={v!r} {text}" if kind == "warn" else f"{text} (got {v!r})")
    if default:
        return ("ok", "")
    if key in verl_defaults.DEFAULTS:
        return ("error", f"is not supported: megappo has no setting for it (verl's default, "
                         f"{verl_defaults.DEFAULTS[key]!r}, is accepted) (got {v!r})")
    return None
