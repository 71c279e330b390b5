"""The critic's replay of recent batches (``critic.replay_batches``).

A critic is a regression on the returns, and its data is cheap to reuse: the rows of the last few
steps, with the returns they were scored with, still say what the current policy's tokens are
worth (the policy moves little per step), while passing over one batch again only fits that
batch's noise harder. Each DP rank keeps the rows it trained on; their values are computed again
by the critic before the update, so the clipped value loss is anchored where the critic now
stands, as it is for the new rows."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from megappo.batch import RolloutBatch

__all__ = ["CriticReplay"]

# what the value loss reads of a row (besides its values, which are recomputed)
_KEPT = ("input_ids", "prompt_lengths", "responses", "response_mask", "sequence_mask", "rollout_rs_mask", "returns")


def _rows(batch: RolloutBatch, values: Optional[torch.Tensor] = None) -> RolloutBatch:
    return RolloutBatch(**{name: getattr(batch, name) for name in _KEPT}, values=values)


class CriticReplay:
    """The rows of the critic's last ``k`` batches on this DP rank (newest first), held on the host."""

    def __init__(self, k: int):
        if k < 0:
            raise ValueError(f"replay batches must be >= 0, got {k!r}")
        self.k = int(k)
        self.batches: list[RolloutBatch] = []

    def training_batch(self, batch: RolloutBatch, values_fn: Callable[[RolloutBatch], torch.Tensor],
                       pad_token_id: int) -> RolloutBatch:
        """The rows the critic trains on this step: ``batch`` (with its returns and values) and the
        kept rows after it, their values from ``values_fn`` (the critic as it is now); then
        ``batch`` is kept and the oldest batch beyond ``k`` dropped. ``batch`` itself without any."""
        if self.k == 0:
            return batch
        old = self.batches
        self.batches = [_rows(batch).to("cpu")] + old[:self.k - 1]
        if not old:
            return batch
        kept = RolloutBatch.concat(old, pad_token_id).to(batch.responses.device)
        kept.values = values_fn(kept)
        return RolloutBatch.concat([_rows(batch, batch.values), kept], pad_token_id)

    def state_dict(self) -> dict:
        return {"k": self.k, "batches": [{f.name: getattr(b, f.name) for f in dataclasses.fields(b)
                                          if getattr(b, f.name) is not None} for b in self.batches]}

    def load_state_dict(self, state: dict) -> None:
        self.batches = [RolloutBatch(**fields) for fields in state["batches"]][:self.k]
