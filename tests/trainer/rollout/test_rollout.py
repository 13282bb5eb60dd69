"""Prompt encoding, the HF rollout on the tiny model, and the RolloutBatch container."""

import pytest
import torch
from tokenizers.processors import TemplateProcessing

from trainer.config import RolloutConfig
from trainer.data import PromptRecord
from trainer.models import load_policy, load_tokenizer
from trainer.models.tiny import build_tiny_tokenizer
from trainer.rollout.batch import RolloutBatch
from trainer.rollout.hf_rollout import HFRollout, eos_token_ids, response_mask_until_eos
from trainer.rollout.prompts import PromptTooLong, encode_prompts, prompt_token_ids
from trainer.workers.actor import compute_log_probs
from trainer.workers.optimization import response_logits

TINY = "builtin:tiny-qwen2"
PAD, EOS = 0, 1


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY)


@pytest.fixture(scope="module")
def policy(tokenizer):
    return load_policy(TINY, tokenizer, dtype=torch.float32, seed=3, override_config={"num_hidden_layers": 1})


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def make_batch(prompt_ids, prompt_mask, response_ids, response_mask) -> RolloutBatch:
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask.float(), group_index=torch.arange(len(prompt_ids)),
                        records=[PromptRecord(prompt=f"p{i}", data_source="test") for i in range(len(prompt_ids))])


def first_eos_positions(response_ids: torch.Tensor, eos_ids: list[int]) -> list[int | None]:
    positions = []
    for row in response_ids.tolist():
        positions.append(next((index for index, token in enumerate(row) if token in eos_ids), None))
    return positions


# -------------------------------------------------------------------------------------- prompts


def test_encode_prompts_left_pads_a_ragged_batch(tokenizer):
    ids, mask = encode_prompts(["1 2 3", "4", "5 6"], tokenizer, max_length=8)
    one_two_three, four, five_six = ids_of(tokenizer, "1 2 3"), ids_of(tokenizer, "4"), ids_of(tokenizer, "5 6")
    assert ids.tolist() == [one_two_three, [PAD, PAD, *four], [PAD, *five_six]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert ids.dtype == mask.dtype == torch.long


def test_encode_prompts_is_as_wide_as_the_longest_prompt_not_max_length(tokenizer):
    ids, mask = encode_prompts(["1 2", "3"], tokenizer, max_length=100)
    assert ids.shape == mask.shape == (2, 2)


def test_chat_prompts_go_through_the_chat_template(tokenizer):
    messages = [{"role": "system", "content": "1 2"}, {"role": "user", "content": "3"}]
    ids, mask = encode_prompts([messages, "4"], tokenizer, max_length=8)
    # The tiny template joins the contents with spaces.
    assert ids[0].tolist() == ids_of(tokenizer, "1 2 3")
    assert ids[1].tolist() == [PAD, PAD, *ids_of(tokenizer, "4")]


def test_chat_template_special_tokens_are_not_added_twice():
    """A tokenizer that prepends a BOS-like token, with a template that writes it and a generation prompt."""
    tokenizer = build_tiny_tokenizer()
    bos, generation_prompt = tokenizer.convert_tokens_to_ids("="), tokenizer.convert_tokens_to_ids(":")
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="= $A", special_tokens=[("=", bos)])
    tokenizer.chat_template = ("= {% for m in messages %}{{ m['content'] }} {% endfor %}"
                               "{% if add_generation_prompt %}: {% endif %}")
    digits = ids_of(tokenizer, "1 2")
    assert prompt_token_ids("1 2", tokenizer) == [bos, *digits]
    assert prompt_token_ids([{"role": "user", "content": "1 2"}], tokenizer) == [bos, *digits, generation_prompt]


def test_a_long_prompt_is_an_error_naming_the_setting(tokenizer):
    with pytest.raises(PromptTooLong, match=r"5 tokens, more than data\.max_prompt_length=3") as error:
        encode_prompts(["1", "1 2 3 4 5"], tokenizer, max_length=3)
    assert "data.truncation" in str(error.value)


