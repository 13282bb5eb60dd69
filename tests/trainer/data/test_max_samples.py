"""data.train_max_samples and data.val_max_samples (verl's keys): at most that many prompts, drawn as verl's
RLHFDataset draws them, before the length filter; -1 reads every one."""

import numpy as np

from trainer.build import load_prompts
from trainer.config import load_config
from trainer.data import PromptRecord, sample_records
from trainer.models.tiny import build_tiny_tokenizer


def records(count: int) -> list[PromptRecord]:
    return [PromptRecord(prompt=f"question {index}", data_source="counting", ground_truth=str(index))
            for index in range(count)]


def test_verl_draws_without_replacement_with_a_seed_when_shuffling_else_takes_the_first():
    rows = records(20)
    drawn = sample_records(rows, 5, shuffle=True, seed=7)
    # verl: np.random.default_rng(seed).choice(total, size=max_samples, replace=False), in the order drawn.
    assert [row.ground_truth for row in drawn] == [str(index) for index in
                                                   np.random.default_rng(7).choice(20, size=5, replace=False)]
    assert len({row.ground_truth for row in drawn}) == 5
    assert sample_records(rows, 5, shuffle=False, seed=7) == rows[:5]
    assert sample_records(rows, -1, shuffle=True, seed=7) is rows
    assert sample_records(rows, 20, shuffle=True, seed=7) is rows  # as many as there are: all, in file order


def test_a_run_reads_at_most_max_samples_prompts_of_each_split():
    files = ["data.train_files=[builtin:counting]", "data.val_files=[builtin:counting]"]
    everything, _ = load_prompts(load_config(None, files), build_tiny_tokenizer(), lambda line: None)
    config = load_config(None, [*files, "data.train_max_samples=6", "data.val_max_samples=4", "data.shuffle=false"])
    train, validation = load_prompts(config, build_tiny_tokenizer(), lambda line: None)
    assert len(everything) > 6 and train == everything[:6] and validation == everything[:4]
    # A resumed run reads the same draw: the seed is data.seed (else trainer.seed), never none.
    shuffled = load_config(None, [*files, "data.train_max_samples=6", "data.seed=null", "trainer.seed=3"])
    first, _ = load_prompts(shuffled, build_tiny_tokenizer(), lambda line: None)
    again, _ = load_prompts(shuffled, build_tiny_tokenizer(), lambda line: None)
    assert first == again and len(first) == 6 and first != train
    assert first == sample_records(everything, 6, shuffle=True, seed=3)
