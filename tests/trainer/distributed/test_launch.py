"""The launcher of a node's ranks (trainer/distributed/launch.py) and the config keys it reads.

The group tests start real ranks under torch.distributed's elastic launcher (small `python -c` programs
in place of the trainer, so each costs a few seconds, not a training run).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import REPO
from trainer.config import ConfigError, load_config, load_config_with_notes
from trainer.config.environment import launch_keys_from_environment
from trainer.config.ranks import parse_endpoint
from trainer.distributed.launch import first_failed_rank, group_exit_code, plan_group, run_group


@dataclass
class _Failure:
    exitcode: int
    timestamp: int


# ----------------------------------------------------------------------------------- exit codes


def test_the_group_ends_with_the_exit_code_of_its_first_failed_rank() -> None:
    # rank 1 ran out of memory first; rank 0's crash came after, as the group was torn down
    failures = {0: _Failure(exitcode=1, timestamp=105), 1: _Failure(exitcode=12, timestamp=100)}
    assert first_failed_rank(failures) == 1
    assert group_exit_code(failures) == 12


def test_of_ranks_failing_in_the_same_second_the_one_found_first_counts() -> None:
    # the elastic agent lists the rank it found failed before the ranks it then stopped (SIGTERM)
    failures = {3: _Failure(exitcode=-signal.SIGKILL, timestamp=100), 2: _Failure(exitcode=-signal.SIGTERM,
                                                                                 timestamp=100)}
    assert first_failed_rank(failures) == 3


def test_a_killed_rank_passes_on_its_signal() -> None:
    assert group_exit_code({1: _Failure(exitcode=-signal.SIGKILL, timestamp=7)}) == -signal.SIGKILL


def test_a_failure_without_failed_ranks_is_a_crash() -> None:
    assert group_exit_code({}) == 1


# ----------------------------------------------------------------------------------- rendezvous


def test_one_node_meets_on_a_free_local_port_through_c10d() -> None:
    plan = plan_group(nnodes=1, n_gpus_per_node=4, node_rank=0, rdzv_endpoint=None, run_name="run",
                      stop_timeout_s=60)
    assert (plan.rdzv_backend, plan.rdzv_endpoint, plan.world_size) == ("c10d", "localhost:0", 4)
    assert plan.shutdown_timeout_s == 60


def test_several_nodes_take_their_ranks_from_the_node_rank() -> None:
    plan = plan_group(nnodes=2, n_gpus_per_node=8, node_rank=1, rdzv_endpoint="node0:29500", run_name="run",
                      stop_timeout_s=30.5)
    assert (plan.rdzv_backend, plan.rdzv_endpoint, plan.rdzv_configs, plan.world_size) == (
        "static", "node0:29500", {"rank": 1}, 16)
    assert plan.shutdown_timeout_s == 31


# --------------------------------------------------------------------------------- real groups


def _plan(ranks: int = 2):
    return plan_group(nnodes=1, n_gpus_per_node=ranks, node_rank=0, rdzv_endpoint=None, run_name="test",
                      stop_timeout_s=20)


def test_a_rank_out_of_memory_ends_the_group_with_exit_code_12(tmp_path: Path) -> None:
    program = "import os, sys; sys.exit(12 if os.environ['RANK'] == '1' else 0)"
    assert run_group(_plan(), ["-c", program], log_dir=tmp_path) == 12


def test_a_rank_killed_ends_the_group_by_the_same_signal(tmp_path: Path) -> None:
    program = textwrap.dedent("""
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    assert run_group(_plan(), ["-c", program], log_dir=tmp_path) == -signal.SIGKILL


