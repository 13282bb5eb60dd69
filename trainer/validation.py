"""Validation: the actor's responses to the validation prompts, sampled as actor_rollout_ref.rollout.val_kwargs says
(verl's default: greedy, one per prompt), scored by the run's reward, with verl's val-core/val-aux metrics per data
source. With several ranks each scores its share of every validation batch, and the responses are gathered.
trainer.log_val_generations: that many responses (prompt, response, score) go to the log and to the observers that
take them (the experiment trackers), as verl logs them. trainer.validation_data_dir: every response, as one JSON line
(verl's input, output, gts, score, step and what the reward manager reported) in <dir>/<step>.jsonl.

The metrics are verl's (ray_trainer._val_metrics_update and metric_utils.process_validation_metrics), from each
response's score and what its scoring reported. For each data source, each variable (`reward`: the response's score;
and each number the reward manager reported: a scoring function's dict entries, dapo's `acc` and `overlong_reward`)
and each prompt's n responses:

- ``mean@n``, and with n > 1 ``std@n`` (population);
- for k = 2, 4, 8, ... below n and k = n: ``best@k/mean`` and ``best@k/std`` (``worst@k/...``), the mean and standard
  deviation of the best (worst) of k responses drawn with replacement, over 1000 draws (a bootstrap, seeded: the
  same responses give the same figures);
- with a reported ``pred`` (the answer a response gives), ``maj@k/mean`` and ``maj@k/std``: the variable's value of
  the answer most of k drawn responses give (majority voting).

Each is averaged over the data source's prompts and named ``val-core/<source>/<variable>/<metric>`` for the core
variable (``acc`` where the manager reports it, else ``reward``) and its mean@n, best@n and maj@n, and
``val-aux/...`` for the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from trainer.config import KEYS, RolloutConfig, RunConfig
from trainer.data import PromptRecord
from trainer.dumps import decode_texts, generation_lines, write_generations
from trainer.generation import Generation
from trainer.rewards.manager import RewardFunction
from trainer.rewards.time_limit import StepInterrupted
from trainer.rollout.batch import RolloutBatch

BOOTSTRAP_DRAWS = 1000
BOOTSTRAP_SEED = 42


@dataclass(frozen=True)
class ValidationSample:
    """One validation response, as the ranks gather them."""

    data_source: str
    prompt_index: int
    """The prompt's place among the validation prompts (verl's uid): a prompt's n responses share it."""
    response_index: int
    """Which of its prompt's n responses this is."""
    score: float
    reported: dict[str, Any] = field(default_factory=dict)
    """What the reward manager reported besides the score (verl's reward_extra_info)."""
    prompt: str = ""
    """The prompt and response as text: kept only where they are shown (log_val_generations) or written
    (validation_data_dir)."""
    response: str = ""
    ground_truth: Any = None
    """The prompt's ground truth (verl's gts), for validation_data_dir."""


def validation_metrics(samples: Sequence[ValidationSample], seed: int = BOOTSTRAP_SEED) -> dict[str, float]:
    """verl's val-core/val-aux metrics of the validation responses (the module's docstring)."""
    by_source: dict[str, dict[int, dict[str, list[Any]]]] = {}
    for sample in samples:
        variables = by_source.setdefault(sample.data_source, {}).setdefault(sample.prompt_index, {})
        for name, value in {"reward": sample.score, **sample.reported}.items():
            variables.setdefault(name, []).append(value)
    metrics: dict[str, float] = {}
    for source, prompts in by_source.items():
        per_prompt: dict[str, dict[str, list[float]]] = {}  # variable -> metric -> one value per prompt
        for variables in prompts.values():
            answers = variables.get("pred")
            for name, values in variables.items():
                if not all(_is_number(value) for value in values):
                    continue  # text (an answer, a note) is no metric
                numbers = np.array(values, dtype=np.float64)
                for metric, value in prompt_metrics(numbers, answers, seed).items():
                    per_prompt.setdefault(name, {}).setdefault(metric, []).append(value)
        core = "acc" if "acc" in per_prompt else "reward"
        for name, named in per_prompt.items():
            largest = max(int(metric.split("@")[1].split("/")[0]) for metric in named)
            for metric, values in named.items():
                section = ("val-core" if name == core and metric.startswith(("mean", "maj", "best"))
                           and f"@{largest}" in metric else "val-aux")
                metrics[f"{section}/{source}/{name}/{metric}"] = float(np.mean(values))
    return metrics


