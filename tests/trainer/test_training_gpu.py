"""The same loop on a CUDA GPU, in bf16: it runs, reports GPU memory, and resumes exactly."""

from __future__ import annotations

import pytest
import torch

from trainer.config import load_config
from trainer.loop import Trainer
from trainer.metrics import device_peak_flops

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


class TightBudget:
    """The device memory probe of a run whose budget the test sets once the models are built: the bytes this
    process's tensors hold, of `total` (all of the device until then)."""

    def __init__(self):
        self.total = torch.cuda.get_device_properties(0).total_memory

    def __call__(self) -> tuple[int, int]:
        return torch.cuda.memory_allocated(), self.total


MASTERS_ON_THE_HOST = ["model_dtype=bf16", "optimizer_offload=true", "offload_grad_dtype=bf16"]
OFFLOADED = [*MASTERS_ON_THE_HOST, "offload_policy={embedding: cpu, lm_head: cpu}", "dynamic_offload.enabled=true"]


def test_offloaded_steps_give_the_resident_losses_with_layers_streamed_and_planned_per_phase(tmp_path):
    """Issue 14: whole steps of the trainer, offloaded (AdamW and the masters on the CPU, the embedding and head
    streamed, layers planned per phase under a budget that cannot hold every layer) against the same models
    resident on the GPU with their fp32 masters on the host, on the same data and seed: the same losses and
    values within bf16 noise after several steps, whichever path (host or device) runs the update.

    The reference keeps fp32 masters because a bf16 model updated in place does not train the same: an update
    of 1e-5 is below bf16's resolution for most weights, which then do not move (on an H200, 2026-12-02, the
    offloaded runs' fourth pg_loss was 0.0090 against 0.0197 for the all-bf16 run, while the host and device
    updates agreed to 1e-4)."""
    steps = ["trainer.total_training_steps=4", "dynamic_offload.min_transformer_layers_on_gpu=0",
             "actor_rollout_ref.actor.optim.lr=1e-5", "critic.optim.lr=1e-5"]
    roles = ("actor_rollout_ref.actor", "critic")
    masters = [f"{role}.fsdp_config.{setting}" for role in roles for setting in MASTERS_ON_THE_HOST]
    resident = cuda_trainer(tmp_path, *steps, *masters, "trainer.experiment_name=resident")
    resident.fit()
    expected = resident.metrics_log.read()
    for update in ("cpu", "gpu"):
        budget = TightBudget()
        overrides = [f"{role}.fsdp_config.{setting}" for role in roles
                     for setting in (*OFFLOADED, f"optimizer_update={update}")]
        config = load_config("examples/quickstart.yaml", [*CUDA_BF16, f"trainer.runs_dir={tmp_path}", *steps,
                                                          *overrides, f"trainer.experiment_name=offloaded-{update}"])
        offloaded = Trainer(config, log=lambda *_: None, memory_probe=budget)
        layer_bytes = sum(engine.layer_bytes for engine in offloaded.memory.dynamic_engines)
        # Room for about three layers besides what is held now: the phases take turns with them.
        budget.total = int((torch.cuda.memory_allocated() + 3 * layer_bytes) / 0.9)
        offloaded.fit()
        rows = offloaded.metrics_log.read()
        total_layers = sum(len(engine.transformer_units) for engine in offloaded.memory.dynamic_engines)
        assert all(row["offload/transformer_layers_on_gpu"] < total_layers for row in rows[1:])
        for key in ("actor/pg_loss", "critic/vf_loss", "critic/values/mean", "critic/score/mean"):
            assert [row[key] for row in rows] == pytest.approx([row[key] for row in expected], rel=2e-2,
                                                               abs=2e-3), (update, key)
        del offloaded
        torch.cuda.empty_cache()


def test_the_mfu_figures_of_a_gpu_run_are_fractions_of_the_devices_peak(tmp_path):
    name = torch.cuda.get_device_name()
    if device_peak_flops(torch.device("cuda")) is None:
        pytest.skip(f"no bf16 peak known for {name}: the run leaves its MFU figures out")
    trainer = cuda_trainer(tmp_path, "trainer.total_training_steps=2")
    trainer.fit()
    for row in trainer.metrics_log.read():
        for key in ("perf/mfu/actor", "perf/mfu/actor_infer", "perf/mfu/critic"):
            assert 0 < row[key] < 1, (name, key, row[key])
