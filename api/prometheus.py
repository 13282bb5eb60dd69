"""Every verl_* Prometheus metric, on a registry the caller passes in (a fresh one per test).

Names follow Prometheus conventions: base units in the name (_seconds, _bytes, _ratio from 0 to 1),
_total on counters, histograms for latencies, labels of bounded cardinality (free-form values from the
trainer or a user are mapped to a fixed set before they become labels). Labels that name a phase, a
copy direction, a module group or a model take their values from the enums of the trainer's messages
(trainer/config/messages.py), so the two cannot drift apart.

With several ranks, the series each rank has of its own (its offload copies and placement, its peak memory,
whether it is connected) carry a `rank` label: the global ranks of the daemon's node, at most
trainer.n_gpus_per_node values (daemon/ranks.py admits no others). NVML series carry `gpu`. The other series
are the run's, from rank 0.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from trainer.config.live import LIVE_SETTINGS, LOG_LEVEL_SETTING, SETTING_NAMES, SETTINGS, canonical_name
from trainer.config.messages import OffloadMessage, Phase, Role
from trainer.config.schema import LogLevel

GIB = 1024**3
OFFLOAD_COPY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                        1.0, 2.5, 5.0, 10.0)
EXPOSITION_MAX_AGE_S = 0.25
"""While metrics keep changing, /metrics is rendered at most this often (see TelemetryMetrics.exposition)."""
STEP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)

PHASES = tuple(phase.value for phase in Phase)
RESTART_REASONS = ("crash", "signal", "oom", "hang", "exit")
UPDATE_RESULTS = ("accepted", "rejected", "applied")
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)
# The gauges of the live settings are named in their table (trainer.config.live.LIVE_SETTINGS); the log level is
# a state set (a `level` label, 1 for the current one), the others one number each.

# Step metrics (verl's names) -> gauges; perf/max_memory_allocated_gb is in GiB, converted to bytes.
STEP_GAUGES = {
    "perf/throughput": ("verl_trainer_throughput_tokens_per_second",
                        "Tokens (prompt + response) processed per second in the latest step.", 1.0),
    "critic/score/mean": ("verl_trainer_score_mean", "Mean sequence score (reward before KL) of the latest step.",
                          1.0),
    "actor/ppo_kl": ("verl_trainer_ppo_kl", "KL between the rollout policy and the updated one, latest step.", 1.0),
    "actor/pg_loss": ("verl_trainer_policy_loss", "Policy-gradient loss of the latest step.", 1.0),
    "critic/vf_loss": ("verl_trainer_value_loss", "Value-function loss of the latest step.", 1.0),
    "actor/entropy": ("verl_trainer_entropy", "Mean token entropy of the policy, latest step.", 1.0),
    "rollout/embedding_cache_hit_ratio": ("verl_rollout_embedding_cache_hit_ratio",
                                          "Share of the latest step's no-grad embedding lookups served from the "
                                          "GPU cache.", 1.0),
}
MEMORY_KEY = "perf/max_memory_allocated_gb"  # in GiB; verl_trainer_gpu_memory_max_allocated_bytes{rank}
STEP_SECONDS_KEY = "timing_s/step"
PHASE_SECONDS_PREFIX = "timing_s/"
TRAIN_TOKENS_KEY = "perf/total_num_tokens"
# Not one of verl's names: trainer/metrics.py adds it so rollout tokens need not be guessed from a mean length.
ROLLOUT_TOKENS_KEY = "perf/total_num_response_tokens"
# torch.cuda.memory_stats()["num_ooms"]: cumulative within one trainer process.
OOM_COUNT_KEY = "perf/num_ooms"
# Out-of-memory errors the trainer recovered from in the step (trainer/workers/optimization.py).
OOM_RECOVERIES_KEY = "perf/oom_recoveries"
# Checkpoint saves that failed (a full disk) since the previous step's metrics (trainer/loop.py).
CHECKPOINT_FAILURES_KEY = "checkpoint/failures"
# Dynamic offload (trainer/offload/dynamic.py): layers on the GPU after the step, moves during it.
LAYERS_ON_GPU_KEY = "offload/transformer_layers_on_gpu"
# The same for one model, for each role of the trainer's offload engines (a fixed set: they become labels).
ROLE_LAYERS_ON_GPU_KEY = "offload/{role}/transformer_layers_on_gpu"
OFFLOAD_ROLES = tuple(role.value for role in Role)
MOVE_KEYS = {"to_cpu": "offload/moves_to_cpu", "to_gpu": "offload/moves_to_gpu"}


def _changes(method: Callable) -> Callable:
    """Marks a TelemetryMetrics method that changes a metric: the cached exposition is stale after it."""

    @functools.wraps(method)
    def changing(self: TelemetryMetrics, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            self._version += 1
    return changing


class TelemetryMetrics:
    """The daemon's Prometheus metrics; the daemon feeds it from its events.

    The run's name is not a label on every series: it is on `verl_run_info{run, project, config}`,
    which queries join on when they need it. Every change goes through the methods marked `_changes`,
    so `exposition()` can serve the same text until something changes.
    """

    def __init__(self, registry: CollectorRegistry, *, run: str, project: str = "", config: str = "",
                 clock: Callable[[], float] = time.monotonic):
        self.registry = registry
        self._version = 0
        self._clock = clock
        self._exposition: tuple[int, bytes, float] | None = None  # (version, text, when rendered)
        self._exposition_lock = threading.Lock()
        self._gpu_series: set[tuple[str, str]] = set()
        self._last_trainer_ooms = 0
        info = Info("verl_run", "The run this daemon supervises.", registry=registry)
        info.info({"run": run, "project": project, "config": config})
        self._gpu_metrics(registry)
        self._host_metrics(registry)
        self._offload_metrics(registry)
        self._trainer_metrics(registry)
        self._setting_metrics(registry)
        self.nvml_up = Gauge("verl_telemetry_nvml_up", "1 when NVML answers (GPU metrics are live), else 0.",
                             registry=registry)
        self.dropped = Counter("verl_telemetry_dropped_messages", "Telemetry messages dropped, by where.",
                               ["source"], registry=registry)

    def exposition(self) -> bytes:
        """The Prometheus text of every metric, rendered again only after a change, and at most every
        EXPOSITION_MAX_AGE_S while changes keep coming.

        Rendering the whole registry costs about 2 ms of CPU (25 kB of text with the histograms). A
        fast run changes a metric at every phase (tens of times a second for a small model), so
        scrapers polling that fast would render at nearly every request: they get text at most a
        quarter of a second old instead (Prometheus scrapes every 15 s).
        """
        with self._exposition_lock:
            version = self._version  # read before rendering: a change during the render makes it stale
            now = self._clock()
            cached = self._exposition
            if cached is None or (cached[0] != version and now - cached[2] >= EXPOSITION_MAX_AGE_S):
                self._exposition = cached = (version, generate_latest(self.registry), now)
            return cached[1]

    # ------------------------------------------------------------------------------- definitions

    def _gpu_metrics(self, registry: CollectorRegistry) -> None:
        labels = ["gpu", "uuid"]
        self.gpu_utilization = Gauge("verl_gpu_utilization_ratio", "Fraction of time a kernel ran on the GPU.",
                                     labels, registry=registry)
        self.gpu_memory_used = Gauge("verl_gpu_memory_used_bytes", "GPU memory in use (all processes).", labels,
                                     registry=registry)
        self.gpu_memory_total = Gauge("verl_gpu_memory_total_bytes", "GPU memory in all.", labels,
                                      registry=registry)
        self.gpu_power = Gauge("verl_gpu_power_watts", "GPU power draw.", labels, registry=registry)
        self.gpu_temperature = Gauge("verl_gpu_temperature_celsius", "GPU core temperature.", labels,
                                     registry=registry)
        self.gpu_pcie = Gauge("verl_gpu_pcie_throughput_bytes_per_second",
                              "PCIe throughput of the GPU (tx: out of the GPU, rx: into it), latest slow sample.",
                              [*labels, "direction"], registry=registry)
        self.gpu_process_memory = Gauge("verl_gpu_process_memory_used_bytes",
                                        "GPU memory used by this run's trainer processes and by all others.",
                                        [*labels, "role"], registry=registry)

    def _host_metrics(self, registry: CollectorRegistry) -> None:
        self.host_cpu = Gauge("verl_host_cpu_utilization_ratio", "Fraction of the host's CPU time in use.",
                              registry=registry)
        self.host_memory_used = Gauge("verl_host_memory_used_bytes", "Host memory in use.", registry=registry)
        self.host_memory_total = Gauge("verl_host_memory_total_bytes", "Host memory in all.", registry=registry)
        self.process_rss = Gauge("verl_process_resident_memory_bytes", "Resident memory of the daemon and trainer.",
                                 ["process"], registry=registry)

    def _offload_metrics(self, registry: CollectorRegistry) -> None:
        self.offload_copy_seconds = Histogram(
            "verl_offload_copy_duration_seconds", "Duration of one offload copy, timed with CUDA events (a "
            "sample of the copies: about 64 a training step; verl_offload_copies_total counts them all).",
            ["direction", "group", "rank"], buckets=OFFLOAD_COPY_BUCKETS, registry=registry)
        self.offload_copied_bytes = Counter("verl_offload_copied_bytes", "Bytes copied by the offload engine.",
                                            ["direction", "group", "rank"], registry=registry)
        self.offload_copies = Counter("verl_offload_copies", "Copies made by the offload engine.",
                                      ["direction", "group", "rank"], registry=registry)
        self.offload_layers_on_gpu = Gauge("verl_offload_transformer_layers_on_gpu",
                                           "Transformer layers kept on the GPU between passes, all models together.",
                                           registry=registry)
        self.offload_model_layers_on_gpu = Gauge(
            "verl_offload_model_transformer_layers_on_gpu", "Transformer layers kept on the GPU between passes, by "
            "model (actor, critic, ref, reward): min_transformer_layers_on_gpu applies to each.", ["role"],
            registry=registry)
        self.offload_moves = Counter("verl_offload_moves", "Transformer layers moved by dynamic offload, by "
                                     "direction (to_cpu, to_gpu).", ["direction"], registry=registry)
        for direction in MOVE_KEYS:
            self.offload_moves.labels(direction)  # both series from the start: rate() needs a 0 before the first move
        self.offload_group_bytes = Gauge("verl_offload_group_bytes",
                                         "Size of each module group of each model (a rank's shard of it), by the "
                                         "device that holds it.", ["role", "group", "device", "rank"],
                                         registry=registry)
        self._group_series: dict[str, set[tuple[str, ...]]] = {}  # rank -> its verl_offload_group_bytes labels

    def _trainer_metrics(self, registry: CollectorRegistry) -> None:
        self.steps = Counter("verl_trainer_steps", "Training steps completed (steps redone after a restart count "
                             "again).", registry=registry)
        self.step = Gauge("verl_trainer_step", "The latest completed step.", registry=registry)
        self.total_steps = Gauge("verl_trainer_total_steps", "Steps the run is to reach.", registry=registry)
        self.tokens = Counter("verl_trainer_tokens", "Tokens processed: rollout = response tokens generated, "
                              "train = prompt + response tokens trained on.", ["phase"], registry=registry)
        self.phase_seconds = Histogram("verl_trainer_step_phase_duration_seconds",
                                       "Wall time of each phase of a step (timing_s/<phase> of its metrics).",
                                       ["phase"], buckets=STEP_BUCKETS, registry=registry)
        self.step_seconds = Histogram("verl_trainer_step_duration_seconds", "Wall time of a whole step.",
                                      buckets=STEP_BUCKETS, registry=registry)
        self.step_gauges = {key: Gauge(name, help_text, registry=registry)
                            for key, (name, help_text, _) in STEP_GAUGES.items()}
        self.memory_max_allocated = Gauge("verl_trainer_gpu_memory_max_allocated_bytes",
                                          "Peak GPU memory allocated by torch during the latest step, by rank.",
                                          ["rank"], registry=registry)
        self.rank_up = Gauge("verl_trainer_rank_up", "1 while the trainer rank is connected to this daemon, else 0.",
                             ["rank"], registry=registry)
        self.ooms = Counter("verl_trainer_oom", "CUDA out-of-memory errors in the trainer (caught or fatal).",
                            registry=registry)
        self.oom_recoveries = Counter("verl_trainer_oom_recoveries", "CUDA out-of-memory errors the trainer "
                                      "recovered from (by offloading more or splitting a micro-batch).",
                                      registry=registry)
        self.restarts = Counter("verl_trainer_restarts", "Trainer restarts by the daemon, by reason.", ["reason"],
                                registry=registry)
        self.checkpoint_failures = Counter("verl_trainer_checkpoint_failures", "Checkpoint saves that could not "
                                           "be written (a full disk); the run goes on and tries again at the next "
                                           "save.", registry=registry)
        self.phase = Gauge("verl_trainer_phase", "1 for the phase the trainer is in, 0 for the others.", ["phase"],
                           registry=registry)
        for reason in RESTART_REASONS:
            self.restarts.labels(reason)
        for phase in PHASES:
            self.phase.labels(phase).set(0)

    def _setting_metrics(self, registry: CollectorRegistry) -> None:
        self.settings = {setting.name: Gauge(setting.gauge, setting.gauge_help, registry=registry)
                         for setting in LIVE_SETTINGS if setting.name != LOG_LEVEL_SETTING}
        log_level = SETTINGS[LOG_LEVEL_SETTING]
        self.log_level = Gauge(log_level.gauge, log_level.gauge_help, ["level"], registry=registry)
        self.setting_updates = Counter("verl_setting_updates", "Live setting changes by setting and result "
                                       "(accepted by the daemon, rejected, applied by the trainer).",
                                       ["setting", "result"], registry=registry)
        # Every series from 0 at the start: a change must be an increase a query can see (increase() and
        # the dashboard's annotations miss the first change of a series that appears already at 1).
        for setting in SETTING_NAMES:
            for result in UPDATE_RESULTS:
                self.setting_updates.labels(setting, result)
        self.setting_updates.labels("unknown", "rejected")

    # ------------------------------------------------------------------------------- observations

    @_changes
    def observe_gpu(self, sample: Mapping[str, Any]) -> None:
        """A "gpu" event's data: per-GPU gauges, NVML up/down, and its "host" part when present.

        Series of GPUs absent from the sample (NVML went away) are removed rather than left frozen.
        """
        self.set_nvml_up(bool(sample.get("nvml")))
        seen = set()
        for gpu in sample.get("gpus") or ():
            labels = (str(gpu["index"]), str(gpu["uuid"]))
            seen.add(labels)
            self._observe_one_gpu(labels, gpu)
        for labels in self._gpu_series - seen:
            self._remove_gpu(labels)
        self._gpu_series = seen
        if sample.get("host"):
            self.observe_host(sample["host"])

    def _observe_one_gpu(self, labels: tuple[str, str], gpu: Mapping[str, Any]) -> None:
        for gauge, key in ((self.gpu_utilization, "utilization_ratio"), (self.gpu_memory_used, "memory_used_bytes"),
                           (self.gpu_memory_total, "memory_total_bytes"), (self.gpu_power, "power_watts"),
                           (self.gpu_temperature, "temperature_celsius")):
            _set(gauge.labels(*labels), gpu.get(key))
        for direction in ("tx", "rx"):
            value = gpu.get(f"pcie_{direction}_bytes_per_second")
            if value is not None:
                self.gpu_pcie.labels(*labels, direction).set(value)
        by_role = {"trainer": 0, "other": 0}
        for process in gpu.get("processes") or ():
            role = "trainer" if process.get("role") == "trainer" else "other"
            by_role[role] += process.get("memory_bytes") or 0
        for role, used in by_role.items():
            self.gpu_process_memory.labels(*labels, role).set(used)

    def _remove_gpu(self, labels: tuple[str, str]) -> None:
        for gauge in (self.gpu_utilization, self.gpu_memory_used, self.gpu_memory_total, self.gpu_power,
                      self.gpu_temperature):
            _remove(gauge, *labels)
        for direction in ("tx", "rx"):
            _remove(self.gpu_pcie, *labels, direction)
        for role in ("trainer", "other"):
            _remove(self.gpu_process_memory, *labels, role)

    @_changes
    def observe_host(self, host: Mapping[str, Any]) -> None:
        _set(self.host_cpu, host.get("cpu_ratio"))
        _set(self.host_memory_used, host.get("memory_used_bytes"))
        _set(self.host_memory_total, host.get("memory_total_bytes"))
        _set(self.process_rss.labels("daemon"), host.get("daemon_rss_bytes"))
        if host.get("trainer_rss_bytes") is None:
            _remove(self.process_rss, "trainer")  # no trainer running (between restarts)
        else:
            self.process_rss.labels("trainer").set(host["trainer_rss_bytes"])

    @_changes
    def observe_rank_step(self, rank: str, metrics: Mapping[str, float | None]) -> None:
        """A rank's own figures from its step's metrics (every rank's, rank 0's included)."""
        memory = _number(metrics.get(MEMORY_KEY))
        if memory is not None:
            self.memory_max_allocated.labels(rank).set(memory * GIB)

    @_changes
    def set_rank_up(self, rank: str, up: bool) -> None:
        self.rank_up.labels(rank).set(1 if up else 0)

    @_changes
    def observe_step(self, step: int, metrics: Mapping[str, float | None]) -> None:
        """One completed step's metrics under verl's names, the run's (rank 0's); None, NaN and unknown keys are
        skipped. A rank's own figures (its memory) go to observe_rank_step."""
        self.steps.inc()
        self.step.set(step)
        for key, (_, _, scale) in STEP_GAUGES.items():
            value = _number(metrics.get(key))
            if value is not None:
                self.step_gauges[key].set(value * scale)
        for key, value in metrics.items():
            seconds = _number(value)
            if seconds is None or not key.startswith(PHASE_SECONDS_PREFIX) or seconds < 0:
                continue
            phase = key.removeprefix(PHASE_SECONDS_PREFIX)
            if key == STEP_SECONDS_KEY:
                self.step_seconds.observe(seconds)
            elif phase in PHASES:  # the trainer times its phases only: anything else is no label value
                self.phase_seconds.labels(phase).observe(seconds)
        for phase, key in (("train", TRAIN_TOKENS_KEY), ("rollout", ROLLOUT_TOKENS_KEY)):
            tokens = _number(metrics.get(key))
            if tokens is not None and tokens >= 0:
                self.tokens.labels(phase).inc(tokens)
        self._observe_ooms(_number(metrics.get(OOM_COUNT_KEY)))
        self._observe_dynamic_offload(metrics)
        failures = _number(metrics.get(CHECKPOINT_FAILURES_KEY))
        if failures is not None and failures > 0:
            self.checkpoint_failures.inc(failures)

    def _observe_dynamic_offload(self, metrics: Mapping[str, float | None]) -> None:
        recovered = _number(metrics.get(OOM_RECOVERIES_KEY))
        if recovered is not None and recovered > 0:
            self.oom_recoveries.inc(recovered)
        layers = _number(metrics.get(LAYERS_ON_GPU_KEY))
        if layers is not None:
            self.offload_layers_on_gpu.set(layers)
        for role in OFFLOAD_ROLES:
            layers = _number(metrics.get(ROLE_LAYERS_ON_GPU_KEY.format(role=role)))
            if layers is not None:
                self.offload_model_layers_on_gpu.labels(role).set(layers)
        for direction, key in MOVE_KEYS.items():
            moves = _number(metrics.get(key))
            if moves is not None and moves > 0:
                self.offload_moves.labels(direction).inc(moves)

    def _observe_ooms(self, trainer_count: float | None) -> None:
        if trainer_count is None:
            return
        # The count is per trainer process: a smaller one means a new process started counting from 0.
        new = trainer_count - self._last_trainer_ooms if trainer_count >= self._last_trainer_ooms else trainer_count
        if new > 0:
            self.ooms.inc(new)
        self._last_trainer_ooms = trainer_count

    @_changes
    def set_total_steps(self, total_steps: int) -> None:
        self.total_steps.set(total_steps)

    @_changes
    def observe_phase(self, phase: Phase) -> None:
        for name in PHASES:
            self.phase.labels(name).set(1 if name == phase else 0)

    @_changes
    def observe_offload(self, offload: OffloadMessage, *, rank: str = "0") -> None:
        """One rank's timed copies into the latency histogram, the counts of every copy into the counters; a
        summary replaces that rank's last one."""
        for copy in offload.copies:
            self.offload_copy_seconds.labels(copy.direction.value, copy.group.value, rank).observe(copy.seconds)
        for count in offload.counts:
            labels = (count.direction.value, count.group.value, rank)
            self.offload_copied_bytes.labels(*labels).inc(count.bytes)
            self.offload_copies.labels(*labels).inc(count.copies)
        if offload.summary is not None:
            for labels in self._group_series.pop(rank, set()):
                _remove(self.offload_group_bytes, *labels)
            series = self._group_series[rank] = set()
            for row in offload.summary:
                labels = (row.role.value, row.group.value, row.device, rank)
                self.offload_group_bytes.labels(*labels).set(row.bytes)
                series.add(labels)

    @_changes
    def count_restart(self, reason: str) -> None:
        if reason not in RESTART_REASONS:
            raise ValueError(f"unknown restart reason {reason!r}; expected one of {', '.join(RESTART_REASONS)}")
        self.restarts.labels(reason).inc()
        if reason == "oom":
            self.ooms.inc()
        self._last_trainer_ooms = 0  # the next trainer process counts its OOMs from 0

    @_changes
    def set_setting(self, name: str, value: Any) -> None:
        """Show a live setting's current value (canonical name, e.g. "dynamic_offload.gpu_memory_threshold")."""
        if name == LOG_LEVEL_SETTING:
            for level in LOG_LEVELS:
                self.log_level.labels(level).set(1 if level == value else 0)
        elif name in self.settings:
            self.settings[name].set(float(value))
        else:
            raise ValueError(f"unknown live setting {name!r}; known: {', '.join(SETTING_NAMES)}")

    @_changes
    def count_setting_update(self, setting: str, result: str) -> None:
        if result not in UPDATE_RESULTS:
            raise ValueError(f"unknown result {result!r}; expected one of {', '.join(UPDATE_RESULTS)}")
        # A rejected name comes from the user: only known names become label values, each setting's canonical one.
        self.setting_updates.labels(canonical_name(setting) or "unknown", result).inc()

    @_changes
    def set_nvml_up(self, up: bool) -> None:
        self.nvml_up.set(1 if up else 0)

    @_changes
    def count_dropped(self, source: str, n: int) -> None:
        if n > 0:
            self.dropped.labels(source).inc(n)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _set(gauge: Gauge, value: Any) -> None:
    number = _number(value)
    if number is not None:
        gauge.set(number)


def _remove(metric: Gauge, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass
