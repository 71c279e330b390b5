"""The run's seeds (megappo.seeds) and RNG state (megappo.rng)."""
import random

import numpy as np
import torch

from megappo import rng, seeds


def test_rng_capture_restore_replays_every_stream():
    state = rng.capture()
    first = (torch.rand(3), random.random(), np.random.rand())
    torch.rand(5), random.random(), np.random.rand()   # move every stream on
    rng.restore(state)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]
    assert set(state) == {"torch", "python", "numpy"}   # the checkpoint's per-rank keys (no CUDA here)


def test_seeds_split_prompts_independently_of_the_replicas():
    n, first = 8, seeds.batch_seed(3, 5, seeds.TRAIN)
    # a replica that gets prompts 4.. of the batch seeds its first prompt as the whole batch would
    replica = seeds.prompt_seed(first, 4, n)
    assert [seeds.prompt_seed(replica, i, n) for i in range(3)] == [seeds.prompt_seed(first, 4 + i, n) for i in range(3)]
    # every prompt's n samples take their own seeds
    assert len({seeds.prompt_seed(first, i, n) + j for i in range(32) for j in range(n)}) == 32 * n


def test_salts_and_steps_give_distinct_batches():
    salts = [seeds.TRAIN, seeds.VALIDATION] + [seeds.dynamic_round_salt(r) for r in range(1, 6)]
    assert seeds.dynamic_round_salt(0) == seeds.TRAIN and len(set(salts)) == len(salts)
    batch = {(step, salt): seeds.batch_seed(1, step, salt) for step in range(50) for salt in salts}
    assert len(set(batch.values())) == len(batch)
    assert all(0 <= v < 2 ** 40 for v in batch.values())
    assert seeds.epoch_seed(1, 0) != seeds.epoch_seed(1, 1) != seeds.epoch_seed(2, 0)
    mini = {seeds.mini_batch_seed(s, e, i) for s in range(20) for e in range(4) for i in range(8)}
    assert len(mini) == 20 * 4 * 8


def test_epoch_orders_are_permutations_that_change_with_step_and_epoch():
    orders = {(s, e): seeds.epoch_order(16, 42, s, e) for s in range(6) for e in range(4)}
    for order in orders.values():
        assert sorted(order.tolist()) == list(range(16))
    assert len({tuple(o.tolist()) for o in orders.values()}) == len(orders)
    assert torch.equal(seeds.epoch_order(16, 42, 3, 1), orders[3, 1])        # a resumed run draws the same
    assert not torch.equal(seeds.epoch_order(16, 7, 3, 1), orders[3, 1])      # data_loader_seed matters
