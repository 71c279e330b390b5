"""Micro-batch grouping: fixed size or a token budget."""
import pytest


def test_token_budget_micro_batches():
    from megappo.workers.batching import micro_batch_groups, token_budget_groups  # noqa: I001

    lengths = [30, 5, 12, 28, 7, 19, 3, 40]
    for budget in (40, 64, 100, 1000):
        groups = token_budget_groups(lengths, budget)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert all(len(g) * max(lengths[i] for i in g) <= budget for g in groups)
    assert len(token_budget_groups(lengths, 1000)) == 1
    with pytest.raises(ValueError, match="a sequence of 40 tokens exceeds the micro-batch token budget 39"):
        token_budget_groups(lengths, 39)
    assert micro_batch_groups(4, [1] * 4, micro_batch_size=2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="do not split into micro-batches of 3"):
        micro_batch_groups(4, [1] * 4, micro_batch_size=3)


def test_balanced_partition_and_dealing():
    import random

    from megappo.workers.batching import balanced_partition, deal_to_dp

    rnd = random.Random(0)
    lengths = [rnd.randint(10, 2000) for _ in range(64)]
    parts = balanced_partition(lengths, 4)
    assert sorted(i for p in parts for i in p) == list(range(64)) and {len(p) for p in parts} == {16}
    loads = [sum(lengths[i] for i in p) for p in parts]
    naive = [sum(lengths[i * 16:(i + 1) * 16]) for i in range(4)]
    assert max(loads) - min(loads) < (max(naive) - min(naive)) / 4
    assert max(loads) - min(loads) <= max(lengths)

    M, dp = 16, 4
    for balance in (True, False):
        ranks = deal_to_dp(lengths, M, dp, balance=balance)
        assert sorted(i for r in ranks for i in r) == list(range(64))
        for r in ranks:
            assert len(r) == 64 // dp
            for k in range(64 // M):  # rank's k-th mini-batch lies inside the global k-th mini-batch
                mine = r[k * (M // dp):(k + 1) * (M // dp)]
                assert all(k * M <= i < (k + 1) * M for i in mine)
    assert deal_to_dp(lengths, M, dp, balance=False)[1][:4] == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="do not deal evenly to 3 DP ranks"):
        deal_to_dp(lengths, 16, 3)
