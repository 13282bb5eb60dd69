"""Built-in datasets, so a run can start with no data files at all.

``counting`` is small enough that a tiny random-init model learns it with RL on a CPU in a
couple of minutes: the prompt is a few digits counting up modulo 10 ("7 8 9") and the answer
is the digits that follow ("0 1 2 3"), scored word by word by ``score_counting``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from trainer.data.records import PromptRecord

COUNTING_DATA_SOURCE = "counting"
COUNTING_PROMPT_DIGITS = 3
COUNTING_ANSWER_DIGITS = 4


def counting_records(num_prompts: int = 1024, seed: int = 0) -> list[PromptRecord]:
    """``num_prompts`` counting prompts with uniformly drawn starting digits."""
    generator = random.Random(seed)
    records = []
    for index in range(num_prompts):
        digits = _count_from(generator.randrange(10), COUNTING_PROMPT_DIGITS + COUNTING_ANSWER_DIGITS)
        records.append(PromptRecord(
            prompt=" ".join(digits[:COUNTING_PROMPT_DIGITS]),
            data_source=COUNTING_DATA_SOURCE,
            ground_truth=" ".join(digits[COUNTING_PROMPT_DIGITS:]),
            extra_info={"index": index},
            source=f"builtin:{COUNTING_DATA_SOURCE} prompt {index}",
        ))
    return records


def _count_from(start: int, length: int) -> list[str]:
    return [str((start + offset) % 10) for offset in range(length)]


# Names must match trainer.config.BUILTIN_DATASETS, which validates configs without importing this module.
BUILTIN_DATASETS: dict[str, Callable[[], list[PromptRecord]]] = {"counting": counting_records}
