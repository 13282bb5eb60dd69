"""Out-of-memory recovery for the no-grad phases (rollout, log-probs, values): a CUDA out-of-memory
error in a piece of the batch does not end the run. The piece is retried once memory was relieved
(dynamic offload moved layers to the CPU), or split in two. The update has its own loop
(optimization.accumulate_gradients): a failed backward has already added to gradients.

    recovery = Recovery(relieve_memory=trainer.relieve_memory)
    parts = run_in_pieces(lambda first, count: score(batch[first:first + count]), len(batch), 16,
                          recovery=recovery, models=[model])
    metrics["perf/oom_recoveries"] += recovery.take()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from trainer.offload import offload_engine

T = TypeVar("T")


@dataclass
class Recovery:
    """How to relieve memory, and the errors recovered from since the last `take`."""

    relieve_memory: Callable[[], bool] | None = None
    """Frees device memory (moves layers to the CPU); True if it could."""
    count: int = 0

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


def run_in_pieces(run: Callable[[int, int], T], total: int, size: int, *, recovery: Recovery | None,
                  models: Sequence[nn.Module] = ()) -> list[T]:
    """`run(first, count)` over consecutive pieces of at most `size` of `total` items, in order.

    On a CUDA out-of-memory error the pieces already done are kept (nothing accumulates across
    them), the failed pass of `models` is abandoned, and the failed piece is retried once memory
    was relieved, or split in two; one item that still does not fit raises. Without `recovery`
    the error propagates.
    """
    pieces = [(first, min(size, total - first)) for first in range(0, total, size)]
    results: list[T] = []
    while len(results) < len(pieces):
        first, count = pieces[len(results)]
        failed = False
        try:
            results.append(run(first, count))
        except torch.OutOfMemoryError:
            if recovery is None or count == 1 and recovery.relieve_memory is None:
                raise
            failed = True
        if not failed:
            continue
        # Out of the except block: the error's frames (and the tensors they hold) are gone now.
        release(models)
        recovery.count += 1
        if recovery.relieve_memory is not None and recovery.relieve_memory():
            continue
        if count == 1:
            raise torch.OutOfMemoryError("CUDA out of memory on a single sequence, with no layer left to move "
                                         "to the CPU: lower the response length or raise the memory budget")
        half = count // 2
        pieces[len(results):len(results) + 1] = [(first, half), (first + half, count - half)]
    return results


def release(models: Sequence[nn.Module]) -> None:
    """Forget the passes of `models` that raised and give the cached device memory back."""
    for model in models:
        engine = offload_engine(model)
        if engine is not None:
            engine.abandon_pass()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
