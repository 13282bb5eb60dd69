"""Training on several ranks (FSDP2 over gloo, 2 CPU ranks) as a user launches it: `python -m torch.distributed.run
--nproc-per-node 2 -m trainer --config X`, against the same run on one rank (`python -m trainer`).

The runs are greedy (rollout.do_sample: false), so one rank and two sample the same responses to the same
prompts; GRPO's advantages are then 0 (a group's responses are alike), and the entropy bonus is what trains.
Four launches serve every test of the module (starting ranks costs seconds here): one rank and two for three
steps each, then each resumed at the other world size from the other's step-2 checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.support import REPO
from trainer.data import counting_records, rank_share, write_records

TOLERANCE = 1e-5
"""fp32: the largest difference allowed between parameters trained on one rank and on two (Adam's steps here
move them by about 1e-3 each; sums over different splits differ in the last bits)."""
HOST_ADAMW_TOLERANCE = 1e-4
"""The same for runs whose AdamW runs on the CPU over bf16 weights' fp32 masters (OPTIMIZER_OFFLOAD): the CPU's own
vector kernels round the host's arithmetic, and which kernels run depends on the processor. Measured on an AMD EPYC:
3.2e-5 between one and two ranks, bit for bit the same before and after issue 37's restructuring; under 1e-5 on the
processor of CI's run of 2026-12-04. A wrong update (two ranks that did not delay) moved the weights 5e-3 apart."""
MACHINE_METRICS = ("timing_s/", "timing_per_token_ms/", "perf/")
RUN = [
    "actor_rollout_ref.model.path=builtin:tiny-qwen2",
    "actor_rollout_ref.model.override_config={num_hidden_layers: 2, hidden_size: 32, intermediate_size: 64}",
    "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.optim.lr=1e-3",
    "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.rollout.do_sample=false", "algorithm.adv_estimator=grpo", "data.max_prompt_length=8",
    "data.max_response_length=6", "trainer.device=cpu", "trainer.total_training_steps=3", "trainer.save_freq=2",
]


def launch(ranks: int, runs_dir: Path, name: str, *overrides: str, config: Path | None = None
           ) -> subprocess.CompletedProcess:
    """The trainer on `ranks` CPU ranks (torchrun for several, as the verl daemon starts them)."""
    if config is None:
        config = runs_dir / "empty.yaml"
        config.write_text("{}\n")
    command = [*trainer_command(ranks, config), *RUN, f"trainer.n_gpus_per_node={ranks}",
               f"trainer.runs_dir={runs_dir}", f"trainer.experiment_name={name}", *overrides]
    return subprocess.run(command, env=rank_environment(), capture_output=True, text=True, timeout=300)


def rank_script_reports(script: str, out: Path, *args: str, ranks: int = 2) -> list[dict]:
    """Run this folder's `script` on `ranks` CPU ranks (torchrun, gloo) with `out` and `args`; each rank's report,
    OUT/rank<r>.json, in rank order."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(Path(__file__).with_name(script)), str(out), *args]
    finished = subprocess.run(command, env=rank_environment(), capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def rank_environment() -> dict[str, str]:
    """This environment without a torchrun rank of its own (the test may run under one), the repository first."""
    # The repository first, then what the caller's path holds (packages installed with --target, as on the GPU image).
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        environment.pop(variable, None)
    return environment


def trainer_command(processes: int, config: Path) -> list[str]:
    """`python -m trainer --config config`, under torchrun with `processes` processes when more than one."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
                if processes > 1 else [sys.executable])
    return [*launcher, "-m", "trainer", "--config", str(config)]


def actor_weights(checkpoint: Path, role: str = "actor") -> dict[str, torch.Tensor]:
    """A model's whole weights of a checkpoint of one rank (safetensors) or several (DCP shards)."""
    shards = checkpoint / role / "dcp"
    if shards.is_dir():
        whole = checkpoint.parent / f".{checkpoint.name}.{role}.pt"
        dcp_to_torch_save(shards, whole)
        return torch.load(whole, weights_only=False)["model"]
    return load_file(checkpoint / role / "model.safetensors")


def largest_difference(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    names = set(first) & set(second)
    assert len(names) >= len(first) - 1, "a tied head may be saved under one name only"
    return max((first[name].float() - second[name].float()).abs().max().item() for name in names)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


PPO = ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1", "critic.optim.lr=1e-3",
       "actor_rollout_ref.actor.entropy_coeff=0", "trainer.total_training_steps=2", "trainer.save_freq=1"]
"""PPO with a critic, 2 steps, a checkpoint after each (conftest.ppo_one_rank runs it once on one rank)."""


