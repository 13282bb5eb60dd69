"""The verl_* metrics: every documented name, with help text and base units, fed from realistic step
metrics and GPU samples, and an exposition that `promtool check metrics` accepts."""

from __future__ import annotations

import shutil
import subprocess
import time
from typing import get_args

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from api.prometheus import EXPOSITION_MAX_AGE_S, GIB, TelemetryMetrics
from trainer.config.live import SETTING_NAMES
from trainer.config.messages import (
    CopyCount,
    CopySample,
    Direction,
    Group,
    OffloadMessage,
    OffloadSummaryRow,
    Phase,
    Role,
)
from trainer.config.schema import LogLevel

# Sample names as they appear in the exposition (counters with _total, histograms by family name).
DOCUMENTED = [
    "verl_gpu_utilization_ratio", "verl_gpu_memory_used_bytes", "verl_gpu_memory_total_bytes", "verl_gpu_power_watts",
    "verl_gpu_temperature_celsius", "verl_gpu_pcie_throughput_bytes_per_second", "verl_gpu_process_memory_used_bytes",
    "verl_host_cpu_utilization_ratio", "verl_host_memory_used_bytes", "verl_process_resident_memory_bytes",
    "verl_offload_copy_duration_seconds", "verl_offload_copied_bytes_total", "verl_offload_group_bytes",
    "verl_trainer_steps_total", "verl_trainer_step", "verl_trainer_total_steps", "verl_trainer_tokens_total",
    "verl_trainer_step_phase_duration_seconds", "verl_trainer_step_duration_seconds",
    "verl_trainer_throughput_tokens_per_second", "verl_trainer_score_mean", "verl_trainer_ppo_kl",
    "verl_trainer_policy_loss", "verl_trainer_value_loss", "verl_trainer_entropy",
    "verl_trainer_gpu_memory_max_allocated_bytes", "verl_trainer_oom_total", "verl_trainer_restarts_total",
    "verl_trainer_phase", "verl_setting_gpu_memory_threshold_ratio", "verl_setting_min_transformer_layers_on_gpu",
    "verl_setting_dynamic_offload_enabled", "verl_setting_gpu_sample_interval_seconds",
    "verl_setting_pcie_sample_interval_seconds", "verl_setting_updates_total", "verl_telemetry_nvml_up",
    "verl_telemetry_dropped_messages_total", "verl_run_info", "verl_offload_transformer_layers_on_gpu",
    "verl_offload_model_transformer_layers_on_gpu", "verl_trainer_rank_up",
    "verl_offload_moves_total", "verl_trainer_oom_recoveries_total", "verl_rollout_embedding_cache_hit_ratio",
    "verl_trainer_checkpoint_failures_total",
]

# One PPO step as trainer/loop.py reports it (verl's names).
STEP_METRICS = {
    "actor/pg_loss": -0.0123, "actor/ppo_kl": 0.00042, "actor/entropy": 2.31, "actor/lr": 1e-6,
    "critic/vf_loss": 0.51, "critic/score/mean": 0.375, "critic/score/max": 1.0, "critic/score/min": 0.0,
    "timing_s/step": 3.2, "timing_s/gen": 1.9, "timing_s/reward": 0.01, "timing_s/old_log_prob": 0.2,
    "timing_s/ref": 0.2, "timing_s/values": 0.15, "timing_s/adv": 0.002, "timing_s/update_critic": 0.3,
    "timing_s/update_actor": 0.4, "timing_s/some_new_phase": 0.05,
    "perf/throughput": 2560.0, "perf/total_num_tokens": 8192, "perf/total_num_response_tokens": 6144,
    "perf/time_per_step": 3.2, "perf/max_memory_allocated_gb": 1.5, "perf/max_memory_reserved_gb": 2.0,
    "response_length/mean": 96.0, "training/epoch": 0, "val-core/gsm8k/reward/mean@1": None,
}

