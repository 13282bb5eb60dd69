"""Command-line overrides in Hydra's grammar, and ``${...}`` interpolation, applied to the raw config tree
before the schema validates it.

hydra-core's own parser reads each override, so a verl launch script's lines mean here what they mean
there: ``key=value``, ``+key=value`` (add), ``++key=value`` (add or override), ``~key`` (delete), lists
``[a,b]``, dicts ``{a:1}``, quoted strings and ``${...}``, which omegaconf resolves (``${data.max_prompt_length}``,
``${oc.env:USER}``, ``${oc.env:VAR,default}``). One difference from Hydra: the schema, not the YAML file,
decides which keys exist, so ``key=value`` sets any key the schema knows (Hydra wants ``+`` for a key the
file lacks), ``~key`` puts a key back to its default, and a key the schema does not know is the schema's
usual unknown-key error.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.config.errors import ConfigProblem, dotted, field_at, unknown_key_message
from trainer.config.fields import describe_allowed, is_mapping, section_type, show, unwrap_optional
from trainer.config.verl import knows, merged_over_defaults

GRAMMAR = ("key=value, +key=value (add a key), ++key=value (add or override), ~key (back to the default); "
           "e.g. data.train_batch_size=64")
INTERPOLATIONS = ("${key.path} of another key, ${oc.env:VAR} of an environment variable that is set, "
                  "or ${oc.env:VAR,default}")


def apply_overrides(raw: dict[str, Any], lines: Iterable[str]) -> list[ConfigProblem]:
    """Apply each override line to `raw` in order; one problem per line that cannot be applied."""
    parser = OverridesParser.create()
    problems = []
    for line in lines:
        problem = _apply(raw, parser, line)
        if problem is not None:
            problems.append(problem)
    return problems


def _apply(raw: dict[str, Any], parser: OverridesParser, line: str) -> ConfigProblem | None:
    try:
        override = parser.parse_override(line)
    except HydraException as error:
        key = line.lstrip("~+").partition("=")[0].strip()
        # ANTLR's words for the commonest slip ("missing EQUAL at '<EOF>'") would puzzle more than help.
        reason = "no '='" if "=" not in line and not line.startswith("~") else _first_line(error)
        return ConfigProblem(key or line, f"got {line!r}, which is not an override ({reason}); allowed: {GRAMMAR}")
    key = override.key_or_group
    if not key:
        return ConfigProblem(line, f"got {line!r}, an override without a key; allowed: {GRAMMAR}")
    if override.package is not None:
        return ConfigProblem(key, f"got {line!r}: '@package' picks a package of a Hydra config group, and this "
                             f"config has no groups; allowed: {GRAMMAR}")
    if override.is_sweep_override():
        return ConfigProblem(key, f"got {line!r}, a sweep over several values (Hydra's --multirun), and a run "
                             f"takes one; allowed: {key}=[a,b] for a list, {key}='a,b' for a string with a comma")
    parts = key.split(".")
    if override.type is OverrideType.DEL:
        return _delete(raw, parts, override, line)
    node = _parent(raw, parts, line, create=True)
    if isinstance(node, ConfigProblem):
        return node
    assert node is not None  # created on the way
    if override.type is OverrideType.ADD and parts[-1] in node:
        return ConfigProblem(key, f"got {line!r}, but {key} is already set to {show(node[parts[-1]])} (by the "
                             f"config file or an earlier override), and + adds a key that is not set; allowed: "
                             f"{key}=... or ++{key}=... to change it")
    node[parts[-1]] = _typed_value(override, parts, line)
    return None


def _typed_value(override: Override, parts: list[str], line: str) -> Any:
    """The override's value; for a string setting the text as typed (experiment_name=1e3 stays '1e3')."""
    value = override.value()
    field = field_at(parts)
    if field is not None and unwrap_optional(field.annotation) is str and not isinstance(value, str | None):
        return line.partition("=")[2]
    return value


