"""Every rule of a config, one function per section, all broken rules reported together."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Callable, Optional

from megappo.config.schema import ConfigError, PPOConfig, get
from megappo.layout import parallel_layout, split_worlds

# vLLM engine arguments megappo decides: the megappo key that sets each, or why it is not a setting
# (rollout.engine_kwargs.vllm may not name them; megappo.rollout checks the rest against vLLM's)
VLLM_ARGS_OWNED = {
    "tensor_parallel_size": "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "dtype": "actor_rollout_ref.rollout.dtype",
    "enforce_eager": "actor_rollout_ref.rollout.enforce_eager",
    "max_num_seqs": "actor_rollout_ref.rollout.max_num_seqs",
    "max_num_batched_tokens": "actor_rollout_ref.rollout.max_num_batched_tokens",
    "gpu_memory_utilization": "actor_rollout_ref.rollout.gpu_memory_utilization",
    "enable_sleep_mode": "actor_rollout_ref.rollout.free_cache_engine",
    "trust_remote_code": "actor_rollout_ref.model.trust_remote_code",
    "seed": "actor_rollout_ref.actor.megatron.seed",
    **{k: "actor_rollout_ref.model.lora_rank" for k in ("enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras")},
    **{k: "no key: megappo's weight sync and memory plan rely on its value" for k in
       ("model", "tokenizer", "load_format", "skip_tokenizer_init", "distributed_executor_backend",
        "kv_cache_memory_bytes")},
}


def _known(kind: str) -> list[str]:
    # Lazy: the registries live in megappo.algo (torch); the dry run pays this once.
    from megappo import algo

    return {"estimator": algo.list_estimators, "kl": algo.list_kl_kinds, "agg": algo.list_loss_agg_modes,
            "policy_loss": algo.list_policy_losses}[kind]()


A = "actor_rollout_ref.actor."
R = "actor_rollout_ref.rollout."
Need = Callable[[bool, str, str], bool]


def validate(
    cfg: PPOConfig,
    *,
    check_paths: bool = False,
    world_size: Optional[int] = None,
    warnings: Optional[list[str]] = None,
    installed: Callable[[str], bool] = lambda name: importlib.util.find_spec(name) is not None,
) -> None:
    """Check every rule; raise one :class:`ConfigError` listing all that fail.

    ``check_paths`` also requires data files and the model directory to exist, and the optional
    packages a chosen logger needs to be ``installed`` (a real start);
    ``world_size`` is the launcher's actual WORLD_SIZE, checked against nnodes x n_gpus_per_node.
    Advisory findings are appended to ``warnings``.
    """
    E: list[tuple[str, str]] = []
    W = warnings if warnings is not None else []

    def need(cond: bool, key: str, msg: str) -> bool:
        if not cond:
            E.append((key, msg))
        return cond

    _sizes(cfg, need)
    dp = _layout(cfg, need, W, world_size)
    _batches(cfg, need, dp)
    _ppo_and_kl(cfg, need, W)
    _policy_loss(cfg, need, W)
    _rollout_correction(cfg, need, W)
    _estimator(cfg, need, W)
    _sampling(cfg, need, W)
    _multi_turn(cfg, need)
    _optimizers(cfg, need)
    _trainer(cfg, need)
    _start_checkpoints(cfg, need, W)
    _checkpoint_contents(cfg, need)
    _lora(cfg, need)
    _model_overrides(cfg, need)
    _pipeline_split(cfg, need)
    if check_paths:
        _paths(cfg, need, installed)
    if E:
        raise ConfigError(E)


def _sizes(cfg: PPOConfig, need: Need) -> None:
    for key in ("data.train_batch_size", "data.max_prompt_length", "data.max_response_length",
                A + "ppo_mini_batch_size", A + "ppo_epochs", A + "ppo_max_token_len_per_gpu", R + "n",
                R + "tensor_model_parallel_size", R + "max_num_batched_tokens", R + "max_num_seqs",
                R + "val_kwargs.n", "critic.ppo_mini_batch_size", "critic.ppo_epochs",
                "trainer.nnodes", "trainer.n_gpus_per_node", "trainer.total_epochs",
                A + "megatron.tensor_model_parallel_size", A + "megatron.pipeline_model_parallel_size",
                "algorithm.kl_ctrl.horizon", "rollout.nnodes", "rollout.n_gpus_per_node",
                R + "multi_turn.max_parallel_calls", R + "multi_turn.max_tool_response_length"):
        v = get(cfg, key)
        need(isinstance(v, int) and v >= 1, key, f"must be a positive integer, got {v!r}")
    for key in ("data.val_batch_size", "data.gen_batch_size", A + "ppo_micro_batch_size_per_gpu", R + "log_prob_micro_batch_size_per_gpu",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_gpu",
                "critic.forward_micro_batch_size_per_gpu", "trainer.total_training_steps",
                A + "megatron.virtual_pipeline_model_parallel_size",
                "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep",
                R + "multi_turn.max_assistant_turns", R + "multi_turn.max_user_turns"):
        v = get(cfg, key)
        need(v is None or v >= 1, key, f"must be null or a positive integer, got {v!r}")
    ka, kc = cfg.trainer.max_actor_ckpt_to_keep, cfg.trainer.max_critic_ckpt_to_keep
    need(ka is None or kc is None or ka == kc, "trainer.max_critic_ckpt_to_keep",
         f"must equal trainer.max_actor_ckpt_to_keep ({ka}), got {kc}: megappo saves the actor and the critic "
         "together as one resumable step; set one of the two")


def _layout(cfg: PPOConfig, need: Need, W: list[str], world_size: Optional[int]) -> Optional[int]:
    """The layout rules; returns the data-parallel size when the layout divides the world."""
    tr, m, ro = cfg.trainer, cfg.actor_rollout_ref.actor.megatron, cfg.actor_rollout_ref.rollout
    world = tr.nnodes * tr.n_gpus_per_node      # the training ranks (all ranks when colocated)
    split, rn = not cfg.actor_rollout_ref.hybrid_engine, cfg.rollout
    rworld = rn.nnodes * rn.n_gpus_per_node if split else world
    if world_size is not None:
        extra = f" + rollout.nnodes x rollout.n_gpus_per_node = {rn.nnodes} x {rn.n_gpus_per_node}" if split else ""
        need(world_size == world + (rworld if split else 0), "trainer.n_gpus_per_node",
             f"trainer.nnodes x trainer.n_gpus_per_node = {tr.nnodes} x {tr.n_gpus_per_node}{extra} = "
             f"{world + (rworld if split else 0)}, but the launcher started WORLD_SIZE={world_size} processes")
    if split and rn.nnodes != tr.nnodes:
        need(rn.n_gpus_per_node == tr.n_gpus_per_node, "rollout.n_gpus_per_node",
             f"must equal trainer.n_gpus_per_node ({tr.n_gpus_per_node}) when the rollout has nodes of its own "
             f"(rollout.nnodes {rn.nnodes} != trainer.nnodes {tr.nnodes}): one launcher starts as many ranks on every "
             f"node; got {rn.n_gpus_per_node}")
    need(cfg.trainer.async_mode != "one_step_off" or split, "trainer.async_mode",
         "one_step_off needs the split placement (actor_rollout_ref.hybrid_engine=False, rollout.nnodes / "
         "rollout.n_gpus_per_node): colocated ranks cannot generate while they train")
    need(cfg.trainer.async_mode != "one_step_off" or not cfg.algorithm.filter_groups.enable, "trainer.async_mode",
         "one_step_off does not combine with dynamic sampling (algorithm.filter_groups.enable) yet: its extra "
         "generation rounds would wait for the update")
    tp, pp, vpp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size
    cp = m.context_parallel_size
    layout_ok = tp >= 1 and pp >= 1 and world >= 1 and need(cp >= 1, A + "megatron.context_parallel_size",
                                                             f"must be >= 1, got {cp}")
    if layout_ok and cp == 1:
        layout_ok = need(world % (tp * pp) == 0, A + "megatron.tensor_model_parallel_size",
                         f"world size {world} (trainer.nnodes x trainer.n_gpus_per_node) must be divisible by "
                         f"TP x PP = {tp} x {pp} = {tp * pp} ({A}megatron.tensor_model_parallel_size x "
                         f"{A}megatron.pipeline_model_parallel_size)")
    elif layout_ok:
        layout_ok = need(world % (tp * cp * pp) == 0, A + "megatron.context_parallel_size",
                         f"world size {world} (trainer.nnodes x trainer.n_gpus_per_node) must be divisible by "
                         f"TP x CP x PP = {tp} x {cp} x {pp} = {tp * cp * pp} ({A}megatron.tensor_model_parallel_size "
                         f"x {A}megatron.context_parallel_size x {A}megatron.pipeline_model_parallel_size)")
    if vpp is not None and vpp >= 1:
        need(pp > 1, A + "megatron.virtual_pipeline_model_parallel_size",
             f"the interleaved schedule needs pipeline_model_parallel_size > 1 (is {pp}); set it to null")
    ep = m.expert_model_parallel_size
    if need(ep >= 1, A + "megatron.expert_model_parallel_size", f"must be >= 1, got {ep}") and layout_ok and ep > 1:
        # megatron lays the EP ranks over the TP x DP ranks of each pipeline stage (expert-TP 1)
        need((world // pp) % ep == 0, A + "megatron.expert_model_parallel_size",
             f"must divide world size / PP = {world} / {pp} = {world // pp} (the expert-parallel ranks are taken "
             f"from each pipeline stage's TP x DP ranks), got {ep}")
    for sect in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"):
        etp = get(cfg, sect + ".megatron").expert_tensor_parallel_size
        need(etp in (None, 1), f"{sect}.megatron.expert_tensor_parallel_size",
             f"must be 1 or null: megappo keeps each expert whole on its EP rank (expert tensor parallelism is not "
             f"supported; divide experts with expert_model_parallel_size instead), got {etp}")
    for sect in ("actor_rollout_ref.ref", "critic"):
        other = get(cfg, sect + ".megatron")
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                     "context_parallel_size", "expert_model_parallel_size"):
            need(getattr(other, name) == getattr(m, name), f"{sect}.megatron.{name}",
                 f"must equal {A}megatron.{name} ({getattr(m, name)}), got {getattr(other, name)}: the actor, "
                 "reference and critic share one megatron parallel state per process")
    rtp = ro.tensor_model_parallel_size
    if rtp >= 1 and split and rworld >= 1:
        need(rworld % rtp == 0 and rn.n_gpus_per_node % rtp == 0, R + "tensor_model_parallel_size",
             f"must divide rollout.n_gpus_per_node ({rn.n_gpus_per_node}): each vLLM replica's ranks stay inside one "
             f"rollout node; got {rtp}")
    elif rtp >= 1 and world >= 1:
        need(world % rtp == 0, R + "tensor_model_parallel_size",
             f"world size {world} must be divisible by the rollout TP size {rtp}")
        if tr.n_gpus_per_node >= 1 and tr.n_gpus_per_node % rtp != 0:
            W.append(f"{R}tensor_model_parallel_size={rtp} does not divide trainer.n_gpus_per_node="
                     f"{tr.n_gpus_per_node}: vLLM tensor parallelism would cross nodes")
    return world // (tp * pp) if layout_ok else None


def _rollout_n(cfg: PPOConfig) -> Optional[int]:
    n = cfg.actor_rollout_ref.rollout.n
    return n if isinstance(n, int) and n >= 1 else None


def _batches(cfg: PPOConfig, need: Need, dp: Optional[int]) -> None:
    """verl's semantics: mini-batch sizes are in prompts, global over DP."""
    d, cr, n = cfg.data, cfg.critic, _rollout_n(cfg)
    for role, sect in (("actor", A), ("critic", "critic.")):
        if role == "critic" and not critic_enabled(cfg):
            continue
        mini = get(cfg, sect + "ppo_mini_batch_size")
        micro = get(cfg, sect + "ppo_micro_batch_size_per_gpu")
        dyn = get(cfg, sect + "use_dynamic_bsz")
        if not (isinstance(mini, int) and mini >= 1 and d.train_batch_size >= 1 and n):
            continue
        need(d.train_batch_size % mini == 0, sect + "ppo_mini_batch_size",
             f"data.train_batch_size ({d.train_batch_size}) must be divisible by {sect}ppo_mini_batch_size ({mini}) "
             "so every step is a whole number of mini-batches")
        if dp:
            if need(mini * n % dp == 0, sect + "ppo_mini_batch_size",
                    f"a mini-batch of {mini} prompts x rollout.n {n} = {mini * n} samples must split evenly over "
                    f"{dp} data-parallel ranks"):
                per_rank = mini * n // dp
                if not dyn and micro is not None and micro >= 1:
                    need(per_rank % micro == 0, sect + "ppo_micro_batch_size_per_gpu",
                         f"the per-rank mini-batch ({mini} x {n} / DP {dp} = {per_rank} samples) must be divisible "
                         f"by the micro-batch size {micro}")
        if not dyn:
            need(micro is not None, sect + "ppo_micro_batch_size_per_gpu",
                 f"must be set when {sect}use_dynamic_bsz is false")
        else:
            tokens = get(cfg, sect + "ppo_max_token_len_per_gpu")
            need(tokens >= d.max_prompt_length + d.max_response_length, sect + "ppo_max_token_len_per_gpu",
                 f"token budget {tokens} is smaller than one sequence (data.max_prompt_length + "
                 f"data.max_response_length = {d.max_prompt_length + d.max_response_length})")
    if critic_enabled(cfg) and cr.use_dynamic_bsz:
        need(cr.forward_max_token_len_per_gpu >= d.max_prompt_length + d.max_response_length,
             "critic.forward_max_token_len_per_gpu", f"token budget {cr.forward_max_token_len_per_gpu} is smaller than "
             f"one sequence ({d.max_prompt_length + d.max_response_length} tokens)")
    for sect in (R, "actor_rollout_ref.ref."):
        if get(cfg, sect + "log_prob_use_dynamic_bsz"):
            tokens = get(cfg, sect + "log_prob_max_token_len_per_gpu")
            need(tokens >= d.max_prompt_length + d.max_response_length, sect + "log_prob_max_token_len_per_gpu",
                 f"token budget {tokens} is smaller than one sequence ({d.max_prompt_length + d.max_response_length} tokens)")
        else:
            need(get(cfg, sect + "log_prob_micro_batch_size_per_gpu") is not None, sect + "log_prob_micro_batch_size_per_gpu",
                 f"must be set when {sect}log_prob_use_dynamic_bsz is false")
    if dp and n and d.train_batch_size >= 1:
        need(d.train_batch_size * n % dp == 0, "data.train_batch_size",
             f"train_batch_size x rollout.n = {d.train_batch_size * n} samples must split evenly over {dp} data-parallel ranks")


