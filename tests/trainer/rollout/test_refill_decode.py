"""The static decode that does not pay for finished rows (issue 40): finer buckets, and finished rows' slots refilled
with waiting prompts over a cache whose columns are a ring (trainer/rollout/refill.py)."""

import types

import pytest
import torch

from tests.trainer.rollout.test_rollout import make_batch
from trainer.models import load_policy, load_tokenizer
from trainer.rollout.hf_rollout import response_mask_until_eos
from trainer.rollout.prompts import encode_prompts
from trainer.rollout.refill import PendingRows, copy_prompt_rows, ring_columns
from trainer.rollout.static_decode import Sampling, StaticDecoder, fine_buckets
from trainer.workers.actor import compute_log_probs

PROMPTS = ["1 2 3", "4", "5 6", "7 8 9 0", "2 2", "9 8 7 6 5", "0", "3 1"]
ENDS = [1, 4, 12]
"""Token ids that end a response: the tiny policy's greedy rows end after 1 to 12 tokens with these."""


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin:tiny-qwen2")


@pytest.fixture(scope="module")
def policy(tokenizer):
    return load_policy("builtin:tiny-qwen2", tokenizer, dtype=torch.float32, seed=3,
                       override_config={"num_hidden_layers": 2}).eval()


def decoder_for(policy, tokenizer, **sampling) -> StaticDecoder:
    return StaticDecoder(policy, eos_ids=ENDS, pad_id=tokenizer.pad_token_id, sampling=Sampling(**sampling))


@pytest.mark.parametrize("slots", [1, 3, 5])
def test_refilled_slots_decode_the_greedy_tokens_of_the_whole_batch(tokenizer, policy, slots):
    """8 prompts through `slots` rows: every prompt waits for a finished row's slot, and each response is the one the
    whole batch decodes, token for token, over a ring the write position wrapped around."""
    prompt_ids, prompt_mask = encode_prompts(PROMPTS, tokenizer, max_length=8)
    whole = decoder_for(policy, tokenizer, do_sample=False).generate(prompt_ids, prompt_mask, 12)
    decoder = decoder_for(policy, tokenizer, do_sample=False)
    refilled = decoder.generate(prompt_ids, prompt_mask, 12, slots=slots)
    assert torch.equal(refilled, whole)
    assert decoder.refilled == len(PROMPTS) - slots  # every waiting prompt took a slot
    assert decoder.bucket_history[0] == slots
    assert 8 + decoder.steps > 8 + 12  # the cache's write column went past its end: the ring wrapped


def test_a_decode_without_refills_takes_its_slots_in_pieces_and_gives_the_same_tokens(tokenizer, policy):
    prompt_ids, prompt_mask = encode_prompts(PROMPTS, tokenizer, max_length=8)
    whole = decoder_for(policy, tokenizer, do_sample=False).generate(prompt_ids, prompt_mask, 12)
    decoder = decoder_for(policy, tokenizer, do_sample=False)
    decoder.refill = False
    assert torch.equal(decoder.generate(prompt_ids, prompt_mask, 12, slots=3), whole)
    assert decoder.refilled == 0


def test_rows_that_run_to_the_length_limit_free_their_slots_too(tokenizer, policy):
    """No EOS ever comes (an id outside the vocabulary): each row ends at 6 tokens, and the next prompts take over."""
    prompt_ids, prompt_mask = encode_prompts(PROMPTS, tokenizer, max_length=8)
    decoder = StaticDecoder(policy, eos_ids=[10**6], pad_id=tokenizer.pad_token_id, sampling=Sampling(do_sample=False))
    whole = decoder.generate(prompt_ids, prompt_mask, 6)
    refilled = decoder.generate(prompt_ids, prompt_mask, 6, slots=3)
    assert refilled.shape == whole.shape == (8, 6)
    assert torch.equal(refilled, whole)
    assert decoder.refilled == 5 and decoder.steps == 3 * 5  # three rounds of 5 steps after each round's prefill


def test_sampled_tokens_of_refilled_rows_come_from_the_training_forwards_distribution(tokenizer, policy):
    """The log-probability each sampled token had when it was drawn (the decode's own logits, at the temperature)
    is the one the training forward gives it on the row's prompt and response: refilled rows' keys, positions and
    masks are their own sequence's, so they sample from the same distribution as a whole batch (whose sampling
    arithmetic test_static_decode.py checks against generate's warpers)."""
    prompt_ids, prompt_mask = encode_prompts(PROMPTS * 2, tokenizer, max_length=8)
    decoder = decoder_for(policy, tokenizer, temperature=0.8)
    decoder.keep_log_probs = True
    torch.manual_seed(4)
    responses = decoder.generate(prompt_ids, prompt_mask, 16, slots=4)
    assert decoder.refilled == 12
    mask = response_mask_until_eos(responses, ENDS)
    expected = compute_log_probs(policy, make_batch(prompt_ids, prompt_mask, responses, mask), micro_batch_size=16,
                                 temperature=0.8)[:, :responses.shape[1]]
    assert torch.allclose(decoder.log_probs * mask, expected * mask, atol=1e-4)
    assert bool((decoder.log_probs[mask == 0] == 0).all())


