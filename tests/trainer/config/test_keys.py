"""KEYS (trainer/config/keys.py): config keys named through the schema. Every `KEYS.<chain>` written in the
repository's Python source is checked against the schema here, read with `ast`, so that a key on an error path no
test runs cannot drift from the schema either."""

from __future__ import annotations

import ast
import copy
import pickle
from collections.abc import Iterator

import pytest

from tests.support import REPO
from trainer.config import FSDP_CONFIG, KEYS, RunConfig, Section, fsdp_key, key_of
from trainer.config.fields import section_type
from trainer.config.keys import Key, leaf_keys
from trainer.config.schema import FSDP_PREFIX, FSDPConfig


def test_a_key_is_its_dotted_path_and_drops_into_strings() -> None:
    key = KEYS.actor_rollout_ref.actor.fsdp_config.param_offload
    assert key == "actor_rollout_ref.actor.fsdp_config.param_offload" and isinstance(key, str)
    assert f"set {KEYS.data.max_prompt_length}=64" == "set data.max_prompt_length=64"
    assert {KEYS.trainer.seed: 1}["trainer.seed"] == 1
    assert str(KEYS) == "" and KEYS.data == "data"


def test_a_name_the_schema_lacks_fails_at_once_naming_it() -> None:
    # _step: a chain written out would be a wrong key in the repository (see the last tests)
    with pytest.raises(AttributeError, match=r"data has no key 'max_prompt_lenght' \(did you mean "
                                             r"'max_prompt_length'\?\); it has: train_files"):
        _step(KEYS.data, "max_prompt_lenght")
    with pytest.raises(AttributeError, match="the config has no key 'datta'"):
        _step(KEYS, "datta")
    with pytest.raises(AttributeError, match="trainer.seed is a setting, not a section: it has no key 'value'"):
        _step(KEYS.trainer.seed, "value")


def test_a_models_section_by_its_role() -> None:
    assert fsdp_key("critic").param_offload == "critic.fsdp_config.param_offload"
    assert fsdp_key("reward_model").offload_policy.norm == "reward_model.model.fsdp_config.offload_policy.norm"
    assert {role: fsdp_key(role) for role in FSDP_PREFIX} == FSDP_PREFIX
    with pytest.raises(AttributeError):
        _step(fsdp_key("ref"), "lr")
    assert f"set {FSDP_CONFIG.dynamic_offload.enabled}=true" == "set fsdp_config.dynamic_offload.enabled=true"


def test_key_of_checks_a_dotted_path() -> None:
    assert key_of("critic.optim.lr") == KEYS.critic.optim.lr and isinstance(key_of("critic.optim"), Key)
    with pytest.raises(AttributeError, match="critic has no key 'optimizer'"):
        key_of(".".join(["critic", "optimizer", "lr"]))


def test_a_key_pickles_and_copies_as_the_plain_string() -> None:
    key = KEYS.dynamic_offload.gpu_memory_threshold
    for copied in (pickle.loads(pickle.dumps(key)), copy.copy(key), copy.deepcopy(key)):
        assert copied == key and type(copied) in (str, Key)
    assert type(pickle.loads(pickle.dumps(key))) is str


def test_no_field_name_hides_behind_a_string_method() -> None:
    """Attribute access finds str's own attributes first: a field named like one (count, index, split) would
    give the method instead of the key."""
    clashes = [key for key in _all_keys() if key.rpartition(".")[2] in dir(str)]
    # verl's name, kept: KEYS cannot spell it by attribute (str.format), key_of can.
    assert clashes == ["actor_rollout_ref.rollout.multi_turn.format"]
    assert key_of(clashes[0]) == clashes[0] and isinstance(key_of(clashes[0]), Key)


def test_leaf_keys_are_every_setting_in_the_schemas_order() -> None:
    keys = list(leaf_keys())
    assert keys[0] == "actor_rollout_ref.model.path" and keys[-1] == "daemon.log_level"
    assert "critic.fsdp_config.offload_policy.norm" in keys and "critic.fsdp_config" not in keys
    assert all(isinstance(key_of(key), Key) for key in keys)


# ------------------------------------------------------------------------------ every KEYS chain written


