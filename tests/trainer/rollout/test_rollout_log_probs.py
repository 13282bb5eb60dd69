"""The log-probs the rollout records of the tokens it samples (rollout correction's pi_rollout): what the actor's
scoring forward gives the same tokens at the same weights and temperature, through either decode."""

import pytest
import torch

from trainer.config import RolloutConfig
from trainer.data import PromptRecord
from trainer.models import load_policy, load_tokenizer
from trainer.rollout.batch import RolloutBatch
from trainer.rollout.hf_rollout import HFRollout
from trainer.rollout.prompts import encode_prompts
from trainer.workers.actor import compute_log_probs

PROMPTS = ["1 2 3", "4", "5 6", "7 8 9 0"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin:tiny-qwen2")


@pytest.fixture(scope="module")
def policy(tokenizer):
    return load_policy("builtin:tiny-qwen2", tokenizer, dtype=torch.float32, seed=3,
                       override_config={"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64})


def scored(policy, prompt_ids, prompt_mask, sampled, temperature) -> torch.Tensor:
    batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=sampled.response_ids,
                         response_mask=sampled.response_mask, group_index=torch.arange(len(prompt_ids)),
                         records=[PromptRecord(prompt=str(row), data_source="test") for row in range(len(prompt_ids))])
    return compute_log_probs(policy, batch, micro_batch_size=4, temperature=temperature)


@pytest.mark.parametrize("decode", ["generate", "static"])
@pytest.mark.parametrize("do_sample", [True, False])
def test_the_recorded_log_probs_are_the_scoring_forwards_at_the_sampling_temperature(tokenizer, policy, decode,
                                                                                     do_sample):
    prompt_ids, prompt_mask = encode_prompts(PROMPTS * 2, tokenizer, max_length=8)
    rollout = HFRollout(policy, tokenizer, RolloutConfig(decode=decode, temperature=0.7, do_sample=do_sample), 10,
                        record_log_probs=True)
    torch.manual_seed(1)
    sampled = rollout.sample(prompt_ids, prompt_mask)
    assert sampled.log_probs is not None and sampled.log_probs.shape == sampled.response_ids.shape
    expected = scored(policy, prompt_ids, prompt_mask, sampled, temperature=0.7)
    torch.testing.assert_close(sampled.log_probs, expected, atol=1e-4, rtol=0)
    # At temperature 1 each token's log-prob is another number: the recorded ones are at the sampling temperature.
    other = scored(policy, prompt_ids, prompt_mask, sampled, temperature=1.0)
    assert (sampled.log_probs - other).abs().max() > 0.01
    assert bool((sampled.log_probs[sampled.response_mask == 0] == 0).all())  # nothing after EOS


def test_the_rollout_records_nothing_unless_asked(tokenizer, policy):
    prompt_ids, prompt_mask = encode_prompts(PROMPTS, tokenizer, max_length=8)
    for decode in ("generate", "static"):
        sampled = HFRollout(policy, tokenizer, RolloutConfig(decode=decode), 6).sample(prompt_ids, prompt_mask)
        assert sampled.log_probs is None


def test_recording_changes_no_sampled_token(tokenizer, policy):
    prompt_ids, prompt_mask = encode_prompts(PROMPTS * 2, tokenizer, max_length=8)
    responses = {}
    for record in (False, True):
        torch.manual_seed(5)
        rollout = HFRollout(policy, tokenizer, RolloutConfig(decode="generate", temperature=0.9), 8,
                            record_log_probs=record)
        responses[record] = rollout.generate(prompt_ids, prompt_mask)[0]
    assert torch.equal(responses[False], responses[True])
