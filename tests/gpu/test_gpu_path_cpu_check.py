"""The GPU checks' code on CPU under the device check: one process with a simulated cuda:0
(MEGAPPO_CHECK_DEVICES=1, megatron_cpu.install(check_devices=True) before gloo), float32, local
layer spec, transformers on the host. A tensor left on the host where the GPU needs it (or the
reverse) raises DeviceCheckError here, as CUDA/NCCL would on the GPU box."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def test_gpu_checks_pass_under_the_cpu_device_check(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MEGAPPO_GPU_FIGURES",)}
    env.update(MEGAPPO_CHECK_DEVICES="1", CUDA_VISIBLE_DEVICES="", PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    p = subprocess.run([sys.executable, str(HERE / "gpu_checks.py"), str(tmp_path)], capture_output=True,
                       text=True, timeout=300, env=env, cwd=str(REPO))
    out = p.stdout + p.stderr
    assert "DeviceCheckError" not in out, "a tensor is on the wrong device for the GPU run:\n" + out[-6000:]
    assert p.returncode == 0 and "CPU_CHECK_OK" in p.stdout, out[-6000:]
