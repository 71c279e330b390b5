"""The split placement's rollout: the rollout ranks serve generation and weight loads; the training
ranks hold a :class:`RemoteRollout` in place of a local engine.

Protocol (over :mod:`megappo.distributed.split`'s bridge; global rank 0 speaks for the training
ranks): every request is a command the rollout ranks execute in order. GENERATE carries the
prompts and sampling settings; each replica generates its slice of the prompts (the seed of every
prompt is a function of its place in the batch, as in the colocated rollout: the samples do not
depend on the number of replicas), the outputs are gathered over the rollout group and the first
rollout rank sends them back. GENERATE_TURNS is the same for multi-turn rollouts with tools: the
rollout ranks run the turn loop and the tools (:meth:`MultiTurnRollout.generate`) and send back
the samples, their prompt indices and the turn metrics. WEIGHTS is followed by one versioned
weight transfer. LORA (a LoRA actor whose adapters the engines serve) carries the adapters'
rank, alpha, modules and policy version and is followed by one versioned transfer of the
adapters (PEFT names), which each rollout rank's engine serves from then on; the base went once,
by WEIGHTS. STOP ends the service. The training side may leave one generation in flight (one-step off-policy): it must be
collected before the next command, since the bridge's messages are matched in order.
"""
from __future__ import annotations

import copy
from typing import Optional

from megappo import watchdog
from megappo.distributed import split
from megappo.rollout import RolloutOutput, SamplingConfig

__all__ = ["RemoteRollout", "serve"]

GENERATE, WEIGHTS, STOP, RESET_PREFIX_CACHE, GENERATE_TURNS, LORA = 1, 2, 3, 4, 5, 6


class RemoteRollout:
    """What the trainer asks of its engine, done by the rollout ranks. Every training rank calls
    every method (weight gathers are collective over them; every rank gets the outputs)."""

    def __init__(self, groups, pad_token_id: int, lora_rank: int = 0):
        self.groups = groups
        self.pad_token_id = pad_token_id
        # the rank of the adapters the rollout ranks' engines serve (megappo.builders.engine_lora_rank
        # of the same configuration); 0: they take full (for a LoRA actor: merged) weights
        self.lora_rank = lora_rank
        self.asleep = False                  # the rollout ranks' engines never sleep
        self.transfers = 0                   # weight transfers sent (the bridge's version numbers)
        self.policy_version: Optional[int] = None   # trainer step whose weights the rollout ranks hold
        self.pending: Optional[int] = None   # policy version of a requested, uncollected generation

    def sleep(self) -> None:
        pass

    def sync_weights(self, named, policy_version: int) -> dict:
        """The actor's full HF tensors (every training rank iterates its own ``named``) to the
        rollout ranks, as the weights of trainer step ``policy_version``."""
        self._idle("send weights")
        self.transfers += 1
        if self.groups.is_sender:
            split.send_command(self.groups, WEIGHTS, self.transfers)
        out = split.send_weights(self.groups, named, self.transfers)
        self.policy_version = policy_version
        return out

    def sync_lora(self, tensors: dict, rank: int, alpha: float, modules, version: int) -> dict:
        """The actor's adapters (full PEFT-named tensors, on every training rank) to the rollout
        ranks, whose engines serve them from then on as the weights of trainer step ``version``."""
        self._idle("send adapters")
        if not self.lora_rank:
            raise RuntimeError("RemoteRollout: the rollout ranks' engines were started without LoRA (lora_rank=0): "
                               "they take merged weights, not adapters")
        self.transfers += 1
        if self.groups.is_sender:
            split.send_command(self.groups, LORA, {"transfer": self.transfers, "rank": int(rank), "alpha": float(alpha),
                                                   "modules": list(modules), "version": int(version)})
        out = split.send_weights(self.groups, sorted(tensors.items()), self.transfers)
        self.policy_version = version
        return out

    def request(self, prompts: list, sampling: SamplingConfig) -> None:
        """Start generating (``sampling.seed``: the seed of the batch's first prompt); collect()
        returns the outputs. The rollout ranks use the last weights sent."""
        self._idle("request a generation")
        if self.policy_version is None:
            raise RuntimeError("RemoteRollout: no weights were sent to the rollout ranks yet")
        if self.groups.is_sender:
            split.send_command(self.groups, GENERATE, {"prompts": [list(map(int, p)) for p in prompts],
                                                 "sampling": copy.copy(sampling)})
        self.pending = self.policy_version

    def request_turns(self, prompts: list, tools_kwargs: list, sampling: SamplingConfig,
                      contexts: Optional[list] = None) -> None:
        """As :meth:`request`, for conversations with tool turns (``tools_kwargs``: each prompt's
        tools' create kwargs; ``contexts``: each prompt's messages and interaction_kwargs, with
        interactions); collect() returns (samples, their prompt indices, turn metrics)."""
        self._idle("request a generation")
        if self.policy_version is None:
            raise RuntimeError("RemoteRollout: no weights were sent to the rollout ranks yet")
        if self.groups.is_sender:
            split.send_command(self.groups, GENERATE_TURNS, {"prompts": [list(map(int, p)) for p in prompts],
                                                             "tools_kwargs": tools_kwargs, "sampling": copy.copy(sampling),
                                                             "contexts": contexts})
        self.pending = self.policy_version

    def generate_turns(self, prompts: list, tools_kwargs: list, sampling: SamplingConfig,
                       contexts: Optional[list] = None) -> tuple:
        self.request_turns(prompts, tools_kwargs, sampling, contexts)
        return self.collect()[0]

    def collect(self) -> tuple[RolloutOutput, int]:
        """(outputs of the requested generation in prompt order, the policy version that made them)."""
        if self.pending is None:
            raise RuntimeError("RemoteRollout.collect: no generation was requested")
        out = split.receive_object(self.groups)
        version, self.pending = self.pending, None
        return out, version

    def generate(self, prompts: list, sampling: SamplingConfig) -> RolloutOutput:
        self.request(prompts, sampling)
        return self.collect()[0]

    def reset_prefix_cache(self) -> None:
        self._idle("reset the prefix cache")
        if self.groups.is_sender:
            split.send_command(self.groups, RESET_PREFIX_CACHE)

    def stop(self) -> None:
        self._idle("stop the rollout ranks")
        if self.groups.is_sender:
            split.send_command(self.groups, STOP)
            split.close_bridge(self.groups)

    def _idle(self, what: str) -> None:
        if self.pending is not None:
            raise RuntimeError(f"RemoteRollout: cannot {what} while a generation is in flight (collect it first: "
                               "the bridge's messages are matched in order)")


