"""Run megatron-core 0.16.1 on CPU (gloo): the whole adaptation, in one place.

megatron-core has no CPU mode; it calls CUDA APIs in many places. ``install()`` is called once,
first thing, when ``trainer.device=cpu`` (by the trainer, the checkpoint converter and the
conversion check, which build megatron models); on GPU it is never imported. Each piece is independent so tests can show it is needed (megatron fails
without it) and that it works (megatron runs with it):

- ``rng``:    model_parallel_cuda_manual_seed and the RNG tracker get/set the CUDA generator;
              they are pointed at the CPU default generator (seeding cannot be skipped: weight
              init and dropout fork the tracker's states).
- ``device``: tensors created with ``device="cuda"`` / ``torch.cuda.current_device()`` (RoPE,
              schedules, grad buffers, optimizer) are created on the CPU instead, by a global
              ``TorchFunctionMode`` that rewrites CUDA devices, makes ``Tensor.cuda()`` the
              identity and makes ``torch.cuda.current_device()`` answer 0.
- ``backward``: a TorchFunctionMode is not active inside autograd's backward, where
              sequence-parallel all-gathers allocate on ``current_device()``; autograd.Function
              backward calls are wrapped to enter the same mode.
- ``sync``:   ``torch.cuda.synchronize`` (pipeline p2p, dist_checkpointing's writer) is a no-op.
- ``tensor_type``: the optimizer asserts parameters report ``torch.cuda.FloatTensor``; the mode
              reports CPU tensors' type strings with the ``torch.cuda.`` prefix.
- ``streams``: MoE's alltoall token dispatcher builds a ``torch.cuda.Stream`` when constructed and
              waits on, enters and records events of streams every forward: one CPU stand-in stream
              (every call is a no-op; CPU work is already in order).
- ``moe_splits``: the dispatcher turns its split sizes into numpy arrays only when they are CUDA
              tensors (``maybe_move_tensor_to_cpu``); on CPU they stay tensors, which gloo's
              ``all_to_all_single`` refuses: CPU tensors are converted the same way.

``install(check_devices=True)`` (the CPU device check, :mod:`megappo.device_check`) replaces the
plain rewrite with one that also tracks which tensors would live on the GPU and fails where CUDA or
NCCL would; ``torch.cuda.current_device()`` then answers ``LOCAL_RANK``.
"""
from __future__ import annotations

import logging

import torch

from megappo.cuda_to_cpu import CudaToCpu

__all__ = ["PIECES", "install", "installed"]

PIECES = ("rng", "device", "backward", "sync", "tensor_type", "streams", "moe_splits")
_installed: set[str] = set()
_mode_factory = None  # builds the mode the backward piece enters (the same kind as the global one)


def installed() -> frozenset:
    return frozenset(_installed)


def device_check_on() -> bool:
    """True when this process runs under the CPU device check (simulated CUDA device)."""
    from megappo import device_check

    return device_check.guard_installed()


def _install_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = torch.cuda.manual_seed
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)

    # Forking the tracker now moves the CPU generator itself, which megatron reports as "CPU RNG
    # state changed within GPU RNG context" on every fork: expected here, so silence it.
    class _DropForkWarning(logging.Filter):
        def filter(self, record):
            return "CPU RNG state changed within GPU RNG context" not in record.getMessage()

    logging.getLogger(mrandom.__name__).addFilter(_DropForkWarning())


def _install_mode(devices: bool, tensor_type: bool, check_devices: bool = False) -> None:
    global _mode_factory
    if check_devices:
        import os

        from megappo import device_check

        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.current_device = lambda: index
        _mode_factory = lambda: device_check.SimulatedCuda(tensor_type, index)  # noqa: E731
        device_check.install_collective_guard()
    else:
        if devices:
            torch.cuda.current_device = lambda: 0
        _mode_factory = lambda: CudaToCpu(devices, tensor_type)  # noqa: E731
    _mode_factory().__enter__()  # global for this thread, for the life of the process


def _install_backward() -> None:
    BackwardCFunction = torch.autograd.function.BackwardCFunction
    original = BackwardCFunction.apply

    def apply(self, *args):
        mode = _mode_factory() if _mode_factory is not None else CudaToCpu(False, False)
        with mode:
            return original(self, *args)

    BackwardCFunction.apply = apply


def _install_sync() -> None:
    torch.cuda.synchronize = lambda device=None: None


class _CpuStream:
    """A CUDA stream's interface, for CPU work (which runs in order anyway)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return _CpuEvent()

    def synchronize(self) -> None:
        pass


class _CpuEvent:
    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def record(self, stream=None) -> None:
        pass


def _install_streams() -> None:
    import contextlib

    stream = _CpuStream()
    # classes, not factories: libraries annotate with ``torch.cuda.Stream | None`` at import time
    torch.cuda.Stream = _CpuStream
    torch.cuda.Event = _CpuEvent
    torch.cuda.current_stream = lambda device=None: stream
    torch.cuda.default_stream = lambda device=None: stream
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    # The dispatcher's device-to-host stream is a class attribute made on first use from
    # whatever torch.cuda.Stream is then; vLLM's CPU worker (imported later, when the engine
    # starts) swaps in placeholders whose record_event returns None. Pin ours.
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = stream


def _install_moe_splits() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def install(pieces=PIECES, check_devices: bool = False) -> None:
    """Install the named pieces (all by default); installing twice is a no-op. ``check_devices``
    (needs the ``device`` piece) turns on the CPU device check; it must come with the first call."""
    unknown = set(pieces) - set(PIECES)
    if unknown:
        raise ValueError(f"unknown megatron_cpu pieces {sorted(unknown)}; known: {', '.join(PIECES)}")
    if torch.cuda.is_available():
        raise RuntimeError("megatron_cpu.install() is for CPU-only runs; this process sees a CUDA device "
                           "(use trainer.device=cuda)")
    todo = [p for p in PIECES if p in pieces and p not in _installed]
    if check_devices and "device" not in todo and not device_check_on():
        raise RuntimeError("megatron_cpu.install(check_devices=True) must be the first install of the device piece")
    if "rng" in todo:
        _install_rng()
    if "device" in todo or "tensor_type" in todo:
        _install_mode(devices="device" in todo, tensor_type="tensor_type" in todo,
                      check_devices=check_devices and "device" in todo)
    if "backward" in todo:
        _install_backward()
    if "sync" in todo:
        _install_sync()
    if "streams" in todo:
        _install_streams()
    if "moe_splits" in todo:
        _install_moe_splits()
    _installed.update(todo)
