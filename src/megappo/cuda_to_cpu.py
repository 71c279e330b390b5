"""The plain CUDA-to-CPU rewrite megatron-core runs under on CPU (see :mod:`megappo.megatron_cpu`),
and the base of the CPU device check's simulated CUDA (:mod:`megappo.device_check`)."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CudaToCpu", "cpu_device"]


def cpu_device(d):
    if isinstance(d, torch.device):
        return torch.device("cpu") if d.type == "cuda" else d
    if isinstance(d, str):
        return "cpu" if d.startswith("cuda") else d
    if isinstance(d, int) and not isinstance(d, bool):
        return "cpu"  # an integer device is a CUDA ordinal
    return d


class CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA devices to the CPU for every torch call made while it is active."""

    def __init__(self, devices: bool, tensor_type: bool):
        super().__init__()
        self.devices = devices
        self.tensor_type = tensor_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and self.tensor_type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if not self.devices:
            return func(*args, **kwargs)
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):   # megatron pins host staging tensors (CP's RoPE slice); no allocator off CUDA
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], cpu_device(args[1])) + tuple(args[2:])
        return func(*args, **kwargs)
