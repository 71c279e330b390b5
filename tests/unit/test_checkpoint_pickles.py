"""A checkpoint cannot run code: per-rank state (RNG streams, the one-step-off generation in
flight) is saved as tensors and plain types and read with torch.load(weights_only=True); a
planted pickle payload is refused unless the user says, once, that they trust the checkpoint.
(megatron's dist_checkpointing reads its common state the same way:
tests/distributed/test_checkpoint.py::test_megatron_common_state_refuses_a_payload.)"""
import os
import pickle
import random

import numpy as np
import pytest
import torch


class Payload:
    """Unpickling it creates ``marker``: proof that loading ran code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def _output():
    from megappo.rollout import RolloutOutput

    return RolloutOutput(prompt_index=torch.tensor([0, 0, 1, 1]), responses=torch.tensor([[5, 6], [7, 2], [8, 0], [9, 9]]),
                         response_mask=torch.tensor([[1., 1.], [1., 1.], [1., 0.], [1., 1.]]),
                         rollout_log_probs=torch.randn(4, 2), finish_reasons=["length", "stop", "stop", "length"])


def test_rank_state_round_trips_as_plain_tensors(tmp_path):
    from megappo import rng
    from megappo.checkpoint import load_checkpoint, save_checkpoint
    from megappo.trainer import run_state

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    inflight = ([4, 7], _output(), 5)
    save_checkpoint(str(tmp_path), 3, {}, {"k": 1},
                    per_rank_state={**rng.capture(), "inflight": run_state._plain_inflight(inflight)})
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    state, rank_state = load_checkpoint(str(tmp_path / "global_step_3"), {}, with_rank_state=True)
    assert state == {"step": 3, "k": 1}
    rng.restore(rank_state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected   # the streams continue
    indices, out, version = run_state._inflight_from(rank_state["inflight"])
    assert indices == [4, 7] and version == 5 and out.finish_reasons == inflight[1].finish_reasons
    for f in ("prompt_index", "responses", "response_mask", "rollout_log_probs"):
        assert torch.equal(getattr(out, f), getattr(inflight[1], f)), f


def test_planted_payload_in_rank_state_is_refused(tmp_path, monkeypatch):
    from megappo.checkpoint import TRUST_PICKLES, CheckpointError, _write_manifest, load_checkpoint, save_checkpoint

    monkeypatch.delenv(TRUST_PICKLES, raising=False)
    save_checkpoint(str(tmp_path), 1, {}, {}, per_rank_state={"x": torch.zeros(1)})
    ckpt, marker = tmp_path / "global_step_1", tmp_path / "ran"
    torch.save({"x": Payload(str(marker))}, ckpt / "rank_state" / "rank_0.pt")
    _write_manifest(str(ckpt))   # whoever planted it rewrote the checksums too
    with pytest.raises(CheckpointError, match=rf"rank_0.pt: holds Python objects .* refused .*{TRUST_PICKLES}=1"):
        load_checkpoint(str(ckpt), {}, with_rank_state=True)
    assert not marker.exists()
    monkeypatch.setenv(TRUST_PICKLES, "1")   # the explicit, one-time way for an older checkpoint one trusts
    load_checkpoint(str(ckpt), {}, with_rank_state=True)
    assert marker.exists()
