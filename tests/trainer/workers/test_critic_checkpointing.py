"""critic.model.enable_gradient_checkpointing reaches the critic the trainer builds, and its update then recomputes
each layer in the backward as the actor's does: what kept long3b's critic update (one 4112-token sequence of a 3B) at
about 1 GiB of activations instead of about 19 GiB (benchmarks/results/e2e-long3b-h100-2026-12-07T1913.json ran out of
memory there)."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.test_training import make_trainer


def grad_forwards(layer: torch.nn.Module) -> list[int]:
    """Counts, per call, the forwards of `layer` that build a graph (an update's forward, or its recompute in the
    backward); the values' and log-probs' passes run without one. (transformers checkpoints a layer's `forward`, so
    the layer's own hooks run once; its first norm's run again in the recompute.)"""
    calls: list[int] = []
    layer.input_layernorm.register_forward_pre_hook(lambda module, args: calls.append(1) if torch.is_grad_enabled()
                                                    else None)
    return calls


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_critics_update_recomputes_its_layers_when_checkpointing_as_the_actors_does(tmp_path, checkpointing):
    flag = str(checkpointing).lower()
    # 8 sequences, mini-batches of 4 in micro-batches of 2, one epoch: 4 micro-batches a step for each model.
    trainer = make_trainer(tmp_path, f"critic.model.enable_gradient_checkpointing={flag}",
                           f"actor_rollout_ref.model.enable_gradient_checkpointing={flag}",
                           "critic.ppo_micro_batch_size_per_gpu=2", "critic.ppo_mini_batch_size=4",
                           "trainer.total_training_steps=1", "trainer.save_freq=-1")
    critic, actor = trainer.critic.model, trainer.actor.model
    assert critic.is_gradient_checkpointing == checkpointing == actor.is_gradient_checkpointing
    critic_calls = grad_forwards(critic.model.layers[0])
    actor_calls = grad_forwards(actor.model.layers[0])
    trainer.fit()
    # Each micro-batch's forward, and with checkpointing its recompute in the backward.
    assert len(critic_calls) == 4 * (2 if checkpointing else 1)
    assert len(actor_calls) == len(critic_calls)
