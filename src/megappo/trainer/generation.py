"""This step's samples, in one of three modes: generated now on the colocated engine (or the split
placement's rollout ranks), taken from the generation left in flight during the last step
(one-step off-policy), or DAPO's dynamic sampling (rounds of generate -> score -> keep the groups
whose scores vary). Every rank holds the whole (global) batch. With multi_turn.enable the engine
(colocated, or the split placement's rollout ranks) generates conversations with tool turns
(:mod:`.turns`).

Seeds: each prompt samples from its own seed, a function of (data seed, step, salt, place in the
batch) (:mod:`megappo.seeds`): the samples do not depend on how prompts are split over replicas,
and a resumed run draws exactly what the uninterrupted one drew.
"""
from __future__ import annotations

import copy
from typing import Callable, Optional

import torch

from megappo import algo, seeds
from megappo.batch import RolloutBatch

__all__ = ["Generation"]


class Generation:
    def __init__(self, cfg, engine, train_data, sampler, pad_id: int, rank: int, world: int, split: bool, timer,
                 turns=None):
        self.cfg, self.engine, self.train_data, self.sampler = cfg, engine, train_data, sampler
        self.pad_id, self.rank, self.world, self.split, self.timer = pad_id, rank, world, split, timer
        self.turns = turns     # a MultiTurnRollout (multi_turn.enable), else None
        self.turn_metrics: dict = {}   # the last multi-turn rollout's (turns, tool calls)
        self.turn_samples: list = []   # and its samples (MultiTurnSample), one per row of its batch
        self.one_step_off = cfg.trainer.async_mode == "one_step_off"
        self.inflight = None   # one-step off: the next step's generation (prompt indices, outputs, policy version)
        self.next_indices: Optional[list] = None   # prompts of the generation in flight
        self.lag = 0           # steps between the policy that generated the batch and the one it trains

    def sampling(self, sampling, salt: int, first: int, step: int):
        """``sampling`` seeded for a batch whose first prompt has index ``first`` (in the step's or
        the validation set's order) at trainer step ``step``."""
        sampling.seed = seeds.prompt_seed(seeds.batch_seed(self.cfg.data.seed, step, salt), first, sampling.n)
        return sampling

    def rollout(self, items, sampling, step: int, salt: int = seeds.TRAIN, offset: int = 0) -> tuple[RolloutBatch, list]:
        """Generate ``items`` on this rank's rollout replica (or the rollout ranks), gather every
        replica's samples on every rank."""
        sampling = self.sampling(sampling, salt, offset, step)
        if self.turns is not None:   # conversations with tool turns, each replica its prompts' samples
            batch, items, self.turn_metrics, self.turn_samples = self.turns.rollout(items, sampling, self.rank,
                                                                                     self.world)
            return batch, items
        prompts = [it.prompt_ids for it in items]
        if self.split:   # the rollout ranks generate (each replica its slice, seeded the same way)
            return self.assemble(items, self.engine.generate(prompts, sampling))
        from megappo.rollout import generate_replicated

        rtp = self.cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
        return self.assemble(items, generate_replicated(self.engine, prompts, sampling, self.rank, self.world, rtp))

    def assemble(self, items, out) -> tuple[RolloutBatch, list]:
        """The RolloutBatch of gathered engine outputs (prompt order) and their items."""
        prompts = [items[i].prompt_ids for i in out.prompt_index.tolist()]
        batch = RolloutBatch.from_prompts_and_responses(prompts, out.responses, out.response_mask, self.pad_id,
                                                        prompt_index=out.prompt_index,
                                                        rollout_log_probs=out.rollout_log_probs)
        return batch, [items[i] for i in out.prompt_index.tolist()]

    def generate(self, step: int, sampling, last_step: int) -> tuple[RolloutBatch, list]:
        """The step's batch: the one left in flight (one-step off), or generated now; with
        one-step off the next step's generation starts before this returns."""
        if self.inflight is not None:   # generated during the last step, with the weights before it
            indices, out, version = self.inflight
            self.inflight = None
            items = [self.train_data[i] for i in indices]
            if self.turns is not None:   # (samples, prompt indices, turn metrics) of conversations
                batch, items, self.turn_metrics, self.turn_samples = self.turns.assemble(items, out)
            else:
                batch, items = self.assemble(items, out)
            self.lag = step - version
        else:
            items = [self.train_data[i] for i in self.sampler.next_batch()]
            with self.timer("gen"):
                batch, items = self.rollout(items, sampling, step)
            self.lag = 0
        if self.one_step_off and step + 1 < last_step:
            self.request_next(sampling, step + 1)
        return batch, items

    def pop_metrics(self) -> dict:
        """The last rollout's multi-turn metrics (empty for one-turn rollouts), once."""
        out, self.turn_metrics = self.turn_metrics, {}
        return out

    def request_next(self, sampling, step: int) -> None:
        """One-step off-policy: the rollout ranks start generating step ``step``'s prompts (with
        the weights they hold, the predecessor of the policy being trained now), seeded as that
        step would seed them."""
        self.next_indices = self.sampler.next_batch()
        items = [self.train_data[i] for i in self.next_indices]
        seeded = self.sampling(copy.copy(sampling), seeds.TRAIN, 0, step)
        if self.turns is not None:
            prompts, kwargs, contexts = self.turns.inputs(items)
            self.engine.request_turns(prompts, kwargs, seeded, contexts)
        else:
            self.engine.request([it.prompt_ids for it in items], seeded)

    def collect_in_flight(self) -> None:
        """Receive the generation in flight, if any: the bridge must be free before new weights go
        to the rollout ranks (its messages are matched in order)."""
        if self.split and self.engine.pending is not None:
            out, version = self.engine.collect()
            self.inflight = (self.next_indices, out, version)

    def dynamic_rounds(self, step: int, sampling, score: Callable, wake: Callable) -> tuple[RolloutBatch, list, dict]:
        """DAPO's dynamic sampling (algorithm.filter_groups): rounds of data.gen_batch_size
        prompts are generated and scored (``score(batch, items)`` -> :class:`Scores`), groups whose
        metric does not vary are dropped, until data.train_batch_size prompts are kept (the last
        round's surplus is dropped too). ``wake()`` syncs the weights into an engine that dropped
        them for the reward model. Returns the kept batch (scored), its items and the metrics.

        With tool turns each round is a multi-turn rollout (its own seeds, each row's tools_kwargs);
        the kept rows keep their ``sequence_mask`` and items. The turn metrics then describe the
        kept samples, as ``response_length/*`` and ``critic/score/*`` do, while the tool runner's
        counts and seconds (``tools/*``) add up over every round: the tool work the step did."""
        fg = self.cfg.algorithm.filter_groups
        want, kept, kept_items, n_kept, n_prompts, rounds = self.cfg.data.train_batch_size, [], [], 0, 0, 0
        generated_scores, metrics = [], {}
        round_turn_metrics, kept_samples = [], []   # multi-turn: each round's, and the kept rows' samples
        self.reward_details = []                     # what the reward function returned for each kept row
        while n_kept < want:
            if fg.max_num_gen_batches > 0 and rounds >= fg.max_num_gen_batches:
                raise RuntimeError(
                    f"step {step + 1}: {rounds} generation rounds kept {n_kept} of data.train_batch_size="
                    f"{want} prompts (algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches}): almost "
                    f"every group scores the same {fg.metric}; check the data and the reward, or raise the limit")
            if self.engine.asleep:  # a reward model ran: the engine dropped its weights for it
                wake()
            items = [self.train_data[i] for i in self.sampler.next_batch()]
            with self.timer("gen"):
                batch, its = self.rollout(items, sampling, step, salt=seeds.dynamic_round_salt(rounds))
            if self.cfg.reward_model.enable:
                self.engine.sleep()
            scores = score(batch, its)
            batch.token_level_scores, batch.reward_components = scores.token_level, scores.components
            for k, v in scores.metrics.items():   # prime's failure counts add up over the rounds
                metrics[k] = metrics.get(k, 0.0) + v if k in ("reward/failed", "reward/timed_out") else v
            generated_scores.append(scores.per_sample["seq_reward"])
            rows = torch.nonzero(algo.informative_groups(scores.per_sample[fg.metric], batch.prompt_index)).squeeze(-1)
            groups = torch.unique_consecutive(batch.prompt_index[rows])[:want - n_kept]
            rows = rows[torch.isin(batch.prompt_index[rows], groups)]
            part = batch.select(rows)
            part.prompt_index = n_kept + torch.searchsorted(groups, part.prompt_index)  # groups 0..want-1
            kept.append(part)
            kept_items += [its[i] for i in rows.tolist()]
            self.reward_details += [scores.details[i] if scores.details else None for i in rows.tolist()]
            if self.turns is not None:
                round_turn_metrics.append(self.turn_metrics)
                kept_samples += [self.turn_samples[i] for i in rows.tolist()]
            n_kept += len(groups)
            n_prompts += len(items)
            rounds += 1
        # critic/score/* describe the kept (filtered) batch; this is the policy's score on all it generated
        metrics.update({"train/num_gen_batches": float(rounds), "train/kept_prompt_fraction": n_kept / n_prompts,
                        "train/generated_score_mean": float(torch.cat(generated_scores).mean())})
        if self.turns is not None:
            from .turns import merge_turn_metrics

            self.turn_metrics, self.turn_samples = merge_turn_metrics(round_turn_metrics, kept_samples), kept_samples
        return RolloutBatch.concat(kept, self.pad_id), kept_items, metrics
