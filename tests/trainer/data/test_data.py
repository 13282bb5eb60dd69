"""Prompt records in verl's layout, the built-in counting task and the prompt sampler."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer import config
from trainer.data import (
    BUILTIN_DATASETS,
    DataError,
    PromptRecord,
    PromptSampler,
    counting_records,
    load_records,
    write_records,
)
from trainer.data.checks import UnknownTokens, check_prompts
from trainer.models.tiny import build_tiny_tokenizer
from trainer.rollout.prompts import PromptTooLong

VERL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "system", "content": "Think step by step."},
                   {"role": "user", "content": "What is 2 + 3?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "5"},
        "extra_info": {"index": 0, "split": "train"},
    },
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is 10 * 4?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "40"},
        "extra_info": {"index": 1, "split": "train"},
    },
]

EXPECTED = [
    PromptRecord(prompt=[{"role": "system", "content": "Think step by step."},
                         {"role": "user", "content": "What is 2 + 3?"}],
                 data_source="openai/gsm8k", ground_truth="5", extra_info={"index": 0, "split": "train"}),
    PromptRecord(prompt=[{"role": "user", "content": "What is 10 * 4?"}],
                 data_source="openai/gsm8k", ground_truth="40", extra_info={"index": 1, "split": "train"}),
]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# ------------------------------------------------------------------------------------- reading


def test_verl_parquet_is_read(tmp_path):
    assert load_records([write_parquet(tmp_path / "train.parquet", VERL_ROWS)]) == EXPECTED


def test_jsonl_and_json_are_read_and_files_concatenate(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", VERL_ROWS[:1])
    second = write_jsonl(tmp_path / "b.json", VERL_ROWS[1:])
    assert load_records([first, second]) == EXPECTED


def test_plain_string_prompt_and_optional_columns(tmp_path):
    rows = [{"data_source": "counting", "question": "1 2 3"}]
    records = load_records([write_jsonl(tmp_path / "x.jsonl", rows)], prompt_key="question")
    assert records == [PromptRecord(prompt="1 2 3", data_source="counting", ground_truth=None, extra_info={})]


def test_message_keys_filled_with_none_by_parquet_are_dropped(tmp_path):
    rows = [{"data_source": "d", "prompt": [{"role": "user", "content": "hi", "name": "ann"}]},
            {"data_source": "d", "prompt": [{"role": "user", "content": "yo"}]}]
    records = load_records([write_parquet(tmp_path / "x.parquet", rows)])
    assert records[1].prompt == [{"role": "user", "content": "yo"}]
    assert records[0].prompt == [{"role": "user", "content": "hi", "name": "ann"}]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_write_records_round_trips(tmp_path, suffix):
    records = [*EXPECTED, PromptRecord(prompt=[{"role": "user", "content": "no extras"}],
                                       data_source="gsm8k", ground_truth="7", extra_info={})]
    path = tmp_path / f"out{suffix}"
    write_records(records, path)
    assert load_records([str(path)]) == records


def test_write_records_keeps_verl_layout(tmp_path):
    path = tmp_path / "out.parquet"
    write_records(EXPECTED, path)
    row = pq.read_table(path).to_pylist()[1]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "40"}
    assert row["prompt"] == [{"role": "user", "content": "What is 10 * 4?"}]


def test_write_records_refuses_mixed_prompt_kinds_in_parquet(tmp_path):
    records = [PromptRecord("text", "d"), PromptRecord([{"role": "user", "content": "chat"}], "d")]
    with pytest.raises(DataError, match=r"do not share one type per column .*; write JSONL instead"):
        write_records(records, tmp_path / "mixed.parquet")
    write_records(records, tmp_path / "mixed.jsonl")
    assert load_records([str(tmp_path / "mixed.jsonl")]) == records


# ------------------------------------------------------------------------------------- builtin


def test_builtin_names_match_the_config_schema():
    assert tuple(BUILTIN_DATASETS) == config.BUILTIN_DATASETS


def test_counting_is_deterministic_and_its_answers_continue_the_count():
    records = counting_records(num_prompts=200, seed=3)
    assert records == counting_records(num_prompts=200, seed=3)
    assert records != counting_records(num_prompts=200, seed=4)
    assert [record.extra_info for record in records[:3]] == [{"index": 0}, {"index": 1}, {"index": 2}]
    for record in records:
        digits = [int(word) for word in f"{record.prompt} {record.ground_truth}".split()]
        assert len(record.prompt.split()) == 3 and len(record.ground_truth.split()) == 4
        assert digits == [(digits[0] + offset) % 10 for offset in range(7)]
        assert record.data_source == "counting"
    assert {record.prompt.split()[0] for record in records} == {str(digit) for digit in range(10)}


def test_counting_wraps_modulo_ten():
    wrapped = next(record for record in counting_records(100) if record.prompt == "7 8 9")
    assert wrapped.ground_truth == "0 1 2 3"


def test_builtin_entry_in_file_list():
    assert load_records(["builtin:counting"]) == counting_records()
    message = one_line_error(["builtin:nope"])
    assert message == "'builtin:nope' is not a built-in dataset; allowed: builtin:counting"


# ------------------------------------------------------------------------------------- bad files


def one_line_error(files, **kwargs) -> str:
    with pytest.raises(DataError) as caught:
        load_records(files, **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_missing_prompt_column_names_the_columns_and_the_key(tmp_path):
    path = write_parquet(tmp_path / "x.parquet", [{"data_source": "d", "question": "q", "answer": "a"}])
    message = one_line_error([path])
    assert message == (f"data file {path!r} has no column 'prompt' (columns: data_source, question, answer); "
                       "set data.prompt_key to the column that holds the prompt")


def test_missing_data_source(tmp_path):
    parquet = write_parquet(tmp_path / "x.parquet", [{"prompt": "p"}])
    assert one_line_error([parquet]).startswith(
        f"data file {parquet!r} has no column 'data_source' (columns: prompt); every row needs")
    jsonl = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "data_source": "d"}, {"prompt": "p"}])
    assert one_line_error([jsonl]).startswith(
        f"data file {jsonl!r} line 2 has no key 'data_source' (keys: prompt); every row needs")


def test_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"prompt": "a", "data_source": "d"}\n\n{"prompt": oops}\n')
    message = one_line_error([str(path)])
    assert message.startswith(f"data file {str(path)!r} line 3: not valid JSON (Expecting value")


def test_json_row_must_be_an_object(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('[{"prompt": "a", "data_source": "d"}]\n')
    assert one_line_error([str(path)]) == (f"data file {str(path)!r} line 1: must be a JSON object "
                                           "(one row per line), got list")


@pytest.mark.parametrize(("prompt", "found"), [
    (7, "got int"),
    ("", "got an empty string"),
    ([], "got an empty list"),
    (["hi"], "got str as message 0"),
    ([{"role": "user"}], "got message 0 with content missing"),
])
def test_bad_prompt_names_the_row_and_what_was_found(tmp_path, prompt, found):
    rows = [{"prompt": "fine", "data_source": "d"}, {"prompt": "fine", "data_source": "d"},
            {"prompt": "fine", "data_source": "d"}, {"prompt": prompt, "data_source": "d"}]
    path = write_jsonl(tmp_path / "x.jsonl", rows)
    assert one_line_error([path]) == (f"data file {path!r} line 4: prompt must be a string or a list of "
                                      f"{{role, content}} messages, {found}")


def test_bad_prompt_in_parquet_counts_rows_from_zero(tmp_path):
    rows = [{"prompt": "a", "data_source": "d"}, {"prompt": "", "data_source": "d"}]
    path = write_parquet(tmp_path / "x.parquet", rows)
    assert one_line_error([path]).startswith(f"data file {path!r} row 1: prompt must be a string")


@pytest.mark.parametrize(("column", "value", "expected"), [
    ("data_source", 3, "data_source must be a non-empty string, got int"),
    ("reward_model", "5", "reward_model must be a dict like {'style': 'rule', 'ground_truth': ...}, got str"),
    ("extra_info", [1], "extra_info must be a dict or absent, got list"),
])
def test_bad_other_columns(tmp_path, column, value, expected):
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "data_source": "d", column: value}])
    assert one_line_error([path]) == f"data file {path!r} line 1: {expected}"


def test_empty_files(tmp_path):
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    assert one_line_error([str(empty)]) == f"data file {str(empty)!r} is empty (0 bytes)"
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    assert one_line_error([str(blank)]) == f"data file {str(blank)!r} has no rows"
    no_rows = tmp_path / "no_rows.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "data_source": pa.array([], pa.string())}),
                   no_rows)
    assert one_line_error([str(no_rows)]) == f"data file {str(no_rows)!r} has no rows"


def test_missing_unknown_and_unreadable_files(tmp_path):
    assert one_line_error([str(tmp_path / "gone.jsonl")]).endswith("gone.jsonl' does not exist")
    assert "has an unknown format; allowed: .parquet, .jsonl, .json" in one_line_error(["data.csv"])
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet at all")
    assert one_line_error([str(fake)]).startswith(f"data file {str(fake)!r} is not a readable parquet file (")


def test_a_directory_is_not_reported_as_missing(tmp_path):
    folder = tmp_path / "train.parquet"  # a folder of shards, as Spark and datasets write them
    folder.mkdir()
    assert one_line_error([str(folder)]) == (f"data file {str(folder)!r} is a directory; allowed: .parquet, .jsonl, "
                                             ".json files (list each file of a folder of shards)")


def test_a_reward_model_without_ground_truth_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "1 2", "data_source": "counting", "reward_model": {}}])
    # It trained with ground_truth=None: every response scored 0.
    assert one_line_error([path]) == (f"data file {path!r} line 1: reward_model has no 'ground_truth' (got {{}}); "
                                      "allowed: {'style': 'rule', 'ground_truth': ...}, or {'style': 'model'} "
                                      "for a reward model")
    scored_by_a_model = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "1 2", "data_source": "chat",
                                                            "reward_model": {"style": "model"}}])
    assert load_records([scored_by_a_model])[0].ground_truth is None


def test_the_built_in_scorers_need_a_ground_truth_in_every_row(tmp_path):
    rows = [{"prompt": "1 2", "data_source": "counting", "reward_model": {"style": "rule", "ground_truth": "3"}},
            {"prompt": "4 5", "data_source": "counting"}]
    path = write_parquet(tmp_path / "x.parquet", rows)  # parquet fills the missing struct with nulls
    assert len(load_records([path])) == 2, "a custom function or a reward model may not need one"
    with pytest.raises(DataError) as error:
        load_records([path], require_ground_truth=True)
    assert str(error.value).startswith(f"data file {path!r} row 1: reward_model.ground_truth is missing, but the "
                                       "built-in scorer for data_source 'counting' compares each response with it")


def test_records_know_where_they_were_read(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "1 2", "data_source": "d"}] * 2)
    assert [record.source for record in load_records([path])] == [f"data file {path!r} line 1",
                                                                   f"data file {path!r} line 2"]
    assert counting_records(2)[1].source == "builtin:counting prompt 1"


# ------------------------------------------------------------------------------- prompt checks


def check(records, **options):
    options = {"files_key": "data.train_files", "max_length": 8, "truncation": "error",
               "tokenizer_setting": "actor_rollout_ref.model.tokenizer_path", "tokenizer_name": "tiny", **options}
    check_prompts(records, build_tiny_tokenizer(), **options)


def test_prompts_the_tokenizer_cannot_read_are_refused_naming_the_share_and_tokenizer_path(tmp_path):
    rows = [{"prompt": "what is 3 plus 4", "data_source": "arith"}] + [{"prompt": "1 + 2", "data_source": "arith"}] * 3
    records = load_records([write_jsonl(tmp_path / "x.jsonl", rows)])
    with pytest.raises(UnknownTokens) as error:
        check(records)
    assert str(error.value) == (f"21% of the prompt tokens of data.train_files (3 of 14) are unknown to the tokenizer "
                                f"(tiny; e.g. 'what', 'is', 'plus' in data file '{tmp_path}/x.jsonl' line 1): training "
                                "would read <unk> in their place; set actor_rollout_ref.model.tokenizer_path to a "
                                "tokenizer that covers the data (at most 3% may be unknown)")
    check(counting_records(64))  # the built-in task is all known words
    check(records[1:] * 40 + records[:1])  # one unknown word in a hundred


@pytest.mark.parametrize("prompt", ["1 2 3 4 5 6 7 8 9", [{"role": "user", "content": "1 2 3 4 5 6 7 8 9"}]])
def test_a_prompt_over_the_length_limit_names_where_it_is(tmp_path, prompt):
    rows = [{"prompt": "1 2", "data_source": "d"}, {"prompt": prompt, "data_source": "d"}]
    records = load_records([write_jsonl(tmp_path / "x.jsonl", rows)])
    with pytest.raises(PromptTooLong) as error:
        check(records)
    assert str(error.value) == (f"data file '{tmp_path}/x.jsonl' line 2: the prompt has 9 tokens, more than "
                                "data.max_prompt_length=8; raise it or set data.truncation to left or right")
    check(records, truncation="left")


# ------------------------------------------------------------------------------------- sampler


def take(sampler, count):
    return [sampler.next_batch() for _ in range(count)]


def test_sampler_resumes_with_the_same_batches():
    uninterrupted = take(PromptSampler(10, 3, shuffle=True, seed=5), 8)
    first = PromptSampler(10, 3, shuffle=True, seed=5)
    before = take(first, 4)  # one batch into the second epoch
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints store it as JSON
    resumed = PromptSampler(10, 3, shuffle=True, seed=5)
    resumed.load_state_dict(state)
    assert before + take(resumed, 4) == uninterrupted
    assert (resumed.epoch, resumed.position) == (2, 2)


def test_sampler_drops_the_last_partial_batch_and_reshuffles_each_epoch():
    sampler = PromptSampler(10, 3, shuffle=True, seed=0)
    assert sampler.steps_per_epoch == 3
    epochs = [sum(take(sampler, 3), []) for _ in range(3)]
    for order in epochs:
        assert len(order) == 9 and len(set(order)) == 9 and set(order) <= set(range(10))
    assert epochs[0] != epochs[1] != epochs[2]
    assert sampler.epoch == 2
    assert take(PromptSampler(10, 3, shuffle=True, seed=0), 3) == take(PromptSampler(10, 3, seed=0), 3)
    assert take(PromptSampler(10, 3, seed=0), 3) != take(PromptSampler(10, 3, seed=1), 3)


def test_sampler_without_shuffle_goes_in_file_order():
    assert take(PromptSampler(7, 3, shuffle=False, seed=0), 3) == [[0, 1, 2], [3, 4, 5], [0, 1, 2]]


def test_sampler_too_few_prompts():
    with pytest.raises(ValueError, match=r"^5 prompts cannot fill one batch of data.train_batch_size=8; "
                                         r"lower data.train_batch_size to at most 5"):
        PromptSampler(5, 8, shuffle=True, seed=0)


def test_sampler_refuses_a_checkpoint_of_other_data():
    state = PromptSampler(10, 3, seed=0).state_dict()
    with pytest.raises(ValueError, match=r"\(prompts 10 in the checkpoint, 12 now; data.seed 0 in the "
                                         r"checkpoint, 2 now\): resume with the same data files"):
        PromptSampler(12, 3, seed=2).load_state_dict(state)
