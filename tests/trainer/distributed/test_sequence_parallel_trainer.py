"""Ulysses sequence parallelism in the real trainer: `python -m torch.distributed.run --nproc-per-node 2 -m trainer`
with `ulysses_sequence_parallel_size: 2` (2 CPU ranks over gloo, one sp group: each rank computes half of every
sequence) against the same run on one rank.

The runs are greedy, as test_ranks.py's, so both sample the same responses; the tiny model's sequences (prompt
and response) are of odd lengths too, so the shards are padded. Each run's log says the models run on sequence
shards, so a silent fall-back to whole sequences cannot pass for Ulysses.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.trainer.distributed.test_ranks import (
    MACHINE_METRICS,
    PPO,
    TOLERANCE,
    actor_weights,
    largest_difference,
    launch,
    metrics,
    rank_environment,
    trainer_command,
)
from trainer.data import counting_records, write_records

SEQUENCE_PARALLEL = "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"
TIE_METRICS = ("critic/vf_clipfrac",)
"""Fractions of exact ties: on the first mini-batch the clipped and unclipped value losses are equal, and which
one the last bit favours depends on how the sums were split, so their fraction is no figure to compare."""


def assert_same_metrics(one: list[dict], two: list[dict]) -> None:
    for row_one, row_two in zip(one, two, strict=True):
        for key, value in row_one.items():
            if not key.startswith(MACHINE_METRICS) and key not in TIE_METRICS and not key.endswith("grad_norm"):
                assert row_two[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
            elif key.endswith("grad_norm"):
                assert row_two[key] == pytest.approx(value, rel=1e-3), key
        assert sorted(row_two) == sorted(row_one)
        if "perf/total_num_tokens" in row_one:  # a training step's line (not validation's step 0)
            # Counts are each sequence's once, not once per rank of the sp group that shares it.
            assert row_two["perf/total_num_tokens"] == row_one["perf/total_num_tokens"]


def ran_on_sequence_shards(finished: subprocess.CompletedProcess, role: str, *, packed: bool = False) -> bool:
    output = finished.stdout + finished.stderr
    split = "each micro-batch's padding-free row" if packed else "every sequence"
    return f"{role}: Ulysses sequence parallelism: each of the 2 ranks of a group computes 1/2 of {split}" in output


@pytest.mark.slow
def test_grpo_with_a_reference_on_two_sequence_parallel_ranks_trains_as_one_rank(tmp_path):
    """The actor's update and log-probs and the reference's log-probs run on sequence shards (the KL loss reads
    the reference's); the parameters are one rank's on the same global batch, and so are the metrics, the
    validation scores included."""
    write_records(counting_records(5, seed=1), tmp_path / "validation.jsonl")
    grpo = ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
            "trainer.total_training_steps=2", f"data.val_files={tmp_path / 'validation.jsonl'}",
            "trainer.test_freq=2", "data.val_batch_size=3"]
    one = launch(1, tmp_path, "one", *grpo)
    assert one.returncode == 0, one.stderr[-4000:]
    two = launch(2, tmp_path, "sp", *grpo, SEQUENCE_PARALLEL)
    assert two.returncode == 0, two.stderr[-4000:]
    assert ran_on_sequence_shards(two, "actor") and ran_on_sequence_shards(two, "ref")
    assert largest_difference(actor_weights(tmp_path / "one" / "checkpoints" / "global_step_2"),
                              actor_weights(tmp_path / "sp" / "checkpoints" / "global_step_2")) < TOLERANCE
    assert_same_metrics(metrics(tmp_path / "one"), metrics(tmp_path / "sp"))
    assert metrics(tmp_path / "one")[1]["actor/kl_loss"] > 0  # the reference's log-probs took part
    # Validated after the last step: the ranks of the sp group decode the same share, scored as one rank's.
    assert any(key.startswith("val-core/") for key in metrics(tmp_path / "sp")[-1])


@pytest.mark.slow
def test_padding_free_ppo_with_a_sequence_parallel_critic_and_verl_s_fsdp_config_key_trains_as_one_padded_rank(
        tmp_path, ppo_one_rank):
    """verl's newer key (actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size) sets the actor's degree,
    the critic's values and update run on sequence shards too, and sequence_parallel_offload keeps the policy's
    embedding and head shards on the CPU. Both models use the padding-free forward, as verl's Ulysses configs do
    (verl runs Ulysses on it only): the packed row of real tokens is what the ranks split. Both models train as
    on one rank with padded sequences."""
    two = launch(2, tmp_path, "sp", *PPO, "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",
                 "critic.ulysses_sequence_parallel_size=2", "actor_rollout_ref.actor.sequence_parallel_offload=true",
                 "actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true")
    assert two.returncode == 0, two.stderr[-4000:]
    assert ran_on_sequence_shards(two, "actor", packed=True) and ran_on_sequence_shards(two, "critic", packed=True)
    assert ("actor: 2 ranks shard the model with FSDP2, a unit per decoder layer and per group; the embedding and "
            "head keep their local shards'") in two.stdout + two.stderr
    for role in ("actor", "critic"):
        one_weights, two_weights = (actor_weights(run / "checkpoints" / "global_step_2", role)
                                    for run in (ppo_one_rank, tmp_path / "sp"))
        assert largest_difference(one_weights, two_weights) < TOLERANCE, role
    # The comparison can fail: two steps move the critic by far more than the tolerance.
    assert largest_difference(actor_weights(ppo_one_rank / "checkpoints" / "global_step_2", "critic"),
                              actor_weights(ppo_one_rank / "checkpoints" / "global_step_1", "critic")
                              ) > 100 * TOLERANCE
    assert_same_metrics(metrics(ppo_one_rank), metrics(tmp_path / "sp"))


def run_config_check(folder: Path, *overrides: str, processes: int = 1) -> subprocess.CompletedProcess:
    """The trainer's start on 2 ranks (trainer.n_gpus_per_node, unless `overrides` set it) with `overrides`, which
    the config check refuses before any model is built (in each of `processes`: torchrun's, or one plain one)."""
    config = folder / "empty.yaml"
    config.write_text("{}\n")
    command = [*trainer_command(processes, config), "trainer.device=cpu", "trainer.n_gpus_per_node=2",
               "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", *overrides]
    return subprocess.run(command, env=rank_environment(), capture_output=True, text=True, timeout=120)


ACTOR_DEGREE = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
VERL_ACTOR_DEGREE = "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"
VERL_CRITIC_DEGREE = "critic.model.fsdp_config.ulysses_sequence_parallel_size"


@pytest.mark.parametrize("overrides, key, says", [
    ([f"{ACTOR_DEGREE}=4"], ACTOR_DEGREE, "got 4, more than the run's 2 rank(s)"),
    (["trainer.n_gpus_per_node=3", "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
      f"{ACTOR_DEGREE}=3"], ACTOR_DEGREE, "got 3, but the model's 4 attention heads do not divide by it; allowed: 1"),
    (["trainer.n_gpus_per_node=4", f"{VERL_ACTOR_DEGREE}=2",
      "actor_rollout_ref.model.override_config={num_attention_heads: 6, num_key_value_heads: 3, hidden_size: 48}"],
     VERL_ACTOR_DEGREE, "got 2, but the model's 3 key-value heads neither divide by it nor divide it"),
    (["trainer.n_gpus_per_node=4", "data.train_batch_size=10", "actor_rollout_ref.actor.ppo_mini_batch_size=5",
      f"{ACTOR_DEGREE}=2"], "data.train_batch_size",
     "got 10, whose 10 sequences (x rollout.n 1) do not divide among the run's 4 ranks"),
    ([f"{VERL_ACTOR_DEGREE}=2", f"{ACTOR_DEGREE}=1"], VERL_ACTOR_DEGREE,
     f"got 2, but {ACTOR_DEGREE} is 1: the two are one setting"),
    (["actor_rollout_ref.actor.sequence_parallel_offload=true"], "actor_rollout_ref.actor.sequence_parallel_offload",
     f"got true, but {ACTOR_DEGREE} is 1"),
    (["trainer.n_gpus_per_node=4", "algorithm.adv_estimator=gae", f"{VERL_CRITIC_DEGREE}=2", f"{ACTOR_DEGREE}=4"],
     VERL_CRITIC_DEGREE, "a run has one sequence-parallel degree"),
    ([SEQUENCE_PARALLEL, "actor_rollout_ref.model.override_config={attn_implementation: flash_attention_2}"],
     "actor_rollout_ref.model.override_config.attn_implementation",
     "got 'flash_attention_2', but actor_rollout_ref.actor.ulysses_sequence_parallel_size is 2: Ulysses' all-to-all "
     "wraps SDPA attention only; allowed: sdpa"),
], ids=["more-than-ranks", "heads", "key-value-heads", "batch-over-dp", "alias-conflict", "offload-without-sp",
        "critic-degree", "attention-not-sdpa"])
def test_a_sequence_parallel_setting_that_cannot_run_is_one_line_and_exit_2(tmp_path, overrides, key, says):
    finished = run_config_check(tmp_path, *overrides)
    assert finished.returncode == 2, finished.stderr[-2000:]
    lines = [line for line in finished.stderr.splitlines() if line.startswith("ERROR")]
    assert len(lines) == 1 and lines[0].startswith(f"ERROR: {key}: "), finished.stderr
    assert says in lines[0]


@pytest.mark.slow
def test_every_rank_refuses_a_degree_above_the_ranks_and_one_line_is_printed(tmp_path):
    finished = run_config_check(tmp_path, f"{ACTOR_DEGREE}=4", processes=2)
    assert finished.returncode != 0
    lines = [line for line in finished.stderr.splitlines() if line.startswith("ERROR")]
    assert len(lines) == 1 and f"{ACTOR_DEGREE}: got 4" in lines[0], finished.stderr


def test_verl_s_fsdp_config_keys_set_each_model_s_degree():
    """verl's newer places: the actor's and the critic's fsdp_config (the critic's under critic.model, as verl
    writes it); the reference's is accepted at the actor's degree, which it runs with."""
    from trainer.config import load_config

    config = load_config(None, ["trainer.n_gpus_per_node=2", "algorithm.adv_estimator=gae",
                                "actor_rollout_ref.actor.use_kl_loss=true", f"{VERL_ACTOR_DEGREE}=2",
                                f"{VERL_CRITIC_DEGREE}=2",
                                "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size=2"])
    assert config.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2
    assert config.critic.ulysses_sequence_parallel_size == 2
    assert config.sequence_parallel_size == 2
    one_model = load_config(None, ["trainer.n_gpus_per_node=2", f"{VERL_ACTOR_DEGREE}=2"])
    assert one_model.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2
    assert one_model.critic.ulysses_sequence_parallel_size == 1  # GRPO: no critic, whatever its degree


def test_the_reference_s_degree_other_than_the_actor_s_is_one_line():
    from trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError) as caught:
        load_config(None, ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.use_kl_loss=true",
                           f"{VERL_ACTOR_DEGREE}=2", "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1"])
    assert [str(problem) for problem in caught.value.problems] == [
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size: got 1, but the reference runs with the actor's "
        f"sequence-parallel degree, {ACTOR_DEGREE}: 2; allowed: that degree, or leave the key out"]
