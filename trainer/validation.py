"""Validation: greedy responses to the validation prompts, scored, with the mean score per data source under verl's
val-core keys. With several ranks each scores its share of every validation batch, and the scores are gathered."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from trainer.config import RunConfig
from trainer.config.messages import Role
from trainer.data import PromptRecord
from trainer.generation import Generation
from trainer.rewards.manager import RewardFunction
from trainer.rollout.hf_rollout import HFRollout


class Validator:
    """Scores the actor's greedy responses to the validation prompts."""

    def __init__(self, config: RunConfig, records: Sequence[PromptRecord], generation: Generation,
                 reward: RewardFunction, *, publish_updates: Callable[[], None]):
        self.config = config
        self.records = records
        self.generation = generation
        self.reward = reward
        self.publish_updates = publish_updates  # a delayed update applied: validation scores the weights after it

    def due(self, step: int, total_steps: int) -> bool:
        """Whether the step just trained is validated: every trainer.test_freq steps, and the last one."""
        frequency = self.config.trainer.test_freq
        return bool(self.records) and frequency > 0 and (step % frequency == 0 or step == total_steps)

    def before_training(self, step: int) -> bool:
        """trainer.val_before_train (or val_only): the scores of the weights a fresh run starts from, as step 0's
        line (verl logs them at global step 0 too). Only a run starting at step 0: a resumed one has trained."""
        trainer = self.config.trainer
        return step == 0 and bool(self.records) and (trainer.val_before_train or trainer.val_only)

    def timed(self) -> dict[str, float]:
        """`validate`'s metrics and timing_s/testing."""
        start = time.perf_counter()
        metrics = self.validate()
        return {**metrics, "timing_s/testing": time.perf_counter() - start}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """The mean score of the greedy responses, per data source (val-core/<source>/reward/mean@1)."""
        self.publish_updates()
        generation = self.generation
        greedy = HFRollout(generation.rollout.model, generation.tokenizer,
                           self.config.actor_rollout_ref.rollout.model_copy(update={"do_sample": False}),
                           self.config.data.max_response_length, graph_safety=generation.memory.engine(Role.ACTOR),
                           synced=generation.ranks.distributed, agree_active=generation.ranks.count_agreement)
        scores: dict[str, list[float]] = {}
        size = self.config.data.val_batch_size or len(self.records)  # null: all at once, as verl
        for start in range(0, len(self.records), size):
            records, scored = generation.run_wide.validation_share(self.records[start:start + size])
            batch = generation.generate(records, rollout=greedy, n=1)
            mine = [(record.data_source, score)
                    for record, score in zip(batch.records, self.reward(batch).tolist(), strict=True)][:scored]
            for rank_scores in generation.ranks.gather_objects(mine):
                for source, score in rank_scores:
                    scores.setdefault(source, []).append(score)
        return {f"val-core/{source}/reward/mean@1": sum(values) / len(values) for source, values in scores.items()}
