"""Heartbeat and watchdog: a rank that stops (SIGSTOP, a frozen or lost machine) ends the job in
minutes instead of holding every other rank for ``trainer.dist_timeout_s``.

Each rank runs a daemon thread. Every few seconds it writes this rank's beat -- a counter, the
phase and step the main thread is in, the host and pid -- to the job's store, through a client
connection of its own (the main thread's store calls may block for a whole phase; this one never
waits behind them). A second thread, the guard, ends the job when no store round has completed
for the silence: a client call to a stopped store host can block past its own timeout. Global
rank 0 reads every rank's beat (one ``multi_get``), the other ranks read rank 0's: O(world) store
operations per interval in all. A beat whose counter has not changed for ``trainer.watchdog_silence_s``
(``trainer.watchdog_slow_phase_s`` in a phase declared slow) makes the watcher print one line
naming the silent rank and exit its process non-zero, which torchrun, ``srun --kill-on-bad-exit``
and the Ray launcher turn into the end of the job. Silence is measured on the watcher's own clock
(when it last saw the counter move), so hosts' clocks need not agree.

The main thread only sets a module variable on entering a phase (:func:`phase`, which
:class:`megappo.metrics.Timer` calls for every timed phase) and wakes the thread to publish it:
nothing on the hot path touches the store.

A rank whose main thread is blocked (a deadlocked collective, a hung reward or tool call) still
beats. So each beat also carries how long the main thread has been *blocked*: its innermost
Python frame has not moved and it has used no CPU time (read from /proc) since then. Rank 0 ends
the job when every live rank has been blocked for the silence (the slow allowance while any rank
is in a slow phase, in the user's reward code -- which may wait on a pool or a remote sandbox for
minutes -- or still starting): nobody is computing, so nobody will. The message lists
the ranks by phase, the odd one out first -- the rank in ``reward`` while the others wait in a
collective is the one to look at. Not caught this way: a rank spinning in Python (its frames
move), or one waiting on a GPU with a spinning synchronisation (it uses CPU time); those end at
``trainer.dist_timeout_s``."""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Optional

__all__ = ["phase", "in_phase", "current", "set_step", "start", "stop", "Watchdog", "SLOW", "USER"]

SLOW = "slow"   # phase(name, allowance=SLOW): the silence allowed is trainer.watchdog_slow_phase_s
# phase(name, allowance=USER): the user's code (a reward function) may wait long on work done
# elsewhere (a thread pool, a remote sandbox): blocked, it is allowed trainer.watchdog_slow_phase_s
USER = "user"
_PREFIX = "megappo/heartbeat/"
# (phase, step, allowance): replaced whole, so the beat thread always reads a consistent triple
_now: tuple = ("start", 0, None)
_current: Optional["Watchdog"] = None


@contextmanager
def phase(name: str, allowance=None):
    """The main thread is in phase ``name`` until the block ends (then back in the enclosing one).
    ``allowance``: :data:`SLOW` for a phase that may legitimately hold the interpreter (no beats) for long."""
    global _now
    before = _now
    _now = (name, before[1], allowance if allowance is not None else before[2])
    if _current is not None:
        _current.wake.set()   # published by the thread now, not at its next beat
    try:
        yield
    finally:
        _now = (before[0], _now[1], before[2])


def in_phase(name: str, allowance=None):
    """Decorator: the whole call is phase ``name`` (see :func:`phase`)."""
    import functools

    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with phase(name, allowance):
                return fn(*args, **kwargs)
        return call
    return wrap


def current() -> tuple[str, int]:
    """(the phase, the step) the main thread is in."""
    return _now[0], _now[1]


def set_step(step: int) -> None:
    global _now
    _now = (_now[0], step, _now[2])


