"""A Hugging Face repo id where a model config is expected: its config.json from the local cache.

Users name models the way the Hub does (``deepseek-ai/DeepSeek-V4-Flash``), and a machine that
has run sglang or transformers holds that repo's files in the Hugging Face cache already. The
cache is read, never the network: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub`` (huggingface_hub's own
order), in which a repo lives in ``models--ORG--NAME`` with ``refs/main`` naming the snapshot.
Without the file there, one line says how to pass a config.json instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import ConfigError

#: A Hub repo id: ``ORG/NAME`` of letters, digits, ``-``, ``_`` and ``.`` (at most 96 each).
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
#: ``refs/main`` holds a 40-hex commit id; anything longer is not read.
MAX_REF_BYTES = 256


def is_repo_id(model: str) -> bool:
    """``model`` is written like a Hub repo id (and not like a file: no ``.json`` ending)."""
    return REPO_ID.fullmatch(model) is not None and not model.endswith(".json") and ".." not in model


def hub_cache() -> Path:
    """The Hugging Face hub cache directory, from the environment as huggingface_hub reads it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "huggingface" / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _snapshot_of_main(repo: Path) -> Path | None:
    """The snapshot ``refs/main`` names, when that file is there and holds a commit id."""
    try:
        with open(repo / "refs" / "main", "rb") as f:
            ref = f.read(MAX_REF_BYTES).decode("ascii", "replace").strip()
    except OSError:
        return None
    return repo / "snapshots" / ref if re.fullmatch(r"[0-9a-f]{40}", ref) else None


def cached_config(repo_id: str) -> Path | None:
    """``config.json`` of ``repo_id`` in the local cache: the ``main`` snapshot's, else the
    newest snapshot that has one; None when no snapshot has it."""
    repo = hub_cache() / f"models--{repo_id.replace('/', '--')}"
    main = _snapshot_of_main(repo)
    if main is not None and (main / "config.json").is_file():
        return main / "config.json"
    try:
        found = [p for p in (repo / "snapshots").glob("*/config.json") if p.is_file()]
    except OSError:
        return None
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def config_path(repo_id: str) -> Path:
    """The cached config.json of a repo id, or exit 2 with one line saying how to pass one."""
    path = cached_config(repo_id)
    if path is None:
        raise ConfigError(
            f"--model {repo_id!r}: no such file or preset, and as a Hugging Face repo id its "
            f"config.json is not in the local Hugging Face cache ({hub_cache()}; HF_HUB_CACHE or "
            f"HF_HOME name another); pass the file instead: --model path/to/config.json (e.g. "
            f"after `huggingface-cli download {repo_id} config.json`), or a preset")
    return path


__all__ = ["cached_config", "config_path", "hub_cache", "is_repo_id"]
