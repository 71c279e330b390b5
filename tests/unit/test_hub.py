"""Hub ids as model paths (megappo.hub), offline: a cache folder in the hub client's own layout
(models--org--name/snapshots/<rev>/..., refs/main, trees/<rev>.json) with HF_HUB_OFFLINE=1."""
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
sys.path.insert(0, str(REPO / "tests"))
from hub_cache import REV, folder_files, hub_cache as _cache, offline_cache  # noqa: E402,F401


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


def test_two_revisions_are_an_error_naming_both(offline_cache):
    _cache(offline_cache)
    with pytest.raises(hub.HubError, match="org/tiny@v1: two revisions given, '@v1' in the id and revision='v2'"):
        hub.resolve("org/tiny@v1", revision="v2")
    assert hub.split_id("org/tiny@v1", "v1") == ("org/tiny", "v1") and hub.split_id("org/tiny") == ("org/tiny", None)


def _fake_downloads(monkeypatch, files=None):
    """snapshot_download with the network replaced: a download lands the snapshot (listed) in the cache."""
    import huggingface_hub

    real, downloads = huggingface_hub.snapshot_download, []

    def fake(repo, cache_dir=None, local_files_only=False, **kw):
        if local_files_only:
            return real(repo, cache_dir=cache_dir, local_files_only=True, **kw)
        downloads.append(repo)
        time.sleep(0.3)   # a download takes a while: ranks without the lock would all start one
        return str(_cache(Path(cache_dir), repo, files=files))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    return downloads


def test_a_partial_snapshot_is_completed_online(offline_cache, monkeypatch):
    """A snapshot without the client's file listing (only the planner's config.json was fetched)
    is completed online; a listed one is used as it is. Offline, an unlisted one is used as it is
    (older hub clients keep no listing) when it has weights or none are wanted, else named."""
    from huggingface_hub import constants

    snap = _cache(offline_cache, listed=False)
    with pytest.raises(hub.HubError, match=r"org/tiny: in the HF cache .* without its weights .* HF_HUB_OFFLINE=1"):
        hub.resolve("org/tiny")
    assert Path(hub.resolve("org/tiny", ignore_patterns=hub.WEIGHT_PATTERNS)) == snap   # config and tokenizer only
    _cache(offline_cache, "org/old", files={"config.json": "{}", "model.safetensors": b"w"}, listed=False)
    assert Path(hub.resolve("org/old")).parent.parent.name == "models--org--old"   # unlisted, with weights
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    downloads = _fake_downloads(monkeypatch, files={"config.json": "{}", "model.safetensors": b"w"})
    assert Path(hub.resolve("org/tiny")) == snap and downloads == ["org/tiny"]
    assert (snap / "model.safetensors").is_file()
    hub.resolve("org/tiny")                                       # now listed: no second download
    assert downloads == ["org/tiny"]


def test_one_download_per_node(offline_cache, monkeypatch):
    """Ranks of a node resolve together: the first downloads, the others find the cache."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    downloads = _fake_downloads(monkeypatch)
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
    snap = _cache(tmp_path / "hub", "org/missing", files={"README.md": "not a model"})
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"{snap} has no config.json" in r.stderr, r.stderr[-2000:]


# The converter CLIs (checkpoints_tools/) take hub ids where they take an HF model folder.

def test_convert_from_hf_cli_on_a_hub_id(tmp_path):
    """Offline, the real tool on a tiny model in the cache: the import reads the id's snapshot."""
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import save_tiny_model

    save_tiny_model("qwen3", tmp_path / "model")
    snap = _cache(tmp_path / "hub", "org/tiny-qwen3", files=folder_files(tmp_path / "model"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "PYTHONWARNINGS": "ignore"}
    tool = [sys.executable, str(REPO / "checkpoints_tools" / "convert_from_hf.py"), "--quiet"]
    r = subprocess.run(tool + ["--hf", "org/tiny-qwen3", "--out", str(tmp_path / "out")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "megappo_import.json").read_text())["source"] == str(snap)
    r = subprocess.run(tool + ["--hf", "org/absent", "--out", str(tmp_path / "out2")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "convert_from_hf: error: org/absent: not in the HF cache" in r.stderr, r.stderr


def test_convert_to_hf_and_verify_resolve_hub_ids(offline_cache, monkeypatch, capsys):
    """--hf-config takes a snapshot without weights (it needs config and tokenizer only); verify's
    --hf takes the whole model; a missing id ends with exit code 2 naming it."""
    from huggingface_hub import constants

    from megappo.convert import cli, hf_export, verify

    seen = {}

    def export(ckpt, out, hf_config=None, **kw):   # what the tools were handed is what is checked
        seen["export"] = hf_config
        return {"out": out, "tensors": 0, "bytes": 0, "files": [], "dtype": "fp32", "ckpt": ckpt}

    def compare(ckpt, hf, **kw):
        seen["verify"] = hf
        return {"max_abs_diff": 0.0, "what": "log-prob", "num_seqs": 1, "positions": 1, "hf": hf}

    monkeypatch.setattr(hf_export, "export_hf", export)
    monkeypatch.setattr(verify, "compare_checkpoint_with_hf", compare)
    assert cli.convert_to_hf_main(["--ckpt", "c", "--out", "o", "--hf-config", "org/absent@v3"]) == 2
    assert "convert_to_hf: error: org/absent@v3: not in the HF cache" in capsys.readouterr().err
    assert cli.verify_main(["--ckpt", "c", "--hf", "org/absent"]) == 2
    assert "verify: error: org/absent: not in the HF cache" in capsys.readouterr().err

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    asked = []
    import huggingface_hub

    def fake(repo, cache_dir=None, local_files_only=False, ignore_patterns=None, **kw):
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        asked.append(ignore_patterns)
        return str(_cache(Path(cache_dir), repo))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert cli.convert_to_hf_main(["--ckpt", "c", "--out", "o", "--hf-config", "org/tiny"]) == 0
    assert cli.verify_main(["--ckpt", "c", "--hf", "org/tiny", "--atol", "1"]) == 0
    snap = str(offline_cache / "models--org--tiny" / "snapshots" / REV)
    assert seen == {"export": snap, "verify": snap}
    assert "*.safetensors" in asked[0] and asked[1] is None
