"""Hints from the field's experience with offloaded training, read off one monitor snapshot.

A pure function: `advise(snapshot)` looks at the snapshot the monitor builds (a `Snapshot`: the
run's status and latest values as the API's models, recent events as its JSON) and returns
sentences for a user, most urgent first; no hint means nothing looks wrong.

Only "gpu" events of the last SUSTAINED_WINDOW_S seconds count for the GPU hints, so a short
dip (a checkpoint save, a slow reward call) says nothing.

With several ranks, the ranks of the node (the status's `ranks`) should look alike: the same shard sizes,
the same placement, the same copies. One whose peak GPU memory or mean offload copy time is more than
RANK_IMBALANCE above another's is the slowest of the group, which waits for it at every collective.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from statistics import fmean
from typing import Any, TypedDict

from api.schemas import LatestBody
from trainer.config import KEYS
from trainer.config.messages import RankStatus, RunStatus

# Copies slower than this are bound by host memory or the PCIe link, not by the GPU.
OFFLOAD_P99_LIMIT_S = 0.050
SUSTAINED_WINDOW_S = 60.0
# The GPU samples in the window must span this long before utilization counts as sustained.
MIN_COVERAGE_S = 30.0
LOW_UTILIZATION = 0.60
HIGH_UTILIZATION = 0.95
# Memory "spikes": in use this close to the total, or rising this much between two samples.
MEMORY_NEAR_FULL = 0.95
MEMORY_JUMP = 0.10
RANK_IMBALANCE = 0.20
"""Ranks whose GPU memory or offload copy latency differ by more than this (of the lower figure) are unbalanced."""
GIB = 1024**3


class Snapshot(TypedDict):
    """The run at one moment: what the monitor polls (api/monitor.py MonitorFeed) and /v1/hints gathers."""

    time: float
    """When it was taken (epoch seconds)."""
    status: RunStatus
    """GET /v1/status."""
    latest: LatestBody
    """GET /v1/metrics/latest."""
    history: Sequence[Mapping[str, Any]]
    """Recent events {"seq", "time", "kind", "data"}, oldest first."""


# 1 in a step's metrics while the trainer's latest checkpoint save has failed (trainer/loop.py).
CHECKPOINT_FAILING_KEY = "checkpoint/failing"


def advise(snapshot: Snapshot) -> list[str]:
    """The hints that apply to this snapshot (empty when nothing looks wrong)."""
    hints = _checkpoint_hints(snapshot)
    hints += rank_imbalance_hints(snapshot["status"].ranks)
    p99 = snapshot["latest"].offload.copy_latency_p99_s
    if p99 is not None and p99 > OFFLOAD_P99_LIMIT_S:
        hints.append(f"offload copies are slow (p99 {p99 * 1e3:.0f} ms > {OFFLOAD_P99_LIMIT_S * 1e3:.0f} ms): "
                     "CPU/PCIe bandwidth bound; use a coarser offload granularity (fewer, larger copies) "
                     "or check that host memory is pinned")
    if _training(snapshot):
        for index, samples in _gpu_samples(snapshot).items():
            hints += _gpu_hints(index, samples, anything_offloaded=_anything_offloaded(snapshot))
    return hints


def rank_imbalance_hints(ranks: Sequence[RankStatus]) -> list[str]:
    """One line per figure on which the connected ranks are more than RANK_IMBALANCE apart, naming the ranks."""
    hints = []
    connected = [rank for rank in ranks if rank.connected]
    checks = (("GPU memory", lambda rank: rank.gpu_memory_bytes, lambda value: f"{value / GIB:.1f} GiB",
               "its shard, placement or batch differs from the others' (compare the ranks' offload summaries; "
               f"uneven sequence lengths: {KEYS.actor_rollout_ref.actor.use_dynamic_bsz})"),
              ("offload copy latency", lambda rank: rank.copy_latency_mean_s, lambda value: f"{value * 1e3:.1f} ms",
               "its host link is slower (check that GPU's PCIe link width and that the rank runs on the CPU socket "
               "of its GPU, where its pinned memory is)"))
    for what, figure, show, why in checks:
        figures = [(rank.rank, value) for rank in connected if (value := figure(rank)) is not None]
        if len(figures) < 2:
            continue
        low_rank, low = min(figures, key=lambda item: item[1])
        high_rank, high = max(figures, key=lambda item: item[1])
        if low <= 0 or high <= low * (1 + RANK_IMBALANCE):
            continue
        hints.append(f"ranks are unbalanced: {what} of rank {high_rank} is {show(high)} against {show(low)} on rank "
                     f"{low_rank} ({high / low - 1:.0%} more, over {RANK_IMBALANCE:.0%}); the group waits for "
                     f"the slowest rank at every collective; likely {why}")
    return hints


def _checkpoint_hints(snapshot: Snapshot) -> list[str]:
    step = snapshot["latest"].step
    if step is None or not step.metrics.get(CHECKPOINT_FAILING_KEY):
        return []
    return [f"the latest checkpoint save failed (before step {step.step}; the trainer's log says why, most often "
            "a full disk): a crash now loses every step since the last checkpoint written; free disk space in the "
            f"run directory or keep fewer checkpoints ({KEYS.trainer.max_ckpt_to_keep}); the next save tries again"]


def _gpu_hints(index: int, samples: list[tuple[float, dict]], *, anything_offloaded: bool) -> list[str]:
    if samples[-1][0] - samples[0][0] < MIN_COVERAGE_S:
        return []
    utilization = fmean(gpu["utilization_ratio"] for _, gpu in samples)
    window = f"the last {SUSTAINED_WINDOW_S:.0f} s"
    if utilization < LOW_UTILIZATION and anything_offloaded:
        return [f"GPU {index} averaged {utilization:.0%} utilization over {window} (< {LOW_UTILIZATION:.0%}): "
                "likely over-offloaded; keep more of the model on the GPU (offload_policy, or raise the live settings "
                "dynamic_offload.min_transformer_layers_on_gpu / dynamic_offload.gpu_memory_threshold)"]
    if utilization > HIGH_UTILIZATION and (spike := _memory_spike(samples)):
        return [f"GPU {index} at {utilization:.0%} utilization with memory spikes ({spike}): "
                "raise dynamic_offload.min_transformer_layers_on_gpu so fewer layers move on and off the GPU"]
    return []


def _memory_spike(samples: list[tuple[float, dict]]) -> str | None:
    """What makes the memory spiky, or None: near full at some point, or a sharp rise between samples."""
    fractions = [gpu["memory_used_bytes"] / gpu["memory_total_bytes"]
                 for _, gpu in samples if gpu.get("memory_total_bytes")]
    if not fractions:
        return None
    if max(fractions) >= MEMORY_NEAR_FULL:
        return f"peak {max(fractions):.0%} of memory in use"
    rise = max((after - before for before, after in zip(fractions, fractions[1:], strict=False)), default=0.0)
    if rise >= MEMORY_JUMP:
        return f"memory in use rose by {rise:.0%} of the total between two samples"
    return None


def _gpu_samples(snapshot: Snapshot) -> dict[int, list[tuple[float, dict]]]:
    """(time, GPU data) per GPU index from the gpu events of the window, oldest first."""
    since = snapshot["time"] - SUSTAINED_WINDOW_S
    per_gpu: dict[int, list[tuple[float, dict]]] = {}
    for event in _events(snapshot, "gpu"):
        if event["time"] < since:
            continue
        for gpu in event["data"].get("gpus", []):
            if gpu.get("utilization_ratio") is not None:
                per_gpu.setdefault(gpu["index"], []).append((event["time"], gpu))
    return per_gpu


def _events(snapshot: Snapshot, kind: str) -> Sequence[Mapping[str, Any]]:
    return [event for event in snapshot["history"] if event["kind"] == kind]


def _training(snapshot: Snapshot) -> bool:
    """GPU load means something only while the trainer runs (not while it starts, restarts or stops)."""
    return snapshot["status"].run.state == "running"


def _anything_offloaded(snapshot: Snapshot) -> bool:
    """Whether offload_policy puts any module group on the host; unknown (no summary yet) counts as yes."""
    summary = snapshot["status"].offload.summary
    if not summary:
        return True
    return any(row.placement == "cpu" for row in summary)
