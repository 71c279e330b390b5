"""The suite's process hygiene (tests/processes.py): a process left running fails the session,
named, and is ended; a spawned world's orphans are ended when it returns."""
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _session(tmp_path, body: str):
    (tmp_path / "conftest.py").write_text("from processes import pytest_configure, pytest_sessionfinish  # noqa\n")
    (tmp_path / "test_it.py").write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""), "TESTS_SURVIVOR_GRACE_S": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


def test_a_surviving_orphan_fails_the_session_and_is_ended(tmp_path):
    # A child that starts a grandchild in its own session and exits: the grandchild is an orphan
    # (re-parented to the subreaper, pytest) that would otherwise outlive everything.
    p = _session(tmp_path, f"""
        import subprocess, sys
        def test_leaks():
            code = ("import subprocess; p = subprocess.Popen(['sleep', '300'], start_new_session=True, "
                    "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            open({str(tmp_path / 'pid')!r}, "w").write(out.stdout.strip())
    """)
    pid = int((tmp_path / "pid").read_text())
    assert p.returncode == 1, p.stdout + p.stderr
    assert "1 passed" in p.stdout and "1 process(es) outlived the test session (ended now):" in p.stdout
    assert f"pid {pid} " in p.stdout and "sleep 300" in p.stdout
    time.sleep(0.5)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_clean_session_passes(tmp_path):
    p = _session(tmp_path, """
        import subprocess
        def test_clean():
            subprocess.run(["sleep", "0.1"], check=True)
    """)
    assert p.returncode == 0 and "outlived" not in p.stdout, p.stdout + p.stderr


def _orphan(rank, world, pid_file):
    p = subprocess.Popen(["sleep", "300"], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(pid_file, "w") as f:
        f.write(str(p.pid))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="child subreaper is Linux's")
def test_spawn_ends_what_its_ranks_left_running(tmp_path):
    sys.path.insert(0, os.path.join(TESTS, "distributed"))
    from harness import spawn

    spawn(_orphan, 1, str(tmp_path / "pid"))
    pid = int((tmp_path / "pid").read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_terminated_session_ends_its_descendants(tmp_path):
    """SIGTERM to pytest (a CI or shell timeout): what it started does not survive it."""
    (tmp_path / "conftest.py").write_text("from processes import pytest_configure, pytest_sessionfinish  # noqa\n")
    (tmp_path / "test_it.py").write_text(textwrap.dedent(f"""
        import subprocess, time
        def test_hangs():
            p = subprocess.Popen(["sleep", "300"], start_new_session=True, stdout=subprocess.DEVNULL)
            open({str(tmp_path / 'pid')!r}, "w").write(str(p.pid))
            time.sleep(300)
    """))
    env = {**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    session = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not (tmp_path / "pid").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    pid = int((tmp_path / "pid").read_text())
    session.terminate()
    session.wait(timeout=30)
    time.sleep(0.5)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
