"""The real `verl` command, as a user runs it: a short training run, stopping and resuming,
and one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import json
import os
import pty
import re
import resource
import select
import signal
import struct
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.e2e.runs import QUICKSTART, VERL

SMALL = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "trainer.device=cpu"]


def verl(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(VERL), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_the_verl_command_is_installed():
    assert VERL.is_file(), f"{VERL} missing: install the package (make venv)"


def test_train_writes_the_run_directory(tmp_path):
    # Dynamic offload on a CPU: a warning while the models are built, before the first step.
    result = verl("train", "--config", QUICKSTART, *SMALL, "trainer.total_training_steps=3", "trainer.save_freq=2",
                  "actor_rollout_ref.actor.fsdp_config.dynamic_offload.enabled=true", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "runs" / "quickstart"
    assert (run / "config.yaml").is_file()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert {"actor/pg_loss", "critic/score/mean", "timing_s/gen", "perf/throughput"} <= rows[0].keys()
    assert sorted(path.name for path in (run / "checkpoints").glob("global_step_*")) == [
        "global_step_2", "global_step_3"]
    # One line of metrics per step on the console, and the same in the run's log.
    step_lines = [line for line in result.stderr.splitlines() + result.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in step_lines] == ["1/3", "2/3", "3/3"]
    log = (run / "logs" / "trainer.log").read_text()
    assert "step 3/3" in log
    # What the trainer says while it builds the models reaches the log too, not only the terminal.
    warning = "dynamic offload of the actor needs a GPU to measure memory on"
    assert f"WARNING {warning}" in log and f"WARNING: {warning}" in result.stderr


def test_sigterm_checkpoints_and_a_second_start_resumes(tmp_path):
    args = ["train", "--config", QUICKSTART, *SMALL, "trainer.total_training_steps=400"]
    process = subprocess.Popen([str(VERL), *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    metrics = tmp_path / "runs" / "quickstart" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert "stopped at step" in output
    stopped_at = len(metrics.read_text().splitlines())
    assert 2 <= stopped_at < 400
    checkpoint = tmp_path / "runs" / "quickstart" / "checkpoints" / f"global_step_{stopped_at}"
    assert checkpoint.is_dir()

    result = verl("train", "--config", QUICKSTART, *SMALL, f"trainer.total_training_steps={stopped_at + 2}",
                  cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"resumed from {checkpoint.relative_to(tmp_path)} at step {stopped_at}" in result.stderr + result.stdout
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, stopped_at + 3))


ANSI_ESCAPE = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Za-z0-9]")


def _read_terminal(leader: int, timeout: float) -> bytes:
    """What the program wrote to its terminal within `timeout` seconds (b"" once it has closed it)."""
    ready, _, _ = select.select([leader], [], [], timeout)
    if not ready:
        return b""
    try:
        return os.read(leader, 65536)
    except OSError:  # EIO: every process holding the terminal has exited
        return b""


def test_train_monitor_shows_the_live_view_and_ctrl_c_stops_the_run_with_a_checkpoint(tmp_path):
    """`verl train --monitor` for real, in a pseudo-terminal: the view draws the run's steps; Ctrl-C (SIGINT to
    the terminal's process group: the daemon and its trainer) checkpoints, stops and exits 0."""
    leader, follower = pty.openpty()
    env = {**os.environ, "VERL_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "100", "LINES": "40",
           "TERM": "xterm-256color"}
    process = subprocess.Popen([str(VERL), "train", "--config", QUICKSTART, "--monitor", *SMALL,
                                "trainer.total_training_steps=400"], cwd=tmp_path, env=env, stdin=follower,
                               stdout=follower, stderr=follower, start_new_session=True)
    os.close(follower)
    screen = b""
    try:
        deadline = time.monotonic() + 90
        while not re.search(rb"step +[1-9][0-9]*/400", ANSI_ESCAPE.sub(b"", screen)):
            assert process.poll() is None and time.monotonic() < deadline, screen.decode(errors="replace")
            screen += _read_terminal(leader, 0.2)
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        assert process.wait(timeout=150) == 0, screen.decode(errors="replace")
        while chunk := _read_terminal(leader, 0.5):
            screen += chunk
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        os.close(leader)
    text = ANSI_ESCAPE.sub(b"", screen).decode(errors="replace")
    assert "Traceback" not in text
    assert "verl quickstart" in text and "restarts 0/3" in text  # the live view, not the plain progress lines
    stopped = re.search(r"run quickstart stopped at step (\d+)", text)
    assert stopped, text[-3000:]
    step = int(stopped.group(1))
    assert 1 <= step < 400
    assert (tmp_path / "runs" / "quickstart" / "checkpoints" / f"global_step_{step}").is_dir()


