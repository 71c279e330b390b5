"""Multi-turn rollouts with tools in the trainer (``actor_rollout_ref.rollout.multi_turn.enable``):
each rollout replica runs :func:`megappo.rollout.multi_turn_generate` over its prompts' samples on
the colocated engine, and every rank assembles the whole batch.

- Seeds: sample ``c`` of prompt ``i`` has the seed a one-turn rollout gives it
  (``prompt_seed(first, i, n) + c``); its turn ``k`` samples with ``seeds.turn_seed`` of it, so a
  resumed run draws what the uninterrupted one drew, however prompts are split over replicas.
- The batch: tool turns are in the sequence (``sequence_mask``) and out of ``response_mask``;
  the engine's log-probs on model tokens, 0 on tool tokens.
- The reward function gets what verl's reward managers pass: ``extra_info["num_turns"]`` and
  ``extra_info["rollout_reward_scores"]`` (here each used tool's ``calc_reward``), and also
  ``extra_info["tool_rewards"]`` (the ``execute`` step rewards, verl's ``tool_rewards`` field).
  As in verl, none of them is added to the score: the reward function decides. A reward model
  reads the conversation's token ids, tool turns included, and scores its last model token
  (:class:`megappo.workers.RewardModel`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from megappo.batch import RolloutBatch
from megappo.seeds import prompt_seed

__all__ = ["MultiTurnRollout", "ReplicaTools", "replica_tools", "tool_runner_of", "interaction_runner_of",
           "check_interaction_rows", "merge_turn_metrics"]


def tool_runner_of(cfg):
    """The tool runner ``rollout.multi_turn`` describes (its tools built once), or None for one-turn runs."""
    from megappo.rollout import tool_runner

    mt = cfg.actor_rollout_ref.rollout.multi_turn
    return tool_runner(mt) if mt.enable else None


def interaction_runner_of(cfg):
    """The interactions ``rollout.multi_turn.interaction_config_path`` names (built once), or None."""
    from megappo.tools import InteractionRunner, load_interactions

    mt = cfg.actor_rollout_ref.rollout.multi_turn
    return InteractionRunner(load_interactions(mt.interaction_config_path)) if mt.enable and mt.interaction_config_path \
        else None


def check_interaction_rows(cfg, *datasets) -> None:
    """With interactions, every row of ``datasets`` names one (extra_info.interaction_kwargs.name):
    checked at start, before any work, naming the first row that does not."""
    from megappo.tools import interaction_kwargs_of, read_interaction_config

    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not (mt.enable and mt.interaction_config_path):
        return
    names = [s.name for s in read_interaction_config(mt.interaction_config_path)]
    for data in datasets:
        for it in (data or []):
            interaction_kwargs_of(it.extra_info, names, it.origin)


class ReplicaTools:
    """The tools (or interactions) of a rollout replica over several ranks (rollout TP > 1): the
    replica's first rank runs every call and each of its ranks gets that rank's answers, so all of
    them feed the engine the same prompts. Answers may differ between two runs of a call (a
    timeout, a tool or simulated user with state or randomness), and ranks fed different prompts
    would desynchronise the engine. Collective over ``group``: the loop calls it on every rank in
    the same order."""

    def __init__(self, runner, group, leader: int, is_leader: bool):
        self.runner, self.group, self.leader, self.is_leader = runner, group, leader, is_leader

    def _shared(self, fn):
        box = [fn() if self.is_leader else None]
        dist.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]

    def run_turn(self, samples: list, calls: list, tools_kwargs=None) -> list:
        return self._shared(lambda: self.runner.run_turn(samples, calls, tools_kwargs))

    def pop_metrics(self) -> dict:
        return self._shared(self.runner.pop_metrics)

    def finish_all(self, samples: list):   # one broadcast for the whole rollout
        return self._shared(lambda: self.runner.finish_all(samples))

    # an InteractionRunner's: its instances live on the leader
    def start_all(self, samples: list, kwargs: list) -> None:
        return self._shared(lambda: self.runner.start_all(samples, kwargs))

    def respond(self, samples: list, messages: list) -> list:
        return self._shared(lambda: self.runner.respond(samples, messages))


def replica_tools(runner, rank: int, world: int, rollout_tp: int):
    """``runner`` as this rank's replica uses it: itself for one-rank replicas (or None), else a
    :class:`ReplicaTools` over the replica's ranks. Collective over the world (every rank
    creates every replica's group, in order)."""
    if rollout_tp == 1 or runner is None:
        return runner
    mine = None
    for first in range(0, world, rollout_tp):
        group = dist.new_group(list(range(first, first + rollout_tp)), backend="gloo")
        if first <= rank < first + rollout_tp:
            mine = ReplicaTools(runner, group, first, rank == first)
    return mine


