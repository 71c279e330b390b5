"""Offload's host side: one buffer per part, exactly the (64-byte aligned) size of what it holds,
made once and reused by every round trip (on GPU it is page-locked in place; torch's pinned
allocator would round each storage up to a power of two and keep the blocks cached)."""
import torch

from megappo.workers.offload import _Stored


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g) for n in (1, 1000, 333, 4096)] + [torch.randint(0, 9, (7, 5), generator=g)]


def test_round_trips_reuse_one_exact_buffer():
    ts = _tensors()
    want = [t.clone() for t in ts]
    storages = [t.untyped_storage() for t in ts]
    stored = _Stored()
    for _ in range(3):
        stored.offload(storages)
        assert all(s.nbytes() == 0 for s in storages)
        stored.reload()
        assert all(torch.equal(a, b) for a, b in zip(ts, want))
        for t in ts:   # the weights move on between offloads
            t.add_(1)
        want = [t.clone() for t in ts]
    assert stored.allocations == 1
    assert stored.buffer.numel() == sum(-(-s.nbytes() // 64) * 64 for s in storages)   # not a power of two


def test_offloads_in_parts_and_growth_keep_every_byte():
    ts = _tensors()
    want = [t.clone() for t in ts]
    storages = [t.untyped_storage() for t in ts]
    stored = _Stored()
    stored.offload(storages[:2])
    stored.offload(storages)          # the first two are already off: skipped, the rest appended
    assert stored.allocations == 2 and all(s.nbytes() == 0 for s in storages)
    stored.reload()
    assert all(torch.equal(a, b) for a, b in zip(ts, want))
    stored.offload(storages)          # the grown buffer holds everything now
    stored.reload()
    assert stored.allocations == 2 and all(torch.equal(a, b) for a, b in zip(ts, want))
