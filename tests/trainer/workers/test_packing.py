"""verl's use_remove_padding and use_dynamic_bsz on the CPU: the padding-free forward gives the padded
forward's log-probs, values and gradients, resident and offloaded; micro-batches by token budget keep to
the budget and give the gradient of fixed micro-batches, with results in the batch's order."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.offload.test_offload import TOKENIZER, policy
from trainer.config import ActorConfig, ConfigError, CriticConfig, FSDPConfig, load_config
from trainer.data import PromptRecord
from trainer.errors import RunSetupError
from trainer.models import load_critic
from trainer.rollout.batch import RolloutBatch
from trainer.workers.actor import Actor, compute_log_probs
from trainer.workers.critic import Critic
from trainer.workers.optimization import accumulate_gradients
from trainer.workers.packing import TokenBudgetError, token_budget_partitions

# Prompts left-padded to 7 and responses right-padded to 9, as the rollout lays them out; responses from
# 11% to 100% of the response length.
PROMPT_LENGTHS = (7, 3, 5, 1, 6, 2)
RESPONSE_LENGTHS = (9, 1, 4, 9, 2, 6)
REAL_TOKENS = [prompt + response for prompt, response in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True)]
BUDGET = 16  # the longest sequence, 16 tokens, fits; the batch's 55 need at least four micro-batches
CRITIC_LAYERS = {"num_hidden_layers": 2}


def ragged_batch(seed: int = 0) -> RolloutBatch:
    generator = torch.Generator().manual_seed(seed)
    rows, prompt_width, response_width = len(PROMPT_LENGTHS), max(PROMPT_LENGTHS), max(RESPONSE_LENGTHS)
    prompt_ids = torch.randint(3, len(TOKENIZER), (rows, prompt_width), generator=generator)
    response_ids = torch.randint(3, len(TOKENIZER), (rows, response_width), generator=generator)
    prompt_mask = torch.zeros(rows, prompt_width, dtype=torch.long)
    response_mask = torch.zeros(rows, response_width)
    for row, (prompt, response) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True)):
        prompt_mask[row, prompt_width - prompt:] = 1
        response_mask[row, :response] = 1
    prompt_ids[prompt_mask == 0] = TOKENIZER.pad_token_id
    response_ids[response_mask == 0] = TOKENIZER.pad_token_id
    batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                         response_mask=response_mask, group_index=torch.arange(rows),
                         records=[PromptRecord(prompt="p", data_source="test")] * rows)
    batch.advantages = torch.randn(rows, response_width, generator=generator) * response_mask
    batch.values = torch.randn(rows, response_width, generator=generator) * response_mask
    batch.returns = torch.randn(rows, response_width, generator=generator) * response_mask
    return batch


class Forwards:
    """Records the input shape and real tokens of every forward of `model`."""

    def __init__(self, model: torch.nn.Module):
        self.shapes: list[tuple[int, ...]] = []
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        self.shapes.append(tuple(kwargs["input_ids"].shape))


def actor_for(model, *, remove_padding: bool = False, memory=None, **config) -> Actor:
    settings = {"ppo_mini_batch_size": 6, "ppo_micro_batch_size_per_gpu": 2, "clip_ratio": 10.0, **config}
    return Actor(model, ActorConfig.model_validate(settings), temperature=0.7, rollout_n=1,
                 log_prob_micro_batch_size=3, total_steps=1, seed=1, memory=memory, remove_padding=remove_padding)


def actor_gradients(actor: Actor, batch: RolloutBatch, micro_batch_size: int,
                    max_token_len: int | None = None) -> dict[str, torch.Tensor]:
    actor.model.zero_grad(set_to_none=True)
    accumulate_gradients(actor.model, actor.optimizer, batch, actor._loss, micro_batch_size,
                         memory=actor.memory, max_token_len=max_token_len, loss_agg_mode=actor.config.loss_agg_mode)
    gradients = {name: parameter.grad.clone() for name, parameter in actor.model.named_parameters()
                 if parameter.grad is not None}
    actor.model.zero_grad(set_to_none=True)
    return gradients


def critic() -> torch.nn.Module:
    return load_critic("builtin:tiny-qwen2", TOKENIZER, dtype=torch.float32, seed=1, override_config=CRITIC_LAYERS)


def critic_for(network, **config) -> Critic:
    settings = {"ppo_mini_batch_size": 6, "ppo_micro_batch_size_per_gpu": 2, "ppo_epochs": 1, **config}
    return Critic(network, CriticConfig.model_validate(settings), rollout_n=1, forward_micro_batch_size=3,
                  total_steps=1)


# ----------------------------------------------------------------------------- padding-free forward


def test_padding_free_log_probs_are_the_padded_ones_from_one_packed_row_per_micro_batch():
    model, batch = policy(), ragged_batch()
    padded = compute_log_probs(model, batch, micro_batch_size=3, temperature=0.7)
    forwards = Forwards(model)
    packed = compute_log_probs(model, batch, micro_batch_size=3, temperature=0.7, remove_padding=True)
    assert packed.shape == padded.shape == batch.response_mask.shape
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    assert forwards.shapes == [(1, sum(REAL_TOKENS[:3])), (1, sum(REAL_TOKENS[3:]))]
    assert not packed[batch.response_mask == 0].any()


def test_padding_free_values_are_the_padded_ones():
    model, batch = critic(), ragged_batch()
    padded = critic_for(model).compute_values(batch)
    forwards = Forwards(model)
    packed = critic_for(model, model={"use_remove_padding": True}).compute_values(batch)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    assert forwards.shapes[0][0] == 1


def test_a_padding_free_update_gives_the_padded_gradients_and_weights():
    batch = ragged_batch()
    padded_actor, packed_actor = actor_for(policy()), actor_for(policy(), remove_padding=True)
    batch.old_log_probs = padded_actor.compute_log_probs(batch) + 0.05 * batch.response_mask
    torch.testing.assert_close(actor_gradients(packed_actor, batch, 2), actor_gradients(padded_actor, batch, 2),
                               rtol=1e-4, atol=1e-6)
    padded_metrics, packed_metrics = padded_actor.update(batch), packed_actor.update(batch)
    for key in ("actor/pg_loss", "actor/entropy", "actor/ppo_kl"):
        assert packed_metrics[key] == pytest.approx(padded_metrics[key], rel=1e-5, abs=1e-6)
    torch.testing.assert_close(dict(packed_actor.model.named_parameters()),
                               dict(padded_actor.model.named_parameters()), rtol=1e-5, atol=1e-6)


def test_a_padding_free_critic_update_gives_the_padded_gradients():
    batch = ragged_batch()
    padded, packed = critic_for(critic()), critic_for(critic(), model={"use_remove_padding": True})

    def gradients(worker: Critic) -> dict[str, torch.Tensor]:
        accumulate_gradients(worker.model, worker.optimizer, batch, worker._loss, 2)
        return {name: parameter.grad for name, parameter in worker.model.named_parameters()}

    torch.testing.assert_close(gradients(packed), gradients(padded), rtol=1e-4, atol=1e-6)


def test_the_critic_has_no_dropout_before_its_value_head_as_in_verl():
    model, batch = critic().train(), ragged_batch()
    first, second = (model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits for _ in range(2))
    assert torch.equal(first, second)


@pytest.mark.parametrize("placement", [{"param_offload": True}, {"param_offload": True, "optimizer_offload": True},
                                       {"offload_policy": {"embedding": "cpu", "lm_head": "cpu"}}])
def test_offloaded_padding_free_scoring_and_update_give_the_resident_numbers(placement):
    """The offload engine streams the same modules for a packed row as for a padded batch, through the
    accumulating path of micro-batches of every size (by token budget here)."""
    from tests.trainer.test_memory import Run

    batch = ragged_batch()
    resident = actor_for(policy(), remove_padding=True, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=BUDGET)
    run = Run()
    model = run.memory.place(policy(), FSDPConfig.model_validate(placement), "actor")
    offloaded = actor_for(model, remove_padding=True, memory=run.memory.for_role("actor"), use_dynamic_bsz=True,
                          ppo_max_token_len_per_gpu=BUDGET)
    expected = resident.compute_log_probs(batch)
    torch.testing.assert_close(offloaded.compute_log_probs(batch), expected, rtol=1e-5, atol=1e-6)
    batch.old_log_probs = expected + 0.05 * batch.response_mask
    resident.update(batch)
    offloaded.update(batch)
    torch.testing.assert_close(dict(offloaded.model.state_dict()), dict(resident.model.state_dict()),
                               rtol=1e-5, atol=1e-6)


def test_a_model_whose_layers_ignore_position_ids_is_refused_naming_the_setting():
    model = policy()
    model.config.layer_types = ["full_attention", "linear_attention", "full_attention", "full_attention"]
    with pytest.raises(RunSetupError, match=r"^actor_rollout_ref.model.use_remove_padding: true, but qwen2 has "
                                            r"linear_attention layers, .*; set actor_rollout_ref.model.use_remove"):
        actor_for(model, remove_padding=True)


# ------------------------------------------------------------------------------ token-budget batches


def test_token_budget_groups_keep_to_the_budget_and_hold_every_sequence_once():
    lengths = [16, 10, 9, 10, 8, 2, 15, 1, 7]
    groups = token_budget_partitions(lengths, 25)
    assert sorted(index for group in groups for index in group) == list(range(len(lengths)))
    assert all(sum(lengths[index] for index in group) <= 25 for group in groups)
    assert len(groups) == 4  # 78 tokens: four is the fewest groups of 25
    # No four groups of 20 hold them (16 and 15 each leave room for 2 + 1 only): one more.
    assert len(token_budget_partitions(lengths, 20)) == 5


def test_token_budget_groups_are_balanced():
    groups = token_budget_partitions([8, 8, 8, 8, 4, 4, 4, 4], 24)
    assert sorted(sum([8, 8, 8, 8, 4, 4, 4, 4][index] for index in group) for group in groups) == [24, 24]


def test_a_sequence_longer_than_the_budget_is_one_line_naming_both():
    with pytest.raises(TokenBudgetError, match="a token budget of 12 is smaller than one sequence of 16 tokens"):
        token_budget_partitions([5, 16, 3], 12)


def test_log_probs_by_token_budget_come_back_in_the_batchs_order():
    model, batch = policy(), ragged_batch()
    fixed = compute_log_probs(model, batch, micro_batch_size=3, temperature=0.7)
    for remove_padding in (False, True):
        forwards = Forwards(model)
        by_budget = compute_log_probs(model, batch, micro_batch_size=3, temperature=0.7, max_token_len=BUDGET,
                                      remove_padding=remove_padding)
        torch.testing.assert_close(by_budget, fixed, rtol=1e-5, atol=1e-5)
        assert len(forwards.shapes) == 4
    assert all(tokens <= BUDGET for tokens, in [shape[1:] for shape in forwards.shapes])


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batches_by_token_budget_give_the_gradient_of_fixed_micro_batches(loss_agg_mode):
    """Micro-batches of different sizes weigh their share of the mini-batch's tokens (or sequences), so every
    split gives the gradient of the whole mini-batch's loss."""
    batch = ragged_batch()
    actor = actor_for(policy(), loss_agg_mode=loss_agg_mode, entropy_coeff=0.01)
    batch.old_log_probs = actor.compute_log_probs(batch) + 0.05 * batch.response_mask
    whole = actor_gradients(actor, batch, 6)
    torch.testing.assert_close(actor_gradients(actor, batch, 2), whole, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(actor_gradients(actor, batch, 6, max_token_len=BUDGET), whole, rtol=1e-4, atol=1e-7)


def test_an_update_by_token_budget_gives_the_weights_of_fixed_micro_batches():
    batch = ragged_batch()
    fixed = actor_for(policy())
    by_budget = actor_for(policy(), use_dynamic_bsz=True, ppo_max_token_len_per_gpu=BUDGET)
    batch.old_log_probs = fixed.compute_log_probs(batch) + 0.05 * batch.response_mask
    forwards = Forwards(by_budget.model)
    fixed_metrics, budget_metrics = fixed.update(batch), by_budget.update(batch)
    torch.testing.assert_close(dict(by_budget.model.named_parameters()), dict(fixed.model.named_parameters()),
                               rtol=1e-5, atol=1e-6)
    assert len(forwards.shapes) == 4  # against 3 fixed micro-batches
    # One value per mini-batch, the mini-batch's, however it was cut (optimization.mini_batch_metrics).
    assert budget_metrics["actor/pg_loss"] == pytest.approx(fixed_metrics["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert len(fixed_metrics["actor/pg_loss"]) == 1


def test_critic_values_and_update_by_token_budget():
    batch = ragged_batch()
    fixed = critic_for(critic())
    by_budget = critic_for(critic(), use_dynamic_bsz=True, ppo_max_token_len_per_gpu=BUDGET,
                           forward_max_token_len_per_gpu=BUDGET)
    torch.testing.assert_close(by_budget.compute_values(batch), fixed.compute_values(batch), rtol=1e-5, atol=1e-6)
    fixed.update(batch)
    by_budget.update(batch)
    torch.testing.assert_close(dict(by_budget.model.named_parameters()), dict(fixed.model.named_parameters()),
                               rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------- config

TINY = ["data.max_prompt_length=8", "data.max_response_length=6", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]


def test_the_log_prob_and_critic_budgets_default_to_the_actors_as_in_verl():
    config = load_config(None, [*TINY, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100"])
    rollout, ref, critic_config = (config.actor_rollout_ref.rollout, config.actor_rollout_ref.ref, config.critic)
    assert (rollout.log_prob_use_dynamic_bsz, rollout.log_prob_max_token_len_per_gpu) == (True, 100)
    assert (ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu) == (True, 100)
    assert (critic_config.use_dynamic_bsz, critic_config.forward_max_token_len_per_gpu) == (True, 32768)
    default = load_config(None, TINY)
    assert not default.actor_rollout_ref.model.use_remove_padding and not default.critic.model.use_remove_padding
    assert not default.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz and not default.critic.use_dynamic_bsz


def test_a_budget_smaller_than_the_longest_sequence_is_refused_naming_both_numbers():
    with pytest.raises(ConfigError) as error:
        load_config(None, [*TINY, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                           "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10",
                           "critic.forward_max_token_len_per_gpu=12"])
    assert str(error.value).splitlines() == [
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu: got 10, smaller than the longest sequence a batch can "
        "hold (data.max_prompt_length 8 + data.max_response_length 6 = 14 tokens); allowed: at least 14",
        "critic.forward_max_token_len_per_gpu: got 12, smaller than the longest sequence a batch can hold "
        "(data.max_prompt_length 8 + data.max_response_length 6 = 14 tokens); allowed: at least 14"]


def test_a_budget_not_in_use_is_not_checked_and_micro_batch_sizes_need_not_divide_with_a_budget():
    load_config(None, [*TINY, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10"])
    load_config(None, [*TINY, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"])
    with pytest.raises(ConfigError, match="ppo_micro_batch_size_per_gpu: got 3, which does not divide"):
        load_config(None, [*TINY, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"])


def test_a_budget_too_small_is_reported_in_the_same_round_as_a_schema_error():
    with pytest.raises(ConfigError) as error:
        load_config(None, [*TINY, "actor_rollout_ref.actor.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=9",
                           "actor_rollout_ref.actor.ppo_epochs=zero"])
    assert [line.split(":")[0] for line in str(error.value).splitlines()] == [
        "actor_rollout_ref.actor.ppo_epochs", "critic.ppo_max_token_len_per_gpu"]


def test_ranks_agree_on_as_many_token_budget_micro_batches_as_the_rank_that_needs_the_most():
    """Two ranks in threads, agreeing through a barrier as Ranks.max does through an all-reduce: the same number of
    agreements on each, as many groups on each, every group within the budget, every sequence once."""
    import threading

    from trainer.workers.packing import agreed_partitions

    shares = {0: [3, 3, 3, 3, 3, 3], 1: [9, 8, 7, 2, 9, 8]}  # rank 1 needs 5 groups of at most 10 tokens, rank 0 2
    counts: dict[int, int] = {}
    barrier = threading.Barrier(2)
    calls: dict[int, int] = {0: 0, 1: 0}
    results: dict[int, list[list[int]]] = {}

    def agree(rank: int, count: int) -> int:
        calls[rank] += 1
        counts[rank] = count
        barrier.wait()
        largest = max(counts.values())
        barrier.wait()
        return largest

    threads = [threading.Thread(target=lambda rank=rank: results.__setitem__(
        rank, agreed_partitions(shares[rank], 10, lambda count: agree(rank, count))[0])) for rank in shares]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(results[0]) == len(results[1]) == len(token_budget_partitions(shares[1], 10)) == 5
    assert calls[0] == calls[1]
    for rank, groups in results.items():
        assert sorted(index for group in groups for index in group) == list(range(6))
        assert all(sum(shares[rank][index] for index in group) <= 10 for group in groups)
    # One rank: the fewest groups, as before.
    assert len(token_budget_partitions(shares[0], 10)) == 2
