"""Hub ids as model paths (megappo.hub), offline: a cache folder in the hub client's own layout
(models--org--name/snapshots/<rev>/..., refs/main) with HF_HUB_OFFLINE=1."""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megappo import hub

REPO = Path(__file__).resolve().parents[2]


def _cache(root: Path, repo: str = "org/tiny", rev: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    base = root / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(rev)
    return snap


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_id_resolves_from_the_cache(offline_cache):
    snap = _cache(offline_cache)
    assert hub.is_hub_id("org/tiny") and hub.is_hub_id("org/tiny@main")
    assert not hub.is_hub_id("/abs/path") and not hub.is_hub_id("./rel") and not hub.is_hub_id("a/b/c")
    assert Path(hub.resolve("org/tiny")) == snap
    assert Path(hub.resolve(f"org/tiny@{snap.name}")) == snap     # a revision, as repo@rev
    assert hub.resolve(str(snap)) == str(snap)                    # a folder stays itself


def test_missing_id_names_it(offline_cache):
    with pytest.raises(hub.HubError, match="org/missing: not in the HF cache .* HF_HUB_OFFLINE=1"):
        hub.resolve("org/missing")


def test_one_download_per_node(offline_cache, monkeypatch):
    """Ranks of a node resolve together: the first downloads, the others find the cache."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    import huggingface_hub

    real, downloads = huggingface_hub.snapshot_download, []

    def fake(repo, revision=None, cache_dir=None, local_files_only=False):
        if local_files_only:
            return real(repo, revision=revision, cache_dir=cache_dir, local_files_only=True)
        downloads.append(repo)
        time.sleep(0.3)   # a download takes a while: ranks without the lock would all start one
        return str(_cache(Path(cache_dir), repo))   # "download": the snapshot lands in the cache

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    out = []
    ranks = [threading.Thread(target=lambda: out.append(hub.resolve("org/tiny"))) for _ in range(4)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    assert downloads == ["org/tiny"] and len(set(out)) == 1 and len(out) == 4


def test_train_names_a_missing_hub_id_before_starting(tmp_path):
    from megappo.data.tiny import make_tiny_setup

    p = make_tiny_setup(str(tmp_path / "tiny"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    args = [sys.executable, "-m", "megappo.train", "--config", "tiny_cpu", "actor_rollout_ref.model.path=org/missing",
            f"data.train_files=[{p['train']}]", "data.val_files=[]", "trainer.n_gpus_per_node=1"]
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "actor_rollout_ref.model.path" in r.stderr and "org/missing: not in the HF cache" in r.stderr
    # the same id in the cache resolves to its snapshot (the run then validates that folder)
    snap = _cache(tmp_path / "hub", "org/missing")
    (snap / "config.json").unlink()
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"{snap} has no config.json" in r.stderr, r.stderr[-2000:]
