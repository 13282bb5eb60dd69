"""Batched sampling with transformers' generate on the actor's own weights."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
)

from trainer.config import RolloutConfig
from trainer.models.vision_language import forward_inputs, is_vision_language, vision_token_ids
from trainer.rollout.static_decode import SAFE_POINT_EVERY, GraphSafety, Sampling, StaticDecoder


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends a response: the tokenizer's eos and the model's (chat models have several)."""
    ids = {tokenizer.eos_token_id}
    model_eos = model.generation_config.eos_token_id
    if model_eos is not None:
        ids.update(model_eos if isinstance(model_eos, list) else [model_eos])
    return sorted(ids)


def response_mask_until_eos(response_ids: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """[B, R] float mask: 1 up to and including the first EOS, 0 after it."""
    is_eos = torch.isin(response_ids, torch.tensor(eos_ids, device=response_ids.device))
    # Count EOS tokens seen strictly before each position; the response is what precedes the first.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return (eos_before == 0).float()


def within_model_length(mask: torch.Tensor, prompt_mask: torch.Tensor, max_model_len: int) -> torch.Tensor:
    """[B, R] response mask cut where each row's prompt and response reach `max_model_len` tokens (its prompt's
    real tokens: [B, P] prompt_mask), as verl's engines stop a response there (rollout.max_model_len)."""
    room = (max_model_len - prompt_mask.sum(dim=1, keepdim=True)).clamp(min=0)  # [B, 1] tokens left per row
    positions = torch.arange(mask.shape[1], device=mask.device)[None, :]
    return mask * (positions < room).to(mask.dtype)


class SafePoints(StoppingCriteria):
    """Calls `callback` every `every` decoded tokens, between two forwards of the decode loop (no
    pass in flight: dynamic offload may move layers there). It never stops the generation."""

    def __init__(self, callback: Callable[[], object], every: int = SAFE_POINT_EVERY):
        self.callback = callback
        self.every = every
        self.tokens = 0

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.tokens += 1
        if self.tokens % self.every == 0:
            self.callback()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class SampledLogProbs(LogitsProcessor):
    """Records the log-prob of each token transformers' generate samples, at `temperature`, from the raw logits:
    generate runs a caller's processors before its own sampling warpers (temperature, top-k, top-p), with the ids so
    far. One step's log-softmax is kept until the next call, whose ids end in the token sampled from it; `read`
    takes the last one's. It changes no score."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.columns: list[torch.Tensor] = []
        self._last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._last is not None:
            self.columns.append(self._last.gather(1, input_ids[:, -1:]).squeeze(1))
        self._last = (scores.float() / self.temperature).log_softmax(dim=-1)
        return scores

    def read(self, responses: torch.Tensor) -> torch.Tensor:
        """[B, T] fp32 log-probs of `responses`, the [B, T] tokens generate returned (a step it undid is dropped)."""
        columns = self.columns[:responses.shape[1]]
        if len(columns) < responses.shape[1] and self._last is not None:
            columns.append(self._last.gather(1, responses[:, len(columns):len(columns) + 1]).squeeze(1))
        if not columns:
            return torch.zeros(responses.shape, dtype=torch.float32, device=responses.device)
        return torch.stack(columns, dim=1)


class Sampled(NamedTuple):
    """What one rollout of a batch of prompts gives. Shapes: B prompts, R = response_length."""

    response_ids: torch.Tensor
    """[B, R] sampled token ids, right-padded after EOS."""
    response_mask: torch.Tensor
    """[B, R] float, 1 up to and including EOS."""
    log_probs: torch.Tensor | None
    """[B, R] fp32 log-prob of each sampled token at the sampling temperature, 0 on padding (None: not recorded)."""


class HFRollout:
    """Samples `response_length` tokens at most per prompt, stopping at EOS; with `record_log_probs`, records the
    log-prob the model gave each token it sampled (rollout correction's pi_rollout: `sample`)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: RolloutConfig,
                 response_length: int, *, safe_point: Callable[[], object] | None = None,
                 graph_safety: GraphSafety | None = None, synced: bool = False,
                 agree_active: Callable[[int], int] | None = None, warn: Callable[[str], None] | None = None,
                 record_log_probs: bool = False):
        self.model = model
        self.record_log_probs = record_log_probs
        self.temperature = config.temperature  # the actor scores at it, greedy or not
        # A model sharded over several ranks (FSDP2) gathers each layer's shards from all of them in every
        # forward, so every rank must run as many forwards. transformers' synced_gpus keeps a rank whose
        # responses have all ended stepping (its outputs discarded) until every rank's have. Where the whole
        # weights fit, the training loop holds them on every rank for the rollout instead (gathered once:
        # sharding.whole_weights), the forwards gather nothing, and it sets `synced` False for that rollout.
        self.synced = synced
        """Whether this rank's forwards meet other ranks' (the caller sets it per rollout: False while every rank
        holds the whole weights and FSDP2's hooks are off, `sharding.plain_forwards`: each rank then decodes alone,
        captured in CUDA graphs like one rank's)."""
        self._agree_active = agree_active
        if synced and agree_active is None and config.decode == "static":
            raise ValueError("a static decode synced over several ranks needs their agreement (agree_active)")
        self.safe_point = safe_point  # called between decode chunks (dynamic offload)
        self.response_length = response_length
        self.max_model_len = config.max_model_len
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id
        # A fresh config on purpose: a checkpoint's own generation defaults (repetition penalty,
        # top_k=20, ...) would silently change the sampling distribution the losses assume. (generate()
        # still fills this config's unset fields from the model's: see `generate`.)
        self.generation_config = GenerationConfig(
            max_new_tokens=response_length,
            do_sample=config.do_sample,
            temperature=config.temperature if config.do_sample else None,
            top_p=config.top_p if config.do_sample else None,
            top_k=max(config.top_k, 0) if config.do_sample else None,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            use_cache=True,
        )
        if is_vision_language(model):
            # A response that holds an image placeholder token would ask the forward for an image it has not got.
            self.generation_config.suppress_tokens = vision_token_ids(model)
        self.decode = config.decode
        self._decoded_static = False  # whether the last generate decoded with the static decoder
        # A vision-language model decodes with transformers' generate, which passes the images to the first forward
        # and keeps the multimodal RoPE positions; the static decode is text-only.
        self.decoder = None if config.decode == "generate" or is_vision_language(model) else StaticDecoder(
            model, eos_ids=self.eos_ids, pad_id=self.pad_id,
            sampling=Sampling(do_sample=config.do_sample, temperature=config.temperature,
                              top_k=max(config.top_k, 0), top_p=config.top_p),
            cuda_graphs=not config.enforce_eager, safety=graph_safety, warn=warn)

    def _decodes_static(self, device: torch.device) -> bool:
        """rollout.decode: static, or auto on a GPU for a model transformers marks as fit for a static cache and
        a captured step (the flag its own generate reads before compiling one)."""
        if self.decode == "static":
            return True
        if self.synced:
            # auto: transformers' generate, synced_gpus (the static decode, synced, captures no graph: where each
            # forward gathers, it is not measured against generate yet).
            return False
        model_class = type(self.model)
        return (device.type == "cuda" and bool(getattr(model_class, "_can_compile_fullgraph", False))
                and not getattr(model_class, "_is_stateful", False))

    def refills(self, device: torch.device) -> bool:
        """Whether a batch larger than the rows that decode at once goes to `sample` whole: the static decode then
        refills a finished row's slot with the next waiting prompt (continuous batching, refill.py) instead of the
        batch decoding in pieces, each until its longest row ends."""
        return (self.decoder is not None and not self.synced and self._decodes_static(device)
                and self.decoder.refills())

    def decode_memory(self) -> dict[str, float]:
        """What the last static decode held on the device besides the weights, as step metrics (GB): its KV cache
        and its CUDA graphs' pool (the phase planner learns them within the rollout's peak); nothing after a
        generate."""
        if self.decoder is None or not self._decoded_static:
            return {}
        return {"rollout/kv_cache_gb": self.decoder.cache_bytes / 2**30,
                "rollout/graph_pool_gb": self.decoder.graph_pool_bytes / 2**30}

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, P] left-padded prompts -> ([B, R] response ids right-padded, [B, R] response mask)."""
        sampled = self.sample(prompt_ids, prompt_mask)
        return sampled.response_ids, sampled.response_mask

    @torch.no_grad()
    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, slots: int | None = None,
               multi_modal: Sequence[dict[str, torch.Tensor]] = ()) -> Sampled:
        """[B, P] left-padded prompts -> the responses, their mask and, with `record_log_probs`, their log-probs
        (recorded from the sampling step's own logits: the static decode inside its captured step, generate through
        a logits processor). `slots`: the static decode decodes at most that many rows at once (`refills`).
        `multi_modal`: a vision-language model's inputs of each row's images (RolloutBatch.multi_modal_inputs)."""
        was_training = self.model.training
        model_defaults = self.model.generation_config
        self.model.eval()
        # transformers fills every field our config leaves unset (None) from the model's own
        # generation_config (a checkpoint's repetition_penalty, min_p, suppress_tokens, ...): for the
        # call, the model's defaults are transformers' global ones, which change nothing.
        self.model.generation_config = GenerationConfig()
        try:
            self._decoded_static = self.decoder is not None and self._decodes_static(prompt_ids.device)
            log_probs = None
            length = self._tokens_to_decode(prompt_mask)
            if self.decoder is not None and self._decoded_static:
                self.decoder.agree_active = self._agree_active if self.synced else None
                self.decoder.keep_log_probs = self.record_log_probs
                responses = self.decoder.generate(prompt_ids, prompt_mask, length, self.safe_point, slots)
                log_probs = self.decoder.log_probs if self.record_log_probs else None
            else:
                stopping = StoppingCriteriaList([SafePoints(self.safe_point)] if self.safe_point is not None else [])
                recorder = SampledLogProbs(self.temperature) if self.record_log_probs else None
                generation_config = self.generation_config
                if length != generation_config.max_new_tokens:  # rollout.max_model_len leaves every row less room
                    generation_config = copy.deepcopy(generation_config)
                    generation_config.max_new_tokens = length
                sequences = self.model.generate(
                    input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=generation_config,
                    stopping_criteria=stopping, synced_gpus=self.synced,
                    logits_processor=LogitsProcessorList([recorder] if recorder is not None else []),
                    **forward_inputs(self.model, prompt_ids, multi_modal),
                )
                responses = sequences[:, prompt_ids.shape[1]:]
                log_probs = recorder.read(responses) if recorder is not None else None
        finally:
            self.model.generation_config = model_defaults
            self.model.train(was_training)
        padding = self.response_length - responses.shape[1]
        if padding > 0:
            responses = torch.nn.functional.pad(responses, (0, padding), value=self.pad_id)
            log_probs = None if log_probs is None else torch.nn.functional.pad(log_probs, (0, padding))
        mask = response_mask_until_eos(responses, self.eos_ids)
        if self.max_model_len is not None:
            mask = within_model_length(mask, prompt_mask, self.max_model_len)
        responses = responses.masked_fill(mask == 0, self.pad_id)
        return Sampled(responses, mask, None if log_probs is None else log_probs * mask)

    def _tokens_to_decode(self, prompt_mask: torch.Tensor) -> int:
        """response_length, or fewer where rollout.max_model_len leaves even the shortest prompt less room (several
        ranks decode as many tokens: the synced decode steps together, so each decodes response_length)."""
        if self.max_model_len is None or self.synced or prompt_mask.shape[0] == 0:
            return self.response_length
        shortest = int(prompt_mask.sum(dim=1).min())
        return max(1, min(self.response_length, self.max_model_len - shortest))
