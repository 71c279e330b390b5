"""RolloutBatch: the one container the PPO step passes between stages.

Sequences are stored right-padded and unshifted: row i is ``prompt_i + response_i + pad``, so the
causal mask alone is exact (no token ever attends to padding that precedes it) and position ids
are ``0..S-1``. Response-aligned tensors are ``(B, T)`` with ``T`` the longest response.

Two masks: ``response_mask`` is what the policy is trained on (losses, advantages, KL, entropy,
as verl's ``response_mask``); ``valid_mask`` is what the sequence holds (lengths, micro-batches,
packing). They differ only for multi-turn samples, whose tool turns sit inside the response:
attended and positioned like any token, but not the policy's actions.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["RolloutBatch"]


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor                        # (B, S) long: prompt + response, right-padded
    prompt_lengths: torch.Tensor                   # (B,) long
    responses: torch.Tensor                        # (B, T) long, right-padded
    response_mask: torch.Tensor                    # (B, T) float: 1 on the tokens the policy generated and trains on
    prompt_index: Optional[torch.Tensor] = None    # (B,) long: group id (samples of one prompt share it)
    old_log_prob: Optional[torch.Tensor] = None    # (B, T)
    ref_log_prob: Optional[torch.Tensor] = None    # (B, T)
    rollout_log_probs: Optional[torch.Tensor] = None  # (B, T)
    values: Optional[torch.Tensor] = None          # (B, T)
    token_level_scores: Optional[torch.Tensor] = None   # (B, T)
    token_level_rewards: Optional[torch.Tensor] = None  # (B, T)
    advantages: Optional[torch.Tensor] = None      # (B, T)
    returns: Optional[torch.Tensor] = None         # (B, T)
    rollout_is_weights: Optional[torch.Tensor] = None  # (B, T): rollout correction's truncated IS weights
    sum_pi_squared: Optional[torch.Tensor] = None  # (B, T): sum_v pi_old(v)^2 (optimal_token_baseline)
    reward_components: Optional[dict] = None       # name -> (B,) scores from the reward function's dict (gdpo)
    sample_index: Optional[torch.Tensor] = None    # (B,) long: the sample's row in the step's global batch
    cov_selected: Optional[torch.Tensor] = None    # (B, T) bool: Clip-Cov/KL-Cov's tokens (algo.cov_selection)
    rollout_rs_mask: Optional[torch.Tensor] = None  # (B, T) float: 1 where rejection sampling keeps the token
    # (B, T) float: 1 on every response token in the sequence, the model's and the tool turns'
    # (multi-turn); None: the response mask (one turn: every token after the prompt is the model's)
    sequence_mask: Optional[torch.Tensor] = None

    @classmethod
    def from_prompts_and_responses(cls, prompts: Sequence[Sequence[int]], responses: torch.Tensor,
                                   response_mask: torch.Tensor, pad_token_id: int, **fields) -> "RolloutBatch":
        """Build from per-sample prompt ids and the rollout's (B, T) responses and mask (and, for
        multi-turn samples, ``sequence_mask`` among ``fields``: the lengths come from it)."""
        seq = fields.get("sequence_mask")
        lengths = (response_mask if seq is None else seq).sum(-1).long()
        p_len = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        S = int((p_len + lengths).max())
        ids = torch.full((len(prompts), S), pad_token_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
            n = int(lengths[i])
            ids[i, len(p):len(p) + n] = responses[i, :n]
        return cls(ids, p_len, responses, response_mask.float(), **fields)

    @property
    def valid_mask(self) -> torch.Tensor:
        """(B, T) the response tokens the sequence holds (attended, with positions): with tool
        turns more than the response mask, which the losses, advantages and KL read."""
        return self.response_mask if self.sequence_mask is None else self.sequence_mask

    @property
    def response_lengths(self) -> torch.Tensor:
        """(B,) long: tokens after each prompt, tool turns included."""
        return self.valid_mask.sum(-1).long()

    @property
    def loss_mask(self) -> torch.Tensor:
        """(B, T) the tokens every loss (and its normaliser) counts: the response tokens less those
        rollout correction's rejection sampling dropped. Lengths come from valid_mask."""
        return self.response_mask if self.rollout_rs_mask is None else self.response_mask * self.rollout_rs_mask

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_positions(self) -> torch.Tensor:
        """(B, T) index into a sequence's next-token predictions: response token t of row i is
        predicted at position prompt_len_i + t - 1."""
        T = self.responses.shape[1]
        arange = torch.arange(T, device=self.prompt_lengths.device)
        return (self.prompt_lengths[:, None] + arange[None, :] - 1).clamp(
            max=self.input_ids.shape[1] - 2)

    def select(self, index) -> "RolloutBatch":
        """Rows ``index`` (a slice, list or tensor) of every present field."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = _map(v, lambda t: t[index])
        return RolloutBatch(**out)

    @classmethod
    def concat(cls, batches: Sequence["RolloutBatch"], pad_token_id: int) -> "RolloutBatch":
        """Rows of ``batches`` one after the other; (B, S) and (B, T) fields are right-padded to the
        widest (token ids with ``pad_token_id``, everything else with 0). A field must be present
        in all batches or in none. Group ids are kept as they are: renumber them first."""
        out = {}
        for f in dataclasses.fields(cls):
            vs = [getattr(b, f.name) for b in batches]
            if all(v is None for v in vs):
                out[f.name] = None
                continue
            if any(v is None for v in vs):
                raise ValueError(f"RolloutBatch.concat: field {f.name} is missing in some batches")
            if isinstance(vs[0], dict):
                out[f.name] = {k: torch.cat([v[k] for v in vs]) for k in vs[0]}
                continue
            if vs[0].dim() == 2:
                width = max(v.shape[1] for v in vs)
                fill = pad_token_id if f.name in ("input_ids", "responses") else 0
                vs = [torch.nn.functional.pad(v, (0, width - v.shape[1]), value=fill) for v in vs]
            out[f.name] = torch.cat(vs)
        return cls(**out)

    def to(self, device, non_blocking: bool = False) -> "RolloutBatch":
        """Every present tensor field on ``device`` (the worker boundary: host batch -> device)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = _map(v, lambda t: t.to(device, non_blocking=non_blocking))
        return RolloutBatch(**out)

    def split(self, size: int) -> list["RolloutBatch"]:
        if len(self) % size:
            raise ValueError(f"a batch of {len(self)} samples does not split into micro-batches of {size}")
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]


def _map(v, fn):
    """``fn`` on a tensor field, on each tensor of a dict field; anything else as it is."""
    if isinstance(v, torch.Tensor):
        return fn(v)
    if isinstance(v, dict):
        return {k: fn(t) for k, t in v.items()}
    return v
