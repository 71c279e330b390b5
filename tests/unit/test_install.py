"""The CPU environment the README's set-up command builds, and the package's import cost."""
import subprocess
import sys

HEAVY = ("torch", "vllm", "ray", "megatron", "transformers")


def py(code: str, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_import_megappo_is_cheap():
    p = py("import sys, megappo, megappo.config, megappo.train; "
           f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", f"import megappo pulled in {p.stdout.strip()}"


def test_vllm_imports_beside_cpu_torch():
    # Fails when PyPI's CUDA torchvision/torchaudio/torchcodec are left installed (README set-up).
    p = py("from vllm import LLM, SamplingParams; import vllm, torch; "
           "print(vllm.__version__, torch.__version__)")
    assert p.returncode == 0, p.stderr[-3000:]
    vllm_version, torch_version = p.stdout.split()[-2:]
    assert vllm_version.startswith("0.32.0")
    assert torch_version.startswith("2.13.0")


def test_megatron_core_and_friends_import():
    p = py("import megatron.core, transformers, pyarrow, safetensors, tensorboard, yaml, psutil, ray; "
           "from megatron.core import parallel_state, dist_checkpointing; print(megatron.core.__version__)")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().endswith("0.16.1")


def test_test_file_names_are_unique():
    """pytest imports test files by basename (no packages under tests/): two files of one name
    stop the whole run at collection (it happened: unit/ and e2e/ test_rollout_correction.py)."""
    from collections import Counter
    from pathlib import Path

    names = Counter(p.name for p in Path(__file__).resolve().parents[1].rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1], names
