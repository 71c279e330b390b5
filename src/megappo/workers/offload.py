"""Offload a worker's weights, gradients and optimizer state while it is idle (verl's
``megatron.param_offload`` / ``grad_offload`` / ``optimizer_offload``).

Megatron's parameters are views into DDP's contiguous buffers and the optimizer holds references
to them, so nothing may be re-created: the memory of each tensor's *storage* is released in place
(``untyped_storage().resize_(0)``) after a host copy, and re-allocated and filled on reload. Every
view and reference stays valid. Gradients are not copied: megappo zeroes them before every
update, so their storage is dropped and comes back zeroed (megatron's own
``offload_grad_buffers``/``restore_grad_buffers``).

On GPU the host copy is pinned memory; on CPU it is a separate host tensor, so the whole round
trip (free, re-allocate, copy back) runs there too and tests can check it bit for bit.
"""
from __future__ import annotations

import torch

__all__ = ["StateOffload"]


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _Stored:
    """Storages moved to the host and back, whole, each once."""

    def __init__(self):
        self.host: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    def offload(self, storages) -> None:
        for s in storages:
            if s.nbytes() == 0:   # already offloaded (or empty)
                continue
            data = _as_bytes(s)
            if s.device.type == "cuda":
                host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=True)
                host.copy_(data, non_blocking=True)
                torch.cuda.current_stream().synchronize()
            else:
                host = data.clone()
            self.host.append((s, host))
            s.resize_(0)

    def reload(self) -> None:
        for s, host in self.host:
            s.resize_(host.numel())
            _as_bytes(s).copy_(host, non_blocking=True)
        if self.host and self.host[0][0].device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self.host.clear()


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
