"""Continuous batching for the static decode (issue 40): a row whose sequence has finished takes the next pending
prompt, so a batch of long-tailed responses keeps its slots busy instead of decoding pads until its longest row ends.

The KV cache stays one static buffer per layer, [slots, kv heads, prompt width + new tokens, head dim], but its
columns are a ring: every row writes its next token's keys and values at the same column, which advances by one a
step and wraps at the end. A refilled row's prompt is prefilled on its own (a small cache of the prompt width) and
copied into the columns just before the one written next, so that it decodes its tokens into the columns after it:
prompt and response together take the whole ring once, and a row always ends (by EOS or by length) before the ring
comes back to its prompt. Attention does not care where in the ring a key lies: each key was rotated at its row's
own position when it was written, and the row's mask says which columns are its own.

Writing at a column of our choosing needs transformers' static layer to keep its write position in a tensor
(`cumulative_length`, transformers 5.x): the decode step sets it to the ring's column before each forward. Where the
installed transformers keeps none, `supports_ring` is false and the decoder decodes in pieces instead.
"""

from __future__ import annotations

import torch
from transformers import StaticCache


def supports_ring(cache: StaticCache) -> bool:
    """Whether every layer of `cache` keeps its write position in a tensor the decode step may set."""
    return all(isinstance(getattr(layer, "cumulative_length", None), torch.Tensor) for layer in cache.layers)


def set_write_column(cache: StaticCache, column: torch.Tensor) -> None:
    """Every layer of `cache` writes the next token's keys and values at `column` ([1] device tensor): in place, so a
    CUDA graph of the step replays it."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            layer.cumulative_length.copy_(column[0])


def ring_columns(next_column: int, prompt_width: int, ring: int, device: torch.device) -> torch.Tensor:
    """[prompt_width] the ring's columns a refilled row's prompt occupies: the `prompt_width` columns before
    `next_column`, the one the next step writes, wrapping at `ring`."""
    return (next_column - prompt_width + torch.arange(prompt_width, device=device)) % ring


def copy_prompt_rows(cache: StaticCache, prompts: StaticCache, rows: torch.Tensor, columns: torch.Tensor) -> None:
    """Into `cache`'s batch rows `rows`, at the ring's `columns`, the keys and values of `prompts` (a cache of
    len(rows) prefilled prompts, [len(rows), kv heads, len(columns), head dim] per layer); in place (a captured step
    keeps reading the same buffers). The rows' other columns keep their previous sequence's keys, which their masks
    no longer name."""
    for layer, prompt in zip(cache.layers, prompts.layers, strict=True):
        for name in ("keys", "values"):
            target, source = getattr(layer, name), getattr(prompt, name)
            block = target.index_select(0, rows)
            block.index_copy_(2, columns, source.to(target.dtype))
            target.index_copy_(0, rows, block)


class PendingRows:
    """The prompts still waiting for a slot, taken in order: rows `first`, `first` + 1, ... of the whole batch."""

    def __init__(self, total: int, first: int):
        self.total, self.next = total, first

    def __len__(self) -> int:
        return self.total - self.next

    def take(self, count: int) -> range:
        """The next `count` waiting rows (fewer when fewer wait)."""
        taken = range(self.next, min(self.total, self.next + count))
        self.next = taken.stop
        return taken
