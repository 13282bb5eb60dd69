"""An embedding and an output head on the CPU: rows gathered, and the head streamed in row chunks.

The embedding on the CPU is never shipped whole: the rows of the batch's distinct tokens are
gathered on the CPU and only they cross; the device expands them (F.embedding), so its backward
sums each token's gradient, and only those rows come back to be added into the embedding's
gradient on the CPU. The head on the CPU crosses in row chunks (`HeadStreamer`), and its weight
gradient goes back chunk by chunk, so neither ever exists whole on the device. With use_fused_kernels the head's
forward computes the log-probs and entropies over the same chunks (`StreamedHeadRows`), never the logits.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
from torch.nn import functional as F

from trainer.algorithms.fused_head import HeadRows, fused_log_probs_and_entropy
from trainer.offload.copies import D2H, H2D, CopyLog, CopyStreams
from trainer.offload.embedding_cache import EmbeddingCache
from trainer.offload.functions import gathered_rows, streamed_linear
from trainer.offload.gradients import GradientPath
from trainer.offload.layout import Layout
from trainer.offload.placement import PhaseStaging
from trainer.offload.streamer import Streamer
from trainer.offload.units import ROWS_PIECE, Block, Unit, UnitKind, typed_view


class RowsAndChunks:
    """The forwards (and their backwards) of an embedding and a head kept on the CPU."""

    def __init__(self, layout: Layout, streams: CopyStreams, log: CopyLog, streamer: Streamer,
                 gradients: GradientPath, staging: PhaseStaging, device: torch.device):
        self.layout, self.streams, self.log = layout, streams, log
        self.streamer, self.gradients, self.staging, self.device = streamer, gradients, staging, device
        self.embedding_cache: EmbeddingCache | None = None

    def install(self) -> None:
        """Route the embedding's and the head's forward through this object where they are gathered or chunked."""
        parts = self.layout.parts
        for unit in self.layout.units:
            if unit.kind == UnitKind.ROWS:
                parts.embedding.forward = functools.partial(self._embedding_forward, unit)
                if parts.tied and parts.head is not None:
                    parts.head.forward = RoutedHead(self, unit)
            elif unit.kind == UnitKind.CHUNKS and parts.head is not None:
                parts.head.forward = RoutedHead(self, unit)

    def enable_embedding_cache(self, *, cache_size: int, warmup_steps: int) -> EmbeddingCache | None:
        """Serve no-grad lookups of a CPU-resident embedding from a device cache of its most frequent
        rows (rollout.embedding_cache); None when the embedding is not gathered on the CPU."""
        unit = self.layout.unit_of_kind(UnitKind.ROWS)
        if unit is None:
            return None
        index = unit.index_of(self.layout.parts.embedding_weight)
        self.embedding_cache = EmbeddingCache(lambda: unit.arena_view(index), lambda: unit.version, self.device,
                                              cache_size=cache_size, warmup_steps=warmup_steps)
        return self.embedding_cache

    # ------------------------------------------------------------------------- embedding rows

    def _embedding_forward(self, unit: Unit, input_ids: torch.Tensor) -> torch.Tensor:
        parts = self.layout.parts
        embedding_weight = parts.embedding_weight
        padding: int | None = getattr(parts.embedding, "padding_idx", None)  # an nn.Embedding (layout.gathers_rows)
        tracked = torch.is_grad_enabled() and embedding_weight.requires_grad
        staged = None if tracked else self.staging.staged_copy(unit)
        if staged is not None:
            rows = F.embedding(input_ids.to(self.device), staged, padding)
            self.streamer.prefetch(-1, +1)
            return rows
        unit.settled()
        if not tracked and self.embedding_cache is not None:
            rows = self.embedding_cache.lookup(input_ids)
            self.streamer.prefetch(-1, +1)
            return rows
        # Only the distinct tokens' rows are gathered and cross the bus; the device expands them with
        # F.embedding, whose backward sums each token's gradient (in fp32 on CUDA, rounded once, as an
        # embedding kept on the device does), so only those rows' gradients come back.
        tokens, inverse = torch.unique(input_ids.to("cpu").reshape(-1), return_inverse=True)
        padding_row = None
        if padding is not None and bool((tokens == padding).any()):
            padding_row = int(torch.searchsorted(tokens, padding))
        weight = unit.arena_view(unit.index_of(embedding_weight))
        inverse = inverse.view(input_ids.shape)
        gather = functools.partial(self._gather, unit, weight, tokens)
        positions = inverse.pin_memory().to(self.device, non_blocking=True) if self.streams.cuda else inverse
        if tracked:
            rows = gathered_rows(embedding_weight, gather, functools.partial(self._rows_backward, unit, tokens))
        else:
            rows = gather()
        self.streamer.prefetch(-1, +1)
        return F.embedding(positions, rows, padding_row)

    def _gather(self, unit: Unit, weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        rows = torch.empty((tokens.numel(), weight.shape[1]), dtype=weight.dtype, device=self.device)
        nbytes = rows.numel() * rows.element_size()
        if not self.streams.cuda:
            self.log.timed(H2D, unit.group, nbytes, None, lambda: torch.index_select(weight, 0, tokens, out=rows))
            return rows
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        torch.index_select(weight, 0, tokens, out=host)
        # On the compute stream: the forward cannot start before the rows anyway.
        self.log.timed(H2D, unit.group, nbytes, self.streams.compute(), lambda: rows.copy_(host, non_blocking=True))
        return rows

    def _rows_backward(self, unit: Unit, tokens: torch.Tensor, grad_rows: torch.Tensor) -> None:
        """The gradient of the distinct tokens' rows (already summed per token on the device) goes to
        the host and is added into the embedding's gradient there."""
        gradients = self.gradients
        gradients.enter_backward()
        unit.grad_square = None
        gradients.ensure_grad_arena(unit)
        assert unit.grad_views is not None
        index = unit.index_of(self.layout.parts.embedding_weight)
        first_write = unit.passing.fresh and index not in unit.passing.landed_entries()
        zero_first = first_write and self.layout.parts.tied
        unit.passing.landed.add((index, ROWS_PIECE))
        # In the host gradient's dtype before the copy: the device converts in microseconds what
        # would take the host tens of milliseconds.
        grad_rows = grad_rows.to(unit.grad_view(index).dtype)
        # Distinct tokens' rows added into a zeroed gradient are that gradient's only nonzero rows, unless the
        # head's gradient (tied) or an earlier forward's rows are there too.
        gradients.add_square(unit, [(grad_rows, index)], exact=first_write and not self.layout.parts.tied)
        nbytes = grad_rows.numel() * grad_rows.element_size()
        if not self.streams.cuda:
            self.log.timed(D2H, unit.group, nbytes, None,
                           lambda: self._add_rows(unit, index, tokens, grad_rows, zero_first))
            return
        self.streams.stream_waits(self.streams.d2h, self.streams.record_compute())
        host = torch.empty(grad_rows.shape, dtype=grad_rows.dtype, pin_memory=True)
        end = self.log.timed(D2H, unit.group, nbytes, self.streams.d2h,
                             functools.partial(host.copy_, grad_rows, non_blocking=True))
        gradients.hold_until_copied(end, [grad_rows])

        def land() -> None:
            assert end is not None
            end.synchronize()
            self._add_rows(unit, index, tokens, host, zero_first)

        gradients.run_on_worker(land)

    def _add_rows(self, unit: Unit, index: int, tokens: torch.Tensor, rows: torch.Tensor, zero_first: bool) -> None:
        """Add one backward's gradient of the distinct tokens' rows: a dense gradient's worth, so
        accumulating micro-batches rounds as an embedding kept on the device does."""
        assert unit.grad_views is not None
        parameter = unit.entries[index].parameter
        fresh = unit.passing.fresh
        target = parameter.grad if parameter.grad is not None and not fresh else unit.grad_view(index)
        if zero_first:
            target.zero_()
        target.index_add_(0, tokens, rows)

    # ---------------------------------------------------------------------------- head chunks

    def _head_forward(self, unit: Unit, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.layout.parts.head_weight
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return streamed_linear(hidden, weight, HeadStreamer(self, unit))
        staged = self.staging.staged_copy(unit)
        if staged is not None:
            return F.linear(hidden, staged)
        return HeadStreamer(self, unit).forward(hidden)


class RoutedHead:
    """The forward of a head streamed in chunks (`RowsAndChunks._head_forward`), and its fused log-probs (`fused`:
    what trainer/models/fused_head.py calls in its place around a forward with use_fused_kernels)."""

    def __init__(self, owner: RowsAndChunks, unit: Unit):
        self.owner, self.unit = owner, unit

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.owner._head_forward(self.unit, hidden)

    def fused(self, hidden: torch.Tensor, labels: torch.Tensor, temperature: float, *,
              entropy_graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Each position's log-prob of its label and entropy, over the head's chunks as they stream (or its copy kept
        on the device); the weight's gradient goes to the host chunk by chunk, as the unfused backward sends it."""
        return fused_log_probs_and_entropy(hidden, self.owner.layout.parts.head_weight, labels, temperature,
                                           entropy_graph=entropy_graph,
                                           rows=StreamedHeadRows(HeadStreamer(self.owner, self.unit)))


class StreamedHeadRows(HeadRows):
    """The head's weight for the fused log-probs: each chunk fetched into its device slot (or sliced from the
    phase's device copy) while it is read; its gradient sent to the host (the weight given is the CPU master, which
    only says whether it trains)."""

    sends_weight_grad = True

    def __init__(self, streamer: HeadStreamer):
        super().__init__()
        self.head = streamer

    def chunks(self, weight: torch.Tensor, *, backward: bool) -> Iterator[tuple[int, torch.Tensor]]:
        owner, unit = self.head.owner, self.head.unit
        staged = owner.staging.staged_copy(unit)
        for block in reversed(unit.blocks) if backward else unit.blocks:
            assert block.rows is not None
            first, last = block.rows
            if staged is not None:  # kept whole on the device for this phase
                yield first, staged[first:last]
                continue
            owner.streamer.acquire(block)
            try:
                yield first, self.head.chunk(block)
            finally:
                owner.streamer.release(block)

    def begin_backward(self) -> None:
        self.head.owner.gradients.enter_backward()

    def send_weight_grad(self, first: int, grad: torch.Tensor) -> None:
        unit = self.head.unit
        self.head.owner.gradients.send(unit, [(grad, unit.index_of(self.head.weight), first * grad.shape[1])])


class HeadStreamer:
    """y = x W^T for a head whose weight W streams in row chunks (see functions.StreamedLinear)."""

    def __init__(self, owner: RowsAndChunks, unit: Unit):
        self.owner, self.unit = owner, unit
        self.weight = owner.layout.parts.head_weight

    def chunk(self, block: Block) -> torch.Tensor:
        assert block.rows is not None and block.slot.data is not None
        first, last = block.rows
        size = torch.Size((last - first, self.weight.shape[1]))
        return typed_view(block.slot.data, 0, (size, self.owner.layout.dtypes.compute))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        streamer = self.owner.streamer
        staged = self.owner.staging.staged_copy(self.unit)
        if staged is not None:  # kept whole on the device for this phase
            return F.linear(hidden, staged)
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = torch.empty((flat.shape[0], self.weight.shape[0]), dtype=hidden.dtype, device=hidden.device)
        for block in self.unit.blocks:
            streamer.acquire(block)
            assert block.rows is not None
            first, last = block.rows
            out[:, first:last] = flat @ self.chunk(block).t()
            streamer.release(block)
        return out.view(*hidden.shape[:-1], out.shape[-1])

    def backward(self, hidden: torch.Tensor, grad_output: torch.Tensor, *,
                 input_needs_grad: bool) -> torch.Tensor | None:
        streamer, gradients = self.owner.streamer, self.owner.gradients
        gradients.enter_backward()
        flat = hidden.reshape(-1, hidden.shape[-1])
        grads = grad_output.reshape(-1, grad_output.shape[-1])
        staged = self.owner.staging.staged_copy(self.unit)
        grad_input = None
        if input_needs_grad:
            grad_input = grads.mm(staged) if staged is not None else torch.zeros_like(flat)
        weight_index = self.unit.index_of(self.weight)
        trains_weight = self.weight.requires_grad
        for block in reversed(self.unit.blocks):
            assert block.rows is not None
            first, last = block.rows
            grad_chunk = grads[:, first:last]
            if grad_input is not None and staged is None:
                streamer.acquire(block)
                grad_input.addmm_(grad_chunk, self.chunk(block))
                streamer.release(block)
            if trains_weight:
                weight_grad = grad_chunk.t().mm(flat)
                gradients.send(self.unit, [(weight_grad, weight_index, first * flat.shape[1])])
        return grad_input.view_as(hidden) if grad_input is not None else None
