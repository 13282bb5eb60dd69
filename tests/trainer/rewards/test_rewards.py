"""Built-in scorers, the data_source registry and user-supplied scoring functions."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer.data import load_records
from trainer.rewards import (
    SCORERS,
    CustomRewardError,
    UnknownDataSource,
    as_float_score,
    default_compute_score,
    load_custom_score,
    resolve_compute_score,
    score_counting,
    score_gsm8k,
)

# ------------------------------------------------------------------------------------- counting


@pytest.mark.parametrize(("response", "expected"), [
    ("0 1 2 3", 1.0),
    (" 0  1\n2 3 ", 1.0),
    ("0 1 9 3", 0.75),
    ("0 1", 0.5),
    ("1 2 3 4", 0.0),
    ("0 1 2 3 4 5 6 7", 0.5),  # right answer, then as many junk words: half the reward
    ("0 1 2 3 4", 0.8),
    ("", 0.0),
])
def test_score_counting(response, expected):
    assert score_counting(response, "0 1 2 3") == expected


# ---------------------------------------------------------------------------------------- gsm8k


@pytest.mark.parametrize(("response", "strict", "flexible"), [
    ("3 apples plus 15 is 18.\n#### 18", 1.0, 1.0),
    ("She pays $1,800 in all.\n#### $1,800", 0.0, 0.0),  # truth below is 18
    ("So 18.\n#### 18.", 1.0, 1.0),
    ("#### 18.00", 1.0, 1.0),
    ("#### 17 and then I checked: 18", 0.0, 1.0),
    ("The answer is 18", 0.0, 1.0),
    ("#### 18\nWait, maybe 19", 1.0, 0.0),
    ("no number here", 0.0, 0.0),
    ("#### -18", 0.0, 0.0),
])
def test_score_gsm8k_strict_and_flexible(response, strict, flexible):
    assert score_gsm8k(response, "18", method="strict") == strict
    assert score_gsm8k(response, "18", method="flexible") == flexible


def test_score_gsm8k_normalises_commas_dollars_and_format_score():
    assert score_gsm8k("#### $1,800", "1800") == 1.0
    assert score_gsm8k("#### 1,800", "1,800") == 1.0
    assert score_gsm8k("#### 7", "1800", format_score=0.1) == 0.1
    assert score_gsm8k("no answer", "1800", format_score=0.1) == 0.0
    assert score_gsm8k("#### 1800", 1800, score=2.0) == 2.0
    with pytest.raises(ValueError, match="allowed: strict, flexible"):
        score_gsm8k("#### 1", "1", method="loose")


# ------------------------------------------------------------------------------------- registry


def test_registry_dispatches_on_data_source():
    assert set(SCORERS) == {"arithmetic", "counting", "gsm8k", "openai/gsm8k", "hiyouga/geometry3k"}
    assert default_compute_score("counting", "0 1 9 3", "0 1 2 3") == 0.75
    assert default_compute_score("openai/gsm8k", "#### 72", "72", {"index": 0}) == 1.0
    assert default_compute_score("gsm8k", "#### 71", "72") == 0.0
    assert type(default_compute_score("counting", "0", "0")) is float


def test_unknown_data_source_says_what_to_do():
    with pytest.raises(UnknownDataSource) as caught:
        default_compute_score("lighteval/MATH", "x", "y", None)
    assert str(caught.value) == (
        "no built-in scorer for data_source 'lighteval/MATH'; known: arithmetic, counting, gsm8k, hiyouga/geometry3k, "
        "openai/gsm8k; "
        "set custom_reward_function.path to a Python file that defines "
        "compute_score(data_source, solution_str, ground_truth, extra_info)")
    assert isinstance(caught.value, ValueError)


# ----------------------------------------------------------------------------------- end to end


def test_verl_parquet_is_read_and_scored(tmp_path):
    rows = [
        {"data_source": "openai/gsm8k", "ability": "math",
         "prompt": [{"role": "user", "content": f"Question {index}? Let's think step by step."}],
         "reward_model": {"style": "rule", "ground_truth": answer},
         "extra_info": {"index": index, "split": "test"}}
        for index, answer in enumerate(["72", "10", "1800"])
    ]
    path = tmp_path / "gsm8k_test.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    responses = ["48 + 24 = 72\n#### 72", "It is 5.\n#### 5", "#### $1,800"]
    records = load_records([str(path)])
    scores = [default_compute_score(record.data_source, response, record.ground_truth, record.extra_info)
              for record, response in zip(records, responses, strict=True)]
    assert scores == [1.0, 0.0, 1.0]


# ---------------------------------------------------------------------------------------- custom


def write_module(tmp_path, source, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(source)
    return str(path)


def test_custom_function_is_loaded_and_used(tmp_path):
    path = write_module(tmp_path, (
        "from dataclasses import dataclass\n"
        "@dataclass\n"
        "class Weights:\n"
        "    exact: float = 1.0\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    exact = Weights().exact if solution_str == ground_truth else -1\n"
        "    return {'score': exact, 'length': len(solution_str)}\n"
    ))
    function = load_custom_score(path, "compute_score")
    assert as_float_score(function("any", "yes", "yes", None)) == 1.0
    scorer = resolve_compute_score(path, "compute_score")
    assert scorer("any", "no", "yes", {}) == {"score": -1, "length": 2}, "verl's result, for the reward manager"
    assert resolve_compute_score(None, "compute_score") is default_compute_score


def test_two_loads_of_one_file_do_not_share_state(tmp_path):
    path = write_module(tmp_path, "calls = []\ndef score():\n    calls.append(1)\n    return len(calls)\n")
    first, second = load_custom_score(path, "score"), load_custom_score(path, "score")
    assert (first(), first(), second()) == (1, 2, 1)


def test_custom_file_missing(tmp_path):
    with pytest.raises(CustomRewardError, match=r"custom_reward_function.path '.*nowhere.py' does not exist"):
        load_custom_score(str(tmp_path / "nowhere.py"), "compute_score")


def test_custom_file_raising_on_import(tmp_path):
    path = write_module(tmp_path, "import math\nraise RuntimeError('needs a GPU\\nreally')\n")
    with pytest.raises(CustomRewardError) as caught:
        load_custom_score(path, "compute_score")
    assert str(caught.value) == (f"custom_reward_function.path {path!r} raised RuntimeError on import: "
                                 "needs a GPU really")


def test_custom_file_with_a_syntax_error(tmp_path):
    path = write_module(tmp_path, "def compute_score(:\n")
    with pytest.raises(CustomRewardError, match=r"raised SyntaxError on import: "):
        load_custom_score(path, "compute_score")


def test_custom_name_missing_lists_the_callables(tmp_path):
    path = write_module(tmp_path, (
        "import os\nfrom math import sqrt\nTHRESHOLD = 0.5\n"
        "def my_score(*args):\n    return 1\n"
        "def _helper():\n    pass\n"
        "class Scorer:\n    pass\n"
    ))
    with pytest.raises(CustomRewardError) as caught:
        load_custom_score(path, "compute_score")
    assert str(caught.value) == (f"custom_reward_function.path {path!r} has no 'compute_score' "
                                 "(callables it defines: Scorer, my_score); set custom_reward_function.name")
    empty = write_module(tmp_path, "X = 1\n", name="empty.py")
    with pytest.raises(CustomRewardError, match=r"has no 'compute_score' \(it defines no callables\)"):
        load_custom_score(empty, "compute_score")


def test_custom_name_not_callable(tmp_path):
    path = write_module(tmp_path, "compute_score = 0.5\n")
    with pytest.raises(CustomRewardError) as caught:
        load_custom_score(path, "compute_score")
    assert str(caught.value) == (f"'compute_score' in custom_reward_function.path {path!r} is a float, "
                                 "not a function")


@pytest.mark.parametrize(("value", "expected"), [
    (1, 1.0), (0.25, 0.25), (True, 1.0), (False, 0.0), ({"score": 0.5, "acc": True}, 0.5),
    (np.float32(0.5), 0.5), ({"score": np.int64(2)}, 2.0),
])
def test_as_float_score_accepts_numbers_and_score_dicts(value, expected):
    score = as_float_score(value)
    assert score == expected and type(score) is float


@pytest.mark.parametrize(("value", "message"), [
    ("1.0", "the reward function returned str; return a float or a dict with a 'score' key"),
    (None, "the reward function returned NoneType; return a float or a dict with a 'score' key"),
    ({"acc": 1.0}, "the reward function returned a dict without a 'score' key (keys: acc)"),
    ({"score": [1.0]}, "the reward function returned list; return a float or a dict with a 'score' key"),
    (float("nan"), "the reward function returned nan; a reward that is not finite would spoil every update"),
    (float("-inf"), "the reward function returned -inf; a reward that is not finite would spoil every update"),
])
def test_as_float_score_rejects_the_rest(value, message):
    with pytest.raises(CustomRewardError) as caught:
        as_float_score(value)
    assert str(caught.value) == message
