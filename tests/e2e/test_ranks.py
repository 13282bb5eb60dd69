"""Several ranks as a user meets them: the real `verl train` with trainer.device=cpu and
trainer.n_gpus_per_node=2 (2 CPU ranks over gloo under the daemon's launcher), and two "nodes" on this
machine (two `verl train` processes, nnodes=2, one rank each, a loopback rendezvous)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
from pathlib import Path

import pytest

from tests.e2e.runs import LiveRun, verl_train

TWO_RANKS = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"]


def current_step(run: LiveRun) -> int:
    return run.json("/v1/status")["progress"]["step"]


def connected_ranks(run: LiveRun) -> list[dict]:
    return [rank for rank in run.json("/v1/status")["ranks"] if rank["connected"]]


def test_two_ranks_train_report_per_rank_and_stop_with_a_checkpoint(tmp_path: Path) -> None:
    # optimizer_offload: each rank's HostAdamW copies (gradients down, updates up) are its offload copies.
    with verl_train(tmp_path, *TWO_RANKS, "trainer.total_training_steps=400",
                    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true") as run:
        run.wait(lambda: len(connected_ranks(run)) == 2 and current_step(run) >= 2, timeout=120,
                 what="two ranks past step 2")
        ranks = connected_ranks(run)
        assert [(rank["rank"], rank["local_rank"]) for rank in ranks] == [(0, 0), (1, 1)]
        rank_pids = [rank["pid"] for rank in ranks]
        assert set(rank_pids) <= set(run.runtime()["trainer_pids"]), "the runtime file lists the ranks"
        metrics = run.get("/metrics").text
        assert 'verl_trainer_rank_up{rank="0"} 1.0' in metrics and 'verl_trainer_rank_up{rank="1"} 1.0' in metrics
        # every rank's own figures under its rank (a CPU run's torch peak on the device is 0)
        assert 'verl_trainer_gpu_memory_max_allocated_bytes{rank="1"} 0.0' in metrics
        for rank in ("0", "1"):
            for direction in ("d2h", "h2d"):
                copies = re.search(rf'verl_offload_copies_total{{direction="{direction}",group="transformer",'
                                   rf'rank="{rank}"}} ([0-9.e+]+)', metrics)
                assert copies is not None and float(copies.group(1)) > 0, (rank, direction)
        run.wait(lambda: all(rank["copy_latency_mean_s"] is not None for rank in connected_ranks(run)),
                 timeout=60, what="each rank's offload copy latency in /v1/status (the advisor compares them)")

        # a rank's pid leads to the daemon (walking up through the launcher), and its live view has a row per rank
        snapshot = run.verl("monitor", "--pid", str(rank_pids[1]), "--once", "--json")
        assert snapshot.returncode == 0, snapshot.stderr
        assert json.loads(snapshot.stdout)["status"]["run"]["daemon_pid"] == run.process.pid
        view = run.verl("monitor", "--pid", str(rank_pids[1]), "--once")
        assert "rank 0" in view.stdout and "rank 1" in view.stdout, view.stdout

        changed = run.verl("set", "gpu_memory_threshold=0.7", "--pid", str(run.process.pid))
        assert changed.returncode == 0, changed.stderr
        version = run.json("/v1/settings")["version"]
        run.wait(lambda: run.json("/v1/settings")["acknowledged_version"] >= version, timeout=60,
                 what="rank 0's acknowledgement (once both ranks applied it)")

        stopped = run.verl("stop", "--pid", str(run.process.pid))
        assert stopped.returncode == 0, stopped.stderr
        assert run.process.wait(timeout=120) == 0, run.output()
    saved = [path.name for path in (run.run_dir / "checkpoints").iterdir() if path.name.startswith("global_step_")]
    assert saved, "the stop saved a checkpoint"


def test_a_killed_rank_restarts_the_group_which_resumes_and_finishes(tmp_path: Path) -> None:
    total = 12
    with verl_train(tmp_path, *TWO_RANKS, f"trainer.total_training_steps={total}", "trainer.save_freq=3") as run:
        run.wait(lambda: len(connected_ranks(run)) == 2 and current_step(run) >= 4, timeout=120,
                 what="two ranks past step 4")
        killed = connected_ranks(run)[1]["pid"]
        os.kill(killed, signal.SIGKILL)
        run.wait(lambda: run.json("/v1/status")["restarts"]["total"] == 1, timeout=120, what="the group's restart")
        run.wait(lambda: {rank["pid"] for rank in connected_ranks(run)} - {killed} == {
            rank["pid"] for rank in connected_ranks(run)} and len(connected_ranks(run)) == 2, timeout=120,
                 what="both ranks back")
        assert 'verl_trainer_restarts_total{reason="signal"} 1.0' in run.get("/metrics").text
        assert run.process.wait(timeout=240) == 0, run.output()
    output = (tmp_path / "verl.out").read_text()
    resumed = re.search(r"resumed from runs/quickstart/checkpoints/global_step_(\d+) at step (\d+)", output)
    assert resumed and int(resumed[1]) % 3 == 0 and int(resumed[1]) >= 3, output[-3000:]
    rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, total + 1))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_nodes_on_loopback_train_and_stop_cleanly_and_node_1_points_to_node_0(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    shared = tmp_path / "shared-checkpoints"  # as a cluster's shared file system holds the sharded checkpoints
    nodes = {rank: tmp_path / f"node{rank}" for rank in (0, 1)}
    for folder in nodes.values():
        folder.mkdir()

    def node(rank: int):
        return verl_train(nodes[rank], "trainer.nnodes=2", f"trainer.node_rank={rank}",
                          f"trainer.rdzv_endpoint={endpoint}", f"trainer.default_local_dir={shared}",
                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "trainer.total_training_steps=400")

    with node(0) as first, node(1) as second:
        first.wait(lambda: current_step(first) >= 2, timeout=180, what="node 0 past step 2")
        # Each node's daemon serves its own rank; node 0's shows node 1's too, as rank 0 reports it each step.
        assert [(rank["rank"], rank["node_rank"], rank["pid"] is not None) for rank in connected_ranks(first)] == [
            (0, 0, True), (1, 1, False)]
        assert [rank["rank"] for rank in connected_ranks(second)] == [1]
        assert connected_ranks(first)[1]["step"] >= 1
        shown = first.verl("status", "--pid", str(first.process.pid))
        assert "1 (node 1 GPU 0, as rank 0 reports it)" in shown.stdout, shown.stdout
        assert second.json("/v1/status")["run"]["node_rank"] == 1

        refused = second.verl("set", "gpu_memory_threshold=0.7", "--pid", str(second.process.pid))
        assert refused.returncode == 2, refused.stdout
        assert "serves node 1 of 2" in refused.stderr and "only node 0's daemon takes it" in refused.stderr
        assert second.json("/v1/settings")["values"]["dynamic_offload.gpu_memory_threshold"] == 0.85
        refused_stop = second.verl("stop", "--pid", str(second.process.pid))
        assert refused_stop.returncode == 2 and "node 0" in refused_stop.stderr
        assert second.process.poll() is None

        stopped = first.verl("stop", "--pid", str(first.process.pid))
        assert stopped.returncode == 0, stopped.stderr
        assert first.process.wait(timeout=180) == 0, first.output()
        assert second.process.wait(timeout=180) == 0, second.output()
    assert any(path.name.startswith("global_step_") for path in shared.iterdir())


@pytest.mark.slow
def test_a_rank_killed_on_node_1_restarts_both_nodes_groups_which_meet_again_resume_and_finish(tmp_path: Path) -> None:
    """A rank of another node that dies fails the collectives of node 0's ranks too: each node's daemon restarts its
    own group, the groups meet again at the same endpoint, resume from the shared latest checkpoint and finish."""
    endpoint = f"127.0.0.1:{_free_port()}"
    shared = tmp_path / "shared-checkpoints"
    nodes = {rank: tmp_path / f"node{rank}" for rank in (0, 1)}
    for folder in nodes.values():
        folder.mkdir()
    total = 6

    def node(rank: int):
        return verl_train(nodes[rank], "trainer.nnodes=2", f"trainer.node_rank={rank}",
                          f"trainer.rdzv_endpoint={endpoint}", f"trainer.default_local_dir={shared}",
                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                          f"trainer.total_training_steps={total}", "trainer.save_freq=2")

    with node(0) as first, node(1) as second:
        first.wait(lambda: current_step(first) >= 3, timeout=180, what="node 0 past step 3")
        [killed] = [rank["pid"] for rank in connected_ranks(second)]
        os.kill(killed, signal.SIGKILL)
        for run in (first, second):
            run.wait(lambda run=run: run.json("/v1/status")["restarts"]["total"] >= 1, timeout=180,
                     what="each node's group restarted")
        assert first.process.wait(timeout=300) == 0, first.output()
        assert second.process.wait(timeout=300) == 0, second.output()
    output = (nodes[0] / "verl.out").read_text()
    resumed = re.search(r"resumed from .*global_step_(\d+) at step", output)
    assert resumed and int(resumed[1]) % 2 == 0, output[-3000:]
    rows = [json.loads(line) for line in next((nodes[0] / "runs").rglob("metrics.jsonl")).read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, total + 1))


def test_the_slurm_script_starts_one_verl_train_per_node_with_a_valid_config(tmp_path: Path) -> None:
    """examples/slurm/verl.sbatch under stand-ins for srun (two tasks), scontrol and verl: each node's command
    line loads as a config for its node."""
    import subprocess
    import sys

    from tests.e2e.runs import REPO
    from trainer.config import load_config

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_ins = {
        "scontrol": "#!/bin/sh\nprintf 'gpu-a17\\ngpu-a18\\n'\n",
        "srun": "#!/bin/bash\nwhile [[ $1 == -* ]]; do shift; done\n"  # srun's options, then one task per node
                "for node in 0 1; do SLURM_NODEID=$node \"$@\" || exit 1; done\n",
        "verl": f"#!/bin/sh\n{sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\" "
                f">> {tmp_path}/calls.jsonl\n",
    }
    for name, text in stand_ins.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    environment = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-a[17-18]",
                   "SLURM_NNODES": "2", "SLURM_JOB_ID": "77", "SLURM_GPUS_ON_NODE": "8",
                   "CONFIG": str(REPO / "examples" / "quickstart.yaml")}
    extra = ["trainer.total_training_steps=9", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]
    subprocess.run(["bash", str(REPO / "examples" / "slurm" / "verl.sbatch"), *extra],
                   cwd=tmp_path, env=environment, check=True, timeout=60)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 2 and all(call[:3] == ["train", "--config", environment["CONFIG"]] for call in calls)
    for node, call in enumerate(calls):
        trainer = load_config(call[2], call[3:]).trainer
        assert (trainer.nnodes, trainer.node_rank, trainer.n_gpus_per_node) == (2, node, 8)
        assert trainer.rdzv_endpoint == "gpu-a17:29500" and trainer.total_training_steps == 9
        assert trainer.default_local_dir == f"{tmp_path}/verl-77/checkpoints"
        assert trainer.runs_dir == f"{tmp_path}/verl-77/runs/node{node}"


def test_the_two_node_script_takes_torchruns_names_for_the_node_rank_and_endpoint(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    """examples/multinode/two_nodes.sh with a stand-in verl: NODE_RANK and MASTER_ADDR:MASTER_PORT, which the
    script leaves in the environment, fill trainer.node_rank and trainer.rdzv_endpoint of its command line."""
    import subprocess
    import sys

    from tests.e2e.runs import REPO
    from trainer.config.loading import load_config

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "verl").write_text(f"#!/bin/sh\n{sys.executable} -c 'import json, os, sys; print(json.dumps("
                                  "[sys.argv[1:], os.environ[\"NODE_RANK\"], os.environ[\"MASTER_ADDR\"], "
                                  f"os.environ[\"MASTER_PORT\"]]))' \"$@\" >> {tmp_path}/calls.jsonl\n")
    (bin_dir / "verl").chmod(0o755)
    for node in (0, 1):
        environment = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "NODE_RANK": str(node),
                       "MASTER_ADDR": "node0.cluster", "SHARED": str(tmp_path / "shared"),
                       "CONFIG": str(REPO / "examples" / "quickstart.yaml"), "GPUS_PER_NODE": "2"}
        subprocess.run(["bash", str(REPO / "examples" / "multinode" / "two_nodes.sh"),
                        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"], env=environment, check=True,
                       timeout=60)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    for node, (arguments, node_rank, address, port) in enumerate(calls):
        for name, value in (("NODE_RANK", node_rank), ("MASTER_ADDR", address), ("MASTER_PORT", port)):
            monkeypatch.setenv(name, value)
        trainer = load_config(arguments[2], arguments[3:]).trainer
        assert (trainer.nnodes, trainer.node_rank, trainer.rdzv_endpoint) == (2, node, "node0.cluster:29500")
        assert trainer.runs_dir == f"{tmp_path}/shared/runs/node{node}"
