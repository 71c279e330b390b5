"""No process outlives the test suite (a pytest plugin, loaded by tests/conftest.py).

A rank that is SIGKILLed mid-run (the fault-injection tests do it on purpose; a timeout does it
by accident) leaves whatever it started running, re-parented to init where nothing will end it:
on a developer machine such processes pile up, in CI they outlive the job. So the pytest process
becomes a child subreaper (Linux's PR_SET_CHILD_SUBREAPER): orphans of its descendants are
re-parented to it instead, :func:`end_new_descendants` ends those a spawned world left behind,
and at the end of the session any descendant still alive fails the run, named, and is ended."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

import pytest

# Helpers that belong to the pytest process itself and exit with it.
_OWN_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "torch._inductor.compile_worker")


def set_child_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    pr_set_child_subreaper = 36
    return ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0) == 0


def _live(p) -> bool:
    import psutil

    try:
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        # a process forked from the forkserver (a test rank) has its command line: only the
        # server itself, a child of this process, is a helper
        helper = any(h in " ".join(p.cmdline()) for h in _OWN_HELPERS)
        return not helper or ("multiprocessing.forkserver" in " ".join(p.cmdline()) and p.ppid() != os.getpid())
    except psutil.Error:   # gone meanwhile
        return False


def descendants() -> list:
    """Live descendants of this process (psutil.Process), own helpers and zombies left out."""
    import psutil

    return [p for p in psutil.Process().children(recursive=True) if _live(p)]


def end(procs: list) -> None:
    """SIGKILL ``procs`` and reap the ones that were re-parented to this process."""
    import psutil

    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    for p in procs:
        try:
            if p.ppid() == os.getpid():
                os.waitpid(p.pid, 0)
        except (psutil.Error, ChildProcessError):
            pass


def end_new_descendants(before: set) -> list:
    """End the descendants that are not in ``before`` (pids): what a blocking call that should
    have left nothing running left behind. Returns their descriptions."""
    left = [p for p in descendants() if p.pid not in before]
    named = [describe(p) for p in left]
    end(left)
    return named


def describe(p) -> str:
    import psutil

    try:
        return f"pid {p.pid} (parent {p.ppid()}, {p.memory_info().rss >> 20} MiB): {' '.join(p.cmdline())[:160]}"
    except psutil.Error:
        return f"pid {p.pid} (gone)"


def die_with_parent() -> None:
    """In a child: SIGKILL when the parent dies (a killed test session takes its ranks along)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def _end_all_then_exit(signum, frame):
    """A test session stopped with SIGTERM (a CI or shell timeout) ends its descendants first."""
    end(descendants())
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def pytest_configure(config):
    set_child_subreaper()
    signal.signal(signal.SIGTERM, _end_all_then_exit)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    # processes on their way out (a just-closed engine) get a moment
    deadline = time.monotonic() + float(os.environ.get("TESTS_SURVIVOR_GRACE_S", "20"))
    left = descendants()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = descendants()
    if not left:
        return
    named = [describe(p) for p in left]
    end(left)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(named)} process(es) outlived the test session (ended now):"] + [f"  {n}" for n in named]
    if reporter is not None:
        reporter.write_line("")
        for line in lines:
            reporter.write_line(line, red=True)
    else:
        print("\n".join(lines), file=sys.stderr)
    if session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
