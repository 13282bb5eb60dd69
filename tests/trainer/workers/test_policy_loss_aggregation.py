"""A policy loss that averages its own way (GSPO per sequence) beside a token-mean entropy bonus: the update's
gradient is the mini-batch's whatever its micro-batches, each loss weighed by its own aggregation's share."""

import pytest
import torch

from trainer.config import ActorConfig
from trainer.data import PromptRecord
from trainer.models import load_policy, load_tokenizer
from trainer.rollout.batch import RolloutBatch
from trainer.workers.actor import Actor
from trainer.workers.optimization import accumulate_gradients


def responses_of_three_lengths(vocabulary: int) -> RolloutBatch:
    generator = torch.Generator().manual_seed(0)
    return RolloutBatch(prompt_ids=torch.randint(3, vocabulary, (3, 3), generator=generator),
                        prompt_mask=torch.ones(3, 3, dtype=torch.long),
                        response_ids=torch.randint(3, vocabulary, (3, 4), generator=generator),
                        response_mask=torch.tensor([[1.0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]),
                        group_index=torch.arange(3), records=[PromptRecord(prompt="p", data_source="test")] * 3)


def gradient(actor: Actor, batch: RolloutBatch, micro_batch_size: int) -> list[torch.Tensor]:
    actor.optimizer.zero_grad(set_to_none=True)
    accumulate_gradients(actor.model, actor.optimizer, batch, actor._loss, micro_batch_size,
                         loss_agg_mode=actor.config.loss_agg_mode, loss_mask=lambda part: part.training_mask)
    return [parameter.grad.clone() for parameter in actor.model.parameters() if parameter.grad is not None]


@pytest.mark.parametrize("loss_mode", ["gspo", "geo_mean", "vanilla"])
def test_micro_batches_give_the_mini_batchs_gradient_whatever_the_policy_losss_aggregation(loss_mode):
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    model = load_policy("builtin:tiny-qwen2", tokenizer, dtype=torch.float64, seed=1,
                        override_config={"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64})
    config = ActorConfig.model_validate({"ppo_mini_batch_size": 3, "entropy_coeff": 0.1, "loss_agg_mode": "token-mean",
                                         "clip_ratio": 0.5, "policy_loss": {"loss_mode": loss_mode}})
    actor = Actor(model, config, temperature=1.0, rollout_n=1, log_prob_micro_batch_size=3, total_steps=1, seed=1)
    batch = responses_of_three_lengths(len(tokenizer))
    batch.old_log_probs = actor.compute_log_probs(batch) + 0.05
    batch.advantages = torch.tensor([[1.0], [-0.5], [2.0]], dtype=torch.float64).expand(3, 4) * batch.response_mask
    whole = gradient(actor, batch, micro_batch_size=3)
    for split, together in zip(gradient(actor, batch, micro_batch_size=1), whole, strict=True):
        torch.testing.assert_close(split, together)
