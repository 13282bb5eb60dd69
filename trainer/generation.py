"""The step's rollout: prompts in, a RolloutBatch of sampled responses out, with the actor's weights staged for it.

A batch decodes whole, or in as many pieces as rollout.gpu_memory_utilization leaves room for; a piece that runs out
of device memory is retried once layers moved off, or in halves. On several ranks every rank pads its prompts like
the others and decodes as many pieces.

ReMax's baseline (algorithm.adv_estimator=remax), the score of the actor's greedy response to each prompt, is
generated here too: verl decodes it in the step's generation, after the sampled responses (its `gen_max` timing),
and scores it with the same reward; the trainer does the same inside its `gen` phase (`timing_s/gen_max`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from trainer.config import KEYS, RolloutConfig, RunConfig
from trainer.config.messages import Role
from trainer.data import PromptRecord
from trainer.data.records import Prompt
from trainer.distributed.run_wide import RunWide
from trainer.errors import RunSetupError
from trainer.memory import MemoryManager
from trainer.models import torch_dtype
from trainer.models.vision_language import ImageProcessor, is_vision_language
from trainer.rewards.manager import RewardFunction
from trainer.rollout.batch import RolloutBatch
from trainer.rollout.budget import KVCacheShape, over_budget_message, rows_within_budget
from trainer.rollout.hf_rollout import HFRollout
from trainer.rollout.multi_turn import multi_turn_rollout
from trainer.rollout.prompts import encode_prompts
from trainer.staging import Staging
from trainer.workers.recovery import run_in_pieces


class Generation:
    """Samples responses to prompts with the actor's weights: the step's rollout and validation's greedy one."""

    def __init__(self, config: RunConfig, tokenizer: PreTrainedTokenizerBase, rollout: HFRollout,
                 staging: Staging, run_wide: RunWide, *, heartbeat: Callable[[], None], log: Callable[[str], None],
                 warn: Callable[[str], None]):
        self.config = config
        self.tokenizer = tokenizer
        self.rollout = rollout
        self.staging = staging
        self.memory: MemoryManager = staging.memory
        self.run_wide = run_wide
        self.ranks = run_wide.ranks
        self.device = run_wide.ranks.device
        self.heartbeat = heartbeat
        self.log, self.warn = log, warn
        self._over_budget_warned = False  # rollout.gpu_memory_utilization leaves no room: said once
        self._decode_memory_logged = 0.0  # GiB the static decode held when the log last said so
        self.multi_turn = multi_turn_rollout(config, tokenizer, log)  # None: one turn
        # A vision-language model's prompts carry their images (None: a text model's).
        self.images = (ImageProcessor.load(config.actor_rollout_ref.model.path, tokenizer)
                       if is_vision_language(rollout.model) else None)
        if self.images is not None and config.data.truncation != "error":
            raise RunSetupError(f"{KEYS.data.truncation}: {config.data.truncation} with a vision-language model, whose "
                                "prompts cut short would lose vision tokens their images need; set error (and "
                                f"{KEYS.data.max_prompt_length} to hold the images' tokens)")

    def generate(self, records: Sequence[PromptRecord], rollout: HFRollout | None = None,
                 n: int | None = None, groups: Sequence[int] | None = None) -> RolloutBatch:
        """Sample n responses per prompt; the batch holds prompt i's responses at i*n ... i*n + n - 1, in group i,
        or in group groups[i] (a step whose sequences the ranks split: StepShare.groups)."""
        n = self.config.actor_rollout_ref.rollout.n if n is None else n
        repeated = [record for record in records for _ in range(n)]
        group_index = (torch.arange(len(records)) if groups is None else torch.tensor(list(groups))
                       ).to(self.device).repeat_interleave(n)
        prompts, multi_modal = self._prompts(records, n)
        if self.multi_turn is not None:
            return self._conversations(repeated, prompts, multi_modal, rollout or self.rollout, group_index)
        prompt_ids, prompt_mask = encode_prompts(prompts, self.tokenizer,
                                                 max_length=self.config.data.max_prompt_length,
                                                 truncation=self.config.data.truncation,
                                                 template_kwargs=self.config.data.apply_chat_template_kwargs)
        prompt_ids, prompt_mask = self.run_wide.pad_like_other_ranks(prompt_ids, prompt_mask,
                                                                     self.tokenizer.pad_token_id)
        if multi_modal is not None:  # rows added to match other ranks have no images
            multi_modal += [{}] * (len(prompt_ids) - len(multi_modal))
        images = (lambda first, count: {}) if multi_modal is None else (
            lambda first, count: {"multi_modal": multi_modal[first:first + count]})
        prompt_ids, prompt_mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        rollout = rollout or self.rollout  # either samples with the actor's weights
        self.heartbeat()  # once per validation batch too
        with self.staging("rollout", Role.ACTOR, len(repeated)) as alone:
            # Several ranks that each hold the whole weights, FSDP2's hooks off, decode alone (and in CUDA graphs);
            # otherwise every forward gathers, and the ranks step together.
            rollout.synced = self.ranks.distributed and not alone
            # A batch that runs out of device memory is retried once layers moved off, or in halves.
            rows = self.run_wide.fewest(self._rows_that_fit(len(repeated), prompt_ids.shape[1]))
            # The static decode takes the whole batch and refills finished rows' slots (`rows` at once) with it.
            refills = rollout.refills(self.device)
            slots = {"slots": rows} if refills else {}
            size = len(repeated) if refills else rows
            fillers = self._fillers(rollout, math.ceil(len(repeated) / size))
            pieces = run_in_pieces(lambda first, count: rollout.sample(prompt_ids[first:first + count],
                                                                       prompt_mask[first:first + count], **slots,
                                                                       **images(first, count)),
                                   len(repeated), size,
                                   memory=None if self.ranks.distributed else self.memory.for_role(Role.ACTOR))
            for _ in range(fillers):  # discarded: a shorter share's forwards to match another rank's
                rollout.sample(prompt_ids[:1], prompt_mask[:1], **slots, **images(0, 1))
        sampled = [torch.cat(parts) for parts in zip(*pieces, strict=True) if parts[0] is not None]
        # The ranks of a sequence-parallel group sampled the same prompts from the same random stream; their first
        # rank's responses go to the others, so that a kernel not bitwise deterministic on another device cannot
        # give the group different sequences to split.
        response_ids, response_mask, *log_probs = self.ranks.broadcast_in_sequence_group(sampled)
        return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                            response_mask=response_mask, group_index=group_index, records=repeated,
                            rollout_log_probs=log_probs[0] if log_probs else None, multi_modal_inputs=multi_modal)

    def _fillers(self, rollout: HFRollout, pieces: int) -> int:
        """How many more pieces a synced rollout (every forward gathers the shards) of `pieces` runs to match the
        rank that runs the most (uneven shares, use_dynamic_bsz): agreed before any piece runs."""
        return self.ranks.max(pieces) - pieces if rollout.synced else 0

    def _prompts(self, records: Sequence[PromptRecord], n: int
                 ) -> tuple[list[Prompt], list[dict[str, torch.Tensor]] | None]:
        """Each record's prompt n times over; for a vision-language model, with its images written as vision tokens,
        and each row's multi-modal inputs (the images processed once per prompt)."""
        if self.images is None:
            return [record.prompt for record in records for _ in range(n)], None
        processed = [self.images.prompt_inputs(record.prompt, record.images, record.source or "a prompt")
                     for record in records]
        return ([prompt for prompt, _ in processed for _ in range(n)],
                [inputs for _, inputs in processed for _ in range(n)])

    def _conversations(self, repeated: list[PromptRecord], texts: list[Prompt],
                       multi_modal: list[dict[str, torch.Tensor]] | None, rollout: HFRollout,
                       group_index: torch.Tensor) -> RolloutBatch:
        """The multi-turn rollout of `repeated` (trainer/rollout/multi_turn.py) from their prompts `texts`, each turn
        sampled by `_sample_turn`; synced over ranks, every rank samples as many turns. A vision-language model's
        rows keep their prompt's images (`multi_modal`) for every turn's generation and for the forwards after it, as
        verl's agent loop keeps its image_data; the tools answer in text."""
        assert self.multi_turn is not None
        prompt_ids, prompt_mask = encode_prompts(texts, self.tokenizer,
                                                 max_length=self.config.data.max_prompt_length,
                                                 truncation=self.config.data.truncation,
                                                 template_kwargs=self.multi_turn.prompt_kwargs())
        self.heartbeat()
        with self.staging("rollout", Role.ACTOR, len(repeated)) as alone:
            rollout.synced = self.ranks.distributed and not alone
            prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
            done = self.multi_turn.run(repeated, prompts,
                                       lambda ids, mask, images=(): self._sample_turn(rollout, ids, mask, images),
                                       agree=self.ranks.count_agreement if rollout.synced else None,
                                       multi_modal=multi_modal)
        prompt_ids, prompt_mask = self.run_wide.pad_like_other_ranks(done.prompt_ids, done.prompt_mask,
                                                                     self.tokenizer.pad_token_id)
        return RolloutBatch(prompt_ids=prompt_ids.to(self.device), prompt_mask=prompt_mask.to(self.device),
                            response_ids=done.response_ids.to(self.device),
                            response_mask=done.response_mask.to(self.device),
                            response_attention=done.response_attention.to(self.device),
                            group_index=group_index,
                            records=done.records,
                            rollout_log_probs=None if done.log_probs is None else done.log_probs.to(self.device),
                            multi_modal_inputs=multi_modal)

    def _sample_turn(self, rollout: HFRollout, ids: torch.Tensor, mask: torch.Tensor,
                     images: Sequence[dict[str, torch.Tensor]] = ()) -> list[torch.Tensor | None]:
        """One turn of the multi-turn rollout: on one rank in pieces, as the step's rollout decodes (max_num_seqs,
        the memory budget, a retry after running out of memory); on several ranks whole, so that every rank decodes
        as many pieces. `images`: each row's multi-modal inputs (a vision-language model's; () for a text one)."""
        ids, mask = ids.to(self.device), mask.to(self.device)
        if self.ranks.distributed:
            return list(rollout.sample(ids, mask, multi_modal=images))
        pieces = run_in_pieces(lambda first, count: rollout.sample(ids[first:first + count], mask[first:first + count],
                                                                   multi_modal=images[first:first + count]),
                               len(ids), self._rows_that_fit(len(ids), ids.shape[1]),
                               memory=self.memory.for_role(Role.ACTOR))
        return [None if parts[0] is None else torch.cat(parts) for parts in zip(*pieces, strict=True)]

    def rollout_like(self, settings: RolloutConfig, *, safe_point: Callable[[], object] | None = None,
                     warn: Callable[[str], None] | None = None) -> HFRollout:
        """A rollout of the step's model, placed and synced as the step's, sampling as `settings` say (validation's
        val_kwargs, ReMax's greedy baseline)."""
        return HFRollout(self.rollout.model, self.tokenizer, settings, self.config.data.max_response_length,
                         safe_point=safe_point, graph_safety=self.memory.engine(Role.ACTOR),
                         synced=self.ranks.distributed, agree_active=self.ranks.count_agreement, warn=warn)

    def decode_memory(self) -> dict[str, float]:
        """The static decode's KV cache and CUDA graphs' pool (rollout/kv_cache_gb, rollout/graph_pool_gb), said in
        the log the first time and when they grow by more than a tenth: device memory the rollout holds besides the
        weights, which the phase planner counts in the rollout's working memory."""
        held = self.rollout.decode_memory()
        if held:
            total = held["rollout/kv_cache_gb"] + held["rollout/graph_pool_gb"]
            if total > 1.1 * self._decode_memory_logged:
                self._decode_memory_logged = total
                self.log(f"static decode: KV cache {held['rollout/kv_cache_gb']:.2f} GiB, CUDA graphs' pool "
                         f"{held['rollout/graph_pool_gb']:.2f} GiB on the device beside the weights (the rollout's "
                         "working memory, which the phase planner learns)")
        return held

    def _rows_that_fit(self, rows: int, prompt_length: int) -> int:
        """How many of `rows` sequences decode at once: at most rollout.max_num_seqs and max_num_batched_tokens
        (vLLM's caps: sequences decoding together, tokens a decode step processes, one a sequence), and as many as
        rollout.gpu_memory_utilization leaves room for beside what is in use now (trainer/rollout/budget.py; a GPU
        only)."""
        settings = self.config.actor_rollout_ref.rollout
        rows = min(rows, settings.max_num_seqs, settings.max_num_batched_tokens)
        utilization = settings.gpu_memory_utilization
        if utilization is None or self.memory.probe is None:
            return rows
        in_use, capacity = self.memory.probe()
        element_bytes = torch_dtype(self.config.actor_rollout_ref.actor.fsdp_config.model_dtype).itemsize
        per_row = KVCacheShape.of(self.rollout.model.config).bytes_per_sequence(
            prompt_length + self.config.data.max_response_length, element_bytes)
        fitting = rows_within_budget(rows, utilization=utilization, in_use=in_use, capacity=capacity,
                                     bytes_per_row=per_row)
        if fitting == 0 and not self._over_budget_warned:
            self._over_budget_warned = True
            self.warn(over_budget_message(utilization=utilization, in_use=in_use, capacity=capacity,
                                          bytes_per_row=per_row))
        return max(1, fitting)


