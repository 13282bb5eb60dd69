"""Hugging Face hub model ids (``Qwen/Qwen2.5-7B-Instruct``) resolved through the local hub cache.

Nothing is ever downloaded at run time: an id resolves to the snapshot a download left in the cache
(``models--Org--Name/snapshots/<hash>/``, the one ``refs/main`` names), or the run is refused with one
line saying how to fill the cache. The config check and the model loaders both resolve through here.
"""

from __future__ import annotations

import os
from pathlib import Path


class HubModelNotCached(Exception):
    """A hub model id with no snapshot in the local cache; the message says how to fill it."""


def hub_cache_dir() -> Path:
    """The hub cache huggingface_hub reads: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub.

    Read from the environment at each call: huggingface_hub reads it once, when it is first imported.
    """
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):  # the second is the older name
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    return cache_home / "huggingface" / "hub"


def resolve_model_path(value: str) -> str:
    """The local directory `value` names: itself when it is a directory (or no hub id), else the cached
    snapshot of the hub model it names. Raises HubModelNotCached when that model is not in the cache."""
    if Path(value).expanduser().is_dir():
        return value
    # Imported here: the daemon validates configs, and most never name a hub id.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return snapshot_download(value, cache_dir=cache, local_files_only=True)
    except HFValidationError:  # no hub id ("/data/model", "./model"): a path, which the caller checks
        return value
    except LocalEntryNotFoundError:
        raise HubModelNotCached(
            f"{value!r} is not a local directory, and the hub model {value} is not in the local Hugging Face cache "
            f"{str(cache)!r} (models are never downloaded at run time); fill the cache on a machine with internet "
            f"with `hf download {value}` (or `huggingface-cli download {value}`), copy it here and point HF_HUB_CACHE "
            "(or HF_HOME) at it, or set the key to a local model directory") from None
