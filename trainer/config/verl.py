"""verl's dialect of the config, translated in front of the schema as the alias table (trainer/config/aliases.py)
says: each mapped key is read as its canonical key (in the table's order), each noted key is set aside with a
note, and each other key of verl's ppo_trainer.yaml (verl_ppo_trainer.yaml beside this module, verl's generated
file as it ships) that the schema lacks is accepted at verl's default value and refused at any other, in one line
saying why. A key in neither the schema nor verl's file is left to the schema, which reports it as unknown (with
its did-you-mean), so a misspelt key is never taken for one of verl's.

A default that verl's file writes as an interpolation (``rollout.prompt_length: ${data.max_prompt_length}``)
is that interpolation's value in the user's config: the key is accepted where it mirrors its source.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.config.aliases import Action, Alias, Reading, entries, entry_for, why
from trainer.config.errors import ConfigProblem
from trainer.config.fields import Section, section_type, show
from trainer.config.schema import FROZEN_ROLES, FSDP_PREFIX, RunConfig

VERL_CONFIG_FILE = Path(__file__).with_name("verl_ppo_trainer.yaml")
GROUPS = ("embedding", "lm_head", "transformer", "norm")


@dataclass
class Translation:
    """A config in verl's dialect, translated."""

    tree: dict[str, Any]
    """What the schema reads."""
    problems: list[ConfigProblem] = field(default_factory=list)
    """The problems of verl's keys."""
    written: dict[str, str] = field(default_factory=dict)
    """{canonical key: the key the user wrote}, for naming problems as the user wrote the keys."""
    notes: list[str] = field(default_factory=list)
    """One line per noted key: the key and why it has no effect here."""


def translate(raw: dict[str, Any]) -> Translation:
    """verl's dialect in `raw` (interpolations resolved) -> the tree the schema reads, and what was found."""
    translation = Translation(copy.deepcopy(raw))
    for alias in entries(Action.MAPPED):
        _READERS[alias.reading](alias, translation)
    translation.problems += _drop_verl_keys(translation.tree, RunConfig, verl_only_defaults(), [], _Context(raw),
                                            translation.notes)
    return translation


# ------------------------------------------------------------------------------------- mapped keys


def _move(alias: Alias, translation: Translation) -> None:
    """Each key the alias writes -> its canonical key; a key given in both places with different values is a
    problem naming both, and the canonical place's value stands."""
    assert alias.canonical is not None  # a mapped entry names its canonical key
    pattern = re.compile(r"(.*)".join(re.escape(part) for part in alias.written.split("*")))
    place = alias.canonical.removesuffix(".*")  # named in the message: a section's place, or the key
    tree = translation.tree
    for location, value in list(_leaves(tree, [])):
        written = ".".join(location)
        if value == {} and written == alias.written.removesuffix(".*"):
            _remove(tree, location)  # verl's section given empty: nothing to move
            continue
        match = pattern.fullmatch(written)
        if match is None:
            continue
        target = _filled(alias.canonical, match.groups()).split(".")
        if _blocked(tree, target[:-1]):
            continue  # a setting in the way: the schema names it, and this key left where it was written
        _remove(tree, location)
        parent = _mapping_at(tree, target[:-1])
        canonical, name = ".".join(target), target[-1]
        if name in parent and not _same(parent[name], value):
            translation.problems.append(ConfigProblem(written, f"got {show(value)}, but {canonical} is "
                                                      f"{show(parent[name])}: the two are one setting ({place} is "
                                                      "its canonical place); allowed: one of them, or the same value"))
            continue
        if name not in parent:
            translation.written[canonical] = written
        parent[name] = value


def _same_as(alias: Alias, translation: Translation) -> None:
    """A key that repeats its canonical key's value: dropped where it does, a problem where it does not."""
    assert alias.canonical is not None
    tree = translation.tree
    for location, value in list(_leaves(tree, [])):
        if not alias.matches(".".join(location)):
            continue
        _remove(tree, location)
        current = _value_or_default(tree, alias.canonical.split("."))
        if not _same(value, current):
            # Only the reference's Ulysses degree repeats another key today, hence "that degree".
            translation.problems.append(ConfigProblem(".".join(location), f"got {show(value)}, but {alias.why}, "
                                                      f"{alias.canonical}: {show(current)}; allowed: that degree, or "
                                                      "leave the key out"))


def _offload_switch(alias: Alias, translation: Translation) -> None:
    """verl's offload_policy: true|false in each model's fsdp_config -> this project's per-group mapping."""
    for role, prefix in FSDP_PREFIX.items():
        if alias.matches(f"{prefix}.offload_policy"):
            translation.problems += _offload_policy(translation.tree, prefix.split("."), role not in FROZEN_ROLES)


_READERS: dict[Reading, Callable[[Alias, Translation], None]] = {
    Reading.MOVED: _move, Reading.SAME_AS: _same_as, Reading.OFFLOAD_SWITCH: _offload_switch}