def test_sigterm_to_the_launcher_reaches_every_rank_and_it_ends_by_sigterm(tmp_path: Path) -> None:
    rank_program = textwrap.dedent(f"""
        import os, signal, sys, time
        from pathlib import Path
        def stop(signum, frame):
            Path({str(tmp_path)!r}, "stopped-" + os.environ["RANK"]).write_text("checkpointed")
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        Path({str(tmp_path)!r}, "started-" + os.environ["RANK"]).write_text("")
        time.sleep(120)
    """)
    launcher = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from trainer.distributed.launch import exit_like, plan_group, run_group
        plan = plan_group(nnodes=1, n_gpus_per_node=2, node_rank=0, rdzv_endpoint=None, run_name="t",
                          stop_timeout_s=20)
        sys.exit(exit_like(run_group(plan, ["-c", {rank_program!r}], log_dir=Path({str(tmp_path)!r}, "logs"))))
    """)
    process = subprocess.Popen([sys.executable, "-c", launcher], env={**os.environ, "PYTHONPATH": str(REPO)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: all((tmp_path / f"started-{rank}").exists() for rank in (0, 1)), process)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGTERM, output[-3000:]
    assert [(tmp_path / f"stopped-{rank}").read_text() for rank in (0, 1)] == ["checkpointed"] * 2


def _wait_for(condition, process: subprocess.Popen, timeout_s: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)


# ---------------------------------------------------------------------------------- config keys


def _problems(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    return [str(problem) for problem in caught.value.problems]


def test_several_nodes_need_a_rendezvous_endpoint(monkeypatch) -> None:
    for name in ("PET_RDZV_ENDPOINT", "MASTER_ADDR", "MASTER_PORT", "PET_MASTER_ADDR", "PET_MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    # A WARNING at load (verl's several-node scripts leave it to Ray); `verl train` refuses to start without it
    # (tests/trainer/config/test_front_door.py).
    [warning] = load_config_with_notes(None, ["trainer.nnodes=2"]).warnings
    assert str(warning).startswith("trainer.rdzv_endpoint: is not set, but trainer.nnodes is 2: each node's")


@pytest.mark.parametrize(("override", "expected"), [
    ("trainer.rdzv_endpoint=node0", "trainer.rdzv_endpoint: got 'node0'; allowed: host:port of node 0"),
    ("trainer.rdzv_endpoint=node0:99999", "trainer.rdzv_endpoint: got 'node0:99999'; allowed: host:port"),
    ("trainer.node_rank=2", "trainer.node_rank: got 2, but trainer.nnodes is 2; allowed: 0 to 1"),
])
def test_launch_keys_are_checked(override: str, expected: str) -> None:
    problems = _problems(["trainer.nnodes=2", "trainer.rdzv_endpoint=node0:29500", override])
    assert any(problem.startswith(expected) for problem in problems), problems


def test_endpoints_parse_with_ipv6_hosts() -> None:
    assert parse_endpoint("[::1]:29500") == ("::1", 29500)
    assert parse_endpoint("node0.cluster:29500") == ("node0.cluster", 29500)
    assert parse_endpoint(":29500") is None


def test_torchrun_and_slurm_names_fill_what_the_config_leaves_out() -> None:
    raw = {"trainer": {"nnodes": 2}}
    environment = {"SLURM_NODEID": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert launch_keys_from_environment(raw, environment) == []
    assert raw["trainer"] == {"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "node0:29500"}
    raw = {"trainer": {"nnodes": 2, "node_rank": 0}}
    launch_keys_from_environment(raw, {"NODE_RANK": "1", "PET_RDZV_ENDPOINT": "head:29400"})
    assert raw["trainer"] == {"nnodes": 2, "node_rank": 0, "rdzv_endpoint": "head:29400"}  # the config wins


def test_the_environment_is_not_read_for_one_node() -> None:
    raw = {"trainer": {"n_gpus_per_node": 2}}
    assert launch_keys_from_environment(raw, {"NODE_RANK": "3", "MASTER_ADDR": "x", "MASTER_PORT": "1"}) == []
    assert raw == {"trainer": {"n_gpus_per_node": 2}}


def test_a_node_rank_in_the_environment_that_is_no_number_is_one_line() -> None:
    problems = launch_keys_from_environment({"trainer": {"nnodes": 2}}, {"NODE_RANK": "first"})
    assert [str(problem) for problem in problems] == [
        "trainer.node_rank: got 'first' from $NODE_RANK; allowed: a whole number from 0 (or set trainer.node_rank)"]


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_the_launcher_ends_by_the_signal_that_killed_the_rank(signum: int) -> None:
    program = f"import sys; from trainer.distributed.launch import exit_like; sys.exit(exit_like({-signum}))"
    ended = subprocess.run([sys.executable, "-c", program], env={**os.environ, "PYTHONPATH": str(REPO)},
                           timeout=60)
    assert ended.returncode == -signum


def test_a_failed_rank_exit_code_is_the_launchers() -> None:
    program = "import sys; from trainer.distributed.launch import exit_like; sys.exit(exit_like(12))"
    ended = subprocess.run([sys.executable, "-c", program], env={**os.environ, "PYTHONPATH": str(REPO)},
                           timeout=60)
    assert ended.returncode == 12


def test_the_launcher_runs_the_configs_ranks_and_passes_the_stack_dump_signal_on(tmp_path: Path) -> None:
    """`python -m trainer.distributed.launch --config RESOLVED.yaml -- PROGRAM`: the config's rank count, and
    STACK_DUMP_SIGNAL (the daemon's "write your stacks" to a hung group) reaches every rank."""
    from trainer.config import dump_config
    from trainer.config.ipc import STACK_DUMP_SIGNAL

    config = load_config(REPO / "examples" / "quickstart.yaml", [
        f"trainer.runs_dir={tmp_path}", "trainer.device=cpu", "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"])
    resolved = tmp_path / "config.yaml"
    resolved.write_text(dump_config(config))
    rank_program = textwrap.dedent(f"""
        import os, signal, sys, time
        from pathlib import Path
        folder = Path({str(tmp_path)!r})
        def dumped(signum, frame):
            (folder / ("stacks-" + os.environ["RANK"])).write_text(os.environ["WORLD_SIZE"])
            sys.exit(0)
        signal.signal({int(STACK_DUMP_SIGNAL)}, dumped)
        (folder / ("started-" + os.environ["RANK"])).write_text("")
        time.sleep(120)
    """)
    process = subprocess.Popen([sys.executable, "-m", "trainer.distributed.launch", "--config", str(resolved), "--",
                                "-c", rank_program], env={**os.environ, "PYTHONPATH": str(REPO)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: all((tmp_path / f"started-{rank}").exists() for rank in (0, 1)), process)
        process.send_signal(STACK_DUMP_SIGNAL)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output[-3000:]
    assert [(tmp_path / f"stacks-{rank}").read_text() for rank in (0, 1)] == ["2", "2"]
    assert (config.trainer.run_dir / "logs" / "ranks").is_dir(), "the agent's files go under the run's logs"


def test_the_launcher_refuses_more_ranks_than_the_node_has_gpus_in_one_line_before_starting_any(tmp_path: Path,
                                                                                             monkeypatch, capsys):
    from trainer.config import dump_config
    from trainer.distributed import launch

    config = load_config(REPO / "examples" / "quickstart.yaml", [
        f"trainer.runs_dir={tmp_path}", "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"])
    resolved = tmp_path / "config.yaml"
    resolved.write_text(dump_config(config))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    monkeypatch.setattr(launch, "run_group", lambda *args, **kwargs: pytest.fail("the launcher started ranks"))
    assert launch.main(["--config", str(resolved)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ERROR: trainer.n_gpus_per_node: 4 ranks on this node, but it shows 2 GPU(s) (each rank needs one of its "
        "own); allowed: at most 2"]
