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
from trainer.config.megatron import CONFIG_NAMES, asks_for_megatron
from trainer.config.multi_turn import MEGATRON_NAMED_CONFIGS, NAMED_CONFIGS
from trainer.config.notes import Note
from trainer.config.placement import TRAINING_ONLY_KEYS
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
    notes: list[Note] = field(default_factory=list)
    """One per noted key given away from verl's default: the key, its value and why it has no effect here."""
    megatron: list[tuple[str, Any]] = field(default_factory=list)
    """(key, value) of each setting that asks for Megatron-LM (`single_megatron_problem`)."""
    shared: set[str] = field(default_factory=set)
    """The canonical keys set by a key of several models (actor_rollout_ref.fsdp_config.*): a warning that one of
    them has no effect (the reference's, when no reference is built) does not apply to what the user wrote."""


def translate(raw: dict[str, Any], config_name: str | None = None) -> Translation:
    """verl's dialect in `raw` (interpolations resolved) -> the tree the schema reads, and what was found.
    `config_name`: verl's Hydra --config-name, when a launch script gives one."""
    translation = Translation(copy.deepcopy(raw), megatron=asks_for_megatron(_leaves(raw, []), config_name))
    name = None if config_name is None else config_name.removesuffix(".yaml")
    if name is not None and name not in (*CONFIG_NAMES, *NAMED_CONFIGS, *MEGATRON_NAMED_CONFIGS):
        translation.problems.append(ConfigProblem("--config-name", f"got {config_name!r}, a Hydra config of its "
                                                  "own, which this project cannot compose; allowed: ppo_trainer "
                                                  "(verl's, the default), verl's multi-turn examples' "
                                                  f"{', '.join(NAMED_CONFIGS)}, or its settings in a YAML file "
                                                  "given with --config"))
    for alias in entries(Action.MAPPED):
        _READERS[alias.reading](alias, translation)
    translation.problems += _drop_verl_keys(translation.tree, RunConfig, verl_only_defaults(), [], _Context(raw),
                                            translation.notes)
    return translation


# ------------------------------------------------------------------------------------- mapped keys


def _move(alias: Alias, translation: Translation) -> None:
    """Each key the alias writes -> its canonical key (Reading.EACH: each of its canonical keys); a key given in
    two places with different values is a problem naming both, and the value there first stands. A setting of a
    trained model only (an optimizer's) goes to the first canonical key alone: the reference is frozen."""
    assert alias.canonical is not None  # a mapped entry names its canonical key
    pattern = re.compile(r"(.*)".join(re.escape(part) for part in alias.written.split("*")))
    # Named in a message: a section's place, or the key.
    places = [canonical.removesuffix(".*") for canonical in (alias.canonical, *alias.also)]
    tree = translation.tree
    for location, value in list(_leaves(tree, [])):
        written = ".".join(location)
        if value == {} and written == alias.written.removesuffix(".*"):
            _remove(tree, location)  # verl's section given empty: nothing to move
            continue
        match = pattern.fullmatch(written)
        if match is None:
            continue
        targets = [(_filled(canonical, match.groups()).split("."), place)
                   for canonical, place in zip((alias.canonical, *alias.also), places, strict=True)]
        targets = targets[:1] + [(target, place) for target, place in targets[1:] if not _trains_only(target)]
        if any(_blocked(tree, target[:-1]) for target, _ in targets):
            continue  # a setting in the way: the schema names it, and this key left where it was written
        _remove(tree, location)
        for target, place in targets:
            canonical = ".".join(target)
            _put(translation, _mapping_at(tree, target[:-1]), canonical, written, copy.deepcopy(value), place)
            if alias.also:
                translation.shared.add(canonical)


def _put(translation: Translation, parent: dict[str, Any], canonical: str, written: str, value: Any,
         place: str) -> None:
    """`value`, written at `written`, as the canonical key's (in `parent`); a different value there already is a
    problem naming both places: the canonical one, or the other key that was read as it (each model's
    dynamic_offload level, read as the run-wide one)."""
    name = canonical.rpartition(".")[2]
    if name in parent and not _same(parent[name], value):
        other = translation.written.get(canonical, canonical)
        translation.problems.append(ConfigProblem(written, f"got {show(value)}, but {other} is "
                                                  f"{show(parent[name])}: the two are one setting ({place} is "
                                                  "its canonical place); allowed: one of them, or the same value"))
        return
    if name not in parent:
        translation.written[canonical] = written
    parent[name] = value


def _trains_only(target: Sequence[str]) -> bool:
    """Whether a dotted key (split) is a frozen model's setting that acts on training only (its optimizer's)."""
    key = ".".join(target)
    return any(key.startswith(FSDP_PREFIX[role] + ".") and key[len(FSDP_PREFIX[role]) + 1:].split(".")[0]
               in TRAINING_ONLY_KEYS for role in FROZEN_ROLES)


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


