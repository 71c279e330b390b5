"""The critic's replay of recent batches (trainer.replay.CriticReplay): which rows the critic
trains on each step, their returns and recomputed values, and its state across a checkpoint."""
import io

import pytest
import torch

from megappo.batch import RolloutBatch
from megappo.trainer.replay import CriticReplay

PAD = 0


def _batch(seed: int, rows: int = 4, width: int = 5) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    responses = torch.randint(3, 30, (rows, width), generator=g) * mask.long()
    prompts = [list(torch.randint(3, 30, (int(k),), generator=g)) for k in torch.randint(2, 5, (rows,), generator=g)]
    b = RolloutBatch.from_prompts_and_responses(prompts, responses, mask, PAD, prompt_index=torch.arange(rows))
    b.returns = torch.rand(rows, width, generator=g) * mask
    b.values = torch.rand(rows, width, generator=g) * mask
    b.advantages = torch.randn(rows, width, generator=g) * mask   # not the critic's: not replayed
    return b


class Critic:
    """Values that depend on the row's tokens and on the critic's version (what a trained critic
    gives the same rows after an update); records the rows it was asked for."""
    def __init__(self):
        self.version, self.calls = 0, []

    def __call__(self, b: RolloutBatch) -> torch.Tensor:
        self.calls.append(b)
        return (b.responses.float() / 100 + self.version) * b.response_mask


def _same_rows(got: RolloutBatch, want: RolloutBatch, field: str) -> None:
    a, b = getattr(got, field), getattr(want, field)
    w = max(a.shape[-1], b.shape[-1]) if a.dim() == 2 else None
    if w is not None:
        a = torch.nn.functional.pad(a, (0, w - a.shape[1]))
        b = torch.nn.functional.pad(b, (0, w - b.shape[1]))
    assert torch.equal(a, b), field


def test_rows_of_the_last_k_batches_newest_first_with_values_from_the_critic_now():
    critic, replay = Critic(), CriticReplay(2)
    batches = [_batch(s, width=4 + s) for s in range(4)]   # widths differ: the concat pads
    seen = []
    for step, b in enumerate(batches):
        critic.version = step
        seen.append(replay.training_batch(b, critic, PAD))
    assert seen[0] is batches[0]   # nothing kept yet: the batch as it is
    # step 3: the new batch, then batches 2 and 1 (0 dropped), the replayed rows re-valued at version 3
    rows = seen[3]
    assert len(rows) == 12
    for i, src in enumerate((batches[3], batches[2], batches[1])):
        part = rows.select(slice(4 * i, 4 * i + 4))
        for field in ("input_ids", "responses", "response_mask", "returns", "prompt_lengths"):
            _same_rows(part, src, field)
        want = src.values if i == 0 else (src.responses.float() / 100 + 3) * src.response_mask
        _same_rows(part, RolloutBatch(src.input_ids, src.prompt_lengths, src.responses, src.response_mask,
                                      values=want), "values")
    assert rows.advantages is None and rows.prompt_index is None   # only what the value loss reads
    assert [len(c) for c in critic.calls] == [4, 8, 8]


def test_zero_keeps_nothing_and_bad_sizes_are_refused():
    replay = CriticReplay(0)
    b = _batch(0)
    assert replay.training_batch(b, Critic(), PAD) is b and replay.training_batch(b, Critic(), PAD) is b
    with pytest.raises(ValueError, match="replay batches must be >= 0, got -1"):
        CriticReplay(-1)


def test_state_survives_a_weights_only_checkpoint():
    a, critic = CriticReplay(2), Critic()
    for s in range(3):
        a.training_batch(_batch(s), critic, PAD)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = CriticReplay(2)
    b.load_state_dict(torch.load(buf, weights_only=True))
    nxt = _batch(7)
    got, want = b.training_batch(nxt, critic, PAD), a.training_batch(nxt, critic, PAD)
    for field in ("input_ids", "responses", "response_mask", "returns", "values"):
        _same_rows(got, want, field)
    # a smaller k after a restart keeps the newest batches only
    c = CriticReplay(1)
    c.load_state_dict(a.state_dict())
    assert len(c.batches) == 1 and torch.equal(c.batches[0].returns, a.batches[0].returns)
