"""verl's geo3k rule (verl/utils/reward_score/geo3k.py): 0.9 for the right boxed answer, 0.1 for the format."""

from __future__ import annotations

import pytest

from trainer.rewards.scorers import default_compute_score


@pytest.mark.parametrize(("response", "truth", "score"), [
    (r"<think>two sides</think> The answer is \boxed{12}.", "12", 1.0),  # right and formatted
    (r"\boxed{12.0}", "12", 0.9),  # right as a number, no <think>
    (r"<think>x</think> \boxed{7}", "12", 0.1),  # formatted, wrong
    (r"<think>x</think> \boxed{\frac{2}{3}} then \boxed{4 \sqrt{3}}", r"4\sqrt{3}", 1.0),  # the last box, nested
    ("12", "12", 0.0),  # no box: no answer
])
def test_the_geo3k_score(response: str, truth: str, score: float) -> None:
    assert default_compute_score("hiyouga/geometry3k", response, truth) == pytest.approx(score)
