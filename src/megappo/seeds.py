"""Every seed the run derives, in one place. A sample's randomness depends only on the data seed,
the trainer step, what the batch is for (its salt) and the prompt's place in the batch: not on how
prompts are split over rollout replicas, the placement, or whether the run was resumed.

- :func:`epoch_seed`: the shuffle of one epoch of the prompt order (``data.seed``);
- :func:`batch_seed`: the seed of a generated batch's first prompt at a step, per salt
  (:data:`TRAIN`, :data:`VALIDATION`, :func:`dynamic_round_salt` for DAPO's extra rounds);
- :func:`prompt_seed`: prompt ``i`` of a batch samples with seeds ``prompt_seed .. + n - 1``
  (vLLM adds the sample index for each of the ``n`` children);
- :func:`turn_seed`: a multi-turn sample's model turn ``k`` (turn 0 draws what one turn would);
- :func:`mini_batch_seed`: the seed of one PPO mini-batch's random choices (Clip-Cov's tokens),
  from the optimizer's step count, which a resumed run restores;
- :func:`epoch_order`: the order of a batch's rows in one PPO epoch (``actor.shuffle``,
  ``actor.data_loader_seed``), from the same step count.

Model initialisation and vLLM's engine take ``actor_rollout_ref.actor.megatron.seed`` as it is.
"""
from __future__ import annotations

import torch

__all__ = ["TRAIN", "VALIDATION", "dynamic_round_salt", "epoch_seed", "batch_seed", "prompt_seed",
           "turn_seed", "mini_batch_seed", "epoch_order"]

TRAIN, VALIDATION = 0, 1


def dynamic_round_salt(round_no: int) -> int:
    """The salt of dynamic sampling's generation round ``round_no`` (0: the step's own batch);
    later rounds skip validation's salt."""
    return TRAIN if round_no == 0 else round_no + 1


def epoch_seed(seed: int, epoch: int) -> int:
    return seed * 1_000_003 + epoch


def batch_seed(data_seed: int, step: int, salt: int) -> int:
    return (data_seed * 1_000_003 + step * 4_000_037 + salt * 7_919_003) % (1 << 40)


def prompt_seed(first: int, index: int, n: int) -> int:
    """The first seed of prompt ``index`` of a batch whose first prompt samples from ``first``."""
    return first + index * n


def turn_seed(sample_seed: int, turn: int) -> int:
    """The seed of a multi-turn sample's model turn ``turn``. Each turn is a new engine request;
    reusing the sample's seed would replay the same random draws on every turn."""
    if turn == 0:
        return sample_seed
    return (sample_seed * 2_654_435_761 + turn * 40_503) % (1 << 40)


def mini_batch_seed(optimizer_steps: int, epoch: int, index: int) -> int:
    """Mini-batch ``index`` of PPO epoch ``epoch``, after ``optimizer_steps`` optimizer steps."""
    return (optimizer_steps * 1_000 + epoch) * 100_003 + index


def epoch_order(rows: int, loader_seed: int, optimizer_steps: int, epoch: int) -> torch.Tensor:
    """A permutation of ``rows``: the order PPO epoch ``epoch`` takes a batch's rows in, after
    ``optimizer_steps`` optimizer steps, when mini-batches are shuffled."""
    g = torch.Generator().manual_seed((loader_seed * 1_000_003 + optimizer_steps * 1_009 + epoch) % (1 << 63))
    return torch.randperm(rows, generator=g)
