"""DAPO's overlong penalty (trainer/algorithms/reward_shaping.py) against values worked out by hand."""

from __future__ import annotations

import pytest
import torch

from trainer.algorithms.reward_shaping import overlong_penalty


def test_the_penalty_is_zero_before_the_buffer_and_falls_linearly_over_it() -> None:
    # L_max 20, a buffer of 8 tokens: free up to 12 tokens, then -factor * (L - 12) / 8.
    lengths = torch.tensor([1, 12, 13, 16, 20, 24])
    penalties = overlong_penalty(lengths, max_response_length=20, buffer_length=8, penalty_factor=1.0)
    assert penalties.tolist() == [0.0, 0.0, -0.125, -0.5, -1.0, -1.5], "past L_max it goes on falling, as verl's"
    assert penalties.dtype == torch.float32


def test_the_factor_scales_the_penalty() -> None:
    lengths = torch.tensor([10, 14, 16])
    penalties = overlong_penalty(lengths, max_response_length=16, buffer_length=4, penalty_factor=0.5)
    assert penalties.tolist() == [0.0, -0.25, -0.5]


def test_a_buffer_of_no_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 token"):
        overlong_penalty(torch.tensor([3]), max_response_length=4, buffer_length=0, penalty_factor=1.0)
