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
