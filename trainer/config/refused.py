"""The rules of a config the schema refused (`checks_despite_schema_errors`), so that every problem shows in one
round: the refused values are dropped and the rest validated again; each refused key holds a RefusedValue, which a
rule must not judge the default in place of, and a rule that reads one runs again with each value a refused choice
allows (rules.py holds the rules)."""

from __future__ import annotations

import copy
import itertools
import typing
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from trainer.config.errors import ConfigProblem, dotted, field_at, meant_key
from trainer.config.fields import Section, unwrap_optional
from trainer.config.rules import Rule, all_rules
from trainer.config.schema import RunConfig


def checks_despite_schema_errors(raw: dict[str, Any], errors: Sequence[ErrorDetails]) -> list[ConfigProblem]:
    """The checks beyond the schema of a config that failed it, so that every problem shows in one round.

    The refused values are dropped and the rest validated again; in that config each refused key holds a
    RefusedValue, since a check must not judge a default the user did not write. A check that reads one runs
    again with each value the refused key allows (where they are few: a choice, a switch), and what it finds with
    every one of them is reported: that does not depend on the refused value. A key misspelt (an unknown key close
    to a known one) refuses the key it was likely meant for. Problems at or under a dropped key are left out: the
    schema has named them.
    """
    patched = copy.deepcopy(raw)
    dropped: list[str] = []
    refused: list[list[str]] = []
    for error in errors:
        field_path = [str(part) for part in itertools.takewhile(lambda part: isinstance(part, str), error["loc"])]
        if field_path and _drop(patched, field_path):
            dropped.append(dotted(field_path))
            refused.append(field_path)
        if error["type"] == "extra_forbidden" and field_path:
            refused += [field_path[:-1] + [meant] for meant in meant_key(field_path)]
    try:
        config = RunConfig.model_validate(patched)
    except ValidationError:
        return []
    variants = _variants(config, refused)
    for field_path in refused:
        config = typing.cast(RunConfig, _refuse(config, field_path))
    problems = [problem for rule in all_rules() for problem in _despite_refused(rule, config, variants)]
    return [problem for problem in problems if not any(is_under(problem.path, key) for key in dropped)]


def _despite_refused(rule: Rule, config: RunConfig, variants: Sequence[RunConfig]) -> list[ConfigProblem]:
    """What `rule` finds in `config` (refused values in it); where it reads one, what it finds in every variant
    (each refused choice or switch at each of its values): none of that depends on the refused values."""
    try:
        return rule(config)
    except RefusedValueRead:
        pass
    found: list[ConfigProblem] | None = None
    for variant in variants:
        try:
            problems = rule(variant)
        except RefusedValueRead:
            return []
        found = problems if found is None else [problem for problem in found if problem in problems]
    return found or []


_MOST_VARIANTS = 64


def _variants(config: RunConfig, refused: Sequence[Sequence[str]]) -> list[RunConfig]:
    """`config` with its refused keys at each combination of the values they allow, where each allows a few (a
    Literal's choices, a boolean's two); one that allows more stays refused. None when there would be too many."""
    choices = []
    for field_path in refused:
        field = field_at(field_path)
        annotation = unwrap_optional(field.annotation) if field is not None else None
        values: tuple[Any, ...] = (typing.get_args(annotation) if typing.get_origin(annotation) is Literal
                                   else (False, True) if annotation is bool else ())
        if values:
            choices.append((field_path, values))
    combinations = list(itertools.product(*(values for _, values in choices)))
    if not choices or len(combinations) > _MOST_VARIANTS:
        return []
    refused_elsewhere = [path for path in refused if path not in [field_path for field_path, _ in choices]]
    variants = []
    for combination in combinations:
        variant = config
        for (field_path, _), value in zip(choices, combination, strict=True):
            variant = typing.cast(RunConfig, _set(variant, field_path, value))
        for field_path in refused_elsewhere:
            variant = typing.cast(RunConfig, _refuse(variant, field_path))
        variants.append(variant)
    return variants


def _set(section: Section, field_path: Sequence[str], value: Any) -> Section:
    """`section` with the field at `field_path` set to `value` (unvalidated: one of the values it allows)."""
    name = field_path[0]
    if name not in type(section).model_fields:
        return section
    if len(field_path) > 1:
        child = getattr(section, name)
        return section.model_copy(update={name: _set(child, field_path[1:], value)}) if isinstance(
            child, Section) else section
    return section.model_copy(update={name: value})


class RefusedValueRead(Exception):
    """A check read a value the schema refused."""


class RefusedValue:
    """Stands in a config for a value the schema refused: any use of it (a comparison, arithmetic, truth,
    text, an attribute) raises RefusedValueRead, so a check never judges the default in its place."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RefusedValueRead

    __bool__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __hash__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __mod__ = __rmod__ = _refuse
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __neg__ = __abs__ = _refuse
    __str__ = __format__ = __iter__ = __len__ = __contains__ = __index__ = __int__ = __float__ = _refuse
    __fspath__ = __getitem__ = _refuse

    def __getattr__(self, name: str) -> Any:
        raise RefusedValueRead

    def __repr__(self) -> str:
        return "<refused by the schema>"


def _refuse(section: Section, field_path: Sequence[str]) -> Section:
    """`section` with the field at `field_path` (or the deepest section field on the way) a RefusedValue."""
    name = field_path[0]
    if name not in type(section).model_fields:
        return section
    value = getattr(section, name)
    if len(field_path) > 1 and isinstance(value, Section):
        return section.model_copy(update={name: _refuse(value, field_path[1:])})
    return section.model_copy(update={name: RefusedValue()})


def _drop(raw: dict[str, Any], field_path: Sequence[str]) -> bool:
    node: Any = raw
    for part in field_path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict) and field_path[-1] in node:
        del node[field_path[-1]]
        return True
    return False


def is_under(path: str, key: str) -> bool:
    """Whether dotted `path` is `key` or lies under it (a field, or an item of a list)."""
    return path == key or path.startswith((key + ".", key + "["))