def serve(cfg, groups) -> None:
    """The rollout ranks' program: one engine per rank (replicas of rollout TP ranks over the
    rollout group), commands executed until STOP."""
    from megappo import builders

    builders.import_external_lib(cfg)
    engine = builders.build_engine(cfg)
    rtp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    turns = _turns(cfg, engine, groups)
    op = None
    while op != STOP:
        with watchdog.phase("rollout_wait"):   # a silent rollout rank is named with what it was doing
            op, obj = split.receive_command(groups)
        with watchdog.phase(_PHASES.get(op, "rollout_command")):
            _serve_one(op, obj, engine, groups, rtp, turns)


def _turns(cfg, engine, groups):
    """multi_turn.enable: the turn loop over this rank's engine, with the tools built here (they
    run where the engine is); else None."""
    from megappo import builders

    from .turns import MultiTurnRollout, interaction_runner_of, tool_runner_of

    runner = tool_runner_of(cfg)
    if runner is None:
        return None
    tokenizer = builders.load_tokenizer(cfg)
    return MultiTurnRollout(cfg, engine, tokenizer, runner, engine.pad_token_id, groups.role_rank, groups.role_world,
                            interaction_runner_of(cfg))


_PHASES = {WEIGHTS: "rollout_weights", LORA: "rollout_weights", GENERATE: "rollout_generate", GENERATE_TURNS: "rollout_generate"}


def _serve_one(op, obj, engine, groups, rtp, turns=None) -> None:
    from megappo.rollout import generate_replicated

    if op == WEIGHTS:
        _, buckets = split.receive_weights(groups, expected_version=obj)
        engine.sync_weights(p for b in buckets for p in b)
    elif op == LORA:
        _, buckets = split.receive_weights(groups, expected_version=obj["transfer"])
        tensors = dict(p for b in buckets for p in b)
        engine.sync_lora(tensors, obj["rank"], obj["alpha"], obj["modules"], obj["version"])
    elif op == GENERATE:
        out = generate_replicated(engine, obj["prompts"], obj["sampling"], groups.role_rank, groups.role_world, rtp)
        if groups.bridge_rank == 1:
            split.send_object(groups, out)
    elif op == GENERATE_TURNS:
        if turns is None:
            raise RuntimeError(f"rollout rank {groups.global_rank}: asked for tool turns, but multi_turn.enable is "
                               f"false in its configuration")
        out = turns.generate(obj["prompts"], obj["tools_kwargs"], obj["sampling"], groups.role_rank, groups.role_world,
                             obj.get("contexts"))
        if groups.bridge_rank == 1:
            split.send_object(groups, out)
    elif op == RESET_PREFIX_CACHE:
        engine.reset_prefix_cache()
    elif op == STOP:
        watchdog.stop()
        split.close_bridge(groups)
        engine.shutdown()
    else:
        raise RuntimeError(f"rollout rank {groups.global_rank}: unknown command {op} "
                           f"(weights version {groups.weights_version_received})")