def _offload_policy(tree: dict[str, Any], path: Sequence[str], trains: bool) -> list[ConfigProblem]:
    """verl's offload_policy: true|false at `path` -> this project's per-group mapping (and optimizer_offload)."""
    node = _node(tree, path)
    if not isinstance(node, dict) or not isinstance(node.get("offload_policy"), bool):
        return []
    prefix = ".".join(path)
    if not node["offload_policy"]:
        del node["offload_policy"]  # verl's default: nothing offloaded by it
        return []
    node["offload_policy"] = dict.fromkeys(GROUPS, "cpu")
    if not trains:
        return []
    if node.get("optimizer_offload") is False and "optimizer_offload" in node:
        return [ConfigProblem(f"{prefix}.optimizer_offload", f"got false, but {prefix}.offload_policy is true, "
                              "which offloads everything, optimizer states included (verl's FSDP2 "
                              "CPUOffloadPolicy); allowed: true or unset, or a mapping for offload_policy")]
    node["optimizer_offload"] = True
    return []


def _filled(pattern: str, parts: Sequence[str]) -> str:
    """`pattern` with each `*` replaced by the next of `parts` (a canonical key without `*` takes none of them:
    every model's written key is read as the one run-wide key)."""
    pieces = pattern.split("*")
    return pieces[0] + "".join(part + piece for part, piece in zip(parts, pieces[1:], strict=False))


def _node(tree: Any, path: Sequence[str]) -> Any:
    """The value at `path` in nested mappings, or None where a step is missing or not a mapping."""
    node = tree
    for part in path:
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _blocked(tree: dict[str, Any], path: Sequence[str]) -> bool:
    """Whether a step of `path` holds something other than a mapping (a missing step does not block it)."""
    node: Any = tree
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return not isinstance(node, dict)
        node = node[part]
    return not isinstance(node, dict)


def _mapping_at(tree: dict[str, Any], path: Sequence[str]) -> dict[str, Any]:
    """The mapping at `path` (not `_blocked`), created on the way."""
    node = tree
    for part in path:
        node = node.setdefault(part, {})
    return node


def _value_or_default(tree: dict[str, Any], path: Sequence[str]) -> Any:
    """The value the config gives at `path`, or the schema's default when it gives none."""
    parent = _node(tree, path[:-1])
    if isinstance(parent, dict) and path[-1] in parent:
        return parent[path[-1]]
    value: Any = RunConfig()
    for part in path:
        value = getattr(value, part)
    return value


def _remove(tree: dict[str, Any], location: Sequence[str]) -> None:
    """Delete the key at `location`, and each mapping on the way that it leaves empty."""
    parents = [tree]
    for part in location[:-1]:
        parents.append(parents[-1][part])
    del parents[-1][location[-1]]
    for depth in range(len(location) - 1, 0, -1):
        if parents[depth]:
            break
        del parents[depth - 1][location[depth - 1]]


def _leaves(node: Any, location: list[str]) -> Iterator[tuple[list[str], Any]]:
    """(location, value) of each setting in nested mappings; an empty mapping is one too."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, [*location, str(key)])
    elif location:
        yield location, node


# --------------------------------------------------------------------------------- verl's own keys


@functools.cache
def verl_only_defaults() -> dict[str, Any]:
    """verl's file as a tree of the keys the schema lacks (its mapped keys read as their canonical keys), each at
    verl's default (interpolations kept as written)."""
    translation = Translation(yaml.safe_load(VERL_CONFIG_FILE.read_text(encoding="utf-8")))
    for alias in entries(Action.MAPPED):
        if alias.reading is not Reading.OFFLOAD_SWITCH:  # the schema has offload_policy: pruned below
            _READERS[alias.reading](alias, translation)
    tree = translation.tree
    # verl's Megatron trainer (ppo_megatron_trainer.yaml) puts each model's engine settings under `megatron`:
    # accepted empty, so that any of them is refused as needing Megatron rather than as a key unknown.
    for section in (tree["actor_rollout_ref"]["actor"], tree["actor_rollout_ref"]["ref"], tree["critic"]):
        section["megatron"] = {}
    return _unknown_to(tree, RunConfig)


def _unknown_to(tree: dict[str, Any], section: type[Section] | None) -> dict[str, Any]:
    pruned: dict[str, Any] = {}
    for key, value in tree.items():
        field_info = section.model_fields.get(key) if section is not None else None
        if field_info is None:
            pruned[key] = value
            continue
        child = section_type(field_info.annotation)
        if child is not None and isinstance(value, dict):
            below = _unknown_to(value, child)
            if below:
                pruned[key] = below
    return pruned


def knows(parts: Sequence[str]) -> bool:
    """Whether a dotted key (split) is one of verl's keys outside the schema, or a mapped or noted key of the
    alias table (a `.*` pattern's section included)."""
    key = ".".join(parts)
    if _noted_by_name(key):
        return True
    for alias in entries(Action.MAPPED):
        if alias.matches(key) or (alias.written.endswith(".*") and key == alias.written[:-2]):
            return True
    node: Any = verl_only_defaults()
    for part in parts:
        if not isinstance(node, dict):
            return False
        if part not in node:
            return node == {} and node is not verl_only_defaults()  # under a mapping verl leaves empty
        node = node[part]
    return True


