"""The CPU device check: run on CPU with the GPU's device discipline enforced.

On a GPU, a batch left on the host, a CPU tensor handed to an NCCL collective or a layer whose
weights stayed on the CPU crashes the first step. On CPU all of these work, so a CPU test suite
cannot see them. With ``MEGAPPO_CHECK_DEVICES=1`` (or :func:`install`) a CPU process simulates one
CUDA device, ``cuda:LOCAL_RANK``, and fails where CUDA or NCCL would:

- Every tensor's storage carries a place: ``device`` (made with a CUDA device, ``.cuda()``,
  ``.to(cuda)``, or computed from device tensors) or ``host`` (made without a device, ``.cpu()``,
  or computed from host tensors only). Storage created out of sight (autograd's C++ backward)
  has none and is neutral. ``.device`` / ``.is_cuda`` of a device tensor answer ``cuda:N``, so
  code that follows the device of its inputs behaves exactly as on a GPU.
- An op that mixes device and host tensors raises, as CUDA does (``copy_``, indexing with host
  indices and a 0-d host scalar are allowed, as on CUDA).
- A collective on a process group that is NCCL on a GPU (the default group and megatron's groups)
  raises when given a host tensor; a group created with ``backend="gloo"`` (the host side groups)
  raises when given a device tensor. Object collectives (``*_object``) are not checked: torch moves
  their bytes itself.

The computation itself stays on the CPU: results equal the unchecked CPU run. This is installed by
:func:`megappo.megatron_cpu.install` (``check_devices=True``) in place of the plain CUDA-to-CPU
rewrite; it costs a Python call per torch op, so only tests turn it on.
"""
from __future__ import annotations

import functools
import inspect
import os

import torch

from megappo.cuda_to_cpu import CudaToCpu, cpu_device

__all__ = ["DeviceCheckError", "SimulatedCuda", "place", "install_collective_guard", "guard_installed",
           "enabled_by_env"]

HOST, DEVICE = "host", "device"
_ATTR = "_megappo_place"
ENV = "MEGAPPO_CHECK_DEVICES"


class DeviceCheckError(RuntimeError):
    """A tensor was on the host where the GPU run needs it on the device, or the reverse."""


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "0") not in ("", "0", "false", "False")


def place(t) -> str | None:
    """``"device"``, ``"host"`` or None (unknown) for a tensor under the check."""
    try:
        return getattr(t.untyped_storage(), _ATTR, None)
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _set(t, where) -> None:
    try:
        setattr(t.untyped_storage(), _ATTR, where)
    except (RuntimeError, NotImplementedError, AttributeError):
        pass


def _tensors(obj, out):
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    return out


def _is_cuda(d) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, int) and not isinstance(d, bool)


