"""A decoded token's attention on the key/value heads (trainer/models/attention.py) gives transformers' own
SDPA attention's results, and everything else goes to that function unchanged."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_utils import AttentionInterface

from trainer.models import attention
from trainer.models.attention import packed_gqa_attention


class Layer(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def tensors(batch=3, heads=8, kv_heads=2, tokens=1, positions=11, dim=16):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, tokens, dim, generator=generator)
    key, value = (torch.randn(batch, kv_heads, positions, dim, generator=generator) for _ in range(2))
    return query, key, value


@pytest.mark.parametrize("mask", ["none", "bool", "float"])
def test_a_single_query_token_gives_the_library_result(mask):
    query, key, value = tensors()
    valid = torch.rand(3, 11, generator=torch.Generator().manual_seed(1)) > 0.3
    valid[:, 0] = True  # every row attends somewhere
    masks = {"none": None, "bool": valid[:, None, None, :],
             "float": torch.where(valid, 0.0, float("-inf"))[:, None, None, :]}
    layer = Layer(groups=4)
    ours, _ = packed_gqa_attention(layer, query, key, value, masks[mask], scaling=0.25)
    library, _ = attention.LIBRARY_SDPA(layer, query, key, value, masks[mask], scaling=0.25)
    assert ours.shape == library.shape == (3, 1, 8, 16)
    torch.testing.assert_close(ours, library, rtol=1e-5, atol=1e-6)


def test_several_query_tokens_and_per_head_masks_go_to_the_library(monkeypatch):
    calls = []

    def library(*args, **kwargs):
        calls.append(args[1].shape)
        return torch.zeros(1), None

    monkeypatch.setattr(attention, "LIBRARY_SDPA", library)
    layer = Layer(groups=4)
    query, key, value = tensors(tokens=5)
    packed_gqa_attention(layer, query, key, value, None)
    one, key, value = tensors(tokens=1)
    packed_gqa_attention(layer, one, key, value, torch.ones(3, 8, 1, 11, dtype=torch.bool))  # a mask per head
    packed_gqa_attention(Layer(groups=1), one, key, value, None)  # no grouped heads
    assert calls == [query.shape, one.shape, one.shape]


def test_it_is_registered_only_where_the_library_does_not_pack(monkeypatch):
    original = dict(AttentionInterface._global_mapping)
    try:
        monkeypatch.setattr(attention, "library_packs_gqa", lambda: True)
        assert attention.use_packed_gqa() is False
        assert AttentionInterface._global_mapping["sdpa"] is original["sdpa"]
        monkeypatch.setattr(attention, "library_packs_gqa", lambda: False)
        assert attention.use_packed_gqa() is True
        assert AttentionInterface._global_mapping["sdpa"] is packed_gqa_attention
    finally:
        AttentionInterface._global_mapping.clear()
        AttentionInterface._global_mapping.update(original)


def test_a_tiny_grouped_query_model_decodes_generates_greedy_tokens_with_it(monkeypatch):
    """The static decoder with this attention registered gives transformers' generate's tokens with the library's
    (the tiny preset has 4 query heads on 2 key/value heads)."""
    from tests.trainer.rollout.test_static_decode import TINY, generate, prompts
    from trainer.models import load_policy, load_tokenizer
    from trainer.rollout.static_decode import Sampling, StaticDecoder

    tokenizer = load_tokenizer(TINY)
    policy = load_policy(TINY, tokenizer, dtype=torch.float32, seed=3, override_config={"num_hidden_layers": 2}).eval()
    assert policy.config.num_attention_heads > policy.config.num_key_value_heads
    prompt_ids, prompt_mask = prompts(tokenizer)
    expected = generate(policy, prompt_ids, prompt_mask, eos_ids=[1], pad_id=tokenizer.pad_token_id, new_tokens=12,
                        do_sample=False)
    packed = []

    def counted(*args, **kwargs):
        packed.append(args[1].shape[2])  # the query's tokens
        return packed_gqa_attention(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", counted)
    decoder = StaticDecoder(policy, eos_ids=[1], pad_id=tokenizer.pad_token_id, sampling=Sampling(do_sample=False))
    assert torch.equal(decoder.generate(prompt_ids, prompt_mask, 12), expected)
    assert 1 in packed  # decoded tokens went through it