class MultiTurnRollout:
    """``rollout(items, sampling, rank, world)`` -> (batch, one item per sample, metrics, the
    samples in batch order). The conversations are generated here (:meth:`generate`, on the
    colocated engine), or, for the split placement, by the rollout ranks (``engine`` is a
    :class:`~megappo.trainer.remote.RemoteRollout`; they run :meth:`generate` on theirs)."""

    def __init__(self, cfg, engine, tokenizer, runner, pad_id: int, rank: int = 0, world: int = 1,
                 interactions=None):
        from megappo.rollout import ToolTurnTokens, loop_settings
        from megappo.tools import read_interaction_config

        self.cfg, self.engine, self.pad_id = cfg, engine, pad_id
        path = cfg.actor_rollout_ref.rollout.multi_turn.interaction_config_path
        self.interaction_names = [s.name for s in read_interaction_config(path)] if path else None
        self.remote = hasattr(engine, "generate_turns")
        if self.remote:   # the rollout ranks hold the engine and run the tools and interactions
            return
        rtp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
        self.runner = replica_tools(runner, rank, world, rtp)
        self.interactions = replica_tools(interactions, rank, world, rtp)
        self.loop = loop_settings(cfg.actor_rollout_ref.rollout.multi_turn)
        roles = (("tool",) if getattr(runner, "schemas", None) else ()) + (("user",) if path else ())
        self.tool_turn = ToolTurnTokens(tokenizer, engine.eos_token_ids, cfg.data.apply_chat_template_kwargs,
                                        roles=roles or ("tool",))
        # the parser reads the model's text as the template wrote it (<tool_call> may be a special
        # token); an interaction reads it as verl decodes it for its messages, without special tokens
        self.decode = lambda ids, skip_special_tokens=False: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def inputs(self, items: list) -> tuple[list, list, Optional[list]]:
        """What the turn loop needs of the prompts: their token ids, each row's tools_kwargs, and
        (with interactions) each prompt's chat messages and interaction_kwargs, checked."""
        from megappo.tools import interaction_kwargs_of, tools_kwargs_of

        contexts = None
        if self.interaction_names is not None:   # what each prompt's interaction reads
            contexts = [{"messages": it.raw_chat,
                         "interaction_kwargs": interaction_kwargs_of(it.extra_info, self.interaction_names, it.origin)}
                        for it in items]
        return [it.prompt_ids for it in items], [tools_kwargs_of(it.extra_info, it.origin) for it in items], contexts

    def rollout(self, items: list, sampling, rank: int, world: int) -> tuple[RolloutBatch, list, dict, list]:
        prompts, kwargs, contexts = self.inputs(items)
        if self.remote:
            out = self.engine.generate_turns(prompts, kwargs, sampling, contexts)
        else:
            out = self.generate(prompts, kwargs, sampling, rank, world, contexts)
        return self.assemble(items, out)

    def assemble(self, items: list, out: tuple) -> tuple[RolloutBatch, list, dict, list]:
        """The batch, items and metrics of :meth:`generate`'s ``(samples, index, metrics)``."""
        samples, index, metrics = out
        return self.batch(samples, items, index), [with_turns(items[i], s) for i, s in zip(index, samples)], metrics, samples

    def generate(self, prompts: list, tools_kwargs: list, sampling, rank: int, world: int,
                 contexts: Optional[list] = None) -> tuple[list, list, dict]:
        """Every sample's conversation, each replica its prompts' (``rank``, ``world``: of the
        engine-holding ranks, whose default group this gathers over); ``contexts``: each prompt's
        chat messages and interaction_kwargs, with interactions. Returns (samples in prompt order,
        each sample's prompt index, the merged turn metrics) on every rank."""
        from megappo.rollout import VLLMTurns, multi_turn_generate, prompt_slice, rollout_replica

        rtp = self.cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
        replica, n_rep = rollout_replica(rank, world, rtp)
        sl = prompt_slice(len(prompts), replica, n_rep)
        n = sampling.n
        mine = [(i, c) for i in range(sl.start, sl.stop) for c in range(n)]
        seeds = None if sampling.seed is None else [prompt_seed(sampling.seed, i, n) + c for i, c in mine]
        samples, metrics = multi_turn_generate(
            VLLMTurns(self.engine, sampling), [prompts[i] for i, _ in mine], runner=self.runner,
            decode=self.decode, tool_turn=self.tool_turn, max_response_length=sampling.max_tokens,
            tools_kwargs=[tools_kwargs[i] for i, _ in mine], seeds=seeds, **self.loop,
            **({} if contexts is None else dict(
                interactions=self.interactions, messages=[contexts[i]["messages"] for i, _ in mine],
                interaction_kwargs=[contexts[i]["interaction_kwargs"] for i, _ in mine])))
        parts = [(sl.start, samples, metrics)]
        if world > 1:
            parts = [None] * world
            dist.all_gather_object(parts, (sl.start, samples, metrics))
            parts = sorted((parts[r * rtp] for r in range(n_rep)), key=lambda p: p[0])   # one per replica, prompt order
        samples = [s for _, ss, _ in parts for s in ss]
        index = [i for start, ss, _ in parts for i in range(start, start + len(ss) // n) for _ in range(n)]
        return samples, index, merge_turn_metrics([m for _, _, m in parts], samples)

    def batch(self, samples: list, items: list, index: list[int]) -> RolloutBatch:
        """The samples as a RolloutBatch: prompt order, tool turns in the sequence only."""
        T = max(1, max(len(s.response_ids) for s in samples))
        B = len(samples)
        responses = torch.full((B, T), self.pad_id, dtype=torch.long)
        model, seq, logp = torch.zeros(B, T), torch.zeros(B, T), torch.zeros(B, T)
        for j, s in enumerate(samples):
            k = len(s.response_ids)
            responses[j, :k] = torch.tensor(s.response_ids, dtype=torch.long)
            model[j, :k] = torch.tensor(s.response_mask, dtype=torch.float)
            seq[j, :k] = 1.0
            logp[j, :k] = torch.tensor(s.logprobs, dtype=torch.float)
        return RolloutBatch.from_prompts_and_responses([items[i].prompt_ids for i in index], responses, model,
                                                       self.pad_id, prompt_index=torch.tensor(index, dtype=torch.long),
                                                       rollout_log_probs=logp * model, sequence_mask=seq)


def with_turns(item, sample):
    """The sample's own copy of its prompt's item, with what its turns tell the reward function."""
    extra = dict(item.extra_info, num_turns=sample.num_turns, rollout_reward_scores=dict(sample.tool_rewards),
                 tool_rewards=list(sample.step_rewards), turn_scores=list(sample.turn_scores))
    return dataclasses.replace(item, extra_info=extra)


def merge_turn_metrics(parts: list[dict], samples: list) -> dict:
    """One step's metrics from several rollouts' (every replica's, or DAPO's rounds): the tool
    runners' and interactions' counts and seconds add up (the slowest call is the slowest of all), the per-sample
    figures are over ``samples``."""
    from megappo.rollout import sample_metrics

    out: dict[str, float] = {}
    for m in parts:
        for k, v in m.items():
            if k == "tools/max_call_seconds":
                out[k] = max(out.get(k, 0.0), v)
            elif k.startswith(("tools/", "interaction/")):
                out[k] = out.get(k, 0.0) + v
    out.update(sample_metrics(samples))
    return out
