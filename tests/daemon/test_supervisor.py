"""The supervisor with a fake trainer (tests/daemon/fake_trainer.py): restarts, give-up, exit codes, stop."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from daemon.supervisor import RestartPolicy, Supervisor, exit_reason
from trainer.config.exit_codes import EXIT_OUT_OF_MEMORY

FAKE_TRAINER = [sys.executable, str(Path(__file__).with_name("fake_trainer.py"))]
QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"


def fake_env(folder: Path, **settings: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("FAKE_", "VERL_IPC"))}
    return {**env, "FAKE_DIR": str(folder), **{f"FAKE_{key.upper()}": value for key, value in settings.items()}}


def events(folder: Path) -> list[dict]:
    path = folder / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def trainer_started(folder: Path, supervisor: Supervisor) -> bool:
    """The fake trainer said it started: from then on it takes a stop (its signal handler is in place)."""
    path = folder / "events.jsonl"  # read as text: the trainer may be writing its next line
    return path.exists() and '"event": "start"' in path.read_text()


def supervise(folder: Path, *, max_restarts: int = 3, backoff_s: float = 0.05, stop_timeout_s: float = 10.0,
              stop_after_s: float | None = None, stop_when: Callable[[Path, Supervisor], bool] = trainer_started,
              stops: tuple[dict, ...] = ({},), **settings: str) -> tuple[int, Supervisor, list[dict]]:
    """Supervise the fake trainer; with `stop_after_s`, send `stops` once that many seconds have passed and
    `stop_when` holds (the fake trainer starts in about 0.5 s, and in seconds on a busy machine)."""
    restarts: list[dict] = []
    supervisor = Supervisor(FAKE_TRAINER, policy=RestartPolicy(max_restarts, backoff_s, 60.0),
                            stop_timeout_s=stop_timeout_s, env=fake_env(folder, **settings),
                            on_restart=restarts.append)

    async def scenario() -> int:
        if stop_after_s is None:
            return await asyncio.wait_for(supervisor.run(), 30)
        run = asyncio.create_task(supervisor.run())
        await asyncio.sleep(stop_after_s)
        deadline = time.monotonic() + 30
        while not stop_when(folder, supervisor):
            assert not run.done() and time.monotonic() < deadline, "the stop's moment never came"
            await asyncio.sleep(0.02)
        for stop in stops:  # the keyword arguments of each request
            supervisor.request_stop(**stop)
        return await asyncio.wait_for(run, 30)

    return asyncio.run(scenario()), supervisor, restarts


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(max_restarts=10, backoff_s=1.0, backoff_max_s=5.0)
    assert [policy.delay(restart) for restart in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_a_trainer_that_finishes_ends_the_run_with_exit_0(tmp_path: Path) -> None:
    code, supervisor, restarts = supervise(tmp_path, total_steps="3")
    assert code == 0 and supervisor.state == "finished" and restarts == []
    assert events(tmp_path)[-1] == {**events(tmp_path)[-1], "event": "exit", "step": 3}


def test_a_crashing_trainer_is_restarted_with_backoff_then_given_up_on_with_exit_1(tmp_path: Path) -> None:
    started = time.monotonic()
    code, supervisor, restarts = supervise(tmp_path, max_restarts=2, backoff_s=0.2, crash="exit:3",
                                           crash_at_step="1")
    assert code == 1 and supervisor.state == "failed"
    assert [event["event"] for event in events(tmp_path)].count("start") == 3  # the first run and 2 restarts
    assert restarts == [{"reason": "crash", "exit_code": 3, "restarts": 1, "backoff_s": 0.2},
                        {"reason": "crash", "exit_code": 3, "restarts": 2, "backoff_s": 0.4}]
    assert supervisor.restarts == 2 and supervisor.restarts_by_reason == {"crash": 2}
    assert time.monotonic() - started >= 0.6  # it did wait the back-off


def test_a_trainer_killed_by_a_signal_is_restarted_and_resumes(tmp_path: Path) -> None:
    code, supervisor, restarts = supervise(tmp_path, total_steps="4", crash="kill", crash_at_step="3",
                                           crash_runs="1")
    assert code == 0 and supervisor.state == "finished"
    assert [(event["reason"], event["exit_code"]) for event in restarts] == [("signal", -9)]
    starts = [event["step"] for event in events(tmp_path) if event["event"] == "start"]
    assert starts == [0, 2]  # the restart resumed after the last step the first run completed


@pytest.mark.parametrize(("returncode", "reason"), [(-9, "signal"), (-15, "signal"), (1, "crash"), (3, "crash"),
                                                   (EXIT_OUT_OF_MEMORY, "oom")])
def test_exit_reason_tells_out_of_memory_from_other_crashes(returncode: int, reason: str) -> None:
    assert exit_reason(returncode) == reason


def test_a_trainer_out_of_memory_is_restarted_and_counted_as_oom(tmp_path: Path) -> None:
    code, supervisor, restarts = supervise(tmp_path, total_steps="3", crash=f"exit:{EXIT_OUT_OF_MEMORY}",
                                           crash_at_step="2", crash_runs="1")
    assert code == 0 and supervisor.state == "finished"
    assert [(event["reason"], event["exit_code"]) for event in restarts] == [("oom", EXIT_OUT_OF_MEMORY)]
    assert supervisor.restarts_by_reason == {"oom": 1}


def test_the_real_trainer_exits_with_the_code_the_supervisor_counts_as_oom(tmp_path, monkeypatch, capsys) -> None:
    """trainer/main.py and daemon/supervisor.py share the code (trainer/config/exit_codes.py: the daemon has no
    torch), and an unrecovered torch out-of-memory error must end the trainer with it and one line saying what to
    do."""
    import torch

    import trainer.loop
    import trainer.main
    from trainer.config.ipc import ENV_SOCKET, ENV_TOKEN

    class OutOfMemoryTrainer:
        def __init__(self, *args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.delenv(ENV_SOCKET, raising=False)
    monkeypatch.delenv(ENV_TOKEN, raising=False)
    monkeypatch.setattr(trainer.loop, "Trainer", OutOfMemoryTrainer)
    code = trainer.main.main(["--config", str(QUICKSTART), f"trainer.runs_dir={tmp_path}"])
    assert code == trainer.main.EXIT_OUT_OF_MEMORY == EXIT_OUT_OF_MEMORY
    assert exit_reason(code) == "oom"
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith("ERROR: out of memory, not recovered (CUDA out of memory. "
                                                     "Tried to allocate 2.00 GiB)"), errors
    assert "ppo_micro_batch_size_per_gpu" in errors[0] and "param_offload=true" in errors[0]


def test_exit_2_is_a_config_problem_and_is_not_restarted(tmp_path: Path) -> None:
    code, supervisor, restarts = supervise(tmp_path, exit_code="2")
    assert code == 2 and supervisor.state == "failed" and restarts == []
    assert [event["event"] for event in events(tmp_path)] == ["start"]


def test_zero_max_restarts_gives_up_on_the_first_crash(tmp_path: Path) -> None:
    code, _, restarts = supervise(tmp_path, max_restarts=0, crash="exit:1", crash_at_step="1")
    assert code == 1 and restarts == []


def test_a_stop_request_lets_the_trainer_finish_its_step_and_exit_0(tmp_path: Path) -> None:
    code, supervisor, restarts = supervise(tmp_path, stop_after_s=1.0, total_steps="1000", step_s="0.05")
    assert code == 0 and supervisor.state == "finished" and restarts == []
    kinds = [event["event"] for event in events(tmp_path)]
    assert "sigterm" in kinds and kinds[-1] == "exit"
    assert events(tmp_path)[-1]["stopped"] is True and events(tmp_path)[-1]["step"] < 1000


def test_a_trainer_that_ignores_the_stop_is_killed_after_the_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    code, supervisor, _ = supervise(tmp_path, stop_after_s=1.0, stop_timeout_s=0.5, total_steps="1000",
                                    ignore_stop="1")
    assert code == 0 and supervisor.state == "finished"
    assert supervisor.last_exit_code == -9
    assert "sigterm_ignored" in [event["event"] for event in events(tmp_path)]
    assert 1.4 < time.monotonic() - started < 10


def test_a_stop_during_the_backoff_does_not_restart(tmp_path: Path) -> None:
    code, supervisor, restarts = supervise(tmp_path, backoff_s=5.0, stop_after_s=1.5, crash="exit:3",
                                           crash_at_step="1", stop_when=lambda _, supervisor: supervisor.restarts == 1)
    assert code == 0 and len(restarts) == 1
    assert [event["event"] for event in events(tmp_path)].count("start") == 1


def test_a_second_stop_request_is_the_same_stop_and_the_trainer_still_checkpoints(tmp_path: Path) -> None:
    code, supervisor, _ = supervise(tmp_path, stop_after_s=1.0, stops=({}, {}), total_steps="1000", step_s="0.05")
    assert code == 0 and supervisor.last_exit_code == 0  # not killed
    assert events(tmp_path)[-1]["event"] == "exit" and events(tmp_path)[-1]["stopped"] is True


def test_only_a_forced_stop_kills_the_trainer_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    code, supervisor, _ = supervise(tmp_path, stop_after_s=1.0, stops=({}, {"force": True}), total_steps="1000",
                                    ignore_stop="1")
    assert code == 0 and supervisor.state == "finished" and supervisor.last_exit_code == -9
    assert time.monotonic() - started < 8  # not after stop_timeout_s (10 s)
