"""A decode step's attention over the cache's live columns only (issue 40).

The static cache (static_decode.py) holds [rows, kv heads, longest prompt + new tokens, head dim] per layer, and
transformers' static layer hands attention the whole of it at every step: a row that has decoded 100 of 4096 tokens
still reads 4096 columns of keys and values, masked. At batch 256 that read is most of a decode step's bytes (an H100
step was 2.67x its HBM floor counting only the live keys, 1.46x counting the whole cache). Without refills every row
writes the same column at each step, so the columns any row has written are the first `prompt width + step` of them:
attention needs no more. `LiveWindow` makes every layer of a cache return that prefix of its keys and values (a view,
no copy), with the step's mask cut to the same columns.

The length read is the written length rounded up to a multiple of `step` (an eighth of the cache's columns, in
multiples of 64 columns, by default), so a batch size's decode runs at about eight lengths, each one CUDA graph; a
multiple of 64 keeps the mask's rows aligned as the fused attention kernels tile them. The columns cut off are masked
for every row, and a masked key adds nothing to attention: the step's result is the same. A ring cache (refill.py,
where rows write wherever the ring is) reads all of its columns.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import StaticCache

LIVE_STEPS = 8
"""Lengths a decode reads at by default: the read length is a multiple of 1/LIVE_STEPS of the cache's columns."""
LIVE_ALIGN = 64
"""The default step is a multiple of this many columns."""


def live_step(columns: int) -> int:
    """The default multiple of the read length, for a cache of `columns` columns: an eighth of them, rounded up to a
    multiple of LIVE_ALIGN."""
    return -(-columns // (LIVE_STEPS * LIVE_ALIGN)) * LIVE_ALIGN


def live_length(written: int, columns: int, step: int) -> int:
    """The columns a step reads: `written` (the columns holding keys, the one this step writes included) rounded up
    to a multiple of `step`, at most the cache's `columns`."""
    return min(columns, -(-written // step) * step)


class LiveWindow:
    """The prefix of every layer's keys and values that `cache`'s updates return: `length` columns (None: all).

    Wraps each layer's `update` (the cache writes the step's keys in place as before); set `length` before a forward.
    """

    def __init__(self, cache: StaticCache):
        self.length: int | None = None
        for layer in cache.layers:
            layer.update = functools.partial(self._update, layer.update)

    def _update(self, update: Any, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = update(key_states, value_states, *args, **kwargs)
        if self.length is None:
            return keys, values
        return keys[:, :, :self.length], values[:, :, :self.length]