def _ppo_and_kl(cfg: PPOConfig, need: Need, W: list[str]) -> None:
    act, al, cr, n = cfg.actor_rollout_ref.actor, cfg.algorithm, cfg.critic, _rollout_n(cfg)
    need(act.clip_ratio_c > 1.0, A + "clip_ratio_c", f"dual-clip constant must be > 1, got {act.clip_ratio_c}")
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        v = getattr(act, key)
        need(v is None or v >= 0, A + key, f"must be >= 0, got {v}")
    need(cr.cliprange_value > 0, "critic.cliprange_value", f"must be > 0, got {cr.cliprange_value}")
    need(isinstance(cr.replay_batches, int) and cr.replay_batches >= 0, "critic.replay_batches",
         f"must be an integer >= 0, got {cr.replay_batches!r}")
    for key in ("entropy_coeff", "kl_loss_coef"):
        need(getattr(act, key) >= 0, A + key, f"must be >= 0, got {getattr(act, key)}")
    need(al.kl_ctrl.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", f"must be >= 0, got {al.kl_ctrl.kl_coef}")
    if al.kl_ctrl.type == "adaptive":
        need(al.kl_ctrl.target_kl > 0, "algorithm.kl_ctrl.target_kl",
             f"the adaptive controller needs target_kl > 0, got {al.kl_ctrl.target_kl}")
    for key in ("algorithm.gamma", "algorithm.lam", "algorithm.critic_lam"):
        v = get(cfg, key)
        need(v is None or 0.0 <= v <= 1.0, key, f"must be in [0, 1], got {v}")
    need(al.lam_length_alpha is None or al.lam_length_alpha > 0, "algorithm.lam_length_alpha",
         f"must be > 0 (VAPO uses 0.05), got {al.lam_length_alpha}")
    need(al.gae_adv_norm in ("auto", "batch", "group", "group_shift", "group_centred", "group_cv"), "algorithm.gae_adv_norm",
         f"must be auto, batch, group, group_shift, group_centred or group_cv, got {al.gae_adv_norm!r}")
    need(0.0 <= al.gae_cv_decay < 1.0, "algorithm.gae_cv_decay", f"must be in [0, 1), got {al.gae_cv_decay!r}")
    need(al.gae_cv_beta_max > 0.0, "algorithm.gae_cv_beta_max", f"must be > 0, got {al.gae_cv_beta_max!r}")
    need(al.gae_cv_min_t >= 1.0, "algorithm.gae_cv_min_t", f"must be >= 1, got {al.gae_cv_min_t!r}")
    if al.gae_adv_norm in ("group_shift", "group_centred", "group_cv"):
        need(al.lam_length_alpha is None, "algorithm.gae_adv_norm",
             f"{al.gae_adv_norm} takes one lambda (algorithm.lam): unset algorithm.lam_length_alpha")
    if al.gae_adv_norm in ("group", "group_shift", "group_centred", "group_cv"):
        need(n > 1, "algorithm.gae_adv_norm",
             f"group normalisation compares the samples of a prompt: needs actor_rollout_ref.rollout.n > 1, got {n}")
    need(al.critic_target in ("return", "group_relative"), "algorithm.critic_target",
         f"must be return or group_relative, got {al.critic_target!r}")
    if al.adv_estimator == "gae" and al.critic_target == "group_relative":
        need(al.gae_adv_norm in ("group_shift", "group_centred", "group_cv"), "algorithm.critic_target",
             "group_relative targets hold only the within-group part of the value, which only "
             "gae_adv_norm group_shift, group_centred or group_cv (n > 1) read correctly; "
             f"this run has gae_adv_norm={al.gae_adv_norm!r}")
    if al.adv_estimator != "gae":
        for key, default in (("critic_lam", None), ("lam_length_alpha", None), ("gae_adv_norm", "batch"),
                             ("critic_target", "return")):
            if getattr(al, key) not in (default, "auto"):
                W.append(f"algorithm.{key}={getattr(al, key)!r} is read only by adv_estimator=gae "
                         f"(this run uses {al.adv_estimator!r}): ignored")
    kl_kinds = _known("kl")
    need(act.kl_loss_type in kl_kinds, A + "kl_loss_type",
         f"unknown KL estimator {act.kl_loss_type!r}; supported: {', '.join(kl_kinds)}")
    need(al.kl_penalty in kl_kinds, "algorithm.kl_penalty",
         f"unknown KL estimator {al.kl_penalty!r}; supported: {', '.join(kl_kinds)}")


def _policy_loss(cfg: PPOConfig, need: Need, W: list[str]) -> None:
    act = cfg.actor_rollout_ref.actor
    losses = _known("policy_loss")
    need(act.policy_loss.loss_mode in losses, A + "policy_loss.loss_mode",
         f"unknown policy loss {act.policy_loss.loss_mode!r}; registered: {', '.join(losses)}")
    pl = act.policy_loss
    for key in ("clip_cov_ratio", "kl_cov_ratio", "ppo_kl_coef"):
        need(getattr(pl, key) > 0, A + "policy_loss." + key, f"must be > 0, got {getattr(pl, key)}")
    need(pl.clip_cov_lb < pl.clip_cov_ub, A + "policy_loss.clip_cov_ub",
         f"must be above clip_cov_lb ({pl.clip_cov_lb}), got {pl.clip_cov_ub}")
    for key in ("tau_pos", "tau_neg"):
        need(getattr(act, key) > 0, A + key, f"SAPO's gate temperature must be > 0, got {getattr(act, key)}")
    beta = act.policy_loss.dro_beta
    if act.policy_loss.loss_mode == "dro":   # verl's default is null: DRO has no neutral penalty weight
        need(beta is not None and beta > 0, A + "policy_loss.dro_beta",
             f"loss_mode=dro needs a penalty weight > 0, got {beta}")


def _rollout_correction(cfg: PPOConfig, need: Need, W: list[str]) -> None:
    act, rc = cfg.actor_rollout_ref.actor, cfg.algorithm.rollout_correction
    need(rc.rollout_is_threshold > 0, "algorithm.rollout_correction.rollout_is_threshold",
         f"must be > 0, got {rc.rollout_is_threshold}")
    if rc.bypass_mode and rc.rollout_is is not None and rc.loss_type == "ppo_clip":
        W.append("algorithm.rollout_correction.rollout_is has no effect with bypass_mode=true: the old log-probs "
                 "are the rollout's, so every weight is 1 (the PPO ratio does the correction)")
    if rc.rollout_rs is not None:
        from megappo.algo import RolloutRSError, parse_rollout_rs

        try:
            parse_rollout_rs(rc.rollout_rs, rc.rollout_rs_threshold)
            bad = None
        except RolloutRSError as e:
            bad = e
        need(bad is None, bad.key if bad else "", bad.reason if bad else "")
    elif rc.rollout_rs_threshold is not None:
        W.append("algorithm.rollout_correction.rollout_rs_threshold has no effect without rollout_rs (rejection "
                 "sampling is off)")
    if rc.loss_type == "reinforce" and not rc.bypass_mode:
        W.append("algorithm.rollout_correction.loss_type=reinforce has no effect without bypass_mode=true (as verl); "
                 "the policy loss is actor.policy_loss.loss_mode, which may be reinforce itself")
    elif rc.loss_type == "reinforce":
        need(act.policy_loss.loss_mode in ("vanilla", "reinforce"), A + "policy_loss.loss_mode",
             f"algorithm.rollout_correction.loss_type=reinforce with bypass_mode=true is the policy loss (as verl), "
             f"so loss_mode={act.policy_loss.loss_mode} would be ignored: leave loss_mode vanilla or use loss_type=ppo_clip")
        need(not (rc.rollout_is is not None and rc.rollout_is_batch_normalize),
             "algorithm.rollout_correction.rollout_is_batch_normalize",
             "is not supported with loss_type=reinforce: its weights come from the current policy in each "
             "micro-batch, where a batch mean does not exist (verl averages each micro-batch over all ranks)")


def _estimator(cfg: PPOConfig, need: Need, W: list[str]) -> None:
    al, cr, n = cfg.algorithm, cfg.critic, _rollout_n(cfg)
    estimators = _known("estimator")
    if need(al.adv_estimator in estimators, "algorithm.adv_estimator",
            f"unknown advantage estimator {al.adv_estimator!r}; registered: {', '.join(estimators)}"):
        from megappo import algo

        spec = algo.get_estimator(al.adv_estimator)
        if spec.needs_critic:
            need(cr.enable is not False, "critic.enable",
                 f"algorithm.adv_estimator={al.adv_estimator} needs a critic (values), but critic.enable=false")
        elif cr.enable:
            W.append(f"critic.enable=true but algorithm.adv_estimator={al.adv_estimator} does not use values: "
                     "the critic is trained and ignored")
        if cr.replay_batches and not (spec.needs_critic or cr.enable):
            W.append(f"critic.replay_batches={cr.replay_batches} is read only with a critic, and "
                     f"algorithm.adv_estimator={al.adv_estimator} builds none")
        if "sum_pi_squared" in spec.inputs:
            need(not al.rollout_correction.bypass_mode, "algorithm.rollout_correction.bypass_mode",
                 f"algorithm.adv_estimator={al.adv_estimator} needs sum pi^2 from the old-log-prob pass, which "
                 "bypass mode skips")
        if "reward_components" in spec.inputs:
            keys, weights = al.gdpo_reward_keys, al.gdpo_reward_weights
            if need(bool(keys), "algorithm.gdpo_reward_keys",
                    f"algorithm.adv_estimator={al.adv_estimator} needs the reward components to normalise: keys of "
                    "the dict the reward function returns, e.g. [accuracy_reward,format_reward]"):
                need(weights is None or len(weights) == len(keys), "algorithm.gdpo_reward_weights",
                     f"needs one weight per gdpo_reward_keys entry ({len(keys)}), got {len(weights or [])}")
            need(not cfg.reward_model.enable, "reward_model.enable",
                 f"algorithm.adv_estimator={al.adv_estimator} normalises the components of a reward function's "
                 "dict; a reward model gives one score")
            if al.use_kl_in_reward or cfg.reward_model.overlong_buffer.enable:
                W.append(f"algorithm.adv_estimator={al.adv_estimator} reads the reward components only: the "
                         "in-reward KL penalty and the overlong penalty do not reach its advantages (as verl)")
        elif al.gdpo_reward_keys:
            W.append(f"algorithm.gdpo_reward_keys is read by adv_estimator=gdpo only (it is {al.adv_estimator})")
        if spec.group_relative and n is not None:
            need(n > 1, R + "n",
                 f"algorithm.adv_estimator={al.adv_estimator} compares samples of the same prompt and needs "
                 f"rollout.n > 1 (got {n}): with n=1 every group is a singleton and the advantage degenerates")


def _sampling(cfg: PPOConfig, need: Need, W: list[str]) -> None:
    d, ro, fg = cfg.data, cfg.actor_rollout_ref.rollout, cfg.algorithm.filter_groups
    if fg.enable:
        need(fg.metric is not None, "algorithm.filter_groups.metric",
             "dynamic sampling needs the metric that must vary within a group: acc, score, seq_reward or "
             "seq_final_reward")
        need(not (fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward),
             "algorithm.filter_groups.metric", "seq_final_reward with algorithm.use_kl_in_reward=true would need "
             "the old and reference log-probs of every generated sample before filtering; use seq_reward")
        need(not (fg.metric == "acc" and cfg.reward_model.enable), "algorithm.filter_groups.metric",
             "acc comes from a reward function's returned dict; a reward model gives scores only: use score or "
             "seq_reward")
        if _rollout_n(cfg) == 1:
            W.append("algorithm.filter_groups.enable=true with rollout.n=1: every group is one sample and none "
                     "is filtered")
    if d.gen_batch_size is not None and d.gen_batch_size >= 1:  # (a bad size is reported by _sizes)
        need(fg.enable, "data.gen_batch_size", "is the prompts per generation round of dynamic sampling; "
             "set algorithm.filter_groups.enable=true or leave it null (each step generates train_batch_size)")
    for sect in (R, R + "val_kwargs."):
        t, p, k = get(cfg, sect + "temperature"), get(cfg, sect + "top_p"), get(cfg, sect + "top_k")
        need(t >= 0, sect + "temperature", f"must be >= 0, got {t}")
        need(0 < p <= 1, sect + "top_p", f"must be in (0, 1], got {p}")
        need(k == -1 or k >= 1, sect + "top_k", f"must be -1 (disabled) or >= 1, got {k}")
    need(0 < ro.gpu_memory_utilization <= 1, R + "gpu_memory_utilization",
         f"must be in (0, 1], got {ro.gpu_memory_utilization}")
    for name in ro.engine_kwargs.vllm:
        need(name not in VLLM_ARGS_OWNED, R + "engine_kwargs.vllm." + name, f"megappo sets it ({VLLM_ARGS_OWNED.get(name)})")
    mml = ro.engine_kwargs.vllm.get("max_model_len")
    need(mml is None or (isinstance(mml, int) and mml >= d.max_prompt_length + d.max_response_length),
         R + "engine_kwargs.vllm.max_model_len", f"must hold a prompt and its response: null or an integer >= "
         f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length + d.max_response_length}, got {mml!r}")
    need(ro.max_num_batched_tokens >= d.max_prompt_length + d.max_response_length or ro.max_num_batched_tokens < 1,
         R + "max_num_batched_tokens",
         f"{ro.max_num_batched_tokens} is smaller than one sequence "
         f"({d.max_prompt_length + d.max_response_length} tokens)")


def _multi_turn(cfg: PPOConfig, need: Need) -> None:
    mt, k = cfg.actor_rollout_ref.rollout.multi_turn, R + "multi_turn."
    if mt.enable:
        need(cfg.data.return_raw_chat, "data.return_raw_chat", "must be true with multi_turn.enable: multi-turn "
             "rollouts apply the chat template to the raw messages with the tool schemas")
    for name in ("tool_config_path", "function_tool_path", "interaction_config_path"):
        path = getattr(mt, name)
        if path:
            problem = _tool_file_problem(name, path)
            need(problem is None, k + name, problem or "")
    if mt.interaction_config_path:
        need(mt.enable, k + "enable", "must be true with multi_turn.interaction_config_path (interactions answer "
             "between the turns of multi-turn rollouts)")


def _tool_file_problem(name: str, path: str) -> Optional[str]:
    """What is wrong with a tool file, checked without importing the tools' code (a dry run
    may name classes of packages installed only where the job runs)."""
    from megappo.tools import ToolConfigError, read_interaction_config, read_tool_config

    p = Path(os.path.expanduser(path))
    if not p.is_file():
        return f"file not found: {path}"
    if name == "function_tool_path":
        return None if p.suffix == ".py" else f"expected a Python file (.py), got {path}"
    try:
        (read_interaction_config if name == "interaction_config_path" else read_tool_config)(p)
    except ToolConfigError as e:
        return str(e)
    return None


def _optimizers(cfg: PPOConfig, need: Need) -> None:
    for sect in (A + "optim.", "critic.optim."):
        o = get(cfg, sect[:-1])
        need(o.lr >= 0, sect + "lr", f"must be >= 0, got {o.lr}")
        need(o.clip_grad >= 0, sect + "clip_grad", f"must be >= 0 (0 disables), got {o.clip_grad}")
        need(0 <= o.lr_warmup_steps_ratio <= 1, sect + "lr_warmup_steps_ratio", f"must be in [0, 1], got {o.lr_warmup_steps_ratio}")
        need(o.lr_warmup_steps >= -1, sect + "lr_warmup_steps", f"must be -1 or >= 0, got {o.lr_warmup_steps}")
        need(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), sect + "betas", f"must be two numbers in [0, 1), got {o.betas}")


