"""PPOTrainer: one SPMD program per rank; ``step()`` follows DESIGN.md section 2."""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

from megappo import algo
from megappo.batch import RolloutBatch
from megappo.config import PPOConfig, parallel_layout, to_dict
from megappo.workers.batching import PassBatching

__all__ = ["PPOTrainer", "init_distributed"]


def init_distributed(cfg: PPOConfig) -> torch.device:
    """torch.distributed from the launcher's environment (torchrun, srun, Ray); megatron's
    parallel state from the config. On CPU the megatron adaptation is installed first (with the
    device check when ``MEGAPPO_CHECK_DEVICES=1``). Returns this process's device."""
    import datetime

    from megappo.distributed import process_device

    if cfg.trainer.device == "cpu":
        from megappo import device_check, megatron_cpu

        megatron_cpu.install(check_devices=device_check.enabled_by_env())
    backend = "gloo" if cfg.trainer.device == "cpu" else "nccl"
    timeout = datetime.timedelta(seconds=cfg.trainer.dist_timeout_s)
    if not cfg.actor_rollout_ref.hybrid_engine:
        # split placement: each role gets its own default group (megatron sees the training ranks,
        # vLLM the rollout ranks) and the bridge between them; rollout ranks need no megatron
        from megappo.distributed import split

        tr, ro = cfg.trainer, cfg.rollout
        groups = split.init_split(split.train_ranks_of(tr.nnodes, tr.n_gpus_per_node, ro.nnodes, ro.n_gpus_per_node),
                                  backend, timeout)
        split.set_current(groups)
        if groups.role == "rollout":
            return process_device(cfg.trainer.device)
    elif not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timeout)
    from megappo.models import initialize_parallel

    m = cfg.actor_rollout_ref.actor.megatron
    initialize_parallel(m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                        m.virtual_pipeline_model_parallel_size, seed=m.seed, ep=m.expert_model_parallel_size,
                        etp=m.expert_tensor_parallel_size or 1)
    return process_device(cfg.trainer.device)


def set_library_log_level(level: str) -> None:
    """vLLM's and megatron-core's loggers at ``level`` (trainer.log_level). vLLM configures its
    logger from VLLM_LOGGING_LEVEL when first imported (a user's own setting wins); later
    changes go through the logger objects."""
    import logging

    os.environ.setdefault("VLLM_LOGGING_LEVEL", level.upper())
    for name in ("vllm", "megatron"):
        logging.getLogger(name).setLevel(level.upper())


