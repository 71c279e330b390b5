"""PPOTrainer: one SPMD program per rank; ``step()`` is the algorithm's data flow, phase by phase
(docs/architecture.md). Each phase is a call whose inputs and outputs are visible here: the
generation modes live in :mod:`.generation`, the reward in :mod:`.scoring`, the per-rank passes
in :mod:`.phases`, checkpoints in :mod:`.run_state`, the weight sync in :mod:`megappo.sync`."""
from __future__ import annotations

import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

from megappo import algo, watchdog
from megappo.batch import RolloutBatch
from megappo.config import PPOConfig, to_dict
from megappo.layout import parallel_layout
from megappo.rollout import SamplingConfig

from . import phases, run_state
from .generation import Generation
from .replay import CriticReplay
from .scoring import Scorer
from .setup import set_library_log_level
from .turns import MultiTurnRollout, check_interaction_rows, interaction_runner_of, tool_runner_of
from .validation import dump_rollout, log_records, validate, wants_records

__all__ = ["PPOTrainer"]


class PPOTrainer:
    def __init__(self, cfg: PPOConfig):
        from megatron.core import parallel_state as ps

        from megappo import builders
        from megappo.data import PromptDataset, PromptSampler
        from megappo.distributed import host_dp_group, process_device, split
        from megappo.metrics import CollapseWatch, MetricsLogger, Timer
        from megappo.rewards import load_custom_reward
        from megappo.sync import WeightSync
        from megappo.workers import PassBatching

        self.cfg = cfg
        arr, d, tr = cfg.actor_rollout_ref, cfg.data, cfg.trainer
        set_library_log_level(tr.log_level)
        self.batching = PassBatching.from_config(cfg)
        self.policy_loss, self.value_loss = builders.loss_specs(cfg)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.split = split.current()   # split placement: the rollout ranks (trainer.remote.serve) generate
        self.layout = parallel_layout(cfg, self.split.global_world if self.split else self.world)
        # Host-side collectives over DP (advantages, KL controller, metrics) carry CPU tensors of
        # the batch the trainer keeps on the host: they use megatron's gloo DP group.
        self.dp_group = host_dp_group()
        self.device = process_device(tr.device)
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        builders.import_external_lib(cfg)
        self.tokenizer = builders.load_tokenizer(cfg)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # Data and the reward function first: a bad row or a broken reward file is reported in
        # seconds, before vLLM starts and the models are built.
        crf = cfg.custom_reward_function
        custom_reward = (load_custom_reward(crf.path, crf.name, crf.reward_kwargs,
                                            batched=cfg.reward_model.reward_manager == "batch") if crf.path else None)
        self.tools = tool_runner_of(cfg)   # multi-turn: the tools, built once (None: one turn)
        ds = dict(max_prompt_length=d.max_prompt_length, prompt_key=d.prompt_key,
                  filter_overlong_prompts=d.filter_overlong_prompts, truncation=d.truncation,
                  return_raw_chat=d.return_raw_chat, tools=list(self.tools.schemas.values()) if self.tools else None,
                  chat_template_kwargs=d.apply_chat_template_kwargs)
        ds.update(shuffle=d.shuffle, seed=d.seed)   # which rows *_max_samples keeps: verl's choice
        self.train_data = PromptDataset(d.train_files, self.tokenizer, max_samples=d.train_max_samples, **ds)
        self.val_data = (PromptDataset(d.val_files, self.tokenizer, max_samples=d.val_max_samples, **ds)
                         if d.val_files else None)
        check_interaction_rows(cfg, self.train_data, self.val_data)
        self.last_step = self.total_steps()   # fit() sets the run's last step
        run_state.check_run_dir(cfg)
        if self.split:
            from .remote import RemoteRollout

            self.engine = RemoteRollout(self.split, self.pad_id, lora_rank=builders.engine_lora_rank(cfg))
        else:
            self.engine = builders.build_engine(cfg)   # first: see megappo.builders
        self.info, self.actor = builders.build_actor(cfg, self.device, self.pad_id, self.last_step)
        self.ref = builders.build_reference(cfg, self.device, self.pad_id, self.actor)
        self.critic = builders.build_critic(cfg, self.device, self.pad_id, self.last_step)
        self.reward_model = builders.build_reward_model(cfg, self.device, self.pad_id, self.tokenizer)
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = algo.make_kl_controller({"type": k.type, "kl_coef": k.kl_coef, "target_kl": k.target_kl,
                                                "horizon": k.horizon})
        self.cv_memory = phases.cv_memory(cfg)   # group_cv's beta across steps
        self.critic_replay = CriticReplay(cfg.critic.replay_batches)   # this rank's recent rows for the critic
        self.sampler = PromptSampler(len(self.train_data), d.gen_batch_size or d.train_batch_size, shuffle=d.shuffle,
                                     seed=d.seed, key="data.gen_batch_size" if d.gen_batch_size else "data.train_batch_size")
        self.step_no = 0
        self.n_actor_params: Optional[int] = None   # counted at the first MFU figure
        self.timer = Timer()
        self.collapse_watch = CollapseWatch()
        self.logger = MetricsLogger(tr.logger, os.path.expanduser(tr.default_local_dir), rank=self.rank,
                                    total_steps=self.last_step, project=tr.project_name,
                                    experiment=tr.experiment_name, config=to_dict(cfg))
        turns = (MultiTurnRollout(cfg, self.engine, self.tokenizer, self.tools, self.pad_id, self.rank, self.world,
                                  interaction_runner_of(cfg) if not self.split else None) if self.tools else None)
        self.generation = Generation(cfg, self.engine, self.train_data, self.sampler, self.pad_id, self.rank,
                                     self.world, self.split is not None, self.timer, turns)
        self.scorer = Scorer(cfg, self.tokenizer, custom_reward, self.reward_model, self.batching.reward,
                             self.dp_rows, self.dp_group, self.check, self.timer)
        self.sync = WeightSync(self.actor, self.info.desc, self.engine, others=(self.ref, self.critic),
                               shard_direct=arr.rollout.shard_sync, remote=self.split is not None)
        self.resumed_from = self.resume()
        self.sync.push(self.step_no)

    def total_steps(self) -> int:
        """trainer.total_training_steps, or total_epochs x the prompt batches in one pass over the data
        (batches of data.gen_batch_size with dynamic sampling, as verl's dataloader)."""
        if self.cfg.trainer.total_training_steps:
            return self.cfg.trainer.total_training_steps
        per_epoch = len(self.train_data) // (self.cfg.data.gen_batch_size or self.cfg.data.train_batch_size)
        return max(1, per_epoch * self.cfg.trainer.total_epochs)

    # -- the step ----------------------------------------------------------------------------
    def step(self, log: bool = True) -> dict:
        cfg, t, step, check = self.cfg, self.timer, self.step_no + 1, self.check
        watchdog.set_step(step)
        with t("step"):
            sampling = SamplingConfig.from_config(cfg.actor_rollout_ref.rollout, cfg.data.max_response_length)
            batch, items, reward_metrics = self.rollout_and_reward(step, sampling)
            self.engine.sleep()
            batch.sample_index = torch.arange(len(batch))   # each row keeps its place in the global batch
            local = batch.select(self.dp_rows(batch))       # this DP rank's rows
            with t("old_log_prob"):
                local.old_log_prob, local.sum_pi_squared = phases.old_log_probs(self.actor, local, cfg, self.batching)
            check("old_log_prob", old_log_prob=local.old_log_prob)
            local.rollout_is_weights, local.rollout_rs_mask, metrics = phases.rollout_correction(
                local, cfg, self.dp_group)
            if self.ref is not None:
                with t("ref"):
                    local.ref_log_prob = self.ref.compute_log_prob(local, **self.batching.ref.kwargs())
                self.ref.offload()
                check("ref", ref_log_prob=local.ref_log_prob)
            if self.critic is not None:
                with t("values"):
                    local.values = self.critic.compute_values(local, **self.batching.values.kwargs())
                check("values", values=local.values)
            with t("adv"):
                local.token_level_rewards, local.advantages, local.returns, m = phases.rewards_and_advantages(
                    local, cfg, self.kl_ctrl, self.dp_group, self.cv_memory)
                metrics.update(m)
            check("adv", rewards=local.token_level_rewards, advantages=local.advantages, returns=local.returns)
            if self.critic is not None:
                with t("update_critic"):
                    metrics.update(phases.update_critic(self.critic, local, cfg, self.batching, self.value_loss,
                                                        self.dp, step, self.device, self.critic_replay, self.pad_id))
            if self.step_no >= cfg.trainer.critic_warmup:
                with t("update_actor"):
                    metrics.update(phases.update_actor(self.actor, local, cfg, self.batching, self.policy_loss,
                                                       self.dp, step, self.device))
            with t("sync"):  # also wakes a sleeping engine (its weights were dropped)
                self.generation.collect_in_flight()   # one-step off: the bridge must be free first
                metrics["rollout/sync_bytes"] = float(self.sync.push(step).get("rollout/sync_bytes", 0))
        self.step_no = step
        metrics.update(reward_metrics)
        metrics.update(self.generation.pop_metrics())   # multi-turn: turns and tool calls
        metrics = phases.step_metrics(step, metrics, batch, local, cfg, self.dp_group, t, self.layout.world_size,
                                      self.generation.lag if self.split else None, self.train_data.num_filtered,
                                      self.actor_params)
        warning = self.collapse_watch.update(metrics)
        if warning and self.rank == 0:
            print(f"step {step}: WARNING: {warning}", file=sys.stderr, flush=True)
        if log:
            self.logger.log(step, metrics)
        return metrics

    def rollout_and_reward(self, step: int, sampling) -> tuple[RolloutBatch, list, dict]:
        """The step's global batch, scored, on every rank: generate then score, or DAPO's rounds
        of generate -> score -> keep the varied groups (algorithm.filter_groups)."""
        if self.cfg.algorithm.filter_groups.enable:
            batch, items, reward_metrics = self.generation.dynamic_rounds(
                self.step_no, sampling, self.scorer, wake=lambda: self.sync.push(self.step_no))
            details = self.generation.reward_details
        else:
            batch, items = self.generation.generate(self.step_no, sampling, self.last_step)
            self.engine.sleep()   # the reward model and the trainer's passes need the memory
            scores = self.scorer(batch, items)
            batch.token_level_scores, batch.reward_components = scores.token_level, scores.components
            reward_metrics, details = scores.metrics, scores.details
        dump_rollout(self.cfg, self.rank, self.tokenizer, step, batch, items, details, self.timer)
        return batch, items, reward_metrics

    def dp_rows(self, batch: RolloutBatch) -> list[int]:
        """This DP rank's rows of a global batch (balanced per actor mini-batch)."""
        return phases.dp_rows(batch, self.cfg, self.batching, self.dp, self.dp_rank)

    def check(self, stage: str, **tensors) -> None:
        """Collective: a NaN/inf on any rank after ``stage`` stops every rank (phases.check_finite)."""
        phases.check_finite(self.step_no + 1, self.device, stage, **tensors)

    def actor_params(self) -> int:
        """Parameters of the whole actor (summed over its TP x PP shards), counted once."""
        if self.n_actor_params is None:
            from megatron.core import parallel_state as ps

            n = torch.tensor([float(sum(p.numel() for c in self.actor.chunks for p in c.parameters()))],
                             device=self.device)
            dist.all_reduce(n, group=ps.get_model_parallel_group())
            self.n_actor_params = int(n.item())
        return self.n_actor_params

    # -- validation, checkpoints, the loop ---------------------------------------------------
    def validate(self) -> dict:
        records = [] if wants_records(self.cfg, self.logger, self.rank) else None   # decoded where they go
        out = validate(self.cfg, self.val_data, self.generation, self.scorer, self.engine, self.timer, self.step_no,
                       records)
        log_records(self.cfg, self.logger, self.rank, self.step_no, records)
        return out

    def algo_state(self) -> dict:
        return {"kl_ctrl": self.kl_ctrl, "gae_cv": self.cv_memory}

    def save(self) -> str:
        return run_state.save(self.cfg, self.step_no, run_state.checkpointed_workers(self.actor, self.critic),
                              self.sampler, self.algo_state(), self.world, self.layout, self.generation.inflight,
                              self.critic_replay)

    def resume(self) -> Optional[str]:
        """Load the checkpoint ``trainer.resume_mode`` asks for; returns its path (None: fresh)."""
        r = run_state.resume(self.cfg, lambda: run_state.checkpointed_workers(self.actor, self.critic), self.sampler,
                             self.algo_state(), self.logger, self.world, self.generation.one_step_off,
                             self.critic_replay, self.layout)
        if r.path is not None:
            self.step_no, self.generation.inflight = r.step, r.inflight
            if self.rank == 0:
                print(f"resumed from {r.path} at step {self.step_no}", flush=True)
        return r.path

    def fit(self, steps: Optional[int] = None) -> list[dict]:
        """Train until ``total_training_steps`` (or ``steps`` more); validate every ``test_freq``
        steps and at the end, checkpoint every ``save_freq`` steps and at the end."""
        tr = self.cfg.trainer
        self.last_step = self.total_steps() if steps is None else self.step_no + steps
        history = []
        if tr.val_only:   # the checkpoint resumed from (or the start), validated; nothing trained
            self.logger.log(self.step_no, {**self.validate(), **self.timer.pop()})
            self.last_step = self.step_no
        elif self.step_no == 0 and tr.val_before_train and self.val_data is not None:
            val = self.validate()
            self.timer.pop()
            self.logger.log(0, val)
        while self.step_no < self.last_step:
            metrics = self.step(log=False)
            last = self.step_no == self.last_step
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
        self.scorer.close()
        self.logger.close()
        watchdog.stop()   # the others may still be tearing down: this rank's silence is no fault now
        return history