def test_every_keys_chain_in_the_repository_names_a_key_of_the_schema() -> None:
    chains = list(_chains_in_sources())
    assert len(chains) >= 20, "the search found almost no KEYS chains: it would pass without looking"
    wrong = [f"{where}: {text}: {problem}" for where, text, problem in
             ((where, text, _problem(section, parts)) for where, text, section, parts in chains) if problem]
    assert wrong == []


def test_the_chain_check_catches_a_wrong_key() -> None:
    source = ("from trainer.config import KEYS, fsdp_key, key_of\n"
              "a = KEYS.data.max_prompt_lenght\nb = fsdp_key(role).param_ofload\nc = key_of('data.seeed')\n"
              "d = KEYS.trainer.seed.startswith('x')\ne = f'{KEYS.trainer.seed}'\nf = FSDP_CONFIG.wrap_polcy\n")
    found = [(text, _problem(section, parts)) for _, text, section, parts in
             sorted(_chains(ast.parse(source), "x.py"), key=lambda chain: int(chain[0].rpartition(":")[2]))]
    assert [(text, bool(problem)) for text, problem in found] == [
        ("KEYS.data.max_prompt_lenght", True), ("fsdp_key(...).param_ofload", True), ("key_of('data.seeed')", True),
        ("KEYS.trainer.seed.startswith", False), ("KEYS.trainer.seed", False), ("FSDP_CONFIG.wrap_polcy", True)]


def _step(key: Key, name: str) -> Key:
    return getattr(key, name)


def _chains_in_sources() -> Iterator[tuple[str, str, type[Section], list[str]]]:
    for path in sorted(REPO.rglob("*.py")):
        relative = path.relative_to(REPO)
        if any(part.startswith(".") or part in ("__pycache__", "runs", "build") for part in relative.parts):
            continue
        yield from _chains(ast.parse(path.read_text(encoding="utf-8")), str(relative))


def _chains(tree: ast.AST, where: str) -> Iterator[tuple[str, str, type[Section], list[str]]]:
    """(where, the chain as written, the section it starts from, its names) of each maximal chain of attributes
    on KEYS, FSDP_CONFIG or fsdp_key(...), and each key_of("literal")."""
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            parts: list[str] = []
            root: ast.expr = node
            while isinstance(root, ast.Attribute):
                parts.insert(0, root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id == "KEYS":
                yield f"{where}:{node.lineno}", ".".join(["KEYS", *parts]), RunConfig, parts
            elif isinstance(root, ast.Name) and root.id == "FSDP_CONFIG":
                yield f"{where}:{node.lineno}", ".".join(["FSDP_CONFIG", *parts]), FSDPConfig, parts
            elif _calls(root, "fsdp_key"):
                yield f"{where}:{node.lineno}", ".".join(["fsdp_key(...)", *parts]), FSDPConfig, parts
        elif _calls(node, "key_of") and isinstance(node, ast.Call) and node.args:
            argument = node.args[0]
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                yield f"{where}:{node.lineno}", f"key_of({argument.value!r})", RunConfig, argument.value.split(".")


def _calls(node: ast.AST, name: str) -> bool:
    if not isinstance(node, ast.Call):
        return False
    function = node.func
    return (isinstance(function, ast.Name) and function.id == name) or (
        isinstance(function, ast.Attribute) and function.attr == name)


def _problem(section: type[Section] | None, parts: list[str]) -> str | None:
    """Why a chain of names from `section` is not a key of the schema (None: it is; a string method may end it)."""
    for index, name in enumerate(parts):
        field = section.model_fields.get(name) if section is not None else None
        if field is None:
            if index == len(parts) - 1 and index > 0 and name in dir(str):
                return None  # KEYS.trainer.seed.startswith(...): a method of the key's string
            return f"{name!r} is not a key of {'.'.join(parts[:index]) or 'the config'}"
        section = section_type(field.annotation)
    return None


def _all_keys(section: type[Section] = RunConfig, prefix: str = "") -> Iterator[str]:
    """Every dotted key, sections included."""
    for name, field in section.model_fields.items():
        yield prefix + name
        child = section_type(field.annotation)
        if child is not None:
            yield from _all_keys(child, f"{prefix}{name}.")
