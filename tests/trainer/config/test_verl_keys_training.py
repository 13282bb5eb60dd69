"""verl's keys in a real run on the CPU, with a tiny random-init model: validation before training, critic
warm-up, over-long prompts filtered at load, verl's checkpoint folder and per-model retention, the rollout's
memory budget (gpu_memory_utilization) and the LR schedule as the run applies it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import list_checkpoints
from trainer.config import load_config
from trainer.loop import Trainer
from trainer.rollout.budget import KVCacheShape, rows_within_budget
from trainer.rollout.prompts import PromptTooLong

ARO = "actor_rollout_ref"
TINY = [
    f"{ARO}.model.override_config={{num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}}",
    "data.train_batch_size=4", f"{ARO}.actor.ppo_mini_batch_size=4", f"{ARO}.actor.ppo_micro_batch_size_per_gpu=4",
    "data.max_prompt_length=8", "data.max_response_length=4", "trainer.device=cpu", "trainer.save_freq=-1",
    "trainer.total_training_steps=1",
]
GRPO = ["algorithm.adv_estimator=grpo", f"{ARO}.rollout.n=2"]


def trainer_of(tmp_path: Path, *overrides: str, logs: list[str] | None = None) -> Trainer:
    config = load_config(None, [*TINY, f"trainer.runs_dir={tmp_path / 'runs'}", *overrides])
    return Trainer(config, log=(logs.append if logs is not None else lambda *_: None), warn=lambda *_: None)


def test_validation_before_training_is_step_0s_line(tmp_path: Path) -> None:
    trainer = trainer_of(tmp_path, *GRPO, "data.val_files=[builtin:counting]", "data.val_batch_size=null")
    trainer.fit()
    rows = trainer.metrics_log.read()
    assert [row["step"] for row in rows] == [0, 1]
    assert "val-core/counting/reward/mean@1" in rows[0] and rows[0]["timing_s/testing"] > 0
    assert not any(key.startswith("actor/") for key in rows[0]), "no training at step 0"


def test_no_validation_before_training_when_told_and_val_only_stops_after_it(tmp_path: Path) -> None:
    quiet = trainer_of(tmp_path, *GRPO, "data.val_files=[builtin:counting]", "trainer.val_before_train=false",
                       "trainer.experiment_name=quiet")
    quiet.fit()
    assert [row["step"] for row in quiet.metrics_log.read()] == [1]
    only = trainer_of(tmp_path, *GRPO, "data.val_files=[builtin:counting]", "trainer.val_only=true",
                      "trainer.experiment_name=only")
    only.fit()
    assert [row["step"] for row in only.metrics_log.read()] == [0] and only.step == 0
    assert list_checkpoints(only.checkpointer.directory) == [], "nothing trained, nothing saved"


def test_critic_warmup_updates_only_the_critic_for_its_steps(tmp_path: Path) -> None:
    trainer = trainer_of(tmp_path, "trainer.critic_warmup=1", "trainer.total_training_steps=2")
    actor_before = {name: tensor.clone() for name, tensor in trainer.actor.model.state_dict().items()}
    critic_before = {name: tensor.clone() for name, tensor in trainer.critic.model.state_dict().items()}
    trainer.train_step([trainer.records[index] for index in trainer.sampler.next_batch()])
    trainer.step += 1
    assert all(torch.equal(actor_before[name], tensor) for name, tensor in trainer.actor.model.state_dict().items())
    assert not all(torch.equal(critic_before[name], tensor)
                   for name, tensor in trainer.critic.model.state_dict().items())
    metrics = trainer.train_step([trainer.records[index] for index in trainer.sampler.next_batch()])
    assert "actor/pg_loss" in metrics and "critic/vf_loss" in metrics, "the actor trains from step 2 on"
    assert not all(torch.equal(actor_before[name], tensor)
                   for name, tensor in trainer.actor.model.state_dict().items())


def write_prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"data_source": "counting", "prompt": prompt,
                                        "reward_model": {"style": "rule", "ground_truth": "1 2 3 4"}}) + "\n"
                            for prompt in prompts), encoding="utf-8")
    return path


def test_overlong_prompts_are_dropped_at_load_and_counted(tmp_path: Path) -> None:
    short, long = "1 2 3", " ".join(["1"] * 20)
    data = write_prompts(tmp_path / "train.jsonl", [short, long, short, short, long, short])
    with pytest.raises(PromptTooLong, match="more than data.max_prompt_length=8"):  # verl's default: no filter
        trainer_of(tmp_path, *GRPO, f"data.train_files={data}")
    logs: list[str] = []
    trainer = trainer_of(tmp_path, *GRPO, f"data.train_files={data}", "data.filter_overlong_prompts=true", logs=logs)
    assert [record.prompt for record in trainer.records] == [short] * 4
    assert ("data.filter_overlong_prompts: dropped 2 of 6 prompts of data.train_files longer than "
            "data.max_prompt_length=8 tokens") in logs


def test_checkpoints_go_to_default_local_dir_and_keep_the_larger_per_model_count(tmp_path: Path) -> None:
    folder = tmp_path / "verl_checkpoints"
    overrides = [f"trainer.default_local_dir={folder}", "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=1",
                 "trainer.max_critic_ckpt_to_keep=2"]
    trainer = trainer_of(tmp_path, *overrides, "trainer.total_training_steps=3")
    trainer.fit()
    assert [step for step, _ in list_checkpoints(folder)] == [2, 3], "the critic's 2 win: one checkpoint holds both"
    assert not (trainer.run_dir / "checkpoints").exists(), "default_local_dir wins over the run's own folder"
    assert (trainer.run_dir / "metrics.jsonl").is_file(), "the rest of the run stays in its run directory"
    resumed = trainer_of(tmp_path, *overrides, "trainer.total_training_steps=4")
    resumed.resume()
    assert resumed.step == 3


def test_gpu_memory_utilization_decodes_the_batch_in_pieces_that_fit(tmp_path: Path) -> None:
    trainer = trainer_of(tmp_path, *GRPO, f"{ARO}.rollout.gpu_memory_utilization=0.5")
    per_row = KVCacheShape.of(trainer.actor.model.config).bytes_per_sequence(3 + 4, element_bytes=4)
    in_use = 10_000
    capacity = 2 * (in_use + 3 * per_row + per_row // 2)  # half of it: what is in use and 3.5 rows
    trainer.memory.probe = lambda: (in_use, capacity)  # a GPU's reading, on the CPU
    sizes: list[int] = []
    sample = trainer.rollout.sample
    trainer.rollout.sample = lambda ids, mask: sizes.append(len(ids)) or sample(ids, mask)
    # 8 sequences of 3 prompt tokens
    batch = trainer.generation.generate([trainer.records[index] for index in range(4)])
    assert batch.prompt_ids.shape[1] == 3
    assert sizes == [3, 3, 2]
    assert len(batch) == 8 and batch.response_ids.shape == (8, 4)


def test_rows_within_budget_counts_what_is_in_use() -> None:
    assert rows_within_budget(100, utilization=0.5, in_use=200, capacity=1000, bytes_per_row=100) == 3
    assert rows_within_budget(2, utilization=0.5, in_use=200, capacity=1000, bytes_per_row=100) == 2
    assert rows_within_budget(100, utilization=0.2, in_use=300, capacity=1000, bytes_per_row=100) == 0


def test_a_cosine_schedule_is_applied_step_by_step(tmp_path: Path) -> None:
    trainer = trainer_of(tmp_path, *GRPO, f"{ARO}.actor.optim.lr=1e-3", f"{ARO}.actor.optim.lr_scheduler_type=cosine",
                         f"{ARO}.actor.optim.min_lr_ratio=0.1", "trainer.total_training_steps=3")
    trainer.fit()
    rates = [row["actor/lr"] for row in trainer.metrics_log.read()]
    # progress 0, 1/3, 2/3 of verl's half cosine from 1e-3 down to 1e-4
    assert rates == pytest.approx([1e-3, 1e-4 + 9e-4 * 0.75, 1e-4 + 9e-4 * 0.25])