def test_sampling_with_refills_is_reproducible_for_a_seed(tokenizer, policy):
    prompt_ids, prompt_mask = encode_prompts(PROMPTS, tokenizer, max_length=8)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(decoder_for(policy, tokenizer, temperature=1.5).generate(prompt_ids, prompt_mask, 12, slots=3))
    assert torch.equal(runs[0], runs[1])


def test_a_shrinking_batch_goes_through_the_fine_buckets(tokenizer, policy):
    prompt_ids, prompt_mask = encode_prompts(PROMPTS * 3, tokenizer, max_length=8)
    decoder = decoder_for(policy, tokenizer, do_sample=False)
    decoder.check_every = 1
    fine = decoder.generate(prompt_ids, prompt_mask, 12)
    assert decoder.bucket_history[:2] == [24, 16]  # 24 rows, then 16 (powers of two would go to 16, then 8)
    assert set(decoder.bucket_history) <= set(fine_buckets(24))
    decoder.fine_buckets = False
    assert torch.equal(decoder.generate(prompt_ids, prompt_mask, 12), fine)


def test_fine_buckets_shrink_by_about_a_quarter_in_sizes_vllm_captures():
    assert fine_buckets(256) == [256, 192, 144, 104, 72, 48, 32, 24, 16, 8, 4, 2, 1]
    assert fine_buckets(33) == [33, 24, 16, 8, 4, 2, 1]
    assert fine_buckets(8) == [8, 4, 2, 1]
    assert fine_buckets(1) == [1]


def test_a_refilled_prompt_lies_in_the_columns_before_the_next_write_wrapping_at_the_end():
    assert ring_columns(6, 4, 10, torch.device("cpu")).tolist() == [2, 3, 4, 5]
    assert ring_columns(2, 4, 10, torch.device("cpu")).tolist() == [8, 9, 0, 1]


def test_a_prompts_keys_go_into_its_row_at_the_ring_columns_and_nowhere_else():
    keys = torch.zeros(3, 1, 6, 2)
    values = torch.zeros(3, 1, 6, 2)
    cache = types.SimpleNamespace(layers=[types.SimpleNamespace(keys=keys, values=values)])
    prompt_keys = torch.arange(1, 9, dtype=torch.float32).view(1, 1, 4, 2)
    prompts = types.SimpleNamespace(layers=[types.SimpleNamespace(keys=prompt_keys, values=-prompt_keys)])
    copy_prompt_rows(cache, prompts, torch.tensor([1]), ring_columns(1, 4, 6, torch.device("cpu")))
    assert keys.data_ptr() == cache.layers[0].keys.data_ptr()  # in place: a captured step reads the same buffer
    assert keys[1, 0, [3, 4, 5, 0]].tolist() == prompt_keys[0, 0].tolist()
    assert torch.equal(values[1, 0, [3, 4, 5, 0]], -prompt_keys[0, 0])
    assert keys[1, 0, [1, 2]].abs().sum() == 0 and keys[[0, 2]].abs().sum() == 0


def test_waiting_rows_are_taken_in_order_until_none_is_left():
    pending = PendingRows(total=5, first=2)
    assert len(pending) == 3
    assert list(pending.take(2)) == [2, 3]
    assert list(pending.take(4)) == [4] and len(pending) == 0
    assert list(pending.take(1)) == []


def test_the_steps_rollout_hands_the_whole_batch_to_the_static_decode_with_max_num_seqs_slots(tmp_path):
    """rollout.max_num_seqs=3 and 8 sequences a step: one decode of all 8, 3 at a time (not three pieces), and the
    responses are each prompt's greedy ones."""
    from trainer.config import load_config
    from trainer.loop import Trainer

    aro = "actor_rollout_ref"
    config = load_config(None, ["data.train_files=[builtin:counting]", "data.train_batch_size=4",
                                "data.max_prompt_length=8", "data.max_response_length=6",
                                f"{aro}.model.path=builtin:tiny-qwen2", "algorithm.adv_estimator=grpo",
                                f"{aro}.rollout.n=2", f"{aro}.rollout.decode=static", f"{aro}.rollout.do_sample=false",
                                f"{aro}.rollout.max_num_seqs=3", f"{aro}.actor.ppo_mini_batch_size=4",
                                f"{aro}.model.override_config={{num_hidden_layers: 2}}", "trainer.device=cpu",
                                f"trainer.runs_dir={tmp_path / 'runs'}"])
    trainer = Trainer(config, log=lambda *_: None, warn=lambda *_: None)
    calls: list[tuple[int, int | None]] = []
    sample = trainer.rollout.sample
    trainer.rollout.sample = lambda ids, mask, slots=None: calls.append((len(ids), slots)) or sample(ids, mask, slots)
    batch = trainer.generation.generate(trainer.records[:4])
    assert calls == [(8, 3)]
    assert trainer.rollout.decoder.refilled == 5
    alone = [trainer.rollout.sample(batch.prompt_ids[row:row + 1], batch.prompt_mask[row:row + 1]).response_ids
             for row in range(8)]
    assert torch.equal(batch.response_ids, torch.cat(alone))
