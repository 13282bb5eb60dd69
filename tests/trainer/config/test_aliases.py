"""The alias table (trainer/config/aliases.py): each entry points at keys the schema has, and each action does
what it says when loading: mapped keys are read as their canonical keys, noted keys become notes, refused keys
say where they live now. (verl's keys at their defaults: tests/trainer/config/test_verl_keys.py.)"""

from __future__ import annotations

import dataclasses
import fnmatch

import pytest

from trainer.config import ConfigError, Note, load_config, load_config_with_notes
from trainer.config import aliases as alias_table
from trainer.config.aliases import ALIASES, Action, Reading, entry_for
from trainer.config.keys import leaf_keys
from trainer.config.verl import verl_only_defaults

# Every key of the schema, its sections included.
SCHEMA_KEYS = sorted({".".join(key.split(".")[:length])
                      for key in leaf_keys() for length in range(1, key.count(".") + 2)})


def _matches_a_schema_key(pattern: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for key in SCHEMA_KEYS)


@pytest.mark.parametrize("alias", [alias for alias in ALIASES if alias.action in (Action.MAPPED, Action.REFUSED)],
                         ids=lambda alias: alias.written)
def test_a_mapped_or_moved_key_points_at_a_key_of_the_schema(alias: alias_table.Alias) -> None:
    assert alias.canonical is not None and _matches_a_schema_key(alias.canonical)
    if alias.reading is not Reading.OFFLOAD_SWITCH:  # verl's boolean is read at the schema's own key
        assert not _matches_a_schema_key(alias.written), "a key the schema has would never reach its entry"


def test_only_mapped_and_refused_entries_name_a_canonical_key_and_only_default_only_ones_accept_values() -> None:
    assert all((alias.canonical is not None) == (alias.action in (Action.MAPPED, Action.REFUSED)) for alias in ALIASES)
    assert all(not alias.accepts or alias.action in (Action.DEFAULT_ONLY, Action.NOTED) for alias in ALIASES)
    assert all(not alias.also or alias.reading is Reading.EACH for alias in ALIASES)


def test_a_key_takes_the_first_entry_that_matches() -> None:
    assert entry_for("critic.model.fsdp_config.ulysses_sequence_parallel_size").canonical == (
        "critic.ulysses_sequence_parallel_size")
    assert entry_for("critic.model.fsdp_config.param_offload").canonical == "critic.fsdp_config.*"
    assert entry_for("actor_rollout_ref.actor.strategy").accepts == ("fsdp", "fsdp2")
    assert entry_for("actor_rollout_ref.actor.fsdp_config.strategy").accepts == ()
    assert entry_for("trainer.no_such_key") is None


def test_no_key_of_verls_file_is_taken_for_a_mapped_or_moved_key() -> None:
    def leaves(node: dict, prefix: str) -> list[str]:
        return [key for name, value in node.items() for key in (
            leaves(value, f"{prefix}{name}.") if isinstance(value, dict) and value else [f"{prefix}{name}"])]

    assert [key for key in leaves(verl_only_defaults(), "")
            if entry_for(key).action not in (Action.DEFAULT_ONLY, Action.NOTED)] == []


def test_a_noted_key_is_accepted_whatever_its_value_and_becomes_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key becomes noted by its entry's action alone; at verl's default (or a value its entry accepts: what
    happens here anyway) it asks for nothing, and is not noted."""
    engine = entry_for("actor_rollout_ref.rollout.load_format")
    refused = entry_for("actor_rollout_ref.rollout.mode")
    noted = tuple(dataclasses.replace(alias, action=Action.NOTED) if alias is refused else alias for alias in ALIASES)
    monkeypatch.setattr(alias_table, "ALIASES", noted)
    loaded = load_config_with_notes(None, ["actor_rollout_ref.rollout.mode=sync",
                                           "actor_rollout_ref.rollout.load_format=safetensors",
                                           "actor_rollout_ref.rollout.enable_chunked_prefill=true",
                                           "actor_rollout_ref.rollout.free_cache_engine=true"])
    assert loaded.notes == [Note("actor_rollout_ref.rollout.mode", "sync", refused.why),
                            Note("actor_rollout_ref.rollout.load_format", "safetensors", engine.why)]
    assert load_config_with_notes(None, ["actor_rollout_ref.rollout.mode=async"]).notes == []
    assert load_config_with_notes().notes == []
    with pytest.raises(ConfigError):  # a key verl's file lacks is still unknown
        load_config(None, ["actor_rollout_ref.rollout.moed=sync"])


def test_a_models_dynamic_offload_level_is_read_as_the_run_wide_one() -> None:
    """A model's dynamic_offload.gpu_memory_threshold (the article's place) is an alias of the run-wide key; two
    models that disagree are one error naming both places."""
    actor = "actor_rollout_ref.actor.fsdp_config.dynamic_offload"
    config = load_config(None, [f"{actor}.gpu_memory_threshold=0.7", f"{actor}.enabled=true"])
    assert config.dynamic_offload.gpu_memory_threshold == 0.7
    with pytest.raises(ConfigError) as caught:
        load_config(None, [f"{actor}.gpu_memory_threshold=0.7",
                           "critic.fsdp_config.dynamic_offload.gpu_memory_threshold=0.6"])
    assert [str(problem) for problem in caught.value.problems] == [
        f"critic.fsdp_config.dynamic_offload.gpu_memory_threshold: got 0.6, but {actor}.gpu_memory_threshold is 0.7: "
        "the two are one setting (dynamic_offload.gpu_memory_threshold is its canonical place); allowed: one of them, "
        "or the same value"]
    with pytest.raises(ConfigError) as caught:
        load_config(None, [f"{actor}.gpu_memory_threshold=1.5"])
    assert [problem.path for problem in caught.value.problems] == [f"{actor}.gpu_memory_threshold"], \
        "a bad value is named where it was written"


def test_verl_train_names_the_noted_keys_in_one_note_line(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from daemon.cli import load_run_config

    engine = entry_for("actor_rollout_ref.rollout.load_format")
    swap = alias_table.noted("actor_rollout_ref.rollout.swap_space", "vLLM's CPU swap space; the rollout here has none")
    monkeypatch.setattr(alias_table, "ALIASES", (swap, *ALIASES))
    rollout = "actor_rollout_ref.rollout"
    load_run_config(None, [f"{rollout}.load_format=safetensors", f"+{rollout}.swap_space=4",
                           f"{rollout}.layered_summon=true"])
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"NOTE: {rollout}.load_format='safetensors', {rollout}.layered_summon=true: {engine.why}; "
                     f"{rollout}.swap_space=4: {swap.why}"], "keys that share a why-line are named together"
    load_run_config(None, [])
    assert capsys.readouterr().err == "", "no note without a noted key"


def test_a_key_noted_by_name_is_accepted_where_verls_file_lacks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    swap = alias_table.noted("actor_rollout_ref.rollout.swap_space", "vLLM's CPU swap space; the rollout here has none")
    monkeypatch.setattr(alias_table, "ALIASES", (swap, *ALIASES))
    loaded = load_config_with_notes(None, ["+actor_rollout_ref.rollout.swap_space=4"])
    assert loaded.notes == [Note("actor_rollout_ref.rollout.swap_space", 4, swap.why)]
    assert load_config(None, ["+actor_rollout_ref.rollout.swap_space=4", "~actor_rollout_ref.rollout.swap_space"])
    with pytest.raises(ConfigError, match="swap_spaces"):  # a pattern of it would not take a misspelt key
        load_config(None, ["+actor_rollout_ref.rollout.swap_spaces=4"])
