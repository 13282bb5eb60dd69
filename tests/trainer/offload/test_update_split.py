"""The split of an optimizer step's units between the device path and the host path (optimizer_update: both,
trainer/offload/update_split.py): its decisions from given measurements."""

from __future__ import annotations

import random

import pytest

from trainer.offload.update_split import UpdateSplit, UpdateTiming


def split(device: float, host: float, smoothing: float = 0.5) -> UpdateSplit:
    return UpdateSplit({"device": device, "host": host}, smoothing)


def test_equal_speeds_alternate_equal_units_and_a_tie_goes_to_the_device():
    assert split(1.0, 1.0).assign([10] * 4) == ["device", "host", "device", "host"]


def test_a_path_twice_as_fast_gets_twice_the_elements_and_both_end_together():
    chooser = split(1e-9, 2e-9)
    sizes = [100] * 6
    assignment = chooser.assign(sizes)
    assert assignment.count("device") == 4 and assignment.count("host") == 2
    ends = chooser.predicted_seconds(sizes, assignment)
    assert ends["device"] == pytest.approx(ends["host"])
    assert chooser.last_assignment == assignment


def test_units_keep_their_forward_order_within_each_path():
    sizes = [5, 40, 7, 7, 30, 1, 12, 9]
    assignment = split(1.0, 1.3).assign(sizes)
    # One decision per unit, in the order given: each path's units are the given ones, in that order.
    assert len(assignment) == len(sizes) and set(assignment) == {"device", "host"}
    device_units = [index for index, path in enumerate(assignment) if path == "device"]
    assert device_units == sorted(device_units) and device_units[0] == 0


@pytest.mark.parametrize(("device", "host", "side"), [(1e-10, 1e-7, "device"), (1e-7, 1e-10, "host")])
def test_everything_goes_to_a_path_much_faster_than_the_other(device, host, side):
    assert split(device, host).assign([300, 200, 500, 100, 400]) == [side] * 5


def random_cases(seed: int, count: int = 200):
    """(device seconds per element, host seconds per element, unit sizes, a generator for more), `count` times."""
    generator = random.Random(seed)
    for _ in range(count):
        device, host = generator.uniform(0.1, 10), generator.uniform(0.1, 10)
        yield device, host, [generator.randint(0, 1000) for _ in range(generator.randint(1, 30))], generator


def test_the_longer_path_never_takes_longer_than_either_path_alone():
    for device, host, sizes, _ in random_cases(0):
        chooser = split(device, host)
        longest = max(chooser.predicted_seconds(sizes, chooser.assign(sizes)).values())
        assert longest <= min(sum(sizes) * device, sum(sizes) * host) * (1 + 1e-12)
        # And the two paths end within one unit of each other (the largest one's time on the slower path).
        ends = chooser.predicted_seconds(sizes, chooser.last_assignment)
        assert abs(ends["device"] - ends["host"]) <= max(sizes) * max(device, host) * (1 + 1e-12)


def test_a_paths_first_measurement_replaces_its_guess_and_later_ones_are_a_moving_average():
    chooser = split(1e-9, 4e-9, smoothing=0.5)
    chooser.learn([UpdateTiming("host", 100, 1e-7), UpdateTiming("host", 300, 3e-7)])  # 1 ns an element
    assert chooser.seconds_per_element["host"] == pytest.approx(1e-9)
    assert chooser.seconds_per_element["device"] == 1e-9  # it measured nothing: its estimate stays
    chooser.learn([UpdateTiming("device", 1000, 3e-6), UpdateTiming("host", 1000, 2e-6)])
    # The device's first measurement (3 ns) replaces its guess; the host's second (2 ns) moves it halfway.
    assert chooser.seconds_per_element == pytest.approx({"device": 3e-9, "host": 1.5e-9})


def test_what_is_learned_moves_the_split_toward_the_path_that_proved_faster():
    chooser = split(1e-9, 1e-9)
    sizes = [100] * 8
    assert chooser.assign(sizes).count("host") == 4
    # The host measured three times as slow as guessed, the device as guessed.
    for _ in range(6):
        chooser.learn([UpdateTiming("device", 400, 4e-7), UpdateTiming("host", 400, 12e-7)])
    assert chooser.seconds_per_element["host"] == pytest.approx(3e-9, rel=0.05)
    assert chooser.assign(sizes).count("host") == 2


