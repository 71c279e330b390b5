"""Reward functions in worker processes with a time limit per sample (verl's prime reward manager).

A math verifier that loops forever on one odd answer, or one that crashes its interpreter, would
stop the run; here each sample is scored in one of a few worker processes (spawned once, reused
across steps), and a sample that runs past ``timeout_s`` has its worker killed and replaced and
scores 0, as does one whose function raises or whose worker dies (verl's prime semantics).
Each worker owns its pipe, so killing one never corrupts another's messages.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Optional

__all__ = ["RewardPool", "PoolOutcome", "default_workers"]


def default_workers() -> int:
    """This rank's share of the node's CPUs (the node's training ranks score at once), at most
    verl's 64."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:   # (not on Linux)
        cpus = os.cpu_count() or 1
    return max(1, min(64, cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))


@dataclass
class PoolOutcome:
    results: list                                  # per task: (where the function came from, what it returned); None: failed
    failed: dict = field(default_factory=dict)     # task position -> why (timed out, raised, worker died)
    timed_out: int = 0


def _die_with(parent: int) -> None:
    """Linux: this worker is killed when the trainer process ends, however it ends (a worker busy
    in a hung verifier never reads the end of its pipe). The pool starts its workers from the
    trainer's main thread, whose end is the process's."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):   # not Linux: the pipe's end stops an idle worker
        pass
    if os.getppid() != parent:          # the trainer ended before the line above ran
        os._exit(0)


def _serve(spec: Optional[tuple], conn, parent: int) -> None:
    """A worker: load the function once, then score (position, args) messages until None."""
    from .registry import load_custom_reward, resolve_reward

    _die_with(parent)
    try:
        custom = load_custom_reward(*spec) if spec is not None else None
    except Exception as e:  # noqa: BLE001 - the trainer says why
        conn.send(("failed", None, f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None, None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):   # the trainer is gone: so is this worker
            return
        if msg is None:
            return
        pos, i, (ds, sol, gt, extra) = msg
        where = "the reward function"
        try:
            fn, where, args = resolve_reward(ds, sol, gt, extra, custom, i)
            conn.send(("ok", pos, (where, fn(*args))))
        except BaseException as e:  # noqa: BLE001 - any failure scores 0 (verl's prime), reported to the caller
            conn.send(("err", pos, f"{where} raised on sample {i} (data_source={ds!r}): {type(e).__name__}: {e}"))


class RewardPool:
    """``score(tasks)`` -> :class:`PoolOutcome` over ``workers`` processes. ``spec``: (path,
    name, reward_kwargs) of a custom reward function (loaded in each worker), None: the built-in
    rules by data_source. Workers start at the first call; :meth:`close` stops them (they are
    daemonic: the interpreter's exit stops them too)."""

    def __init__(self, workers: int, timeout_s: float, spec: Optional[tuple] = None):
        self.n, self.timeout_s, self.spec = workers, timeout_s, spec
        self.ctx = mp.get_context("spawn")   # no fork of a process holding vLLM's and torch's threads
        self.procs: list = [None] * workers
        self.conns: list = [None] * workers

    def _start(self, w: int) -> None:
        ours, theirs = self.ctx.Pipe()
        p = self.ctx.Process(target=_serve, args=(self.spec, theirs, os.getpid()), daemon=True,
                             name=f"megappo-reward-{w}")
        p.start()
        theirs.close()
        self.procs[w], self.conns[w] = p, ours

    def _stop(self, w: int, grace: float = 0.0) -> None:
        p, c = self.procs[w], self.conns[w]
        if p is not None:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        if c is not None:
            c.close()
        self.procs[w] = self.conns[w] = None

    def _ensure(self) -> None:
        """Start the workers not running (all at once, then wait for each to have loaded the function)."""
        new = [w for w in range(self.n) if self.procs[w] is None or not self.procs[w].is_alive()]
        for w in new:
            self._stop(w)
            self._start(w)
        for w in new:
            self._wait_ready(w)

    def _replace(self, w: int) -> None:
        self._stop(w)
        self._start(w)
        self._wait_ready(w)

    def score(self, tasks: list[tuple]) -> PoolOutcome:
        """``tasks``: (sample number, (data_source, solution, ground_truth, extra_info)) each."""
        self._ensure()
        out = PoolOutcome([None] * len(tasks))
        todo = list(range(len(tasks)))[::-1]
        running: dict[int, tuple[int, float]] = {}   # worker -> (task position, start)

        def fail(w: int, why: str, late: bool = False) -> None:
            """The task worker ``w`` runs scores 0; the worker is replaced (its state is unknown)."""
            pos, _ = running.pop(w)
            i, (ds, *_) = tasks[pos]
            out.failed[pos] = f"sample {i} (data_source={ds!r}): {why}"
            out.timed_out += late
            self._replace(w)

        while todo or running:
            for w in range(self.n):
                if w not in running and todo:
                    pos = todo.pop()
                    try:
                        self.conns[w].send((pos, *tasks[pos]))
                    except (OSError, ValueError):   # an idle worker died: a new one takes the task
                        todo.append(pos)
                        self._replace(w)
                        continue
                    except Exception as e:  # noqa: BLE001 - the task cannot be sent (pickling)
                        i, (ds, *_) = tasks[pos]
                        out.failed[pos] = f"sample {i} (data_source={ds!r}): cannot be sent: {type(e).__name__}: {e}"
                        self._replace(w)
                        continue
                    running[w] = (pos, time.monotonic())
            if not running:
                continue
            soonest = min(t0 for _, t0 in running.values()) + self.timeout_s
            for c in wait([self.conns[w] for w in running], timeout=max(0.0, min(1.0, soonest - time.monotonic()))):
                w = self.conns.index(c)
                try:
                    kind, pos, value = c.recv()
                except (EOFError, OSError):
                    self.procs[w].join(timeout=5)
                    fail(w, f"its worker died (exit code {self.procs[w].exitcode})")
                    continue
                except Exception as e:  # noqa: BLE001 - a result that does not unpickle here
                    fail(w, f"its result could not be read: {type(e).__name__}: {e}")
                    continue
                running.pop(w)
                if kind == "ok":
                    out.results[pos] = value
                else:
                    out.failed[pos] = value
            now = time.monotonic()
            for w, (pos, t0) in list(running.items()):
                if now - t0 > self.timeout_s:
                    fail(w, f"timed out after {self.timeout_s:g} s", late=True)
                elif not self.procs[w].is_alive():
                    fail(w, f"its worker died (exit code {self.procs[w].exitcode})")
        return out

    def _wait_ready(self, w: int) -> None:
        """A worker that cannot load the function (it loaded in the trainer: an environment the
        worker lacks) stops the pool with a message naming the function."""
        why = "no word from it in 120 s"
        try:
            if self.conns[w].poll(120):
                kind, _, text = self.conns[w].recv()
                if kind == "ready":
                    return
                why = text
        except (EOFError, OSError):
            self.procs[w].join(timeout=5)
            why = f"it exited with code {self.procs[w].exitcode}"
        self.close()
        raise RuntimeError(f"reward worker {w} did not start: it loads "
                           f"{self.spec[0] if self.spec else 'megappo.rewards'} in a new process: {why}")

    def close(self) -> None:
        for w in range(self.n):
            if self.conns[w] is not None and self.procs[w] is not None and self.procs[w].is_alive():
                try:
                    self.conns[w].send(None)
                except OSError:
                    pass
        for w in range(self.n):
            self._stop(w, grace=5.0)
