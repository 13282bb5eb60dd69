"""Validation in a real run on the CPU (trainer/validation.py): verl's val_kwargs (validation's own sampling, n
responses per prompt and verl's metrics of them), trainer.log_val_generations (responses in the log and to the
trackers) and trainer.validation_data_dir (every response in a file)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.data import write_records
from trainer.data.builtin import counting_records
from trainer.loop import Trainer
from trainer.rollout.batch import RolloutBatch
from trainer.validation import ValidationSample

ARO = "actor_rollout_ref"
TINY = [
    f"{ARO}.model.override_config={{num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}}",
    "data.train_batch_size=4", f"{ARO}.actor.ppo_mini_batch_size=4", f"{ARO}.actor.ppo_micro_batch_size_per_gpu=4",
    "data.max_prompt_length=8", "data.max_response_length=4", "trainer.device=cpu", "trainer.save_freq=-1",
    "trainer.total_training_steps=1", "algorithm.adv_estimator=grpo", f"{ARO}.rollout.n=2",
    "data.val_batch_size=4", "trainer.val_only=true",
]


class Generations:
    """An observer that takes the validation generations, as the trackers do."""

    def __init__(self) -> None:
        self.shown: list[tuple[int, Sequence[ValidationSample]]] = []

    def on_step(self, step: int, metrics: object) -> None:
        pass

    def on_validation_generations(self, step: int, samples: Sequence[ValidationSample]) -> None:
        self.shown.append((step, samples))


def run_overrides(tmp_path: Path, *overrides: str) -> list[str]:
    """The tiny run, validating four prompts of the counting task."""
    prompts = tmp_path / "validation.jsonl"
    write_records(counting_records(4, seed=1), prompts)
    return [*TINY, f"data.val_files=[{prompts}]", f"trainer.runs_dir={tmp_path / 'runs'}", *overrides]


def validated(tmp_path: Path, *overrides: str, logs: list[str] | None = None,
              observers: Sequence[object] = ()) -> tuple[Trainer, dict[str, float]]:
    config = load_config(None, run_overrides(tmp_path, *overrides))
    trainer = Trainer(config, log=(logs.append if logs is not None else lambda *_: None), warn=lambda *_: None,
                      observers=observers)
    trainer.fit()
    [row] = trainer.metrics_log.read()
    return trainer, row


def test_greedy_validation_with_n_responses_repeats_each_and_reports_verls_figures_of_n(tmp_path: Path) -> None:
    _, one = validated(tmp_path, "trainer.experiment_name=one")
    _, two = validated(tmp_path, f"{ARO}.rollout.val_kwargs.n=2", "trainer.experiment_name=two")
    assert one["val-core/counting/reward/mean@1"] == pytest.approx(two["val-core/counting/reward/mean@2"])
    assert two["val-aux/counting/reward/std@2"] == 0.0, "greedy: a prompt's two responses are the same"
    assert two["val-core/counting/reward/best@2/mean"] == pytest.approx(two["val-core/counting/reward/mean@2"])
    assert {"val-aux/counting/reward/worst@2/mean", "val-core/counting/reward/best@2/std"} <= set(two)
    assert not any(key.endswith("@1") for key in two if key.startswith("val-"))


def test_validation_samples_with_val_kwargs(tmp_path: Path) -> None:
    sampling = [f"{ARO}.rollout.val_kwargs.do_sample=true", f"{ARO}.rollout.val_kwargs.temperature=1.5",
                f"{ARO}.rollout.val_kwargs.n=2", f"{ARO}.rollout.val_kwargs.top_k=0"]
    config = load_config(None, run_overrides(tmp_path, *sampling))
    trainer = Trainer(config, log=lambda *_: None, warn=lambda *_: None)
    rollout = trainer.validator.sampling()
    assert (rollout.do_sample, rollout.temperature, rollout.top_k) == (True, 1.5, 0)
    scored: list[RolloutBatch] = []
    reward = trainer.validator.reward
    original = reward.score
    reward.score = lambda batch: (scored.append(batch), original(batch))[1]  # type: ignore[method-assign]
    trainer.fit()
    responses = [row.tolist() for batch in scored for row in batch.response_ids]
    pairs = list(zip(responses[::2], responses[1::2], strict=True))
    assert len(pairs) == 4 and any(first != second for first, second in pairs), "sampled: a prompt's two differ"
    greedy = load_config(None, run_overrides(tmp_path, f"{ARO}.rollout.val_kwargs.do_sample=true"))
    assert greedy.actor_rollout_ref.rollout.val_kwargs.samples is False, "temperature 0 decodes greedily, as verl's"


def test_log_val_generations_writes_that_many_responses_to_the_log_and_the_trackers(tmp_path: Path) -> None:
    logs: list[str] = []
    generations = Generations()
    _, row = validated(tmp_path, "trainer.log_val_generations=3", logs=logs, observers=[generations])
    heading = [line for line in logs if line.startswith("validation generations")]
    assert heading == ["validation generations at step 0 (3 of 4 responses; trainer.log_val_generations):"]
    shown = [line for line in logs if line.startswith("[prompt] ")]
    assert len(shown) == 3 and all("\n[response] " in line and "\n[score] " in line for line in shown)
    [(step, samples)] = generations.shown
    assert step == 0 and len(samples) == 3 and all(sample.prompt and sample.score >= 0 for sample in samples)
    assert "val-core/counting/reward/mean@1" in row


def test_validation_data_dir_gets_every_response_as_verls_json_line(tmp_path: Path) -> None:
    logs: list[str] = []
    folder = tmp_path / "generations"
    _, row = validated(tmp_path, f"trainer.validation_data_dir={folder}", logs=logs)
    lines = [json.loads(line) for line in (folder / "0.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(lines) == 4 and all(set(line) == {"input", "output", "gts", "score", "step"} for line in lines)
    records = counting_records(4, seed=1)
    assert [line["gts"] for line in lines] == [record.ground_truth for record in records], "in the prompts' order"
    assert all(line["step"] == 0 and record.prompt in line["input"]
               for line, record in zip(lines, records, strict=True))
    assert sum(line["score"] for line in lines) / 4 == pytest.approx(row["val-core/counting/reward/mean@1"])
    assert f"validation generations written to {folder / '0.jsonl'} (trainer.validation_data_dir)" in logs
