"""A Python executor for model-written code: a subprocess under resource limits.

What it enforces (tests/unit/test_tool_sandbox.py checks each on the machine it runs on):

- **CPU time**: ``RLIMIT_CPU`` per process (the kernel kills it with SIGXCPU).
- **Memory**: ``RLIMIT_AS`` (address space) per process: a large allocation raises MemoryError.
- **Wall clock**: the code leads its own process group; past ``wall_s`` the whole group is
  killed, and (when started as root) every process left under its user id too.
- **Processes**: ``RLIMIT_NPROC``. When started as root, each run gets a fresh unused user id
  (no file of the system belongs to it), so the limit counts only that run's processes and a
  fork bomb stops at ``max_processes``. Not as root, the limit counts all of the user's processes
  (threads included) and is set to that count plus ``max_processes`` when the run starts, a guard
  rather than a bound.
- **Output**: stdout and stderr go to files capped by ``RLIMIT_FSIZE`` (``max_output_bytes``; the
  kernel stops a process that writes past it) and the answer keeps ``max_output_chars``.
- **Files**: the working directory is a fresh temporary directory (removed afterwards); as root,
  the code runs under its own user id, so it cannot write to what root or another user owns
  unless the mode allows everyone (the usual state of the system: it can *read* what is
  world-readable). With a private mount namespace (root), ``/tmp``, ``/var/tmp`` and ``/dev/shm``
  are fresh empty tmpfs mounts for the run, so the world-writable places are private too.
  Without root none of this holds: the code can write wherever the trainer's user can.
- **Network**: a new network namespace (only a loopback, down) when the kernel allows it: as
  root, or through an unprivileged user namespace otherwise.
- ``PR_SET_NO_NEW_PRIVS``: a set-uid program cannot give the code privileges back.
- The interpreter is the trainer's, with its site-packages on ``PYTHONPATH``; where other users
  cannot reach it (e.g. a Python under ``/root``) it is bind-mounted into the private ``/tmp``,
  and without a mount namespace such a run is refused (as root the code would otherwise run as
  root, with no process limit).

Not enforced: reads of world-readable files, kernel attack surface (no seccomp filter), disk
space outside the capped files in world-writable places when no mount namespace was made. What a
run achieved is in :attr:`PythonSandbox.last_isolation` (and in the tool's metrics).
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from .base import Tool, function_schema

# Runs in the fresh child process (single-threaded, so no preexec_fn in a threaded parent): it
# takes the namespaces and limits, drops to the run's user id, reports what it achieved on fd 3
# and replaces itself with the interpreter running the code.
_BOOTSTRAP = r'''
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
got = {"netns": False, "mountns": False, "private_tmp": False, "uid": os.getuid()}
NEWNS, NEWNET, NEWUSER, MS_BIND, MS_REC, MS_PRIVATE = 0x20000, 0x40000000, 0x10000000, 4096, 16384, 1 << 18
root = os.geteuid() == 0
if root and libc.unshare(NEWNS | NEWNET) == 0:
    got["netns"] = got["mountns"] = True
elif libc.unshare(NEWNET if root else NEWUSER | NEWNET) == 0:
    got["netns"] = True
os.chdir(cfg["cwd"])
exe, path = cfg["exe"], cfg["path"]
if got["mountns"] and libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0:
    ok = True
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(d):
            ok &= libc.mount(b"tmpfs", d.encode(), b"tmpfs", 0, b"size=64m,mode=1777") == 0
    got["private_tmp"] = bool(ok)
if got["private_tmp"]:
    # the interpreter and its packages where the run's user can reach them (their parents may be
    # closed to other users, e.g. under /root)
    for i, src in enumerate(cfg["binds"]):
        dst = f"/tmp/.megappo-python-{i}"
        os.mkdir(dst, 0o755)
        if libc.mount(src.encode(), dst.encode(), None, MS_BIND | MS_REC, None) != 0:
            sys.exit(f"sandbox: cannot bind {src}")
        exe = exe.replace(src, dst, 1)
        path = [p.replace(src, dst, 1) for p in path]
    # the working directory may lie under a path the tmpfs now hides: bind it (from the cwd,
    # which still points at it) to a fixed place
    os.mkdir("/tmp/work", 0o755)
    if libc.mount(b".", b"/tmp/work", None, MS_BIND, None) != 0:
        sys.exit("sandbox: cannot bind the working directory")
    os.chdir("/tmp/work")
    cfg["env"].update(HOME="/tmp/work", TMPDIR="/tmp/work")
if root and not cfg["reachable"] and not got["private_tmp"]:
    sys.exit("sandbox: the interpreter is not reachable by another user and no mount namespace could be made")
lim = resource.setrlimit
lim(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
lim(resource.RLIMIT_AS, (cfg["mem"], cfg["mem"]))
lim(resource.RLIMIT_FSIZE, (cfg["fsize"], cfg["fsize"]))
lim(resource.RLIMIT_NOFILE, (64, 64))
lim(resource.RLIMIT_CORE, (0, 0))
lim(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))
libc.prctl(38, 1, 0, 0, 0)
if root:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
    got["uid"] = os.getuid()
env = dict(cfg["env"], PYTHONPATH=os.pathsep.join(path))
os.write(cfg["fd"], json.dumps(got).encode())
os.close(cfg["fd"])
os.execve(exe, [exe, "-s", "-B", "main.py"], env)
'''

_UIDS = itertools.count()


def _fresh_uid() -> int:
    # A user id nothing on the system owns: RLIMIT_NPROC then counts this run's processes only,
    # and everything left under it after the run can be killed.
    return 1_500_000_000 + (os.getpid() % 100_000) * 1000 + next(_UIDS) % 1000


def _tasks_of(uid: int) -> list[int]:
    """Live processes (not zombies, which only their parent can clear) whose real user id is ``uid``."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                fields = dict(line.split(":", 1) for line in (p / "status").read_text().splitlines() if ":" in line)
                if int(fields["Uid"].split()[0]) == uid and fields["State"].split()[0] not in ("Z", "X"):
                    pids.append(int(p.name))
            except (OSError, ValueError, KeyError):
                pass
    return pids


def _kill_all(pgid: int, uid: Optional[int]) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for _ in range(20 if uid is not None else 0):     # forks that left the group (setsid) too
        pids = _tasks_of(uid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _reachable(path: str) -> bool:
    """Whether a user with no rights but 'others' can reach ``path`` (every parent searchable)."""
    p = Path(path)
    for d in [p, *p.parents]:
        try:
            if not d.stat().st_mode & 0o001:
                return False
        except OSError:
            return False
    return True


def _interpreter() -> dict:
    """The interpreter the code runs on, its packages, and which of them need a bind mount."""
    import site

    exe = os.path.realpath(sys.executable)
    base = os.path.realpath(sys.base_prefix)
    path = [os.path.realpath(p) for p in site.getsitepackages() if os.path.isdir(p)]
    roots = [base] + [p for p in path if not p.startswith(base + os.sep)]
    binds = [r for r in roots if not _reachable(r)]
    return {"exe": exe, "path": path, "binds": binds, "reachable": not binds}


def _user_task_count() -> int:
    if not os.path.isdir("/proc"):
        return 0
    return len([t for p in _tasks_of(os.getuid()) for t in os.listdir(f"/proc/{p}/task")])


class PythonSandbox(Tool):
    """Runs the ``code`` argument as a Python program; answers with its output and how it ended.

    ``config`` keys (all optional): ``cpu_s`` (2), ``wall_s`` (5), ``memory_mb`` (1024),
    ``max_processes`` (16), ``max_output_bytes`` (1 MiB), ``max_output_chars`` (4000).
    """

    DEFAULTS = dict(cpu_s=2, wall_s=5.0, memory_mb=1024, max_processes=16, max_output_bytes=1 << 20,
                    max_output_chars=4000)

    def __init__(self, config: Optional[dict] = None, tool_schema: Optional[dict] = None):
        super().__init__(config, tool_schema or function_schema(
            "python", "Run a Python program and return what it prints (stdout, then stderr).",
            {"code": {"type": "string", "description": "the program; print what you want to see"}}, ["code"]))
        unknown = set(self.config) - set(self.DEFAULTS) - {"type"}
        if unknown:
            raise ValueError(f"PythonSandbox: unknown config key(s) {sorted(unknown)}; known: {sorted(self.DEFAULTS)}")
        self.limits = {**self.DEFAULTS, **{k: v for k, v in self.config.items() if k in self.DEFAULTS}}
        self.last_isolation: dict = {}

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[str, float, dict]:
        text, info = self.run(parameters["code"])
        return text, 0.0, info

    def run(self, code: str) -> tuple[str, dict]:
        """The answer text and facts of the run: ``ending`` (exit, cpu_limit, wall_limit,
        output_limit, signal), ``returncode``, ``seconds`` and the isolation achieved."""
        lim = self.limits
        root = os.geteuid() == 0
        uid = _fresh_uid() if root else None
        work = Path(tempfile.mkdtemp(prefix="megappo-sandbox-"))
        private = Path(tempfile.mkdtemp(prefix="megappo-sandbox-io-"))     # outputs: the parent's only
        try:
            (work / "main.py").write_text(code, encoding="utf-8")
            if root:
                os.chown(work, uid, uid)
                os.chown(work / "main.py", uid, uid)
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
                   "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                   "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            nproc = lim["max_processes"] if root else _user_task_count() + lim["max_processes"]
            cfg = dict(cwd=str(work), uid=uid, env=env, **_interpreter(), cpu_s=int(lim["cpu_s"]),
                       mem=int(lim["memory_mb"]) << 20,
                       fsize=int(lim["max_output_bytes"]), nproc=int(nproc))
            return self._spawn(cfg, private, uid)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(private, ignore_errors=True)

    def _spawn(self, cfg: dict, private: Path, uid: Optional[int]) -> tuple[str, dict]:
        lim = self.limits
        r, w = os.pipe()
        cfg = dict(cfg, fd=w)
        with open(private / "out", "wb") as out, open(private / "err", "wb") as err:
            start = time.perf_counter()
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _BOOTSTRAP, json.dumps(cfg)],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, pass_fds=(w,),
                                    start_new_session=True, cwd=cfg["cwd"], env={"PATH": cfg["env"]["PATH"]})
            os.close(w)
            try:
                rc = proc.wait(timeout=lim["wall_s"])
                walled = False
            except subprocess.TimeoutExpired:
                walled = True
            _kill_all(proc.pid, uid)
            rc = proc.wait()
            seconds = time.perf_counter() - start
        with os.fdopen(r, "rb") as f:
            reported = f.read()
        iso = json.loads(reported) if reported else {"netns": False, "mountns": False, "private_tmp": False,
                                                     "uid": None}     # the bootstrap stopped early
        self.last_isolation = iso
        return self._answer(private, rc, walled, seconds, iso)

    def _answer(self, private: Path, rc: int, walled: bool, seconds: float, iso: dict) -> tuple[str, dict]:
        lim = self.limits
        out_b, err_b = (private / "out").read_bytes(), (private / "err").read_bytes()
        out, err = out_b.decode("utf-8", "replace"), err_b.decode("utf-8", "replace")
        if walled:
            ending, note = "wall_limit", f"[killed: wall-clock limit of {lim['wall_s']:g} s]"
        elif rc == -signal.SIGXCPU or rc == -signal.SIGKILL and seconds >= lim["cpu_s"]:
            ending, note = "cpu_limit", f"[killed: CPU time limit of {lim['cpu_s']:g} s]"
        elif rc == -signal.SIGXFSZ or max(len(out_b), len(err_b)) >= lim["max_output_bytes"]:
            ending, note = "output_limit", f"[output stopped at the limit of {lim['max_output_bytes']} bytes]"
        elif rc < 0:
            ending, note = "signal", f"[killed by signal {signal.Signals(-rc).name}]"
        else:
            ending, note = "exit", (f"[exit code {rc}]" if rc else "")
        text = out + (("\n" if out and not out.endswith("\n") else "") + err if err else "")
        if len(text) > lim["max_output_chars"]:
            text = text[:lim["max_output_chars"]] + f"\n...[{len(text) - lim['max_output_chars']} more characters]"
        text = (text + ("\n" if text and not text.endswith("\n") else "") + note) if note else text
        info = {"ending": ending, "returncode": rc, "seconds": seconds, **{f"isolation/{k}": v for k, v in iso.items()}}
        return text, info
