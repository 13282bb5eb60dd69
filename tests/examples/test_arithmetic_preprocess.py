"""examples/data_preprocess/arithmetic.py: verl's parquet layout, the same files from the same seed, held-out
questions that training never sees, and ground truths the example's reward scores right."""

import importlib.util

from tests.support import REPO
from trainer.data import load_records
from trainer.rewards import default_compute_score

spec = importlib.util.spec_from_file_location("arithmetic", REPO / "examples" / "data_preprocess" / "arithmetic.py")
arithmetic = importlib.util.module_from_spec(spec)
spec.loader.exec_module(arithmetic)


def generate(directory, *extra):
    assert arithmetic.main(["--local_save_dir", str(directory), "--train_size", "40", "--test_size", "10",
                            *extra]) == 0
    return load_records([str(directory / "train.parquet")]), load_records([str(directory / "test.parquet")])


def test_the_files_are_verl_layout_held_out_and_scored_right_by_their_truth(tmp_path):
    train, test = generate(tmp_path)
    assert (len(train), len(test)) == (40, 10)
    questions = [record.prompt[0]["content"] for record in train + test]
    assert len(set(questions)) == 50  # distinct, and none of the test's in train
    for record in train + test:
        assert record.data_source == "arithmetic" and record.prompt[0]["role"] == "user"
        info = record.extra_info
        left, right = info["left"], info["right"]
        assert record.prompt[0]["content"] == f"What is {left} {info['operator']} {right}? Answer with just the number."
        assert int(record.ground_truth) == (left + right if info["operator"] == "+" else left - right)
        assert 1 <= left <= 50 and 1 <= right <= 50
        assert default_compute_score(record.data_source, f"{left} {info['operator']} {right} = "
                                     f"{record.ground_truth}", record.ground_truth) == 1.0
    assert [record.extra_info["index"] for record in test] == list(range(10))


def test_the_same_seed_writes_the_same_questions_and_another_seed_others(tmp_path):
    first = generate(tmp_path / "first")
    assert generate(tmp_path / "again") == first
    assert generate(tmp_path / "other", "--seed", "1") != first
