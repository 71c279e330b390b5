"""The phases of a step after generation, each a function of what it reads, returning what it
computes (the loop in :mod:`.ppo` writes the results into the batch), and the collective checks
that stop every rank together on a non-finite value."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from megappo import algo
from megappo.batch import RolloutBatch

__all__ = ["dp_rows", "old_log_probs", "rollout_correction", "rewards_and_advantages", "update_critic",
           "update_actor", "check_finite", "check_finite_metrics", "step_metrics"]


def dp_rows(batch: RolloutBatch, cfg, batching, dp: int, dp_rank: int) -> list[int]:
    """This DP rank's rows of the global batch, balanced per actor mini-batch."""
    from megappo.workers import deal_to_dp

    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    n = cfg.actor_rollout_ref.rollout.n
    return deal_to_dp(lengths, batching.actor_mini_batch * n, dp, cfg.trainer.balance_batch)[dp_rank]


def old_log_probs(actor, batch: RolloutBatch, cfg, batching) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(the actor's log-probs before the update, sum pi^2 when the estimator needs it); in rollout
    correction's bypass mode the engine's own log-probs (no forward pass)."""
    if cfg.algorithm.rollout_correction.bypass_mode:
        return batch.rollout_log_probs.clone(), None
    if "sum_pi_squared" in algo.get_estimator(cfg.algorithm.adv_estimator).inputs:
        # optimal_token_baseline: sum pi^2 from the same logits as the old log-probs
        return actor.compute_log_prob(batch, with_sum_pi_squared=True, **batching.old_log_prob.kwargs())
    return actor.compute_log_prob(batch, **batching.old_log_prob.kwargs()), None


def rollout_correction(batch: RolloutBatch, cfg, dp_group) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], dict]:
    """(truncated importance weights the policy loss multiplies, the rejection mask every loss
    applies, metrics): the engine-vs-trainer drift metrics always; the weights with
    algorithm.rollout_correction.rollout_is, the mask with rollout_rs (DP-global metrics)."""
    rc = cfg.algorithm.rollout_correction
    metrics = algo.rollout_probs_diff(batch.rollout_log_probs, batch.old_log_prob, batch.response_mask,
                                      dp_group=dp_group)
    weights = mask = None
    # bypass mode: old = the engine's, weights and rejection come from the current policy in the loss
    if rc.rollout_is is not None and not rc.bypass_mode:
        weights, m = algo.rollout_is_weights(batch.old_log_prob, batch.rollout_log_probs, batch.response_mask,
                                             level=rc.rollout_is, threshold=rc.rollout_is_threshold,
                                             batch_normalize=rc.rollout_is_batch_normalize, dp_group=dp_group)
        metrics.update(m)
    if rc.rollout_rs is not None and not rc.bypass_mode:
        # the tokens (or whole sequences) out of bounds leave every loss; lengths stay as they are
        mask, m = algo.rollout_rejection_mask(batch.old_log_prob, batch.rollout_log_probs, batch.response_mask,
                                              rs=rc.rollout_rs, threshold=rc.rollout_rs_threshold, dp_group=dp_group)
        metrics.update(m)
    return weights, mask, metrics


def cv_memory(cfg) -> algo.CvMemory:
    """group_cv's running sums across steps, with the run's decay and top weight."""
    return algo.CvMemory(cfg.algorithm.gae_cv_decay, cfg.algorithm.gae_cv_beta_max, cfg.algorithm.gae_cv_min_t)


def rewards_and_advantages(batch: RolloutBatch, cfg, kl_ctrl, dp_group, cv_memory=None) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """(token-level rewards: the scores, minus the KL penalty when it is in the reward; advantages;
    returns; metrics), statistics over the global batch (every DP rank). ``cv_memory``
    (algo.CvMemory): group_cv's running sums, updated here."""
    al, metrics = cfg.algorithm, {}
    if al.use_kl_in_reward:
        rewards, metrics = algo.apply_kl_in_reward(batch.token_level_scores, batch.old_log_prob, batch.ref_log_prob,
                                                   batch.response_mask, kl_ctrl, al.kl_penalty, dp_group=dp_group)
    else:
        rewards = batch.token_level_scores
    advantages, returns = algo.compute_advantages(
        al.adv_estimator, token_level_rewards=rewards, response_mask=batch.response_mask, values=batch.values,
        group_index=batch.prompt_index, gamma=al.gamma, lam=al.lam, norm_adv_by_std_in_grpo=al.norm_adv_by_std_in_grpo,
        dp_group=dp_group, old_log_probs=batch.old_log_prob, sum_pi_squared=batch.sum_pi_squared,
        rollout_is_weights=batch.rollout_is_weights, reward_components=batch.reward_components,
        reward_weights=al.gdpo_reward_weights, gae_adv_norm=al.gae_adv_norm, critic_lam=al.critic_lam,
        lam_length_alpha=al.lam_length_alpha, cv_memory=cv_memory, critic_target=al.critic_target)
    if batch.values is not None and cfg.actor_rollout_ref.rollout.n > 1:
        metrics["critic/advantages/equal_score_share"] = algo.equal_score_share(
            advantages, rewards, batch.response_mask, batch.prompt_index, dp_group)
        if al.adv_estimator == "gae" and al.gae_adv_norm == "group_cv" and cv_memory is not None:
            metrics["critic/advantages/cv_beta"] = cv_memory.beta   # the weight these advantages used
            metrics["critic/advantages/cv_beta_fit"] = cv_memory.beta_fit   # before shrinkage and clamp
            metrics["critic/advantages/cv_t"] = cv_memory.t           # the fit's t-statistic (the gate's)
            metrics["critic/advantages/cv_share"] = cv_memory.share   # the outcome's share the critic carries
            metrics["critic/advantages/cv_gain"] = cv_memory.gain     # GRPO's advantage variance it removes
        elif al.adv_estimator == "gae" and al.gae_adv_norm in ("group_centred", "group_cv"):
            metrics["critic/advantages/cv_beta"] = algo.critic_cv_beta(
                rewards, batch.values, batch.response_mask, batch.prompt_index, al.gamma, al.lam, dp_group)
    return rewards, advantages, returns, metrics


def update_critic(critic, batch: RolloutBatch, cfg, batching, loss, dp: int, step: int, device,
                  replay=None, pad_id: int = 0) -> dict:
    """PPO epochs of the critic (on ``batch`` and the rows ``replay``, a
    :class:`~megappo.trainer.replay.CriticReplay`, keeps); its losses and weights checked finite;
    then its offloadable state leaves the device (the critic is done for this step)."""
    per_rank = batching.critic_mini_batch * cfg.actor_rollout_ref.rollout.n // dp
    rows = batch if replay is None else replay.training_batch(
        batch, lambda b: critic.compute_values(b, **batching.values.kwargs()), pad_id)
    metrics = critic.update_critic(rows, mini_batch_size=per_rank, ppo_epochs=cfg.critic.ppo_epochs, loss=loss,
                                   shuffle_seed=cfg.critic.data_loader_seed if cfg.critic.shuffle else None,
                                   **batching.critic.kwargs())
    if replay is not None:
        metrics["critic/replay_samples"] = float(len(rows) - len(batch)) * dp
    check_finite_metrics("update_critic", metrics, "critic/", step)
    check_finite(step, device, "update_critic", critic_weights=_any_nonfinite(critic))
    critic.offload()
    return metrics


def update_actor(actor, batch: RolloutBatch, cfg, batching, loss, dp: int, step: int, device) -> dict:
    """PPO epochs of the policy, checked finite; its gradients and optimizer state may leave the
    device now, its weights after the sync."""
    per_rank = batching.actor_mini_batch * cfg.actor_rollout_ref.rollout.n // dp
    a = cfg.actor_rollout_ref.actor
    metrics = actor.update_policy(batch, mini_batch_size=per_rank, ppo_epochs=a.ppo_epochs, loss=loss,
                                  shuffle_seed=a.data_loader_seed if a.shuffle else None, **batching.actor.kwargs())
    check_finite_metrics("update_actor", metrics, "actor/", step)
    check_finite(step, device, "update_actor", actor_weights=_any_nonfinite(actor))
    actor.offload(params=False)
    return metrics


def check_finite(step: int, device, stage: str, **tensors) -> None:
    """Collective: every rank stops with the same error when any rank holds a NaN/inf in
    ``tensors`` after ``stage`` of step ``step`` -- before anything is synced, logged or checkpointed."""
    bad = [name for name, t in tensors.items() if t is not None and not bool(torch.isfinite(t).all())]
    flag = torch.tensor([1.0 if bad else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        what = ", ".join(bad) if bad else "values on another rank"
        raise FloatingPointError(f"step {step}, stage {stage}: non-finite {what}; stopping before anything is saved")


def check_finite_metrics(stage: str, metrics: dict, prefix: str, step: int) -> None:
    # Loss and grad-norm metrics are reduced over the job already: every rank sees the same.
    bad = [k for k, v in metrics.items() if k.startswith(prefix) and isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise FloatingPointError(f"step {step}, stage {stage}: non-finite {', '.join(bad)}; stopping before anything is saved")


def _any_nonfinite(worker) -> torch.Tensor:
    """A 0-d tensor, NaN when any of this rank's weights is NaN/inf after an update (finite
    losses do not prove finite weights: the last optimizer step of a step comes after them)."""
    bad = torch.zeros((), dtype=torch.bool)
    for chunk in worker.chunks:
        for p in chunk.parameters():
            bad |= ~torch.isfinite(p.detach()).all().cpu()
    return torch.tensor(float("nan") if bad else 0.0)


def step_metrics(step: int, metrics: dict, global_batch: RolloutBatch, local_batch: RolloutBatch, cfg, dp_group,
                 timer, world_size: int, lag: Optional[int], num_filtered: int, actor_params) -> dict:
    """The step's batch statistics, timings and throughput added to ``metrics`` (``lag``: the
    weight version lag under the split placement, else None; ``actor_params()``: the actor's
    parameter count, for MFU on GPU); a non-finite one stops the run."""
    from megappo.metrics import data_metrics

    metrics.update(data_metrics(global_batch, cfg.data.max_response_length))  # every rank holds the global batch
    dealt = data_metrics(local_batch, cfg.data.max_response_length, group=dp_group)  # each DP rank its rows
    metrics.update({k: v for k, v in dealt.items() if k.split("/")[1] in ("rewards", "advantages", "returns", "values")
                    or k in ("critic/vf_explained_var", "critic/advantages_returns_corr")})
    metrics.update(timer.pop())
    tokens = float(global_batch.valid_mask.sum() + global_batch.prompt_lengths.sum())
    metrics["perf/throughput"] = tokens / metrics["timing_s/step"] / world_size  # per rank of the job
    if lag is not None:   # steps between the policy that generated this batch and the one it trains
        metrics["training/weight_version_lag"] = float(lag)
    metrics["perf/max_memory_allocated_gb"] = _max_memory_gb(cfg.trainer.device)
    # Prompts dropped at load time for exceeding data.max_prompt_length (filter_overlong_prompts).
    metrics["data/filtered_overlong_prompts"] = float(num_filtered)
    if cfg.trainer.device == "cuda" and "timing_s/update_actor" in metrics:
        from megappo.metrics import mfu, peak_flops

        peak = peak_flops(torch.cuda.get_device_name())
        if peak:
            metrics["perf/mfu/actor"] = mfu(actor_params(), tokens * cfg.actor_rollout_ref.actor.ppo_epochs,
                                            metrics["timing_s/update_actor"], dist.get_world_size(), peak)
    metrics = {k: v for k, v in metrics.items() if not isinstance(v, list)}
    for k, v in metrics.items():
        if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
            raise FloatingPointError(f"step {step}: metric {k} is {v}; stopping before anything is saved")
    return metrics


def _max_memory_gb(device: str) -> float:
    """Peak accelerator memory on GPU; on CPU the process's peak resident set (there is no
    allocator counter), so the figure stays comparable between steps of one run."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
