"""HuggingFace hub ids where a model path is taken ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B@<revision>"):
resolved with ``huggingface_hub.snapshot_download`` into the standard HF cache (``HF_HOME`` /
``HF_HUB_CACHE``; ``HF_TOKEN`` for gated models; ``HF_HUB_OFFLINE=1`` reads the cache only).

Once per node: every rank takes a file lock in the cache for the id; the first one downloads, the
others then find the snapshot in the cache (a lock rather than a barrier, so it also works before
torch.distributed starts and on a shared file system, where one node downloads for all)."""
from __future__ import annotations

import os
from typing import Optional

__all__ = ["HubError", "is_hub_id", "resolve"]


class HubError(ValueError):
    """A hub id that cannot be had (not cached offline, unknown, gated, no network); names the id."""


def is_hub_id(path: str) -> bool:
    """``org/name`` (optionally ``@revision``) that is not an existing path."""
    repo = path.split("@", 1)[0]
    return (not os.path.exists(os.path.expanduser(path)) and not path.startswith(("/", ".", "~"))
            and repo.count("/") == 1 and all(repo.split("/")))


def resolve(path: str, revision: Optional[str] = None) -> str:
    """The local folder of ``path``: itself when it is a folder, else the hub id's snapshot
    (``repo@rev`` or ``revision``; default the main branch), downloaded once per node."""
    if os.path.isdir(os.path.expanduser(path)):
        return os.path.expanduser(path)
    if not is_hub_id(path):
        raise HubError(f"{path}: neither a model folder nor a hub id (org/name)")
    from filelock import FileLock
    from huggingface_hub import constants, snapshot_download

    repo, _, rev = path.partition("@")
    rev = rev or revision
    cache = constants.HF_HUB_CACHE
    os.makedirs(os.path.join(cache, ".megappo-locks"), exist_ok=True)
    with FileLock(os.path.join(cache, ".megappo-locks", repo.replace("/", "--") + ".lock")):
        try:
            return snapshot_download(repo, revision=rev, cache_dir=cache, local_files_only=True)
        except Exception:   # not in the cache (yet)
            pass
        if constants.HF_HUB_OFFLINE:
            raise HubError(f"{path}: not in the HF cache ({cache}) and HF_HUB_OFFLINE=1; download it first "
                           f"(huggingface-cli download {repo}) or unset HF_HUB_OFFLINE") from None
        try:
            return snapshot_download(repo, revision=rev, cache_dir=cache)
        except Exception as e:
            raise HubError(f"{path}: cannot be downloaded from the HuggingFace hub ({type(e).__name__}: {e}); "
                           "check the id, HF_TOKEN for gated models, and the network") from None
