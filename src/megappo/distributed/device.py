"""The one device of a process, decided once at start and passed down.

``cuda:LOCAL_RANK`` on GPU, ``cpu`` on CPU, and under the CPU device check
(:mod:`megappo.device_check`) the simulated ``cuda:LOCAL_RANK``. The trainer keeps the gathered
global batch on the host; workers move each micro-batch to their device and hand results back to
the host. Host-side collectives (metrics, advantages, the KL controller) run on gloo side groups.
"""
from __future__ import annotations

import os

import torch

__all__ = ["process_device", "module_device", "host_dp_group", "host_world_group"]


def process_device(kind: str) -> torch.device:
    """This process's compute device for ``trainer.device`` = ``kind`` (sets CUDA's current device)."""
    local = int(os.environ.get("LOCAL_RANK", 0))
    if kind == "cuda":
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    from megappo.megatron_cpu import device_check_on

    return torch.device("cuda", local) if device_check_on() else torch.device("cpu")


def module_device(modules) -> torch.device:
    """The device every parameter of ``modules`` is on; an error naming the parameters that are
    elsewhere (a layer left on the CPU only shows up as a crash on the first GPU forward)."""
    devices: dict = {}
    for m in modules:
        for name, p in m.named_parameters():
            devices.setdefault(_norm(p.device), []).append(name)
    if not devices:
        return torch.device("cpu")
    if len(devices) > 1:
        main = max(devices, key=lambda d: len(devices[d]))
        stray = {str(d): names[:4] for d, names in devices.items() if d != main}
        raise ValueError(f"model parameters on more than one device: most on {main}, but {stray}")
    return next(iter(devices))


def _norm(d: torch.device) -> torch.device:
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def host_dp_group():
    """megatron's gloo data-parallel group: the side group for host tensors of the DP ranks."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group_gloo()


def host_world_group():
    """A gloo group over every rank of the default group (this role's ranks under the split
    placement), for Python objects gathered from all of them: the default group itself where it is
    gloo, else a new one. Collective: every rank calls it at the same point."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")
