"""Out-of-memory recovery: a CUDA out-of-memory error in a piece of a batch does not end the run.

One helper, `retry_out_of_memory`, serves the two kinds of work that split a batch into pieces:

- the no-grad phases (rollout, log-probs, values, the reward model), through `run_in_pieces`: the
  pieces are independent, so the ones done are kept and only the failed one runs again;
- the update's gradient accumulation (optimization.accumulate_gradients): a backward that failed
  half-way has already added to some gradients, so its `discard` drops them and every piece of the
  mini-batch runs again (the same result: see there).

After an error the failed pass is released, memory is relieved (dynamic offload moves layers to the
CPU, else a phase's kept groups stream from then on) and the same pieces run again; when nothing
could be freed, the failed piece is split in two. Workers get what they need for this from the run's
memory manager (trainer/memory.py) as a `WorkerMemory`, when they are built:

    parts = run_in_pieces(lambda first, count: score(batch[first:first + count]), len(batch), 16,
                          memory=memory)     # the recoveries are counted on `memory`
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
from transformers import PreTrainedModel

from trainer.config import OptimConfig

T = TypeVar("T")



class SequenceOutOfMemory(torch.OutOfMemoryError):
    """Out of device memory on a micro-batch of one sequence with nothing left to free: recovery has nothing left to
    move or split, and a restart would meet it again. The step's phase turns it into one ERROR line that says what to
    change (trainer/out_of_memory.py); it stays a torch.OutOfMemoryError for whoever catches those."""

    def __init__(self, cause: BaseException, tokens: tuple[int, int] | None = None):
        self.tokens = tokens
        """The sequence's (prompt, response) tokens, where the work knows them."""
        lines = str(cause).strip().splitlines()
        self.detail = lines[0] if lines else type(cause).__name__
        """Torch's own message, its first line: what was asked for, what was in use and allowed."""
        length = f" of {sum(tokens)} tokens" if tokens is not None else ""
        super().__init__(f"CUDA out of memory on a single sequence{length}, with no layer left to move to the CPU "
                         f"({self.detail})")


class OutOfMemoryRelief(Protocol):
    """What recovery asks of the memory manager, for the model whose pass ran out of memory."""

    def release(self) -> None:
        """Forget the model's failed pass and give the cached device memory back."""
        ...

    def relieve_memory(self) -> bool:
        """Free device memory for the next attempt; True if anything could be freed."""
        ...


class WorkerMemory(OutOfMemoryRelief, Protocol):
    """One model's side of the run's memory manager (trainer.memory.ModelMemory): what the actor,
    critic and reward model are built with."""

    def safe_point(self) -> None:
        """Nothing is in flight (between micro-batches): dynamic offload may move layers."""
        ...

    def count_recoveries(self, count: int) -> None:
        """`count` out-of-memory errors were recovered from (the step's perf/oom_recoveries)."""
        ...

    def build_optimizer(self, model: PreTrainedModel, config: OptimConfig) -> torch.optim.Optimizer:
        """The model's AdamW: the offload engine's when it has one (per-layer groups, the update
        where optimizer_offload puts it)."""
        ...

    def update_streams_layers(self) -> bool:
        """Whether the model's update, placed for now, streams transformer layers from the CPU (its micro-batches
        then merge: merging.MicroBatchMerging)."""
        ...

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        """Around the micro-batches of one mini-batch: gradients the device can keep add up there and
        go to the host once (OffloadEngine.accumulating)."""
        ...


@dataclass(frozen=True)
class Piece:
    """Items [first, first + count) of a batch."""

    first: int
    count: int


def split_into_pieces(total: int, size: int) -> list[Piece]:
    """Consecutive pieces of at most `size` of `total` items."""
    return [Piece(first, min(size, total - first)) for first in range(0, total, size)]


@dataclass
class Retried(Generic[T]):
    """The pieces `retry_out_of_memory` ran, in order, each with its result; and how many
    out-of-memory errors it recovered from on the way."""

    done: list[tuple[Piece, T]]
    recoveries: int
    fitting: int | None = None
    """After a split, the most items a piece held from then on (every later piece was cut to it): what a caller
    that runs more batches may start from. None: nothing was split."""


def retry_out_of_memory(run: Callable[[Piece], T], pieces: Sequence[Piece], relief: OutOfMemoryRelief | None, *,
                        discard: Callable[[], None] | None = None,
                        tokens: Callable[[Piece], tuple[int, int]] | None = None) -> Retried[T]:
    """`run` every piece in order, recovering from CUDA out-of-memory errors.

    After an error, once its frames (and the tensors they hold) are gone: `relief.release()`
    forgets the failed pass; `discard`, when given, drops what the pieces done so far left behind
    (accumulated gradients), and they are all run again; then, if `relief.relieve_memory()` freed
    memory, the same pieces run again, otherwise the failed piece is split in two (each half keeps
    its origin) and every later piece is cut to the larger half's size (a piece as large would fail too: each
    failure of an accumulating run redoes all its pieces). Each of these counts as one recovery. A piece of one
    item that fails with nothing freed ends it: a SequenceOutOfMemory with the CUDA error's message and, given
    `tokens`, the piece's (prompt, response) tokens. Without `relief` the error propagates at once.
    """
    pieces = list(pieces)
    done: list[tuple[Piece, T]] = []
    recoveries = 0
    fitting: int | None = None
    while len(done) < len(pieces):
        piece = pieces[len(done)]
        try:
            result = run(piece)
        except torch.OutOfMemoryError as error:
            if relief is None:
                raise
            # Without its traceback the error no longer holds the failed pass's frames and tensors.
            failure = error.with_traceback(None)
        else:
            done.append((piece, result))
            continue
        failed = len(done)
        relief.release()  # first: an abandoned backward may still land gradients until then
        if discard is not None:
            discard()
            done = []
        if relief.relieve_memory():
            recoveries += 1
            continue
        if piece.count == 1:
            raise SequenceOutOfMemory(failure, tokens(piece) if tokens is not None else None) from None
        half = piece.count // 2
        fitting = piece.count - half if fitting is None else min(fitting, piece.count - half)
        later = [part for other in pieces[failed + 1:] for part in _cut(other, fitting)]
        pieces[failed:] = [Piece(piece.first, half), Piece(piece.first + half, piece.count - half), *later]
        recoveries += 1
    return Retried(done, recoveries, fitting)


def _cut(piece: Piece, size: int) -> list[Piece]:
    """`piece` as consecutive pieces of at most `size` items."""
    return [Piece(piece.first + start, min(size, piece.count - start)) for start in range(0, piece.count, size)]


def run_in_pieces(run: Callable[[int, int], T], total: int, size: int, *, memory: WorkerMemory | None) -> list[T]:
    """`run(first, count)` over consecutive pieces of at most `size` of `total` items, in order, for a
    no-grad phase: a piece that runs out of device memory is retried once memory was relieved, or
    split; the pieces done are kept (nothing accumulates across them). Without `memory` the error
    propagates."""
    return run_pieces(run, split_into_pieces(total, size), memory=memory)


def run_pieces(run: Callable[[int, int], T], pieces: Sequence[Piece], *, memory: WorkerMemory | None) -> list[T]:
    """`run_in_pieces` over the given `pieces` (micro-batches by token budget have sizes of their own)."""
    retried = retry_out_of_memory(lambda piece: run(piece.first, piece.count), pieces, memory)
    if memory is not None:
        memory.count_recoveries(retried.recoveries)
    return [result for _, result in retried.done]
