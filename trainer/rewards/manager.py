"""Turn a batch of responses into one score each: rule-based scorers or a reward model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trainer.config import KEYS
from trainer.rewards.custom import RewardFunctionError, as_float_score
from trainer.rollout.batch import RolloutBatch
from trainer.workers.recovery import WorkerMemory, run_in_pieces

ScoreFunction = Callable[[str, str, Any, dict | None], Any]


class RewardFunction(Protocol):
    errors: int
    """Responses scored 0 so far because the scoring function raised (custom_reward_function.on_error: zero)."""

    def __call__(self, batch: RolloutBatch) -> torch.Tensor:
        """[B] float scores, one per response."""
        ...


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] scores -> [B, R] token-level scores, each on its response's last token (EOS included)."""
    token_scores = torch.zeros_like(response_mask, dtype=torch.float32)
    last = (response_mask.sum(dim=1).long() - 1).clamp(min=0)
    token_scores[torch.arange(len(scores), device=scores.device), last] = scores.float()
    return token_scores


def decode_responses(batch: RolloutBatch, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The responses as text, without padding or EOS."""
    return tokenizer.batch_decode(batch.response_ids.masked_fill(batch.response_mask == 0, tokenizer.pad_token_id),
                                  skip_special_tokens=True)


class RuleReward:
    """verl's naive reward manager: score(data_source, response text, ground truth, extra_info).

    `on_error`: what a RewardFunctionError (the user's function raised) does: "raise" passes it on,
    "zero" scores the response 0, counts it in `errors` and warns the first time.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, compute_score: ScoreFunction, *,
                 on_error: str = "raise", warn: Callable[[str], None] = print):
        self.tokenizer = tokenizer
        self.compute_score = compute_score
        self.on_error = on_error
        self.warn = warn
        self.errors = 0

    def __call__(self, batch: RolloutBatch) -> torch.Tensor:
        texts = decode_responses(batch, self.tokenizer)
        scores = [self._score(record.data_source, text, record.ground_truth, record.extra_info)
                  for record, text in zip(batch.records, texts, strict=True)]
        return torch.tensor(scores, dtype=torch.float32, device=batch.response_ids.device)

    def _score(self, data_source: str, text: str, ground_truth: Any, extra_info: dict | None) -> float:
        try:
            return as_float_score(self.compute_score(data_source, text, ground_truth, extra_info))
        except RewardFunctionError as error:
            if self.on_error != "zero":
                raise
            self.errors += 1
            if self.errors == 1:
                self.warn(f"{error.what}: scored 0 ({KEYS.custom_reward_function.on_error}: zero); the reward/errors "
                          "metric counts such responses")
            return 0.0


class ModelReward:
    """A sequence classifier scores the prompt and response, re-tokenized with its own tokenizer."""

    def __init__(self, model: PreTrainedModel, policy_tokenizer: PreTrainedTokenizerBase,
                 reward_tokenizer: PreTrainedTokenizerBase, *, micro_batch_size: int, max_length: int,
                 memory: WorkerMemory | None = None):
        self.model = model
        self.policy_tokenizer = policy_tokenizer
        self.reward_tokenizer = reward_tokenizer
        self.micro_batch_size = micro_batch_size
        self.max_length = max_length
        self.memory = memory  # the memory manager's, for this model: out-of-memory errors retried or split
        self.errors = 0  # a model's scores never fail one by one

    def _texts(self, batch: RolloutBatch) -> list[str]:
        responses = decode_responses(batch, self.policy_tokenizer)
        texts = []
        for record, response in zip(batch.records, responses, strict=True):
            if isinstance(record.prompt, list) and self.reward_tokenizer.chat_template:
                messages = [*record.prompt, {"role": "assistant", "content": response}]
                texts.append(self.reward_tokenizer.apply_chat_template(messages, tokenize=False))
            else:
                prompt = record.prompt if isinstance(record.prompt, str) else "\n".join(
                    message["content"] for message in record.prompt)
                texts.append(f"{prompt} {response}")
        return texts

    @torch.no_grad()
    def __call__(self, batch: RolloutBatch) -> torch.Tensor:
        device = batch.response_ids.device
        texts = self._texts(batch)
        # Right padding: the classifier reads the score at the last non-pad token.
        self.reward_tokenizer.padding_side = "right"

        def score(first: int, count: int) -> torch.Tensor:
            encoded = self.reward_tokenizer(texts[first:first + count], return_tensors="pt",
                                            padding=True, truncation=True, max_length=self.max_length)
            output = self.model(input_ids=encoded["input_ids"].to(device),
                                attention_mask=encoded["attention_mask"].to(device))
            return output.logits[:, 0].float()

        return torch.cat(run_in_pieces(score, len(texts), self.micro_batch_size, memory=self.memory))
