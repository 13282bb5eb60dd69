"""Turn a batch of responses into one score each: verl's naive manager (rule-based scorers) or a reward model.
verl's other managers (dapo, prime, batch) and the registry of them all: managers.py."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trainer.config import KEYS
from trainer.errors import RunSetupError
from trainer.rewards.custom import RewardFunctionError, split_score
from trainer.rollout.batch import RolloutBatch
from trainer.workers.packing import check_packable, packed_boundary_keywords
from trainer.workers.recovery import WorkerMemory, run_in_pieces

ScoreFunction = Callable[[str, str, Any, dict | None], Any]


class RewardScores(NamedTuple):
    """What a reward manager gives for a batch of B responses."""

    scores: torch.Tensor
    """[B] float32: each response's reward."""
    extra: list[dict[str, Any]]
    """B dicts: what the scoring reported of each response besides its reward (verl's reward_extra_info: a scoring
    function's dict entries, dapo's acc and overlong penalty); empty dicts where it reported nothing."""

    def metrics(self) -> dict[str, float]:
        """reward/<name>/mean of each number the responses reported (over those that reported it; true is 1)."""
        values: dict[str, list[float]] = {}
        for reported in self.extra:
            for name, value in reported.items():
                if is_number(value):
                    values.setdefault(name, []).append(float(value))
        return {f"reward/{name}/mean": sum(given) / len(given) for name, given in values.items()}


def is_number(value: Any) -> bool:
    """A finite number or a bool (numpy's too): what a metric can average."""
    return isinstance(value, numbers.Real) and math.isfinite(float(value))


class RewardFunction(Protocol):
    errors: int
    """Responses scored 0 so far because the scoring failed (custom_reward_function.on_error: zero; prime's)."""

    def score(self, batch: RolloutBatch) -> RewardScores:
        """Each response's reward, and what else its scoring reported."""
        ...

    def __call__(self, batch: RolloutBatch) -> torch.Tensor:
        """[B] float scores, one per response."""
        ...


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] scores -> [B, R] token-level scores, each on its response's last token (EOS included): the last the mask
    marks (a multi-turn response's last token of the model's own)."""
    token_scores = torch.zeros_like(response_mask, dtype=torch.float32)
    positions = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    last = ((response_mask > 0).long() * positions).amax(dim=1).sub(1).clamp(min=0)  # [B]; 0 for an empty mask
    token_scores[torch.arange(len(scores), device=scores.device), last] = scores.float()
    return token_scores


def decode_responses(batch: RolloutBatch, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The responses as text, without padding or EOS."""
    return tokenizer.batch_decode(batch.response_ids.masked_fill(batch.response_real_mask == 0, tokenizer.pad_token_id),
                                  skip_special_tokens=True)


