"""Validation: the whole validation set scored with ``rollout.val_kwargs`` sampling."""
from __future__ import annotations

from typing import Optional

import torch

from megappo import seeds

__all__ = ["validate"]


def validate(cfg, val_data, generation, scorer, engine, timer, step: int, samples: Optional[list] = None) -> dict:
    """``val-core/<data_source>/reward/mean@<n>`` (and ``best@<n>`` when n > 1). ``samples``
    (a list) receives every sample's record (megappo.metrics.generation_records: input and
    output decoded without special tokens, gts, score, and what the reward function returned)."""
    from megappo.metrics import generation_records
    from megappo.rollout import SamplingConfig

    if val_data is None:
        return {}
    sampling = SamplingConfig.from_config(cfg.actor_rollout_ref.rollout, cfg.data.max_response_length, validation=True)
    items = [val_data[i] for i in range(len(val_data))]
    size = cfg.data.val_batch_size or len(items)
    with timer("testing"):
        # data.val_batch_size prompts per generate call; each prompt's seed depends on its place
        # in the whole set, so the split does not change what is sampled
        scores = []
        for lo in range(0, len(items), size):
            batch, its = generation.rollout(items[lo:lo + size], sampling, step, salt=seeds.VALIDATION, offset=lo)
            details = [] if samples is not None else None
            scores.append(scorer.rule_scores(batch, its, details).sum(-1))
            if samples is not None:
                samples += generation_records(scorer.tokenizer, batch, its, scores[-1], details)
        scores = torch.cat(scores).view(len(items), sampling.n)
        # Training rollouts never see validation's cached prompts: a run resumed from the
        # checkpoint of this step (fresh engine, empty cache) then samples exactly as this one.
        engine.reset_prefix_cache()
    out = {}
    n = sampling.n
    for src in sorted({it.data_source for it in items}):
        rows = torch.tensor([i for i, it in enumerate(items) if it.data_source == src])
        s = scores[rows].double()
        out[f"val-core/{src}/reward/mean@{n}"] = s.mean().item()
        if n > 1:
            out[f"val-core/{src}/reward/best@{n}"] = s.max(-1).values.mean().item()
    return out

