"""Offload a worker's weights, gradients and optimizer state while it is idle (verl's
``megatron.param_offload`` / ``grad_offload`` / ``optimizer_offload``).

Megatron's parameters are views into DDP's contiguous buffers and the optimizer holds references
to them, so nothing may be re-created: the memory of each tensor's *storage* is released in place
(``untyped_storage().resize_(0)``) after a host copy, and re-allocated and filled on reload. Every
view and reference stays valid. Gradients are not copied: megappo zeroes them before every
update, so their storage is dropped and comes back zeroed (megatron's own
``offload_grad_buffers``/``restore_grad_buffers``).

On GPU the host copy is page-locked memory; on CPU it is a separate host tensor, so the whole round
trip (free, re-allocate, copy back) runs there too and tests can check it bit for bit.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["StateOffload"]


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _Stored:
    """Storages moved to the host and back, whole, each once. The host side is one buffer, made at
    the first offload (grown if a later one needs more) and reused by every later round trip. On
    GPU it is page-locked in place at its exact size (cudaHostRegister): torch's pinned allocator
    would round each storage up to a power of two and keep the freed blocks cached, holding up to
    twice the offloaded state in pinned memory per rank."""

    ALIGN = 64   # bytes: each storage starts aligned in the buffer

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None
        self.host: list[tuple[torch.UntypedStorage, int, int]] = []   # (storage, offset, bytes)
        self.allocations = 0

    def _end(self) -> int:
        return max((off + -(-n // self.ALIGN) * self.ALIGN for _, off, n in self.host), default=0)

    def _room(self, nbytes: int, cuda: bool) -> None:
        """A buffer of at least ``nbytes``, keeping what is already in it."""
        if self.buffer is not None and self.buffer.numel() >= nbytes:
            return
        new = torch.empty(nbytes, dtype=torch.uint8)
        if cuda:
            _page_lock(new)
        if self.buffer is not None:
            new[:self._end()].copy_(self.buffer[:self._end()])
            if cuda:
                _page_unlock(self.buffer)
        self.buffer = new
        self.allocations += 1

    def offload(self, storages) -> None:
        todo = [s for s in storages if s.nbytes() > 0]   # 0: already offloaded (or empty)
        if not todo:
            return
        cuda = todo[0].device.type == "cuda"
        offset = self._end()
        places = []
        for s in todo:
            places.append(offset)
            offset += -(-s.nbytes() // self.ALIGN) * self.ALIGN
        self._room(offset, cuda)
        for s, off in zip(todo, places):
            self.buffer[off:off + s.nbytes()].copy_(_as_bytes(s), non_blocking=cuda)
        if cuda:
            torch.cuda.current_stream().synchronize()
        for s, off in zip(todo, places):
            self.host.append((s, off, s.nbytes()))
            s.resize_(0)

    def reload(self) -> None:
        for s, off, n in self.host:
            s.resize_(n)
            _as_bytes(s).copy_(self.buffer[off:off + n], non_blocking=True)
        if self.host and self.host[0][0].device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self.host.clear()


def _page_lock(t: torch.Tensor) -> None:
    """Pin a host tensor's pages where they are (as torch's own checkpoint stager does)."""
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
    if err != 0:
        raise RuntimeError(f"offload: cudaHostRegister of {t.numel() * t.element_size() >> 20} MiB of host "
                           f"memory failed (cudaError {err}); is the host out of lockable memory (ulimit -l)?")


def _page_unlock(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def _storages(tensors) -> list[torch.UntypedStorage]:
    """The distinct storages under ``tensors`` (views of one buffer share one)."""
    seen, out = set(), []
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen and s.nbytes() > 0:
            seen.add(s.data_ptr())
            out.append(s)
    return out


class StateOffload:
    """What a worker may move off its device while idle, and the moves.

    ``offload()`` frees the selected parts (idempotent); ``ensure(params=..., grads=...,
    optimizer=...)`` brings back what a pass is about to use. The worker calls ``ensure`` itself
    before every forward and update, so a pass never meets a freed tensor."""

    def __init__(self, worker, *, params: bool = False, grads: bool = False, optimizer: bool = False):
        self.worker = worker
        self.enabled = {"params": params, "grads": grads and worker.optimizer is not None,
                        "optimizer": optimizer and worker.optimizer is not None}
        self._params, self._optimizer = _Stored(), _Stored()
        self._grads_off = False

    def __bool__(self) -> bool:
        return any(self.enabled.values())

    def _param_storages(self) -> list:
        return _storages(p for c in self.worker.chunks for p in c.parameters())

    def _optimizer_storages(self) -> list:
        """Optimizer state and the optimizer's own (fp32 main) weights, never storage shared with
        the model's parameters (fp32 models: the optimizer updates the parameters themselves)."""
        model = {s.data_ptr() for s in self._param_storages()}
        tensors = []
        for opt in getattr(self.worker.optimizer, "chained_optimizers", [self.worker.optimizer]):
            inner = getattr(opt, "optimizer", None)
            if inner is None:
                continue
            for group in inner.param_groups:
                tensors += [p for p in group["params"] if isinstance(p, torch.Tensor)]
            for state in inner.state.values():
                tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return [s for s in _storages(tensors) if s.data_ptr() not in model]

    def offload(self, *, params: bool = True) -> None:
        # optimizer first: it may hold storages the parameter pass would otherwise see first
        if self.enabled["optimizer"]:
            self._optimizer.offload(self._optimizer_storages())
        if self.enabled["grads"] and not self._grads_off:
            for m in self.worker.ddp_chunks:
                m.offload_grad_buffers(synchronize=False, empty_cache=False)
            self._grads_off = True
        if params and self.enabled["params"]:
            self._params.offload(self._param_storages())
        if self and torch.cuda.is_available() and self.worker.device.type == "cuda":
            torch.cuda.empty_cache()

    def ensure(self, *, params: bool = True, grads: bool = False, optimizer: bool = False) -> None:
        if params:
            self._params.reload()
        if grads and self._grads_off:
            for m in self.worker.ddp_chunks:
                m.restore_grad_buffers(synchronize=False)
            self._grads_off = False
        if optimizer:
            self._optimizer.reload()

    def reload_all(self) -> None:
        self.ensure(params=True, grads=True, optimizer=True)
