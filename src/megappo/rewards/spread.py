"""A batch's rule or custom rewards computed once, spread over the training ranks.

Every rank needs every sample's score (advantages, filters and metrics are computed on the whole
batch), but no sample needs scoring twice: rank r of W calls the reward function on samples
r, r + W, ... and the results are all-gathered (over a host group: the scores are Python objects).
A batch reward function (verl's batch manager: one call with every sample, e.g. an LLM judge that
compares a prompt's samples) runs once, on the group's first rank. Every rank then sees the same
scores, whatever a non-deterministic judge would have said on each, and a failure on any rank is
raised on all of them, naming the sample.
"""
from __future__ import annotations

from typing import Callable, Optional

from .registry import RewardFunctionError, call_rewards, finish_scores

__all__ = ["spread_scores"]


def _gather(obj, group) -> list:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def spread_scores(data_sources: list, decode: Callable[[int], str], ground_truths: list, extra_infos: list, *,
                  custom: Optional[Callable] = None, group=None, pool=None,
                  details: Optional[list] = None) -> tuple[list[float], dict]:
    """(every sample's score, metrics) on every rank of ``group``. ``decode(i)``: sample i's
    response text (decoded only where it is scored). ``pool`` (a :class:`~megappo.rewards.pool.RewardPool`,
    verl's prime manager): this rank's share is scored there, a sample that fails or times out
    scores 0 and is counted (``reward/failed``, ``reward/timed_out``). ``details`` receives what
    the function returned per sample (a dict, or None)."""
    import torch.distributed as dist   # (here: a reward worker process imports this package without torch)

    n = len(data_sources)
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    batched = custom is not None and getattr(custom, "megappo_batched", False)
    mine = (list(range(n)) if rank == 0 else []) if batched else list(range(rank, n, size))
    results, wheres, failed, timed_out, err = [], [], {}, 0, None
    try:
        texts = [decode(i) for i in mine]
        args = ([data_sources[i] for i in mine], texts, [ground_truths[i] for i in mine], [extra_infos[i] for i in mine])
        if pool is not None and mine:
            got = pool.score([(i, a) for i, a in zip(mine, zip(*args))])
            # a sample that failed scores 0 (verl's prime); its details say why (a filter's or
            # gdpo's keys read 0 there)
            results = [{"score": 0.0, "reward_failed": got.failed[p]} if p in got.failed else r[1]
                       for p, r in enumerate(got.results)]
            wheres = ["" if p in got.failed else r[0] for p, r in enumerate(got.results)]
            failed, timed_out = {mine[p]: why for p, why in got.failed.items()}, got.timed_out
        elif mine:
            results, wheres = call_rewards(*args, custom=custom, index=mine)
    except Exception as e:  # noqa: BLE001 - every rank raises it (their gathers must pair up first)
        err = e if isinstance(e, RewardFunctionError) else RewardFunctionError(f"{type(e).__name__}: {e}")
    parts = _gather((mine, results, wheres, failed, timed_out, None if err is None else str(err)), group)
    bad = [(r, p[5]) for r, p in enumerate(parts) if p[5]]
    if bad:
        r, msg = bad[0]
        raise RewardFunctionError(msg if size == 1 else f"rank {r}: {msg}") from err
    full, where_of, fails, late = [None] * n, [None] * n, {}, 0
    for idx, res, whr, fl, to, _ in parts:
        for i, x, w in zip(idx, res, whr):
            full[i], where_of[i] = x, w
        fails.update(fl)
        late += to
    metrics = {}
    if pool is not None:
        metrics = {"reward/failed": float(len(fails)), "reward/timed_out": float(late)}
        if fails and (not dist.is_initialized() or dist.get_rank() == 0):
            first = min(fails)
            print(f"reward: {len(fails)} of {n} samples scored 0 ({late} timed out); first: {fails[first]}", flush=True)
    return finish_scores(full, where_of, data_sources, details), metrics
