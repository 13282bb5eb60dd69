"""Length of a run and the learning-rate schedule: exact values per training step.

The schedule (trainer.workers.optimization.build_scheduler) is stepped once per training step, and
the LR of step i (0-based) is lr * factor(i):
    warm-up, i < W:   (i + 1) / (W + 1)     a linear ramp that never spends a step at LR 0 (verl's
                                            ramp i / W starts at 0, wasting the first update)
    constant, i >= W: 1
    cosine, i >= W:   max(min_lr_ratio, min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(2 pi C (i - W) / (T - W))) / 2)
with C = optim.num_cycles (verl's 0.5: one half wave), W = optim.lr_warmup_steps, or
int(lr_warmup_steps_ratio * T) when that is -1, and T the run's steps.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config import OptimConfig, load_config
from trainer.data.sampler import PromptSampler
from trainer.loop import Trainer, count_total_steps
from trainer.workers.optimization import build_scheduler, warmup_steps

# ----------------------------------------------------------------------------------- length of a run


@pytest.mark.parametrize(("overrides", "steps_per_epoch", "expected"), [
    (["trainer.total_epochs=3"], 5, 15),  # epochs x steps per epoch
    (["trainer.total_epochs=1"], 5, 5),
    (["trainer.total_epochs=3", "trainer.total_training_steps=7"], 5, 7),  # verl: total_training_steps wins,
    (["trainer.total_epochs=1", "trainer.total_training_steps=12"], 5, 12),  # fewer or more than the epochs'
])
def test_count_total_steps(overrides: list[str], steps_per_epoch: int, expected: int) -> None:
    assert count_total_steps(load_config(None, overrides), steps_per_epoch) == expected


def test_an_epoch_is_the_whole_batches_of_prompts() -> None:
    # 10 prompts in batches of 4: two whole batches per epoch (the last 2 prompts wait for the next epoch).
    sampler = PromptSampler(num_records=10, batch_size=4, shuffle=False)
    assert sampler.steps_per_epoch == 2
    assert count_total_steps(load_config(None, ["trainer.total_epochs=3"]), sampler.steps_per_epoch) == 6


TINY_RUN = [
    "actor_rollout_ref.model.override_config={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}",
    "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_prompt_length=8",
    "data.max_response_length=4", "trainer.device=cpu", "trainer.save_freq=-1",
    "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
]


def test_the_trainer_runs_epochs_times_its_steps_per_epoch_unless_told_a_step_count(tmp_path) -> None:
    by_epochs = Trainer(load_config(None, [*TINY_RUN, "trainer.total_epochs=2", f"trainer.runs_dir={tmp_path}",
                                           "trainer.experiment_name=epochs"]), log=lambda *_: None)
    assert by_epochs.sampler.steps_per_epoch == len(by_epochs.records) // 8
    assert by_epochs.total_steps == 2 * by_epochs.sampler.steps_per_epoch
    by_steps = Trainer(load_config(None, [*TINY_RUN, "trainer.total_epochs=2", "trainer.total_training_steps=3",
                                          f"trainer.runs_dir={tmp_path}", "trainer.experiment_name=steps"]),
                       log=lambda *_: None)
    assert by_steps.total_steps == 3


# --------------------------------------------------------------------------------------- LR schedule


def learning_rates(config: OptimConfig, total_steps: int, steps: int | None = None) -> list[float]:
    """The LR of each training step, as the optimizer applies it and as actor/lr reports it."""
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([parameter], lr=config.lr)
    scheduler = build_scheduler(optimizer, config, total_steps)
    rates = []
    for _ in range(total_steps if steps is None else steps):
        assert optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0]
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return rates


def test_linear_warm_up_then_constant() -> None:
    config = OptimConfig(lr=0.4, lr_warmup_steps=3, lr_scheduler_type="constant")
    # (i + 1) / 4 of 0.4 for i < 3, then 0.4
    assert learning_rates(config, total_steps=6) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4])


def test_no_warm_up_starts_at_the_peak() -> None:
    assert learning_rates(OptimConfig(lr=0.4), total_steps=3) == pytest.approx([0.4, 0.4, 0.4])


def test_linear_warm_up_then_cosine_to_the_floor() -> None:
    config = OptimConfig(lr=1.0, lr_warmup_steps=2, lr_scheduler_type="cosine", min_lr_ratio=0.1)
    # warm-up 1/3, 2/3; then progress (i - 2) / 4 = 0, 1/4, 1/2, 3/4:
    # 0.1 + 0.9 * (1 + cos(pi * p)) / 2 = 1, 0.1 + 0.9 * 0.85355, 0.1 + 0.9 * 0.5, 0.1 + 0.9 * 0.14645
    half_cos = [(1 + math.cos(math.pi * progress)) / 2 for progress in (0, 0.25, 0.5, 0.75)]
    assert learning_rates(config, total_steps=6) == pytest.approx(
        [1 / 3, 2 / 3, *(0.1 + 0.9 * value for value in half_cos)])
    assert learning_rates(config, total_steps=6)[3:] == pytest.approx([0.868198, 0.55, 0.231802], abs=1e-6)


def test_verls_older_name_warmup_style_sets_the_schedule_too() -> None:
    assert learning_rates(OptimConfig(lr=1.0, warmup_style="cosine"), total_steps=4) == pytest.approx(
        learning_rates(OptimConfig(lr=1.0, lr_scheduler_type="cosine"), total_steps=4))
    assert learning_rates(OptimConfig(lr=1.0, warmup_style="cosine"), total_steps=4)[1] < 1.0


def test_num_cycles_of_a_full_wave_decays_to_the_floor_and_comes_back() -> None:
    config = OptimConfig(lr=1.0, lr_scheduler_type="cosine", num_cycles=1.0, min_lr_ratio=0.0)
    # progress i / 4: (1 + cos(2 pi i / 4)) / 2 = 1, 0.5, 0, 0.5 (verl's get_cosine_schedule_with_warmup)
    assert learning_rates(config, total_steps=4) == pytest.approx([1.0, 0.5, 0.0, 0.5], abs=1e-9)


def test_cosine_never_goes_below_the_floor_past_the_planned_steps() -> None:
    config = OptimConfig(lr=1.0, lr_scheduler_type="cosine", min_lr_ratio=0.2)
    assert learning_rates(config, total_steps=4, steps=7)[4:] == pytest.approx([0.2, 0.2, 0.2])


@pytest.mark.parametrize(("ratio", "total_steps", "expected"), [
    (0.25, 8, 2),
    (0.3, 10, 3),
    (0.29, 100, 29),  # 0.29 * 100 is 28.999999999999996 in floating point
    (0.7, 10, 7),  # and 0.7 * 10 is 7.000000000000001
    (0.5, 5, 2),  # a fraction of a step is not taken
])
def test_warm_up_from_a_ratio_of_the_run(ratio: float, total_steps: int, expected: int) -> None:
    config = OptimConfig(lr=1.0, lr_warmup_steps=-1, lr_warmup_steps_ratio=ratio)
    assert warmup_steps(config, total_steps) == expected
    rates = learning_rates(config, total_steps)
    assert rates[:expected + 1] == pytest.approx([(step + 1) / (expected + 1) for step in range(expected)] + [1.0])


def test_explicit_warm_up_steps_win_over_the_ratio() -> None:
    config = OptimConfig(lr=1.0, lr_warmup_steps=1, lr_warmup_steps_ratio=0.5)
    assert warmup_steps(config, 10) == 1
    assert learning_rates(config, total_steps=3) == pytest.approx([0.5, 1.0, 1.0])


def test_the_schedule_continues_after_a_resume() -> None:
    """A checkpoint holds the optimizer's and the scheduler's state (Actor.state_dict): restored in that
    order into fresh ones, the schedule goes on where it stopped."""
    config = OptimConfig(lr=1.0, lr_warmup_steps=2, lr_scheduler_type="cosine", min_lr_ratio=0.1)
    straight = learning_rates(config, total_steps=6)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
    scheduler = build_scheduler(optimizer, config, 6)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    saved = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    resumed_optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
    resumed = build_scheduler(resumed_optimizer, config, 6)
    resumed_optimizer.load_state_dict(saved["optimizer"])
    resumed.load_state_dict(saved["scheduler"])
    rates = []
    for _ in range(3):
        assert resumed_optimizer.param_groups[0]["lr"] == resumed.get_last_lr()[0]
        rates.append(resumed.get_last_lr()[0])
        resumed_optimizer.step()
        resumed.step()
    assert rates == pytest.approx(straight[3:])


def test_the_actor_reports_the_lr_of_each_step(tmp_path) -> None:
    trainer = Trainer(load_config(None, [*TINY_RUN, "trainer.total_training_steps=3", f"trainer.runs_dir={tmp_path}",
                                         "actor_rollout_ref.actor.optim.lr=0.03",
                                         "actor_rollout_ref.actor.optim.lr_warmup_steps=2"]), log=lambda *_: None)
    trainer.fit()
    assert [row["actor/lr"] for row in trainer.metrics_log.read()] == pytest.approx([0.01, 0.02, 0.03])
