"""Split placement: one job's ranks divided into training ranks and rollout ranks, and the bridge
between the two groups (the foundation of one-step off-policy training).

Layout. The launcher (torchrun, srun, Ray) starts W ranks of the same program. Some train
(megatron TP/PP/DP over them), the others roll out (vLLM replicas under vLLM's external launcher,
``rollout_tp`` consecutive rollout ranks per replica); :func:`megappo.layout.train_ranks_of` says which from the
config (the last GPUs of every node roll out, or whole nodes after the training nodes), and
global rank 0 always trains. Each process's DEFAULT process group covers only its own role:
megatron's ``initialize_model_parallel`` and vLLM's external launcher both derive their groups
from the default group's rank and size (and vLLM reads ``RANK`` from the environment), so each
sees a world of its own role and needs no change. ``RANK``/``WORLD_SIZE`` are rewritten to the
role-local values; the job-global ones live in :class:`SplitGroups`. ``LOCAL_RANK`` stays as
launched: it names the process's device, which vLLM's external launcher opens as ``cuda:LOCAL_RANK``.

Rendezvous. One store for the whole job, from torch's own ``env://`` rendezvous: exactly the
store torch's default init would make (global rank 0 hosts a TCPStore at
``MASTER_ADDR:MASTER_PORT``; under torchrun every rank joins the agent's store there), so no
second port is needed, and torch's default init itself never runs. The groups take prefixes of
it: ``megappo/split/train/`` and ``megappo/split/rollout/`` for the two default groups (they carry
the same group name, and every ``new_group`` megatron or vLLM makes later lands under its role's
prefix), ``megappo/split/bridge/`` for the bridge.

Bridge. A process group over global rank 0 (bridge rank 0) and every rollout rank (bridge rank
``1 + i`` for rollout rank ``i``), built directly as a backend object (``ProcessGroupGloo`` /
``ProcessGroupNCCL``) because ``torch.distributed.new_group`` needs every member of the default
group, and no default group spans both roles. It is not registered with ``torch.distributed``:
use its own methods (``broadcast``, ``send``, ``recv``, ``barrier``), not ``dist.*(group=...)``.
Training ranks other than 0 are not members (``bridge is None``).

Transfers (no disk):
- weights, global rank 0 -> rollout ranks (:func:`send_weights` / :func:`receive_weights`):
  full HF-named tensors in whole-layer buckets (:func:`~megappo.convert.layer_buckets`, what
  ``VLLMRollout.sync_weights`` needs), one broadcast of one flat byte buffer per bucket, with a
  version number that must increase;
- commands, global rank 0 -> rollout ranks (:func:`send_command` / :func:`receive_command`), and
  objects back (:func:`send_object` / :func:`receive_object`: the first rollout rank to global rank
  0, point to point, then a broadcast over the training group): what
  :mod:`megappo.trainer.remote` speaks.

Message format. Every message starts with a control tensor ``int64[4]`` = (kind, a, b, c); a
payload is one ``uint8`` buffer holding a JSON description (names, dtypes, shapes, byte offsets)
followed by the tensors' bytes, each aligned to 16 bytes so it can be viewed back in its dtype
without a copy. The weight transfer header (``START``, version) comes first; the bucket count and
names cannot be known before the training ranks' collective iteration has produced the tensors
(knowing them up front would hold the whole model on rank 0), so each bucket carries its own
description and the closing ``END`` message carries the totals, which the receiver checks.
Both sides check the kind of each message: a bridge out of step fails naming what it expected.
"""
from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist

__all__ = ["SplitGroups", "init_split", "send_weights", "receive_weights", "send_command", "receive_command", "send_object", "receive_object", "current", "set_current", "close_bridge"]

_PREFIX = "megappo/split/"
_ALIGN = 16  # byte alignment of each tensor in a payload (any dtype can be viewed back in place)

# message kinds (first entry of the control tensor)
_W_START, _W_BUCKET, _W_END, _COMMAND, _OBJECT = 1, 2, 3, 5, 6
_KIND_NAMES = {_W_START: "weights START", _W_BUCKET: "weights BUCKET", _W_END: "weights END",
               _COMMAND: "COMMAND", _OBJECT: "OBJECT"}
_TAG_OBJECT = 8  # tag of send_object's point-to-point messages


