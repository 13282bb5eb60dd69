"""verl's engine limits with the built-in rollout: rollout.max_model_len stops a response where its prompt and it
reach that many tokens (as verl's engines stop it), and rollout.max_num_seqs and max_num_batched_tokens bound how
many sequences decode at once (the decode's pieces)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainer.config import RolloutConfig, load_config
from trainer.generation import Generation
from trainer.models import load_policy, load_tokenizer
from trainer.rollout.hf_rollout import HFRollout, within_model_length
from trainer.rollout.prompts import encode_prompts


def test_within_model_length_cuts_each_row_where_its_prompt_and_response_reach_the_length() -> None:
    mask = torch.ones(3, 5)
    # Real prompt tokens: 2, 4 and 6 (left padding); max_model_len 7 leaves 5, 3 and 1 response tokens.
    prompt_mask = torch.tensor([[0, 0, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    assert within_model_length(mask, prompt_mask, 7).tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0],
                                                                  [1, 0, 0, 0, 0]]
    ended = torch.tensor([[1.0, 1, 0, 0, 0]] * 3)  # an EOS at the second token: nothing more to cut
    assert within_model_length(ended, prompt_mask, 7).tolist() == [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0],
                                                                   [1, 0, 0, 0, 0]]


@pytest.mark.parametrize("decode", ["generate", "static"])
def test_a_rollout_with_a_model_length_stops_each_response_there(decode: str) -> None:
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    policy = load_policy("builtin:tiny-qwen2", tokenizer, dtype=torch.float32, seed=3,
                         override_config={"num_hidden_layers": 1})
    prompt_ids, prompt_mask = encode_prompts(["1 2 3", "4", "5 6 7 8 9"], tokenizer, max_length=8)
    lengths = prompt_mask.sum(dim=1)
    free = HFRollout(policy, tokenizer, RolloutConfig(do_sample=False, decode=decode), 8)
    cut = HFRollout(policy, tokenizer, RolloutConfig(do_sample=False, decode=decode, max_model_len=9), 8)
    free_ids, free_mask = free.generate(prompt_ids, prompt_mask)
    cut_ids, cut_mask = cut.generate(prompt_ids, prompt_mask)
    room = (9 - lengths).clamp(max=8)
    assert cut_mask.shape == free_mask.shape == (3, 8), "padded to the response length as always"
    for row in range(3):
        kept = int(min(room[row], free_mask[row].sum()))
        assert int(cut_mask[row].sum()) == kept
        assert torch.equal(cut_ids[row, :kept], free_ids[row, :kept]), "the same tokens up to the cut"
        assert bool((cut_ids[row, kept:] == tokenizer.pad_token_id).all())


def rows_that_fit(rows: int, *overrides: str) -> int:
    """Generation._rows_that_fit for a config, on a machine with no memory probe (no GPU budget)."""
    generation = SimpleNamespace(config=load_config(None, list(overrides)), memory=SimpleNamespace(probe=None))
    return Generation._rows_that_fit(generation, rows, 8)  # type: ignore[arg-type]


def test_the_decode_pieces_hold_at_most_max_num_seqs_and_max_num_batched_tokens_sequences() -> None:
    rollout = "actor_rollout_ref.rollout"
    assert rows_that_fit(1000) == 256, "verl's default max_num_seqs"
    assert rows_that_fit(100) == 100
    assert rows_that_fit(1000, f"{rollout}.max_num_seqs=64") == 64
    # A decode step processes one token per sequence: 48 tokens a step hold 48 sequences.
    assert rows_that_fit(1000, f"{rollout}.max_num_seqs=512", f"{rollout}.max_num_batched_tokens=48") == 48
