"""Validation: the whole validation set scored with ``rollout.val_kwargs`` sampling."""
from __future__ import annotations

from typing import Optional

import torch

from megappo import seeds
from megappo.metrics import generation_records

__all__ = ["validate", "wants_records", "log_records", "dump_rollout"]


def validate(cfg, val_data, generation, scorer, engine, timer, step: int, samples: Optional[list] = None) -> dict:
    """``val-core/<data_source>/reward/mean@<n>`` (and ``best@<n>`` when n > 1). ``samples``
    (a list) receives every sample's record (megappo.metrics.generation_records: input and
    output decoded without special tokens, gts, score, and what the reward function returned)."""
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



def wants_records(cfg, logger, rank: int) -> bool:
    """Whether a validation's samples are decoded: trainer.log_val_generations for an active
    logger, or trainer.validation_data_dir on rank 0."""
    tr = cfg.trainer
    return bool((tr.log_val_generations > 0 and logger.active) or (tr.validation_data_dir and rank == 0))


def log_records(cfg, logger, rank: int, step: int, records: Optional[list]) -> None:
    """A validation's samples to where they go: log_val_generations of them to the logger (chosen
    as verl chooses), every one to validation_data_dir/<step>.jsonl (rank 0)."""
    import os

    from megappo.metrics import dump_generations, select_generations

    n, tr = cfg.trainer.log_val_generations, cfg.trainer
    if records and n > 0 and logger.active:
        logger.log_generations(step, select_generations([(r["input"], r["output"], r["score"]) for r in records], n))
    if records and tr.validation_data_dir and rank == 0:
        dump_generations(os.path.expanduser(tr.validation_data_dir), step, records)


def dump_rollout(cfg, rank: int, tokenizer, step: int, batch, items: list, details: Optional[list], timer) -> None:
    """trainer.rollout_data_dir: the step's samples, as verl writes them (rank 0); ``details``:
    what the reward function returned for each."""
    import os

    from megappo.metrics import dump_generations

    if cfg.trainer.rollout_data_dir and rank == 0:
        with timer("dump_rollout_generations"):
            dump_generations(os.path.expanduser(cfg.trainer.rollout_data_dir), step, generation_records(
                tokenizer, batch, items, batch.token_level_scores.sum(-1), details))
