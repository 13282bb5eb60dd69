"""The daemon's live settings: all or nothing, versioned, audited, and what a new trainer is sent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from api.schemas import SettingsNotSavedError
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
    update = store.update({"dynamic_offload.gpu_memory_threshold": 0.7, "dynamic_offload.enabled": True},
                          source="api")
    assert update.version == 1 and store.version == 1
    assert update.old == {"dynamic_offload.gpu_memory_threshold": 0.85, "dynamic_offload.enabled": False}
    assert update.new == {"dynamic_offload.gpu_memory_threshold": 0.7, "dynamic_offload.enabled": True}
    assert update.values == store.values.public()
    assert update.values["dynamic_offload.min_transformer_layers_on_gpu"] == 0
    assert store.update({"dynamic_offload.min_transformer_layers_on_gpu": 4}).version == 2
    assert store.values.gpu_memory_threshold == 0.7 and store.values.min_transformer_layers_on_gpu == 4
    assert audit(store)[0] == {"time": 1000.0, "version": 1, "old": update.old, "new": update.new,
                               "source": "api", "result": "accepted"}


THRESHOLD, MINIMUM = "dynamic_offload.gpu_memory_threshold", "dynamic_offload.min_transformer_layers_on_gpu"


def test_a_short_name_is_taken_and_the_change_shown_by_the_canonical_name(store: SettingsStore) -> None:
    update = store.update({"gpu_memory_threshold": 0.7, "log_level": "debug", "gpu_sample_interval_s": 2})
    assert update.old == {THRESHOLD: 0.85, "daemon.log_level": "info", "telemetry.gpu_sample_interval_s": 1.0}
    assert update.new == {THRESHOLD: 0.7, "daemon.log_level": "debug", "telemetry.gpu_sample_interval_s": 2.0}
    assert store.values.gpu_memory_threshold == 0.7 and store.values.log_level == "debug"
    [line] = audit(store)
    assert (line["old"], line["new"]) == (update.old, update.new)
    assert store.acknowledge(1, step=4).new == update.new
    assert audit(store)[-1]["new"] == update.new


@pytest.mark.parametrize("values", [(0.7, 0.6), (0.7, 0.7)], ids=["different", "the same"])
def test_a_setting_named_by_both_its_names_is_refused_with_nothing_changed(
        store: SettingsStore, values: tuple[float, float]) -> None:
    with pytest.raises(SettingsRejected) as rejected:
        store.update({"gpu_memory_threshold": values[0], THRESHOLD: values[1], "log_level": "debug"})
    [problem] = rejected.value.problems
    assert problem.setting == THRESHOLD
    assert f"gpu_memory_threshold={values[0]!r}" in problem.message
    assert f"{THRESHOLD}={values[1]!r}" in problem.message
    assert store.values == LiveSettings() and store.version == 0
    [line] = audit(store)
    assert line["result"] == "rejected" and line["new"] == {
        "gpu_memory_threshold": values[0], THRESHOLD: values[1], "daemon.log_level": "debug"}
    assert line["problems"] == [{"setting": THRESHOLD, "message": problem.message}]


def test_a_setting_named_twice_beside_other_bad_entries_is_one_problem_of_several(store: SettingsStore) -> None:
    with pytest.raises(SettingsRejected) as rejected:
        store.update({"min_transformer_layers_on_gpu": 1, MINIMUM: "x" * 10_000, "log_level": "loud", "nope": 1})
    assert sorted(problem.setting for problem in rejected.value.problems) == ["daemon.log_level", MINIMUM, "nope"]
    assert all(len(problem.message) < 400 for problem in rejected.value.problems)
    assert "(10002 characters)" in str(rejected.value) and store.version == 0


@pytest.mark.parametrize("change", [
    {THRESHOLD: 0.5, MINIMUM: -1},
    {THRESHOLD: 1.5},
    {THRESHOLD: "abc"},
    {THRESHOLD: 0.5, "no_such_setting": 1},
    {},
])
def test_a_change_with_any_bad_entry_changes_nothing(store: SettingsStore, change: dict) -> None:
    before = store.values
    with pytest.raises(SettingsRejected) as rejected:
        store.update(change)
    assert store.values == before and store.version == 0
    named = {problem.setting for problem in rejected.value.problems}
    bad = {name for name in change if name in (MINIMUM, "no_such_setting")
           or (name == THRESHOLD and change[name] != 0.5)}
    assert named == (bad or {"body"})
    [line] = audit(store)
    assert AUDIT_KEYS <= line.keys() and line["result"] == "rejected" and line["version"] is None
    assert {problem["setting"] for problem in line["problems"]} == named


def test_acknowledgement_records_the_step_once_per_version_and_audits_every_application(
        store: SettingsStore) -> None:
    store.update({THRESHOLD: 0.6})
    assert store.state().acknowledged_version == 0
    change = store.acknowledge(1, step=7)
    assert change is not None and change.new == {THRESHOLD: 0.6}
    assert store.state() == SettingsState(version=1, values=store.values, acknowledged_version=1, applied_at_step=7)
    assert store.acknowledge(1, step=12) is None  # a restarted trainer applying it again: not news...
    assert store.applied_at_step == 12
    applied = [line for line in audit(store) if line["result"] == "applied"]
    assert [line["step"] for line in applied] == [7, 12]  # ...but the audit log shows it
    assert all(AUDIT_KEYS <= line.keys() and line["source"] == "trainer" for line in applied)
    assert store.acknowledge(5, step=13) is None and store.acknowledged_version == 1  # a version never issued


def test_the_down_message_carries_the_current_version_and_every_value(store: SettingsStore) -> None:
    assert store.down_message() == SettingsMessage(version=0, values=LiveSettings())
    store.update({"daemon.log_level": "debug"})
    message = store.down_message()
    assert message.version == 1 and message.values.log_level == "debug"


def test_describe_lists_every_setting_with_who_applies_it(store: SettingsStore) -> None:
    body = store.describe()
    names = [entry.name for entry in body.settings]
    assert names == list(LiveSettings().public())
    assert names == ["dynamic_offload.gpu_memory_threshold", "dynamic_offload.min_transformer_layers_on_gpu",
                     "dynamic_offload.enabled", "telemetry.gpu_sample_interval_s", "telemetry.pcie_sample_interval_s",
                     "daemon.log_level"]
    by_name = {entry.name: entry for entry in body.settings}
    assert by_name["telemetry.gpu_sample_interval_s"].applied_by == "daemon"
    assert by_name[THRESHOLD].applied_by == "trainer"
    assert (by_name[THRESHOLD].short_name, by_name["dynamic_offload.enabled"].short_name) == (
        "gpu_memory_threshold", None)
    assert all(entry.description for entry in body.settings)
    assert (body.values, body.version, body.acknowledged_version, body.applied_at_step) == (store.values, 0, 0, None)


def test_asking_for_the_values_in_effect_makes_no_version_and_no_audit_line(store: SettingsStore) -> None:
    first = store.update({THRESHOLD: 0.8})
    again = store.update({"gpu_memory_threshold": 0.8})  # `verl set gpu_memory_threshold=0.8` after it
    assert (again.version, again.old, again.new, again.changed) == (1, {}, {}, False)
    assert again.values == first.values and store.version == 1
    assert store.down_message().version == 1
    assert [line["result"] for line in audit(store)] == ["accepted"]


def test_old_and_new_keep_only_the_settings_whose_value_changes(store: SettingsStore) -> None:
    update = store.update({THRESHOLD: 0.85, MINIMUM: 2})  # 0.85: the default
    assert update.changed and update.version == 1
    assert (update.old, update.new) == ({MINIMUM: 0}, {MINIMUM: 2})
    [line] = audit(store)
    assert (line["old"], line["new"]) == (update.old, update.new)
    assert store.acknowledge(1, step=3).new == {MINIMUM: 2}


LARGEST_INTEGER = 2**53 - 1  # the largest whole number the API's readers hold exactly


@pytest.mark.parametrize("value", [10**400, LARGEST_INTEGER + 1, 1e300], ids=["400 digits", "2**53", "1e300"])
def test_a_whole_number_beyond_what_readers_hold_is_refused(store: SettingsStore, value: float) -> None:
    """10**400 once passed validation and then overflowed float() in the daemon, after the store had changed."""
    with pytest.raises(SettingsRejected) as rejected:
        store.update({MINIMUM: value})
    [problem] = rejected.value.problems
    assert problem.setting == MINIMUM and f"<= {LARGEST_INTEGER}" in problem.message
    assert len(problem.message) < 250 and store.version == 0


def test_a_whole_number_sent_as_a_json_float_is_a_whole_number(store: SettingsStore) -> None:
    update = store.update({MINIMUM: 4.0})  # JSON Schema's "integer" takes 4.0
    assert update.new == {MINIMUM: 4} and store.values.min_transformer_layers_on_gpu == 4
    assert store.update({"min_transformer_layers_on_gpu": 5.0}).new == {MINIMUM: 5}  # by its short name too
    assert store.update({MINIMUM: LARGEST_INTEGER}).version == 3


def test_an_unknown_name_does_not_hide_the_other_bad_values(store: SettingsStore) -> None:
    with pytest.raises(SettingsRejected) as rejected:
        store.update({"no_such_setting": 1, THRESHOLD: 1.5, "daemon.log_level": "loud",
                      "telemetry.gpu_sample_interval_s": 2})
    assert sorted(problem.setting for problem in rejected.value.problems) == [
        "daemon.log_level", THRESHOLD, "no_such_setting"]


def test_rejected_values_and_names_are_cut_to_an_excerpt(store: SettingsStore) -> None:
    with pytest.raises(SettingsRejected) as rejected:
        store.update({"log_level": "x" * 100_000, "n" * 10_000: 1, "gpu_memory_threshold": [0.5] * 10_000})
    assert len(str(rejected.value)) < 1200  # what the daemon logs
    assert all(len(problem.setting) < 150 and len(problem.message) < 400 for problem in rejected.value.problems)
    assert "(100002 characters)" in str(rejected.value)
    [line] = store.audit_path.read_text().splitlines()
    assert len(line) < 2000 and json.loads(line)["result"] == "rejected"


def test_a_change_that_cannot_be_written_to_the_audit_log_changes_nothing(tmp_path: Path) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("needs Linux's /dev/full")
    store = SettingsStore(LiveSettings(), audit_path=Path("/dev/full"))  # every write: ENOSPC, a full disk
    with pytest.raises(SettingsNotSavedError, match="not made: the settings audit log /dev/full cannot be written"):
        store.update({"gpu_memory_threshold": 0.6})
    assert store.values == LiveSettings() and store.version == 0 and store.down_message().version == 0
    # What happened anyway is not turned into a failure: a rejection, an acknowledgement.
    with pytest.raises(SettingsRejected):
        store.update({"gpu_memory_threshold": 2})
    store.audit_path = tmp_path / "settings_audit.jsonl"
    assert store.update({"gpu_memory_threshold": 0.6}).version == 1
    store.audit_path = Path("/dev/full")
    assert store.acknowledge(1, step=3) is not None and store.acknowledged_version == 1


PARTIAL_WRITE = """
import resource, signal, sys
from pathlib import Path
from api.schemas import SettingsNotSavedError
from daemon.settings import SettingsStore
from trainer.config.live import LiveSettings

path = Path(sys.argv[1])
store = SettingsStore(LiveSettings(), audit_path=path)
store.update({"gpu_memory_threshold": 0.6})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit: EFBIG instead of death
resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 20, resource.RLIM_INFINITY))
try:
    store.update({"gpu_memory_threshold": 0.7})
except SettingsNotSavedError:
    print("refused", store.version, store.values.gpu_memory_threshold)
"""


def test_a_line_cut_short_by_a_full_disk_is_taken_back(tmp_path: Path) -> None:
    """The file-size limit cuts the second line after 20 bytes, as a disk that fills in the middle of a write."""
    path = tmp_path / "settings_audit.jsonl"
    child = subprocess.run([sys.executable, "-c", PARTIAL_WRITE, str(path)], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert child.stdout.split() == ["refused", "1", "0.6"], child.stderr
    [line] = path.read_text().splitlines()
    assert json.loads(line)["new"] == {THRESHOLD: 0.6} and path.read_text().endswith("\n")