def test_the_split_is_deterministic_given_its_measurements():
    history = [[UpdateTiming("device", 1234, 5e-6), UpdateTiming("host", 999, 7e-6)],
               [UpdateTiming("device", 2000, 6e-6)], [UpdateTiming("host", 50, 1e-7)]]
    sizes = [17, 300, 42, 42, 1000, 3, 250]
    assignments = []
    for _ in range(2):
        chooser = UpdateSplit.guessed(14)
        for timings in history:
            chooser.learn(timings)
        assignments.append(chooser.assign(sizes))
    assert assignments[0] == assignments[1]


def test_the_first_guess_is_the_bus_for_the_device_and_a_conservative_host_figure():
    chooser = UpdateSplit.guessed(14, bandwidth=50e9, host_seconds_per_element=1e-9)
    assert chooser.seconds_per_element == pytest.approx({"device": 14 / 50e9, "host": 1e-9})
    # A 3B-shaped step (36 equal layers): the device path, guessed 3.6 times as fast, takes most of it.
    assignment = chooser.assign([80_000_000] * 36)
    assert 26 <= assignment.count("device") <= 30


@pytest.mark.parametrize(("rates", "smoothing"), [({"device": 0.0, "host": 1.0}, 0.5),
                                                  ({"device": 1.0}, 0.5), ({"device": 1.0, "host": 1.0}, 1.5)])
def test_a_split_refuses_estimates_it_cannot_use(rates, smoothing):
    with pytest.raises(ValueError, match="UpdateSplit"):
        UpdateSplit(rates, smoothing)


def test_a_window_longer_than_the_balanced_update_gives_the_host_what_ends_within_its_share():
    """The reads that need the update come 10 s after the plan: the host (2 s for each of 6 units) takes units in
    order while its queue ends within 0.75 of the window (3 units, 6 s), the device the rest; the balanced split
    would end both at 4 s and send the device 4 units."""
    sizes = [100] * 6
    chooser = split(1e-2, 2e-2)
    assert chooser.assign(sizes).count("device") == 4
    chooser.learn_window(10.0)
    assert chooser.assign(sizes) == ["host"] * 3 + ["device"] * 3
    ends = chooser.predicted_seconds(sizes, chooser.last_assignment)
    assert ends == pytest.approx({"device": 3.0, "host": 6.0})
    assert "window 10 s" in chooser.describe()


def test_a_window_no_longer_than_the_balanced_update_keeps_the_balanced_split():
    sizes = [100] * 6
    chooser = split(1e-2, 2e-2)
    balanced = chooser.assign(sizes)
    for window in (0.0, 4.0, 4.0 / 0.75):  # within 0.75 of the window: no later than the balanced end
        chooser.window = window
        assert chooser.assign(sizes) == balanced


def test_with_any_window_the_device_never_takes_more_and_the_update_never_ends_later():
    for device, host, sizes, generator in random_cases(1):
        chooser = split(device, host)
        balanced = chooser.assign(sizes)
        makespan = max(chooser.predicted_seconds(sizes, balanced).values())
        chooser.window = generator.uniform(0, 3) * makespan
        assignment = chooser.assign(sizes)
        on_device = sum(size for size, path in zip(sizes, assignment, strict=True) if path == "device")
        assert on_device <= sum(size for size, path in zip(sizes, balanced, strict=True) if path == "device")
        ends = chooser.predicted_seconds(sizes, assignment)
        assert max(ends.values()) <= max(makespan, 0.75 * chooser.window) * (1 + 1e-12)


def test_the_window_is_a_moving_average_and_a_negative_one_is_refused():
    chooser = split(1.0, 1.0, smoothing=0.5)
    chooser.learn_window(2.0)
    assert chooser.window == 2.0
    chooser.learn_window(4.0)
    assert chooser.window == 3.0
    with pytest.raises(ValueError, match="window"):
        chooser.learn_window(-1.0)


def test_the_last_host_share_is_the_elements_the_host_got():
    chooser = split(1e-9, 2e-9)
    assert chooser.last_host_share is None
    chooser.assign([100] * 6)  # 4 to the device, 2 to the host
    assert chooser.last_host_share == pytest.approx(2 / 6)
    chooser.assign([])
    assert chooser.last_host_share == pytest.approx(2 / 6)  # nothing updated: the last share stands
