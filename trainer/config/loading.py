"""Loading a run config: the YAML file (or the built-in defaults), then the command line's overrides in
Hydra's grammar, then ``${...}`` interpolation, then verl's dialect (trainer/config/verl.py), the schema and
every check beyond it in one pass."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainer.config.overrides import apply_overrides, resolve_interpolations
from trainer.config.schema import (
    ConfigError,
    ConfigProblem,
    RunConfig,
    launch_keys_from_environment,
    read_yaml,
    validate_config,
)
from trainer.config.verl import translate


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
    environment_problems = launch_keys_from_environment(raw, os.environ)
    tree, problems, aliases = translate(raw)
    problems += environment_problems
    try:
        config = validate_config(tree)
    except ConfigError as error:
        problems += error.problems
    if problems:
        raise ConfigError([_as_written(problem, aliases) for problem in problems])
    return config


def _as_written(problem: ConfigProblem, aliases: dict[str, str]) -> ConfigProblem:
    """The problem under the key path the user wrote (verl's critic.model.fsdp_config for critic.fsdp_config)."""
    for canonical, written in aliases.items():
        if problem.path == canonical or problem.path.startswith(canonical + "."):
            return ConfigProblem(written + problem.path[len(canonical):], problem.message)
    return problem
