"""The advisor's hints, each from a hand-made snapshot, and silence when nothing is wrong."""

from __future__ import annotations

import pytest

from api.advisor import Snapshot, advise
from api.schemas import LatestBody, OffloadSummary, StepSnapshot
from tests.support import run_status
from trainer.config.messages import Group, OffloadSummaryRow, RankStatus, Role, RunState

NOW = 1_700_000_000.0
TOTAL = 80 * 2**30


def gpu_samples(utilization, used_fraction=0.5, *, seconds: int = 60, gpus: int = 1) -> list[dict]:
    """One gpu event per second over the last `seconds`; utilization and memory may be per-sample lists."""
    def at(value, i: int) -> float:
        return value[i] if isinstance(value, list) else value

    return [{"seq": i + 1, "time": NOW - seconds + 1 + i, "kind": "gpu", "data": {
        "nvml": True, "host": {},
        "gpus": [{"index": index, "uuid": f"GPU-{index}", "utilization_ratio": at(utilization, i),
                  "memory_used_bytes": at(used_fraction, i) * TOTAL, "memory_total_bytes": TOTAL}
                 for index in range(gpus)]}} for i in range(seconds)]


def make_snapshot(*, history=(), p99_s=0.004, state: RunState = "running", offloaded=True) -> Snapshot:
    placement = "cpu" if offloaded else "gpu"
    summary = [OffloadSummaryRow(role=Role.ACTOR, group=Group.TRANSFORMER, placement=placement, device=placement,
                                 bytes=1),
               OffloadSummaryRow(role=Role.ACTOR, group=Group.LM_HEAD, placement="gpu", device="gpu", bytes=1)]
    latest = LatestBody(seq=1, step=None, gpu=None,
                        offload=OffloadSummary(copy_latency_p50_s=0.002, copy_latency_p99_s=p99_s,
                                               bandwidth_bytes_per_second=20e9, copies=100))
    return Snapshot(time=NOW, status=run_status(state=state, summary=summary), latest=latest, history=list(history))


def test_a_healthy_run_gets_no_hint():
    assert advise(make_snapshot(history=gpu_samples(0.85, 0.7))) == []


def test_an_empty_snapshot_gets_no_hint():
    nothing_copied = OffloadSummary(copy_latency_p50_s=None, copy_latency_p99_s=None,
                                    bandwidth_bytes_per_second=None, copies=0)
    empty = Snapshot(time=NOW, status=run_status(step=0),
                     latest=LatestBody(seq=0, step=None, gpu=None, offload=nothing_copied), history=[])
    assert advise(empty) == []


def test_slow_offload_copies_point_at_bandwidth():
    hints = advise(make_snapshot(p99_s=0.083, history=gpu_samples(0.85)))
    assert len(hints) == 1
    assert "p99 83 ms > 50 ms" in hints[0]
    assert "CPU/PCIe bandwidth bound" in hints[0] and "coarser offload granularity" in hints[0]
    assert "pinned" in hints[0]
    assert advise(make_snapshot(p99_s=0.050)) == [], "the limit itself is no hint"
    assert advise(make_snapshot(p99_s=None)) == [], "no copies yet, no hint"


def test_sustained_low_utilization_points_at_over_offloading():
    hints = advise(make_snapshot(history=gpu_samples(0.42)))
    assert len(hints) == 1
    assert "GPU 0 averaged 42% utilization" in hints[0] and "over-offloaded" in hints[0]


def test_low_utilization_names_each_gpu():
    history = gpu_samples(0.4, gpus=2)
    for event in history:
        event["data"]["gpus"][1]["utilization_ratio"] = 0.9
    hints = advise(make_snapshot(history=history))
    assert len(hints) == 1 and hints[0].startswith("GPU 0 ")


@pytest.mark.parametrize("why", ["too short", "outside the window", "not training", "nothing offloaded"])
def test_low_utilization_that_says_nothing_gets_no_hint(why):
    history = gpu_samples(0.3)
    state, offloaded = "running", True
    if why == "too short":
        history = gpu_samples(0.3, seconds=20)
    elif why == "outside the window":
        for event in history:
            event["time"] -= 120
    elif why == "not training":
        state = "restarting"
    else:
        offloaded = False
    assert advise(make_snapshot(history=history, state=state, offloaded=offloaded)) == []


