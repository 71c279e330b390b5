"""The split placement's bookkeeping without processes: which global ranks train, and the order
RemoteRollout enforces on the bridge (one generation in flight, collected before any other command)."""
import pytest
import torch

from megappo.distributed.split import SplitGroups
from megappo.layout import train_ranks_of
from megappo.rollout import SamplingConfig
from megappo.trainer import RemoteRollout


def test_train_ranks_follow_the_launchers_layout():
    # ROLLOUT_GPUS=2 on nodes of 8: every node's first 6 ranks train
    assert train_ranks_of(2, 6, 2, 2) == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13]
    # ROLLOUT_NNODES=1 after 2 training nodes of 8: the first 16 ranks train
    assert train_ranks_of(2, 8, 1, 8) == list(range(16))
    assert train_ranks_of(1, 1, 1, 1) == [0]


def _trainer_rank():
    """A training rank other than 0: it sends nothing over the bridge, but keeps the same books."""
    return SplitGroups("train", 1, 4, [0, 1], [2, 3], None, None, torch.device("cpu"))


def test_remote_rollout_keeps_one_generation_in_flight_and_its_version():
    engine = RemoteRollout(_trainer_rank(), pad_token_id=0)
    sampling = SamplingConfig(n=1, max_tokens=4)
    with pytest.raises(RuntimeError, match="no weights were sent to the rollout ranks yet"):
        engine.request([[5, 6]], sampling)
    engine.sync_weights(iter([("w", torch.zeros(1))]), policy_version=0)
    assert (engine.transfers, engine.policy_version) == (1, 0)
    engine.request([[5, 6]], sampling)
    assert engine.pending == 0          # made with the weights of step 0
    with pytest.raises(RuntimeError, match="cannot send weights while a generation is in flight"):
        engine.sync_weights(iter([]), policy_version=1)
    with pytest.raises(RuntimeError, match="cannot request a generation while a generation is in flight"):
        engine.request([[5, 6]], sampling)
    with pytest.raises(RuntimeError, match="cannot stop the rollout ranks while a generation is in flight"):
        engine.stop()
    engine.pending = None               # (collected)
    engine.sync_weights(iter([]), policy_version=1)
    assert (engine.transfers, engine.policy_version) == (2, 1)
    with pytest.raises(RuntimeError, match="no generation was requested"):
        engine.collect()


def test_both_placements_make_the_default_group_alike(monkeypatch):
    """On GPU the colocated path and the split placement create their default NCCL group with the
    same options (no device_id in either: the same lazy communicator creation), checked by
    recording the calls (no GPU here: set_device and the group are stand-ins)."""
    import datetime

    import torch
    import torch.distributed as dist

    from megappo.config import load_config
    from megappo.distributed import split
    from megappo.trainer import setup

    class Made(Exception):
        pass

    calls = []

    def record(backend, **kw):
        calls.append((backend, sorted(k for k in kw if k not in ("store", "rank", "world_size"))))
        raise Made

    monkeypatch.setattr(dist, "init_process_group", record)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(dist, "rendezvous", lambda *a, **k: iter([(dist.HashStore(), 0, 2)]))
    for k, v in dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(k, v)
    cfg = load_config(["trainer.device=cuda"])
    try:
        setup.init_distributed(cfg)
    except Made:
        pass
    try:
        split.init_split(1, "nccl", datetime.timedelta(seconds=5))
    except Made:
        pass
    assert len(calls) == 2 and calls[0] == calls[1] == ("nccl", ["timeout"]), calls
