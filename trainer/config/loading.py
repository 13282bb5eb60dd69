"""Loading a run config: the YAML file (or the built-in defaults), then the command line's overrides in
Hydra's grammar, then ``${...}`` interpolation, then the schema and every check beyond it in one pass."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainer.config.overrides import apply_overrides, resolve_interpolations
from trainer.config.schema import ConfigError, RunConfig, read_yaml, validate_config


def load_config(path: str | os.PathLike[str] | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """Read a YAML file (none: every default), apply the overrides, resolve interpolations, validate.

    Raises ConfigError naming every problem at once.
    """
    raw: dict[str, Any] = read_yaml(Path(path)) if path is not None else {}
    problems = apply_overrides(raw, overrides)
    if problems:  # a line that could not be applied leaves the tree short of what the user meant
        raise ConfigError(problems)
    problems = resolve_interpolations(raw)
    if problems:
        raise ConfigError(problems)
    return validate_config(raw)