def _trainer(cfg: PPOConfig, need: Need) -> None:
    d, tr = cfg.data, cfg.trainer
    for key in ("trainer.save_freq", "trainer.test_freq"):
        v = get(cfg, key)
        need(v == -1 or v >= 1, key, f"must be -1 (disabled) or a positive number of steps, got {v}")
    need(tr.critic_warmup >= 0, "trainer.critic_warmup", f"must be >= 0, got {tr.critic_warmup}")
    need(tr.dist_timeout_s >= 1, "trainer.dist_timeout_s", f"must be >= 1 second, got {tr.dist_timeout_s}")
    need(tr.log_val_generations >= 0, "trainer.log_val_generations",
         f"must be >= 0 (validation samples to log; 0: none), got {tr.log_val_generations}")
    need(tr.watchdog_silence_s >= 0, "trainer.watchdog_silence_s", f"must be >= 0 (0 disables), got {tr.watchdog_silence_s}")
    need(tr.watchdog_slow_phase_s >= 0, "trainer.watchdog_slow_phase_s", f"must be >= 0, got {tr.watchdog_slow_phase_s}")
    if tr.resume_mode == "resume_path":
        need(bool(tr.resume_from_path), "trainer.resume_from_path", "must be set when trainer.resume_mode=resume_path")
    need(bool(tr.resume_mode), "trainer.resume_mode",
         f"must be disable, auto, resume_path or a checkpoint path, got {tr.resume_mode!r}")
    need(bool(d.train_files), "data.train_files", "needs at least one file, got an empty list")
    if tr.val_only:
        need(bool(d.val_files), "data.val_files", "must name validation files when trainer.val_only=true "
             "(it validates and stops)")
    for key in ("data.train_max_samples", "data.val_max_samples"):
        v = get(cfg, key)
        need(v == -1 or v >= 1, key, f"must be -1 (every row) or a positive number of rows, got {v}")
    if cfg.reward_model.enable:
        rm = cfg.reward_model
        need(bool(rm.model.path), "reward_model.model.path", "must be set when reward_model.enable=True")
        need(rm.use_dynamic_bsz or rm.micro_batch_size_per_gpu is not None, "reward_model.micro_batch_size_per_gpu",
             "must be set unless reward_model.use_dynamic_bsz")
    if cfg.reward_model.reward_manager == "prime":
        rm = cfg.reward_model
        need(not rm.enable, "reward_model.reward_manager", "prime runs the rule or custom reward function in worker "
             "processes; it does not apply to a reward model (reward_model.enable=true)")
        need(rm.prime_timeout_s > 0, "reward_model.prime_timeout_s", f"must be > 0 seconds, got {rm.prime_timeout_s}")
        need(rm.prime_workers is None or rm.prime_workers >= 1, "reward_model.prime_workers",
             f"must be null or a positive number of processes, got {rm.prime_workers}")
    if cfg.reward_model.reward_manager == "batch":
        need(bool(cfg.custom_reward_function.path) and not cfg.reward_model.enable, "reward_model.reward_manager",
             "batch calls custom_reward_function.path's function with lists: set custom_reward_function.path "
             "(and no reward model)")
    ob = cfg.reward_model.overlong_buffer
    if ob.enable:
        if ob.max_resp_len is None:
            need(0 < ob.len <= d.max_response_length, "reward_model.overlong_buffer.len",
                 f"must be in (0, data.max_response_length={d.max_response_length}], got {ob.len}")
        elif need(ob.max_resp_len >= 1, "reward_model.overlong_buffer.max_resp_len",
                  f"must be >= 1 (null: data.max_response_length), got {ob.max_resp_len}"):
            need(0 < ob.len <= ob.max_resp_len, "reward_model.overlong_buffer.len",
                 f"must be in (0, reward_model.overlong_buffer.max_resp_len={ob.max_resp_len}], got {ob.len}")
        need(ob.penalty_factor >= 0, "reward_model.overlong_buffer.penalty_factor", f"must be >= 0, got {ob.penalty_factor}")
    need(d.max_prompt_length + d.max_response_length < 10**7, "data.max_response_length",
         f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length + d.max_response_length} "
         f"tokens is implausibly long; expected fewer than {10**7}")


