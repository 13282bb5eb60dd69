"""rollout.decode=static on a GPU: the log-probs of what it samples against the training forward's (bf16)."""

import pytest
import torch

from tests.trainer.test_rollout import make_batch
from trainer.models import load_policy, load_tokenizer
from trainer.rollout.hf_rollout import response_mask_until_eos
from trainer.rollout.prompts import encode_prompts
from trainer.rollout.static_decode import Sampling, StaticDecoder
from trainer.workers.actor import compute_log_probs

pytestmark = pytest.mark.gpu


def test_the_static_decodes_log_probs_agree_with_the_training_forward_in_bf16():
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    policy = load_policy("builtin:tiny-qwen2", tokenizer, dtype=torch.bfloat16, seed=3,
                         override_config={"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
                                          "num_attention_heads": 4, "num_key_value_heads": 2}).cuda().eval()
    prompt_ids, prompt_mask = encode_prompts(["1 2 3", "4", "5 6", "7 8 9 0"] * 8, tokenizer, max_length=8)
    prompt_ids, prompt_mask = prompt_ids.cuda(), prompt_mask.cuda()
    decoder = StaticDecoder(policy, eos_ids=[1, 4], pad_id=tokenizer.pad_token_id, sampling=Sampling())
    decoder.keep_log_probs = True
    torch.manual_seed(0)
    responses = decoder.generate(prompt_ids, prompt_mask, 24)
    mask = response_mask_until_eos(responses, [1, 4])
    expected = compute_log_probs(policy, make_batch(prompt_ids, prompt_mask, responses, mask), micro_batch_size=8,
                                 temperature=1.0)
    difference = ((decoder.log_probs - expected[:, :responses.shape[1]]) * mask).abs()
    assert difference.max() < 0.1 and difference.sum() / mask.sum() < 0.02, difference.max()


def test_the_per_token_step_in_cuda_graphs_decodes_what_the_eager_step_does():
    """Greedy, through a shrinking batch: each batch size's step is captured at its second step and replayed;
    the tokens are the eager decoder's."""
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    policy = load_policy("builtin:tiny-qwen2", tokenizer, dtype=torch.bfloat16, seed=3,
                         override_config={"num_hidden_layers": 2}).cuda().eval()
    prompt_ids, prompt_mask = encode_prompts(["1 2 3", "4", "5 6", "7 8 9 0"] * 4, tokenizer, max_length=8)
    prompt_ids, prompt_mask = prompt_ids.cuda(), prompt_mask.cuda()
    results = {}
    for graphs in (False, True):
        decoder = StaticDecoder(policy, eos_ids=[1, 4, 12], pad_id=tokenizer.pad_token_id,
                                sampling=Sampling(do_sample=False), cuda_graphs=graphs)
        results[graphs] = decoder.generate(prompt_ids, prompt_mask, 20)
        history = decoder.bucket_history
    assert len(history) > 1, history
    assert torch.equal(results[True], results[False])