class GreedyBaseline:
    """ReMax's baseline (Li et al. 2023, arXiv:2310.10505): one greedy response per prompt with the actor's
    weights, scored with the run's reward."""

    def __init__(self, config: RunConfig, generation: Generation, reward: RewardFunction, staging: Staging, *,
                 synchronize: Callable[[], None], safe_point: Callable[[], object] | None = None,
                 warn: Callable[[str], None] | None = None):
        self.generation = generation
        self.reward = reward
        self.staging = staging
        self.synchronize = synchronize
        self.n = config.actor_rollout_ref.rollout.n
        # The rollout's own settings (decode, enforce_eager, top_k...) but greedy: verl's do_sample=False. Built once,
        # so that its static decode captures its graphs once.
        self.rollout = generation.rollout_like(config.actor_rollout_ref.rollout.model_copy(update={"do_sample": False}),
                                               safe_point=safe_point, warn=warn)
        self.seconds = 0.0
        """How long the last call took (timing_s/gen_max)."""

    @torch.no_grad()
    def __call__(self, records: Sequence[PromptRecord], copies: int | None = None) -> torch.Tensor:
        """[len(records) * copies] the score of each prompt's greedy response, once for each of its `copies` sampled
        responses (rollout.n; the batch's order: prompt i's at i*n ... i*n + n - 1)."""
        start = time.perf_counter()
        batch = self.generation.generate(records, rollout=self.rollout, n=1)
        with self.staging("scoring", Role.REWARD, len(batch)):
            scores = self.reward(batch).to(self.generation.device, torch.float32)
        baselines = scores.repeat_interleave(self.n if copies is None else copies)
        self.synchronize()
        self.seconds = time.perf_counter() - start
        return baselines