RESUMABLE = {"model", "optimizer", "extra"}


def resumable_checkpoints(cfg: PPOConfig) -> bool:
    """Whether this run's saves are resumable checkpoints (else HF exports only)."""
    return RESUMABLE <= set(cfg.actor_rollout_ref.actor.checkpoint.save_contents)


def _checkpoint_contents(cfg: PPOConfig, need: Need) -> None:
    """save_contents: the resumable three together (with hf_model or not), or hf_model alone;
    a critic's like the actor's (one step saves both); load_contents: the three, or what was saved."""
    roles = [A.rstrip(".")] + (["critic"] if critic_enabled(cfg) else [])
    kinds, valid = {}, True
    for role in roles:
        ck = get(cfg, role + ".checkpoint")
        save, load = set(ck.save_contents), set(ck.load_contents)
        kinds[role] = RESUMABLE <= save
        valid &= need(kinds[role] or save == {"hf_model"}, role + ".checkpoint.save_contents",
             f"must hold model, optimizer and extra (a resumable checkpoint; add hf_model to write a HuggingFace folder "
             f"too) or be [hf_model] (HuggingFace exports only); got {ck.save_contents} (to save nothing, set "
             f"trainer.save_freq=-1)")
        need(RESUMABLE <= load or load == save, role + ".checkpoint.load_contents",
             f"must hold model, optimizer and extra: a resume restores all three; got {ck.load_contents} (to start "
             f"from a checkpoint's weights with a fresh optimizer, set {role}.megatron.use_dist_checkpointing=True and "
             f"{role}.megatron.dist_checkpointing_path=<global_step_N>/{role.split('.')[-1]})")
    if valid and len(set(kinds.values())) > 1:   # (each list valid: else its own error says it)
        need(False, "critic.checkpoint.save_contents",
             f"must be resumable (model, optimizer, extra) exactly when the actor's is: one save holds both; the "
             f"actor's is {cfg.actor_rollout_ref.actor.checkpoint.save_contents}, the critic's "
             f"{cfg.critic.checkpoint.save_contents} (for HuggingFace exports of both, set both to [hf_model])")