class PPOTrainer:
    def __init__(self, cfg: PPOConfig):
        from megatron.core import parallel_state as ps
        from transformers import AutoTokenizer

        from megappo import builders
        from megappo.data import PromptDataset, PromptSampler
        from megappo.distributed import host_dp_group, process_device
        from megappo.metrics import CollapseWatch, MetricsLogger, Timer
        from megappo.rewards import load_custom_reward

        self.cfg = cfg
        arr, d, tr = cfg.actor_rollout_ref, cfg.data, cfg.trainer
        set_library_log_level(tr.log_level)
        self.batching = PassBatching.from_config(cfg)
        self.policy_loss, self.value_loss = builders.loss_specs(cfg)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        from megappo.distributed import split

        # split placement: the rollout ranks (megappo.rollout.remote.serve) generate; this rank trains
        self.split = split.current()
        self.one_step_off = tr.async_mode == "one_step_off"
        self.layout = parallel_layout(cfg, self.split.global_world if self.split else self.world)
        # Host-side collectives over DP (advantages, KL controller, metrics) carry CPU tensors of
        # the batch the trainer keeps on the host: they use megatron's gloo DP group.
        self.dp_group = host_dp_group()
        self.device = process_device(tr.device)
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(arr.model.path))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # Data and the reward function first: a bad row or a broken reward file is reported in
        # seconds, before vLLM starts and the models are built.
        self.custom_reward = (load_custom_reward(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
                              if cfg.custom_reward_function.path else None)
        ds = dict(max_prompt_length=d.max_prompt_length, prompt_key=d.prompt_key,
                  filter_overlong_prompts=d.filter_overlong_prompts, truncation=d.truncation)
        self.train_data = PromptDataset(d.train_files, self.tokenizer, **ds)
        self.val_data = PromptDataset(d.val_files, self.tokenizer, **ds) if d.val_files else None
        total = self.total_steps()
        if self.split:
            from megappo.rollout.remote import RemoteRollout

            self.engine = RemoteRollout(self.split, self.pad_id)
        else:
            self.engine = builders.build_engine(cfg)   # first: see megappo.builders
        self.info, self.actor = builders.build_actor(cfg, self.device, self.pad_id, total)
        self.ref = builders.build_reference(cfg, self.device, self.pad_id)
        self.critic = builders.build_critic(cfg, self.device, self.pad_id, total)
        self.reward_model = builders.build_reward_model(cfg, self.device, self.pad_id, self.tokenizer)
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = algo.make_kl_controller({"type": k.type, "kl_coef": k.kl_coef, "target_kl": k.target_kl,
                                                "horizon": k.horizon})
        self.sampler = PromptSampler(len(self.train_data), d.gen_batch_size or d.train_batch_size, shuffle=d.shuffle,
                                     seed=d.seed, key="data.gen_batch_size" if d.gen_batch_size else "data.train_batch_size")
        self.step_no = 0
        self._lag = 0
        self._last_step = total   # fit() sets the run's last step
        self.inflight = None   # one-step off-policy: the next step's generation (items, outputs, policy version)
        self.timer = Timer()
        self.collapse_watch = CollapseWatch()
        self.logger = MetricsLogger(tr.logger, os.path.expanduser(tr.default_local_dir), rank=self.rank,
                                    total_steps=total, project=tr.project_name, experiment=tr.experiment_name,
                                    config=to_dict(cfg))
        self.resumed_from = self.resume()
        self.sync_weights()

    # -- pieces ---------------------------------------------------------------------------
    def total_steps(self) -> int:
        """trainer.total_training_steps, or total_epochs x the prompt batches in one pass over the data
        (batches of data.gen_batch_size with dynamic sampling, as verl's dataloader)."""
        if self.cfg.trainer.total_training_steps:
            return self.cfg.trainer.total_training_steps
        if hasattr(self, "train_data"):
            n = len(self.train_data)
        else:
            from megappo.data import read_rows

            n = sum(len(read_rows(f)) for f in self.cfg.data.train_files)
        per_epoch = n // (self.cfg.data.gen_batch_size or self.cfg.data.train_batch_size)
        return max(1, per_epoch * self.cfg.trainer.total_epochs)

    def sync_weights(self, version: Optional[int] = None) -> dict:
        """The actor's weights into the engine (which wakes first). Every role's offloadable state
        leaves the device around it: the others' before the engine wakes, the actor's weights
        after they were streamed."""
        from megappo.convert.hf_io import RankCoords, iter_hf_tensors, plan_shared_gather
        from megappo.models.layers import uses_te
        from megappo.rollout.shard_sync import iter_sync_tensors, plan_for_engine

        for w in (self.ref, self.critic):
            if w is not None:
                w.offload()
        self.actor.offload(params=False)
        self.actor.state_offload.ensure(params=True)
        coords = RankCoords.from_megatron()
        if not hasattr(self, "_shard_plan"):  # decided once, by all ranks together
            self._shard_plan = (plan_for_engine(self.engine, self.actor.chunks, self.info.desc, coords)
                                if self.cfg.actor_rollout_ref.rollout.shard_sync and not self.split else None)
        if self._shard_plan is not None:
            named = iter_sync_tensors(self.actor.chunks, self.info.desc, coords, self._shard_plan,
                                      uses_te(self.actor.chunks))
        else:
            if not hasattr(self, "_shared_gather"):  # CPU ranks of one host: gather through shared memory
                self._shared_gather = plan_shared_gather(self.actor.chunks, self.info.desc, coords)
            named = iter_hf_tensors(self.actor.chunks, self.info.desc, coords, shared=self._shared_gather)
        if self.split:
            if self.engine.pending is not None:   # one-step off: the next batch, made with the previous weights
                self._collect_inflight()
            # the policy's version: the updates it has had (the step's sync runs before step_no advances)
            out = self.engine.sync_weights(named, policy_version=self.step_no if version is None else version)
        else:
            out = self.engine.sync_weights(named)
        self.actor.offload()
        return out

    def rollout(self, items, sampling, salt: int = 0, offset: int = 0) -> tuple[RolloutBatch, list]:
        """Generate on this rank's rollout replica, gather every replica's samples on every rank.
        Each prompt samples from its own seed, a function of (seed, step, salt, position in the
        batch): the samples do not depend on how prompts are split over replicas, and a resumed
        run draws exactly what the uninterrupted one drew."""
        if self.split:   # the rollout ranks generate (each replica its slice, seeded the same way)
            return self._assemble(items, self.engine.generate([it.prompt_ids for it in items],
                                                              self._sampling(sampling, salt, offset)))
        from megappo.rollout import generate_replicated

        rtp = self.cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
        return self._assemble(items, generate_replicated(self.engine, [it.prompt_ids for it in items],
                                                         self._sampling(sampling, salt, offset), self.rank,
                                                         self.world, rtp))

    def _sampling(self, sampling, salt: int, first: int, step: Optional[int] = None):
        """``sampling`` seeded for a batch whose first prompt has index ``first`` (in the step's or
        the validation set's order) at trainer step ``step`` (default: the current one)."""
        step = self.step_no if step is None else step
        base = (self.cfg.data.seed * 1_000_003 + step * 4_000_037 + salt * 7_919_003) % (1 << 40)
        sampling.seed = base + first * sampling.n
        return sampling

    def _assemble(self, items, out) -> tuple[RolloutBatch, list]:
        """The RolloutBatch of gathered engine outputs (prompt order) and their items."""
        prompts = [items[i].prompt_ids for i in out.prompt_index.tolist()]
        batch = RolloutBatch.from_prompts_and_responses(prompts, out.responses, out.response_mask, self.pad_id,
                                                        prompt_index=out.prompt_index,
                                                        rollout_log_probs=out.rollout_log_probs)
        return batch, [items[i] for i in out.prompt_index.tolist()]

    def score(self, batch: RolloutBatch, items, details: Optional[list] = None) -> torch.Tensor:
        """(B, T) token-level scores: each response's reward on its last token. ``details``
        receives what the reward function returned per sample (see megappo.rewards.score_batch)."""
        from megappo.rewards import score_batch

        texts = [self.tokenizer.decode(batch.responses[i, :int(batch.response_mask[i].sum())].tolist(),
                                       skip_special_tokens=True) for i in range(len(batch))]
        scores = score_batch([it.data_source for it in items], texts, [it.ground_truth for it in items],
                             [it.extra_info for it in items], custom=self.custom_reward, details=details)
        tls = torch.zeros_like(batch.response_mask)
        last = (batch.response_mask.sum(-1).long() - 1).clamp(min=0)
        tls[torch.arange(len(batch)), last] = torch.tensor(scores, dtype=tls.dtype)
        return tls * batch.response_mask

    def _check_finite(self, stage: str, **tensors) -> None:
        """Collective: every rank stops with the same error when any rank holds a NaN/inf in
        ``tensors`` after ``stage`` -- before anything is synced, logged or checkpointed."""
        bad = [name for name, t in tensors.items() if t is not None and not bool(torch.isfinite(t).all())]
        flag = torch.tensor([1.0 if bad else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            what = ", ".join(bad) if bad else "values on another rank"
            raise FloatingPointError(f"step {self.step_no + 1}, stage {stage}: non-finite {what}; "
                                     "stopping before anything is saved")

    def _check_finite_metrics(self, stage: str, metrics: dict, prefix: str) -> None:
        # Loss and grad-norm metrics are reduced over the job already: every rank sees the same.
        bad = [k for k, v in metrics.items() if k.startswith(prefix) and isinstance(v, float) and not math.isfinite(v)]
        if bad:
            raise FloatingPointError(f"step {self.step_no + 1}, stage {stage}: non-finite {', '.join(bad)}; "
                                     "stopping before anything is saved")

    def _actor_params(self) -> int:
        """Parameters of the whole actor (summed over its TP x PP shards), counted once."""
        if not hasattr(self, "_n_params"):
            from megatron.core import parallel_state as ps

            n = torch.tensor([float(sum(p.numel() for c in self.actor.chunks for p in c.parameters()))],
                             device=self.device)
            dist.all_reduce(n, group=ps.get_model_parallel_group())
            self._n_params = int(n.item())
        return self._n_params

    def _assemble_rows(self, local: torch.Tensor, rows: list, n_rows: int) -> torch.Tensor:
        """The full batch's tensor from every DP rank's rows (for metrics over all samples)."""
        parts = [None] * self.dp
        dist.all_gather_object(parts, (rows, local.cpu()), group=self.dp_group)
        out = torch.zeros((n_rows, *local.shape[1:]), dtype=local.dtype)
        for r, t in parts:
            out[torch.tensor(r, dtype=torch.long)] = t
        return out

    # -- the step (DESIGN.md section 2) ------------------------------------------------------
    def step(self, log: bool = True) -> dict:
        from megappo.rollout import SamplingConfig

        cfg, arr, t = self.cfg, self.cfg.actor_rollout_ref, self.timer
        metrics = {}
        with t("step"):
            sampling = SamplingConfig.from_config(arr.rollout, cfg.data.max_response_length)
            global_batch, global_items = self._generate(sampling)
            self.engine.sleep()
            local_batch = self._deal(global_batch)
            with t("old_log_prob"):
                local_batch.old_log_prob = self._old_log_prob(local_batch)
            self._check_finite("old_log_prob", old_log_prob=local_batch.old_log_prob)
            metrics.update(self._rollout_correction(local_batch))
            if self.ref is not None:
                with t("ref"):
                    local_batch.ref_log_prob = self.ref.compute_log_prob(local_batch, **self.batching.ref.kwargs())
                self.ref.offload()
                self._check_finite("ref", ref_log_prob=local_batch.ref_log_prob)
            if self.critic is not None:
                with t("values"):
                    local_batch.values = self.critic.compute_values(local_batch, **self.batching.values.kwargs())
                self._check_finite("values", values=local_batch.values)
            with t("adv"):
                metrics.update(self._advantages(local_batch))
            self._check_finite("adv", rewards=local_batch.token_level_rewards, advantages=local_batch.advantages,
                               returns=local_batch.returns)
            if self.critic is not None:
                with t("update_critic"):
                    metrics.update(self._update_critic(local_batch))
            if self.step_no >= cfg.trainer.critic_warmup:
                with t("update_actor"):
                    metrics.update(self._update_actor(local_batch))
            with t("sync"):  # also wakes a sleeping engine (its weights were dropped)
                self.sync_weights(version=self.step_no + 1)
        self.step_no += 1
        metrics = self._step_metrics(metrics, global_batch, local_batch)
        warning = self.collapse_watch.update(metrics)
        if warning and self.rank == 0:
            print(f"step {self.step_no}: WARNING: {warning}", file=sys.stderr, flush=True)
        if log:
            self.logger.log(self.step_no, metrics)
        return metrics

    def _generate(self, sampling) -> tuple[RolloutBatch, list]:
        """This step's scored samples (every rank holds them all) and their prompts. With DAPO's
        dynamic sampling (algorithm.filter_groups) rounds of data.gen_batch_size prompts are
        generated and scored, groups whose metric does not vary are dropped, until
        data.train_batch_size prompts are kept (the last round's surplus is dropped too)."""
        fg = self.cfg.algorithm.filter_groups
        self._reward_metrics = {}
        if not fg.enable:
            if self.inflight is not None:   # one-step off: generated during the last step, with the weights before it
                indices, out, version = self.inflight
                self.inflight = None
                global_batch, global_items = self._assemble([self.train_data[i] for i in indices], out)
                self._lag = self.step_no - version
            else:
                items = [self.train_data[i] for i in self.sampler.next_batch()]
                with self.timer("gen"):
                    global_batch, global_items = self.rollout(items, sampling)
                self._lag = 0
            if self.one_step_off and self.step_no + 1 < self._last_step:
                self._request_next(sampling)
            self.engine.sleep()
            self._score(global_batch, global_items)
            return global_batch, global_items
        want, kept, kept_items, n_kept, n_prompts, rounds = self.cfg.data.train_batch_size, [], [], 0, 0, 0
        generated_scores = []
        while n_kept < want:
            if fg.max_num_gen_batches > 0 and rounds >= fg.max_num_gen_batches:
                raise RuntimeError(
                    f"step {self.step_no + 1}: {rounds} generation rounds kept {n_kept} of data.train_batch_size="
                    f"{want} prompts (algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches}): almost "
                    f"every group scores the same {fg.metric}; check the data and the reward, or raise the limit")
            if self.engine.asleep:  # a reward model ran: the engine dropped its weights for it
                self.sync_weights()
            items = [self.train_data[i] for i in self.sampler.next_batch()]
            with self.timer("gen"):  # salt 1 is validation's
                batch, its = self.rollout(items, sampling, salt=0 if rounds == 0 else rounds + 1)
            if self.reward_model is not None:
                self.engine.sleep()
            values = self._score(batch, its)
            metric = values[fg.metric]
            generated_scores.append(values["seq_reward"])
            rows = torch.nonzero(algo.informative_groups(metric, batch.prompt_index)).squeeze(-1)
            groups = torch.unique_consecutive(batch.prompt_index[rows])[:want - n_kept]
            rows = rows[torch.isin(batch.prompt_index[rows], groups)]
            part = batch.select(rows)
            part.prompt_index = n_kept + torch.searchsorted(groups, part.prompt_index)  # groups 0..want-1
            kept.append(part)
            kept_items += [its[i] for i in rows.tolist()]
            n_kept += len(groups)
            n_prompts += len(items)
            rounds += 1
        # critic/score/* describe the kept (filtered) batch; this is the policy's score on all it generated
        self._reward_metrics.update({"train/num_gen_batches": float(rounds), "train/kept_prompt_fraction": n_kept / n_prompts,
                                     "train/generated_score_mean": float(torch.cat(generated_scores).mean())})
        return RolloutBatch.concat(kept, self.pad_id), kept_items

    def _request_next(self, sampling) -> None:
        """One-step off-policy: the rollout ranks start generating the next step's prompts (with
        the weights they hold, this step's policy's predecessor) while this step trains; the
        samples are seeded as the next step would seed them."""
        import copy

        indices = self.sampler.next_batch()
        self._next_indices = indices
        self.engine.request([self.train_data[i].prompt_ids for i in indices],
                            self._sampling(copy.copy(sampling), 0, 0, step=self.step_no + 1))

    def _collect_inflight(self) -> None:
        out, version = self.engine.collect()
        self.inflight = (self._next_indices, out, version)

    def _score(self, global_batch: RolloutBatch, global_items: list) -> dict:
        """Score every sample: the rule/custom function on the whole global batch, or the reward
        model on this rank's rows (the batch's DP deal), assembled on every rank; then the shaping
        (DAPO's overlong penalty; its metrics go to ``self._reward_metrics``). Returns the
        per-sample values dynamic sampling can filter on."""
        if self.reward_model is None:
            with self.timer("reward"):
                details = []
                global_batch.token_level_scores = self.score(global_batch, global_items, details)
        else:
            rows, details = self._dp_rows(global_batch), []
            with self.timer("reward"):
                local = self.reward_model.compute_scores(global_batch.select(rows), **self.batching.reward.kwargs())
                global_batch.token_level_scores = self._assemble_rows(local, rows, len(global_batch))
        out = {"score": global_batch.token_level_scores.sum(-1)}
        ob = self.cfg.reward_model.overlong_buffer
        if ob.enable:
            global_batch.token_level_scores, m = algo.overlong_penalty(
                global_batch.token_level_scores, global_batch.response_mask,
                max_response_length=self.cfg.data.max_response_length, buffer_len=ob.len,
                penalty_factor=ob.penalty_factor)
            self._reward_metrics.update(m)
        self._check_finite("reward", scores=global_batch.token_level_scores)
        out["seq_reward"] = out["seq_final_reward"] = global_batch.token_level_scores.sum(-1)
        if self.cfg.algorithm.filter_groups.metric == "acc":
            out["acc"] = _acc(details, self.reward_model is not None)
        if self.cfg.algorithm.gdpo_reward_keys:
            global_batch.reward_components = _reward_components(details, self.cfg.algorithm.gdpo_reward_keys)
        return out

    def _dp_rows(self, global_batch: RolloutBatch) -> list[int]:
        """This DP rank's rows of the global batch, balanced per actor mini-batch."""
        from megappo.workers.batching import deal_to_dp

        lengths = (global_batch.prompt_lengths + global_batch.response_mask.sum(-1).long()).tolist()
        n = self.cfg.actor_rollout_ref.rollout.n
        return deal_to_dp(lengths, self.batching.actor_mini_batch * n, self.dp, self.cfg.trainer.balance_batch)[self.dp_rank]

    def _deal(self, global_batch: RolloutBatch) -> RolloutBatch:
        """This DP rank's rows; each keeps its row number in the global batch (``sample_index``)."""
        global_batch.sample_index = torch.arange(len(global_batch))
        return global_batch.select(self._dp_rows(global_batch))

    def _old_log_prob(self, local_batch: RolloutBatch) -> torch.Tensor:
        """The actor's log-probs before the update; in rollout correction's bypass mode the
        engine's own (no forward pass)."""
        if self.cfg.algorithm.rollout_correction.bypass_mode:
            return local_batch.rollout_log_probs.clone()
        if "sum_pi_squared" in algo.get_estimator(self.cfg.algorithm.adv_estimator).inputs:
            # optimal_token_baseline: sum pi^2 from the same logits as the old log-probs
            lp, local_batch.sum_pi_squared = self.actor.compute_log_prob(
                local_batch, with_sum_pi_squared=True, **self.batching.old_log_prob.kwargs())
            return lp
        return self.actor.compute_log_prob(local_batch, **self.batching.old_log_prob.kwargs())

    def _rollout_correction(self, local_batch: RolloutBatch) -> dict:
        """The engine-vs-trainer drift metrics; with algorithm.rollout_correction.rollout_is the
        truncated importance weights the policy loss multiplies; with rollout_rs the rejection
        mask every loss applies (DP-global metrics)."""
        metrics = algo.rollout_probs_diff(local_batch.rollout_log_probs, local_batch.old_log_prob,
                                          local_batch.response_mask)
        rc = self.cfg.algorithm.rollout_correction
        # bypass mode: old = the engine's, weights and rejection come from the current policy in the loss
        if rc.rollout_is is not None and not rc.bypass_mode:
            local_batch.rollout_is_weights, m = algo.rollout_is_weights(
                local_batch.old_log_prob, local_batch.rollout_log_probs, local_batch.response_mask,
                level=rc.rollout_is, threshold=rc.rollout_is_threshold, batch_normalize=rc.rollout_is_batch_normalize,
                dp_group=self.dp_group)
            metrics.update(m)
        if rc.rollout_rs is not None and not rc.bypass_mode:
            # the tokens (or whole sequences) out of bounds leave every loss; lengths stay as they are
            local_batch.rollout_rs_mask, m = algo.rollout_rejection_mask(
                local_batch.old_log_prob, local_batch.rollout_log_probs, local_batch.response_mask,
                rs=rc.rollout_rs, threshold=rc.rollout_rs_threshold, dp_group=self.dp_group)
            metrics.update(m)
        return metrics

    def _advantages(self, local_batch: RolloutBatch) -> dict:
        """Rewards (scores, minus the KL penalty when it is in the reward), then advantages and
        returns; statistics over the global batch (every DP rank)."""
        al, metrics = self.cfg.algorithm, {}
        if al.use_kl_in_reward:
            local_batch.token_level_rewards, metrics = algo.apply_kl_in_reward(
                local_batch.token_level_scores, local_batch.old_log_prob, local_batch.ref_log_prob,
                local_batch.response_mask, self.kl_ctrl, al.kl_penalty, dp_group=self.dp_group)
        else:
            local_batch.token_level_rewards = local_batch.token_level_scores
        local_batch.advantages, local_batch.returns = algo.compute_advantages(
            al.adv_estimator, token_level_rewards=local_batch.token_level_rewards,
            response_mask=local_batch.response_mask, values=local_batch.values, group_index=local_batch.prompt_index,
            gamma=al.gamma, lam=al.lam, norm_adv_by_std_in_grpo=al.norm_adv_by_std_in_grpo, dp_group=self.dp_group,
            old_log_probs=local_batch.old_log_prob, sum_pi_squared=local_batch.sum_pi_squared,
            rollout_is_weights=local_batch.rollout_is_weights, reward_components=local_batch.reward_components,
            reward_weights=al.gdpo_reward_weights, gae_adv_norm=al.gae_adv_norm,
            critic_lam=al.critic_lam, lam_length_alpha=al.lam_length_alpha)
        if local_batch.values is not None and self.cfg.actor_rollout_ref.rollout.n > 1:
            metrics["critic/advantages/equal_score_share"] = algo.equal_score_share(
                local_batch.advantages, local_batch.token_level_rewards, local_batch.response_mask,
                local_batch.prompt_index, self.dp_group)
        return metrics

    def _update_critic(self, local_batch: RolloutBatch) -> dict:
        """PPO epochs of the critic; its losses and weights checked finite; then its offloadable
        state leaves the device (the critic is done for this step)."""
        metrics = self.critic.update_critic(local_batch, mini_batch_size=self._per_rank(self.batching.critic_mini_batch),
                                            ppo_epochs=self.cfg.critic.ppo_epochs, loss=self.value_loss,
                                            **self.batching.critic.kwargs())
        self._check_finite_metrics("update_critic", metrics, "critic/")
        self._check_finite("update_critic", critic_weights=_any_nonfinite(self.critic))
        self.critic.offload()
        return metrics

    def _update_actor(self, local_batch: RolloutBatch) -> dict:
        """PPO epochs of the policy, checked finite; its gradients and optimizer state may leave
        the device now, its weights after the sync."""
        metrics = self.actor.update_policy(local_batch, mini_batch_size=self._per_rank(self.batching.actor_mini_batch),
                                           ppo_epochs=self.cfg.actor_rollout_ref.actor.ppo_epochs, loss=self.policy_loss,
                                           **self.batching.actor.kwargs())
        self._check_finite_metrics("update_actor", metrics, "actor/")
        self._check_finite("update_actor", actor_weights=_any_nonfinite(self.actor))
        self.actor.offload(params=False)
        return metrics

    def _per_rank(self, prompts: int) -> int:
        """Samples of a mini-batch of ``prompts`` prompts on one DP rank."""
        return prompts * self.cfg.actor_rollout_ref.rollout.n // self.dp

    def _step_metrics(self, metrics: dict, global_batch: RolloutBatch, local_batch: RolloutBatch) -> dict:
        """The step's local_batch statistics, timings and throughput; a non-finite one stops the run."""
        from megappo.metrics import data_metrics

        cfg = self.cfg
        metrics.update(self._reward_metrics)   # reward shaping (DAPO's overlong penalty), when on
        metrics.update(data_metrics(global_batch, cfg.data.max_response_length))  # every rank holds the global batch
        dealt = data_metrics(local_batch, cfg.data.max_response_length, group=self.dp_group)  # each DP rank its rows
        metrics.update({k: v for k, v in dealt.items() if k.split("/")[1] in ("rewards", "advantages", "returns", "values")
                        or k in ("critic/vf_explained_var", "critic/advantages_returns_corr")})
        metrics.update(self.timer.pop())
        tokens = float(global_batch.response_mask.sum() + global_batch.prompt_lengths.sum())
        metrics["perf/throughput"] = tokens / metrics["timing_s/step"] / self.layout.world_size  # per rank of the job
        if self.split:   # steps between the policy that generated this batch and the one it trains
            metrics["training/weight_version_lag"] = float(self._lag)
        metrics["perf/max_memory_allocated_gb"] = _max_memory_gb(cfg.trainer.device)
        # Prompts dropped at load time for exceeding data.max_prompt_length (filter_overlong_prompts).
        metrics["data/filtered_overlong_prompts"] = float(self.train_data.num_filtered)
        if cfg.trainer.device == "cuda" and "timing_s/update_actor" in metrics:
            from megappo.metrics import mfu, peak_flops

            peak = peak_flops(torch.cuda.get_device_name())
            if peak:
                metrics["perf/mfu/actor"] = mfu(self._actor_params(), tokens * cfg.actor_rollout_ref.actor.ppo_epochs,
                                                metrics["timing_s/update_actor"], self.world, peak)
        metrics = {k: v for k, v in metrics.items() if not isinstance(v, list)}
        for k, v in metrics.items():
            if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
                raise FloatingPointError(f"step {self.step_no}: metric {k} is {v}; stopping before anything is saved")
        return metrics

    # -- validation, checkpoints, the loop ---------------------------------------------------
    def validate(self) -> dict:
        """Score the whole validation set with ``rollout.val_kwargs`` sampling:
        ``val-core/<data_source>/reward/mean@<n>`` (and ``best@<n>`` when n > 1)."""
        from megappo.rollout import SamplingConfig

        if self.val_data is None:
            return {}
        sampling = SamplingConfig.from_config(self.cfg.actor_rollout_ref.rollout, self.cfg.data.max_response_length,
                                              validation=True)
        items = [self.val_data[i] for i in range(len(self.val_data))]
        size = self.cfg.data.val_batch_size or len(items)
        with self.timer("testing"):
            # data.val_batch_size prompts per generate call; each prompt's seed depends on its place
            # in the whole set, so the split does not change what is sampled
            scores = []
            for lo in range(0, len(items), size):
                batch, its = self.rollout(items[lo:lo + size], sampling, salt=1, offset=lo)
                scores.append(self.score(batch, its).sum(-1))
            scores = torch.cat(scores).view(len(items), sampling.n)
            # Training rollouts never see validation's cached prompts: a run resumed from the
            # checkpoint of this step (fresh engine, empty cache) then samples exactly as this one.
            self.engine.reset_prefix_cache()
        out = {}
        n = sampling.n
        for src in sorted({it.data_source for it in items}):
            rows = torch.tensor([i for i, it in enumerate(items) if it.data_source == src])
            s = scores[rows].double()
            out[f"val-core/{src}/reward/mean@{n}"] = s.mean().item()
            if n > 1:
                out[f"val-core/{src}/reward/best@{n}"] = s.max(-1).values.mean().item()
        return out

    def _workers(self) -> dict:
        """The checkpointed workers, with all their state on the device (saving and loading read
        and write every tensor)."""
        workers = {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}
        for w in workers.values():
            w.state_offload.reload_all()
        return workers

    def trainer_state(self) -> dict:
        return {"data": self.sampler.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                "world_size": self.world, "layout": dataclasses.asdict(self.layout)}

    def save(self) -> str:
        """``global_step_<step>`` under ``trainer.default_local_dir``, published atomically."""
        from megappo.checkpoint import save_checkpoint

        tr = self.cfg.trainer
        keep = tr.max_actor_ckpt_to_keep or tr.max_critic_ckpt_to_keep  # equal when both set (validate)
        root = os.path.expanduser(tr.default_local_dir)
        hf = {"actor": os.path.expanduser(self.cfg.actor_rollout_ref.model.path)}
        if self.critic is not None:
            hf["critic"] = os.path.expanduser(self.cfg.critic.model.path)
        return save_checkpoint(root, self.step_no, self._workers(), self.trainer_state(),
                               max_to_keep=keep, per_rank_state={**_rng_state(), "inflight": self.inflight},
                               hf_sources=hf)

    def resume(self) -> Optional[str]:
        """Load the checkpoint ``trainer.resume_mode`` asks for; returns its path (None: fresh)."""
        from megappo.checkpoint import CheckpointError, latest_step, load_checkpoint

        tr = self.cfg.trainer
        root = os.path.expanduser(tr.default_local_dir)
        if tr.resume_mode == "disable":
            return None
        if tr.resume_mode == "auto":
            step = latest_step(root)
            if step is None:
                # A run that died before its first checkpoint starts over: drop its metric lines.
                self.logger.truncate_after(-1)
                return None
            path = os.path.join(root, f"global_step_{step}")
        else:
            path = os.path.expanduser(tr.resume_from_path if tr.resume_mode == "resume_path" else tr.resume_mode)
        state, rank_state = load_checkpoint(path, self._workers(), with_rank_state=True)
        try:
            self.sampler.load_state_dict(state["data"])
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"{path}/trainer_state.json: cannot restore the trainer state: {e}") from e
        self.step_no = int(state["step"])
        if rank_state is not None and state.get("world_size") == self.world:
            _set_rng_state(rank_state)
        if self.one_step_off:
            # the generation in flight at the save (the next step's batch) was stored with it:
            # the resumed run trains on exactly what the uninterrupted one trained on
            rank0 = os.path.join(path, "rank_state", "rank_0.pt")
            self.inflight = torch.load(rank0, weights_only=False).get("inflight") if os.path.isfile(rank0) else None
        self.logger.truncate_after(self.step_no)
        if self.rank == 0:
            print(f"resumed from {path} at step {self.step_no}", flush=True)
        return path

    def fit(self, steps: Optional[int] = None) -> list[dict]:
        """Train until ``total_training_steps`` (or ``steps`` more); validate every ``test_freq``
        steps and at the end, checkpoint every ``save_freq`` steps and at the end."""
        tr = self.cfg.trainer
        total = self.total_steps() if steps is None else self.step_no + steps
        self._last_step = total
        history = []
        if self.step_no == 0 and tr.val_before_train and self.val_data is not None:
            val = self.validate()
            self.timer.pop()
            self.logger.log(0, val)
        while self.step_no < total:
            metrics = self.step(log=False)
            last = self.step_no == total
            if tr.test_freq > 0 and (self.step_no % tr.test_freq == 0 or last):
                metrics.update(self.validate())
                metrics.update(self.timer.pop())
            if tr.save_freq > 0 and (self.step_no % tr.save_freq == 0 or last):
                with self.timer("save_checkpoint"):
                    self.save()
                metrics.update(self.timer.pop())
            self.logger.log(self.step_no, metrics)
            history.append(metrics)
        if self.split:
            self.engine.stop()
        self.logger.close()
        return history


def _reward_components(details: list, keys: list) -> dict:
    """name -> (B,) float64: the reward function's per-component scores (gdpo_reward_keys)."""
    from megappo.rewards import RewardFunctionError

    for i, d in enumerate(details):
        missing = [k for k in keys if not (isinstance(d, dict) and k in d)]
        if missing:
            raise RewardFunctionError(f"algorithm.gdpo_reward_keys={list(keys)} needs the reward function to return a "
                                      f"dict with each of them; sample {i} returned {d!r} (missing {missing})")
    return {k: torch.tensor([float(d[k]) for d in details], dtype=torch.float64) for k in keys}


def _acc(details: list, reward_model: bool) -> torch.Tensor:
    """(B,) the reward function's ``acc`` per sample (DAPO's filter metric)."""
    from megappo.rewards import RewardFunctionError

    missing = [i for i, d in enumerate(details) if not (isinstance(d, dict) and "acc" in d)]
    if reward_model or missing:
        raise RewardFunctionError(
            "algorithm.filter_groups.metric=acc needs the reward function to return a dict with 'acc' "
            + ("(a reward model gives scores only)" if reward_model else
               f"(sample {missing[0]} returned {details[missing[0]]!r})") + "; or filter on score / seq_reward")
    return torch.tensor([float(d["acc"]) for d in details], dtype=torch.float64)


def _any_nonfinite(worker) -> torch.Tensor:
    """A 0-d tensor, NaN when any of this rank's weights is NaN/inf after an update (finite
    losses do not prove finite weights: the last optimizer step of a step comes after them)."""
    bad = torch.zeros((), dtype=torch.bool)
    for chunk in worker.chunks:
        for p in chunk.parameters():
            bad |= ~torch.isfinite(p.detach()).all().cpu()
    return torch.tensor(float("nan") if bad else 0.0)


def _max_memory_gb(device: str) -> float:
    """Peak accelerator memory on GPU; on CPU the process's peak resident set (there is no
    allocator counter), so the figure stays comparable between steps of one run."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _rng_state() -> dict:
    import random

    import numpy as np

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def _set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
