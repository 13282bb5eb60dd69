"""Faults injected on purpose, for the chaos soak (benchmarks/chaos.py) and the end-to-end tests: a full disk while
a checkpoint is saved, without a small file system to fill (mounting one needs root).

VERL_FAULT_FULL_DISK names a file. While that file exists, a checkpoint save fails as on a full disk (OSError
ENOSPC) where the file says: ``write`` (part way through writing the checkpoint's files, the default) or ``rename``
(at its rename into place), for every save or, as ``write@N``, for step N's only. Unset (a user's run), nothing
happens: one look at the environment per save.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

FULL_DISK_ENV = "VERL_FAULT_FULL_DISK"
"""The environment variable that names the fault's file."""


def full_disk(where: str, step: int, path: Path) -> None:
    """Raise ENOSPC for writing `path` if the fault's file asks for it at `where` ("write", "rename") of `step`."""
    marker = os.environ.get(FULL_DISK_ENV)
    if not marker:
        return
    try:
        wanted = Path(marker).read_text(encoding="utf-8").strip() or "write"
    except OSError:  # no file (yet, or any more): no fault
        return
    place, _, only = wanted.partition("@")
    if place == where and (not only or int(only) == step):
        # As a write() the device refuses reports it: no file name (`path` is for the reader of this code).
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected: {FULL_DISK_ENV} at {path.name})")