GPU_SAMPLE = {
    "nvml": True,
    "gpus": [{"index": 0, "uuid": "GPU-8f2c", "name": "NVIDIA H200", "utilization_ratio": 0.93,
              "memory_used_bytes": 100 * GIB, "memory_total_bytes": 141 * GIB, "power_watts": 612.5,
              "temperature_celsius": 55, "pcie_tx_bytes_per_second": 1.5e9, "pcie_rx_bytes_per_second": None,
              "processes": [{"pid": 2, "memory_bytes": 90 * GIB, "role": "trainer"},
                            {"pid": 3, "memory_bytes": 1 * GIB, "role": "other"},
                            {"pid": 4, "memory_bytes": 2 * GIB, "role": "other"}]}],
    "host": {"cpu_ratio": 0.25, "memory_used_bytes": 40 * GIB, "memory_total_bytes": 128 * GIB,
             "daemon_rss_bytes": 80_000_000, "trainer_rss_bytes": 9_000_000_000},
}


def fed_metrics(clock=time.monotonic) -> tuple[TelemetryMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = TelemetryMetrics(registry, run="gsm8k-ppo", project="verl-offload", config="/runs/a/config.yaml",
                               clock=clock)
    metrics.set_total_steps(200)
    metrics.observe_gpu(GPU_SAMPLE)
    metrics.set_rank_up("0", True)
    for step, step_metrics in ((1, STEP_METRICS), (2, {**STEP_METRICS, "timing_s/step": 0.8, "perf/num_ooms": 1})):
        metrics.observe_step(step, step_metrics)  # as the daemon feeds rank 0's metrics: the run's, and its own
        metrics.observe_rank_step("0", step_metrics)
    metrics.observe_phase(Phase.UPDATE_ACTOR)
    metrics.observe_offload(OffloadMessage(
        copies=[CopySample(direction="h2d", group="transformer", bytes=400_000_000, seconds=0.0081),
                CopySample(direction="d2h", group="embedding", bytes=1_000_000, seconds=0.00005)],
        counts=[CopyCount(direction="h2d", group="transformer", copies=1, bytes=400_000_000),
                CopyCount(direction="d2h", group="embedding", copies=1, bytes=1_000_000)],
        summary=[OffloadSummaryRow(role="actor", group="embedding", placement="cpu", device="cpu",
                                   bytes=272_000_000),
                 OffloadSummaryRow(role="actor", group="transformer", placement="gpu", device="gpu",
                                   bytes=14_000_000_000)]))
    metrics.count_restart("crash")
    for name, value in {"dynamic_offload.gpu_memory_threshold": 0.8, "dynamic_offload.min_transformer_layers_on_gpu": 4,
                        "dynamic_offload.enabled": True, "telemetry.gpu_sample_interval_s": 1.0,
                        "telemetry.pcie_sample_interval_s": 10.0, "daemon.log_level": "info"}.items():
        metrics.set_setting(name, value)
    metrics.count_setting_update("dynamic_offload.gpu_memory_threshold", "accepted")
    metrics.count_setting_update("no_such_setting", "rejected")
    metrics.set_nvml_up(True)
    metrics.count_dropped("trainer", 3)
    return metrics, registry


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return samples(registry).get((name, tuple(sorted(labels.items()))))


def labels_of(registry: CollectorRegistry, name: str, label: str) -> set[str]:
    """The values `label` takes in the series of sample `name`."""
    return {dict(labels)[label] for sample, labels in samples(registry) if sample == name}


def test_every_documented_metric_is_exposed_with_help_text() -> None:
    _, registry = fed_metrics()
    text = generate_latest(registry).decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    exposed = {sample.name for family in families.values() for sample in family.samples}
    missing = [name for name in DOCUMENTED if name not in exposed and name not in families]
    assert missing == []
    assert [family.name for family in families.values() if not family.documentation.strip()] == []
    assert families["verl_offload_copy_duration_seconds"].type == "histogram"
    assert families["verl_trainer_step_duration_seconds"].type == "histogram"
    assert families["verl_trainer_step_phase_duration_seconds"].type == "histogram"


def test_step_metrics_become_counters_gauges_and_histograms_in_base_units() -> None:
    _, registry = fed_metrics()
    assert value(registry, "verl_trainer_steps_total") == 2
    assert value(registry, "verl_trainer_step") == 2 and value(registry, "verl_trainer_total_steps") == 200
    assert value(registry, "verl_trainer_tokens_total", phase="train") == 2 * 8192
    assert value(registry, "verl_trainer_tokens_total", phase="rollout") == 2 * 6144
    assert value(registry, "verl_trainer_policy_loss") == pytest.approx(-0.0123)
    assert value(registry, "verl_trainer_score_mean") == pytest.approx(0.375)
    assert value(registry, "verl_trainer_gpu_memory_max_allocated_bytes", rank="0") == 1.5 * GIB
    assert value(registry, "verl_trainer_rank_up", rank="0") == 1
    assert value(registry, "verl_trainer_step_duration_seconds_count") == 2
    assert value(registry, "verl_trainer_step_duration_seconds_sum") == pytest.approx(4.0)
    assert value(registry, "verl_trainer_step_duration_seconds_bucket", le="1.0") == 1
    assert value(registry, "verl_trainer_step_phase_duration_seconds_sum", phase="gen") == pytest.approx(3.8)
    # An unknown phase does not become a label value (the trainer sends none: see the label-set tests);
    # the step itself is not a phase.
    phases = labels_of(registry, "verl_trainer_step_phase_duration_seconds_count", "phase")
    assert "some_new_phase" not in phases and "other" not in phases
    assert value(registry, "verl_trainer_step_phase_duration_seconds_count", phase="step") is None
    assert value(registry, "verl_trainer_oom_total") == 1


def test_gpu_host_offload_phase_and_settings_values() -> None:
    _, registry = fed_metrics()
    gpu = {"gpu": "0", "uuid": "GPU-8f2c"}
    assert value(registry, "verl_gpu_utilization_ratio", **gpu) == pytest.approx(0.93)
    assert value(registry, "verl_gpu_memory_total_bytes", **gpu) == 141 * GIB
    assert value(registry, "verl_gpu_pcie_throughput_bytes_per_second", **gpu, direction="tx") == 1.5e9
    assert value(registry, "verl_gpu_pcie_throughput_bytes_per_second", **gpu, direction="rx") is None  # not sampled
    assert value(registry, "verl_gpu_process_memory_used_bytes", **gpu, role="trainer") == 90 * GIB
    assert value(registry, "verl_gpu_process_memory_used_bytes", **gpu, role="other") == 3 * GIB
    assert value(registry, "verl_process_resident_memory_bytes", process="trainer") == 9_000_000_000
    assert value(registry, "verl_host_cpu_utilization_ratio") == 0.25
    assert value(registry, "verl_offload_copied_bytes_total", direction="h2d", group="transformer",
                 rank="0") == 400_000_000
    assert value(registry, "verl_offload_copy_duration_seconds_bucket", direction="h2d", group="transformer",
                 rank="0", le="0.01") == 1
    assert value(registry, "verl_offload_copy_duration_seconds_bucket", direction="d2h", group="embedding",
                 rank="0", le="0.0001") == 1
    assert value(registry, "verl_offload_group_bytes", role="actor", group="embedding", device="cpu",
                 rank="0") == 272_000_000
    assert value(registry, "verl_trainer_phase", phase="update_actor") == 1
    assert value(registry, "verl_trainer_phase", phase="gen") == 0
    assert value(registry, "verl_trainer_restarts_total", reason="crash") == 1
    assert value(registry, "verl_trainer_restarts_total", reason="oom") == 0  # every reason exists from the start
    assert value(registry, "verl_setting_gpu_memory_threshold_ratio") == 0.8
    assert value(registry, "verl_setting_dynamic_offload_enabled") == 1
    assert value(registry, "verl_setting_min_transformer_layers_on_gpu") == 4
    assert value(registry, "verl_setting_updates_total", setting="unknown", result="rejected") == 1
    assert value(registry, "verl_telemetry_dropped_messages_total", source="trainer") == 3
    assert value(registry, "verl_run_info", run="gsm8k-ppo", project="verl-offload", config="/runs/a/config.yaml") == 1


def test_gpu_series_go_away_when_nvml_does() -> None:
    metrics, registry = fed_metrics()
    metrics.observe_gpu({"nvml": False, "gpus": [], "host": {**GPU_SAMPLE["host"], "trainer_rss_bytes": None}})
    names = {name for name, _ in samples(registry)}
    assert not {name for name in names if name.startswith("verl_gpu_")}
    assert value(registry, "verl_telemetry_nvml_up") == 0
    assert value(registry, "verl_host_memory_used_bytes") == 40 * GIB  # host metrics carry on
    assert value(registry, "verl_process_resident_memory_bytes", process="trainer") is None


def test_oom_counts_follow_trainer_processes_across_restarts() -> None:
    registry = CollectorRegistry()
    metrics = TelemetryMetrics(registry, run="r")
    for count in (0, 1, 1):  # torch's num_ooms is cumulative in a process
        metrics.observe_step(1, {"perf/num_ooms": count})
    metrics.count_restart("oom")  # the fatal one, never reported by a step
    for count in (2, 3):  # the new process counts from 0 again
        metrics.observe_step(1, {"perf/num_ooms": count})
    assert value(registry, "verl_trainer_oom_total") == 1 + 1 + 3


def test_dynamic_offload_and_oom_recoveries_from_step_metrics() -> None:
    registry = CollectorRegistry()
    metrics = TelemetryMetrics(registry, run="r")
    assert value(registry, "verl_offload_moves_total", direction="to_cpu") == 0
    metrics.observe_step(1, {"offload/transformer_layers_on_gpu": 24, "offload/moves_to_cpu": 4,
                             "offload/moves_to_gpu": 0, "perf/oom_recoveries": 1})
    metrics.observe_step(2, {"offload/transformer_layers_on_gpu": 25, "offload/moves_to_cpu": 0,
                             "offload/moves_to_gpu": 1, "perf/oom_recoveries": 0,
                             "offload/actor/transformer_layers_on_gpu": 20,
                             "offload/critic/transformer_layers_on_gpu": 5,
                             "offload/someone/transformer_layers_on_gpu": 9,
                             "rollout/embedding_cache_hit_ratio": 0.75})
    assert value(registry, "verl_rollout_embedding_cache_hit_ratio") == 0.75
    assert value(registry, "verl_offload_transformer_layers_on_gpu") == 25
    assert value(registry, "verl_offload_model_transformer_layers_on_gpu", role="actor") == 20
    assert value(registry, "verl_offload_model_transformer_layers_on_gpu", role="critic") == 5
    assert value(registry, "verl_offload_model_transformer_layers_on_gpu", role="someone") is None, \
        "only the known roles become label values"
    assert value(registry, "verl_offload_moves_total", direction="to_cpu") == 4
    assert value(registry, "verl_offload_moves_total", direction="to_gpu") == 1
    assert value(registry, "verl_trainer_oom_recoveries_total") == 1


def test_checkpoint_failures_are_counted_from_step_metrics() -> None:
    registry = CollectorRegistry()
    metrics = TelemetryMetrics(registry, run="r")
    assert value(registry, "verl_trainer_checkpoint_failures_total") == 0
    metrics.observe_step(1, {"checkpoint/failures": 0, "checkpoint/failing": 0})
    metrics.observe_step(2, {"checkpoint/failures": 1, "checkpoint/failing": 1})
    metrics.observe_step(3, {"checkpoint/failures": 0, "checkpoint/failing": 1})
    metrics.observe_step(4, {"checkpoint/failures": 2, "checkpoint/failing": 1})
    assert value(registry, "verl_trainer_checkpoint_failures_total") == 3


def test_bad_inputs_are_refused_or_skipped() -> None:
    registry = CollectorRegistry()
    metrics = TelemetryMetrics(registry, run="r")
    with pytest.raises(ValueError, match="restart reason"):
        metrics.count_restart("bored")
    with pytest.raises(ValueError, match="unknown live setting"):
        metrics.set_setting("nope", 1)
    with pytest.raises(ValueError, match="result"):
        metrics.count_setting_update("dynamic_offload.gpu_memory_threshold", "maybe")
    metrics.observe_step(1, {"actor/pg_loss": float("nan"), "critic/score/mean": None, "timing_s/gen": -1.0})
    assert value(registry, "verl_trainer_policy_loss") == 0  # NaN skipped, the gauge keeps its last value
    assert value(registry, "verl_trainer_step_phase_duration_seconds_count", phase="gen") is None


def test_each_instance_owns_its_registry() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    TelemetryMetrics(first, run="a").count_restart("exit")
    TelemetryMetrics(second, run="b")
    assert value(first, "verl_trainer_restarts_total", reason="exit") == 1
    assert value(second, "verl_trainer_restarts_total", reason="exit") == 0


def test_the_exposition_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found: install Debian's `prometheus` package (apt-get install -y prometheus)")
    _, registry = fed_metrics()
    result = subprocess.run([promtool, "check", "metrics"], input=generate_latest(registry), capture_output=True,
                            timeout=30)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
    assert result.stdout.decode().strip() == "" and result.stderr.decode().strip() == ""


def test_the_exposition_is_rendered_again_only_after_a_change() -> None:
    now = [0.0]
    metrics, registry = fed_metrics(clock=lambda: now[0])
    first = metrics.exposition()
    assert first == generate_latest(registry)
    assert metrics.exposition() is first, "nothing changed: the same text, not a render"
    changes = [
        lambda: metrics.set_total_steps(300),
        lambda: metrics.observe_gpu({**GPU_SAMPLE, "gpus": [{**GPU_SAMPLE["gpus"][0], "power_watts": 500.0}]}),
        lambda: metrics.observe_host({**GPU_SAMPLE["host"], "cpu_ratio": 0.5}),
        lambda: metrics.observe_step(3, {**STEP_METRICS, "timing_s/step": 0.9}),
        lambda: metrics.observe_phase(Phase.GEN),
        lambda: metrics.observe_offload(OffloadMessage(
            copies=[CopySample(direction="h2d", group="norm", bytes=10, seconds=0.001)],
            counts=[CopyCount(direction="h2d", group="norm", copies=1, bytes=10)])),
        lambda: metrics.count_restart("oom"),
        lambda: metrics.set_setting("dynamic_offload.gpu_memory_threshold", 0.7),
        lambda: metrics.count_setting_update("dynamic_offload.gpu_memory_threshold", "applied"),
        lambda: metrics.set_nvml_up(False),
        lambda: metrics.count_dropped("ipc", 1),
    ]
    for change in changes:
        before = metrics.exposition()
        change()
        now[0] += EXPOSITION_MAX_AGE_S
        after = metrics.exposition()
        assert after == generate_latest(registry) and after != before


def test_while_metrics_keep_changing_the_exposition_is_rendered_at_most_every_quarter_second() -> None:
    now = [100.0]
    metrics, registry = fed_metrics(clock=lambda: now[0])
    first = metrics.exposition()
    metrics.observe_phase(Phase.GEN)
    now[0] += EXPOSITION_MAX_AGE_S / 2
    assert metrics.exposition() is first, "changed, but rendered too recently: the last text"
    now[0] += EXPOSITION_MAX_AGE_S / 2
    fresh = metrics.exposition()
    assert fresh != first and fresh == generate_latest(registry)


def test_every_public_method_that_changes_a_metric_marks_the_exposition_stale() -> None:
    # A new method without @_changes would let /metrics serve old values until some other change.
    methods = {name: value for name, value in vars(TelemetryMetrics).items()
               if not name.startswith("_") and callable(value)}
    unmarked = [name for name, method in methods.items() if name != "exposition" and not hasattr(method, "__wrapped__")]
    public = list(methods)
    assert public and unmarked == []


def test_offload_counts_feed_the_copy_and_byte_counters_and_the_sample_the_histogram() -> None:
    registry = CollectorRegistry()
    metrics = TelemetryMetrics(registry, run="r")
    metrics.observe_offload(OffloadMessage(
        copies=[CopySample(direction="h2d", group="transformer", bytes=1000, seconds=0.002)],
        counts=[CopyCount(direction="h2d", group="transformer", copies=16, bytes=16000)]))
    labels = {"direction": "h2d", "group": "transformer", "rank": "0"}
    assert value(registry, "verl_offload_copies_total", **labels) == 16
    assert value(registry, "verl_offload_copied_bytes_total", **labels) == 16000
    assert value(registry, "verl_offload_copy_duration_seconds_count", **labels) == 1
    # A step without a timed copy of a group still counts its copies.
    metrics.observe_offload(OffloadMessage(copies=[], counts=[CopyCount(direction="d2h", group="norm", copies=2,
                                                                        bytes=20)]))
    assert value(registry, "verl_offload_copies_total", direction="d2h", group="norm", rank="0") == 2
    assert value(registry, "verl_offload_copied_bytes_total", direction="d2h", group="norm", rank="0") == 20
    assert value(registry, "verl_offload_copy_duration_seconds_count", direction="d2h", group="norm", rank="0") is None



# -------------------------------------------------------------- label sets come from the message enums


def test_the_phase_labels_are_the_phases_the_trainer_sends() -> None:
    registry = CollectorRegistry()
    metrics = TelemetryMetrics(registry, run="r")
    every_phase = {phase.value for phase in Phase}
    assert labels_of(registry, "verl_trainer_phase", "phase") == every_phase, "declared from the start"
    metrics.observe_step(1, {f"timing_s/{phase}": 0.1 for phase in (*every_phase, "step", "validate", "idle")})
    assert labels_of(registry, "verl_trainer_step_phase_duration_seconds_count", "phase") == every_phase
    for phase in Phase:
        metrics.observe_phase(phase)
        assert value(registry, "verl_trainer_phase", phase=phase.value) == 1
        assert sum(value(registry, "verl_trainer_phase", phase=other) for other in every_phase) == 1


def test_the_offload_labels_are_the_directions_groups_and_roles_of_the_messages() -> None:
    registry = CollectorRegistry()
    metrics = TelemetryMetrics(registry, run="r")
    metrics.observe_offload(OffloadMessage(
        copies=[CopySample(direction=direction, group=group, bytes=1, seconds=0.001)
                for direction in Direction for group in Group],
        counts=[CopyCount(direction=direction, group=group, copies=1, bytes=1)
                for direction in Direction for group in Group],
        summary=[OffloadSummaryRow(role=role, group=group, placement="cpu", device="cpu", bytes=1)
                 for role in Role for group in Group]))
    directions, groups = {direction.value for direction in Direction}, {group.value for group in Group}
    for name in ("verl_offload_copy_duration_seconds_count", "verl_offload_copies_total",
                 "verl_offload_copied_bytes_total"):
        assert labels_of(registry, name, "direction") == directions, name
        assert labels_of(registry, name, "group") == groups, name
    assert labels_of(registry, "verl_offload_group_bytes", "role") == {role.value for role in Role}
    assert labels_of(registry, "verl_offload_group_bytes", "group") == groups
    metrics.observe_step(1, {f"offload/{role}/transformer_layers_on_gpu": 2 for role in Role})
    assert labels_of(registry, "verl_offload_model_transformer_layers_on_gpu", "role") == {role.value for role in Role}


def test_the_setting_labels_are_the_live_settings_and_log_levels() -> None:
    registry = CollectorRegistry()
    TelemetryMetrics(registry, run="r").set_setting("daemon.log_level", "info")
    assert labels_of(registry, "verl_setting_updates_total", "setting") == {*SETTING_NAMES, "unknown"}
    assert "dynamic_offload.gpu_memory_threshold" in SETTING_NAMES and "gpu_memory_threshold" not in SETTING_NAMES
    assert labels_of(registry, "verl_setting_log_level", "level") == set(get_args(LogLevel))


def test_an_update_counted_by_a_short_name_is_labelled_with_the_canonical_one() -> None:
    """A rejected change names its settings as the user wrote them: the short name must not become "unknown"."""
    registry = CollectorRegistry()
    metrics = TelemetryMetrics(registry, run="r")
    metrics.count_setting_update("gpu_memory_threshold", "rejected")
    metrics.count_setting_update("dynamic_offload.gpu_memory_threshold", "rejected")
    assert value(registry, "verl_setting_updates_total", setting="dynamic_offload.gpu_memory_threshold",
                 result="rejected") == 2
    assert value(registry, "verl_setting_updates_total", setting="unknown", result="rejected") == 0


def test_the_setting_gauges_keep_their_names() -> None:
    """The dashboards and DESIGN.md query these names: renaming the settings must not rename the metrics."""
    registry = CollectorRegistry()
    metrics = TelemetryMetrics(registry, run="r")
    metrics.set_setting("dynamic_offload.gpu_memory_threshold", 0.7)
    metrics.set_setting("dynamic_offload.min_transformer_layers_on_gpu", 3)
    metrics.set_setting("telemetry.gpu_sample_interval_s", 2.0)
    assert value(registry, "verl_setting_gpu_memory_threshold_ratio") == 0.7
    assert value(registry, "verl_setting_min_transformer_layers_on_gpu") == 3
    assert value(registry, "verl_setting_gpu_sample_interval_seconds") == 2.0


# ------------------------------------------------------------------------------------ several ranks


def test_each_rank_has_its_own_offload_and_memory_series_and_the_exposition_parses() -> None:
    registry = CollectorRegistry()
    metrics = TelemetryMetrics(registry, run="r")
    for rank, seconds, memory_gb in (("0", 0.002, 6.0), ("1", 0.004, 9.0)):
        metrics.set_rank_up(rank, True)
        metrics.observe_rank_step(rank, {"perf/max_memory_allocated_gb": memory_gb})
        metrics.observe_offload(OffloadMessage(
            copies=[CopySample(direction="h2d", group="transformer", bytes=1000, seconds=seconds)],
            counts=[CopyCount(direction="h2d", group="transformer", copies=4, bytes=4000)],
            summary=[OffloadSummaryRow(role="actor", group="transformer", placement="cpu", device="cpu",
                                       bytes=500 + int(rank))]), rank=rank)
    metrics.set_rank_up("1", False)
    copies = {"direction": "h2d", "group": "transformer"}
    assert value(registry, "verl_offload_copy_duration_seconds_sum", **copies, rank="1") == pytest.approx(0.004)
    assert value(registry, "verl_offload_copies_total", **copies, rank="0") == 4
    assert value(registry, "verl_trainer_gpu_memory_max_allocated_bytes", rank="1") == 9 * GIB
    assert [value(registry, "verl_trainer_rank_up", rank=rank) for rank in "01"] == [1, 0]
    # a rank's new placement replaces its own rows only
    metrics.observe_offload(OffloadMessage(copies=[], counts=[], summary=[
        OffloadSummaryRow(role="actor", group="transformer", placement="gpu", device="gpu", bytes=7)]), rank="1")
    group = {"role": "actor", "group": "transformer"}
    assert value(registry, "verl_offload_group_bytes", **group, device="cpu", rank="0") == 500
    assert value(registry, "verl_offload_group_bytes", **group, device="cpu", rank="1") is None
    assert value(registry, "verl_offload_group_bytes", **group, device="gpu", rank="1") == 7
    assert labels_of(registry, "verl_offload_copies_total", "rank") == {"0", "1"}
    # the run-wide series carry no rank: rank 0's step metrics are the run's
    metrics.observe_step(3, {"perf/throughput": 10.0})
    assert value(registry, "verl_trainer_throughput_tokens_per_second") == 10.0
