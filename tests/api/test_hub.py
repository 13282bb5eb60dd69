"""The telemetry hub: ordered bounded history, filters, live fan-out that never waits for a subscriber,
and the rolling offload window."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import pytest

from api.hub import Event, OffloadWindow, TelemetryHub
from trainer.config.messages import CopyCount, CopySample, OffloadMessage, PhaseMessage, StepMessage


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def step_data(step: int) -> StepMessage:
    return StepMessage(step=step, metrics={"actor/pg_loss": 0.1 * step, "timing_s/step": 2.0,
                                           "perf/throughput": 900.0})


async def take(events, count: int, timeout: float = 5.0) -> list[Event]:
    return [await asyncio.wait_for(anext(events), timeout) for _ in range(count)]


# ----------------------------------------------------------------------------------------- history


def test_events_are_numbered_in_order_and_since_returns_the_later_ones() -> None:
    clock = FakeClock()
    hub = TelemetryHub(history_seconds=60, clock=clock)
    assert hub.last_seq == 0 and hub.since() == [] and hub.latest("step") is None
    for step in range(1, 6):
        clock.now += 1
        event = hub.publish("step", step_data(step))
        assert (event.seq, event.time, event.kind) == (step, clock.now, "step")
    assert [event.seq for event in hub.since()] == [1, 2, 3, 4, 5]
    assert [event.seq for event in hub.since(3)] == [4, 5]
    assert hub.since(5) == [] and hub.since(99) == []
    assert hub.last_seq == 5 and hub.latest("step").data.step == 5


def test_kinds_and_keys_filter_without_touching_the_stored_events() -> None:
    hub = TelemetryHub(history_seconds=60)
    hub.publish("gpu", {"nvml": False, "gpus": [], "host": {"cpu_ratio": 0.5}})
    hub.publish("step", step_data(1))
    hub.publish("phase", PhaseMessage(step=1, phase="gen"))

    assert [event.kind for event in hub.since(kinds={"step", "phase"})] == ["step", "phase"]
    filtered = hub.since(keys={"actor/pg_loss", "not/there"})
    assert (filtered[1].data.step, filtered[1].data.metrics) == (1, {"actor/pg_loss": 0.1})
    assert filtered[0].data == {"nvml": False, "gpus": [], "host": {"cpu_ratio": 0.5}}  # other kinds unfiltered
    assert set(hub.since()[1].data.metrics) == {"actor/pg_loss", "timing_s/step", "perf/throughput"}


def test_history_drops_events_beyond_max_events() -> None:
    hub = TelemetryHub(history_seconds=3600, max_events=3)
    for step in range(1, 8):
        hub.publish("step", step_data(step))
    assert [event.seq for event in hub.since()] == [5, 6, 7]
    assert [event.seq for event in hub.since(2)] == [5, 6, 7]
    assert hub.first_seq == 5 and hub.last_seq == 7


def test_history_drops_events_older_than_history_seconds_but_latest_remembers() -> None:
    clock = FakeClock()
    hub = TelemetryHub(history_seconds=10, clock=clock)
    hub.publish("step", step_data(1))
    clock.now += 6
    hub.publish("gpu", {"nvml": False, "gpus": []})
    clock.now += 6  # the step is now 12 s old, the sample 6 s: pruned on read, no publish needed
    assert [event.kind for event in hub.since()] == ["gpu"]
    clock.now += 5
    assert hub.since() == []
    assert hub.latest("step").data.step == 1  # the run's last step still shows between steps


def test_publish_is_safe_from_many_threads() -> None:
    hub = TelemetryHub(history_seconds=60)
    threads = [threading.Thread(target=lambda: [hub.publish("log", {"n": n}) for n in range(500)]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [event.seq for event in hub.since()] == list(range(1, 2001))


def test_event_json_turns_non_finite_numbers_into_null() -> None:
    event = Event(3, 1.5, "step", {"step": 1, "metrics": {"a": math.nan, "b": math.inf, "c": 1.0}})
    assert json.loads(event.to_json()) == {"seq": 3, "time": 1.5, "kind": "step",
                                           "data": {"step": 1, "metrics": {"a": None, "b": None, "c": 1.0}}}


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        TelemetryHub(history_seconds=0)
    with pytest.raises(ValueError):
        TelemetryHub(history_seconds=10, max_events=0)


# ------------------------------------------------------------------------------------ subscribers


def test_subscriber_gets_the_replay_then_live_events() -> None:
    async def scenario() -> None:
        hub = TelemetryHub(history_seconds=60)
        for step in range(1, 4):
            hub.publish("step", step_data(step))
        async with hub.subscribe(since=1) as events:
            assert [event.seq for event in await take(events, 2)] == [2, 3]
            hub.publish("phase", PhaseMessage(step=4, phase="gen"))
            live = await take(events, 1)
            assert (live[0].seq, live[0].kind) == (4, "phase")

    asyncio.run(scenario())


def test_subscriber_without_since_gets_only_new_events() -> None:
    async def scenario() -> None:
        hub = TelemetryHub(history_seconds=60)
        hub.publish("step", step_data(1))
        async with hub.subscribe() as events:
            hub.publish("step", step_data(2))
            assert [event.seq for event in await take(events, 1)] == [2]

    asyncio.run(scenario())


def test_events_published_from_another_thread_reach_the_subscriber() -> None:
    async def scenario() -> None:
        hub = TelemetryHub(history_seconds=60)
        async with hub.subscribe(since=0) as events:
            sampler = threading.Thread(target=lambda: [hub.publish("gpu", {"n": n}) for n in range(50)])
            sampler.start()
            received = await take(events, 50)
            sampler.join()
        assert [event.data["n"] for event in received] == list(range(50))

    asyncio.run(scenario())


def test_a_slow_subscriber_gets_a_gap_and_resumes_from_the_history_without_blocking_publish() -> None:
    async def scenario() -> None:
        hub = TelemetryHub(history_seconds=60, subscriber_queue_size=2)
        async with hub.subscribe() as events:
            started = time.perf_counter()
            for step in range(1, 6):
                hub.publish("step", step_data(step))
            assert time.perf_counter() - started < 1.0
            gap, *replayed = await take(events, 6)
            assert (gap.kind, gap.data["after_seq"], gap.data["lost"]) == ("gap", 0, 0)
            assert [event.seq for event in replayed] == [1, 2, 3, 4, 5]  # nothing missed: all still kept
            hub.publish("step", step_data(6))
            assert [event.seq for event in await take(events, 1)] == [6]

    asyncio.run(scenario())


def test_an_event_both_replayed_and_queued_is_delivered_once() -> None:
    async def scenario() -> None:
        hub = TelemetryHub(history_seconds=60, subscriber_queue_size=2)
        async with hub.subscribe() as events:
            for step in range(1, 4):  # the third overflows the queue
                hub.publish("step", step_data(step))
            # From another thread while the loop is busy here: the event is in the history at once, its
            # delivery to the queue waits for the loop, i.e. until after the resync replayed it.
            sampler = threading.Thread(target=hub.publish, args=("gpu", {"n": 4}))
            sampler.start()
            sampler.join()
            gap = await anext(events)  # no wait_for: the resync must run before the loop delivers the 4th
            assert gap.kind == "gap"
            assert [event.seq for event in await take(events, 4)] == [1, 2, 3, 4]
            hub.publish("step", step_data(5))
            assert [event.seq for event in await take(events, 1)] == [5]

    asyncio.run(scenario())


def test_events_from_two_threads_reach_a_subscriber_in_order() -> None:
    async def scenario() -> None:
        hub = TelemetryHub(history_seconds=60)
        async with hub.subscribe() as events:
            # Event 1 from the sampler thread waits in the loop's queue while event 2, published on the loop
            # itself, reaches the subscriber first.
            sampler = threading.Thread(target=hub.publish, args=("gpu", {"n": 1}))
            sampler.start()
            sampler.join()
            hub.publish("step", step_data(2))
            assert [event.seq for event in await take(events, 2)] == [1, 2]
            hub.publish("step", step_data(3))
            assert [event.seq for event in await take(events, 1)] == [3]

    asyncio.run(scenario())


def test_a_subscriber_behind_the_history_is_told_how_many_events_it_lost() -> None:
    async def scenario() -> None:
        hub = TelemetryHub(history_seconds=60, max_events=3, subscriber_queue_size=2)
        async with hub.subscribe() as events:
            for step in range(1, 8):
                hub.publish("step", step_data(step))
            gap, *replayed = await take(events, 4)
            assert (gap.kind, gap.data["lost"]) == ("gap", 4)
            assert [event.seq for event in replayed] == [5, 6, 7]
        # Resuming from a seq that aged out says so too.
        async with hub.subscribe(since=1) as events:
            gap, first = await take(events, 2)
            assert (gap.kind, gap.data["after_seq"], gap.data["lost"], first.seq) == ("gap", 1, 3, 5)

    asyncio.run(scenario())


def test_a_first_subscriber_that_asks_for_everything_has_missed_nothing_that_aged_out_before_it_came() -> None:
    """since=0 is the live page's first load: the history as it is now, with no gap for what was pruned
    before (the page showed "missed 316 events" on every load of a run older than its history)."""

    async def scenario() -> None:
        clock = FakeClock()
        hub = TelemetryHub(history_seconds=60, clock=clock)
        for step in range(1, 4):
            hub.publish("step", step_data(step))
        clock.now += 61
        hub.publish("step", step_data(4))
        async with hub.subscribe(since=0) as events:
            hub.publish("step", step_data(5))
            assert [(event.kind, event.seq) for event in await take(events, 2)] == [("step", 4), ("step", 5)]

    asyncio.run(scenario())


def test_a_closed_subscription_stops_receiving() -> None:
    async def scenario() -> None:
        hub = TelemetryHub(history_seconds=60)
        subscription = hub.subscribe()
        await subscription.aclose()
        hub.publish("step", step_data(1))
        with pytest.raises(StopAsyncIteration):
            await anext(subscription)
        assert len(hub._subscriptions) == 0

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------- offload window


def copies(durations_ms: list[float], size: int = 1_000_000) -> list[CopySample]:
    return [CopySample(direction="h2d", group="transformer", bytes=size, seconds=ms / 1000) for ms in durations_ms]


def test_offload_window_percentiles_and_bandwidth_on_known_samples() -> None:
    window = OffloadWindow(clock=FakeClock())
    assert window.summary() == {"copy_latency_p50_s": None, "copy_latency_p99_s": None,
                                "bandwidth_bytes_per_second": None, "copies": 0}
    window.add(copies([float(ms) for ms in range(100, 0, -1)]))  # 1 ms ... 100 ms, any order
    # Linear interpolation between closest ranks (numpy's default): p50 of 1..100 is 50.5, p99 is 99.01.
    assert window.percentile(50) == pytest.approx(0.0505)
    assert window.percentile(99) == pytest.approx(0.09901)
    assert window.percentile(0) == pytest.approx(0.001) and window.percentile(100) == pytest.approx(0.1)
    # 100 MB in 5.05 s of copying.
    assert window.bandwidth_bytes_per_second() == pytest.approx(100_000_000 / 5.05)
    summary = window.summary()
    assert summary["copies"] == 100 and summary["copy_latency_p99_s"] == pytest.approx(0.09901)
    with pytest.raises(ValueError):
        window.percentile(101)


def test_offload_window_forgets_copies_older_than_a_minute() -> None:
    clock = FakeClock()
    window = OffloadWindow(clock=clock)
    window.add(copies([200.0] * 10))
    clock.now += 30
    window.add(copies([2.0] * 10))
    assert window.percentile(99) == pytest.approx(0.2)
    clock.now += 31
    assert window.percentile(99) == pytest.approx(0.002) and window.summary()["copies"] == 10
    clock.now += 30
    assert window.summary()["copies"] == 0 and window.bandwidth_bytes_per_second() is None


def test_hub_feeds_offload_events_to_its_window() -> None:
    hub = TelemetryHub(history_seconds=60)
    hub.publish("offload", OffloadMessage(copies=copies([10.0, 30.0]),
                                          counts=[CopyCount(direction="h2d", group="transformer", copies=2, bytes=2)]))
    assert hub.offload.summary()["copies"] == 2
    assert hub.offload.percentile(50) == pytest.approx(0.02)


def test_the_window_counts_every_copy_and_times_the_sample() -> None:
    window = OffloadWindow(clock=FakeClock())
    # Four timed copies stand for 400 copies of 1 MB.
    window.add(copies([1.0, 2.0, 3.0, 4.0]), [CopyCount(direction="h2d", group="transformer", copies=400,
                                                        bytes=400_000_000)])
    summary = window.summary()
    assert summary["copies"] == 400
    assert summary["copy_latency_p50_s"] == pytest.approx(0.0025)
    assert summary["bandwidth_bytes_per_second"] == pytest.approx(4_000_000 / 0.010)


def test_hub_feeds_offload_counts_to_its_window() -> None:
    hub = TelemetryHub(history_seconds=60)
    hub.publish("offload", OffloadMessage(copies=copies([10.0]),
                                          counts=[CopyCount(direction="h2d", group="norm", copies=7, bytes=7)]))
    assert hub.offload.summary()["copies"] == 7