@dataclass
class SplitGroups:
    """This process's place in the split job. Default-group ranks are role-local; the fields
    below are job-global unless named otherwise."""

    role: str                       # "train" | "rollout"
    global_rank: int
    global_world: int
    train_ranks: list[int]          # global ranks that train (0 among them)
    rollout_ranks: list[int]        # the others, in order
    bridge: Optional[object]        # backend over [0] + rollout_ranks; None on training ranks > 0
    bridge_rank: Optional[int]      # 0 on global rank 0, 1 + rollout rank on rollout ranks, else None
    device: torch.device            # where tensors for the role group and the bridge live (cuda: NCCL)
    store: object = field(repr=False, default=None)  # the job's store (keeps a hosted TCPStore alive)
    # version bookkeeping of the weight transfers (training ranks: sent; rollout ranks: received)
    weights_version_sent: int = 0
    weights_version_received: int = 0
    # messages that can wait a whole training step: counted on both ends, announced in the store
    commands: int = 0               # rank 0: sent; rollout ranks: received
    objects: int = 0                # rank 0: received; the first rollout rank: sent
    _receiving: bool = field(default=False, repr=False)  # a weight transfer's buckets are not all read yet

    @property
    def role_rank(self) -> int:
        """This rank in its role's default group."""
        ranks = self.train_ranks if self.role == "train" else self.rollout_ranks
        return ranks.index(self.global_rank)

    @property
    def role_world(self) -> int:
        return len(self.train_ranks if self.role == "train" else self.rollout_ranks)

    @property
    def is_sender(self) -> bool:
        """Global rank 0: the training rank that talks to the rollout group over the bridge."""
        return self.global_rank == 0


def init_split(train: "int | list[int]", backend: str = "gloo",
               timeout: datetime.timedelta = datetime.timedelta(minutes=30)) -> SplitGroups:
    """Split the launched job (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
    ``LOCAL_RANK`` from the launcher) into training ranks (``train``: their global ranks, or their
    number: ranks 0..train-1; global rank 0 must train) and rollout ranks (the others, in order);
    make each role's default process group (``backend``: "gloo" or "nccl") and the bridge.
    Collective over the whole job. torch.distributed must not be initialised yet: the default
    group is what this creates."""
    if dist.is_initialized():
        raise RuntimeError(f"init_split: torch.distributed is already initialised (world size {dist.get_world_size()}); "
                           "the split placement must create each role's default process group itself")
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_split: the launcher did not set {missing} (torchrun, srun torchrun and the Ray "
                           "launcher set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCAL_RANK)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    train_ranks = sorted(range(train) if isinstance(train, int) else set(train))
    n_train = len(train_ranks)
    if not 1 <= n_train < world or train_ranks[0] != 0 or train_ranks[-1] >= world:
        raise ValueError(f"init_split: training ranks {train_ranks[:8]}{' ...' if n_train > 8 else ''} out of a "
                         f"world of {world}: need global rank 0 among them and at least one rollout rank")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"init_split: backend must be 'gloo' or 'nccl', got {backend!r}")
    rollout_ranks = [r for r in range(world) if r not in set(train_ranks)]
    role = "train" if rank in train_ranks else "rollout"
    ranks = train_ranks if role == "train" else rollout_ranks
    role_rank = ranks.index(rank)

    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    # torch's own env:// rendezvous: rank 0 hosts the TCPStore (or all join torchrun's agent store)
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
    store.set_timeout(timeout)

    # What the role's libraries read: vLLM's external launcher takes its worker rank from RANK (and
    # its DP rank, when set, from RANK too); megatron and vLLM size their groups by the default group.
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(role_rank), str(len(ranks))
    # no device_id, as in the colocated path (trainer.setup): NCCL communicators are made lazily,
    # the same way in both placements (device_id would make every later group eagerly, by splits)
    dist.init_process_group(backend, store=dist.PrefixStore(f"{_PREFIX}{role}/", store), rank=role_rank,
                            world_size=len(ranks), timeout=timeout)

    bridge = bridge_rank = None
    if rank == 0 or role == "rollout":
        bridge_rank = 0 if rank == 0 else 1 + rollout_ranks.index(rank)
        bridge = _make_bridge(dist.PrefixStore(f"{_PREFIX}bridge/", store), bridge_rank, 1 + len(rollout_ranks),
                              backend, timeout)
    return SplitGroups(role, rank, world, train_ranks, rollout_ranks, bridge, bridge_rank, device, store)


