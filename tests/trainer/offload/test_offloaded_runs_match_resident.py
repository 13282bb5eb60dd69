"""Offloaded and resident GRPO runs on the CPU give the same metrics to the bit (issue 39's claim), micro-batch by
micro-batch: the engine's gradient accumulation (streamed layers, the embedding's rows, the head's chunks) adds as
autograd does. fsdp_config.merge_micro_batches, which runs a streamed update's mini-batch as one micro-batch (the
same gradient, summed in another order), merges only where layers move to a GPU, so it leaves CPU runs alone."""

from __future__ import annotations

import pytest

from trainer.config import load_config
from trainer.loop import Trainer

# benchmarks/real_model.py's quick run (builtin:tiny-qwen2 on counting), GRPO with the KL loss.
QUICK = ["data.train_files=[builtin:counting]", "data.train_batch_size=2", "data.max_prompt_length=8",
         "data.max_response_length=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
         "actor_rollout_ref.actor.optim.lr=1e-3", "trainer.total_training_steps=2", "trainer.device=cpu",
         "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true", "trainer.val_before_train=false",
         "trainer.save_freq=-1", "trainer.test_freq=-1"]
ACTOR = "actor_rollout_ref.actor"
KEYS = ("actor/grad_norm", "actor/kl_loss", "actor/pg_loss", "actor/entropy")


def metrics(tmp_path_factory, micro_batch: int, *overrides: str) -> list[tuple[float, ...]]:
    """Each step's actor metrics of a run with micro-batches of `micro_batch` sequences (4 sequences a step)."""
    runs = tmp_path_factory.mktemp("run")
    trainer = Trainer(load_config(None, [*QUICK, f"{ACTOR}.ppo_micro_batch_size_per_gpu={micro_batch}", *overrides,
                                         f"trainer.runs_dir={runs}"]), log=lambda *_: None)
    trainer.fit()
    return [tuple(row[key] for key in KEYS) for row in trainer.metrics_log.read()]


@pytest.fixture(scope="module")
def resident(tmp_path_factory):
    """The resident run in four micro-batches of one sequence, and in one of four."""
    return {size: metrics(tmp_path_factory, size) for size in (1, 4)}


def test_the_resident_runs_tell_the_micro_batchings_apart(resident):
    """The comparisons below can fail: the order of a gradient's sums shows in step 2's metrics."""
    assert resident[1][1] != resident[4][1]


def test_an_offloaded_run_in_micro_batches_of_one_is_the_resident_run_to_the_bit(tmp_path_factory, resident):
    """Every group on the CPU, four micro-batches of one sequence whose gradients the engine adds on the host
    (streamed layers, the embedding's rows, the head's chunks): the resident run's metrics, not one ulp away."""
    run = metrics(tmp_path_factory, 1, f"{ACTOR}.fsdp_config.param_offload=true",
                  f"{ACTOR}.fsdp_config.merge_micro_batches=false")
    assert run == resident[1]
    assert run[0][0] > 0 and run[1][1] > 0  # a gradient at step 1, and a KL to the reference at step 2


def test_by_default_an_offloaded_cpu_run_is_the_resident_run_to_the_bit(tmp_path_factory, resident):
    """merge_micro_batches (on by default) merges only where layers really move to a device: on a CPU device the
    offloaded run keeps the configured micro-batches, so its metrics are the resident run's, not one ulp away (before,
    it merged them and summed the gradient in another order: a 3.7e-8 gap in step 2's kl_loss)."""
    run = metrics(tmp_path_factory, 1, f"{ACTOR}.fsdp_config.param_offload=true")
    assert run == resident[1]
    assert run != resident[4]