class RuleReward:
    """verl's naive reward manager: score(data_source, response text, ground truth, extra_info) per response. A
    scorer's dict result is its "score" and what else it reports (RewardScores.extra).

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
        return self.score(batch).scores

    def score(self, batch: RolloutBatch) -> RewardScores:
        texts = self._texts(batch)
        scored = [self._score(record.data_source, text, record.ground_truth, record.extra_info)
                  for record, text in zip(batch.records, texts, strict=True)]
        return RewardScores(torch.tensor([score for score, _ in scored], dtype=torch.float32,
                                         device=batch.response_ids.device), [extra for _, extra in scored])

    def _texts(self, batch: RolloutBatch) -> list[str]:
        return decode_responses(batch, self.tokenizer)

    def _score(self, data_source: str, text: str, ground_truth: Any,
               extra_info: dict | None) -> tuple[float, dict[str, Any]]:
        try:
            result = self.compute_score(data_source, text, ground_truth, extra_info)
        except RewardFunctionError as error:
            self._zeroed(error, 1)
            return 0.0, {}
        score, _ = split_score(result)
        return score, self._extra(result, score)

    def _extra(self, result: Any, score: float) -> dict[str, Any]:
        """What a response's scoring reported besides its reward: a dict result's entries (verl's naive)."""
        return dict(result) if isinstance(result, dict) else {}

    def _zeroed(self, error: RewardFunctionError, count: int) -> None:
        """`count` responses whose scoring raised `error`: passed on, or (on_error: zero) scored 0 and counted."""
        if self.on_error != "zero":
            raise error
        self.errors += count
        if self.errors == count:
            self.warn(f"{error.what}: scored 0 ({KEYS.custom_reward_function.on_error}: zero); the reward/errors "
                      "metric counts such responses")


class ModelReward:
    """A sequence classifier scores the prompt and response, re-tokenized with its own tokenizer. With
    `remove_padding` each micro-batch's sequences go through it as one padding-free row (as the actor's do) and each
    score is read at the position the padded forward reads it at: the same scores, without the padding's compute."""

    def __init__(self, model: PreTrainedModel, policy_tokenizer: PreTrainedTokenizerBase,
                 reward_tokenizer: PreTrainedTokenizerBase, *, micro_batch_size: int, max_length: int,
                 memory: WorkerMemory | None = None, remove_padding: bool = False):
        self.model = model
        self.policy_tokenizer = policy_tokenizer
        self.reward_tokenizer = reward_tokenizer
        self.micro_batch_size = micro_batch_size
        self.max_length = max_length
        self.memory = memory  # the memory manager's, for this model: out-of-memory errors retried or split
        self.errors = 0  # a model's scores never fail one by one
        self.head: torch.nn.Module | None = None  # with remove_padding: the head whose per-token output is read
        if remove_padding:
            setting = KEYS.reward_model.model.use_remove_padding
            check_packable(model, setting)
            self.head = score_head(model, setting)

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

    def __call__(self, batch: RolloutBatch) -> torch.Tensor:
        return self.score(batch).scores

    @torch.no_grad()
    def score(self, batch: RolloutBatch) -> RewardScores:
        device = batch.response_ids.device
        texts = self._texts(batch)
        # Right padding: the classifier reads the score at the last non-pad token.
        self.reward_tokenizer.padding_side = "right"

        def score(first: int, count: int) -> torch.Tensor:
            encoded = self.reward_tokenizer(texts[first:first + count], return_tensors="pt",
                                            padding=True, truncation=True, max_length=self.max_length)
            input_ids, attention_mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
            if self.head is not None:
                return self._padding_free_scores(input_ids, attention_mask)
            output = self.model(input_ids=input_ids, attention_mask=attention_mask)
            return output.logits[:, 0].float()

        scores = torch.cat(run_in_pieces(score, len(texts), self.micro_batch_size, memory=self.memory))
        return RewardScores(scores, [{} for _ in texts])

    def _padding_free_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B] scores of right-padded [B, T] sequences from one padding-free forward: the head's output at each
        sequence's last token that is not the pad token, where transformers' sequence classifiers pool it."""
        assert self.head is not None
        real = attention_mask.bool()
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        pooled = (positions * (input_ids != self.model.config.pad_token_id)).argmax(dim=1)
        row_index = real.flatten().cumsum(0).view(real.shape) - 1  # each real token's place in the packed row
        read_at = row_index[torch.arange(len(input_ids), device=input_ids.device), pooled]
        outputs: list[torch.Tensor] = []
        handle = self.head.register_forward_hook(lambda module, args, output: outputs.append(output))
        try:
            self.model(input_ids=input_ids[real].unsqueeze(0),
                       position_ids=(attention_mask.cumsum(dim=1) - 1)[real].unsqueeze(0),
                       use_cache=False, **packed_boundary_keywords(self.model, real.sum(dim=1)))
        finally:
            handle.remove()
        return outputs[-1][0, read_at, 0].float()


def score_head(model: PreTrainedModel, setting: str) -> torch.nn.Module:
    """The head of a sequence classifier (transformers' decoder classifiers call it `score`), whose output at every
    position a padding-free forward reads; a model without one is refused, naming `setting`."""
    head = getattr(model, "score", None)
    if not isinstance(head, torch.nn.Module):
        raise RunSetupError(f"{setting}: true, but {type(model).__name__} has no `score` head whose output at each "
                            f"token a padding-free forward could read; set {setting}=false")
    return head