def prompt_metrics(values: np.ndarray, answers: Sequence[Any] | None, seed: int) -> dict[str, float]:
    """One variable's metrics over one prompt's n responses [n] (`answers`: each response's `pred`, or None)."""
    count = len(values)
    metrics = {f"mean@{count}": float(values.mean())}
    if count == 1:
        return metrics
    metrics[f"std@{count}"] = float(values.std())
    for size in bootstrap_sizes(count):
        draws = bootstrap_draws(count, size, seed)
        metrics[f"best@{size}/mean"], metrics[f"best@{size}/std"] = _mean_and_std(values[draws].max(axis=1))
        metrics[f"worst@{size}/mean"], metrics[f"worst@{size}/std"] = _mean_and_std(values[draws].min(axis=1))
        if answers is not None:
            majority = [majority_value(values[drawn], [answers[index] for index in drawn])
                        for drawn in bootstrap_draws(count, size, seed)]
            metrics[f"maj@{size}/mean"], metrics[f"maj@{size}/std"] = _mean_and_std(np.array(majority))
    return metrics


def bootstrap_sizes(count: int) -> list[int]:
    """The k of best@k for n responses: 2, 4, 8, ... below n, then n."""
    sizes, size = [], 2
    while size < count:
        sizes.append(size)
        size *= 2
    return [*sizes, count]


def bootstrap_draws(count: int, size: int, seed: int) -> np.ndarray:
    """[BOOTSTRAP_DRAWS, size] indices of `count` responses drawn with replacement: the draws verl's bootstrap_metric
    makes (numpy's legacy generator seeded with `seed`, as np.random.seed and np.random.choice give them)."""
    return np.random.RandomState(seed).choice(count, size=(BOOTSTRAP_DRAWS, size), replace=True)


def majority_value(values: np.ndarray, answers: Sequence[Any]) -> float:
    """The value of the first response that gives the answer most responses give (the first such answer on a tie)."""
    counts: dict[Any, int] = {}
    first: dict[Any, float] = {}
    for value, answer in zip(values.tolist(), answers, strict=True):
        counts[answer] = counts.get(answer, 0) + 1
        first.setdefault(answer, value)
    return first[max(counts, key=counts.__getitem__)]


def sample_generations(samples: Sequence[ValidationSample], count: int,
                       seed: int = BOOTSTRAP_SEED) -> list[ValidationSample]:
    """The `count` responses trainer.log_val_generations shows, as verl picks them: sorted by prompt, shuffled by a
    seeded generator, the first `count`; the same ones at every validation (their prompts' responses change)."""
    ordered = sorted(samples, key=lambda sample: sample.prompt)
    shuffled = [ordered[index] for index in np.random.RandomState(seed).permutation(len(ordered))]
    return shuffled[:count]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float | np.number | np.bool_) and bool(np.isfinite(float(value)))


def _mean_and_std(values: np.ndarray) -> tuple[float, float]:
    return float(values.mean()), float(values.std())