@pytest.mark.parametrize(("truncation", "kept"), [("left", "3 4 5"), ("right", "1 2 3")])
def test_truncation_keeps_one_end(tokenizer, truncation, kept):
    ids, mask = encode_prompts(["1 2 3 4 5", "9"], tokenizer, max_length=3, truncation=truncation)
    assert ids.tolist() == [ids_of(tokenizer, kept), [PAD, PAD, *ids_of(tokenizer, "9")]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_an_empty_prompt_is_an_error(tokenizer):
    with pytest.raises(PromptTooLong, match="empty"):
        encode_prompts(["1", "   "], tokenizer, max_length=3)


# -------------------------------------------------------------------------------- response mask


@pytest.mark.parametrize(("ids", "expected"), [
    ([5, 6, EOS, 7, 8], [1, 1, 1, 0, 0]),  # EOS in the middle: kept, everything after it dropped
    ([EOS, 6, 7, 8, 9], [1, 0, 0, 0, 0]),  # an immediate EOS is a one-token response
    ([5, 6, 7, 8, 9], [1, 1, 1, 1, 1]),  # no EOS: the response ran to the length limit
    ([5, EOS, 7, EOS, EOS], [1, 1, 0, 0, 0]),  # only the first EOS counts
    ([5, 6, 7, 8, EOS], [1, 1, 1, 1, 1]),
])
def test_response_mask_until_eos(ids, expected):
    mask = response_mask_until_eos(torch.tensor([ids]), [EOS])
    assert mask.tolist() == [expected]
    assert mask.dtype == torch.float32


def test_response_mask_knows_several_eos_ids():
    ids = torch.tensor([[5, 9, 6, EOS], [5, 6, EOS, 9], [5, 6, 7, 8]])
    assert response_mask_until_eos(ids, [EOS, 9]).tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]


def test_eos_token_ids_merge_the_tokenizer_and_the_model(tokenizer, policy):
    assert eos_token_ids(policy, tokenizer) == [EOS]
    model_eos = policy.generation_config.eos_token_id
    try:
        policy.generation_config.eos_token_id = [12, EOS, 9]
        assert eos_token_ids(policy, tokenizer) == [EOS, 9, 12]
    finally:
        policy.generation_config.eos_token_id = model_eos


# ------------------------------------------------------------------------------------ HFRollout


def rollout(policy, tokenizer, response_length=6, **settings) -> HFRollout:
    return HFRollout(policy, tokenizer, RolloutConfig(**settings), response_length)


def test_rollout_shapes_and_padding_after_eos(tokenizer, policy):
    prompts = ["1 2 3", "4", "5 6", "7 8 9 0"] * 8
    prompt_ids, prompt_mask = encode_prompts(prompts, tokenizer, max_length=8)
    torch.manual_seed(0)
    # A high temperature makes the random model end about one response in three within 8 tokens.
    responses, mask = rollout(policy, tokenizer, response_length=8, temperature=3.0).generate(prompt_ids, prompt_mask)
    assert responses.shape == mask.shape == (32, 8)
    assert responses.dtype == torch.long and mask.dtype == torch.float32
    positions = first_eos_positions(responses, [EOS])
    assert any(position is not None and 0 < position < 7 for position in positions), "no EOS mid-response"
    assert any(position is None for position in positions), "every response ended"
    for row, position in enumerate(positions):
        length = 8 if position is None else position + 1
        assert mask[row].tolist() == [1.0] * length + [0.0] * (8 - length)
        assert responses[row, length:].tolist() == [PAD] * (8 - length)
        assert EOS not in responses[row, :length - 1].tolist()


def test_rollout_pads_to_the_response_length_when_every_response_ends_early(tokenizer, policy):
    """generate stops once all rows are done; the responses are still [B, R]."""
    prompt_ids, prompt_mask = encode_prompts(["1 2 3", "4"], tokenizer, max_length=8)
    greedy = rollout(policy, tokenizer, do_sample=False)
    greedy_tokens, _ = greedy.generate(prompt_ids, prompt_mask)
    # Declare the first greedy tokens as EOS: both responses are then one token long.
    model_eos = policy.generation_config.eos_token_id
    try:
        policy.generation_config.eos_token_id = greedy_tokens[:, 0].tolist()
        ending = rollout(policy, tokenizer, do_sample=False)
    finally:
        policy.generation_config.eos_token_id = model_eos
    responses, mask = ending.generate(prompt_ids, prompt_mask)
    assert responses.shape == (2, 6)
    assert responses[:, 0].tolist() == greedy_tokens[:, 0].tolist()
    assert responses[:, 1:].eq(PAD).all()
    assert mask.tolist() == [[1.0, 0, 0, 0, 0, 0]] * 2