def _make_bridge(store, bridge_rank: int, size: int, backend: str, timeout: datetime.timedelta):
    """The bridge's backend object. Gloo connects its full mesh in the constructor (so this is
    collective over the bridge's members, unless TORCH_GLOO_LAZY_INIT is set); NCCL creates its
    communicator at the first collective, on that tensor's device (this process's current device)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, bridge_rank, size, timeout)
    if not dist.is_nccl_available():
        raise RuntimeError("init_split: backend 'nccl' asked for, but this torch has no NCCL")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    opts.is_high_priority_stream = False
    return dist.ProcessGroupNCCL(store, bridge_rank, size, opts)


# -- weights: global rank 0 -> rollout ranks ----------------------------------------------------
def send_weights(groups: SplitGroups, named_tensors: Iterable, version: int, bucket_bytes: int = 64 << 20) -> dict:
    """Send the model's full HF-named tensors to every rollout rank as weights ``version``.

    Called by EVERY training rank with its own iterator of the same tensors (e.g.
    :func:`megappo.convert.hf_io.iter_hf_tensors`, whose gathers are collective over the training
    ranks): global rank 0 sends, the others only drain theirs. ``version`` must be newer than the
    last version sent (checked on every training rank before anything is iterated, so a refused
    version leaves all of them in step). Buckets hold whole decoder layers (at most ~``bucket_bytes``
    unless one layer is larger). Returns figures on rank 0 (empty elsewhere)."""
    if groups.role != "train":
        raise RuntimeError(f"send_weights runs on training ranks; global rank {groups.global_rank} is a rollout rank")
    version = int(version)
    if version <= groups.weights_version_sent:
        raise ValueError(f"send_weights: weights version {version} is not newer than the last version sent, "
                         f"{groups.weights_version_sent}; versions must increase")
    if not groups.is_sender:
        for _ in named_tensors:  # the collective gathers must run on every training rank
            pass
        groups.weights_version_sent = version
        return {}
    from megappo.convert import layer_buckets

    t0 = time.perf_counter()
    _bridge_bcast(groups, _control(groups, _W_START, version))
    n_buckets = n_bytes = n_tensor_bytes = 0
    for bucket in layer_buckets((_pair(item) for item in named_tensors), bucket_bytes):
        n_tensor_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        meta, payload = _pack(bucket, groups.device)
        _bridge_bcast(groups, _control(groups, _W_BUCKET, meta, payload.numel() - meta))
        _bridge_bcast(groups, payload)
        n_buckets += 1
        n_bytes += payload.numel() - meta
    _bridge_bcast(groups, _control(groups, _W_END, n_buckets, n_bytes))
    groups.weights_version_sent = version
    # rollout/sync_bytes: the tensors' bytes, as a colocated engine reports what it loaded
    return {"split/weights_send_s": time.perf_counter() - t0, "split/weights_bytes": n_bytes,
            "split/weights_buckets": n_buckets, "split/weights_version": version, "rollout/sync_bytes": n_tensor_bytes}


def receive_weights(groups: SplitGroups, expected_version: Optional[int] = None
                    ) -> tuple[int, Iterator[list[tuple[str, torch.Tensor]]]]:
    """On every rollout rank: ``(version, buckets)`` of the transfer :func:`send_weights` makes.
    ``buckets`` yields lists of ``(hf_name, tensor)`` holding whole decoder layers, on this rank's
    device; read it to the end before the next bridge operation (each bucket is received as it is
    read), e.g. ``engine.sync_weights(p for b in buckets for p in b)``.

    Raises ``ValueError`` naming both versions when the version is not newer than the last one
    received, or differs from ``expected_version``; the rejected transfer is received and dropped
    first, so the bridge stays in step and the next transfer can be received."""
    if groups.role != "rollout":
        raise RuntimeError(f"receive_weights runs on rollout ranks; global rank {groups.global_rank} trains")
    if groups._receiving:
        raise RuntimeError("receive_weights: the buckets of the previous transfer were not all read; the bridge "
                           "would be out of step")
    kind, version, _, _ = _bridge_recv_control(groups, _W_START)
    problem = None
    if expected_version is not None and version != expected_version:
        problem = f"expected weights version {expected_version}, the bridge delivered version {version}"
    elif version <= groups.weights_version_received:
        problem = (f"weights version {version} is not newer than the last version received, "
                   f"{groups.weights_version_received} (a sender whose versions went backwards)")
    if problem is not None:
        for _ in _weight_buckets(groups, version, accept=False):
            pass
        raise ValueError(f"receive_weights: {problem}; that transfer was received and dropped")
    groups._receiving = True
    return version, _weight_buckets(groups, version, accept=True)


def _weight_buckets(groups: SplitGroups, version: int, accept: bool) -> Iterator[list[tuple[str, torch.Tensor]]]:
    n_buckets = n_bytes = 0
    while True:
        kind, a, b, _ = _bridge_recv_control(groups, _W_BUCKET, _W_END)
        if kind == _W_END:
            if (a, b) != (n_buckets, n_bytes):
                raise RuntimeError(f"receive_weights: version {version}: the sender reports {a} buckets of {b} bytes, "
                                   f"this rank received {n_buckets} buckets of {n_bytes} bytes")
            break
        payload = torch.empty(a + b, dtype=torch.uint8, device=groups.device)
        _bridge_bcast(groups, payload)
        n_buckets += 1
        n_bytes += b
        if accept:
            desc = _decode_meta(payload, a)
            yield list(_unpack(desc, payload, a))
    if accept:
        groups.weights_version_received = version
        groups._receiving = False


def _pair(item) -> tuple[str, torch.Tensor]:
    if hasattr(item, "kernel"):  # megappo.convert.SyncTensor
        if item.kernel:
            raise ValueError(f"send_weights: {item.name} is a shard in vLLM's kernel layout; the bridge carries full "
                             "HF-named tensors (shard-direct sync needs the colocated placement)")
        return item.name, item.tensor
    return item


# -- payloads ------------------------------------------------------------------------------------
def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _pack(items: list, device: torch.device, extra: Optional[dict] = None) -> tuple[int, torch.Tensor]:
    """One uint8 buffer on ``device``: a JSON description (padded to the alignment), then each
    tensor's bytes at an aligned offset. Returns (description length, buffer)."""
    entries, offset = [], 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, nbytes])
        offset = _aligned(offset + nbytes)
    head = json.dumps({"tensors": entries, **(extra or {})}).encode()
    meta = _aligned(len(head))
    buf = torch.empty(meta + offset, dtype=torch.uint8, device=device)
    buf[:len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    buf[len(head):meta].zero_()  # the reader strips this padding
    for (name, t), (_, _, _, off, nbytes) in zip(items, entries):
        if nbytes:
            buf[meta + off:meta + off + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return meta, buf


def _decode_meta(payload: torch.Tensor, meta: int) -> dict:
    raw = payload[:meta].cpu().numpy().tobytes().rstrip(b"\0")  # JSON has no NUL; padding is NUL
    return json.loads(raw.decode())


def _unpack(desc: dict, payload: torch.Tensor, meta: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of ``payload`` in each tensor's dtype and shape (no copy; they keep the buffer alive)."""
    data = payload[meta:]
    for name, dtype, shape, off, nbytes in desc["tensors"]:
        yield name, data[off:off + nbytes].view(getattr(torch, dtype)).reshape(shape)


# -- messages ------------------------------------------------------------------------------------
def _control(groups: SplitGroups, kind: int, a: int = 0, b: int = 0, c: int = 0) -> torch.Tensor:
    return torch.tensor([kind, a, b, c], dtype=torch.int64, device=groups.device)


def _check_kind(ctrl: torch.Tensor, kinds: tuple, source: str) -> tuple[int, int, int, int]:
    kind, a, b, c = (int(x) for x in ctrl.cpu().tolist())
    if kind not in kinds:
        expected = " or ".join(_KIND_NAMES[k] for k in kinds)
        raise RuntimeError(f"split bridge out of step: expected a {expected} message from {source}, got "
                           f"{_KIND_NAMES.get(kind, f'kind {kind}')} ({a}, {b}, {c})")
    return kind, a, b, c


def _bridge_bcast(groups: SplitGroups, t: torch.Tensor) -> None:
    groups.bridge.broadcast(t, 0).wait()


def _bridge_recv_control(groups: SplitGroups, *kinds: int) -> tuple[int, int, int, int]:
    ctrl = _control(groups, 0)
    _bridge_bcast(groups, ctrl)
    return _check_kind(ctrl, kinds, "training rank 0")


def close_bridge(groups: SplitGroups) -> None:
    """Shut the bridge down once its last message (STOP) went through, on both ends: an NCCL
    communicator left to the interpreter's exit warns (and may hang in its destructor)."""
    if groups.bridge is not None:
        groups.bridge.shutdown()
        groups.bridge = None


# -- the job's groups, commands and objects -------------------------------------------------------
_CURRENT: Optional[SplitGroups] = None


def set_current(groups: Optional[SplitGroups]) -> None:
    """Record this process's split groups (megappo.trainer.init_distributed makes them)."""
    global _CURRENT
    _CURRENT = groups


def current() -> Optional[SplitGroups]:
    """This process's split groups, or None in a colocated job."""
    return _CURRENT


def _bytes_tensor(obj, device) -> torch.Tensor:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(device)


def _from_bytes(t: torch.Tensor):
    import io

    return torch.load(io.BytesIO(t.cpu().numpy().tobytes()), weights_only=False)


# A rollout rank waits for the next command through the whole training phase (and a save), and
# in one-step off the first rollout rank's result waits for rank 0 to collect it after its update;
# the other way, rank 0's first command waits while the rollout ranks still start their engines.
# A collective pending that long would hit the process group's timeout (trainer.dist_timeout_s),
# and gloo and NCCL then abort it and the process. So the parties of each such message meet in the
# job's store first (no timeout that matters), and the collective starts only when all are there.
_STORE_POLL = datetime.timedelta(hours=1)   # each expiry logs a c10d warning: rarely


def _meet(groups: SplitGroups, name: str, bridge_ranks: list[int]) -> None:
    """Block until every bridge rank in ``bridge_ranks`` (this one among them) reached message
    ``name``, however long that takes. A store whose host died raises (the job is over); only the
    store's wait timeout is retried."""
    groups.store.set(f"{_PREFIX}{name}/{groups.bridge_rank}", b"1")
    _wait(groups, [f"{name}/{r}" for r in bridge_ranks])


def _wait(groups: SplitGroups, names: list[str]) -> None:
    keys = [f"{_PREFIX}{n}" for n in names]
    while True:
        try:
            groups.store.wait(keys, _STORE_POLL)
            return
        except dist.DistStoreError as e:
            if "timeout" not in str(e).lower():
                raise


def _bridge_ranks(groups: SplitGroups) -> list[int]:
    return list(range(1 + len(groups.rollout_ranks)))


def send_command(groups: SplitGroups, op: int, obj=None) -> None:
    """Global rank 0 to every rollout rank: command ``op`` (an int > 0) with a picklable ``obj``."""
    if not groups.is_sender:
        raise RuntimeError(f"send_command runs on global rank 0, not {groups.global_rank}")
    payload = _bytes_tensor(obj, groups.device)
    groups.commands += 1
    _meet(groups, f"command/{groups.commands}", _bridge_ranks(groups))
    _bridge_bcast(groups, _control(groups, _COMMAND, int(op), payload.numel()))
    _bridge_bcast(groups, payload)


def receive_command(groups: SplitGroups) -> tuple[int, object]:
    """On every rollout rank: the next (op, obj) of :func:`send_command` (blocks until it comes,
    however long the training ranks take)."""
    groups.commands += 1
    _meet(groups, f"command/{groups.commands}", _bridge_ranks(groups))
    _, op, n, _ = _bridge_recv_control(groups, _COMMAND)
    payload = torch.empty(n, dtype=torch.uint8, device=groups.device)
    _bridge_bcast(groups, payload)
    return op, _from_bytes(payload)


def send_object(groups: SplitGroups, obj) -> None:
    """The first rollout rank to global rank 0: a picklable object (tensors included), point to point."""
    if groups.bridge_rank != 1:
        raise RuntimeError(f"send_object runs on the first rollout rank, not global rank {groups.global_rank}")
    payload = _bytes_tensor(obj, groups.device)
    groups.objects += 1
    _meet(groups, f"object/{groups.objects}", [0, 1])
    groups.bridge.send([_control(groups, _OBJECT, payload.numel())], 0, _TAG_OBJECT).wait()
    groups.bridge.send([payload], 0, _TAG_OBJECT).wait()


def receive_object(groups: SplitGroups):
    """On every training rank: what :func:`send_object` sent (global rank 0 receives it over the
    bridge and broadcasts it over the training group)."""
    groups.objects += 1
    name = f"object/{groups.objects}"
    if groups.is_sender:
        _meet(groups, name, [0, 1])
        ctrl = _control(groups, 0)
        groups.bridge.recv([ctrl], 1, _TAG_OBJECT).wait()
        _, n, _, _ = _check_kind(ctrl, (_OBJECT,), "the first rollout rank")
        payload = torch.empty(n, dtype=torch.uint8, device=groups.device)
        groups.bridge.recv([payload], 1, _TAG_OBJECT).wait()
        obj = _from_bytes(payload)
        groups.store.set(f"{_PREFIX}{name}/received", b"1")
    else:
        # the generation can outlast the training group's timeout: join the broadcast once it is here
        _wait(groups, [f"{name}/received"])
        obj = None
    if len(groups.train_ranks) > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        obj = box[0]
    return obj
