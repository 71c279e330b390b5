"""Same-host weight gather through one shared-memory copy of the full HF model (CPU tensors).

:func:`~megappo.convert.hf_io.iter_hf_tensors` normally assembles each full tensor with a TP
all-gather and a PP broadcast per parameter, then splits fused tensors into HF ones: every rank
receives the whole model through sockets (gloo over loopback on the CPU stack) and allocates it
twice. When every rank of the model-parallel group runs on one host with CPU tensors, this
module does it with shared memory instead: the group maps one segment laid out as the full
HF-named model, each rank writes its own shards straight into their places (already split and
unpadded, :func:`~megappo.convert.parallel.shard_into_hf`), and after a barrier every rank yields
views of the segment. Per sync a rank copies only its own shards; nothing is allocated.

The segment is a file under ``/dev/shm``, unlinked as soon as every rank has mapped it, so nothing
is left behind when a job dies. :meth:`SharedHFModel.plan` returns ``None`` (the caller keeps the
collectives) for a single rank, device tensors, ranks on several hosts or a ``/dev/shm`` without
room; the decision is agreed over the group, so its ranks never mix transports.
"""
from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from .names import hf_shapes, param_maps
from .parallel import shard_into_hf

log = logging.getLogger(__name__)

__all__ = ["SharedHFModel"]

_ALIGN = 64
SHM_DIR = "/dev/shm"


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class SharedHFModel:
    """The full HF-named model in one shared segment, written in pieces by the ranks of a
    model-parallel group. Plan once (:meth:`plan`, collective); per sync :meth:`publish`
    (collective), then :meth:`tensors`."""

    def __init__(self, group, desc, te: bool, layout, local: dict, tensors: dict, token: str):
        self.group, self.desc, self.te, self.layout = group, desc, te, layout
        self._local = local      # megatron name -> this rank's parameter, for the maps its stage owns
        self._tensors = tensors  # HF name -> view of the segment, in param_maps order
        self.token = token       # the segment was /dev/shm/megappo-weights-<token> (now unlinked)

    @classmethod
    def plan(cls, local: dict[str, torch.Tensor], desc, layout, te: bool = False, group=None,
             shm_dir: str = SHM_DIR) -> Optional["SharedHFModel"]:
        """``local``: this rank's parameters by global megatron name. Collective over ``group``
        (default: ``layout.mp_group``, the ranks holding one copy of the model)."""
        group = group if group is not None else getattr(layout, "mp_group", None)
        if group is None or dist.get_world_size(group) == 1:
            return None
        if desc.num_experts and getattr(layout, "ep", 1) > 1:
            return None   # experts live outside the model-parallel group (on other EP ranks): collectives

        maps = param_maps(desc, te)
        owned = {pm.megatron: local[pm.megatron] for pm in maps
                 if layout.owner(pm, desc.num_layers) == layout.pp_rank}
        dtype = next(iter(local.values())).dtype
        esize = torch.empty((), dtype=dtype).element_size()
        entries, size = {}, 0
        for pm in maps:
            for name, shape in hf_shapes(pm, desc).items():
                entries[name] = (size, shape)
                size += (int(torch.Size(shape).numel()) * esize + _ALIGN - 1) // _ALIGN * _ALIGN
        try:
            st = os.statvfs(shm_dir)
            room = st.f_bavail * st.f_frsize
        except OSError:
            room = 0
        me = dict(rank=dist.get_rank(), host=_host_id(), room=room, dtype=str(dtype),
                  cpu=all(p.device.type == "cpu" for p in local.values()))
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, me, group=group)
        hosts = {e["host"] for e in everyone}
        why = ("device tensors" if not all(e["cpu"] for e in everyone) else
               f"ranks on {len(hosts)} hosts" if len(hosts) > 1 else
               "parameters of several dtypes" if len({e["dtype"] for e in everyone}) > 1 else
               f"{shm_dir} has {min(e['room'] for e in everyone) >> 20} MiB free, the model needs {size >> 20} MiB"
               if any(e["room"] < size for e in everyone) else None)
        leader = dist.get_rank(group) == 0
        if why:
            if leader:
                log.info("weight gather: collectives (shared memory not used: %s)", why)
            return None
        token = [uuid.uuid4().hex if leader else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        path = os.path.join(shm_dir, f"megappo-weights-{token[0]}")
        if leader:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
        try:
            dist.barrier(group=group)
            seg = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            dist.barrier(group=group)
        finally:
            if leader:
                os.unlink(path)  # every rank has mapped it (or failed): the mapping outlives the name
        dist.barrier(group=group)  # no segment has a name once any rank returns
        tensors = {n: seg[o:o + int(torch.Size(s).numel()) * esize].view(dtype).view(s) for n, (o, s) in entries.items()}
        if leader:
            log.info("weight gather: shared memory, %d ranks, %.0f MiB", len(everyone), size / 2**20)
        return cls(group, desc, te, layout, owned, tensors, token[0])

    @torch.no_grad()
    def publish(self) -> None:
        """Write this rank's current shards into the segment. Collective: the first barrier keeps
        a rank from overwriting tensors another rank still reads from the previous sync."""
        dist.barrier(group=self.group)
        lay = self.layout
        for pm in param_maps(self.desc, self.te):
            p = self._local.get(pm.megatron)
            if p is not None:
                shard_into_hf(pm, p.detach(), self.desc, lay.tp_rank, lay.tp, self._tensors)
        dist.barrier(group=self.group)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, view)`` of the whole model, valid until the next :meth:`publish`."""
        return iter(self._tensors.items())
