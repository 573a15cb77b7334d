"""Where a model or processor a config names lives on this machine: a local dir, or a Hugging
Face Hub repo id (``Qwen/Qwen3-VL-2B-Instruct``, how every peer is pointed at a model)
resolved from the local Hugging Face cache (``$HF_HOME/hub``, as ``huggingface_hub`` lays
it out), never from the network: a repo the cache lacks is named with the command that
fetches it, unless the config lets connect download it (``model.download``).

    >>> repo_id("Qwen/Qwen3-VL-2B-Instruct"), repo_id("/nowhere/model"), repo_id("models/x/y")
    ('Qwen/Qwen3-VL-2B-Instruct', None, None)
    >>> fetch_command("Qwen/Qwen3-VL-2B-Instruct")
    'hf download Qwen/Qwen3-VL-2B-Instruct'
"""

from __future__ import annotations

import re
from pathlib import Path

_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def repo_id(ref: str | None) -> str | None:
    """``ref`` as a Hub repo id (``Org/Name``: one slash, no path on this machine by that
    name), else None (a local path, existing or not)."""
    if not ref or ref.startswith((".", "/", "~")) or Path(ref).expanduser().exists():
        return None
    return ref if _REPO.fullmatch(ref) else None


def cached(repo: str, repo_type: str = "model") -> Path | None:
    """The snapshot dir of ``repo`` (a ``model`` or a ``dataset`` repo) in the local Hugging
    Face cache (its ``main``), or None when the cache lacks it; nothing is downloaded."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, repo_type=repo_type, local_files_only=True))
    except Exception:  # noqa: BLE001 - huggingface_hub's "not in the cache" has several types
        return None


def local_dir(ref: str | None) -> Path | None:
    """The dir ``ref`` names on this machine: a local path (expanded, resolved), or the
    cached snapshot of a Hub repo id; None for null, or a repo the cache lacks."""
    if not ref:
        return None
    repo = repo_id(ref)
    if repo is not None:
        return cached(repo)
    return Path(ref).expanduser().resolve()


def fetch_command(repo: str, repo_type: str = "model") -> str:
    """The command that puts ``repo`` into the local cache (``huggingface_hub``'s CLI).

    >>> fetch_command("HuggingFaceM4/the_cauldron", "dataset")
    'hf download --repo-type dataset HuggingFaceM4/the_cauldron'
    """
    kind = "" if repo_type == "model" else f"--repo-type {repo_type} "
    return f"hf download {kind}{repo}"
