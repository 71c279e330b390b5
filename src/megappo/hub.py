"""HuggingFace hub ids where a model path is taken ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B@<revision>"):
resolved with ``huggingface_hub.snapshot_download`` into the standard HF cache (``HF_HOME`` /
``HF_HUB_CACHE``; ``HF_TOKEN`` for gated models; ``HF_HUB_OFFLINE=1`` reads the cache only).

Once per node: every rank takes a file lock in the cache for the id; the first one downloads, the
others then find the snapshot in the cache (a lock rather than a barrier, so it also works before
torch.distributed starts and on a shared file system, where one node downloads for all).

A snapshot in the cache counts as complete only when the hub client's own file listing for it is
cached too (snapshot_download writes one; the hub client then checks every listed file is there).
A snapshot without one may hold only what a partial download fetched (the planner's config.json),
so online it is completed with snapshot_download (which fetches only the missing files); offline
it is taken as it is (a cache filled by older hub clients has no listing), unless weights are
wanted and it has none: then the error says so, before anything starts.

Also data set repositories (repo_type="dataset": the hub data sets of megappo.data.preprocess)."""
from __future__ import annotations

import contextlib
import fnmatch
import os
from typing import Optional, Sequence

__all__ = ["HubError", "WEIGHT_PATTERNS", "is_hub_id", "split_id", "resolve", "cached_file", "resolve_file"]

# Files a config/tokenizer-only snapshot leaves out.
WEIGHT_PATTERNS = ["*.safetensors", "*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.ckpt", "*.gguf", "*.onnx"]


class HubError(ValueError):
    """A hub id that cannot be had (not cached offline, unknown, gated, no network); names the id."""


def is_hub_id(path: str) -> bool:
    """``org/name`` (optionally ``@revision``) that is not an existing path."""
    repo = path.split("@", 1)[0]
    return (not os.path.exists(os.path.expanduser(path)) and not path.startswith(("/", ".", "~"))
            and repo.count("/") == 1 and all(repo.split("/")))


def split_id(path: str, revision: Optional[str] = None) -> tuple[str, Optional[str]]:
    """(repo, revision) of ``org/name[@rev]``; a ``revision`` given beside a different ``@rev`` is an error."""
    repo, _, rev = path.partition("@")
    if rev and revision and rev != revision:
        raise HubError(f"{path}: two revisions given, '@{rev}' in the id and revision={revision!r}; keep one")
    return repo, rev or revision or None


@contextlib.contextmanager
def _node_lock(repo: str, repo_type: str):
    """One lock per repository in the cache, shared by every kind of download of it."""
    from filelock import FileLock
    from huggingface_hub import constants

    locks = os.path.join(constants.HF_HUB_CACHE, ".megappo-locks")
    os.makedirs(locks, exist_ok=True)
    with FileLock(os.path.join(locks, f"{repo_type}s--{repo.replace('/', '--')}.lock")):
        yield constants.HF_HUB_CACHE


def _listed(repo: str, rev: Optional[str], repo_type: str, cache: str) -> bool:
    """Whether the hub client's file listing of this snapshot is cached (so its completeness was checked)."""
    try:
        from huggingface_hub import get_cached_repo_tree
    except ImportError:   # an older hub client keeps no listing: always ask the hub (fetches only what is missing)
        return False
    try:
        get_cached_repo_tree(repo, revision=rev, repo_type=repo_type, cache_dir=cache)
        return True
    except Exception:
        return False


def _has_weights(folder: str) -> bool:
    return any(fnmatch.fnmatch(f, p) for f in os.listdir(folder) for p in WEIGHT_PATTERNS)


def _what(path: str, repo_type: str) -> str:
    return path if repo_type == "model" else f"{repo_type} {path}"


def _unavailable(path: str, repo: str, repo_type: str, cache: str) -> HubError:
    flag = " --repo-type dataset" if repo_type == "dataset" else ""
    return HubError(f"{_what(path, repo_type)}: not in the HF cache ({cache}) and HF_HUB_OFFLINE=1; download it "
                    f"first (huggingface-cli download{flag} {repo}) or unset HF_HUB_OFFLINE")


def _failed(path: str, repo_type: str, e: Exception) -> HubError:
    return HubError(f"{_what(path, repo_type)}: cannot be downloaded from the HuggingFace hub ({type(e).__name__}: "
                    f"{e}); check the id, HF_TOKEN for gated or private repositories, and the network")


def resolve(path: str, revision: Optional[str] = None, repo_type: str = "model",
            ignore_patterns: Optional[Sequence[str]] = None) -> str:
    """The local folder of ``path``: itself when it is a folder, else the hub id's snapshot
    (``repo@rev`` or ``revision``; default the main branch), downloaded once per node.
    ``ignore_patterns`` (e.g. WEIGHT_PATTERNS): files not to download."""
    if os.path.isdir(os.path.expanduser(path)):
        return os.path.expanduser(path)
    if not is_hub_id(path):
        raise HubError(f"{path}: neither a local folder nor a hub id (org/name)")
    from huggingface_hub import constants, snapshot_download

    repo, rev = split_id(path, revision)
    kw = dict(revision=rev, repo_type=repo_type,
              ignore_patterns=list(ignore_patterns) if ignore_patterns else None)
    with _node_lock(repo, repo_type) as cache:
        try:
            snap = snapshot_download(repo, cache_dir=cache, local_files_only=True, **kw)
        except Exception:   # not in the cache (yet), or incomplete by its listing
            snap = None
        if snap and _listed(repo, rev, repo_type, cache):
            return snap
        if constants.HF_HUB_OFFLINE:
            if snap and (repo_type != "model" or ignore_patterns or _has_weights(snap)):
                return snap
            if snap:
                raise HubError(f"{path}: in the HF cache ({snap}) without its weights (only some files were "
                               "fetched, e.g. the planner's config.json) and HF_HUB_OFFLINE=1; download it first "
                               f"(huggingface-cli download {repo}) or unset HF_HUB_OFFLINE")
            raise _unavailable(path, repo, repo_type, cache) from None
        try:
            return snapshot_download(repo, cache_dir=cache, **kw)
        except Exception as e:
            raise _failed(path, repo_type, e) from None


def cached_file(path: str, filename: str, revision: Optional[str] = None) -> Optional[str]:
    """One file of a hub model if the HF cache has it (no network), else None."""
    from huggingface_hub import try_to_load_from_cache

    repo, rev = split_id(path, revision)
    found = try_to_load_from_cache(repo, filename, revision=rev)
    return found if isinstance(found, str) else None


def resolve_file(path: str, filename: str, revision: Optional[str] = None) -> str:
    """One file of a hub model (the planner's config.json), downloaded alone, once per node."""
    if not is_hub_id(path):
        raise HubError(f"{path}: not a hub id (org/name)")
    from huggingface_hub import constants, hf_hub_download

    repo, rev = split_id(path, revision)
    with _node_lock(repo, "model") as cache:
        found = cached_file(path, filename, revision)
        if found:
            return found
        if constants.HF_HUB_OFFLINE:
            raise HubError(f"{path}: {filename} is not in the HF cache ({cache}) and HF_HUB_OFFLINE=1; download "
                           f"it first (huggingface-cli download {repo} {filename}) or unset HF_HUB_OFFLINE") from None
        try:
            return hf_hub_download(repo, filename, revision=rev, cache_dir=cache)
        except Exception as e:
            raise _failed(path, "model", e) from None
