"""actor_rollout_ref.model.use_fused_kernels in the RL loop: GRPO with a KL loss (a reference, old log-probs, the
update) trains as the unfused loop does; a model whose head cannot be fused is named in one NOTE line at start and
runs the unfused path."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.test_training import MACHINE_METRICS, TINY
from trainer.config import load_config
from trainer.loop import Trainer

GRPO = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.use_kl_loss=true",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.rollout.temperature=0.8", "trainer.total_training_steps=2"]


def trainer(tmp_path, name: str, *overrides: str, lines: list[str] | None = None) -> Trainer:
    config = load_config(None, [*TINY, *GRPO, f"trainer.runs_dir={tmp_path}", f"trainer.experiment_name={name}",
                                *overrides])
    return Trainer(config, log=(lines.append if lines is not None else lambda *_: None))


def test_a_fused_grpo_run_trains_as_the_unfused_one(tmp_path):
    unfused = trainer(tmp_path, "unfused")  # each run built and trained in turn: a build draws from the global RNG
    unfused.fit()
    lines: list[str] = []
    fused = trainer(tmp_path, "fused", "actor_rollout_ref.model.use_fused_kernels=true", lines=lines)
    assert fused.actor.fused_head and fused.reference is not None and fused.reference.fused_head
    assert not unfused.actor.fused_head and not any("use_fused_kernels" in line for line in lines)
    fused.fit()
    for expected, got in zip(unfused.metrics_log.read(), fused.metrics_log.read(), strict=True):
        for key, value in expected.items():
            if not key.startswith(MACHINE_METRICS):
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    torch.testing.assert_close(fused.actor.model.state_dict(), unfused.actor.model.state_dict(), rtol=1e-4,
                               atol=1e-5)


def test_a_head_whose_logits_the_forward_changes_is_named_in_one_note_and_runs_unfused(tmp_path):
    lines: list[str] = []
    run = trainer(tmp_path, "capped", "actor_rollout_ref.model.use_fused_kernels=true",
                  "actor_rollout_ref.model.override_config={num_hidden_layers: 1, hidden_size: 32, "
                  "intermediate_size: 64, final_logit_softcapping: 30.0}", lines=lines)
    notes = [line for line in lines if "use_fused_kernels" in line]
    assert notes == [
        "NOTE: actor_rollout_ref.model.use_fused_kernels=true: its config's final_logit_softcapping=30.0 changes the "
        "logits after the head; the actor's log-probs come from its logits (the unfused path)",
        "NOTE: actor_rollout_ref.model.use_fused_kernels=true: its config's final_logit_softcapping=30.0 changes the "
        "logits after the head; the reference's log-probs come from its logits (the unfused path)"]
    assert not run.actor.fused_head and run.reference is not None and not run.reference.fused_head
