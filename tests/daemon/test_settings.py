"""The daemon's live settings: all or nothing, versioned, audited, and what a new trainer is sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from daemon.settings import SettingsStore
from trainer.config.live import LiveSettings, SettingsRejected
from trainer.config.messages import SettingsMessage, SettingsState

AUDIT_KEYS = {"time", "version", "old", "new", "source", "result"}


@pytest.fixture
def store(tmp_path: Path) -> SettingsStore:
    return SettingsStore(LiveSettings(), audit_path=tmp_path / "runs" / "x" / "settings_audit.jsonl",
                         clock=lambda: 1000.0)


def audit(store: SettingsStore) -> list[dict]:
    if not store.audit_path.exists():
        return []
    return [json.loads(line) for line in store.audit_path.read_text().splitlines()]


def test_a_change_gets_a_version_and_reports_old_and_new(store: SettingsStore) -> None:
    update = store.update({"gpu_memory_threshold": 0.7, "dynamic_offload.enabled": True}, source="api")
    assert update.version == 1 and store.version == 1
    assert update.old == {"gpu_memory_threshold": 0.85, "dynamic_offload.enabled": False}
    assert update.new == {"gpu_memory_threshold": 0.7, "dynamic_offload.enabled": True}
    assert update.values == store.values.public() and update.values["min_transformer_layers_on_gpu"] == 0
    assert store.update({"min_transformer_layers_on_gpu": 4}).version == 2
    assert store.values.gpu_memory_threshold == 0.7 and store.values.min_transformer_layers_on_gpu == 4
    assert audit(store)[0] == {"time": 1000.0, "version": 1, "old": update.old, "new": update.new,
                               "source": "api", "result": "accepted"}


@pytest.mark.parametrize("change", [
    {"gpu_memory_threshold": 0.5, "min_transformer_layers_on_gpu": -1},
    {"gpu_memory_threshold": 1.5},
    {"gpu_memory_threshold": "abc"},
    {"gpu_memory_threshold": 0.5, "no_such_setting": 1},
    {},
])
def test_a_change_with_any_bad_entry_changes_nothing(store: SettingsStore, change: dict) -> None:
    before = store.values
    with pytest.raises(SettingsRejected) as rejected:
        store.update(change)
    assert store.values == before and store.version == 0
    named = {problem.setting for problem in rejected.value.problems}
    bad = {name for name in change if name in ("min_transformer_layers_on_gpu", "no_such_setting")
           or (name == "gpu_memory_threshold" and change[name] != 0.5)}
    assert named == (bad or {"body"})
    [line] = audit(store)
    assert AUDIT_KEYS <= line.keys() and line["result"] == "rejected" and line["version"] is None
    assert {problem["setting"] for problem in line["problems"]} == named


def test_acknowledgement_records_the_step_once_per_version_and_audits_every_application(
        store: SettingsStore) -> None:
    store.update({"gpu_memory_threshold": 0.6})
    assert store.state().acknowledged_version == 0
    change = store.acknowledge(1, step=7)
    assert change is not None and change.new == {"gpu_memory_threshold": 0.6}
    assert store.state() == SettingsState(version=1, values=store.values, acknowledged_version=1, applied_at_step=7)
    assert store.acknowledge(1, step=12) is None  # a restarted trainer applying it again: not news...
    assert store.applied_at_step == 12
    applied = [line for line in audit(store) if line["result"] == "applied"]
    assert [line["step"] for line in applied] == [7, 12]  # ...but the audit log shows it
    assert all(AUDIT_KEYS <= line.keys() and line["source"] == "trainer" for line in applied)
    assert store.acknowledge(5, step=13) is None and store.acknowledged_version == 1  # a version never issued


def test_the_down_message_carries_the_current_version_and_every_value(store: SettingsStore) -> None:
    assert store.down_message() == SettingsMessage(version=0, values=LiveSettings())
    store.update({"log_level": "debug"})
    message = store.down_message()
    assert message.version == 1 and message.values.log_level == "debug"


def test_describe_lists_every_setting_with_who_applies_it(store: SettingsStore) -> None:
    body = store.describe()
    names = [entry.name for entry in body.settings]
    assert names == list(LiveSettings().public())
    by_name = {entry.name: entry for entry in body.settings}
    assert by_name["gpu_sample_interval_s"].applied_by == "daemon"
    assert by_name["gpu_memory_threshold"].applied_by == "trainer"
    assert all(entry.description for entry in body.settings)
    assert (body.values, body.version, body.acknowledged_version, body.applied_at_step) == (store.values, 0, 0, None)


def test_asking_for_the_values_in_effect_makes_no_version_and_no_audit_line(store: SettingsStore) -> None:
    first = store.update({"gpu_memory_threshold": 0.8})
    again = store.update({"gpu_memory_threshold": 0.8})  # `verl set gpu_memory_threshold=0.8` twice
    assert (again.version, again.old, again.new, again.changed) == (1, {}, {}, False)
    assert again.values == first.values and store.version == 1
    assert store.down_message().version == 1
    assert [line["result"] for line in audit(store)] == ["accepted"]


def test_old_and_new_keep_only_the_settings_whose_value_changes(store: SettingsStore) -> None:
    update = store.update({"gpu_memory_threshold": 0.85, "min_transformer_layers_on_gpu": 2})  # 0.85: the default
    assert update.changed and update.version == 1
    assert (update.old, update.new) == ({"min_transformer_layers_on_gpu": 0}, {"min_transformer_layers_on_gpu": 2})
    [line] = audit(store)
    assert (line["old"], line["new"]) == (update.old, update.new)
    assert store.acknowledge(1, step=3).new == {"min_transformer_layers_on_gpu": 2}