def test_a_short_dip_in_a_busy_minute_is_no_hint():
    utilization = [0.9] * 60
    utilization[30:40] = [0.05] * 10  # ten seconds of checkpoint saving
    assert advise(make_snapshot(history=gpu_samples(utilization))) == []


def test_busy_gpu_with_memory_near_full_asks_for_more_layers_on_the_gpu():
    used = [0.8] * 60
    used[45] = 0.97
    hints = advise(make_snapshot(history=gpu_samples(0.98, used)))
    assert len(hints) == 1
    assert "98% utilization with memory spikes" in hints[0] and "peak 97%" in hints[0]
    assert "raise dynamic_offload.min_transformer_layers_on_gpu" in hints[0]


def test_busy_gpu_with_a_sharp_memory_rise_asks_for_more_layers_on_the_gpu():
    used = [0.6] * 30 + [0.75] * 30
    hints = advise(make_snapshot(history=gpu_samples(0.97, used)))
    assert len(hints) == 1 and "rose by 15%" in hints[0]
    assert "dynamic_offload.min_transformer_layers_on_gpu" in hints[0]


def test_busy_gpu_with_steady_memory_is_no_hint():
    assert advise(make_snapshot(history=gpu_samples(0.98, 0.8))) == []


def test_hints_add_up():
    hints = advise(make_snapshot(p99_s=0.2, history=gpu_samples(0.3)))
    assert len(hints) == 2
    assert "bandwidth" in hints[0] and "over-offloaded" in hints[1]


def test_a_failing_checkpoint_save_gets_a_hint_until_one_is_written():
    def at_step(failing: float) -> Snapshot:
        snapshot = make_snapshot(history=gpu_samples(0.85, 0.7))
        step = StepSnapshot(step=12, time=NOW, metrics={"checkpoint/failures": 1.0, "checkpoint/failing": failing})
        snapshot["latest"] = snapshot["latest"].model_copy(update={"step": step})
        return snapshot

    hints = advise(at_step(1.0))
    assert len(hints) == 1
    assert hints[0].startswith("the latest checkpoint save failed (before step 12; the trainer's log says why, most "
                               "often a full disk): a crash now loses every step since the last checkpoint written")
    assert "trainer.max_ckpt_to_keep" in hints[0]
    assert advise(at_step(0.0)) == [], "a save went through since"


# --------------------------------------------------------------------------------------- several ranks


def ranked_snapshot(*ranks: tuple[float | None, float | None], connected: bool = True) -> Snapshot:
    """A snapshot whose ranks have these (GPU memory GiB, mean copy ms)."""
    snapshot = make_snapshot(history=gpu_samples(0.85, 0.7))
    rows = [RankStatus(rank=rank, local_rank=rank, pid=100 + rank, connected=connected, step=5, heard_s_ago=0.5,
                       gpu_memory_bytes=None if memory is None else memory * 2**30,
                       copy_latency_mean_s=None if copy_ms is None else copy_ms / 1e3)
            for rank, (memory, copy_ms) in enumerate(ranks)]
    return {**snapshot, "status": snapshot["status"].model_copy(update={"ranks": rows})}


def test_ranks_with_memory_more_than_20_percent_apart_are_named_in_one_line():
    hints = advise(ranked_snapshot((8.0, 2.0), (10.0, 2.1)))
    assert len(hints) == 1
    assert hints[0].startswith("ranks are unbalanced: GPU memory of rank 1 is 10.0 GiB against 8.0 GiB on rank 0 "
                               "(25% more, over 20%)")


def test_a_rank_with_slow_copies_is_named():
    hints = advise(ranked_snapshot((8.0, 2.0), (8.0, 2.0), (8.1, 3.0)))
    assert len(hints) == 1 and "offload copy latency of rank 2 is 3.0 ms against 2.0 ms on rank 0" in hints[0]
    assert "PCIe" in hints[0]


@pytest.mark.parametrize("ranks", [
    ((8.0, 2.0), (9.6, 2.4)),           # exactly 20% apart: the limit itself is no hint
    ((8.0, 2.0),),                      # one rank: nothing to compare
    ((8.0, None), (None, 2.0)),         # no figure known on two ranks
])
def test_ranks_within_20_percent_or_without_figures_get_no_hint(ranks):
    assert advise(ranked_snapshot(*ranks)) == []


def test_ranks_not_connected_are_not_compared():
    assert advise(ranked_snapshot((8.0, 2.0), (12.0, 2.0), connected=False)) == []
