"""The run's prompts against its tokenizer, checked once at start before any model is built (the
tokenizer alone is cheap): each prompt's length against data.max_prompt_length, and the share of
prompt tokens the tokenizer does not know, which it would train on as <unk>."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from trainer.config import KEYS
from trainer.data.records import DataError, PromptRecord
from trainer.rollout.prompts import PromptTooLong

UNKNOWN_TOKEN_LIMIT = 0.03
"""The largest share of unknown prompt tokens a run starts with. Real tokenizers know (nearly) every
token of text; above a few percent the tokenizer does not fit the data, and a policy that reads
<unk> for the words that matter learns nothing (a reward of exactly 0, and no word about why)."""

Seen = Callable[[PromptRecord], str | list[dict[str, Any]]]
"""A record's prompt as the model sees it: a vision-language model's with each <image> written as its image's vision
tokens (models/vision_language.py: ImageProcessor.seen_prompt), as verl's dataset counts it through the processor."""

_BATCH = 1024  # prompts tokenized per call: batched for speed, bounded for memory


class UnknownTokens(DataError):
    """Too many prompt tokens are unknown to the tokenizer."""


def check_prompts(records: Sequence[PromptRecord], tokenizer: PreTrainedTokenizerBase, *, files_key: str,
                  max_length: int, truncation: str, tokenizer_setting: str, tokenizer_name: str,
                  template_kwargs: Mapping[str, Any] | None = None, seen: Seen | None = None) -> None:
    """Raise PromptTooLong for the first prompt over `max_length` tokens (with truncation "error") or
    of no tokens, and UnknownTokens when more than UNKNOWN_TOKEN_LIMIT of all tokens are unknown.
    `files_key` (data.train_files), `tokenizer_setting` and `tokenizer_name` go into the messages. With `seen`, a
    prompt counts as the model sees it (its images' tokens included)."""
    unknown_id = tokenizer.unk_token_id
    unknown = total = 0
    first_unknown: list[PromptRecord] = []
    for record, ids in zip(records, _token_ids(records, tokenizer, template_kwargs, seen), strict=True):
        if not ids:
            raise PromptTooLong(f"{record.source}: the prompt is empty after tokenization; every prompt needs "
                                "at least one token")
        if len(ids) > max_length and truncation == "error":
            images = " (its images' vision tokens included)" if seen is not None and record.images else ""
            raise PromptTooLong(f"{record.source}: the prompt has {len(ids)} tokens{images}, more than "
                                f"{KEYS.data.max_prompt_length}={max_length}; raise it or set {KEYS.data.truncation} "
                                "to left or right")
        total += len(ids)
        if unknown_id is not None:
            count = ids.count(unknown_id)
            unknown += count
            if count and len(first_unknown) < 3:
                first_unknown.append(record)
    if total and unknown / total > UNKNOWN_TOKEN_LIMIT:
        words = ", ".join(repr(word) for word in _unknown_words(first_unknown, tokenizer, template_kwargs, seen))
        examples = f"e.g. {words} in {first_unknown[0].source}" if words else f"e.g. in {first_unknown[0].source}"
        raise UnknownTokens(f"{unknown / total:.0%} of the prompt tokens of {files_key} ({unknown} of {total}) are "
                            f"unknown to the tokenizer ({tokenizer_name}; {examples}): training would read "
                            f"{tokenizer.unk_token} in their "
                            f"place; set {tokenizer_setting} to a tokenizer that covers the data (at most "
                            f"{UNKNOWN_TOKEN_LIMIT:.0%} may be unknown)")


def drop_overlong_prompts(records: Sequence[PromptRecord], tokenizer: PreTrainedTokenizerBase,
                          max_length: int, template_kwargs: Mapping[str, Any] | None = None,
                          seen: Seen | None = None) -> list[PromptRecord]:
    """The records whose prompt has at most `max_length` tokens, as the rollout tokenizes it (verl's
    data.filter_overlong_prompts, which counts the chat template's tokens too, and with `seen` its images')."""
    return [record for record, ids in zip(records, _token_ids(records, tokenizer, template_kwargs, seen), strict=True)
            if len(ids) <= max_length]


def _texts(records: Sequence[PromptRecord], tokenizer: PreTrainedTokenizerBase,
           template_kwargs: Mapping[str, Any] | None, seen: Seen | None = None) -> list[tuple[str, bool]]:
    """(text, add special tokens) per prompt, as trainer/rollout/prompts.py prompt_token_ids tokenizes it."""
    prompts = [seen(record) if seen is not None and record.images else record.prompt for record in records]
    return [(prompt, True) if isinstance(prompt, str)
            else (str(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False,
                                                    **(template_kwargs or {}))), False)
            for prompt in prompts]


def _token_ids(records: Sequence[PromptRecord], tokenizer: PreTrainedTokenizerBase,
               template_kwargs: Mapping[str, Any] | None, seen: Seen | None = None) -> Iterator[list[int]]:
    for start in range(0, len(records), _BATCH):
        texts = _texts(records[start:start + _BATCH], tokenizer, template_kwargs, seen)
        ids: dict[int, list[int]] = {}
        for special in (True, False):
            positions = [index for index, (_, add) in enumerate(texts) if add == special]
            if positions:
                encoded = tokenizer([texts[index][0] for index in positions], add_special_tokens=special)
                ids.update(zip(positions, encoded["input_ids"], strict=True))
        yield from (ids[index] for index in range(len(texts)))


def _unknown_words(records: Sequence[PromptRecord], tokenizer: PreTrainedTokenizerBase,
                   template_kwargs: Mapping[str, Any] | None, seen: Seen | None = None) -> list[str]:
    """Up to three distinct pieces of the prompts' text that became the unknown token."""
    words: list[str] = []
    if not tokenizer.is_fast:  # only fast tokenizers map tokens back to the text
        return words
    for text, special in _texts(records, tokenizer, template_kwargs, seen):
        encoded = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        for token, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True):
            if token == tokenizer.unk_token_id and text[start:end] not in words:
                words.append(text[start:end])
    return words[:3]