def _start_checkpoint_roles(cfg: PPOConfig) -> list[str]:
    """The megatron sections (keys) of the roles this run builds that may start from a
    dist_checkpointing folder: the actor, the reference when a KL term needs it, the critic."""
    roles = [A + "megatron"]
    if cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        roles.append("actor_rollout_ref.ref.megatron")
    if critic_enabled(cfg):
        roles.append("critic.megatron")
    return roles


def _start_checkpoints(cfg: PPOConfig, need: Need, W: list[str]) -> None:
    """use_dist_checkpointing needs its path; a path without it is ignored (said); an actor that
    starts from a checkpoint beside a reference that starts from model.path is said too (verl
    loads each role from its own section)."""
    roles = _start_checkpoint_roles(cfg)
    for sect in roles:
        m = get(cfg, sect)
        if m.use_dist_checkpointing:
            need(bool(m.dist_checkpointing_path), sect + ".dist_checkpointing_path",
                 f"must be set when {sect}.use_dist_checkpointing=True (the dist_checkpointing folder to start from)")
        elif m.dist_checkpointing_path:
            W.append(f"{sect}.dist_checkpointing_path is set but {sect}.use_dist_checkpointing is False: "
                     f"the weights come from the HF folder in model.path")
    ref = "actor_rollout_ref.ref.megatron"
    if ref in roles and get(cfg, A + "megatron").use_dist_checkpointing and not get(cfg, ref).use_dist_checkpointing:
        W.append(f"{A}megatron.use_dist_checkpointing=True but {ref}.use_dist_checkpointing=False: the reference "
                 f"policy starts from model.path's HF weights, not from the actor's checkpoint")


