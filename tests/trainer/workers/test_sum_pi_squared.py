"""verl's calculate_sum_pi_squared: the actor's scoring pass gives, beside the old log-probs, each response
position's sum of squared probabilities, as the whole softmax gives it, padded, padding-free and in micro-batches."""

from __future__ import annotations

import pytest
import torch

from trainer.data import PromptRecord
from trainer.models import load_policy, load_tokenizer
from trainer.rollout.batch import RolloutBatch
from trainer.workers.actor import compute_log_probs, score_responses

TOKENIZER = load_tokenizer("builtin:tiny-qwen2")
TEMPERATURE = 0.7


def ragged_batch() -> RolloutBatch:
    """Four sequences, prompts left-padded to 4 and responses right-padded to 5 (lengths 5, 2, 4, 1)."""
    generator = torch.Generator().manual_seed(0)
    prompt_lengths, response_lengths = (4, 2, 3, 1), (5, 2, 4, 1)
    prompt_ids = torch.randint(3, len(TOKENIZER), (4, 4), generator=generator)
    response_ids = torch.randint(3, len(TOKENIZER), (4, 5), generator=generator)
    prompt_mask = torch.zeros(4, 4, dtype=torch.long)
    response_mask = torch.zeros(4, 5)
    for row, (prompt, response) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        prompt_mask[row, 4 - prompt:] = 1
        response_mask[row, :response] = 1
    prompt_ids[prompt_mask == 0] = TOKENIZER.pad_token_id
    response_ids[response_mask == 0] = TOKENIZER.pad_token_id
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask, group_index=torch.arange(4),
                        records=[PromptRecord(prompt="p", data_source="test")] * 4)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return load_policy("builtin:tiny-qwen2", TOKENIZER, seed=1, dtype=torch.float32,
                       override_config={"num_hidden_layers": 1})


def whole_softmax_sums(model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits
    first = batch.prompt_ids.shape[1] - 1  # the last prompt position predicts the first response token
    probabilities = torch.softmax(logits[:, first:first + batch.response_ids.shape[1]] / TEMPERATURE, dim=-1)
    return (probabilities ** 2).sum(-1) * batch.response_mask


@pytest.mark.parametrize(("micro_batch_size", "remove_padding"), [(4, False), (3, False), (2, True)])
def test_the_scoring_pass_gives_each_positions_sum_of_squared_probabilities(model, micro_batch_size,
                                                                             remove_padding):
    batch = ragged_batch()
    scores = score_responses(model, batch, micro_batch_size=micro_batch_size, temperature=TEMPERATURE,
                             remove_padding=remove_padding, sum_pi_squared=True)
    assert scores.sum_pi_squared is not None and scores.sum_pi_squared.dtype == torch.float32
    torch.testing.assert_close(scores.sum_pi_squared, whole_softmax_sums(model, batch), rtol=1e-5, atol=1e-6)
    assert not scores.sum_pi_squared[batch.response_mask == 0].any()
    # A probability distribution's sum of squares lies in [1/V, 1].
    kept = scores.sum_pi_squared[batch.response_mask == 1]
    assert (kept >= 1 / len(TOKENIZER) - 1e-6).all() and (kept <= 1).all()
    # The log-probs are the ones the pass gives without it.
    plain = compute_log_probs(model, batch, micro_batch_size=micro_batch_size, temperature=TEMPERATURE,
                              remove_padding=remove_padding)
    torch.testing.assert_close(scores.log_probs, plain)


def test_without_asking_no_sums_are_computed(model):
    scores = score_responses(model, ragged_batch(), micro_batch_size=4, temperature=TEMPERATURE)
    assert scores.sum_pi_squared is None