def _is_device_arg(d) -> bool:
    return isinstance(d, (torch.device, str)) or (isinstance(d, int) and not isinstance(d, bool))


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _fresh(out: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``out`` with a storage of its own (a move that the CPU turned into a no-op must still copy)."""
    try:
        if out.untyped_storage().data_ptr() == src.untyped_storage().data_ptr() and out.numel():
            return out.clone()
    except (RuntimeError, NotImplementedError):
        pass
    return out


# Ops CUDA allows across devices: a copy, indexing a device tensor with host indices (and
# assigning into it), and moves (handled before the mixing check).
_MIXED_OK = {torch.Tensor.copy_, torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_,
             torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.new_tensor,
             # a type query of `param.data = moved` (Module.cuda/.to): moving a parameter is legal
             torch._has_compatible_shallow_copy_type}
# Ops that refuse even a 0-d tensor from the other device.
_STRICT = {torch.cat, torch.stack, torch.concat, torch.hstack, torch.vstack}


_DEVICE_GET = torch.Tensor.device.__get__  # method-wrappers compare equal, never identical
_DATA_SET = torch.Tensor.data.__set__       # `param.data = moved`: the parameter moves with it
_IS_CUDA_GET = torch.Tensor.is_cuda.__get__


class SimulatedCuda(CudaToCpu):
    """The CUDA-to-CPU rewrite of megatron_cpu, keeping track of what would live on the GPU."""

    def __init__(self, tensor_type: bool, index: int):
        super().__init__(devices=True, tensor_type=tensor_type)
        self.sim = torch.device("cuda", index)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("pin_memory"):   # pinned host memory is host memory (no pinned allocator off CUDA)
            kwargs["pin_memory"] = False
        if func is torch.Tensor.type and self.tensor_type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if func == _DEVICE_GET:
            return self.sim if place(args[0]) == DEVICE else func(*args)
        if func == _IS_CUDA_GET:
            return place(args[0]) == DEVICE
        if func is torch.Tensor.get_device:
            return self.sim.index if place(args[0]) == DEVICE else -1
        if func == _DATA_SET:
            func(*args, **kwargs)
            if place(args[1]) is not None:
                _set(args[0], place(args[1]))
            return None
        if func is torch.Tensor.cuda:
            src = args[0]
            if place(src) == DEVICE:
                return src
            out = src.clone()
            _set(out, DEVICE)
            return out
        if func is torch.Tensor.cpu:
            src = args[0]
            if place(src) != DEVICE:
                return src
            out = _fresh(func(*args, **kwargs), src)
            _set(out, HOST)
            return out
        if func is torch.Tensor.to:
            return self._to(func, args, kwargs)
        if "device" in kwargs and kwargs["device"] is not None:  # factories, *_like, new_*, as_tensor
            target = DEVICE if _is_cuda(kwargs["device"]) else HOST
            kwargs["device"] = cpu_device(kwargs["device"])
            ins = _tensors(args, [])
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                if any(out is t for t in ins) and place(out) != target:
                    out = out.clone()
                _set(out, target)
            return out

        ins = _tensors(args, []) + _tensors(kwargs, [])
        places = [(t, place(t)) for t in ins]
        has_dev = any(p == DEVICE for _, p in places)
        has_host = any(p == HOST for _, p in places)
        if has_dev and has_host and func not in _MIXED_OK:
            strict = func in _STRICT
            bad = [t for t, p in places if p == HOST and (strict or t.dim() > 0)]
            if bad:
                raise DeviceCheckError(
                    f"{_name(func)}: mixes tensors on the GPU with CPU tensors of shape "
                    f"{[tuple(t.shape) for t in bad]} (on a GPU: 'Expected all tensors to be on the same device'); "
                    "move them to the worker's device first")
        out = func(*args, **kwargs)
        where = DEVICE if has_dev else HOST if (has_host or not ins) else None
        if where is not None:
            for t in _tensors(out, []):
                if place(t) is None:
                    _set(t, where)
        return out

    def _to(self, func, args, kwargs):
        src = args[0]
        target = kwargs.get("device")
        rest = list(args[1:])
        if rest and isinstance(rest[0], torch.Tensor):  # .to(other): other's device and dtype
            other = rest[0]
            target = self.sim if place(other) == DEVICE else torch.device("cpu")
            rest[0] = other.dtype
        elif rest and _is_device_arg(rest[0]) and not isinstance(rest[0], torch.dtype):
            target = rest[0]
            rest[0] = cpu_device(rest[0])
        if "device" in kwargs:
            kwargs["device"] = cpu_device(kwargs["device"])
        out = func(src, *rest, **kwargs)
        if target is None:  # dtype only: stays where it is
            if place(out) is None:
                _set(out, place(src))
            return out
        want = DEVICE if _is_cuda(target) else HOST
        if place(src) != want:
            out = _fresh(out, src)
            _set(out, want)
        return out


# -- collectives ---------------------------------------------------------------------------------
_host_groups: "set" = set()
_GUARDED = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
            "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "all_to_all",
            "all_to_all_single", "send", "recv", "gather", "scatter")
_installed = False


def guard_installed() -> bool:
    """True once :func:`install_collective_guard` ran (this process runs under the check)."""
    return _installed


def _group_kind(group) -> str:
    return HOST if group is not None and group in _host_groups else DEVICE


def check_collective(name: str, tensors, group) -> None:
    need = _group_kind(group)
    for t in tensors:
        p = place(t)
        if need == DEVICE and p == HOST:
            raise DeviceCheckError(
                f"torch.distributed.{name}: a CPU tensor of shape {tuple(t.shape)} on a process group that is NCCL "
                "on a GPU (NCCL has no CPU support); move it to the device, or use a gloo side group / *_object")
        if need == HOST and p == DEVICE:
            raise DeviceCheckError(
                f"torch.distributed.{name}: a GPU tensor of shape {tuple(t.shape)} on a gloo (host) side group; "
                "bring it to the CPU first")


def install_collective_guard() -> None:
    """Wrap ``torch.distributed``'s tensor collectives (the names callers reach) with the check,
    and record the groups created with ``backend="gloo"`` as host groups. Install before any
    group is created."""
    global _installed
    if _installed:
        return
    import torch.distributed as dist

    for name in _GUARDED:
        orig = getattr(dist, name, None)
        if orig is None:
            continue
        sig = inspect.signature(orig)

        def wrapped(*args, __orig=orig, __sig=sig, __name=name, **kwargs):
            bound = __sig.bind_partial(*args, **kwargs).arguments
            check_collective(__name, _tensors([v for k, v in bound.items() if k != "group"], []),
                             bound.get("group"))
            return __orig(*args, **kwargs)

        setattr(dist, name, functools.wraps(orig)(wrapped))

    orig_batch = dist.batch_isend_irecv

    def batch_isend_irecv(p2p_op_list):
        for op in p2p_op_list:
            check_collective("batch_isend_irecv", [op.tensor], op.group)
        return orig_batch(p2p_op_list)

    dist.batch_isend_irecv = batch_isend_irecv

    orig_new_group = dist.new_group

    @functools.wraps(orig_new_group)
    def new_group(*args, **kwargs):
        backend = kwargs.get("backend")
        if backend is None and len(args) > 2:
            backend = args[2]
        g = orig_new_group(*args, **kwargs)
        if g is not None and backend is not None and "gloo" in str(backend).lower() and "nccl" not in str(backend).lower():
            _host_groups.add(g)
        return g

    dist.new_group = new_group
    _installed = True
