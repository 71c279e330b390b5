import os
import socket
import sys
from pathlib import Path

import pytest

# Every process of the suite (pytest's own, and the worlds and jobs it starts, which inherit the
# variable) runs torch single-threaded unless OMP_NUM_THREADS says otherwise: on models this small
# OpenMP's fork and join around each op costs more than the op, and worlds of 2-4 processes with a
# thread per core each oversubscribe CI's 2 cores (three e2e and distributed tests, 2026-12-06:
# 144 s -> 120 s). torchrun makes the same choice for its workers.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# megappo's cache (override_config's merged model folders) stays inside the suite's temporary
# folder, not the user's ~/.cache.
if "MEGAPPO_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["MEGAPPO_CACHE"] = tempfile.mkdtemp(prefix="megappo-test-cache-")
    atexit.register(shutil.rmtree, os.environ["MEGAPPO_CACHE"], True)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

# No process outlives the suite: orphans are re-parented to pytest, and any still alive at the
# end fail the run, named (tests/processes.py).
from processes import pytest_configure, pytest_sessionfinish  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    for item in items:   # the fast tier, -m "not slow", is tests/unit (single-process)
        folder = Path(str(item.fspath)).parent.name
        if folder in ("distributed", "e2e", "gpu") or item.get_closest_marker("distributed") \
                or item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.slow)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing: gpu tests cannot run either
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not "gpu" in keywords: tests/gpu/ is a keyword too
            item.add_marker(skip)


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture
def repo() -> Path:
    return REPO
