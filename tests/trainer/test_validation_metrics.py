"""Validation's metrics under verl's names (trainer/validation.py): mean@n, std@n and the bootstrapped
best@k, worst@k and maj@k per data source, the core variable in val-core and the rest in val-aux; and which
responses trainer.log_val_generations shows."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from trainer.validation import (
    ValidationSample,
    bootstrap_sizes,
    sample_generations,
    validation_metrics,
)


def samples_of(source: str, scores_by_prompt: list[list[float]],
               reported: list[list[dict[str, Any]]] | None = None) -> list[ValidationSample]:
    return [ValidationSample(source, prompt, response, score, reported[prompt][response] if reported else {})
            for prompt, scores in enumerate(scores_by_prompt) for response, score in enumerate(scores)]


def verls_bootstrap(values: list[float], size: int, reduce: Any) -> tuple[float, float]:
    """verl's metric_utils.bootstrap_metric as it draws: the global generator seeded with 42, then np.random.choice."""
    np.random.seed(42)
    draws = np.random.choice(len(values), size=(1000, size), replace=True)
    results = np.array([reduce(np.array(values)[row]) for row in draws])
    return float(results.mean()), float(results.std())


def test_one_response_per_prompt_is_the_mean_of_each_source_under_val_core() -> None:
    samples = samples_of("gsm8k", [[1.0], [0.0], [1.0], [1.0]]) + samples_of("math", [[0.25], [0.75]])
    assert validation_metrics(samples) == {"val-core/gsm8k/reward/mean@1": 0.75, "val-core/math/reward/mean@1": 0.5}


def test_several_responses_give_verls_mean_std_best_and_worst_names_and_numbers() -> None:
    samples = samples_of("gsm8k", [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.5]])
    metrics = validation_metrics(samples)
    assert metrics["val-core/gsm8k/reward/mean@4"] == pytest.approx((0.5 + 0.125) / 2)
    assert metrics["val-aux/gsm8k/reward/std@4"] == pytest.approx((0.5 + np.std([0, 0, 0, 0.5])) / 2)
    for size in (2, 4):
        for name, reduce in (("best", np.max), ("worst", np.min)):
            first, second = verls_bootstrap([1.0, 0.0, 0.0, 1.0], size, reduce), \
                verls_bootstrap([0.0, 0.0, 0.0, 0.5], size, reduce)
            section = "val-core" if name == "best" and size == 4 else "val-aux"
            assert metrics[f"{section}/gsm8k/reward/{name}@{size}/mean"] == pytest.approx((first[0] + second[0]) / 2)
            assert metrics[f"{section}/gsm8k/reward/{name}@{size}/std"] == pytest.approx((first[1] + second[1]) / 2)
    assert len(metrics) == 2 + 2 * 2 * 2, "mean, std, and best and worst's mean and std at k = 2 and 4"
    assert metrics["val-core/gsm8k/reward/best@4/mean"] > metrics["val-core/gsm8k/reward/mean@4"] > \
        metrics["val-aux/gsm8k/reward/worst@4/mean"]


def test_the_sizes_of_best_of_k_double_up_to_n() -> None:
    assert [bootstrap_sizes(count) for count in (2, 3, 4, 5, 16)] == [[2], [2, 3], [2, 4], [2, 4, 5], [2, 4, 8, 16]]


def test_acc_is_the_core_variable_where_the_manager_reports_it_and_text_is_no_metric() -> None:
    reported = [[{"acc": 1.0, "overlong_reward": -0.5, "overlong": True, "pred": "42"}],
                [{"acc": 0.0, "overlong_reward": 0.0, "overlong": False, "pred": "7"}]]
    metrics = validation_metrics(samples_of("dapo", [[0.5], [0.0]], reported))
    assert metrics == {"val-core/dapo/acc/mean@1": 0.5, "val-aux/dapo/reward/mean@1": 0.25,
                       "val-aux/dapo/overlong_reward/mean@1": -0.25, "val-aux/dapo/overlong/mean@1": 0.5}


def test_a_reported_answer_gives_the_majority_vote() -> None:
    # Two of three responses answer "4" (score 1), one answers "5" (score 0): most draws of 3 vote "4".
    reported = [[{"pred": "4"}, {"pred": "5"}, {"pred": "4"}]]
    metrics = validation_metrics(samples_of("arith", [[1.0, 0.0, 1.0]], reported))

    def majority(rows: np.ndarray) -> float:
        answers = [["4", "5", "4"][index] for index in rows]
        return float(max(set(answers), key=answers.count) == "4")

    np.random.seed(42)
    draws = np.random.choice(3, size=(1000, 3), replace=True)
    votes = np.array([majority(row) for row in draws])
    assert metrics["val-core/arith/reward/maj@3/mean"] == pytest.approx(votes.mean())
    assert metrics["val-aux/arith/reward/maj@2/mean"] <= 1.0 and "val-aux/arith/reward/maj@2/std" in metrics


def test_the_generations_shown_are_the_ones_verl_picks() -> None:
    samples = [ValidationSample("s", index, 0, float(index), prompt=f"prompt {index % 5}", response=f"r{index}")
               for index in range(12)]
    ordered = sorted([(sample.prompt, sample.response, sample.score) for sample in samples], key=lambda row: row[0])
    np.random.RandomState(42).shuffle(ordered)  # verl's _maybe_log_val_generations
    shown = sample_generations(samples, 4)
    assert [(sample.prompt, sample.response, sample.score) for sample in shown] == ordered[:4]
    assert sample_generations(samples, 4) == shown, "the same ones every time"
    assert len(sample_generations(samples, 50)) == 12