def _parent(raw: dict[str, Any], parts: list[str], line: str, *, create: bool) -> dict[str, Any] | ConfigProblem | None:
    """The mapping in `raw` that holds the key `parts` names (created on the way when `create`; None when it
    is not there), or the problem of a path that runs through a setting."""
    node = raw
    for index, part in enumerate(parts[:-1]):
        prefix = ".".join(parts[: index + 1])
        field = field_at(parts[: index + 1])
        # An unknown key is left for the schema, which reports it with a suggestion; a free-form mapping
        # (override_config) takes any key below it.
        if field is not None and section_type(field.annotation) is None and not is_mapping(field.annotation):
            return ConfigProblem(prefix, f"got the override {line!r}, but {prefix} is a setting, not a section; "
                                 f"allowed: {prefix}=<{describe_allowed(field.annotation, field)}>")
        if part not in node:
            if not create:
                return None
            node[part] = {}
        child = node[part]
        if not isinstance(child, dict):
            return ConfigProblem(prefix, f"got the override {line!r}, but the config file sets {prefix} to "
                                 f"{show(child)}; allowed: a section (a mapping) at {prefix}")
        node = child
    return node


def _delete(raw: dict[str, Any], parts: list[str], override: Override, line: str) -> ConfigProblem | None:
    """~key: drop the key from `raw`, so the schema's default applies; ~key=value only while it is value."""
    key = ".".join(parts)
    unknown = _first_unknown(parts)
    if unknown is not None:
        return ConfigProblem(dotted(unknown), unknown_key_message(unknown))
    node = _parent(raw, parts, line, create=False)
    if isinstance(node, ConfigProblem):
        return node
    if node is None or parts[-1] not in node:
        return None  # not set: it has its default already
    expected = override.value()
    if override.value_type is not None and node[parts[-1]] != expected:
        return ConfigProblem(key, f"got {line!r}, but {key} is {show(node[parts[-1]])}, and ~key=value deletes "
                             f"the key only while it has that value; allowed: ~{key}, or ~{key}="
                             f"{show(node[parts[-1]])}")
    del node[parts[-1]]
    return None


def _first_unknown(parts: list[str]) -> list[str] | None:
    """The shortest prefix of `parts` that the schema does not know, or None (a free-form mapping knows all, and
    so does verl's dialect: trainer/config/verl.py)."""
    if knows(parts):
        return None
    for index in range(len(parts)):
        prefix = parts[: index + 1]
        field = field_at(prefix)
        if field is None:
            return prefix
        if is_mapping(field.annotation):
            return None
    return None


# -------------------------------------------------------------------------------------- interpolation


def resolve_interpolations(raw: dict[str, Any]) -> list[ConfigProblem]:
    """Replace each ``${...}`` in `raw` by its value, in place; one problem per value that does not resolve.

    They resolve against the whole config, defaults included, so ``${data.max_prompt_length}`` works
    whether or not the file sets that key.
    """
    found = list(_interpolated(raw, []))
    if not found:
        return []
    try:
        tree = OmegaConf.create(merged_over_defaults(raw))
    except (OmegaConfBaseException, ValueError) as error:
        return [ConfigProblem(dotted(found[0]), f"got {show(_at(raw, found[0]))}, but the config cannot be "
                              f"interpolated ({_first_line(error)}); allowed: {INTERPOLATIONS}")]
    problems = []
    for location in found:
        text = _at(raw, location)
        try:
            value: Any = tree
            for part in location:
                value = value[part]
            if isinstance(value, DictConfig | ListConfig):
                value = OmegaConf.to_container(value, resolve=True)
        except OmegaConfBaseException as error:
            problems.append(ConfigProblem(dotted(location), f"got {show(text)}, which cannot be resolved "
                                          f"({_first_line(error)}); allowed: {INTERPOLATIONS}"))
            continue
        _set(raw, location, value)
    return problems


def _interpolated(node: Any, location: list[Any]) -> Iterator[list[Any]]:
    """The location of every string in `node` that holds a ``${``."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _interpolated(value, [*location, key])
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _interpolated(value, [*location, index])
    elif isinstance(node, str) and "${" in node:
        yield location


def _at(node: Any, location: list[Any]) -> Any:
    for part in location:
        node = node[part]
    return node


def _set(node: Any, location: list[Any], value: Any) -> None:
    _at(node, location[:-1])[location[-1]] = value


def _first_line(error: BaseException) -> str:
    """The gist of a parser's or omegaconf's error (omegaconf adds lines of context, and wraps a KeyError)."""
    lines = str(error).strip().splitlines()
    text = lines[0].strip() if lines else type(error).__name__
    wrapped = re.fullmatch(r"KeyError raised while resolving interpolation: \"(.*)\"", text)
    return wrapped.group(1) if wrapped else text
