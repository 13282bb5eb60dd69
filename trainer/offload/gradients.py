"""The gradient path: gradients of offloaded parameters from the device to their host masters.

Each block's gradients go back D2H on their own copy stream, one copy per tensor, into a pinned
gradient arena, or through a pinned staging ring when they must be added (a later micro-batch's)
or converted (to fp32) by the engine's worker thread; at the end of backward the masters' .grad
are views into the host gradient. The device memory of gradients still on their way is bounded
(`grads_in_flight`; the head's chunks apart, `head_grads_in_flight`) by letting the compute stream
wait for the oldest copy.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from torch import nn

from trainer.offload.copies import D2H, CopyLog, CopyStreams, StagingRing, pinned_empty
from trainer.offload.layout import Layout, allocate_grad_arena
from trainer.offload.options import OffloadOptions
from trainer.offload.units import (
    ALIGNMENT,
    ROWS_PIECE,
    UPDATE_SLICE_ELEMENTS,
    PassState,
    Unit,
    UnitKind,
    aligned,
    typed_view,
)

T = TypeVar("T")
Piece = tuple[torch.Tensor, int, int]
"""A gradient piece: (tensor, entry index, first element of the entry it starts at)."""
InFlight = deque[tuple[torch.cuda.Event | None, list[torch.Tensor]]]


class HostWorker:
    """One thread for the engine's CPU-side work that waits on copies (landing gradients, CPU
    updates), run in submission order. On a CPU-only machine gradient work runs at once
    (`inline` defaults to that), so results land in the same order as the copies that produce them."""

    def __init__(self, *, cuda: bool, role: str, threads: int | None = None):
        self.cuda, self.role, self.threads = cuda, role, threads
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, function: Callable[..., T], *args: Any, inline: bool | None = None) -> Future[T]:
        if inline if inline is not None else not self.cuda:
            future: Future[T] = Future()
            future.set_result(function(*args))
            return future
        with self._lock:
            if self._executor is None:
                # torch's intra-op thread count is the calling thread's own (an OpenMP setting): this sets
                # the worker's alone.
                initializer = None if self.threads is None else functools.partial(torch.set_num_threads, self.threads)
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"offload-{self.role}",
                                                    initializer=initializer)
            return self._executor.submit(function, *args)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class GradientPath:
    """Sends the gradients of hooked, chunked and gathered units to the host, and lands them there."""

    def __init__(self, layout: Layout, streams: CopyStreams, log: CopyLog, options: OffloadOptions,
                 worker: HostWorker, passes: PassState, device: torch.device, *, finish: Callable[[], None]):
        self.layout, self.streams, self.log, self.options = layout, streams, log, options
        self.worker, self.passes, self.device = worker, passes, device
        self._finish = finish  # the engine's end of a backward (which calls `finish` here last)
        self._in_flight: InFlight = deque()
        self._head_in_flight: InFlight = deque()
        self._tasks: list[Future[Any]] = []
        self.defer = False
        """Gradients of blocks in device slots of their own stay on the device until `send_deferred`
        (OffloadEngine.accumulating sets it for the micro-batches of one mini-batch)."""
        self._deferred: list[Unit] = []  # units whose compute parameters hold gradients not sent yet
        # Pinned memory for gradients the worker adds or converts (sized at the first use).
        self.staging = StagingRing(0, functools.partial(pinned_empty, device=device), ALIGNMENT)
        self.squares = SquareSums()
        self.device_squares = streams.cuda
        """Whether send_deferred takes the square of what it sends (Unit.grad_square). On a GPU that spares the
        clipping norm a read of host memory; on the CPU it would be the same read, so it is left off there and
        the norm is computed as it always was (the tests turn it on to check it)."""

    # ------------------------------------------------------------------------------ a backward

    def enter_backward(self) -> None:
        """The first gradient of a backward reached the model: reset every unit's pass state."""
        if self.passes.backward_active:
            return
        self.passes.backward_active = self.passes.in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        for unit in self.layout.units:
            if not unit.offloaded or not unit.trainable:
                continue
            unit.passing.begin(fresh=all(entry.parameter.grad is None for entry in unit.entries))
            if unit.kind == UnitKind.ROWS and not self.layout.parts.tied and unit.passing.fresh:
                # Zero the embedding's gradient while the backward runs; the rows are added into it last.
                self.ensure_grad_arena(unit)
                assert unit.grad_views is not None
                self.run_on_worker(unit.grad_view(0).zero_)

    def on_grad_accumulated(self, unit: Unit, parameter: nn.Parameter) -> None:
        """A compute parameter's gradient is complete; the unit's go to the host once all of them are,
        unless they add up on the device until the mini-batch ends (`keeps_on_device`)."""
        self.enter_backward()
        if self.keeps_on_device(unit):
            if unit not in self._deferred:
                self._deferred.append(unit)
            return
        unit.passing.accumulated += 1
        if unit.passing.accumulated == sum(compute.requires_grad for compute in unit.compute_params):
            self._flush_accumulated(unit)

    def flush_pending(self) -> None:
        """Send the gradients of hooked units whose parameters did not all get one (end of a backward)."""
        for unit in self.layout.units:
            if unit.kind == UnitKind.HOOKED and unit.passing.accumulated:
                self._flush_accumulated(unit)

    def _flush_accumulated(self, unit: Unit) -> None:
        pieces = []
        for index, compute in enumerate(unit.compute_params):
            if compute.grad is not None:
                pieces.append((compute.grad, index, 0))
                compute.grad = None
        if pieces:
            self.send(unit, pieces)

    def keeps_on_device(self, unit: Unit) -> bool:
        """While deferring: a hooked unit in a device slot of its own (a layer dynamic offload keeps on the
        GPU, or a unit on the GPU with its masters on the host). Its compute parameters outlive the pass,
        so autograd adds each micro-batch's gradient into theirs, on the device."""
        return self.defer and unit.kind == UnitKind.HOOKED and bool(unit.blocks) and not unit.blocks[0].streamed

    def send_deferred(self) -> None:
        """Send the gradients the device added up (one copy per tensor for the whole mini-batch) and
        wait until they have landed in the masters' .grad, as at the end of a backward."""
        units, self._deferred = self._deferred, []
        if not units:
            return
        for unit in units:
            unit.passing.begin(fresh=all(entry.parameter.grad is None for entry in unit.entries))
            self._flush_accumulated(unit)
        self.finish()

    def finish(self) -> None:
        """After the blocks were released: wait for every copy and landing, then point each master's
        .grad at its host gradient."""
        self.streams.synchronize()
        self._in_flight.clear()
        self._head_in_flight.clear()
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.result()
        for unit in self.layout.units:
            if not unit.passing.landed:
                continue  # nothing sent this pass: its host gradient (and square, if known) is as it was
            for index in unit.passing.landed_entries():
                parameter = unit.entries[index].parameter
                if parameter.grad is None:
                    assert unit.grad_views is not None
                    parameter.grad = unit.grad_view(index)
            unit.grad_square = unit.passing.square if unit.passing.square_exact else None
            unit.passing.landed.clear()
        self.passes.end()

    def abandon(self) -> None:
        """Forget a backward that raised: the copies it was still making and what the worker had left."""
        for unit in self.layout.units:
            for compute in unit.compute_params:
                compute.grad = None
            unit.grad_square = None
            unit.passing.landed.clear()
            unit.passing.accumulated = 0
        self._deferred.clear()  # their compute gradients are dropped above
        self._in_flight.clear()
        self._head_in_flight.clear()
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.exception()  # waits; a failure there is a consequence of the error being recovered
        self.staging.reset()
        self.passes.end()

    def close(self) -> None:
        self._in_flight.clear()
        self._head_in_flight.clear()
        self.staging.clear()

    def run_on_worker(self, function: Callable[..., Any], *args: Any) -> None:
        """Gradient work for the worker; `finish` waits for it."""
        self._tasks.append(self.worker.submit(function, *args))

    # ---------------------------------------------------------------------------------- sending

    def send(self, unit: Unit, pieces: list[Piece]) -> None:
        """Copy gradient pieces into the unit's host gradient (copied over it, or added)."""
        unit.grad_square = None
        self.ensure_grad_arena(unit)
        self._retire_in_flight()
        # Flatten before the event that orders the copies after the compute (a copy kernel, if any,
        # must come before it).
        pieces = [(tensor.reshape(-1), index, first) for tensor, index, first in pieces]
        # A piece's first write in a fresh pass is a copy; any other (a second piece at the same
        # place, or one after a tied embedding's rows) is added to what is there.
        first_writes = [unit.passing.fresh and not {(index, first), (index, ROWS_PIECE)} & unit.passing.landed
                        for _, index, first in pieces]
        self.add_square(unit, [(tensor, index) for tensor, index, _ in pieces], exact=all(first_writes))
        unit.passing.landed.update((index, first) for _, index, first in pieces)
        if not self.streams.cuda:
            for (tensor, index, first), copy in zip(pieces, first_writes, strict=True):
                self.log.timed(D2H, unit.group, tensor.numel() * tensor.element_size(), None,
                               functools.partial(self._land, unit, index, first, tensor, copy))
            return
        self.streams.stream_waits(self.streams.d2h, self.streams.record_compute())
        # Straight into the pinned host gradient when every piece is a first write (the head's chunks
        # of one backward are each a first write of their own rows); through the worker otherwise.
        if unit.grad_pinned and all(first_writes):
            self._send_direct(unit, pieces)
        else:
            self._send_staged(unit, pieces, first_writes)

    def add_square(self, unit: Unit, pieces: list[tuple[torch.Tensor, int]], *, exact: bool) -> None:
        """Count pieces about to be sent to `unit`'s host gradient (tensor, entry index) in the pass's square:
        `exact` when each is the first write of its place in a fresh host gradient. The square is taken on the
        device, on the compute stream before the copies' event, so the clipping norm reads device memory
        (microseconds) instead of the host gradient (0.45 s of a 7B update on an H200 host, 2026-12-04)."""
        passing = unit.passing
        assert unit.grad_views is not None
        narrowed = any(unit.grad_view(index).element_size() < tensor.element_size() for tensor, index in pieces)
        if not (exact and passing.square_exact and self.device_squares) or narrowed:
            passing.square, passing.square_exact = None, False
            return
        square = self.squares.of([tensor for tensor, _ in pieces])
        if square is not None:  # (None: no piece)
            passing.square = square if passing.square is None else passing.square + square

    def _send_direct(self, unit: Unit, pieces: list[Piece]) -> None:
        assert unit.grad_views is not None
        end = None
        for tensor, index, first in pieces:
            target = unit.grad_view(index).view(-1)[first:first + tensor.numel()]
            end = self.log.timed(D2H, unit.group, tensor.numel() * tensor.element_size(), self.streams.d2h,
                                 functools.partial(target.copy_, tensor, non_blocking=True))
        self.hold_until_copied(end, [tensor for tensor, _, _ in pieces], head=unit.kind == UnitKind.CHUNKS)

    def _send_staged(self, unit: Unit, pieces: list[Piece], first_writes: list[bool]) -> None:
        if not self.staging.capacity:
            self.staging.capacity = self.layout.staging_bytes(self.options.staging_buffers)
        buffer, offset = self.staging.take(sum(aligned(tensor.nbytes) for tensor, _, _ in pieces)), 0
        staged = []
        end = None
        for (tensor, index, first), copy in zip(pieces, first_writes, strict=True):
            host = typed_view(buffer, offset, tensor)
            offset += aligned(tensor.nbytes)
            end = self.log.timed(D2H, unit.group, tensor.numel() * tensor.element_size(), self.streams.d2h,
                                 functools.partial(host.copy_, tensor, non_blocking=True))
            staged.append((host, index, first, copy))
        self.hold_until_copied(end, [tensor for tensor, _, _ in pieces], head=unit.kind == UnitKind.CHUNKS)
        task = self.worker.submit(self._land_staged, unit, staged, end)
        self._tasks.append(task)
        self.staging.hold_until(task)

    def _land_staged(self, unit: Unit, staged: list[tuple[torch.Tensor, int, int, bool]],
                     end: torch.cuda.Event) -> None:
        end.synchronize()
        for host, index, first, copy in staged:
            self._land(unit, index, first, host, copy)

    def _land(self, unit: Unit, index: int, first: int, tensor: torch.Tensor, overwrite: bool) -> None:
        """Put a gradient piece into the master's gradient: copied over it (the piece's first write of
        a fresh pass) or added to it."""
        assert unit.grad_views is not None
        parameter = unit.entries[index].parameter
        target = parameter.grad if parameter.grad is not None else unit.grad_view(index)
        target = target.view(-1)[first:first + tensor.numel()]
        if overwrite:
            target.copy_(tensor.reshape(-1))
        else:
            target.add_(tensor.reshape(-1))

    def ensure_grad_arena(self, unit: Unit) -> None:
        """The group's host gradient arena, in the gradient dtype (allocated at its first gradient)."""
        if unit.grad_views is None:
            allocate_grad_arena(self.layout, unit.group, self.device)

    def _retire_in_flight(self) -> None:
        for queue in (self._in_flight, self._head_in_flight):
            while queue and (queue[0][0] is None or queue[0][0].query()):
                queue.popleft()

    def hold_until_copied(self, end: torch.cuda.Event | None, tensors: list[torch.Tensor], *,
                          head: bool = False) -> None:
        """Keep device gradients alive until their copy to the host is done.

        The host runs ahead of the device, so waiting for the copies to finish on the host would
        keep every block's gradients alive. Instead the compute stream waits for the oldest copy
        and its tensors are released: the allocator hands their memory only to later work on the
        compute stream, which now runs after the copy (what record_stream would do, without its
        cost). The wait is free unless the copies fall behind the backward pass.
        """
        queue = self._head_in_flight if head else self._in_flight
        limit = self.options.head_grads_in_flight if head else self.options.grads_in_flight
        queue.append((end, tensors))
        while limit is not None and len(queue) > limit:
            oldest, _ = queue.popleft()
            self.streams.compute_waits(oldest)