class Validator:
    """Scores the actor's responses to the validation prompts."""

    def __init__(self, config: RunConfig, records: Sequence[PromptRecord], generation: Generation,
                 reward: RewardFunction, *, publish_updates: Callable[[], None],
                 log: Callable[[str], None] = print, observers: Sequence[object] = (),
                 step: Callable[[], int] = lambda: 0):
        self.config = config
        self.records = records
        self.generation = generation
        self.reward = reward
        self.publish_updates = publish_updates  # a delayed update applied: validation scores the weights after it
        self.log = log
        # Those with on_validation_generations(step, samples) get trainer.log_val_generations' responses (the
        # trackers); the list is the trainer's own, to which observers are added after it is built.
        self.observers = observers
        self.step = step  # the step whose weights are validated, for the generations' records

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
        """`validate`'s metrics and timing_s/testing; none when a stop came while the user's reward function was
        stuck scoring a response (the step validation follows is complete: the trainer goes on to checkpoint it)."""
        start = time.perf_counter()
        try:
            metrics = self.validate()
        except StepInterrupted as interrupted:
            self.log(f"{interrupted}: validation at step {self.step()} is abandoned; the step is checkpointed")
            return {}
        return {**metrics, "timing_s/testing": time.perf_counter() - start}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """verl's validation metrics of the responses (val-core/<source>/reward/mean@n, ...: the module's
        docstring), having shown trainer.log_val_generations of them."""
        self.publish_updates()
        generation = self.generation
        responses = self.config.actor_rollout_ref.rollout.val_kwargs.n
        rollout = generation.rollout_like(self.sampling())
        gathered: dict[tuple[int, int], ValidationSample] = {}
        size = self.config.data.val_batch_size or len(self.records)  # null: all at once, as verl
        for start in range(0, len(self.records), size):
            indexed, scored = generation.run_wide.validation_share(
                list(enumerate(self.records[start:start + size], start)))
            batch = generation.generate([record for _, record in indexed], rollout=rollout, n=responses)
            mine = self._samples(batch, [index for index, _ in indexed], responses)[:scored * responses]
            # The ranks of a sequence-parallel group score the same responses: each response is kept once.
            for rank_samples in generation.ranks.gather_objects(mine):
                gathered.update(((sample.prompt_index, sample.response_index), sample) for sample in rank_samples)
        samples = [gathered[key] for key in sorted(gathered)]
        self._show_generations(samples)
        self._write_generations(samples)
        return validation_metrics(samples)

    def sampling(self) -> RolloutConfig:
        """The rollout's settings with validation's sampling (val_kwargs) in place of the training's."""
        rollout = self.config.actor_rollout_ref.rollout
        sampling = rollout.val_kwargs
        if not sampling.samples:
            return rollout.model_copy(update={"do_sample": False})
        return rollout.model_copy(update={"do_sample": True, "temperature": sampling.temperature,
                                          "top_p": sampling.top_p, "top_k": sampling.top_k})

    def _samples(self, batch: RolloutBatch, prompt_indices: list[int], responses: int) -> list[ValidationSample]:
        """Each response of `batch` (prompt i's at i * responses ...) as a ValidationSample; texts only when some of
        them are shown."""
        scored = self.reward.score(batch)
        texts = self.config.trainer.log_val_generations > 0 or self.config.trainer.validation_data_dir is not None
        tokenizer = self.generation.tokenizer
        prompts = decode_texts(tokenizer, batch.prompt_ids, batch.prompt_mask) if texts else None
        replies = decode_texts(tokenizer, batch.response_ids, batch.response_real_mask) if texts else None
        return [ValidationSample(record.data_source, prompt_indices[position // responses], position % responses,
                                 score, scored.extra[position], prompts[position] if prompts else "",
                                 replies[position] if replies else "", record.ground_truth)
                for position, (record, score) in enumerate(zip(batch.records, scored.scores.tolist(), strict=True))]

    def _show_generations(self, samples: Sequence[ValidationSample]) -> None:
        """trainer.log_val_generations of the responses, to the log and the observers that take them (rank 0's)."""
        count = self.config.trainer.log_val_generations
        if count == 0 or not self.generation.ranks.is_main:
            return
        shown = sample_generations(samples, count)
        step = self.step()
        self.log(f"validation generations at step {step} ({len(shown)} of {len(samples)} responses; "
                 f"{KEYS.trainer.log_val_generations}):")
        for sample in shown:
            self.log(f"[prompt] {sample.prompt}\n[response] {sample.response}\n[score] {sample.score:g}")
        for observer in self.observers:
            take = getattr(observer, "on_validation_generations", None)
            if take is not None:
                take(step, shown)

    def _write_generations(self, samples: Sequence[ValidationSample]) -> None:
        """trainer.validation_data_dir: every response as a line of <dir>/<step>.jsonl, as verl dumps them (rank 0's):
        input, output, gts, score, step, and each entry the reward manager reported for every response."""
        folder = self.config.trainer.validation_data_dir
        if folder is None or not self.generation.ranks.is_main:
            return
        step = self.step()
        lines = generation_lines([sample.prompt for sample in samples], [sample.response for sample in samples],
                                 [sample.ground_truth for sample in samples], [sample.score for sample in samples],
                                 [sample.reported for sample in samples], step)
        path = write_generations(folder, step, lines)
        self.log(f"validation generations written to {path} ({KEYS.trainer.validation_data_dir})")
