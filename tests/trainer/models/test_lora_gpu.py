"""LoRA on a CUDA GPU in bf16: streamed from pinned host memory, the adapter trains as when the model stays on the
GPU, and the frozen base is never written."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.models.test_lora import LORA, computed_metrics, split_parameters
from trainer.config import load_config
from trainer.loop import Trainer

pytestmark = pytest.mark.gpu

CUDA_LORA = ["trainer.device=cuda", "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.optim.lr=1e-3",
             "actor_rollout_ref.model.enable_gradient_checkpointing=true", *LORA, "trainer.total_training_steps=3"]
ACTOR = "actor_rollout_ref.actor.fsdp_config"
MASTERS_ON_THE_HOST = [f"{ACTOR}.model_dtype=bf16", f"{ACTOR}.optimizer_offload=true"]
STREAMED = [*MASTERS_ON_THE_HOST, f"{ACTOR}.param_offload=true"]


def cuda_lora_trainer(tmp_path, name: str, *overrides: str) -> Trainer:
    config = load_config("examples/quickstart.yaml", [*CUDA_LORA, f"trainer.runs_dir={tmp_path}",
                                                      f"trainer.experiment_name={name}", *overrides])
    return Trainer(config, log=lambda *_: None)


def test_streamed_lora_trains_the_adapter_as_lora_on_the_gpu(tmp_path):
    # Each trainer is built just before it runs: a Trainer seeds the process's generators when it is built, and
    # the rollout samples from them, so a second one built before the first runs would change what it samples.
    resident = cuda_lora_trainer(tmp_path, "resident", *MASTERS_ON_THE_HOST)
    resident.fit()
    streamed = cuda_lora_trainer(tmp_path, "streamed", *STREAMED)
    assert all(unit.offloaded and unit.placement == "cpu" for unit in streamed.memory.engine("actor").transformer_units)
    frozen, _ = split_parameters(streamed.actor.model)
    streamed.fit()

    after = dict(streamed.actor.model.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in frozen.items())
    expected = resident.actor.model.state_dict()
    for name, value in streamed.actor.model.state_dict().items():
        # (the streamed base lies on the host, the resident one on the GPU)
        torch.testing.assert_close(value.float().cpu(), expected[name].float().cpu(), rtol=1e-2, atol=1e-3,
                                   msg=name)
    for row, expected_row in zip(computed_metrics(streamed), computed_metrics(resident), strict=True):
        assert row["actor/pg_loss"] == pytest.approx(expected_row["actor/pg_loss"], rel=1e-2, abs=1e-3)
    engine = streamed.memory.engine("actor")
    adapter = sum(parameter.numel() for parameter in streamed.actor.model.parameters() if parameter.requires_grad)
    assert engine.host_bytes()["optimizer"] == 2 * 4 * adapter