def _lora_name_problem(value, excluded: bool) -> str:
    """'' when every entry of a target_modules / exclude_modules value is a known HF module name
    (or all-linear), else the message naming the bad ones and the accepted ones."""
    if value is None or list(value) == ["all-linear"]:
        return ""   # the defaults: no need to import the model code (torch) for them
    from megappo.models import LoRAError, lora_targets

    try:
        lora_targets("all-linear", value) if excluded else lora_targets(value)
    except LoRAError as e:
        return str(e).split(": ", 1)[1]
    return ""


def _lora(cfg: PPOConfig, need: Need) -> None:
    """verl's LoRA keys: ranks and module names (LoRA on MoE models: _check_experts)."""
    for sect, keys in (("actor_rollout_ref.model.", ("target_modules", "exclude_modules")),
                       ("critic.model.", ("target_modules",))):
        rank = get(cfg, sect + "lora_rank")
        need(rank >= 0, sect + "lora_rank", f"must be >= 0 (0 turns LoRA off), got {rank}")
        if rank > 0 or (sect.startswith("actor") and cfg.actor_rollout_ref.model.lora_adapter_path):
            for key in keys:
                problem = _lora_name_problem(get(cfg, sect + key), key == "exclude_modules")
                need(not problem, sect + key, problem)


