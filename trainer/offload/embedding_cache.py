"""A device cache of the most frequent tokens' embedding rows, for an embedding kept on the CPU.

Decode looks up a few tokens per step, and token frequencies are very skewed: after a warm-up that
counts them, the `cache_size` most frequent rows stay on the device, and a lookup gathers only the
misses on the CPU and ships them. The rows are refreshed whenever the embedding's weights change
(an optimizer update, a checkpoint load): the cache is never stale.

    cache = engine.enable_embedding_cache(cache_size=8192, warmup_steps=10)
    ...                                  # no-grad forwards (rollout, log-probs) go through it
    cache.end_step()                     # after each step's rollout: counts the warm-up, fills the cache
    metrics["rollout/embedding_cache_hit_ratio"] = cache.take_hit_ratio()
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class EmbeddingCache:
    """The device rows of the most frequent tokens of one CPU-resident embedding table."""

    def __init__(self, weight: Callable[[], torch.Tensor], version: Callable[[], int], device: torch.device, *,
                 cache_size: int, warmup_steps: int):
        self.weight = weight  # the host table (it may be re-read: the arena view of the current weights)
        self.version = version
        self.device = device
        self.cache_size = cache_size
        self.warmup_steps = warmup_steps
        vocabulary = weight().shape[0]
        self.counts = torch.zeros(vocabulary, dtype=torch.long)
        self.steps = 0
        self.tokens: torch.Tensor | None = None  # cached token ids, by slot
        self.slot_of: torch.Tensor | None = None  # [vocabulary] slot on the device, -1 when not cached
        self.rows: torch.Tensor | None = None
        self._rows_version = -1
        self.hits = self.lookups = 0
        self._counted = False  # tokens were counted since the last end_step

    @property
    def filled(self) -> bool:
        return self.rows is not None

    def end_step(self) -> None:
        """One warm-up step done, if it looked anything up (a rollout that kept the whole embedding
        on the device did not); once all are, the cache is filled with the most counted rows."""
        if self.filled:
            return
        if self._counted or self.warmup_steps == 0:
            self.steps += 1
        self._counted = False
        if self.steps >= self.warmup_steps:
            self._fill()

    def _fill(self) -> None:
        size = min(self.cache_size, self.counts.numel())
        self.tokens = torch.topk(self.counts, size, sorted=True).indices.sort().values
        slot_of = torch.full((self.counts.numel(),), -1, dtype=torch.long)
        slot_of[self.tokens] = torch.arange(size)
        self.slot_of = slot_of.to(self.device)
        self.rows = torch.empty((size, self.weight().shape[1]), dtype=self.weight().dtype, device=self.device)
        self._refresh()
        self.counts = torch.zeros(0, dtype=torch.long)  # no longer needed

    def _refresh(self) -> None:
        assert self.rows is not None and self.tokens is not None
        self.rows.copy_(self.weight().index_select(0, self.tokens))
        self._rows_version = self.version()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """[..., hidden] the rows of `ids` (any shape, any device), on the device."""
        flat = ids.reshape(-1)
        if not self.filled:
            self.counts += torch.bincount(flat.cpu(), minlength=self.counts.numel())
            self._counted = True
            rows = self.weight().index_select(0, flat.cpu()).to(self.device)
            return rows.view(*ids.shape, -1)
        if self._rows_version != self.version():
            self._refresh()
        assert self.rows is not None and self.slot_of is not None
        slots = self.slot_of[flat.to(self.device)]
        hit = slots >= 0
        out = torch.empty((flat.numel(), self.rows.shape[1]), dtype=self.rows.dtype, device=self.device)
        out[hit] = self.rows[slots[hit]]
        miss = ~hit
        missing = flat.to("cpu")[miss.cpu()]
        if missing.numel():
            out[miss] = self.weight().index_select(0, missing).to(self.device, non_blocking=True)
        hits = int(hit.sum())
        self.hits += hits
        self.lookups += flat.numel()
        return out.view(*ids.shape, -1)

    def take_hit_ratio(self) -> float | None:
        """Share of lookups served from the device since the last call (None before any)."""
        ratio = self.hits / self.lookups if self.lookups else None
        self.hits = self.lookups = 0
        return ratio