class _Context:
    """The user's config laid over the schema's defaults, for the value of an interpolated verl default."""

    def __init__(self, raw: dict[str, Any]):
        self.raw = raw
        self._tree: Any = None

    def value_of(self, location: list[str], interpolation: str) -> Any:
        """What `interpolation` gives at `location` in the user's config (_UNRESOLVED when it cannot)."""
        if self._tree is None:
            self._tree = OmegaConf.create(merged_over_defaults(self.raw))
        probe = copy.deepcopy(self._tree)
        key = ".".join(location)
        try:
            OmegaConf.update(probe, key, interpolation, force_add=True)
            value = OmegaConf.select(probe, key, throw_on_missing=True)
            return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig | ListConfig) else value
        except (OmegaConfBaseException, ValueError):
            return _UNRESOLVED


_UNRESOLVED = object()


def merged_over_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` laid over the schema's defaults, mapping by mapping: what an interpolation resolves against."""
    merged: dict[str, Any] = _merged(RunConfig().model_dump(mode="json"), raw)
    return merged


def _merged(defaults: Any, raw: Any) -> Any:
    if not (isinstance(defaults, dict) and isinstance(raw, dict)):
        return raw
    merged = dict(defaults)
    for key, value in raw.items():
        merged[key] = _merged(defaults[key], value) if key in defaults else value
    return merged


def _drop_verl_keys(node: dict[str, Any], section: type[Section] | None, verl: Any, location: list[str],
                    context: _Context, notes: list[str]) -> list[ConfigProblem]:
    """Remove from `node` each key of verl's the schema lacks; a problem for each one away from its default (a
    note for each noted one)."""
    problems: list[ConfigProblem] = []
    for key in list(node):
        field_info = section.model_fields.get(key) if section is not None else None
        value = node[key]
        if field_info is not None:
            child = section_type(field_info.annotation)
            if child is not None and isinstance(value, dict):
                below = verl.get(key) if isinstance(verl, dict) else None
                problems += _drop_verl_keys(value, child, below if isinstance(below, dict) else {}, [*location, key],
                                            context, notes)
            continue
        if isinstance(verl, dict) and key in verl:
            del node[key]
            problems += _compare([*location, key], value, verl[key], context, notes)
        elif _noted_by_name(".".join([*location, key])):
            del node[key]
            notes.append(_note(".".join([*location, key])))
    return problems


def _noted_by_name(key: str) -> bool:
    """Whether the table notes this very key (not by a pattern): accepted even where verl's file lacks it. A
    pattern notes keys of verl's file only, so that a misspelt key is never taken for one of verl's."""
    alias = entry_for(key)
    return alias is not None and alias.action is Action.NOTED and alias.written == key


def _note(key: str) -> str:
    alias = entry_for(key)
    assert alias is not None
    return f"{key}: {alias.why}"


def _compare(location: list[str], value: Any, default: Any, context: _Context,
             notes: list[str]) -> list[ConfigProblem]:
    key = ".".join(location)
    alias = entry_for(key)
    if alias is not None and alias.action is Action.NOTED:
        notes.append(_note(key))
        return []
    if isinstance(default, str) and "${" in default:
        # verl's key mirrors another (actor.use_remove_padding: ${...model.use_remove_padding}): where it does,
        # its source's own line speaks for it.
        default = context.value_of(location, default)
        if _same(value, default):
            return []
    if alias is not None and alias.accepts:
        if any(_same(value, choice) for choice in alias.accepts):
            return []
        return [ConfigProblem(key, f"got {show(value)}, but {alias.why}; allowed: "
                              f"{' or '.join(show(choice) for choice in alias.accepts)}")]
    if isinstance(default, dict) and isinstance(value, dict):
        problems: list[ConfigProblem] = []
        for name, item in value.items():
            below = [*location, str(name)]
            if name in default:
                problems += _compare(below, item, default[name], context, notes)
            else:
                problems.append(_refused(".".join(below), item, None, key))
        return problems
    if _same(value, default):
        return []
    return [_refused(key, value, default, key)]


def _refused(key: str, value: Any, default: Any, pattern_key: str) -> ConfigProblem:
    reason = why(key) or why(pattern_key) or "this project has no counterpart of it"
    allowed = ("verl's default (leave the key out)" if default is None or default is _UNRESOLVED
               else f"verl's default {show(default)} (or leave the key out)")
    return ConfigProblem(key, f"got {show(value)}, but {reason}; allowed: {allowed}")


def _same(value: Any, other: Any) -> bool:
    """Equal as YAML values: 1 and 1.0 are, true and 1 are not, a tuple equals the same list."""
    if isinstance(value, bool) or isinstance(other, bool):
        return isinstance(value, bool) and isinstance(other, bool) and value == other
    if isinstance(value, dict) and isinstance(other, dict):
        return value.keys() == other.keys() and all(_same(value[key], other[key]) for key in value)
    if isinstance(value, list | tuple) and isinstance(other, list | tuple):
        return len(value) == len(other) and all(_same(a, b) for a, b in zip(value, other, strict=True))
    return bool(value == other)