class Watchdog:
    """One rank's beat and watch (see the module's docstring). ``connect()`` returns a store client
    whose operations time out after a few seconds; ``end(message)`` ends the process."""

    def __init__(self, connect: Callable, rank: int, world: int, silence: float, slow: float,
                 interval: Optional[float] = None, end: Optional[Callable[[str], None]] = None,
                 clock: Callable[[], float] = time.monotonic, activity: Optional[Callable[[], tuple]] = None):
        self.connect, self.rank, self.world, self.silence = connect, rank, world, silence
        self.slow = max(slow, silence)   # an allowance, never less than the plain silence
        self.interval = interval or max(0.5, min(5.0, silence / 4))
        self.end, self.clock = end or _end_process, clock
        self.prefix = f"{_PREFIX}{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"   # a restarted job's own keys
        self.host, self.pid, self.beats = socket.gethostname(), os.getpid(), 0
        self.watched = list(range(world)) if rank == 0 else [0]
        self.seen: dict[int, tuple] = {}      # rank -> (value, when it last changed, on our clock)
        self.store, self.store_ok, self.last_loop = None, clock(), None
        self.activity = activity or main_thread_activity(threading.main_thread())
        self.last_activity, self.blocked_since = None, clock()
        self.done, self.wake = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._loop, name="megappo-watchdog", daemon=True)
        self.guard = threading.Thread(target=self._guard, name="megappo-watchdog-guard", daemon=True)

    def beat_value(self, blocked: float = 0.0) -> str:
        name, step, allowance = _now
        return f"{self.beats}|{name}|{step}|{allowance or ''}|{self.host}|{self.pid}|{blocked:.0f}"

    def blocked_for(self, now: float) -> float:
        """Seconds the main thread has not moved (same frame and instruction) nor used CPU time."""
        act = self.activity()
        last = self.last_activity
        if act is None or last is None or act[0] != last[0] or act[1] - last[1] > _CPU_EPS:
            self.blocked_since = now
        self.last_activity = act
        return now - self.blocked_since

    def tick(self) -> None:
        """One round: publish this rank's beat, read the watched ones, end the job on a silence."""
        if self.done.is_set():
            return
        now = self.clock()
        if self.last_loop is not None and now - self.last_loop > 3 * self.interval + 1:
            # this thread itself was held (a slow phase here): what it saw is stale, judge afresh
            self.seen = {r: (v, now) for r, (v, _) in self.seen.items()}
            self.store_ok = self.blocked_since = now
        self.last_loop = now
        try:
            if self.store is None:
                self.store = self.connect()
            self.beats += 1
            self.store.set(f"{self.prefix}{self.rank}", self.beat_value(self.blocked_for(now)))
            self._read(now)
            self.store_ok = now
        except Exception as e:   # a store that stopped answering: its host is stopped or gone
            self.store = None
            self.judge_store(now, f" ({type(e).__name__}: {e})")
            return
        self._judge(now)

    def judge_store(self, now: float, why: str = "") -> None:
        """End the job when no store round has completed for the silence. Called by the guard
        thread too: a client call to a stopped store host may block past its own timeout."""
        quiet = now - self.store_ok
        if quiet > self.silence and 0 not in self._finished() and not self.done.is_set():
            who = self.describe(0, self.seen.get(0, ("",))[0])
            self._fire(f"megappo: rank {self.rank}: the job's store has not answered for {quiet:.0f} s{why}; "
                       f"{who}; ending the job")

    def _read(self, now: float) -> None:
        keys = [r for r in self.watched if r != self.rank and not self._is_done(r)]
        new = [r for r in keys if r not in self.seen]
        known = [r for r in keys if r in self.seen]
        for r in new:   # a rank not started yet has no key: check before reading (a get would block)
            if self.store.check([f"{self.prefix}{r}"]):
                self.seen[r] = (self.store.get(f"{self.prefix}{r}").decode(), now)
        if known:
            for r, v in zip(known, self.store.multi_get([f"{self.prefix}{r}" for r in known])):
                v = v.decode()
                if v != self.seen[r][0]:
                    self.seen[r] = (v, now)

    def _is_done(self, r: int) -> bool:
        return r in self.seen and self.seen[r][0].startswith("done|")

    def _finished(self) -> set:
        return {r for r in self.seen if self._is_done(r)}

    def _judge(self, now: float) -> None:
        for r, (value, since) in self.seen.items():
            if self._is_done(r):
                continue
            parts = value.split("|")
            limit = self.slow if parts[3] == "slow" else self.silence
            if now - since > limit:
                self._fire(f"megappo: {self.describe(r, value)}, silent for {now - since:.0f} s; ending the job")
                return
        if self.rank == 0:
            self._judge_blocked(now)

    def _judge_blocked(self, now: float) -> None:
        """Every rank alive (its beat fresh) and blocked for the limit: a deadlock or a hung call."""
        if len(self.seen) < self.world - 1 or self._finished():
            return
        fresh = 3 * self.interval + 1
        beats = {0: self.beat_value(now - self.blocked_since)}
        beats.update({r: v for r, (v, since) in self.seen.items() if now - since <= fresh})
        if len(beats) < self.world:
            return   # a silent rank is the silence rule's to name
        parts = {r: v.split("|") for r, v in beats.items()}
        if any(len(p) < 7 for p in parts.values()):
            return
        slow = any(p[3] in (SLOW, USER) or p[1] == "start" for p in parts.values())
        limit = self.slow if slow else self.silence
        # each beat says how long its rank had been blocked when written (up to an interval ago)
        least = min(float(p[6]) for p in parts.values())
        if least > limit:
            self._fire(f"megappo: every rank has been blocked for {least:.0f} s or more (no rank is computing: "
                       f"a deadlocked collective or a hung call): {_by_phase(parts)}; ending the job")

    def _fire(self, message: str) -> None:
        self.done.set()   # one verdict (a test's end() returns; the process's never does)
        self.end(message)

    @staticmethod
    def describe(r: int, value: str) -> str:
        parts = value.split("|")
        if len(parts) < 6:
            return f"rank {r} (never heard from)"
        return f"rank {r} (host {parts[4]}, pid {parts[5]}) last in phase {parts[1]} of step {parts[2]}"

    def _loop(self) -> None:
        while not self.done.is_set():
            self.wake.wait(self.interval)
            self.wake.clear()
            self.tick()

    def _guard(self) -> None:
        last = self.clock()
        while not self.done.wait(self.interval):
            now = self.clock()
            if now - last > 3 * self.interval + 1:   # held itself (a slow phase here): judge afresh
                self.store_ok = max(self.store_ok, now)
            last = now
            self.judge_store(now)

    def finish(self) -> None:
        """This rank is done: say so (its silence from now on is no fault) and stop the thread."""
        self.done.set()
        self.wake.set()
        try:
            (self.store or self.connect()).set(f"{self.prefix}{self.rank}", f"done|{self.beat_value()}")
        except Exception:
            pass


