"""Batch metrics over data-parallel ranks equal the metrics of the whole batch on one process
(uneven row counts and response lengths)."""
import json

import pytest
import torch

from harness import spawn

pytestmark = pytest.mark.distributed


def _batch():
    from megappo.batch import RolloutBatch

    g = torch.Generator().manual_seed(11)
    B, T = 7, 6
    prompts = [list(range(3, 3 + int(torch.randint(2, 6, (1,), generator=g)))) for _ in range(B)]
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    b = RolloutBatch.from_prompts_and_responses(prompts, torch.randint(3, 50, (B, T), generator=g), mask, 0)
    b.token_level_scores = torch.randn(B, T, generator=g) * mask
    b.token_level_rewards = torch.randn(B, T, generator=g) * mask
    b.advantages, b.returns, b.values = (torch.randn(B, T, generator=g) for _ in range(3))
    return b


def _worker(rank, world, out):
    import torch.distributed as dist

    from megappo.metrics import data_metrics

    rows = [0, 1, 2] if rank == 0 else [3, 4, 5, 6]
    m = data_metrics(_batch().select(rows), max_response_length=6, group=dist.group.WORLD)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(m, f)


def test_dp_metrics_equal_whole_batch_metrics(tmp_path):
    from megappo.metrics import data_metrics

    spawn(_worker, 2, str(tmp_path / "m.json"))
    got = json.loads((tmp_path / "m.json").read_text())
    want = data_metrics(_batch(), max_response_length=6)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), k
    local = data_metrics(_batch().select([0, 1, 2]), max_response_length=6)
    assert local["critic/vf_explained_var"] != pytest.approx(want["critic/vf_explained_var"])  # rank 0 alone differs
