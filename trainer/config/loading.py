"""Loading a run config: the YAML file (or the built-in defaults), then the command line's overrides in
Hydra's grammar, then ``${...}`` interpolation, then verl's dialect (the alias table, trainer/config/aliases.py,
applied by trainer/config/verl.py), the schema and every rule beyond it in one pass (trainer/config/rules.py)."""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from pydantic import ValidationError

from trainer.config.environment import launch_keys_from_environment
from trainer.config.errors import ConfigError, ConfigProblem, ConfigWarning, describe_pydantic_error
from trainer.config.fields import Section
from trainer.config.megatron import single_megatron_problem
from trainer.config.multi_turn import under_named_config
from trainer.config.notes import Note, engine_notes
from trainer.config.overrides import apply_overrides, resolve_interpolations
from trainer.config.refused import checks_despite_schema_errors, is_under
from trainer.config.rules import check_semantics
from trainer.config.schema import RunConfig
from trainer.config.verl import translate


class LoadedConfig(NamedTuple):
    """A loaded config, and what to say at start: the notes of verl's keys read otherwise than in verl (one NOTE
    line: notes.note_line), and the warnings of settings that run as in verl but likely not as meant (a WARNING
    line each)."""

    config: RunConfig
    notes: list[Note]
    warnings: list[ConfigProblem]


