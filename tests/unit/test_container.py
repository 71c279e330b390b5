"""The container image's pins stay those of setup.py's GPU extra and of the README's GPU install
(the image cannot be built here: no docker, no GPU)."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PIN = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([0-9][0-9A-Za-z.+]*)")


def _gpu_extra_pins() -> dict:
    text = (REPO / "setup.py").read_text()
    gpu = re.search(r"^GPU = COMMON \+ \[(.*?)^\]", text, re.S | re.M).group(1)
    return {name.lower(): ver for name, ver in PIN.findall(gpu)}


def test_dockerfile_pins_match_setup_and_readme():
    docker = (REPO / "docker" / "Dockerfile").read_text()
    setup = _gpu_extra_pins()
    assert {"torch", "vllm", "megatron-core", "transformer-engine"} <= set(setup), setup
    code = "\n".join(line for line in docker.splitlines() if not line.lstrip().startswith("#"))
    pins = {name.lower(): ver for name, ver in PIN.findall(code)}
    assert pins, "the Dockerfile pins nothing"
    for name, ver in pins.items():
        assert setup.get(name) == ver, f"docker/Dockerfile pins {name}=={ver}, setup.py's gpu extra {setup.get(name)}"
    assert re.search(r'pip install --no-build-isolation -e "\.\[gpu[],]', code), "the image installs the gpu extra"
    # the versions the Dockerfile's comment names are the pinned ones
    for name, label in (("torch", "torch"), ("vllm", "vLLM"), ("transformer-engine", "TransformerEngine"),
                        ("megatron-core", "megatron-core")):
        assert f"{label} {setup[name]}" in docker, f"docker/Dockerfile's header does not say {label} {setup[name]}"
    readme = (REPO / "README.md").read_text()
    assert f"pip install torch=={setup['torch']}" in readme
    assert f"vLLM {setup['vllm']} pins torch {setup['torch']}" in readme