def test_rollout_leaves_the_model_in_training_mode(tokenizer, policy):
    prompt_ids, prompt_mask = encode_prompts(["1"], tokenizer, max_length=8)
    policy.train()
    try:
        rollout(policy, tokenizer).generate(prompt_ids, prompt_mask)
        assert policy.training
    finally:
        policy.eval()


def test_repeated_prompts_sample_different_responses(tokenizer, policy):
    """rollout.n works by repeating each prompt: the copies must be sampled independently."""
    prompt_ids, prompt_mask = encode_prompts(["1 2 3"] * 8, tokenizer, max_length=8)
    torch.manual_seed(0)
    responses, _ = rollout(policy, tokenizer, temperature=2.0).generate(prompt_ids, prompt_mask)
    assert len({tuple(row) for row in responses.tolist()}) > 1


def test_greedy_decoding_does_not_depend_on_left_padding(tokenizer, policy):
    short_prompts = ["4", "5 6", "0 1 2"]
    greedy = rollout(policy, tokenizer, do_sample=False, response_length=8)
    alone = []
    for prompt in short_prompts:
        prompt_ids, prompt_mask = encode_prompts([prompt], tokenizer, max_length=8)
        alone.append(greedy.generate(prompt_ids, prompt_mask)[0][0].tolist())
    padded_ids, padded_mask = encode_prompts([*short_prompts, "9 8 7 6 5 4 3"], tokenizer, max_length=8)
    assert padded_mask[:3].eq(0).any(dim=1).all(), "the short prompts must be left-padded"
    batched, _ = greedy.generate(padded_ids, padded_mask)
    assert batched[:3].tolist() == alone
    again, _ = greedy.generate(padded_ids, padded_mask)
    assert again.tolist() == batched.tolist()


def test_sampling_with_a_fixed_seed_reproduces(tokenizer, policy):
    prompt_ids, prompt_mask = encode_prompts(["1 2 3", "4", "5 6"] * 4, tokenizer, max_length=8)
    sampler = rollout(policy, tokenizer, temperature=2.0)
    torch.manual_seed(7)
    first, first_mask = sampler.generate(prompt_ids, prompt_mask)
    torch.manual_seed(7)
    second, second_mask = sampler.generate(prompt_ids, prompt_mask)
    torch.manual_seed(8)
    other, _ = sampler.generate(prompt_ids, prompt_mask)
    assert first.tolist() == second.tolist() and first_mask.tolist() == second_mask.tolist()
    assert other.tolist() != first.tolist()


@pytest.mark.parametrize("do_sample", [False, True])
def test_scoring_forward_matches_the_scores_of_generate(tokenizer, policy, do_sample):
    """compute_log_probs (position ids, masks, the off-by-one slice) sees what generate saw.

    Sampling at temperature 1 with no top-k/top-p leaves generate's scores untouched too, and gives
    responses that end at EOS, so the padding after EOS is covered.
    """
    prompts = ["4", "1 2 3 4 5 6 7", "5 6", "0 1 2"] * (3 if do_sample else 1)
    prompt_ids, prompt_mask = encode_prompts(prompts, tokenizer, max_length=8)
    sampler = rollout(policy, tokenizer, do_sample=do_sample, temperature=1.0, response_length=8)
    torch.manual_seed(1)
    with torch.no_grad():
        output = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                                 generation_config=sampler.generation_config,
                                 output_scores=True, return_dict_in_generate=True)
    responses = output.sequences[:, prompt_ids.shape[1]:]
    mask = response_mask_until_eos(responses, sampler.eos_ids)
    responses = responses.masked_fill(mask == 0, PAD)
    steps = len(output.scores)
    generate_scores = torch.stack(output.scores, dim=1).float().log_softmax(dim=-1)
    expected = generate_scores.gather(-1, responses[:, :steps, None]).squeeze(-1) * mask[:, :steps]

    batch = make_batch(prompt_ids, prompt_mask, responses, mask)
    log_probs = compute_log_probs(policy, batch, micro_batch_size=3, temperature=1.0)
    assert log_probs.shape == responses.shape
    if do_sample:
        assert (mask.sum(dim=1) < steps).any(), "no response ended at EOS"
    torch.testing.assert_close(log_probs, expected, atol=1e-4, rtol=0)
    # And the response scored alone, with no left padding, agrees.
    alone = make_batch(prompt_ids[1:2], prompt_mask[1:2], responses[1:2], mask[1:2])
    torch.testing.assert_close(compute_log_probs(policy, alone, micro_batch_size=1, temperature=1.0),
                               expected[1:2], atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------- top_k and top_p

SAMPLING_PROMPTS = ["1 2 3", "4", "5 6", "7 8 9 0"] * 4


def sample(policy, tokenizer, seed: int, **settings) -> tuple[torch.Tensor, torch.Tensor, RolloutBatch]:
    prompt_ids, prompt_mask = encode_prompts(SAMPLING_PROMPTS, tokenizer, max_length=8)
    torch.manual_seed(seed)
    responses, mask = rollout(policy, tokenizer, response_length=6, **settings).generate(prompt_ids, prompt_mask)
    return responses, mask, make_batch(prompt_ids, prompt_mask, responses, mask)


def token_probabilities(policy, batch: RolloutBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, R, V] the model's next-token probabilities at `temperature`, [B, R] those of the sampled tokens)."""
    with torch.no_grad():
        probs = torch.softmax(response_logits(policy, batch).float() / temperature, dim=-1)
    return probs, probs.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)


