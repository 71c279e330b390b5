"""A HuggingFace hub cache folder built by hand, in the layout the hub client reads
(``models--org--name/snapshots/<rev>/...``, ``refs/main``, and the client's file listing
``trees/<rev>.json``), so hub ids resolve offline (HF_HUB_OFFLINE=1) in tests."""
import hashlib
import json
import shutil
from pathlib import Path

import pytest

REV = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo: str = "org/tiny", rev: str = REV, files=None, repo_type: str = "model",
              listed: bool = True, ref: str = "main") -> Path:
    """Snapshot of ``repo`` at commit ``rev`` holding ``files`` ({relative name: text, bytes or a Path
    to copy}; default a config.json), the branch or tag ``ref`` pointing at it. ``listed``: also
    write the client's file listing, as a complete snapshot_download does (without it, an online
    resolve completes the snapshot)."""
    files = {"config.json": json.dumps({"architectures": ["Qwen3ForCausalLM"]})} if files is None else files
    base = Path(root) / f"{repo_type}s--{repo.replace('/', '--')}"
    snap = base / "snapshots" / rev
    snap.mkdir(parents=True, exist_ok=True)
    listing = {}
    for name, content in files.items():
        dst = snap / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            shutil.copyfile(content, dst)
        elif isinstance(content, bytes):
            dst.write_bytes(content)
        else:
            dst.write_text(content)
        data = dst.read_bytes()
        listing[name] = {"size": len(data), "blob_id": hashlib.sha1(data).hexdigest()}
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / ref).write_text(rev)
    if listed:
        (base / "trees").mkdir(exist_ok=True)
        (base / "trees" / f"{rev}.json").write_text(json.dumps({"format_version": 1, "files": listing}))
    return snap


def folder_files(folder: Path) -> dict:
    """{relative name: Path} of every file under ``folder`` (a model folder to put in the cache)."""
    return {str(p.relative_to(folder)): p for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty hub cache, offline, for in-process code (subprocesses get HF_HUB_CACHE/HF_HUB_OFFLINE)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache
