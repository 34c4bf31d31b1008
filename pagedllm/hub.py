"""Hugging Face Hub ids (`org/name`) as model arguments, the way vLLM takes them.

An id is looked up in the local Hugging Face cache first, so that a machine that has the
model (or a container built with it) starts without the network; only when the cache
lacks it, and offline mode (HF_HUB_OFFLINE) is not set, is it downloaded, with
huggingface_hub's progress bars. Either way the answer is a snapshot directory that the
rest of the engine reads like any local checkpoint.

The cache directory and offline mode are read from the environment at each call, not
from huggingface_hub's constants, which are frozen when it is first imported: a process
(or a test) that sets HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE later is still obeyed.

A leaf module: no torch; huggingface_hub is imported only when an id is resolved.
"""

from __future__ import annotations

import os

from pagedllm.config import looks_like_hub_id

__all__ = ["HubModelNotFoundError", "hub_cache_dir", "hub_offline", "looks_like_hub_id",
           "resolve_hub_model"]

# What a checkpoint needs besides its weights: configs, tokenizer files, chat templates.
_TEXT_PATTERNS = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's spelling of a true variable


class HubModelNotFoundError(FileNotFoundError):
    """A hub id that is neither in the cache nor downloadable: the message is one line
    that says what was looked for, where, and what to do, so every entrypoint can print
    it as is instead of a traceback."""


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE


def hub_cache_dir(download_dir: str | None = None) -> str:
    """`download_dir`, else $HF_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub (~/.cache/huggingface/hub): huggingface_hub's order."""
    if download_dir:
        return os.path.abspath(os.path.expanduser(download_dir))
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def _weight_patterns(repo_id: str, revision: str | None, cache_dir: str) -> list[str]:
    """The one weight format to download: safetensors when the repo has them (many repos
    also carry the same weights as .bin), else .bin/.pt, else its single .gguf file."""
    from huggingface_hub import list_repo_files

    files = list_repo_files(repo_id, revision=revision)
    if any(f.endswith(".safetensors") for f in files):
        return ["*.safetensors"]
    if any(f.endswith((".bin", ".pt")) for f in files):
        return ["*.bin", "*.pt"]
    ggufs = [f for f in files if f.endswith(".gguf")]
    if len(ggufs) > 1:
        raise HubModelNotFoundError(
            f"model {repo_id!r} holds {len(ggufs)} .gguf files ({', '.join(ggufs[:4])}"
            f"{', ...' if len(ggufs) > 4 else ''}): download the one you want into "
            f"{cache_dir} (e.g. `hf download {repo_id} FILE`) and pass its path")
    return ggufs


def _complete(snapshot: str, weights: bool) -> bool:
    """Whether a cached snapshot can be used as it is: it has a config (or is a GGUF
    repo) and, when `weights`, weight files, every shard its index names included (a
    `plan` reads only the config, and a download may have been cut short)."""
    import glob
    import json

    names = os.listdir(snapshot)
    has_weights = any(n.endswith((".safetensors", ".bin", ".pt", ".gguf")) for n in names)
    if not weights:
        return "config.json" in names or has_weights
    if not has_weights:
        return False
    for index in glob.glob(os.path.join(snapshot, "*.index.json")):
        try:
            with open(index) as f:
                shards = set(json.load(f).get("weight_map", {}).values())
        except (OSError, ValueError):
            return False
        if not all(os.path.exists(os.path.join(snapshot, s)) for s in shards):
            return False
    return True


def resolve_hub_model(repo_id: str, revision: str | None = None,
                      download_dir: str | None = None, weights: bool = True) -> str:
    """The local snapshot directory of `repo_id` at `revision` (None: the main branch):
    from the cache, else downloaded unless HF_HUB_OFFLINE is set. `weights=False` asks
    for the config and tokenizer files only (what `pagedllm plan` reads). Raises
    HubModelNotFoundError, with a one-line message, when neither works."""
    from huggingface_hub import snapshot_download

    cache_dir = hub_cache_dir(download_dir)
    at = f" at revision {revision!r}" if revision else ""
    try:
        snapshot = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                     local_files_only=True)
    except Exception:  # not cached (or that revision is not): try the network below
        snapshot = None
    if snapshot is not None and _complete(snapshot, weights):
        return snapshot
    what = "is not" if snapshot is None else "is incomplete (no weights or missing shards)"
    if hub_offline():
        raise HubModelNotFoundError(
            f"model {repo_id!r}{at} {what} in the Hugging Face cache {cache_dir} and "
            "HF_HUB_OFFLINE is set: unset it (or set HF_HUB_OFFLINE=0) to download, point "
            "HF_HOME / HF_HUB_CACHE / --download-dir at a cache that has it, or pass a local "
            "directory")
    try:
        patterns = _TEXT_PATTERNS + (_weight_patterns(repo_id, revision, cache_dir)
                                     if weights else [])
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                 allow_patterns=patterns)
    except HubModelNotFoundError:
        raise
    except Exception as e:  # no such repo, gated, no network, disk full, ...
        why = " ".join(str(e).split())[:300] or type(e).__name__
        raise HubModelNotFoundError(
            f"model {repo_id!r}{at} {what} in the Hugging Face cache {cache_dir} and could "
            f"not be downloaded ({type(e).__name__}: {why}): check the id and revision, log "
            "in (`hf auth login` or HF_TOKEN) for a gated model, or pass a local directory"
        ) from None