def step_metrics(run: Path, step: int) -> dict:
    [row] = [row for row in metrics(run) if row["step"] == step]
    return row


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """runs/one and runs/two: 3 steps on 1 and 2 ranks, validated before the first and after the last (5 prompts in
    batches of 3: the ranks' shares are uneven); one_from_two and two_from_one: step 3 resumed at the other world
    size from step 2 of two and one; two_from_two: at the same one, with the actor's shards on the CPU."""
    root = tmp_path_factory.mktemp("ranks")
    write_records(counting_records(5, seed=1), root / "validation.jsonl")
    validation = [f"data.val_files={root / 'validation.jsonl'}", "trainer.test_freq=3", "data.val_batch_size=3"]
    for ranks, name in ((1, "one"), (2, "two")):
        finished = launch(ranks, root, name, *validation)
        assert finished.returncode == 0, finished.stderr[-4000:]
    # The restart of a run at its own world size resumes with its shards on the CPU (FSDP2's CPUOffloadPolicy).
    for ranks, name, source, *placement in ((1, "one_from_two", "two"), (2, "two_from_one", "one"),
                                            (2, "two_from_two", "two", "actor_rollout_ref.actor.fsdp_config."
                                                                      "param_offload=true")):
        finished = launch(ranks, root, name, "trainer.resume_mode=resume_path", *placement,
                          f"trainer.resume_from_path={root / source / 'checkpoints' / 'global_step_2'}")
        assert finished.returncode == 0, finished.stderr[-4000:]
        assert "resumed from" in finished.stderr + finished.stdout
    return root


