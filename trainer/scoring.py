"""The step's `reward` phase: each response scored by the run's reward (a manager or the reward model), the score on
its last token, and, with trainer.rollout_data_dir, the step's responses written as verl dumps them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer.config import KEYS, RunConfig
from trainer.distributed.ranks import Ranks
from trainer.dumps import decode_texts, generation_lines, write_generations
from trainer.rewards.manager import place_on_last_token
from trainer.rewards.time_limit import bind_stop
from trainer.rollout.batch import RolloutBatch


class Scoring:
    """Called with a batch: its token_level_scores set, the phase's metrics returned."""

    def __init__(self, config: RunConfig, reward: Any, tokenizer: Any, ranks: Ranks, *, step: Callable[[], int],
                 log: Callable[[str], None] = print, stopping: Callable[[], bool] | None = None):
        self.rollout_data_dir = config.trainer.rollout_data_dir
        self.reward, self.tokenizer, self.ranks, self.step, self.log = reward, tokenizer, ranks, step, log
        if stopping is not None and not ranks.distributed:  # one rank: the step can be abandoned alone
            bind_stop(reward, stopping)  # a stop while the user's function is stuck abandons the step

    def __call__(self, batch: RolloutBatch) -> dict[str, float]:
        """Each response's reward on its last token (batch.token_level_scores); the responses scored 0 on an error
        (reward/errors) and the mean of each number the reward manager reported (reward/<name>/mean)."""
        errors = self.reward.errors
        scored = self.reward.score(batch)
        batch.token_level_scores = place_on_last_token(scored.scores, batch.response_mask)
        if self.rollout_data_dir is not None:
            self._write_rollouts(batch, scored.scores.tolist(), scored.extra)
        return {"reward/errors": self.reward.errors - errors, **scored.metrics()}

    def _write_rollouts(self, batch: RolloutBatch, scores: list[float], reported: list[dict[str, Any]]) -> None:
        """trainer.rollout_data_dir: the step's responses, every data-parallel rank's, as verl dumps them
        (trainer/dumps.py), written by rank 0."""
        step = self.step() + 1  # the step being trained
        lines = generation_lines(decode_texts(self.tokenizer, batch.prompt_ids, batch.prompt_mask),
                                 decode_texts(self.tokenizer, batch.response_ids, batch.response_real_mask),
                                 [record.ground_truth for record in batch.records],
                                 scores, reported, step)
        # The ranks of a sequence-parallel group hold the same responses: its first rank's are written.
        everyone = self.ranks.gather_objects(lines if self.ranks.sp_rank == 0 else [])
        if self.ranks.is_main:
            path = write_generations(self.rollout_data_dir or "", step,
                                     [line for rank_lines in everyone for line in rank_lines])
            self.log(f"step {step}'s responses written to {path} ({KEYS.trainer.rollout_data_dir})")
