"""Micro-batch grouping: fixed size or a token budget."""
import pytest
import torch


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

    from megappo.workers.batching import balanced_partition
    from megappo.workers import deal_to_dp

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


def _check_fitted(groups, fitted, lengths, multiple):
    """fit_to_multiple's contract: a multiple (>= multiple) of groups, every index exactly once,
    empty groups (padding micro-batches) only last and only when every real group is a single
    sample, and groups only ever split (each fitted group lies inside one original group)."""
    n = sum(len(g) for g in groups)
    assert len(fitted) % multiple == 0 and len(fitted) >= multiple
    assert sorted(i for g in fitted for i in g) == list(range(n))
    real = [g for g in fitted if g]
    assert fitted[:len(real)] == real, f"padding groups must come last: {fitted}"
    if len(real) < len(fitted):
        assert all(len(g) == 1 for g in real), f"padding while a group could still be split: {fitted}"
    assert len(real) == min(n, len(fitted)), "split exactly as far as needed, pad only the rest"
    owner = {i: k for k, g in enumerate(groups) for i in g}
    assert all(len({owner[i] for i in g}) == 1 for g in real)
    assert all(g == sorted(g) for g in fitted)
    if len(groups) % multiple == 0:
        assert fitted == groups  # already fits: unchanged


@pytest.mark.parametrize("multiple", [2, 4])
@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_fit_to_multiple_counts(count, multiple):
    import random

    from megappo.workers.batching import fit_to_multiple, token_budget_groups

    rnd = random.Random(count * 10 + multiple)
    tried = 0
    for n in range(count, 13):
        lengths = [rnd.randint(3, 40) for _ in range(n)]
        # a token budget that gives exactly `count` raw groups, where one exists for these lengths
        budgets = [b for b in range(max(lengths), n * max(lengths) + 1)
                   if len(token_budget_groups(lengths, b)) == count]
        if not budgets:
            continue
        groups = token_budget_groups(lengths, budgets[0])
        assert len(groups) == count
        fitted = fit_to_multiple(groups, lengths, multiple)
        _check_fitted(groups, fitted, lengths, multiple)
        assert len(fitted) == max(multiple, -(-count // multiple) * multiple)
        assert groups == token_budget_groups(lengths, budgets[0])  # input left alone
        tried += 1
    assert tried >= 5


@pytest.mark.parametrize("multiple", [2, 4])
@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_fit_to_multiple_singletons_pad(count, multiple):
    from megappo.workers.batching import fit_to_multiple

    groups = [[i] for i in range(count)]
    fitted = fit_to_multiple(groups, [5] * count, multiple)
    target = max(multiple, -(-count // multiple) * multiple)
    assert fitted == groups + [[] for _ in range(target - count)]
    _check_fitted(groups, fitted, [5] * count, multiple)


def test_fit_to_multiple_splits_the_heaviest_group_first():
    from megappo.workers.batching import fit_to_multiple

    # weights (count x longest): [0] 5, [1, 2] 2 x 50 = 100, [3, 4, 5] 3 x 10 = 30. The largest
    # group by count is [3, 4, 5], the heaviest by padded tokens [1, 2]: that one is split.
    lengths = [5, 50, 50, 10, 10, 10]
    groups = [[0], [1, 2], [3, 4, 5]]
    assert fit_to_multiple(groups, lengths, 4) == [[0], [1], [2], [3, 4, 5]]
    # to 8: [3, 4, 5] (30) next, then its heavier half [3, 5] (20), leaving one empty group
    assert fit_to_multiple(groups, lengths, 8) == [[0], [1], [2], [3], [5], [4], [], []]
    # halves alternate by length, so both keep long and short samples: [40, 30, 20, 10] -> [40, 20] + [30, 10]
    assert fit_to_multiple([[0, 1, 2, 3]], [10, 40, 20, 30], 2) == [[1, 2], [0, 3]]
    # a tie in weight splits the first one
    assert fit_to_multiple([[0, 1], [2, 3], [4]], [7, 7, 7, 7, 3], 4) == [[0], [1], [2, 3], [4]]
    # a single group of 3 to 4: halved twice over, then one padding group
    assert fit_to_multiple([[0, 1, 2]], [30, 20, 10], 4) == [[0], [2], [1], []]
    # the heavier half of a split group is split again before a lighter group: [1..5] -> [1, 3, 5]
    # (3 tokens) + [2, 4] (2), then [1, 3, 5] -> [1, 5] + [3]; no padding while a group can split
    assert fit_to_multiple([[0], [1, 2, 3, 4, 5]], [1] * 6, 4) == [[0], [1, 5], [3], [2, 4]]


def test_each_pass_reads_its_own_keys():
    """verl's keys per pass: the reference and value passes and the critic's mini-batches have
    their own settings (they used to follow the rollout's and the actor's)."""
    from megappo.config import load_config
    from megappo.workers.batching import MicroBatching
    from megappo.workers import PassBatching

    A, R, F = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.ref."
    cfg = load_config([A + "ppo_micro_batch_size_per_gpu=1", R + "log_prob_micro_batch_size_per_gpu=2",
                       F + "log_prob_use_dynamic_bsz=true", F + "log_prob_max_token_len_per_gpu=300",
                       "critic.ppo_micro_batch_size_per_gpu=3", "critic.forward_micro_batch_size_per_gpu=5",
                       "reward_model.micro_batch_size_per_gpu=6", "data.train_batch_size=8",
                       A + "ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=2"], ["tiny_cpu"])
    b = PassBatching.from_config(cfg)
    assert b.actor == MicroBatching(1, None) and b.old_log_prob == MicroBatching(2, None)
    assert b.ref == MicroBatching(None, 300) and b.critic == MicroBatching(3, None)
    assert b.values == MicroBatching(5, None) and b.reward == MicroBatching(6, None)
    assert (b.actor_mini_batch, b.critic_mini_batch) == (4, 2)
    assert b.ref.kwargs() == {"micro_batch_size": None, "max_token_len": 300}
    # unset, they follow verl's references: ref <- rollout, critic forward <- critic ppo
    d = PassBatching.from_config(load_config([], ["tiny_cpu"]))
    assert d.ref == d.old_log_prob and d.values == d.critic and d.critic_mini_batch == d.actor_mini_batch


def test_shuffle_reaches_both_updates_with_its_seed(monkeypatch):
    """actor.shuffle / data_loader_seed (verl's keys) reach the actor's and the critic's update as
    its shuffle seed; the critic follows the actor unless set; off by default (verl's default)."""
    from megappo.config import load_config
    from megappo.trainer import phases
    from megappo.workers import PassBatching

    A = "actor_rollout_ref.actor."
    monkeypatch.setattr(phases, "check_finite", lambda *a, **k: None)

    class Worker:
        chunks = []

        def __init__(self):
            self.seen = {}

        def update_policy(self, batch, **kw):
            self.seen = kw
            return {}

        update_critic = update_policy

        def offload(self, **kw):
            pass

    def seeds_seen(overrides):
        cfg = load_config(["algorithm.adv_estimator=gae", *overrides], ["tiny_cpu"])
        batching, actor, critic = PassBatching.from_config(cfg), Worker(), Worker()
        phases.update_actor(actor, None, cfg, batching, None, 1, 1, "cpu")
        phases.update_critic(critic, None, cfg, batching, None, 1, 1, "cpu")
        return actor.seen["shuffle_seed"], critic.seen["shuffle_seed"]

    assert seeds_seen([]) == (None, None)
    assert seeds_seen([A + "shuffle=true"]) == (42, 42)
    assert seeds_seen([A + "shuffle=true", A + "data_loader_seed=5", "critic.shuffle=false"]) == (5, None)
    assert seeds_seen(["critic.shuffle=true", "critic.data_loader_seed=9"]) == (None, 9)


def test_a_token_budget_is_per_gpu_under_context_parallelism():
    """ppo_max_token_len_per_gpu is what one GPU holds (verl's meaning): at CP2 each rank holds
    half of every sequence, so a micro-batch may hold twice the tokens."""
    from types import SimpleNamespace

    from megappo.batch import RolloutBatch
    from megappo.workers import MegatronWorker

    prompts = [[5] * 6 for _ in range(8)]
    responses = torch.full((8, 4), 7)
    batch = RolloutBatch.from_prompts_and_responses(prompts, responses, torch.ones(8, 4), pad_token_id=0)
    counts = {}
    for cp in (1, 2):   # 8 samples of 10 tokens under a budget of 20 per GPU
        worker = SimpleNamespace(ddp_chunks=[None], pp=1, cp=cp)
        micros, order, keep = MegatronWorker._micro(worker, batch, None, 20)
        assert sorted(order) == list(range(8))
        counts[cp] = [len(mb) for mb in micros]
    assert counts == {1: [2] * 4, 2: [4] * 2}
