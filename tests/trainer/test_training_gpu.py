"""The same loop on a CUDA GPU, in bf16: it runs, reports GPU memory, and resumes exactly."""

from __future__ import annotations

import pytest
import torch

from trainer.config import load_config
from trainer.loop import Trainer

pytestmark = pytest.mark.gpu

CUDA_BF16 = ["trainer.device=cuda", "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
             "critic.fsdp_config.model_dtype=bf16", "data.train_batch_size=32",
             "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
             "actor_rollout_ref.model.enable_gradient_checkpointing=true"]


def cuda_trainer(tmp_path, *overrides: str) -> Trainer:
    config = load_config("examples/quickstart.yaml", [*CUDA_BF16, f"trainer.runs_dir={tmp_path}", *overrides])
    return Trainer(config, log=lambda *_: None)


def test_ppo_runs_on_the_gpu_in_bf16_and_reports_its_memory(tmp_path):
    trainer = cuda_trainer(tmp_path, "trainer.total_training_steps=3")
    assert next(trainer.actor.model.parameters()).device.type == "cuda"
    assert next(trainer.actor.model.parameters()).dtype == torch.bfloat16
    trainer.fit()
    rows = trainer.metrics_log.read()
    assert len(rows) == 3
    assert all(row["perf/max_memory_allocated_gb"] > 0 for row in rows)
    assert all(row["actor/grad_norm"] is not None for row in rows)


def test_resume_on_the_gpu_restores_the_cuda_sampling_state(tmp_path):
    straight = cuda_trainer(tmp_path, "trainer.total_training_steps=4", "trainer.experiment_name=straight",
                            "trainer.save_freq=2")
    straight.fit()
    cuda_trainer(tmp_path, "trainer.total_training_steps=2", "trainer.experiment_name=resumed").fit()
    resumed = cuda_trainer(tmp_path, "trainer.total_training_steps=4", "trainer.experiment_name=resumed")
    resumed.fit()
    scores = [[row["critic/score/mean"] for row in trainer.metrics_log.read()] for trainer in (straight, resumed)]
    assert scores[0] == scores[1]
