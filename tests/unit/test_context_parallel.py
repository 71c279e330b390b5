"""Context parallelism's layout (megappo.models.context_parallel): the positions each CP rank
holds are megatron's load-balanced chunks, the same ones megatron's RoPE slices its table to."""
import pytest
import torch

from megappo.models.context_parallel import _natural_order, local_positions


def test_each_rank_holds_chunk_r_and_its_mirror():
    # 16 tokens over CP 2: 4 chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert local_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # every position is held by exactly one rank, at every CP size
    for cp in (1, 2, 3, 4):
        held = torch.cat([local_positions(24, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(24))


def test_the_same_chunks_as_megatrons_rope_slice():
    from megatron.core.models.common.embeddings import rope_utils

    class Group:   # what get_pos_emb_on_this_cp_rank reads of its group
        def __init__(self, size, rank):
            self._size, self._rank = size, rank

        def size(self):
            return self._size

        def rank(self):
            return self._rank

    table = torch.arange(24.0)[:, None, None, None]   # RoPE's [S, 1, 1, dim] table: row s holds s
    # megatron stages the chunk index in pinned memory and moves it to CUDA: megappo's CPU rewrite
    # runs it here (pin_memory dropped, .cuda() the identity), as it does in a CPU trainer
    from megappo.cuda_to_cpu import CudaToCpu

    with CudaToCpu(devices=True, tensor_type=False):
        for cp in (2, 3):
            for r in range(cp):
                rows = rope_utils.get_pos_emb_on_this_cp_rank(table, 0, Group(cp, r))
                assert rows.flatten().long().tolist() == local_positions(24, cp, r).tolist()


def test_natural_order_undoes_the_ranks_concatenation():
    for cp in (2, 4):
        held = torch.cat([local_positions(32, cp, r) for r in range(cp)])
        assert held[_natural_order(32, cp)].tolist() == list(range(32))


def test_a_length_that_does_not_split_is_an_error():
    with pytest.raises(ValueError, match=r"14 tokens is not a multiple of 2 x context_parallel_size = 4"):
        local_positions(14, 2, 0)
