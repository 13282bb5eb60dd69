"""Turn prompt records into left-padded token ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from trainer.config import KEYS
from trainer.errors import UserError


class PromptTooLong(UserError, ValueError):
    """A prompt over data.max_prompt_length with data.truncation=error."""


def prompt_token_ids(prompt: str | list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase,
                     template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Chat messages go through the tokenizer's chat template (given `template_kwargs`: verl's
    data.apply_chat_template_kwargs); plain text is tokenized as is."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=True)["input_ids"]
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **(template_kwargs or {}))
    # The template already wrote any special tokens it wants.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_prompts(
    prompts: Sequence[str | list[dict[str, Any]]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    truncation: str = "error",
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded [N, P] ids and mask, P the longest prompt (at most max_length)."""
    rows = []
    for prompt in prompts:
        ids = prompt_token_ids(prompt, tokenizer, template_kwargs)
        if len(ids) > max_length:
            if truncation == "error":
                raise PromptTooLong(f"a prompt has {len(ids)} tokens, more than {KEYS.data.max_prompt_length}="
                                    f"{max_length}; raise it or set {KEYS.data.truncation} to left or right")
            ids = ids[-max_length:] if truncation == "left" else ids[:max_length]
        if not ids:
            raise PromptTooLong("a prompt is empty after tokenization; every prompt needs at least one token")
        rows.append(ids)
    width = max(len(ids) for ids in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, ids in enumerate(rows):
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        mask[row, width - len(ids):] = 1
    return input_ids, mask