def load_config(path: str | os.PathLike[str] | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """Read a YAML file (none: every default), apply the overrides, resolve interpolations, validate.

    Raises ConfigError naming every problem at once.
    """
    return load_config_with_notes(path, overrides).config


def load_config_with_notes(path: str | os.PathLike[str] | None = None, overrides: Iterable[str] = (),
                           config_name: str | None = None) -> LoadedConfig:
    """load_config, and what to say at start: the notes of verl's keys read otherwise than verl reads them (the
    noted entries of the alias table, the rollout's engine keys), for one NOTE line, and the warnings.

    `config_name` is verl's Hydra --config-name, when a verl launch script gives one (verl.py: config_name_problems).
    """
    raw: dict[str, Any] = read_yaml(Path(path)) if path is not None else {}
    raw = under_named_config(raw, config_name)
    problems = apply_overrides(raw, overrides)
    if problems:  # a line that could not be applied leaves the tree short of what the user meant
        raise ConfigError(problems)
    problems = resolve_interpolations(raw)
    if problems:
        raise ConfigError(problems)
    environment_problems = launch_keys_from_environment(raw, os.environ)
    translation = translate(raw, config_name)
    problems = translation.problems + environment_problems
    warnings: list[ConfigProblem] = []
    try:
        config, warnings = _validated(translation.tree)
    except ConfigError as error:
        problems += error.problems
    if problems or translation.megatron:
        raise ConfigError(single_megatron_problem([_as_written(problem, translation.written) for problem in problems],
                                                  translation.megatron))
    # A warning about what a key of several models set for the reference alone does not apply to what was written.
    warnings = [_as_written(warning, translation.written) for warning in warnings
                if not all(any(is_under(key, shared) for shared in translation.shared)
                           for key in (getattr(warning, "keys", ()) or (warning.path,)))]
    return LoadedConfig(config, engine_notes(config) + translation.notes, warnings)


def _as_written(problem: ConfigProblem, written: dict[str, str]) -> ConfigProblem:
    """The problem under the key path the user wrote (verl's critic.model.fsdp_config.param_offload for
    critic.fsdp_config.param_offload)."""
    for canonical, as_written in written.items():
        if problem.path == canonical or problem.path.startswith(canonical + "."):
            return dataclasses.replace(problem, path=as_written + problem.path[len(canonical):])
    for canonical, as_written in written.items():  # a section whose keys were written elsewhere
        below = canonical[len(problem.path):]
        if canonical.startswith(problem.path + ".") and as_written.endswith(below):
            return dataclasses.replace(problem, path=as_written.removesuffix(below))
    return problem


def validate_config(raw: dict[str, Any]) -> RunConfig:
    """Turn a plain dict into a RunConfig, or raise ConfigError naming every problem (its warnings: see
    load_config_with_notes)."""
    return _validated(raw)[0]


def _validated(raw: dict[str, Any]) -> tuple[RunConfig, list[ConfigProblem]]:
    """The RunConfig of a plain dict and its warnings, or ConfigError naming every problem."""
    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as error:
        errors = error.errors()
        problems = [describe_pydantic_error(item) for item in errors]
        problems += [problem for problem in checks_despite_schema_errors(raw, errors)
                     if not isinstance(problem, ConfigWarning)]
        raise ConfigError(problems) from None
    found = check_semantics(config)
    problems = [problem for problem in found if not isinstance(problem, ConfigWarning)]
    if problems:
        raise ConfigError(problems)
    return resolve_defaults(config), [problem for problem in found if isinstance(problem, ConfigWarning)]


def resolve_defaults(config: RunConfig) -> RunConfig:
    """Fill the "unset means same as the actor" fields so the saved config is explicit."""
    actor = config.actor_rollout_ref.actor
    critic = config.critic.model_copy(
        update={
            "enable": config.use_critic,
            "ppo_mini_batch_size": config.critic.ppo_mini_batch_size or actor.ppo_mini_batch_size,
            "ppo_micro_batch_size_per_gpu": config.critic.ppo_micro_batch_size_per_gpu
            or actor.ppo_micro_batch_size_per_gpu,
            "ppo_epochs": config.critic.ppo_epochs or actor.ppo_epochs,
            "model": config.critic.model.model_copy(
                update={"path": config.critic.model.path or config.actor_rollout_ref.model.path}
            ),
            **_token_budget_defaults(config.critic, "use_dynamic_bsz", actor.use_dynamic_bsz,
                                     "forward_max_token_len_per_gpu", config.critic.ppo_max_token_len_per_gpu),
        }
    )
    scorers = {name: section.model_copy(update=_token_budget_defaults(
        section, "log_prob_use_dynamic_bsz", actor.use_dynamic_bsz,
        "log_prob_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu))
        for name, section in (("rollout", config.actor_rollout_ref.rollout), ("ref", config.actor_rollout_ref.ref))}
    return config.model_copy(update={"critic": critic,
                                     "actor_rollout_ref": config.actor_rollout_ref.model_copy(update=scorers)})


def _token_budget_defaults(section: Section, switch: str, switch_default: bool, budget: str,
                           budget_default: int) -> dict[str, Any]:
    """verl's interpolations of the dynamic-batch keys (e.g. ${actor.use_dynamic_bsz}) for those left unset."""
    return {switch: switch_default if getattr(section, switch) is None else getattr(section, switch),
            budget: budget_default if getattr(section, budget) is None else getattr(section, budget)}


def dump_config(config: RunConfig) -> str:
    """The config as YAML, every field explicit: what the trainer process is started with."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


# ------------------------------------------------------------------------------------------- YAML


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader with two fixes for config files.

    - ``1e-5`` is a float (YAML 1.2 reads it so; PyYAML follows YAML 1.1, which wants ``1.0e-5``), so a
      learning rate written the usual way stays a number inside free-form keys such as override_config.
    - A key given twice in one mapping is an error: PyYAML would keep the last one without a word.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults` legitimately repeats the keys it merges.
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (first on line {first_line[key] + 1})",
                    key_node.start_mark)
            if isinstance(key, typing.Hashable):
                first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789"))


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        why = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError([ConfigProblem("--config", f"got {str(path)!r}, which {why}; "
                                         "allowed: a YAML file")])
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_ConfigLoader)  # noqa: S506 (a safe loader)
    except UnicodeDecodeError:
        raise ConfigError([ConfigProblem("--config", f"got {str(path)!r}, which is not UTF-8 text; "
                                         "allowed: a YAML file")]) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = getattr(error, "problem", None) or "not valid YAML"
        raise ConfigError([ConfigProblem("--config", f"{str(path)!r} is not valid YAML{where}: {reason}; "
                                         "allowed: a YAML mapping of sections")]) from None
    if raw is None:
        # Most likely the wrong file, or one not written yet: a run with every default is not what was meant.
        raise ConfigError([ConfigProblem("--config", f"got {str(path)!r}, which is empty (or only comments); "
                                         f"allowed: a YAML mapping of sections ({', '.join(RunConfig.model_fields)})"
                                         "; `{}` runs every default")])
    if not isinstance(raw, dict):
        kind = "list" if isinstance(raw, list) else type(raw).__name__
        raise ConfigError([ConfigProblem("--config", f"{str(path)!r} holds a {kind}; allowed: a mapping of "
                                         f"sections ({', '.join(RunConfig.model_fields)})")])
    return raw