_CPU_EPS = 0.05   # CPU seconds between two beats that count as work (a blocked wait uses ~none)


def main_thread_activity(thread: threading.Thread) -> Callable[[], Optional[tuple]]:
    """A sampler of ``thread``'s activity: (its innermost frame and instruction, its CPU seconds).
    None when it cannot be read (then the rank never counts as blocked)."""
    stat = f"/proc/self/task/{thread.native_id}/stat"
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def sample() -> Optional[tuple]:
        frame = sys._current_frames().get(thread.ident)
        if frame is None:
            return None
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / tick   # utime + stime, fields 14 and 15
        except (OSError, IndexError, ValueError):
            return None
        return (id(frame.f_code), frame.f_lasti, frame.f_lineno), cpu
    return sample


def _by_phase(parts: dict) -> str:
    """Ranks grouped by (phase, step), the smallest group first: the odd one out leads."""
    groups: dict[tuple, list] = {}
    for r, p in sorted(parts.items()):
        groups.setdefault((p[1], p[2]), []).append(r)
    out = []
    for (name, step), ranks in sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1][0])):
        who = (", ".join(f"rank {r} (host {parts[r][4]}, pid {parts[r][5]})" for r in ranks) if len(ranks) == 1
               else f"ranks {', '.join(map(str, ranks))}")
        out.append(f"{who} in phase {name} of step {step}")
    return "; ".join(out)


def _end_process(message: str) -> None:
    """Print ``message``, report it to the Ray launcher, and end this process at once (the main
    thread may be blocked in a collective with the silent rank: nothing else would return)."""
    print(message, file=sys.stderr, flush=True)
    path = os.environ.get("MEGAPPO_FAILURE_FILE")
    if path:
        import json

        try:
            with open(path, "w") as f:
                json.dump({"time": time.time(), "error": message[:500]}, f)
        except OSError:
            pass
    sys.stdout.flush()
    os._exit(1)


def start(rank: int, world: int, silence: float, slow: float, timeout: float = 5.0) -> Optional[Watchdog]:
    """Start this rank's watchdog on the job's store at MASTER_ADDR:MASTER_PORT (torchrun's agent
    store, or the one global rank 0 hosts under srun and the Ray launcher: the split placement's
    roles share it too). None when disabled (``silence`` 0) or when there is no one else to watch."""
    global _current
    stop()
    if silence <= 0 or world < 2 or "MASTER_ADDR" not in os.environ:
        return None
    import datetime

    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])

    def connect():
        return dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=timeout),
                             wait_for_workers=False)

    _current = Watchdog(connect, rank, world, silence, slow, interval=max(0.5, min(5.0, silence / 4, timeout)))
    _current.thread.start()
    _current.guard.start()
    return _current


def stop() -> None:
    """This rank finished: its watchdog says so and stops (another rank may still be tearing down)."""
    global _current
    if _current is not None:
        _current.finish()
        _current = None