def lora_enabled(cfg: PPOConfig) -> bool:
    """Whether the actor trains LoRA adapters (lora_rank > 0, or an adapter to start from)."""
    m = cfg.actor_rollout_ref.model
    return m.lora_rank > 0 or bool(m.lora_adapter_path)


def _check_lora_adapter(cfg: PPOConfig, need: Need) -> None:
    """A real start: lora_adapter_path is a PEFT LoRA folder megappo can compute."""
    path = cfg.actor_rollout_ref.model.lora_adapter_path
    if not path:
        return
    from megappo.models import LoRAError, read_peft_adapter

    try:
        read_peft_adapter(os.path.expanduser(path))
    except LoRAError as e:
        need(False, "actor_rollout_ref.model.lora_adapter_path", str(e))


def _pipeline_split(cfg: PPOConfig, need: Need) -> None:
    """An uneven pipeline split: stage sizes of at least one layer, and one of the two forms
    (megatron refuses both at once); whether the model's layers fit is the layout's rule."""
    for sect in [A + "megatron"] + (["critic.megatron"] if critic_enabled(cfg) else []):
        o, k = get(cfg, sect).override_transformer_config, sect + ".override_transformer_config."
        for name, n in (("num_layers_in_first_pipeline_stage", o.num_layers_in_first_pipeline_stage),
                        ("num_layers_in_last_pipeline_stage", o.num_layers_in_last_pipeline_stage)):
            need(n is None or n >= 1, k + name, f"must be at least 1 (or null: an even split), got {n}")
        counted = o.account_for_embedding_in_pipeline_split or o.account_for_loss_in_pipeline_split
        sized = o.num_layers_in_first_pipeline_stage is not None or o.num_layers_in_last_pipeline_stage is not None
        need(not (counted and sized), k + "account_for_embedding_in_pipeline_split",
             "the embedding and loss cannot be counted as layers when num_layers_in_first/last_pipeline_stage "
             "set the stages' sizes (megatron takes one form or the other)")


def _override_roles(cfg: PPOConfig) -> list[str]:
    """The model sections whose override_config.model_config is read (the critic's when built)."""
    return ["actor_rollout_ref.model"] + (["critic.model"] if critic_enabled(cfg) else [])


def _model_overrides(cfg: PPOConfig, need: Need) -> None:
    """override_config.model_config: config.json entries that keep the weights' shapes."""
    from megappo.models import override_problems

    for sect in _override_roles(cfg):
        problems = override_problems(get(cfg, sect).override_config.model_config)
        need(not problems, sect + ".override_config.model_config", "; ".join(problems))


def _check_overrides(cfg: PPOConfig, need: Need) -> None:
    """A real start: each role's merged config.json read by transformers, every entry taking
    effect and the model one megappo builds; the rollout's context within the actor's positions
    (vLLM refuses a max_model_len past max_position_embeddings without RoPE scaling)."""
    import json

    from megappo.models import ModelConfigError, check_overrides, overridden_folder

    for sect in _override_roles(cfg):
        m = get(cfg, sect)
        local = Path(os.path.expanduser(m.path))
        if not (local / "config.json").is_file() or not m.override_config.model_config:
            continue
        try:
            check_overrides(str(local), m.override_config.model_config, m.trust_remote_code)
        except (ModelConfigError, ValueError, TypeError, OSError) as e:
            need(False, sect + ".override_config.model_config", str(e))
    m, vllm_args = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout.engine_kwargs.vllm
    if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0") not in ("", "0") or vllm_args.get("hf_overrides"):
        return   # vLLM is told to allow it, or reads other entries than the folder's
    try:
        raw = json.loads(Path(overridden_folder(os.path.expanduser(m.path), m.override_config.model_config),
                              "config.json").read_text())
    except (OSError, ValueError, TypeError, ModelConfigError):
        return   # no folder here: its own rule names it
    scaled = [r for r in (raw.get("rope_parameters"), raw.get("rope_scaling"))
              if isinstance(r, dict) and r.get("rope_type", r.get("type", "default")) != "default"]
    positions = raw.get("max_position_embeddings")
    needed = max(cfg.data.max_prompt_length + cfg.data.max_response_length, vllm_args.get("max_model_len") or 0)
    if isinstance(positions, int) and not scaled:
        overridden = "max_position_embeddings" in m.override_config.model_config
        need(positions >= needed, "actor_rollout_ref.model." + ("override_config.model_config.max_position_embeddings"
                                                              if overridden else "path"),
             f"the model's max_position_embeddings ({positions}) is shorter than the rollout's context "
             f"(data.max_prompt_length + data.max_response_length, or engine_kwargs.vllm.max_model_len: {needed}): "
             f"vLLM refuses that context without RoPE scaling (or VLLM_ALLOW_LONG_MAX_MODEL_LEN=1); "
             + ("raise it" if overridden else "set actor_rollout_ref.model.override_config.model_config."
                                            "max_position_embeddings (as verl's long-response recipes do)")
             + " or shorten the prompts or responses")