def more_likely_tokens(policy, batch: RolloutBatch, temperature: float = 1.0) -> list[int]:
    """For each sampled response token, how many tokens the model ranked clearly above it."""
    probs, picked = token_probabilities(policy, batch, temperature)
    above = (probs > picked.unsqueeze(-1) + 1e-5).sum(-1)
    return above[batch.response_mask.bool()].tolist()


def mass_above(policy, batch: RolloutBatch, temperature: float) -> list[float]:
    """For each sampled response token, the probability of the tokens clearly more likely than it."""
    probs, picked = token_probabilities(policy, batch, temperature)
    above = (probs * (probs > picked.unsqueeze(-1) + 1e-5)).sum(-1)
    return above[batch.response_mask.bool()].tolist()


@pytest.mark.parametrize("limit", [{"top_k": 1}, {"top_p": 1e-6}])
def test_sampling_limited_to_the_top_token_is_greedy_decoding(tokenizer, policy, limit):
    greedy, greedy_mask, _ = sample(policy, tokenizer, seed=0, do_sample=False)
    unlimited, _, _ = sample(policy, tokenizer, seed=0, temperature=5.0)
    assert unlimited.tolist() != greedy.tolist(), "a hot sampler must stray from greedy, or this test proves nothing"
    for seed in range(3):
        limited, limited_mask, _ = sample(policy, tokenizer, seed=seed, temperature=5.0, **limit)
        assert limited.tolist() == greedy.tolist()
        assert limited_mask.tolist() == greedy_mask.tolist()


def test_top_k_samples_only_among_the_k_most_likely_tokens(tokenizer, policy):
    _, _, unlimited = sample(policy, tokenizer, seed=0, temperature=5.0)
    assert max(more_likely_tokens(policy, unlimited)) >= 3, "a hot sampler must pick unlikely tokens"
    for disabled in (-1, 0):  # both mean no top-k
        _, _, same = sample(policy, tokenizer, seed=0, temperature=5.0, top_k=disabled)
        assert same.response_ids.tolist() == unlimited.response_ids.tolist()
    _, _, limited = sample(policy, tokenizer, seed=0, temperature=5.0, top_k=3)
    ranks = more_likely_tokens(policy, limited)
    assert max(ranks) <= 2
    assert len(set(ranks)) > 1, "the hot sampler should still use more than the top token"


def test_top_p_samples_only_from_the_nucleus(tokenizer, policy):
    """A token is in the nucleus when the tokens more likely than it (after temperature) hold less than top_p."""
    temperature = 2.0
    _, _, unlimited = sample(policy, tokenizer, seed=0, temperature=temperature)
    assert max(mass_above(policy, unlimited, temperature)) > 0.6, "a hot sampler must pick tokens outside it"
    _, _, limited = sample(policy, tokenizer, seed=0, temperature=temperature, top_p=0.6)
    masses = mass_above(policy, limited, temperature)
    assert max(masses) < 0.6 + 1e-4
    assert max(masses) > 0, "the nucleus should hold more than the top token"


