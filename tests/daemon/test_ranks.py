"""The daemon with several ranks on its node: the real launcher (trainer/distributed/launch.py) runs two fake
trainer ranks (fake_trainer.py, one IPC client each), and the daemon keeps per-rank state, takes rank 0's
metrics and acknowledgements as the run's, restarts the whole group when a rank dies and refuses run-wide
requests on a node other than 0."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from api.schemas import NotControlNodeError
from daemon.runtime import RuntimeInfo, runtime_file
from daemon.service import Daemon, default_trainer_command, local_gpu_indices
from tests.daemon.test_service import QUICKSTART, eventually, fake_events, metric
from trainer.config import RunConfig, dump_config, load_config

FAKE_TRAINER = Path(__file__).with_name("fake_trainer.py")
RANKS = 2


def several_ranks(config: RunConfig, **trainer: object) -> RunConfig:
    """`config` on 2 CPU ranks (set past the loader, whose device checks belong to the trainer's side)."""
    changes = {"n_gpus_per_node": RANKS, "device": "cpu", **trainer}
    return config.model_copy(update={"trainer": config.trainer.model_copy(update=changes)})


def make_group_daemon(tmp_path: Path, monkeypatch, *overrides: str, **fake: str) -> Daemon:
    for key in [key for key in os.environ if key.startswith("FAKE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    for key, value in fake.items():
        monkeypatch.setenv(f"FAKE_{key.upper()}", value)
    config = several_ranks(load_config(QUICKSTART, [f"trainer.runs_dir={tmp_path / 'runs'}",
                                                    "trainer.experiment_name=fake", "daemon.restart_backoff_s=0.1",
                                                    "telemetry.gpu_sample_interval_s=0.5", *overrides]))
    config_path = config.trainer.run_dir / "config.yaml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(dump_config(config))
    command = [*default_trainer_command(config, config_path), "--", str(FAKE_TRAINER)]
    return Daemon(config, config_path, trainer_command=command, state=tmp_path / "state", out=io.StringIO())


def test_several_ranks_run_under_the_launcher_and_one_process_as_today(tmp_path: Path) -> None:
    config = load_config(QUICKSTART, [f"trainer.runs_dir={tmp_path}"])
    path = tmp_path / "config.yaml"
    assert default_trainer_command(config, path) == [sys.executable, "-m", "trainer", "--config", str(path)]
    assert default_trainer_command(several_ranks(config), path) == [
        sys.executable, "-m", "trainer.distributed.launch", "--config", str(path)]


def test_each_node_samples_the_gpus_its_ranks_use() -> None:
    assert local_gpu_indices(2, None) == [0, 1]
    assert local_gpu_indices(2, "4,5,6") == [4, 5]
    assert local_gpu_indices(2, "GPU-8f2c,GPU-1a2b") is None  # UUIDs: NVML cannot be matched by index


def test_two_ranks_report_and_rank_0_alone_gets_and_acknowledges_settings(tmp_path: Path, monkeypatch) -> None:
    daemon = make_group_daemon(tmp_path, monkeypatch, total_steps="60", step_s="0.1")
    path = runtime_file(daemon.state, daemon.pid)

    async def scenario() -> tuple[int, dict]:
        run = asyncio.create_task(daemon.run())
        await eventually(lambda: run.done() or len([rank for rank in daemon.ranks.statuses() if rank.connected])
                         == RANKS, timeout=60, what="both ranks connected")
        assert not run.done(), f"the daemon ended with {run.result()}"
        await eventually(lambda: daemon.progress.step >= 2, what="two steps")
        info = RuntimeInfo.from_json(path.read_text())
        async with httpx.AsyncClient(base_url=info.url, headers={"Authorization": f"Bearer {info.token}"}) as api:
            patched = await api.patch("/v1/settings", json={"gpu_memory_threshold": 0.5})
            assert patched.status_code == 200, patched.text
            await eventually(lambda: daemon.settings_store.acknowledged_version == 1, what="rank 0's ack")
            seen = {"status": (await api.get("/v1/status")).json(), "metrics": (await api.get("/metrics")).text,
                    "info": info}
        daemon.request_stop()
        return await asyncio.wait_for(run, 60), seen

    code, seen = asyncio.run(scenario())
    assert code == 0 and daemon.supervisor.state == "finished"
    ranks = seen["status"]["ranks"]
    assert [(rank["rank"], rank["local_rank"], rank["connected"]) for rank in ranks] == [(0, 0, True), (1, 1, True)]
    rank_pids = {rank["pid"] for rank in ranks}
    launcher = seen["info"].trainer_pids[0]
    # the runtime file lists the launcher and every rank: `verl monitor --pid <a rank>` finds the daemon
    assert set(seen["info"].trainer_pids) == {launcher, *rank_pids}
    assert seen["status"]["run"]["world_size"] == RANKS and seen["status"]["run"]["node_rank"] == 0
    assert metric(seen["metrics"], 'verl_trainer_rank_up{rank="1"}') == 1.0
    events = fake_events(tmp_path)
    downs = [event for event in events if event["event"] == "down"]
    assert downs and {event["rank"] for event in downs} == {0}, "down messages go to rank 0 alone"
    exits = [event for event in events if event["event"] == "exit"]
    assert sorted(event["rank"] for event in exits) == [0, 1] and all(event["stopped"] for event in exits)
    assert sorted(event["rank"] for event in events if event["event"] == "sigterm") == [0, 1], \
        "the stop's SIGTERM reached both ranks through the launcher"
    steps = [event.data.step for event in daemon.hub.since(0, kinds=["step"])]
    assert steps == sorted(set(steps)), "one step event per step: rank 0's"


def test_a_rank_that_dies_restarts_the_whole_group(tmp_path: Path, monkeypatch) -> None:
    daemon = make_group_daemon(tmp_path, monkeypatch, total_steps="8", step_s="0.1", crash="kill",
                               crash_at_step="3", crash_runs="1", crash_rank="1")
    code = asyncio.run(asyncio.wait_for(daemon.run(), 120))
    assert code == 0 and daemon.supervisor.state == "finished"
    assert daemon.supervisor.restarts == 1 and daemon.supervisor.restarts_by_reason["signal"] == 1
    events = fake_events(tmp_path)
    starts = sorted((event["rank"], event["run"]) for event in events if event["event"] == "start")
    assert starts == [(0, 1), (0, 2), (1, 1), (1, 2)], "both ranks started again"
    assert [event["rank"] for event in events if event["event"] == "crash"] == [1]
    assert {event["rank"]: event["step"] for event in events if event["event"] == "exit"} == {0: 8, 1: 8}


def test_a_hung_rank_is_seen_though_rank_0_keeps_beating(tmp_path: Path) -> None:
    from daemon.supervisor import RestartPolicy, Supervisor

    hung: list[int] = []
    supervisor = Supervisor([sys.executable, "-c", "import time; time.sleep(60)"],
                            policy=RestartPolicy(0, 0.1, 0.1), stop_timeout_s=5, hang_timeout_s=lambda: 1.0,
                            on_hang=lambda pid, silent_s: hung.append(pid))

    async def scenario() -> int:
        run = asyncio.create_task(supervisor.run())
        await eventually(lambda: supervisor.pids, what="the process")
        supervisor.trainer_connected(0)
        supervisor.trainer_connected(1)
        while not run.done():
            supervisor.beat(0)  # rank 1 says nothing
            await asyncio.sleep(0.1)
        return run.result()

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) == 1
    assert len(hung) == 1


def test_a_kill_reaches_the_ranks_of_the_launcher(tmp_path: Path) -> None:
    from daemon.supervisor import RestartPolicy, Supervisor

    # a "launcher" waiting on a rank that ignores SIGTERM, in a session of its own as the elastic agent starts ranks
    child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    launcher = (f"import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True); time.sleep(60)")
    supervisor = Supervisor([sys.executable, "-c", launcher], policy=RestartPolicy(0, 0.1, 0.1), stop_timeout_s=0.5)
    descendants: list[psutil.Process] = []

    async def scenario() -> int:
        run = asyncio.create_task(supervisor.run())
        await eventually(lambda: supervisor.pids and psutil.Process(supervisor.pids[0]).children(), what="the rank")
        descendants.extend(psutil.Process(supervisor.pids[0]).children())
        supervisor.request_stop()  # SIGTERM, ignored by the rank: killed after stop_timeout_s
        return await run

    try:
        assert asyncio.run(asyncio.wait_for(scenario(), 30)) == 0
        gone, alive = psutil.wait_procs(descendants, timeout=5)
        assert alive == []
    finally:
        for process in descendants:
            with contextlib.suppress(psutil.Error):
                process.kill()


def test_another_nodes_daemon_refuses_run_wide_requests_and_changes_nothing(tmp_path: Path) -> None:
    config = several_ranks(load_config(QUICKSTART, [f"trainer.runs_dir={tmp_path}"]), nnodes=2, node_rank=1,
                           rdzv_endpoint="node0.cluster:29500")
    daemon = Daemon(config, tmp_path / "config.yaml", state=tmp_path / "state", out=io.StringIO())
    for request in (lambda: daemon.update_settings({"gpu_memory_threshold": 0.5}), daemon.request_checkpoint,
                    daemon.request_stop):
        with pytest.raises(NotControlNodeError) as refused:
            request()
        assert "serves node 1 of 2" in str(refused.value) and "node 0's daemon" in str(refused.value)
        assert "node0.cluster" in str(refused.value) and "nothing was changed" in str(refused.value)
    assert daemon.settings_store.values.gpu_memory_threshold == 0.85 and daemon.settings_store.version == 0
    assert not daemon.supervisor.stopping
    assert daemon.ranks.admits(2) and daemon.ranks.admits(3) and not daemon.ranks.admits(0)


def test_sigterm_to_the_daemon_stops_every_rank_with_a_checkpoint(tmp_path: Path, monkeypatch) -> None:
    daemon = make_group_daemon(tmp_path, monkeypatch, total_steps="100000", step_s="0.05")

    async def scenario() -> int:
        run = asyncio.create_task(daemon.run())
        await eventually(lambda: len([rank for rank in daemon.ranks.statuses() if rank.connected]) == RANKS
                         and daemon.progress.step >= 2, timeout=60, what="both ranks connected, two steps")
        os.kill(os.getpid(), signal.SIGTERM)
        return await asyncio.wait_for(run, 60)

    assert asyncio.run(scenario()) == 0
    exits = [event for event in fake_events(tmp_path) if event["event"] == "exit"]
    assert sorted(event["rank"] for event in exits) == [0, 1] and all(event["stopped"] for event in exits)


def test_node_0_shows_the_other_nodes_ranks_as_rank_0_reports_them() -> None:
    """Each rank reports to its own node's daemon; on a run of several nodes rank 0 sends every rank's figures at each
    step's end, and node 0's table shows the other nodes' ranks beside its own (no process there), by rank."""
    from daemon.ranks import RankTable
    from trainer.config.messages import RankReport, RanksMessage

    now = [100.0]
    table = RankTable(node_rank=0, ranks_per_node=2, world_size=4, clock=lambda: now[0])
    table.connected(0, local_rank=0, pid=11, step=0)
    table.connected(1, local_rank=1, pid=12, step=0)
    reports = [RankReport(rank=rank, local_rank=rank % 2, node_rank=rank // 2, step=5,
                          gpu_memory_bytes=float(rank) * 2**30) for rank in range(4)]
    table.observe_remote(RanksMessage(step=5, ranks=[*reports, RankReport(rank=9, local_rank=1, node_rank=4, step=5,
                                                                          gpu_memory_bytes=None)]))
    now[0] = 103.0
    rows = table.statuses()
    assert [(row.rank, row.node_rank, row.local_rank, row.pid) for row in rows] == [
        (0, 0, 0, 11), (1, 0, 1, 12), (2, 1, 0, None), (3, 1, 1, None)]  # rank 9 is not of this run
    assert rows[0].step == 0, "this node's ranks report themselves"
    assert (rows[3].step, rows[3].gpu_memory_bytes, rows[3].heard_s_ago, rows[3].connected) == (5, 3 * 2**30, 3.0,
                                                                                                 True)
    assert table.pids() == [11, 12]  # the GPU sampler watches this node's processes alone
    # Node 1's daemon: its own ranks only (rank 0 reports to node 0's).
    other = RankTable(node_rank=1, ranks_per_node=2, world_size=4)
    other.connected(2, local_rank=0, pid=21, step=5)
    assert [row.node_rank for row in other.statuses()] == [1]


def remote_ranks(table, *copy_seconds: float | None, step: int = 5) -> None:
    """Rank 0's report of ranks 2, 3, ... of node 1 (2 ranks a node) with these mean copy times."""
    from trainer.config.messages import RankReport, RanksMessage

    table.observe_remote(RanksMessage(step=step, ranks=[
        RankReport(rank=rank, local_rank=rank % 2, node_rank=rank // 2, step=step, gpu_memory_bytes=8 * 2**30,
                   copy_latency_mean_s=seconds, gpu_utilization_percent=40.0)
        for rank, seconds in enumerate(copy_seconds, start=2)]))


def test_node_0_flags_a_rank_of_another_node_whose_copies_are_slower_than_its_own() -> None:
    """The other nodes' ranks carry their mean copy time to node 0 (rank 0's report), so the advisor compares a
    slow host link on node 1 with node 0's ranks."""
    from api.advisor import rank_imbalance_hints
    from daemon.ranks import RankTable
    from trainer.config.messages import CopySample, OffloadMessage

    table = RankTable(node_rank=0, ranks_per_node=2, world_size=4)
    for rank in (0, 1):
        table.connected(rank, local_rank=rank, pid=10 + rank, step=5)
        table.observe_offload(rank, OffloadMessage(copies=[
            CopySample(direction="h2d", group="transformer", bytes=1 << 20, seconds=seconds)
            for seconds in (0.0019, 0.0021)], counts=[]))
    remote_ranks(table, 0.002, 0.003)
    rows = table.statuses()
    assert [row.copy_latency_mean_s for row in rows] == pytest.approx([0.002, 0.002, 0.002, 0.003])
    # Node 1's GPUs: their utilization as each rank read it (this node's GPUs are the daemon's own samples).
    assert [row.gpu_utilization_percent for row in rows] == [None, None, 40.0, 40.0]
    [hint] = rank_imbalance_hints(rows)
    assert "offload copy latency of rank 3 is 3.0 ms against 2.0 ms on rank" in hint


def test_another_nodes_ranks_that_rank_0_stops_reporting_are_not_connected_after_the_hang_timeout() -> None:
    from api.advisor import rank_imbalance_hints
    from daemon.ranks import RankTable

    now = [100.0]
    table = RankTable(node_rank=0, ranks_per_node=2, world_size=4, clock=lambda: now[0], stale_after_s=lambda: 600.0)
    table.connected(0, local_rank=0, pid=10, step=5)
    table.connected(1, local_rank=1, pid=11, step=5)
    remote_ranks(table, 0.002, 0.004)
    now[0] = 700.0
    assert [row.connected for row in table.statuses()] == [True] * 4
    now[0] = 701.0  # node 1 went away: rank 0 reported nothing more
    rows = table.statuses()
    assert [(row.rank, row.connected, row.heard_s_ago) for row in rows[2:]] == [(2, False, 601.0), (3, False, 601.0)]
    assert rank_imbalance_hints(rows) == [], "a rank that may be gone is not compared"
    remote_ranks(table, 0.002, 0.002, step=6)
    assert all(row.connected for row in table.statuses())


def test_node_0s_daemon_shows_another_nodes_ranks_not_connected_once_silent_for_its_hang_timeout(tmp_path: Path
                                                                                               ) -> None:
    import time

    config = several_ranks(load_config(QUICKSTART, [f"trainer.runs_dir={tmp_path}", "daemon.hang_timeout_s=0.2"]),
                           nnodes=2, rdzv_endpoint="node0.cluster:29500")
    daemon = Daemon(config, tmp_path / "config.yaml", state=tmp_path / "state", out=io.StringIO())
    remote_ranks(daemon.ranks, 0.002, 0.003)
    assert [(rank.rank, rank.connected, rank.copy_latency_mean_s) for rank in daemon.status().ranks] == [
        (2, True, 0.002), (3, True, 0.003)]
    time.sleep(0.3)
    assert [rank.connected for rank in daemon.status().ranks] == [False, False]