def _write_parquet(path: Path, table: dict) -> str:
    pq.write_table(pa.table(table), path)
    return str(path)


BAD_INPUTS = ["wrong type", "unknown key", "out of range", "moved key", "megatron", "bad choice",
              "missing model", "not a model dir", "missing data file", "unknown data format", "no prompt column",
              "not parquet", "reward function missing", "mini-batch", "grpo_passk n", "malformed override",
              "broken yaml", "empty config", "data directory", "truncated weights"]


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    not_a_model = tmp_path / "not_a_model"
    not_a_model.mkdir()
    no_prompt = _write_parquet(tmp_path / "no_prompt.parquet", {"question": ["1 2 3"], "data_source": ["counting"]})
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"this is not parquet")
    reward = tmp_path / "reward.py"
    reward.write_text("def something_else(*args):\n    return 0.0\n")
    broken_yaml = tmp_path / "broken.yaml"
    broken_yaml.write_text("data:\n  train_batch_size: [1, 2\n")
    empty_yaml = tmp_path / "empty.yaml"
    empty_yaml.write_text("# to be written\n")
    (tmp_path / "shards.parquet").mkdir()
    # A model whose weights file was cut short (an interrupted copy): found by the trainer, not the daemon.
    truncated = tmp_path / "truncated_model"
    truncated.mkdir()
    (truncated / "config.json").write_text('{"model_type": "qwen2"}')
    (truncated / "model.safetensors").write_bytes(struct.pack("<Q", 400) + b'{"lm_head.weight": {"dtype": "F3')
    return {
        "wrong type": (["data.train_batch_size=abc"], "data.train_batch_size"),
        "unknown key": (["actor_rollout_ref.actor.optm.lr=1"], "did you mean 'optim'"),
        "out of range": (["dynamic_offload.gpu_memory_threshold=1.5"], "dynamic_offload.gpu_memory_threshold"),
        "moved key": (["dynamic_offload.enabled=true"], "dynamic offload is enabled per model"),
        "megatron": (["actor_rollout_ref.actor.strategy=megatron"], "Megatron-LM is another training engine"),
        "bad choice": (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator"),
        "missing model": (["actor_rollout_ref.model.path=/nonexistent/model"], "actor_rollout_ref.model.path"),
        "not a model dir": ([f"actor_rollout_ref.model.path={not_a_model}"], "config.json"),
        "missing data file": (["data.train_files=/nonexistent/train.parquet"], "data.train_files[0]"),
        "unknown data format": (["data.train_files=train.csv"], ".parquet"),
        "no prompt column": ([f"data.train_files={no_prompt}"], "data.prompt_key"),
        "not parquet": ([f"data.train_files={garbage}"], "garbage.parquet"),
        "reward function missing": ([f"custom_reward_function.path={reward}"], "compute_score"),
        "mini-batch": (["data.train_batch_size=100"], "ppo_mini_batch_size"),
        "grpo_passk n": (["algorithm.adv_estimator=grpo_passk"], "actor_rollout_ref.rollout.n"),
        "malformed override": (["data.train_batch_size"], "not an override (no '=')"),
        "broken yaml": (["--config", str(broken_yaml)], "line"),
        "empty config": (["--config", str(empty_yaml)], "which is empty (or only comments)"),
        "data directory": ([f"data.train_files={tmp_path / 'shards.parquet'}"], "which is a directory"),
        "truncated weights": ([f"actor_rollout_ref.model.path={truncated}",
                               "actor_rollout_ref.model.tokenizer_path=builtin:tiny-qwen2"],
                              f"'{truncated / 'model.safetensors'}' is damaged or incomplete"),
    }


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_error_line_and_exit_code_2(tmp_path, case):
    overrides, expected = _bad_inputs(tmp_path)[case]
    config = ["--config", QUICKSTART]
    if overrides[0] == "--config":
        config, overrides = overrides, []
    result = verl("train", *config, *SMALL, *overrides, cwd=tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR: ")]
    assert len(errors) == 1, result.stderr
    assert expected in errors[0]
    # Nothing was trained on bad input, and a problem that would recur is not retried.
    assert not (tmp_path / "runs" / "quickstart" / "metrics.jsonl").exists()
    assert "restart 1 of" not in result.stderr + result.stdout


def test_a_reward_function_that_raises_stops_the_run_in_one_line_with_the_traceback_in_the_log(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'score': solution_str.split()[99]}\n")
    result = verl("train", "--config", QUICKSTART, *SMALL, f"custom_reward_function.path={reward}", cwd=tmp_path)
    output = result.stdout + result.stderr
    # It was: a traceback on the console only, three restarts, exit code 1.
    assert result.returncode == 2, output
    assert "Traceback" not in output and "restart 1 of" not in output
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR: ")]
    assert errors == [f"ERROR: custom_reward_function 'compute_score' at {reward}:2 raised IndexError: list index "
                      "out of range (scoring a response of data_source 'counting'); fix the function, or set "
                      "custom_reward_function.on_error=zero to score such responses 0 (its traceback is in "
                      "runs/quickstart/logs/trainer.log)"]
    log = (tmp_path / "runs" / "quickstart" / "logs" / "trainer.log").read_text()
    assert "Traceback (most recent call last):" in log
    assert f'File "{reward}", line 2, in compute_score' in log


def _files_up_to_one_mib() -> None:
    """As on a nearly full disk: no file of the run may grow past 1 MiB (the kernel refuses the write with
    EFBIG, writing what fits first). The quickstart's weights (0.5 MB a model) fit, its trainer state
    (2 MB: optimizer states) does not."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))


def test_checkpoints_the_disk_cannot_take_leave_the_run_going_and_the_last_keeps_the_weights(tmp_path):
    result = subprocess.run([str(VERL), "train", "--config", QUICKSTART, *SMALL, "trainer.total_training_steps=3",
                             "trainer.save_freq=1"], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                            preexec_fn=_files_up_to_one_mib)
    output = result.stdout + result.stderr
    run = tmp_path / "runs" / "quickstart"
    # It was: exit code 2 at the first save.
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3], output
    assert [row["checkpoint/failures"] for row in rows] == [0, 1, 1]
    log = (run / "logs" / "trainer.log").read_text()
    assert log.count("CHECKPOINT NOT SAVED: could not write the checkpoint of step") == 2
    assert not list((run / "checkpoints").glob("*global_step_*")), "no partial checkpoint is left"
    weights = run / "checkpoints" / "weights_step_3"
    assert sorted(path.name for path in weights.iterdir()) == ["config.json", "model.safetensors"]
    assert result.returncode == 2 and "restart 1 of" not in output, output
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR: ")]
    assert len(errors) == 1 and errors[0].startswith("ERROR: the final checkpoint of step 3 was not saved: "), output
    assert f"the actor's weights alone are in {weights.relative_to(tmp_path)} (safetensors" in errors[0]


# ----------------------------------------------------------------------------- --check and no --config


def test_check_validates_without_training_and_prints_the_resolved_config(tmp_path):
    result = verl("train", "--check", *SMALL, "trainer.experiment_name=${oc.env:VERL_CHECK_NAME,checked}",
                  "+data.seed=3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["trainer"]["experiment_name"] == "checked"
    assert (resolved["data"]["train_batch_size"], resolved["data"]["seed"]) == (16, 3)
    assert "config OK" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_check_reports_schema_and_cross_field_problems_in_one_round(tmp_path):
    result = verl("train", "--check", "--config", QUICKSTART, "data.max_prompt_length=abc",
                  "algorithm.adv_estimator=grpo_passk", "data.x=[", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR: ")]
    assert [line.split(":")[1].strip() for line in errors] == ["data.x"], "a grammar error stops before the schema"
    result = verl("train", "--check", "--config", QUICKSTART, "data.max_prompt_length=abc",
                  "algorithm.adv_estimator=grpo_passk", cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR: ")]
    assert [line.split(":")[1].strip() for line in errors] == ["data.max_prompt_length", "actor_rollout_ref.rollout.n"]
    assert result.stdout == ""


def test_check_measures_the_prompts_against_max_prompt_length(tmp_path):
    result = verl("train", "--check", *SMALL, "data.max_prompt_length=2", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR: ")]
    assert len(errors) == 1 and "more than data.max_prompt_length=2" in errors[0], result.stderr
    assert result.stdout == ""


def test_train_without_a_config_file_starts_from_the_defaults(tmp_path):
    result = verl("train", *SMALL, "trainer.total_training_steps=1", "trainer.experiment_name=defaults",
                  cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "runs" / "defaults"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in steps] == [1]