def test_the_models_own_generation_defaults_do_not_change_the_rollout(tokenizer, policy):
    """A model directory's generation_config.json (e.g. repetition_penalty: 1.05) must not reshape sampling:
    the losses score the responses with plain softmax(logits / temperature)."""
    greedy, _, _ = sample(policy, tokenizer, seed=0, do_sample=False)
    sampled, _, _ = sample(policy, tokenizer, seed=0, temperature=2.0)
    saved = policy.generation_config
    try:
        policy.generation_config = saved.__class__(**{**saved.to_dict(), "repetition_penalty": 50.0})
        assert sample(policy, tokenizer, seed=0, do_sample=False)[0].tolist() == greedy.tolist()
        assert sample(policy, tokenizer, seed=0, temperature=2.0)[0].tolist() == sampled.tolist()
    finally:
        policy.generation_config = saved


# ---------------------------------------------------------------------------------- RolloutBatch


@pytest.fixture
def batch() -> RolloutBatch:
    prompt_ids = torch.tensor([[0, 0, 4], [0, 5, 6], [7, 8, 9]])
    prompt_mask = torch.tensor([[0, 0, 1], [0, 1, 1], [1, 1, 1]])
    response_ids = torch.tensor([[10, 1, 0], [11, 12, 13], [1, 0, 0]])
    response_mask = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 0, 0]])
    result = make_batch(prompt_ids, prompt_mask, response_ids, response_mask)
    result.old_log_probs = torch.tensor([[-1.0, -2, 0], [-3, -4, -5], [-6, 0, 0]])
    return result


def test_rollout_batch_joins_prompt_and_response(batch):
    assert len(batch) == 3
    assert batch.input_ids.tolist() == [[0, 0, 4, 10, 1, 0], [0, 5, 6, 11, 12, 13], [7, 8, 9, 1, 0, 0]]
    assert batch.attention_mask.tolist() == [[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert batch.attention_mask.dtype == torch.long
    # Positions count from each sequence's first real token: the same as a prompt with no padding.
    assert batch.position_ids.tolist() == [[0, 0, 0, 1, 2, 2], [0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 3, 3]]
    assert batch.response_lengths.tolist() == [2.0, 3.0, 1.0]


def test_rollout_batch_select_keeps_rows_together(batch):
    picked = batch.select([2, 0])
    assert picked.prompt_ids.tolist() == [[7, 8, 9], [0, 0, 4]]
    assert picked.response_ids.tolist() == [[1, 0, 0], [10, 1, 0]]
    assert picked.old_log_probs.tolist() == [[-6.0, 0, 0], [-1.0, -2, 0]]
    assert picked.group_index.tolist() == [2, 0]
    assert [record.prompt for record in picked.records] == ["p2", "p0"]
    assert picked.values is None and picked.advantages is None
    assert len(batch) == 3, "select must not change the original"
    assert batch.select(torch.tensor([1])).prompt_ids.tolist() == [[0, 5, 6]]


def test_rollout_batch_split_in_order(batch):
    parts = list(batch.split(2))
    assert [len(part) for part in parts] == [2, 1]
    assert [record.prompt for part in parts for record in part.records] == ["p0", "p1", "p2"]
    assert torch.equal(torch.cat([part.response_mask for part in parts]), batch.response_mask)
    assert [len(part) for part in batch.split(5)] == [3]


def test_a_rollout_synced_over_ranks_meets_them_only_while_it_is_told_its_forwards_gather(tokenizer, policy):
    """HFRollout.synced, which the loop sets per rollout: synced, a static decode asks every rank for its count of rows
    still decoding (agree_active); unsynced (each rank holds the whole weights, FSDP2's hooks off), it decodes alone,
    asking nothing, the same tokens; and transformers' generate, unsynced, needs no process group (synced_gpus
    would reduce over one at every token)."""
    prompt_ids, prompt_mask = encode_prompts(["1 2 3", "4"], tokenizer, max_length=8)
    asked: list[int] = []
    shared = HFRollout(policy, tokenizer, RolloutConfig(do_sample=False, decode="static"), 6, synced=True,
                       agree_active=lambda active: asked.append(active) or active)
    results = {}
    for synced in (True, False):
        asked.clear()
        shared.synced = synced
        results[synced] = (shared.generate(prompt_ids, prompt_mask)[0], len(asked))
    assert torch.equal(results[True][0], results[False][0])
    assert results[True][1] > 0 and results[False][1] == 0
    generated = HFRollout(policy, tokenizer, RolloutConfig(do_sample=False, decode="generate"), 6, synced=True)
    generated.synced = False
    assert torch.equal(generated.generate(prompt_ids, prompt_mask)[0], results[False][0])
