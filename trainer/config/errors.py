"""The problems of a config and their messages: each names its dotted key, the value given and what is allowed,
in one line ("data.train_batch_size: got 0, out of range; allowed: an integer >= 1"). Pydantic's errors are
turned into such lines here; an unknown key gets its did-you-mean, and a key that moved says where it lives now
(the refused entries of the alias table, trainer/config/aliases.py)."""

from __future__ import annotations

import difflib
import fnmatch
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from trainer.config.aliases import moved_to
from trainer.config.fields import describe_allowed, section_type, show, unwrap_optional
from trainer.config.keys import leaf_keys
from trainer.config.schema import RunConfig


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a config: where, what was given, what is allowed."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(Exception):
    """A config that cannot run; carries every problem found, not just the first."""

    def __init__(self, problems: Sequence[ConfigProblem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(problem) for problem in self.problems))


def ignored(key: str, value: Any, default: Any, why: str, remedy: str = "") -> ConfigProblem:
    """A key set to `value` that the run would not act on, `why`, and what to do instead of setting it.

    An error, not a warning: whoever reads the config would believe it. Only keys set away from their defaults
    are named, so a default config is clean, and so is a resolved one (every default written out).
    """
    return ConfigProblem(key, f"got {show(value)}, but {why}: it would have no effect; allowed: the default "
                         f"({show(default)}; leave the key out){remedy}")


@dataclass(frozen=True)
class ConfigWarning(ConfigProblem):
    """A problem of a config that runs as verl runs it: said at start in a WARNING line, not refused."""

    keys: tuple[str, ...] = ()
    """The dotted keys it is about, where it names several under `path` (its section)."""


def warned(key: str, value: Any, default: Any, why: str, remedy: str = "") -> ConfigProblem:
    """A key set to `value` that the run does not act on, `why` (verl runs it so too, and ignores it), and what to
    do instead of setting it."""
    return ConfigWarning(key, f"got {show(value)}, but {why}: it has no effect (the default: {show(default)}; leave "
                         f"the key out{remedy})")


def warned_of_section(section: str, settings: Sequence[tuple[str, Any]], why: str, remedy: str = "") -> ConfigProblem:
    """Settings of one section (`settings`: (key under it, value)) that the run does not act on, `why`: one warning
    for all of them."""
    given = ", ".join(f"{key}={show(value)}" for key, value in settings)
    return ConfigWarning(section, f"got {given}, but {why}: {'they have' if len(settings) > 1 else 'it has'} no "
                         f"effect (leave {'them' if len(settings) > 1 else 'it'} out{remedy})",
                         keys=tuple(f"{section}.{key}" for key, _ in settings))


# ------------------------------------------------------------------------------- schema messages


_WHY_WRONG = {
    "int_parsing": "not an integer",
    "int_type": "not an integer",
    "int_from_float": "not a whole number",
    "float_parsing": "not a number",
    "float_type": "not a number",
    "finite_number": "not a finite number",
    "bool_parsing": "not true or false",
    "bool_type": "not true or false",
    "string_type": "not a string",
    "list_type": "not a list",
    "tuple_type": "not a list",
    "greater_than": "out of range",
    "greater_than_equal": "out of range",
    "less_than": "out of range",
    "less_than_equal": "out of range",
    "literal_error": "not one of the choices",
}


def describe_pydantic_error(error: ErrorDetails) -> ConfigProblem:
    """One of pydantic's errors as a problem in this project's words."""
    location = list(error["loc"])
    path = dotted(location)
    kind = error["type"]
    given = error.get("input")
    field = field_at(location)
    if kind == "extra_forbidden":
        return ConfigProblem(path, _moved_key(location, given) or unknown_key_message(location))
    if kind == "missing":
        return ConfigProblem(path, "is missing")
    if kind == "value_error":  # the schema's validators write whole "got ...; allowed: ..." messages
        return ConfigProblem(path, str(error["ctx"]["error"]))
    if field is None:
        return ConfigProblem(path, f"got {show(given)}; {error['msg']}")
    annotation = field.annotation
    if location and isinstance(location[-1], int):  # an item of a list or tuple
        annotation = next(iter(typing.get_args(unwrap_optional(annotation))), annotation)
    section = section_type(annotation)
    if section is not None:
        return ConfigProblem(path, f"got {show(given)}, but {location[-1]} is a section; allowed: a mapping "
                             f"of its keys ({', '.join(section.model_fields)})")
    if kind == "dict_type":
        return ConfigProblem(path, f"got {show(given)}, not a mapping; allowed: a mapping of keys to values")
    why = _WHY_WRONG.get(kind)
    if why is None:
        return ConfigProblem(path, f"got {show(given)}; {error['msg']}")
    return ConfigProblem(path, f"got {show(given)}, {why}; allowed: {describe_allowed(annotation, field)}")


def dotted(location: Sequence[Any]) -> str:
    """A pydantic location as a dotted key, list items in brackets: data.train_files[0]."""
    text = ""
    for part in location:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + str(part)
    return text


def _moved_key(location: Sequence[Any], given: Any) -> str | None:
    """Where an unknown key that moved (a refused entry of the alias table) is set now; None for any other."""
    alias = moved_to(dotted(location))
    parent = field_at(location[:-1]) if len(location) > 1 else None
    section = RunConfig if len(location) == 1 else section_type(parent.annotation) if parent is not None else None
    if alias is None or alias.canonical is None or section is None:
        return None
    return f"got {show(given)}, but {alias.why}: {_set_instead(alias.canonical, given)}; " \
           f"allowed: {', '.join(section.model_fields)}"


def _set_instead(canonical: str, given: Any) -> str:
    """Where to set a moved key: its key, or (a pattern over the models) each model's place and an example."""
    if "*" not in canonical:
        return f"set {canonical} instead"
    place = canonical.partition("*.")[2].partition(".")[0]
    example = next(key for key in leaf_keys() if fnmatch.fnmatchcase(key, canonical))
    return f"set it in each model's {place} instead, e.g. {example}={show(given)}"


def unknown_key_message(location: Sequence[Any]) -> str:
    """Name the unknown key, the closest known one, and the allowed keys of its section."""
    name = str(location[-1])
    parent = field_at(location[:-1]) if len(location) > 1 else None
    section = RunConfig if len(location) == 1 else section_type(parent.annotation) if parent else None
    what = "section" if len(location) == 1 else "key"
    if section is None:
        return f"got the unknown {what} {name!r}"
    allowed = list(section.model_fields)
    close = difflib.get_close_matches(name, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"got the unknown {what} {name!r}{hint}; allowed: {', '.join(allowed)}"


def meant_key(field_path: Sequence[str]) -> list[str]:
    """The known key an unknown one at `field_path` likely misspells, if any."""
    parent = field_at(field_path[:-1]) if len(field_path) > 1 else None
    section = RunConfig if len(field_path) == 1 else section_type(parent.annotation) if parent else None
    if section is None:
        return []
    return difflib.get_close_matches(field_path[-1], list(section.model_fields), n=1)


def field_at(location: Sequence[Any]) -> FieldInfo | None:
    """The schema field a pydantic error location points at (list indexes are skipped)."""
    section: type[BaseModel] | None = RunConfig
    field = None
    for part in location:
        if isinstance(part, int):
            continue
        if section is None:
            return None
        field = section.model_fields.get(str(part))
        if field is None:
            return None
        section = section_type(field.annotation)
    return field
