"""The typed container one RL step passes from phase to phase."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch


@dataclass
class RolloutBatch:
    """Prompts, sampled responses and everything computed from them during one step.

    Shapes: B sequences (prompts x rollout.n), P the longest prompt, R the response length.
    Prompts are left-padded and responses right-padded, so prompt + response is contiguous.
    The fields after ``records`` start as None and are filled phase by phase.
    """

    prompt_ids: torch.Tensor
    """[B, P] token ids, left-padded."""
    prompt_mask: torch.Tensor
    """[B, P] 1 for prompt tokens, 0 for padding."""
    response_ids: torch.Tensor
    """[B, R] sampled token ids, right-padded after EOS."""
    response_mask: torch.Tensor
    """[B, R] float, 1 for response tokens up to and including EOS."""
    group_index: torch.Tensor
    """[B] long: responses to the same prompt share a group (GRPO compares within it)."""
    records: list[Any]
    """B PromptRecords (data_source, ground_truth, extra_info), one per sequence."""

    old_log_probs: torch.Tensor | None = None
    """[B, R] log-probs of the responses under the policy that sampled them."""
    ref_log_probs: torch.Tensor | None = None
    """[B, R] log-probs under the frozen reference policy."""
    sum_pi_squared: torch.Tensor | None = None
    """[B, R] float32: the policy's sum over the vocabulary of squared probabilities at each response position, from
    the old-log-prob pass (actor.calculate_sum_pi_squared, or an estimator that reads it)."""
    reward_baselines: torch.Tensor | None = None
    """[B] the score of the greedy response to each sequence's prompt (ReMax's baseline, generated with the rollout)."""
    values: torch.Tensor | None = None
    """[B, R] critic values of the state before each response token."""
    token_level_scores: torch.Tensor | None = None
    """[B, R] the reward of each response, placed on its last token."""
    token_level_rewards: torch.Tensor | None = None
    """[B, R] scores less the in-reward KL penalty (equal to scores without it)."""
    advantages: torch.Tensor | None = None
    """[B, R] advantages of each response token."""
    returns: torch.Tensor | None = None
    """[B, R] value targets."""
    rollout_log_probs: torch.Tensor | None = None
    """[B, R] log-probs the rollout gave the tokens it sampled, at the sampling temperature (when it records them)."""
    rollout_is_weights: torch.Tensor | None = None
    """[B, R] rollout correction's truncated importance weights pi_old / pi_rollout (detached; 0 at padding)."""
    rollout_rs_mask: torch.Tensor | None = None
    """[B, R] response_mask less the tokens rollout correction's rejection left out of training (`training_mask`)."""
    response_attention: torch.Tensor | None = None
    """[B, R] float: 1 on every real response token, where a multi-turn rollout put tool or user turns between the
    model's (response_mask then marks the model's own tokens alone); None: response_mask."""
    multi_modal_inputs: list[dict[str, torch.Tensor]] | None = None
    """B dicts, a vision-language model's inputs of each sequence's images (verl's multi_modal_inputs: pixel_values
    [patches, D], image_grid_thw [images, 3]; {} for a row without images); None: a text model."""

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        """[B, P + R] prompt and response, as the models read them."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """[B, P + R] long mask of real tokens."""
        return torch.cat([self.prompt_mask.long(), self.response_real_mask.long()], dim=1)

    @property
    def response_real_mask(self) -> torch.Tensor:
        """[B, R] every real response token: the model's, and a multi-turn rollout's tool and user turns."""
        return self.response_mask if self.response_attention is None else self.response_attention

    @property
    def position_ids(self) -> torch.Tensor:
        """[B, P + R] positions counted from each sequence's first real token."""
        return (self.attention_mask.cumsum(dim=1) - 1).clamp(min=0)

    @property
    def training_mask(self) -> torch.Tensor:
        """[B, R] the response tokens the advantages, the critic's and the actor's losses and the step's
        advantage/return/value metrics read: rollout_rs_mask where rejection ran, else response_mask. verl's
        rollout correction replaces its batch's response_mask so (rollout_corr_helper.py); the forwards here read
        response_mask, as verl's read attention_mask: a rejected token is still attended to."""
        return self.response_mask if self.rollout_rs_mask is None else self.rollout_rs_mask

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] number of response tokens (a multi-turn response's tool and user turns included, as verl counts)."""
        return self.response_real_mask.sum(dim=1)

    def select(self, indices: Sequence[int] | torch.Tensor) -> RolloutBatch:
        """The sequences at `indices`, in that order."""
        index = torch.as_tensor(indices, dtype=torch.long)
        updates = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                updates[field.name] = value[index.to(value.device)]
            elif field.name in ("records", "multi_modal_inputs") and value is not None:
                updates[field.name] = [value[i] for i in index.tolist()]
        return replace(self, **updates)

    def split(self, size: int) -> Iterator[RolloutBatch]:
        """Consecutive slices of `size` sequences (the last may be shorter)."""
        for start in range(0, len(self), size):
            yield self.select(range(start, min(start + size, len(self))))

    def to(self, device: torch.device | str) -> RolloutBatch:
        updates = {field.name: getattr(self, field.name).to(device) for field in fields(self)
                   if isinstance(getattr(self, field.name), torch.Tensor)}
        return replace(self, **updates)
