"""What the benchmarks that start runs in subprocesses give them: the repository importable first."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]


def repository_first(parent: Mapping[str, str]) -> str:
    """A PYTHONPATH with the repository first, then whatever `parent`'s held (a device image's wheels come that way:
    a run that lost them could not import its dependencies)."""
    return os.pathsep.join(filter(None, [str(REPOSITORY), parent.get("PYTHONPATH")]))