@pytest.mark.slow
def test_two_ranks_train_the_same_parameters_as_one_on_the_same_global_batch(runs):
    for step in (2, 3):
        one = actor_weights(runs / "one" / "checkpoints" / f"global_step_{step}")
        two = actor_weights(runs / "two" / "checkpoints" / f"global_step_{step}")
        assert largest_difference(one, two) < TOLERANCE, step
    # The comparison can fail: one step moves the weights by far more than the tolerance.
    moved = largest_difference(actor_weights(runs / "one" / "checkpoints" / "global_step_2"),
                               actor_weights(runs / "one" / "checkpoints" / "global_step_3"))
    assert moved > 100 * TOLERANCE
    # The same computed figures, run-wide on rank 0 (means over both ranks' sequences, counts summed).
    for row_one, row_two in zip(metrics(runs / "one"), metrics(runs / "two"), strict=True):
        for key, value in row_one.items():
            if not key.startswith(MACHINE_METRICS) and key != "actor/grad_norm":
                assert row_two[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        if "actor/grad_norm" in row_one:  # not in the validation before training (step 0)
            assert row_two["actor/grad_norm"] == pytest.approx(row_one["actor/grad_norm"], rel=1e-3)


@pytest.mark.slow
def test_ppo_with_a_critic_on_two_ranks_trains_both_models_as_one_rank(tmp_path, ppo_one_rank):
    """The critic is sharded too, and GAE's advantages are whitened over both ranks' tokens, as one rank whitens
    its whole batch. Dynamic offload is accepted on several ranks (each rank moves its own shards' layers from its
    GPU's memory); on a CPU there is no device memory to watch, and the run says so."""
    finished = launch(2, tmp_path, "two", *PPO, "critic.fsdp_config.dynamic_offload.enabled=true")
    assert finished.returncode == 0, finished.stderr[-4000:]
    assert "dynamic offload of the critic needs a GPU to measure memory on" in finished.stdout + finished.stderr
    for role in ("actor", "critic"):
        one, two = (actor_weights(run / "checkpoints" / "global_step_2", role)
                    for run in (ppo_one_rank, tmp_path / "two"))
        assert largest_difference(one, two) < TOLERANCE, role
    assert metrics(tmp_path / "two")[1]["critic/advantages/mean"] == pytest.approx(
        metrics(ppo_one_rank)[1]["critic/advantages/mean"], abs=1e-5)


@pytest.mark.slow
def test_metrics_have_the_same_keys_on_two_ranks_and_only_rank_0_writes_them(runs):
    one, two = metrics(runs / "one"), metrics(runs / "two")
    assert [row["step"] for row in two] == [0, 1, 2, 3]  # one line per step, not one per rank
    # Validation before training and after the last step: each rank scored its share, the mean is of all 5.
    assert "val-core/counting/reward/mean@1" in two[0] and "val-core/counting/reward/mean@1" in two[3]
    assert [sorted(row) for row in one] == [sorted(row) for row in two]
    assert two[1]["perf/total_num_tokens"] == pytest.approx(one[1]["perf/total_num_tokens"])  # summed over ranks
    assert (runs / "two" / "logs" / "trainer-rank1.log").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("resumed, straight", [("one_from_two", "one"), ("two_from_one", "two"),
                                               ("two_from_two", "two")], ids=["2->1", "1->2", "2->2-offloaded"])
def test_a_checkpoint_resumes_at_the_other_world_size_with_the_same_weights_and_optimizer_states(runs, resumed,
                                                                                                 straight):
    # Step 3 after the resume is step 3 of the run that never stopped: the weights and Adam's moments (which
    # set the size of step 3's update) came through the change of world size.
    weights = actor_weights(runs / resumed / "checkpoints" / "global_step_3")
    assert largest_difference(weights, actor_weights(runs / straight / "checkpoints" / "global_step_3")) < TOLERANCE
    assert [row["step"] for row in metrics(runs / resumed)] == [3]
    assert step_metrics(runs / resumed, 3)["actor/entropy"] == pytest.approx(
        step_metrics(runs / straight, 3)["actor/entropy"], rel=1e-5)


def test_each_rank_takes_a_disjoint_slice_of_every_mini_batch_of_whole_prompts():
    batch = [7, 3, 9, 1, 4, 8, 2, 6]
    shares = [rank_share(batch, rank=rank, world_size=2, mini_batch_size=4) for rank in range(2)]
    assert shares == [[7, 3, 4, 8], [9, 1, 2, 6]]
    # Mini-batch k of each rank is its half of global mini-batch k: the same prompts in each optimizer step.
    assert sorted(shares[0][:2] + shares[1][:2]) == sorted(batch[:4])
    assert sorted(shares[0] + shares[1]) == sorted(batch)
    with pytest.raises(ValueError, match="does not split among 4 ranks"):
        rank_share(batch, rank=0, world_size=4, mini_batch_size=2)


def test_grpo_groups_stay_whole_on_one_rank(tmp_path):
    """Prompts are split before they are repeated rollout.n times: each rank's batch holds whole groups."""
    from trainer.config import load_config
    from trainer.loop import Trainer

    config = load_config(None, [*RUN, "trainer.n_gpus_per_node=1", f"trainer.runs_dir={tmp_path}"])
    trainer = Trainer(config, log=lambda *_: None)
    share = [trainer.records[index] for index in rank_share(list(range(8)), rank=1, world_size=2, mini_batch_size=4)]
    batch = trainer.generation.generate(share)
    assert batch.group_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [record.prompt for record in batch.records] == [record.prompt for record in share for _ in range(2)]


@pytest.mark.slow
def test_a_batch_size_that_does_not_divide_among_the_ranks_is_one_config_line_and_exit_2_on_every_rank(tmp_path):
    # verl refuses it too: 3 prompts x 1 response do not split among 2 GPUs (its real_train_batch_size).
    bad = ["actor_rollout_ref.actor.ppo_mini_batch_size=3", "data.train_batch_size=3", "actor_rollout_ref.rollout.n=1",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
    line = ("ERROR: data.train_batch_size: got 3, whose 3 sequences (x rollout.n 1) do not divide among the run's 2 "
            "ranks (trainer.nnodes x trainer.n_gpus_per_node); verl requires train_batch_size x rollout.n to be a "
            "multiple of the GPUs; allowed: a multiple of 2")
    finished = launch(2, tmp_path, "bad", *bad)
    output = finished.stdout + finished.stderr
    assert [text for text in output.splitlines() if "ERROR:" in text] == [line]
    assert "failed (exitcode: 2)" in output and "ConfigError" not in output  # torchrun's report, no trainer traceback
    # Each rank on its own (torchrun stops the others once one has exited): 2, and only rank 0 prints the line.
    (tmp_path / "empty.yaml").write_text("{}\n")
    for rank in (0, 1):
        environment = {**os.environ, "PYTHONPATH": str(REPO), "RANK": str(rank), "WORLD_SIZE": "2"}
        alone = subprocess.run([sys.executable, "-m", "trainer", "--config", str(tmp_path / "empty.yaml"), *RUN,
                                "trainer.n_gpus_per_node=2", f"trainer.runs_dir={tmp_path}", *bad],
                               env=environment, capture_output=True, text=True, timeout=120)
        assert alone.returncode == 2
        assert alone.stderr.splitlines() == ([line] if rank == 0 else [])


def test_a_live_setting_checkpoint_and_stop_apply_at_the_same_step_on_both_ranks(tmp_path):
    out = tmp_path / "reports"
    out.mkdir()
    zero, one = rank_script_reports("control_ranks.py", out, str(tmp_path / "runs"))
    # Sent to rank 0 during step 1: both ranks apply it at the safe point after step 1 and train step 2 with it.
    assert zero["applied_at"] == one["applied_at"] == [1]
    assert zero["threshold"] == one["threshold"] == 0.6
    assert zero["acks"] == [[4, 2]] and one["acks"] == []  # rank 0 acknowledges, once all have applied it
    # Checkpoint-now at the same safe point; rank 1's stop (a signal to it alone) stops both after step 3.
    assert zero["checkpoints"] == one["checkpoints"] == [1, 3]
    assert zero["final_step"] == one["final_step"] == 3


DYNAMIC_BATCHES = ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                   "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=14",
                   "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                   "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=14", "critic.use_dynamic_bsz=true",
                   "critic.ppo_max_token_len_per_gpu=14", "critic.forward_max_token_len_per_gpu=14"]
"""verl's use_dynamic_bsz with budgets of 14 tokens (a sequence here is at most 8 + 6; these are 9 tokens, or 4 or 5
when the response ends early): one or two sequences a micro-batch as their lengths allow, so in some mini-batches
one rank's share needs one micro-batch ([9, 4]) and the other's two ([9, 9])."""


@pytest.mark.slow
def test_token_budget_micro_batches_and_the_static_decode_on_two_ranks_train_as_one_rank(tmp_path, ppo_one_rank):
    """Two features whose passes are collectives on sharded models, in one launch (starting ranks costs seconds):

    - use_dynamic_bsz: each rank splits its share into as many micro-batches as the rank that needs the most (a
      rank one micro-batch short would leave the other waiting in its gathers);
    - rollout.decode=static: each decoded token is a forward that gathers every rank's shards, so every rank decodes
      until every rank's rows have finished (those whose rows have decode pads).

    The gradient does not depend on how the batch is split, and greedy the static decode's tokens are generate's:
    both models train as the one-rank run with fixed micro-batches that decoded with generate."""
    finished = launch(2, tmp_path, "two", *PPO, *DYNAMIC_BATCHES, "actor_rollout_ref.rollout.decode=static")
    assert finished.returncode == 0, finished.stderr[-4000:]
    for role in ("actor", "critic"):
        one, two = (actor_weights(run / "checkpoints" / "global_step_2", role)
                    for run in (ppo_one_rank, tmp_path / "two"))
        assert largest_difference(one, two) < TOLERANCE, role
    assert [row["response_length/mean"] for row in metrics(tmp_path / "two")] == pytest.approx(
        [row["response_length/mean"] for row in metrics(ppo_one_rank)])


LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.use_kl_loss=true", "trainer.total_training_steps=2", "trainer.save_freq=1"]
"""GRPO with a LoRA adapter on the actor, its KL loss against the reference policy: the actor with the adapter
disabled (no second model)."""


@pytest.mark.slow
def test_a_lora_adapter_trains_on_two_ranks_as_on_one_and_resumes_from_a_one_rank_checkpoint(tmp_path):
    """One rank trains 2 steps (its checkpoints hold the adapter alone, in peft's format); two ranks resume its
    step-1 checkpoint (every rank loads the adapter into its shards, the base weights being the model's own) and
    train step 2 on the sharded model: the adapter comes out as the one rank's."""
    from safetensors.torch import load_file

    from trainer.checkpoint import adapter_file_names

    finished = launch(1, tmp_path, "one", *LORA)
    assert finished.returncode == 0, finished.stderr[-4000:]
    finished = launch(2, tmp_path, "two_from_one", *LORA, "trainer.resume_mode=resume_path",
                      f"trainer.resume_from_path={tmp_path / 'one' / 'checkpoints' / 'global_step_1'}")
    assert finished.returncode == 0, finished.stderr[-4000:]
    assert "resumed from" in finished.stderr + finished.stdout
    one = load_file(tmp_path / "one" / "checkpoints" / "global_step_2" / "actor" / "adapter_model.safetensors")
    sharded = actor_weights(tmp_path / "two_from_one" / "checkpoints" / "global_step_2")
    names = adapter_file_names(sharded)
    assert sorted(names) == sorted(one) and len(one) == 2 * 7 * 2  # lora_A and lora_B of 7 linears, 2 layers
    assert max((one[saved] - sharded[name]).abs().max().item() for saved, name in names.items()) < TOLERANCE
    assert max(one[saved].abs().max().item() for saved in one if "lora_B" in saved) > 0  # the adapter trained


OPTIMIZER_OFFLOAD = ["actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
                     "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16", "trainer.total_training_steps=3",
                     "trainer.save_freq=1"]
"""A bf16 actor with optimizer_offload: fp32 masters and AdamW's states on the CPU, on one rank (the offload
engine) and on several (FSDP2 shards on the device, HostAdamW)."""


@pytest.mark.slow
def test_optimizer_offload_of_a_bf16_actor_on_two_ranks_resumes_from_and_into_one_rank_with_the_same_weights(tmp_path):
    """One rank trains 3 steps; two ranks resume its step 1 (AdamW's states loaded onto the CPU for HostAdamW) and
    train steps 2 and 3; one rank resumes the two ranks' step 2 and trains step 3. The three step-3 actors are the
    same, in fp32: two ranks keep fp32 masters of the bf16 weights (FSDP2's MixedPrecisionPolicy over fp32 shards)
    as one rank's engine does. (One step against torch's AdamW: test_sharding.py, test_host_adamw.py.)"""
    finished = launch(1, tmp_path, "one", *OPTIMIZER_OFFLOAD)
    assert finished.returncode == 0, finished.stderr[-4000:]
    for ranks, name, source, step in ((2, "two_from_one", "one", 1), (1, "one_from_two", "two_from_one", 2)):
        finished = launch(ranks, tmp_path, name, *OPTIMIZER_OFFLOAD, "trainer.resume_mode=resume_path",
                          f"trainer.resume_from_path={tmp_path / source / 'checkpoints' / f'global_step_{step}'}")
        assert finished.returncode == 0, finished.stderr[-4000:]
        if ranks == 2:
            assert "AdamW's states and arithmetic on the CPU" in finished.stdout + finished.stderr
            assert "fp32 masters of the bf16 weights" in finished.stdout + finished.stderr
    one, two, back = (actor_weights(tmp_path / run / "checkpoints" / "global_step_3")
                      for run in ("one", "two_from_one", "one_from_two"))
    assert {value.dtype for value in two.values()} == {torch.float32}
    # fp32 masters move by updates that a bf16 weight would round away: most are not bf16 values.
    moved = torch.cat([value.flatten() for value in two.values()])
    assert (moved != moved.bfloat16().float()).float().mean() > 0.5
    assert largest_difference(one, two) < HOST_ADAMW_TOLERANCE
    assert largest_difference(one, back) < HOST_ADAMW_TOLERANCE


@pytest.mark.parametrize(("cores", "ranks_per_node", "threads"), [(32, 2, 16), (16, 3, 5), (2, 4, 1), (1, 1, 1)])
def test_each_rank_takes_its_share_of_the_nodes_cores_for_its_host_work(monkeypatch, cores, ranks_per_node, threads):
    """torchrun starts ranks with OMP_NUM_THREADS=1: unset, trainer.cpu_threads becomes the rank's share of the cores
    it may run on (the host's AdamW of optimizer_offload ran on one core of 32: 9.6 s an update against 0.6 s)."""
    from trainer.distributed import ranks as ranks_module

    monkeypatch.setattr(ranks_module.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert ranks_module.host_threads_per_rank(ranks_per_node) == threads


class _JoinedTheGroup(Exception):
    """Raised in place of init_process_group: the rank got past its checks."""


@pytest.fixture
def two_gpu_node(monkeypatch):
    """A node that shows 2 GPUs (this machine need not have any); joining the process group raises _JoinedTheGroup."""
    from trainer.distributed import ranks as ranks_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(ranks_module.dist, "is_initialized", lambda: False)

    def join(**options):
        raise _JoinedTheGroup(options)

    monkeypatch.setattr(ranks_module.dist, "init_process_group", join)


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_every_rank_of_a_node_short_of_gpus_stops_with_the_line_before_joining_the_group(two_gpu_node, rank):
    """Rank 0 too, though it has a GPU of its own: it is the rank that prints a user error (trainer/main.py), so
    without the check the user saw only torchrun's "rank 2 failed"."""
    from trainer.distributed.ranks import Ranks
    from trainer.errors import RunSetupError

    environ = {"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "4"}
    with pytest.raises(RunSetupError) as caught:
        Ranks.from_environment("auto", environ)
    assert str(caught.value) == ("trainer.n_gpus_per_node: 4 ranks on this node, but it shows 2 GPU(s) (each rank "
                                 "needs one of its own); allowed: at most 2")


def test_ranks_that_fit_the_nodes_gpus_join_the_group(two_gpu_node):
    from trainer.distributed.ranks import Ranks

    with pytest.raises(_JoinedTheGroup):
        Ranks.from_environment("cuda", {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})


def test_without_torchruns_ranks_per_node_only_a_rank_without_a_gpu_stops(two_gpu_node):
    from trainer.distributed.ranks import Ranks
    from trainer.errors import RunSetupError

    with pytest.raises(_JoinedTheGroup):
        Ranks.from_environment("cuda", {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    with pytest.raises(RunSetupError, match="3 ranks on this node, but it shows 2 GPU"):
        Ranks.from_environment("cuda", {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2"})


@pytest.mark.slow
def test_the_actors_delayed_update_on_two_ranks_trains_the_weights_of_one_ranks(tmp_path):
    """delayed_update: one rank's engine and two ranks' HostAdamW both run the host's update during the next rollout,
    which samples with the weights from before it, and publish it before the log-probs and before a checkpoint (so a
    run goes on as one resumed from that checkpoint would). With a checkpoint at step 2 only, step 2's rollout samples
    the weights from before step 1's update and step 3's the saved ones: one and two ranks train the same step-3
    actor, and so do two ranks resumed from one rank's step 2. (The check can fail: two ranks that did not delay
    trained other weights, 0.005 apart, when this was written.)"""
    delayed = [*OPTIMIZER_OFFLOAD, "actor_rollout_ref.actor.fsdp_config.delayed_update=true", "trainer.save_freq=2"]
    resume = ["trainer.resume_mode=resume_path",
              f"trainer.resume_from_path={tmp_path / 'one' / 'checkpoints' / 'global_step_2'}"]
    for ranks, name, extra in ((1, "one", []), (2, "two", []), (2, "resumed", resume)):
        finished = launch(ranks, tmp_path, name, *delayed, *extra)
        assert finished.returncode == 0, finished.stderr[-4000:]
        if name == "two":
            assert "during the next rollout, which samples with the weights from before it" in \
                finished.stdout + finished.stderr
    one, two, resumed = (actor_weights(tmp_path / run / "checkpoints" / "global_step_3")
                         for run in ("one", "two", "resumed"))
    assert largest_difference(one, two) < HOST_ADAMW_TOLERANCE
    assert largest_difference(one, resumed) < HOST_ADAMW_TOLERANCE


@pytest.mark.slow
def test_an_on_policy_delayed_update_on_two_ranks_lands_at_the_update_and_trains_the_weights_of_one_ranks(tmp_path):
    """One mini-batch, one epoch: no step scores the old log-probs in a pass of its own (the update takes its own), so
    two ranks' delayed HostAdamW update lands at the next update's first mini-batch instead, after the values and the
    critic's update: one and two ranks still train the same step-3 actor."""
    on_policy = [*OPTIMIZER_OFFLOAD, "actor_rollout_ref.actor.fsdp_config.delayed_update=true", "trainer.save_freq=3",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    for ranks, name in ((1, "one"), (2, "two")):
        finished = launch(ranks, tmp_path, name, *on_policy)
        assert finished.returncode == 0, finished.stderr[-4000:]
        assert "old_log_prob: not scored in a pass of its own" in finished.stdout + finished.stderr
    one, two = (actor_weights(tmp_path / run / "checkpoints" / "global_step_3") for run in ("one", "two"))
    assert largest_difference(one, two) < HOST_ADAMW_TOLERANCE


@pytest.mark.slow
def test_the_critics_host_update_on_two_ranks_runs_beside_the_actors_and_trains_the_weights_of_one_ranks(tmp_path):
    """PPO whose critic keeps AdamW on the host (optimizer_offload, bf16): on two ranks its HostAdamW computes the
    update in a thread of its own while the actor updates, and the next step's values apply it first, as one rank's
    engine runs the critic's host update in its worker. Exact: one and two ranks train the same step-3 critic."""
    critic = [*PPO, "trainer.total_training_steps=3", "trainer.save_freq=3",
              "critic.fsdp_config.optimizer_offload=true", "critic.fsdp_config.model_dtype=bf16"]
    for ranks, name in ((1, "one"), (2, "two")):
        finished = launch(ranks, tmp_path, name, *critic)
        assert finished.returncode == 0, finished.stderr[-4000:]
        if ranks == 2:
            assert "the host computes its update beside the actor's, and the next values apply it first" in \
                finished.stdout + finished.stderr
    one, two = (actor_weights(tmp_path / run / "checkpoints" / "global_step_3", "critic") for run in ("one", "two"))
    assert largest_difference(one, two) < HOST_ADAMW_TOLERANCE


@pytest.fixture(scope="module")
def host_adamw_runs(tmp_path_factory) -> Path:
    """Two ranks, a bf16 actor with optimizer_offload, 3 steps: HostAdamW's update on the host (host), on the GPU over
    streamed moments (device: optimizer_update gpu), split between them (split: both), and on the host from bf16
    gradient shards (bf16: offload_grad_dtype). Each run's output is in <run>/output.txt."""
    root = tmp_path_factory.mktemp("host_adamw")
    for name, setting in (("host", "optimizer_update=cpu"), ("device", "optimizer_update=gpu"),
                          ("split", "optimizer_update=both"), ("bf16", "offload_grad_dtype=bf16")):
        finished = launch(2, root, name, *OPTIMIZER_OFFLOAD, "trainer.save_freq=3",
                          f"actor_rollout_ref.actor.fsdp_config.{setting}")
        assert finished.returncode == 0, finished.stderr[-4000:]
        (root / name / "output.txt").write_text(finished.stdout + finished.stderr)
    return root


@pytest.mark.slow
def test_the_update_on_the_gpu_over_streamed_moments_on_two_ranks_trains_the_weights_of_the_hosts(host_adamw_runs):
    """optimizer_update gpu and both with optimizer_offload on two ranks (refused there before): HostAdamW updates
    each shard where it is, over AdamW's moments streamed up from the host and back (on CPU ranks, in place), or splits
    each step's parameters between that and the host's arithmetic, and trains the same step-3 actor as the host's
    update (optimizer_update cpu)."""
    said = {name: "the update runs on the device over the moments streamed up and back"
            in (host_adamw_runs / name / "output.txt").read_text() for name in ("device", "split", "host")}
    assert said == {"device": True, "split": False, "host": False}
    assert "each step splits the update between the host's arithmetic and the device's" in \
        (host_adamw_runs / "split" / "output.txt").read_text()
    device, split, host = (actor_weights(host_adamw_runs / run / "checkpoints" / "global_step_3")
                           for run in ("device", "split", "host"))
    assert largest_difference(device, host) < HOST_ADAMW_TOLERANCE
    assert largest_difference(split, host) < HOST_ADAMW_TOLERANCE


@pytest.mark.slow
def test_bf16_host_gradients_on_two_ranks_train_with_the_gradient_shards_down_in_bf16(host_adamw_runs):
    """offload_grad_dtype bf16 with optimizer_offload on two ranks (refused there before): each gradient shard,
    accumulated and reduced in fp32 on the device, goes down to HostAdamW in bf16 (half the bytes) and AdamW takes the
    gradient rounded to bf16 (test_host_adamw.py holds it to torch's AdamW of the rounded gradient). The run trains,
    and its weights differ from the fp32 gradients' run by that rounding alone (the option takes effect)."""
    said = {name: "the gradient shards go down in bf16 (offload_grad_dtype)"
            in (host_adamw_runs / name / "output.txt").read_text() for name in ("bf16", "host")}
    assert said == {"bf16": True, "host": False}
    bf16, fp32 = (actor_weights(host_adamw_runs / run / "checkpoints" / "global_step_3") for run in ("bf16", "host"))
    assert 0 < largest_difference(bf16, fp32) < 0.01


def test_rank_0_reports_each_ranks_copy_time_to_node_0_so_its_advisor_compares_ranks_across_nodes():
    """Node 0's daemon knows another node's ranks only from rank 0's RanksMessage: each rank's mean copy time goes
    in it (None where a rank timed none), beside its memory."""
    from types import SimpleNamespace

    from trainer.distributed.run_wide import RunWide

    sent = []
    rank_zero = RunWide(SimpleNamespace(is_main=True),
                        SimpleNamespace(trainer=SimpleNamespace(nnodes=2, n_gpus_per_node=1)), sent.append)
    rank_zero._report_ranks([
        ({"perf/max_memory_allocated_gb": 1.0}, {"copy_latency_mean_s": 0.004, "gpu_utilization_percent": 87.0}),
        ({}, {"copy_latency_mean_s": None, "gpu_utilization_percent": None})], step=3)
    (message,) = sent
    assert message.step == 3
    assert [(report.rank, report.node_rank, report.copy_latency_mean_s, report.gpu_utilization_percent)
            for report in message.ranks] == [(0, 0, 0.004, 87.0), (1, 1, None, None)]
    assert message.ranks[0].gpu_memory_bytes == 1 << 30


def test_a_rank_of_a_run_of_several_nodes_reads_its_gpus_utilization_for_rank_0s_report(monkeypatch):
    from types import SimpleNamespace

    from trainer.distributed.run_wide import RunWide

    monkeypatch.setattr(torch.cuda, "utilization", lambda device: 61 if device == torch.device("cuda", 1) else 0)
    rank = RunWide(SimpleNamespace(device=torch.device("cuda", 1)),
                   SimpleNamespace(trainer=SimpleNamespace(nnodes=2)), lambda message: None)
    assert rank._report_figures(0.003) == {"copy_latency_mean_s": 0.003, "gpu_utilization_percent": 61.0}

    def no_nvml(device):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "utilization", no_nvml)
    assert rank._report_figures(0.003)["gpu_utilization_percent"] is None
    rank.config.trainer.nnodes = 1  # one node: node 0's daemon sees every rank itself, nothing is read
    assert rank._report_figures(0.003) == {}


def test_verls_nccl_timeout_is_how_long_the_ranks_collectives_wait(two_gpu_node, tmp_path):
    from datetime import timedelta

    from trainer.config import load_config
    from trainer.distributed.ranks import Ranks

    environ = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    config = load_config(None, ["actor_rollout_ref.nccl_timeout=1800", "trainer.n_gpus_per_node=2"])
    with pytest.raises(_JoinedTheGroup) as joined:
        Ranks.from_environment("cuda", environ, timeout_s=config.actor_rollout_ref.nccl_timeout)
    assert joined.value.args[0]["timeout"] == timedelta(seconds=1800)
    assert load_config(None, []).actor_rollout_ref.nccl_timeout == 600  # verl's default


@pytest.mark.slow
def test_a_reward_model_sharded_over_two_ranks_scores_every_response_as_one_rank(tmp_path):
    """The reward model is an FSDP2 model of its own on several ranks; the run-wide scores of each step (each rank
    scores its own share of the responses) are one rank's scores of the whole batch."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from trainer.models import load_tokenizer

    scorer = tmp_path / "reward_model"
    torch.manual_seed(11)
    model = Qwen2ForSequenceClassification(Qwen2Config(
        vocab_size=len(load_tokenizer("builtin:tiny-qwen2")), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0))
    model.save_pretrained(scorer)
    load_tokenizer("builtin:tiny-qwen2").save_pretrained(scorer)
    scored = ["reward_model.enable=true", f"reward_model.model.path={scorer}", "trainer.total_training_steps=2"]
    one, two = (launch(ranks, tmp_path, name, *scored) for ranks, name in ((1, "one"), (2, "two")))
    assert one.returncode == 0, one.stderr[-4000:]
    assert two.returncode == 0, two.stderr[-4000:]
    assert "reward: 2 ranks shard the model with FSDP2" in two.stdout + two.stderr
    for row_one, row_two in zip(metrics(tmp_path / "one"), metrics(tmp_path / "two"), strict=True):
        for key in ("critic/score/mean", "critic/score/max", "critic/score/min"):
            assert row_two[key] == pytest.approx(row_one[key], rel=1e-5, abs=1e-6), key
    # The check can fail: a random scorer gives the responses different scores.
    assert metrics(tmp_path / "one")[0]["critic/score/max"] > metrics(tmp_path / "one")[0]["critic/score/min"]


KILLED_WHILE_SAVING = '''
import os

if os.environ.get("RANK") == "1":  # rank 1 of the group dies once its shards of step 2 are written
    from torch.distributed import checkpoint

    written = checkpoint.save

    def save(state_dict, *, checkpoint_id=None, **options):
        result = written(state_dict, checkpoint_id=checkpoint_id, **options)
        if ".global_step_2.partial" in str(checkpoint_id):
            os.kill(os.getpid(), 9)
        return result

    checkpoint.save = save
'''


@pytest.mark.slow
def test_a_rank_killed_while_the_ranks_write_a_checkpoint_leaves_the_last_complete_one_which_resumes(tmp_path):
    """A sharded save is atomic across ranks: rank 1 killed after writing its shards of step 2 (rank 0's rename not
    done) leaves step 1 as the latest checkpoint and no step 2; the next start clears the partial folder and
    resumes from step 1, here on one rank."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILLED_WHILE_SAVING)
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    steps = ["trainer.total_training_steps=2", "trainer.save_freq=1", f"trainer.runs_dir={tmp_path}",
             "trainer.experiment_name=run"]
    environment = rank_environment()
    environment["PYTHONPATH"] = os.pathsep.join([str(hook), environment["PYTHONPATH"]])
    killed = subprocess.run([*trainer_command(2, config), *RUN, "trainer.n_gpus_per_node=2", *steps],
                            env=environment, capture_output=True, text=True, timeout=300)
    assert killed.returncode != 0, killed.stderr[-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert [path.name for path in sorted(checkpoints.iterdir()) if path.name.startswith("global_step_")] == [
        "global_step_1"]
    assert any(".global_step_2.partial" in path.name for path in checkpoints.iterdir())  # the killed save's
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    resumed = launch(1, tmp_path, "run", *steps[:2])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in (resumed.stdout + resumed.stderr).lower() and "global_step_1" in resumed.stderr
    assert sorted(path.name for path in checkpoints.iterdir() if "global_step" in path.name) == [
        "global_step_1", "global_step_2"]
