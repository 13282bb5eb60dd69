"""The soak (benchmarks/soak.py) in a short version: a real run with the monitor, a stream follower
and a /metrics scraper attached, past its history window. A minute cannot resolve the hour's target
(1 MiB/h), so this checks what a minute can: no descriptor is left behind, memory stays within a few
MiB once the history is full, and the clients were served throughout."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import soak

# RSS growth allowed over the measured ~40 s: a leak of one event's worth per event (a history that is
# never pruned) grows the daemon by several MiB in that time; the allocator's noise is well under one.
DAEMON_GROWTH_MIB = 4.0
TRAINER_GROWTH_MIB = 16.0


@pytest.mark.slow
def test_a_short_soak_keeps_descriptors_flat_and_memory_bounded(tmp_path: Path) -> None:
    # 48 s: about 26 samples a process after the settling, 90 scrapes and 7000 streamed events on the 2-core machine.
    result = soak.soak(duration_s=48, history_s=10, settle_s=12, sample_interval_s=1.0, scrape_interval_s=0.5,
                       save_freq=10, overrides=[], folder=tmp_path)
    processes = result["processes"]
    for name, allowed in (("daemon", DAEMON_GROWTH_MIB), ("trainer", TRAINER_GROWTH_MIB)):
        figures = processes[name]
        assert figures["samples"] >= 20, (name, figures)
        assert len(figures["pids"]) == 1, (name, figures)  # no restart
        assert figures["fds_flat"], (name, figures)
        assert figures["rss_mib_max"] - figures["rss_mib_first"] < allowed, (name, figures)
    traffic = result["traffic"]
    assert traffic["ws_events"] > 100 and traffic["ws_reconnects"] == 0 and not traffic["ws_errors"], traffic
    assert traffic["scrapes"] > 50 and not traffic["scrape_errors"], traffic
    assert result["steps"]["last"] > result["steps"]["first"]
    assert "| daemon |" in soak.report(result)


def test_the_soak_refuses_a_duration_that_leaves_nothing_to_measure(capsys) -> None:
    with pytest.raises(SystemExit) as exit_request:
        soak.main(["--duration", "100", "--history-seconds", "90", "--settle", "20"])
    assert exit_request.value.code == 2
    assert "--duration must exceed --history-seconds + --settle" in capsys.readouterr().err
