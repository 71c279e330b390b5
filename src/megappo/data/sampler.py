"""Seeded, resumable order over a dataset: epochs of shuffled global batches; every rank computes
the same order."""
from __future__ import annotations

import random

from megappo.seeds import epoch_seed

__all__ = ["PromptSampler"]


class PromptSampler:
    def __init__(self, n_items: int, batch_size: int, *, shuffle: bool = True, seed: int = 1,
                 key: str = "data.train_batch_size"):
        if batch_size > n_items:
            raise ValueError(f"{key}={batch_size} is larger than the dataset ({n_items} prompts)")
        self.n, self.batch_size, self.shuffle, self.seed = n_items, batch_size, shuffle, seed
        self.epoch = 0
        self.position = 0  # batches already taken in this epoch

    @property
    def batches_per_epoch(self) -> int:
        return self.n // self.batch_size  # the last partial batch is dropped, as verl's loader does

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(epoch_seed(self.seed, epoch)).shuffle(order)
        return order

    def next_batch(self) -> list[int]:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        order = self._order(self.epoch)
        start = self.position * self.batch_size
        self.position += 1
        return order[start:start + self.batch_size]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n": self.n,
                "batch_size": self.batch_size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "n", "batch_size", "shuffle"):
            if state[key] != getattr(self, key if key != "n" else "n"):
                raise ValueError(f"cannot resume the data order: {key} was {state[key]} and is now {getattr(self, key)}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