def _per_gpu(alias: Alias, translation: Translation) -> None:
    """verl's size over all GPUs -> the per-GPU size: divided among the data-parallel ranks (the world size over
    the model's Ulysses degree; the reward model's over the world size), as verl's workers divide it."""
    assert alias.canonical is not None
    tree = translation.tree
    location = alias.written.split(".")
    parent = _node(tree, location[:-1])
    if not isinstance(parent, dict) or location[-1] not in parent:
        return
    value = parent.pop(location[-1])
    if value is None:
        return  # verl's default: unset
    ranks = _data_parallel_ranks(tree, alias.canonical)
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= ranks):
        what = f"the {ranks} data-parallel ranks" if ranks > 1 else "the run's rank"
        translation.problems.append(ConfigProblem(alias.written, f"got {show(value)}, but it is verl's size over all "
                                                  f"GPUs, divided among {what}; allowed: an integer >= {ranks}, or "
                                                  f"set {alias.canonical.rpartition('.')[2]}"))
        return
    target = alias.canonical.split(".")
    _put(translation, _mapping_at(tree, target[:-1]), alias.canonical, alias.written, value // ranks,
         alias.canonical)


def _data_parallel_ranks(tree: dict[str, Any], canonical: str) -> int:
    """The ranks a size over all GPUs is divided among, for the model of `canonical` (verl's fsdp_workers: the
    world size over the Ulysses degree; its reward model: the world size)."""
    numbers = [_value_or_default(tree, ["trainer", "nnodes"]), _value_or_default(tree, ["trainer", "n_gpus_per_node"])]
    model = canonical.split(".")[0]
    if model != "reward_model":
        numbers.append(_value_or_default(tree, [model, "ulysses_sequence_parallel_size"] if model == "critic" else
                                         ["actor_rollout_ref", "actor", "ulysses_sequence_parallel_size"]))
    counts = [number for number in numbers if isinstance(number, int) and not isinstance(number, bool) and number >= 1]
    if len(counts) < len(numbers):
        return 1  # a bad number: the schema names it
    world = counts[0] * counts[1]
    return max(1, world // counts[2]) if len(counts) > 2 else world


_READERS: dict[Reading, Callable[[Alias, Translation], None]] = {
    Reading.MOVED: _move, Reading.SAME_AS: _same_as, Reading.OFFLOAD_SWITCH: _offload_switch, Reading.EACH: _move,
    Reading.PER_GPU: _per_gpu}


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
                    context: _Context, notes: list[Note]) -> list[ConfigProblem]:
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
            alias = entry_for(".".join([*location, key]))
            assert alias is not None
            notes += _noted([*location, key], value, _ABSENT, alias, context)
    return problems


def _noted_by_name(key: str) -> bool:
    """Whether the table notes this very key (not by a pattern): accepted even where verl's file lacks it. A
    pattern notes keys of verl's file only, so that a misspelt key is never taken for one of verl's."""
    alias = entry_for(key)
    return alias is not None and alias.action is Action.NOTED and alias.written == key


_ABSENT = object()  # a key verl's file does not have


def _noted(location: list[str], value: Any, default: Any, alias: Alias, context: _Context) -> list[Note]:
    """The notes of a noted key given at `value`: none at verl's default (or at a value the entry accepts: what
    happens here anyway), else one for each setting of it (each leaf of a mapping given under it)."""
    if isinstance(value, dict) and value and (isinstance(default, dict) or default is _ABSENT):
        return [note for name, item in value.items() for note in _noted(
            [*location, str(name)], item, default.get(name, _ABSENT) if isinstance(default, dict) else _ABSENT,
            alias, context)]
    if isinstance(default, str) and "${" in default:
        default = context.value_of(location, default)
    if (default is not _ABSENT and _same(value, default)) or any(_same(value, choice) for choice in alias.accepts):
        return []
    return [Note(".".join(location), value, alias.why)]


def _compare(location: list[str], value: Any, default: Any, context: _Context,
             notes: list[Note]) -> list[ConfigProblem]:
    key = ".".join(location)
    if isinstance(default, dict) and isinstance(value, dict):
        # Each setting under a section takes its own entry (multi_turn.enable is refused where rollout.* is noted).
        problems: list[ConfigProblem] = []
        for name, item in value.items():
            below = [*location, str(name)]
            if name in default:
                problems += _compare(below, item, default[name], context, notes)
            elif (entry := entry_for(".".join(below))) is not None and entry.action is Action.NOTED:
                notes += _noted(below, item, _ABSENT, entry, context)
            else:
                problems.append(_refused(".".join(below), item, None, key))
        return problems
    alias = entry_for(key)
    if alias is not None and alias.action is Action.NOTED:
        notes += _noted(location, value, default, alias, context)
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
