"""Rollout replicas over ranks: prompts split by replica, results gathered in prompt order
(one copy per replica)."""
import pytest
import torch

from harness import spawn

pytestmark = pytest.mark.distributed


def _worker(rank, world, rollout_tp, n_prompts, n):
    from megappo.rollout import RolloutOutput, gather_outputs, prompt_slice, rollout_replica

    replica, n_rep = rollout_replica(rank, world, rollout_tp)
    sl = prompt_slice(n_prompts, replica, n_rep)
    k = sl.stop - sl.start
    # a replica's fake samples: response j of prompt p is [p, j] padded to a replica-specific length
    T = 2 + replica
    resp = torch.zeros(k * n, T, dtype=torch.long)
    for i in range(k):
        for j in range(n):
            resp[i * n + j, :2] = torch.tensor([sl.start + i, j])
    local = RolloutOutput(torch.arange(k).repeat_interleave(n), resp, (resp >= 0).float(),
                          torch.zeros(k * n, T), ["stop"] * (k * n))
    out = gather_outputs(local, sl.start, rollout_tp, pad_token_id=-1)
    assert out.prompt_index.tolist() == [p for p in range(n_prompts) for _ in range(n)]
    assert out.responses[:, :2].tolist() == [[p, j] for p in range(n_prompts) for j in range(n)]
    assert out.responses.shape[1] == 2 + (n_rep - 1)


@pytest.mark.parametrize("world, rollout_tp, n_prompts, n", [(4, 1, 6, 2), (4, 2, 5, 4), (2, 2, 3, 2)])
def test_prompts_split_by_replica_and_gathered_in_order(world, rollout_tp, n_prompts, n):
    spawn(_worker, world, rollout_tp, n_prompts, n)
