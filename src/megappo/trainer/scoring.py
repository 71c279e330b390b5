"""The reward step: every sample of the global batch scored by the rule or custom reward function
(spread over the ranks, assembled on every rank; verl's prime manager: in worker processes with a
time limit) or by the reward model (each DP rank its rows, assembled on every rank), then shaped
(DAPO's overlong penalty)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megappo import algo, watchdog
from megappo.batch import RolloutBatch

__all__ = ["Scores", "Scorer"]


@dataclass
class Scores:
    token_level: torch.Tensor     # (B, T) each response's reward on its last token, after shaping
    per_sample: dict              # name -> (B,): score, seq_reward, seq_final_reward (and acc): what filters read
    components: Optional[dict]    # name -> (B,) the reward function's components (algorithm.gdpo_reward_keys)
    metrics: dict                 # the shaping's metrics (and prime's failed / timed-out counts)
    details: Optional[list] = None  # per sample, what the reward function returned (a dict, or None)


class Scorer:
    """``scorer(batch, items)`` -> :class:`Scores`. ``rows(batch)``: this DP rank's rows of a
    global batch (the reward model scores those); ``check_finite(stage, **tensors)``: the
    trainer's collective finiteness check."""

    def __init__(self, cfg, tokenizer, custom_reward, reward_model, reward_batching, rows: Callable, dp_group,
                 check_finite: Callable, timer):
        from megappo.distributed import host_world_group
        from megappo.rewards import RewardPool, default_workers

        self.cfg, self.tokenizer, self.custom_reward, self.reward_model = cfg, tokenizer, custom_reward, reward_model
        self.reward_batching, self.rows, self.dp_group = reward_batching, rows, dp_group
        self.check_finite, self.timer = check_finite, timer
        self.group = host_world_group()   # the rule rewards are spread over every rank of it
        rm, crf = cfg.reward_model, cfg.custom_reward_function
        self.pool = (RewardPool(rm.prime_workers or default_workers(), rm.prime_timeout_s,
                                (crf.path, crf.name, crf.reward_kwargs) if crf.path else None)
                     if rm.reward_manager == "prime" and reward_model is None else None)

    def close(self) -> None:
        """Stop the reward workers (prime)."""
        if self.pool is not None:
            self.pool.close()

    def rule_scores(self, batch: RolloutBatch, items, details: Optional[list] = None,
                    metrics: Optional[dict] = None) -> torch.Tensor:
        """(B, T) the rule/custom function's scores, each on its response's last token.
        ``details`` receives what the reward function returned per sample, ``metrics`` the
        prime manager's counts of samples that failed or timed out."""
        from megappo.rewards import spread_scores

        lengths = batch.response_lengths   # tool turns included: the reward reads the whole conversation

        def decode(i: int) -> str:
            return self.tokenizer.decode(batch.responses[i, :int(lengths[i])].tolist(), skip_special_tokens=True)

        scores, counts = spread_scores([it.data_source for it in items], decode, [it.ground_truth for it in items],
                                       [it.extra_info for it in items], custom=self.custom_reward, group=self.group,
                                       pool=self.pool, details=details)
        if metrics is not None:
            metrics.update(counts)
        tls = torch.zeros_like(batch.response_mask)
        last = (lengths - 1).clamp(min=0)
        tls[torch.arange(len(batch)), last] = torch.tensor(scores, dtype=tls.dtype)
        return tls * batch.valid_mask

    def __call__(self, batch: RolloutBatch, items) -> Scores:
        details, metrics = [], {}
        # the reward function may wait long on work elsewhere: the watchdog allows it the slow limit
        with watchdog.phase("reward", watchdog.USER), self.timer("reward"):
            if self.reward_model is None:
                tls = self.rule_scores(batch, items, details, metrics)
            else:
                rows = self.rows(batch)
                local = self.reward_model.compute_scores(batch.select(rows), **self.reward_batching.kwargs())
                tls = self._assemble_rows(local, rows, len(batch))
        per_sample = {"score": tls.sum(-1)}
        ob = self.cfg.reward_model.overlong_buffer
        if ob.enable:
            tls, shaping = algo.overlong_penalty(tls, batch.valid_mask,
                                                 max_response_length=ob.max_resp_len or self.cfg.data.max_response_length,
                                                 buffer_len=ob.len, penalty_factor=ob.penalty_factor)
            metrics.update(shaping)
        self.check_finite("reward", scores=tls)
        per_sample["seq_reward"] = per_sample["seq_final_reward"] = tls.sum(-1)
        if self.cfg.algorithm.filter_groups.metric == "acc":
            per_sample["acc"] = _acc(details, self.reward_model is not None)
        keys = self.cfg.algorithm.gdpo_reward_keys
        return Scores(tls, per_sample, _reward_components(details, keys) if keys else None, metrics,
                      details if self.reward_model is None else None)

    def _assemble_rows(self, local: torch.Tensor, rows: list, n_rows: int) -> torch.Tensor:
        """The full batch's tensor from every DP rank's rows."""
        parts = [None] * dist.get_world_size(self.dp_group)
        dist.all_gather_object(parts, (rows, local.cpu()), group=self.dp_group)
        out = torch.zeros((n_rows, *local.shape[1:]), dtype=local.dtype)
        for r, t in parts:
            out[torch.tensor(r, dtype=torch.long)] = t
        return out


def _zeros_if_failed(d, keys: list):
    """A sample whose reward call failed under the prime manager (scored 0): 0 for ``keys`` too."""
    return {**{k: 0.0 for k in keys}, **d} if isinstance(d, dict) and "reward_failed" in d else d


def _reward_components(details: list, keys: list) -> dict:
    """name -> (B,) float64: the reward function's per-component scores (gdpo_reward_keys)."""
    from megappo.rewards import RewardFunctionError

    details = [_zeros_if_failed(d, keys) for d in details]
    for i, d in enumerate(details):
        missing = [k for k in keys if not (isinstance(d, dict) and k in d)]
        if missing:
            raise RewardFunctionError(f"algorithm.gdpo_reward_keys={list(keys)} needs the reward function to return a "
                                      f"dict with each of them; sample {i} returned {d!r} (missing {missing})")
    return {k: torch.tensor([float(d[k]) for d in details], dtype=torch.float64) for k in keys}


def _acc(details: list, reward_model: bool) -> torch.Tensor:
    """(B,) the reward function's ``acc`` per sample (DAPO's filter metric)."""
    from megappo.rewards import RewardFunctionError

    details = [_zeros_if_failed(d, ["acc"]) for d in details]
    missing = [i for i, d in enumerate(details) if not (isinstance(d, dict) and "acc" in d)]
    if reward_model or missing:
        raise RewardFunctionError(
            "algorithm.filter_groups.metric=acc needs the reward function to return a dict with 'acc' "
            + ("(a reward model gives scores only)" if reward_model else
               f"(sample {missing[0]} returned {details[missing[0]]!r})") + "; or filter on score / seq_reward")
    return torch.tensor([float(d["acc"]) for d in details], dtype=torch.float64)