def _paths(cfg: PPOConfig, need: Need, installed: Callable[[str], bool]) -> None:
    """A real start: files, model folders and the packages the chosen loggers need exist."""
    tr = cfg.trainer
    for key in ("data.train_files", "data.val_files"):
        for f in get(cfg, key):
            need(Path(os.path.expanduser(f)).is_file(), key, f"file not found: {f}")
    _check_model_path(cfg, "actor_rollout_ref.model.path", need)
    _check_lora_adapter(cfg, need)
    _check_overrides(cfg, need)
    if critic_enabled(cfg) and cfg.critic.model.path != cfg.actor_rollout_ref.model.path:
        _check_model_path(cfg, "critic.model.path", need)
    if cfg.reward_model.enable and cfg.reward_model.model.path:
        _check_model_path(cfg, "reward_model.model.path", need)
    for sect in _start_checkpoint_roles(cfg):
        m = get(cfg, sect)
        if m.use_dist_checkpointing and m.dist_checkpointing_path:
            p = Path(os.path.expanduser(m.dist_checkpointing_path))
            need((p / "metadata.json").is_file(), sect + ".dist_checkpointing_path",
                 f"{m.dist_checkpointing_path} is not a megatron-core dist_checkpointing folder (no metadata.json; "
                 f"expected what megatron's dist_checkpointing.save or verl's converter_hf_to_mcore.py writes)"
                 if p.is_dir() else f"checkpoint directory not found: {m.dist_checkpointing_path}")
    crf = cfg.custom_reward_function.path
    if crf:
        need(Path(os.path.expanduser(crf)).is_file(), "custom_reward_function.path", f"file not found: {crf}")
    if tr.resume_mode == "resume_path" and tr.resume_from_path:
        need(Path(os.path.expanduser(tr.resume_from_path)).is_dir(), "trainer.resume_from_path",
             f"checkpoint directory not found: {tr.resume_from_path}")
    for sink in ("wandb", "mlflow"):
        if sink in tr.logger:
            need(installed(sink), "trainer.logger",
                 f"{sink} is not installed: pip install {sink} (or megappo[loggers]), or drop it from the list")
    if tr.resume_mode not in ("disable", "auto", "resume_path"):
        need(Path(os.path.expanduser(tr.resume_mode)).is_dir(), "trainer.resume_mode",
             f"expected disable, auto, resume_path or an existing checkpoint directory, got {tr.resume_mode!r}")


def _check_model_path(cfg: PPOConfig, key: str, need) -> None:
    p = get(cfg, key)
    local = Path(os.path.expanduser(p))
    if local.exists() or p.startswith(("/", ".", "~")) or p.count("/") != 1:
        if need(local.is_dir(), key, f"model directory not found: {p}"):
            if need((local / "config.json").is_file(), key, f"{p} has no config.json (expected a HuggingFace model folder)"):
                _check_experts(cfg, key, local / "config.json", need)
    # else: a hub id ("Qwen/Qwen3-8B"), resolved from the local HF cache when the model loads.


def _check_experts(cfg: PPOConfig, key: str, config_json: Path, need) -> None:
    """Expert parallelism against the model: EP > 1 needs a Mixture-of-Experts model whose
    experts it divides; LoRA on such a model adapts the attention only."""
    import json

    try:
        raw = json.loads(config_json.read_text())
        # transformers 5 saves Qwen3-MoE's num_experts under its attribute-map name
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    except (ValueError, OSError):
        return   # the model loader reports an unreadable config.json with its own error
    ep, k = cfg.actor_rollout_ref.actor.megatron.expert_model_parallel_size, A + "megatron.expert_model_parallel_size"
    if ep > 1 and not experts and key == "actor_rollout_ref.model.path":   # a dense critic beside an MoE actor is fine
        need(False, k, f"must be 1: {key} ({get(cfg, key)}) is a dense model (no num_experts in its config.json), got {ep}")
    elif experts and ep >= 1:
        need(experts % ep == 0, k, f"must divide the model's num_experts ({experts}, {key}), got {ep}")
    if not experts:
        return
    roles = []   # (its model section's key prefix, adapters on) of the roles built from this folder
    if key == "actor_rollout_ref.model.path":
        roles.append(("actor_rollout_ref.model.", lora_enabled(cfg)))
    if critic_enabled(cfg) and (key == "critic.model.path" or cfg.critic.model.path == cfg.actor_rollout_ref.model.path):
        roles.append(("critic.model.", cfg.critic.model.lora_rank > 0))
    for prefix, lora in roles:
        if lora:
            _check_moe_lora(cfg, prefix, key, experts, need)


def _check_moe_lora(cfg: PPOConfig, prefix: str, key: str, experts: int, need) -> None:
    """LoRA on a Mixture-of-Experts model adapts the attention only: the experts' and router's
    adapters are not built."""
    from megappo.models import ATTENTION_MODULES, LoRAError, lora_spec_from_config

    section = get(cfg, prefix[:-1])
    try:
        modules = lora_spec_from_config(section).modules
    except (LoRAError, OSError, ValueError):
        return   # a bad adapter folder or module name is reported by its own rule
    mlp = [m for m in modules if m not in ATTENTION_MODULES]
    # an adapter folder to start from brings its own modules
    tk = prefix + ("lora_adapter_path" if getattr(section, "lora_adapter_path", None) else "target_modules")
    need(not mlp, tk, f"must name attention modules only ({', '.join(ATTENTION_MODULES)}) on {key}, a "
                      f"Mixture-of-Experts model ({experts} experts): megappo does not build adapters for its "
                      f"experts and router; got {', '.join(mlp)} among the modules")


def critic_enabled(cfg: PPOConfig) -> bool:
    """Whether the run builds a critic (critic.enable, or auto: the estimator needs values)."""
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    try:
        from megappo import algo

        return algo.get_estimator(cfg.algorithm.adv_estimator).needs_critic
    except (KeyError, ValueError):
        return False


# The functions holding the rules (each need(...) call site has a row in tests/unit/test_config.py).
RULE_FUNCTIONS = (_sizes, _layout, _batches, _ppo_and_kl, _policy_loss, _rollout_correction, _estimator, _sampling, _multi_turn, _optimizers, _trainer, _start_checkpoints, _checkpoint_contents, _lora, _model_overrides, _pipeline_split, _paths, _check_overrides, _check_model_path,
                  _check_experts)
