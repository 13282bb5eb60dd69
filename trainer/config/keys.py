"""Config keys named through the schema, so that a renamed field cannot leave a stale dotted string behind.

``KEYS.actor_rollout_ref.actor.fsdp_config.param_offload`` is the string
``"actor_rollout_ref.actor.fsdp_config.param_offload"``; each step is checked against the schema as it is taken
(a name the schema lacks raises AttributeError naming it), and tests/trainer/config/test_keys.py checks every
``KEYS.<chain>`` written in the repository against the schema, so a key on an error path that no test runs cannot
drift either. A `Key` is a `str`, so it drops into f-strings and comparisons unchanged:
``f"set {KEYS.data.max_prompt_length}"``. A model's placement section by its role: ``fsdp_key("critic")``; any
model's, relative to the model: ``FSDP_CONFIG.param_offload`` (``"fsdp_config.param_offload"``).

Code inside trainer/config may write keys as strings: it lives beside the schema, and its messages are tested.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator

from trainer.config.fields import Section, section_type
from trainer.config.placement import FSDPConfig
from trainer.config.schema import FSDP_PREFIX, RunConfig


class Key(str):
    """A dotted config key the schema has; attribute access walks into its section."""

    _section: type[Section] | None

    def __new__(cls, path: str, section: type[Section] | None) -> Key:
        key = super().__new__(cls, path)
        key._section = section
        return key

    def __getattr__(self, name: str) -> Key:
        if name.startswith("__"):  # copy, pickle and friends probe for dunder methods: not keys
            raise AttributeError(name)
        section = self._section
        if section is None:
            raise AttributeError(f"{self} is a setting, not a section: it has no key {name!r}")
        field = section.model_fields.get(name)
        if field is None:
            close = difflib.get_close_matches(name, list(section.model_fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise AttributeError(f"{self or 'the config'} has no key {name!r}{hint}; it has: "
                                 f"{', '.join(section.model_fields)}")
        return Key(f"{self}.{name}" if self else name, section_type(field.annotation))

    def __reduce__(self) -> tuple[type[str], tuple[str]]:
        """Pickled (or copied) as the plain string it spells."""
        return str, (str(self),)


KEYS = Key("", RunConfig)
"""The root of the schema: ``KEYS.data`` is ``"data"``."""


FSDP_CONFIG = Key("fsdp_config", FSDPConfig)
"""Any model's fsdp_config, for a message about every model's: ``FSDP_CONFIG.param_offload`` is
``"fsdp_config.param_offload"``."""


def key_of(dotted: str) -> Key:
    """The Key of a dotted path, checked step by step (AttributeError names the first step the schema lacks); a
    step named like a str method (verl's multi_turn.format) is the key too."""
    key = KEYS
    for name in dotted.split("."):
        key = Key.__getattr__(key, name)
    return key


def fsdp_key(role: str) -> Key:
    """The fsdp_config section of a model by its role (actor, ref, critic, reward_model)."""
    return key_of(FSDP_PREFIX[role])


def leaf_keys(section: type[Section] = RunConfig, prefix: str = "") -> Iterator[str]:
    """Every setting's dotted key under `section`, in the schema's order (sections walked, not listed)."""
    for name, field in section.model_fields.items():
        child = section_type(field.annotation)
        if child is None:
            yield prefix + name
        else:
            yield from leaf_keys(child, f"{prefix}{name}.")
