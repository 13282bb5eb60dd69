"""The arithmetic example's rule: the number an answer ends on."""

import pytest

from trainer.rewards import default_compute_score


@pytest.mark.parametrize("response, score", [
    ("42", 1.0),
    ("17 + 25 = 42", 1.0),  # the instruct model's habit: it restates the sum, then answers
    ("The answer is 42.", 1.0),
    ("17 + 25 = 32", 0.0),
    ("42 is close, but 17 + 25 = 43", 0.0),  # the last number is the answer
    ("Let me add 17 and", 0.0),  # cut off at the length limit before its answer: its last number is an operand
    ("Let me add", 0.0),  # no number at all
    ("1,042", 0.0),  # read whole, not as its last digits
    ("-7", 0.0),
])
def test_the_arithmetic_score_reads_the_final_number(response, score):
    assert default_compute_score("arithmetic", response, "42") == score


def test_negative_and_thousands_answers_compare_as_numbers():
    assert default_compute_score("arithmetic", "63 - 70 = -7", "-7") == 1.0
    assert default_compute_score("arithmetic", "It is 1,042.", "1042") == 1.0
