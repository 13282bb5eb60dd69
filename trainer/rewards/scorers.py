"""Rule-based scorers, picked by a prompt's ``data_source`` as in verl's ``default_compute_score``."""

from __future__ import annotations

import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

from trainer.config import KEYS
from trainer.errors import UserError

Scorer = Callable[[str, Any], float]

# A number as people write it: optional sign, thousands commas, decimals; a sentence's final "."
# is not part of it.
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_STRICT_ANSWER = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


class UnknownDataSource(UserError, ValueError):
    """No built-in scorer for a prompt's data_source."""


def score_counting(solution_str: str, ground_truth: Any) -> float:
    """Share of answer words in place, over the longer of answer and response.

    Dividing by the response length too means words after the answer cost reward, which is
    what teaches a model to stop.
    """
    truth = str(ground_truth).split()
    response = solution_str.split()
    longest = max(len(truth), len(response))
    if longest == 0:
        return 0.0
    matches = sum(1 for expected, given in zip(truth, response, strict=False) if expected == given)
    return matches / longest


def score_gsm8k(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                score: float = 1.0) -> float:
    """verl's GSM8K rule: ``score`` for the right number, ``format_score`` for a wrong one, else 0.

    strict reads the number after the last "#### "; flexible reads the last number in the text.
    """
    if method == "strict":
        found = _STRICT_ANSWER.findall(solution_str)
    elif method == "flexible":
        found = _ANY_NUMBER.findall(solution_str)
    else:
        raise ValueError(f"method {method!r} is not a GSM8K answer rule; allowed: strict, flexible")
    if not found:
        return 0.0
    right = _normalise_number(found[-1]) == _normalise_number(str(ground_truth))
    return float(score) if right else float(format_score)


def score_final_number(solution_str: str, ground_truth: Any) -> float:
    """1.0 when the last number in the response equals ``ground_truth``, else 0.0.

    For generated arithmetic (examples/data_preprocess/arithmetic.py): an instruct model answers "42", "The
    answer is 42." or "17 + 25 = 42", and the number it ends on is its answer. A response with no number
    (one cut off at the length limit before it got there) scores 0.
    """
    return score_gsm8k(solution_str, ground_truth, method="flexible")


def _normalise_number(text: str) -> str:
    """One spelling per value, so "1,800", "$1800" and "1800.00" compare equal."""
    text = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        return f"{Decimal(text).normalize():f}"
    except InvalidOperation:
        return text


_GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def score_geo3k(solution_str: str, ground_truth: Any, format_score: float = 0.1) -> float:
    """verl's geo3k rule (verl/utils/reward_score/geo3k.py): 0.9 for the right answer in the last \\boxed{...},
    plus 0.1 when the response is `<think>...</think>` then a boxed answer. verl grades the answer with mathruler's
    symbolic check; here the boxed text and the truth compare as numbers where both are, else as text without
    spaces and $ signs (the geometry3k answers are numbers and short expressions)."""
    answer = _last_boxed(solution_str)
    right = answer is not None and same_geo3k_answer(answer, ground_truth)
    formatted = _GEO3K_FORMAT.fullmatch(solution_str) is not None
    return (1.0 - format_score) * float(right) + format_score * float(formatted)


def same_geo3k_answer(answer: str, ground_truth: Any) -> bool:
    """Whether `answer` is `ground_truth`: as numbers where both are, else as text without spaces and $ signs."""
    return _normalise_number(answer.replace(" ", "")) == _normalise_number(str(ground_truth).replace(" ", ""))


def _last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} of `text`, its braces balanced; None without one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[begin:index]
    return None


SCORERS: dict[str, Scorer] = {
    "counting": score_counting,
    "openai/gsm8k": score_gsm8k,
    "gsm8k": score_gsm8k,
    "arithmetic": score_final_number,
    "hiyouga/geometry3k": score_geo3k,
}


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: dict[str, Any] | None = None) -> float:
    """verl's scorer signature: dispatch on ``data_source`` to a built-in scorer."""
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise UnknownDataSource(
            f"no built-in scorer for data_source {data_source!r}; known: {', '.join(sorted(SCORERS))}; "
            f"set {KEYS.custom_reward_function.path} to a Python file that defines "
            "compute_score(data_source, solution_str, ground_truth, extra_info)")
    return float(scorer(solution_str, ground_truth))
