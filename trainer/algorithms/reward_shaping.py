"""Reward shaping as pure tensor functions: what a reward manager adds to a response's score besides the score.

Shapes: ``B`` is the batch (one row per response).
"""

from __future__ import annotations

import torch


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer_length: int,
                     penalty_factor: float) -> torch.Tensor:
    """DAPO's overlong reward shaping, as verl's dapo reward manager applies it: ``[B]`` response lengths in
    tokens (EOS included) -> ``[B]`` float32 penalties, added to the responses' scores.

    With L_max = ``max_response_length`` and L_cache = ``buffer_length``, a response of length L gets

        min(-(L - (L_max - L_cache)) / L_cache * penalty_factor, 0)

    0 up to L_max - L_cache tokens, then falling linearly to -penalty_factor at L_max (Yu et al. 2025, "DAPO: An
    Open-Source LLM Reinforcement Learning System at Scale", sec. 3.4, Overlong Reward Shaping). As in verl it is
    not floored past L_max (the paper's -1): a response longer than ``max_response_length`` (a max_resp_len below
    the rollout's own limit) is penalised further.

    Args:
        response_lengths: ``[B]`` tokens of each response.
        max_response_length: L_max, the length the buffer ends at.
        buffer_length: L_cache >= 1, the tokens before L_max over which the penalty grows.
        penalty_factor: the penalty at L_max.
    """
    if buffer_length < 1:
        raise ValueError(f"the overlong buffer must be at least 1 token long, got {buffer_length}")
    excess = response_lengths.float() - (max_response_length - buffer_length)
    return (-excess / buffer_length * penalty_factor).clamp(max=0.0)