class SquareSums:
    """Sums of squares of gradients, in fp32: of a unit's gradient as its device sends it (GradientPath), of
    narrow (bf16) host gradients for the clipping norm (OffloadAdamW).

    On the host: BLAS dot products of slices (widened to fp32 in a reused buffer when narrower). torch's
    norm reduces each CPU tensor on one thread (10 GB/s on an H200 host, where the fused AdamW moves
    84 GB/s), and its float32 sum of 2**27 bf16 normals came out 0.35% short where this is within 0.01%.
    On a GPU: torch's norm kernels (tree reductions, a few microseconds a tensor)."""

    def __init__(self) -> None:
        self._scratch: torch.Tensor | None = None

    def of(self, grads: list[torch.Tensor], slice_elements: int = UPDATE_SLICE_ELEMENTS) -> torch.Tensor | None:
        """The sum of the squares of `grads` (on one device) as a 0-d fp32 tensor there; None without any. On
        the host, in slices of `slice_elements`."""
        if not grads:
            return None
        if grads[0].device.type != "cpu":
            return torch.stack([torch.linalg.vector_norm(grad, dtype=torch.float32) for grad in grads]).square().sum()
        dots = []
        for grad in grads:
            for piece in grad.view(-1).split(slice_elements):
                if piece.dtype != torch.float32:
                    if self._scratch is None or self._scratch.numel() < piece.numel():
                        self._scratch = torch.empty(min(grad.numel(), slice_elements), dtype=torch.float32)
                    piece = self._scratch[:piece.numel()].copy_(piece)
                dots.append(torch.dot(piece, piece))
        return torch.stack(dots).sum()
