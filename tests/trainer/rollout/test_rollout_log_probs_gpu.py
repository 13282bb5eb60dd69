"""On a GPU in bf16: the log-probs the rollout records at the sampling temperature, from inside the static decode's
CUDA graphs and from transformers' generate, against the scoring forward's (rollout correction's pi_rollout)."""

import pytest
import torch

from tests.trainer.rollout.test_static_decode_gpu import bf16_policy_and_prompts
from trainer.config import RolloutConfig
from trainer.data import PromptRecord
from trainer.rollout.batch import RolloutBatch
from trainer.rollout.hf_rollout import HFRollout
from trainer.workers.actor import compute_log_probs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("decode", ["static", "generate"])
def test_the_recorded_log_probs_at_the_temperature_agree_with_the_scoring_forward_in_bf16(decode):
    tokenizer, policy, prompt_ids, prompt_mask = bf16_policy_and_prompts()
    rollout = HFRollout(policy, tokenizer, RolloutConfig(decode=decode, temperature=0.7), 24, record_log_probs=True)
    torch.manual_seed(0)
    sampled = rollout.sample(prompt_ids, prompt_mask)
    if decode == "static":
        assert rollout.decoder.replays > 0  # recorded inside the captured step
    batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=sampled.response_ids,
                         response_mask=sampled.response_mask, group_index=torch.arange(len(prompt_ids)),
                         records=[PromptRecord(prompt="p", data_source="test")] * len(prompt_ids))
    expected = compute_log_probs(policy, batch, micro_batch_size=8, temperature=0.7)
    difference = ((sampled.log_probs - expected) * sampled.response_mask).abs()
    assert difference.max() < 0.1 and difference.sum() / sampled.response_mask.sum() < 0.02, difference.max()
