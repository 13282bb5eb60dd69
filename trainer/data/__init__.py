"""Prompts in verl's dataset layout, the built-in datasets and the order prompts are taken in."""

from trainer.data.builtin import BUILTIN_DATASETS, counting_records
from trainer.data.records import DataError, PromptRecord, load_records, sample_records, write_records
from trainer.data.sampler import PromptSampler, rank_share, sequence_share

__all__ = [
    "BUILTIN_DATASETS",
    "DataError",
    "PromptRecord",
    "PromptSampler",
    "counting_records",
    "load_records",
    "rank_share",
    "sample_records",
    "sequence_share",
    "write_records",
]
