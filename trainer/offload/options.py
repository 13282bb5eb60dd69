"""The engine's tuning knobs (OffloadOptions): one frozen value that the engine's collaborators all read, kept in
a module of its own so that each of them imports it without importing the engine."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from trainer.errors import UserError


class WorkerThreadsError(UserError, ValueError):
    """VERL_OFFLOAD_WORKER_THREADS is not a thread count (a user's error: one line, exit code 2)."""


def _threads_from_environment() -> int | None:
    value = os.environ.get("VERL_OFFLOAD_WORKER_THREADS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise WorkerThreadsError(f"VERL_OFFLOAD_WORKER_THREADS must be a whole number of threads of at least 1, "
                                 f"got {value!r}; unset it for torch's default (every core)")
    return int(value)


@dataclass(frozen=True)
class OffloadOptions:
    prefetch: int = 2
    """Streamed blocks copied ahead of the one in use (behind it in backward); transformer blocks
    rotate through prefetch + 1 device slots."""
    head_chunk_bytes: int = 64 << 20
    """An offloaded output head streams in row chunks of about this many bytes."""
    head_slots: int | None = None
    """Device slots the head's chunks rotate through (None: prefetch + 1). With more, more of the
    head is prefetched while the transformer computes (when it is on the GPU the copy stream is
    otherwise idle), at the cost of that much device memory."""
    grads_in_flight: int = 2
    """Gradient copies (a block's, or the embedding rows') that may still be on their way to the
    host before the compute waits for the oldest: the device memory they hold stays bounded."""
    head_grads_in_flight: int | None = None
    """The same for the chunks of an offloaded head's weight gradient, counted apart (None: all of
    them, at most the head's size). The head's backward comes first and makes its gradient faster
    than the bus takes it (1.09 GB for the 7B shape, 20 ms at 55 GB/s); letting it drain while the
    transformer's backward runs keeps the bus off the critical path."""
    staging_buffers: int = 2
    """The pinned host memory that gradients bound to be added (a later micro-batch's) or converted
    (to fp32) pass through on their way from the device, in units of the largest block's gradient:
    one region shared as a ring, where copies wait for the worker to land the oldest only when it
    is full."""
    worker_threads: int | None = field(default_factory=_threads_from_environment)
    """The CPU threads each engine's worker runs its torch operations on (the CPU AdamW, adding gradients);
    None: torch's default for a new thread (every core). Each trained model's engine has a worker, and two
    run at once (one model's update lands gradients while the other's CPU AdamW runs), beside the main
    thread that drives the GPU: VERL_OFFLOAD_WORKER_THREADS sets it for a run."""
    pipelined_update: bool = True
    """The CPU optimizer update runs in a background thread, block by block in forward order, and
    the next forward waits for each block's update only when it reaches that block. Measured on an
    H200 host (16 cores, 2026-11-30, clip folded into the update): a step of 8 7B-shaped layers took
    1376 ms with it and 1572 ms without (benchmarks/README.md)."""
