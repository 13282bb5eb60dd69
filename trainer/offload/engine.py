"""The offload engine: parameters, gradients and optimizer states on the CPU, per module group.

The engine wires its collaborators together for one model, and is what the rest of the trainer sees:

- `layout`: units, blocks, slots, host arenas and their byte accounting (trainer/offload/layout.py);
- `streamer`: hooks that swap blocks into device slots around their forward and backward, with
  prefetch on a copy stream (streamer.py);
- `gradients`: the gradient path from the device to the host masters, its staging ring and the
  worker thread that lands them (gradients.py);
- `rows`: an embedding gathered by rows and a head streamed in chunks (rows.py);
- `staging` and `layers`: what a phase keeps on the device, and transformer layers moved at run
  time by dynamic offload (placement.py).

Units placed on the GPU stay there, untouched (with optimizer_offload, their fp32 masters and
optimizer states live on the CPU and a compute copy stays on the GPU). Every copy is logged
(direction, group, bytes) and a sample of them timed with CUDA events read lazily (copies.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from trainer.errors import UserError
from trainer.offload.bus import BusTurns
from trainer.offload.copies import CopyLog, CopyStreams
from trainer.offload.device_update import DeviceUpdate
from trainer.offload.embedding_cache import EmbeddingCache
from trainer.offload.gradients import GradientPath, HostWorker
from trainer.offload.layout import (
    HostMemoryError,
    Layout,
    format_bytes,
    host_arenas,
    host_memory_message,
    model_host_bytes,
    pack,
    plan_layout,
    summary_lines,
    summary_rows,
)
from trainer.offload.optimizer import OffloadAdamW
from trainer.offload.placement import LayerMover, PhaseStaging
from trainer.offload.rows import RowsAndChunks
from trainer.offload.streamer import Streamer
from trainer.offload.units import Block, PassState, Placement, Unit
from trainer.offload.update_split import UpdatePath, UpdateSplit, UpdateTiming

UpdateMode = Literal["cpu", "gpu", "both"]
"""Where an offloaded optimizer's update runs (fsdp_config.optimizer_update once "auto" is resolved): the host's
cores, the compute device over states streamed through it, or both at once on disjoint units (UpdateSplit)."""

__all__ = ["HostMemoryError", "OffloadEngine", "OffloadOptions", "format_bytes"]


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
    worker_threads: int | None = field(default_factory=lambda: _threads_from_environment())
    """The CPU threads each engine's worker runs its torch operations on (the CPU AdamW, adding gradients);
    None: torch's default for a new thread (every core). Each trained model's engine has a worker, and two
    run at once (one model's update lands gradients while the other's CPU AdamW runs), beside the main
    thread that drives the GPU: VERL_OFFLOAD_WORKER_THREADS sets it for a run."""
    pipelined_update: bool = True
    """The CPU optimizer update runs in a background thread, block by block in forward order, and
    the next forward waits for each block's update only when it reaches that block. Measured on an
    H200 host (16 cores, 2026-11-30, clip folded into the update): a step of 8 7B-shaped layers took
    1376 ms with it and 1572 ms without (benchmarks/README.md)."""


class OffloadEngine:
    """Places one model's module groups, streams the offloaded ones, and accounts for every copy.

    Build it with `attach_offload`. The model keeps working as a plain nn.Module: forward with or
    without grad, backward (with gradient checkpointing), generate with a KV cache, state_dict.
    """

    def __init__(self, model: nn.Module, placements: dict[str, str], device: torch.device, *, role: str,
                 optimizer_offload: bool = False, options: OffloadOptions | None = None,
                 layer_classes: Sequence[str] | None = None, dynamic_layers: bool = False,
                 layers_on_gpu: int | None = None, host_budget: int | None = None,
                 host_grad_dtype: torch.dtype | None = None, delayed_update: bool = False,
                 optimizer_update: UpdateMode = "cpu"):
        self.model, self.role = model, role
        self.device = torch.device(device)
        self.options = options or OffloadOptions()
        self.streams = CopyStreams(self.device)
        self.log = CopyLog(self.streams.cuda)
        self.layout: Layout = plan_layout(model, placements, optimizer_offload=optimizer_offload,
                                          layer_classes=layer_classes, dynamic_layers=dynamic_layers,
                                          layers_on_gpu=layers_on_gpu, host_grad_dtype=host_grad_dtype)
        if host_budget is not None:
            # Packing gives back the host memory the model's weights hold now (they move into the
            # arena or to the GPU), so that memory counts as available to the placement.
            host_budget += model_host_bytes(model)
            if sum(self.host_bytes().values()) > host_budget:
                raise HostMemoryError(host_memory_message(role, self.host_bytes(), host_budget))
        if optimizer_update not in ("cpu", "gpu", "both"):
            raise ValueError(f"the {role}'s optimizer_update must be cpu, gpu or both, got {optimizer_update!r}")
        self.layout.device_update = optimizer_update != "cpu" and self.layout.optimizer_offload
        self.layout.split_update = optimizer_update == "both" and self.layout.optimizer_offload
        pack(model, self.layout, self.device)
        if delayed_update:
            check_delayed_update(self.layout.units, role)
        self.delayed_update = delayed_update
        """The optimizer's CPU update runs during the next rollout, which reads the weights from before it
        (ZeRO-Offload's delayed parameter update); `stale_reads` opens that window."""
        self.update_lock = threading.Lock()
        """Held while an update's end and zero_grad decide who clears a unit's gradients."""
        self._update_tasks: list[Future[Any]] = []
        self.first_optimizer_states: Callable[[], None] | None = None
        """Makes the CPU optimizer's states (OffloadAdamW sets it; make_optimizer_states runs it)."""
        self.worker = HostWorker(cuda=self.streams.cuda, role=role, threads=self.options.worker_threads)
        dtypes = self.layout.dtypes
        self.device_update = DeviceUpdate(self.device, self.log, master_dtype=dtypes.master, grad_dtype=dtypes.grad,
                                          compute_dtype=dtypes.compute) if self.layout.device_update else None
        """Runs the optimizer update of the offloaded units on the device (device_update.py); None: on the CPU."""
        self.device_worker = HostWorker(cuda=self.streams.cuda, role=f"{role}-device-update",
                                        threads=self.options.worker_threads) if self.device_update else None
        """The device path's own thread: its updates run beside the host worker's (which lands gradients and
        runs the host path), each path's units in the order they were submitted."""
        self.publisher = HostWorker(cuda=self.streams.cuda, role=f"{role}-publish",
                                    threads=self.options.worker_threads) if delayed_update else None
        """Under a delayed update: writes each unit's updated masters into its arena once the rollout's stale reads
        end, in forward order, while the first forward after them runs (each of its reads waits for its own unit
        only), instead of that forward writing each on the main thread while the GPU waits (`stale_reads`)."""
        self._publishing: Future[Any] | None = None
        self.update_split = UpdateSplit.guessed(self.device_update.bytes_each_way()) \
            if self.device_update is not None and self.layout.split_update else None
        """With optimizer_update both: which units each step updates on the device and which on the host."""
        self._planned_at: float | None = None
        self._needed_at: float | None = None
        """The last plan's time and the first read after it that needed its updates (perf_counter seconds): the
        split's window, learned at the next plan."""
        if self.update_split is not None:
            for unit in self.layout.units:
                unit.on_read = self._read_needs_update
        self.bus_turns: BusTurns | None = None
        """The run's turns on the bus for device updates, across its models (`share_bus`); None: never held."""
        self.update_paths: dict[str, UpdatePath] = {}
        """Where each unit's latest optimizer update went, by unit name."""
        self._update_timings: list[UpdateTiming] = []  # appended by the workers, read once they are drained
        self._planned_updates = 0  # optimizer steps planned so far (the first one's timings are not learned)
        self.passes = PassState()
        self.gradients = GradientPath(self.layout, self.streams, self.log, self.options, self.worker, self.passes,
                                      self.device, finish=self._finish_backward)
        self.staging = PhaseStaging(self.layout, self.streams, self.log, self.device)
        self.streamer = Streamer(self.layout, self.streams, self.log, self.options, self.passes, self.staging,
                                 self.device, self.gradients.on_grad_accumulated)
        self.layers = LayerMover(self.layout, self.streamer, self.passes, self.options, self.device, role)
        self.rows = RowsAndChunks(self.layout, self.streams, self.log, self.streamer, self.gradients, self.staging,
                                  self.device)
        self._install_hooks()

    def _install_hooks(self) -> None:
        self.model.register_state_dict_pre_hook(lambda *_: self.wait_for_updates())
        self.model.register_load_state_dict_pre_hook(lambda *_, **__: self.wait_for_updates())
        self.streamer.install_hooks(self.model, on_backward=self.gradients.enter_backward)
        self.rows.install()
        if any(unit.offloaded for unit in self.units):
            _present_compute_placement(self.model, self.device, self.layout.dtypes.compute)

    def _finish_backward(self) -> None:
        self.gradients.flush_pending()
        self.streamer.release_all()
        self.gradients.finish()

    # ---------------------------------------------------------------------------- the layout

    @property
    def units(self) -> list[Unit]:
        return self.layout.units

    @property
    def blocks(self) -> list[Block]:
        return self.streamer.blocks

    @property
    def placements(self) -> dict[str, Placement]:
        return self.layout.placements

    @property
    def transformer_units(self) -> list[Unit]:
        return self.layout.transformer_units

    @property
    def layer_bytes(self) -> int:
        """Device bytes of the largest transformer block (what moving one to the CPU frees, at most)."""
        return self.layout.layer_bytes

    @property
    def ring_slots(self) -> int:
        """Device slots of a block's size that streamed transformer blocks rotate through while any streams."""
        return self.options.prefetch + 1




    def summary(self) -> list[dict[str, object]]:
        """Each group: where it lives and its parameters' size (for the start-of-run log and /v1/status)."""
        return summary_rows(self.layout, self.role, self.device)

    def summary_lines(self) -> list[str]:
        """The offload summary in words, e.g. "Embedding: OFFLOADED to CPU (1.02 GiB)"."""
        return summary_lines(self.layout, role=self.role, device=self.device, host=self.host_bytes(),
                             saved_gpu_bytes=self.saved_gpu_bytes())

    def host_bytes(self) -> dict[str, int]:
        """Host memory the placement holds once it trains, by use (Layout.host_bytes)."""
        return self.layout.host_bytes(cuda=self.streams.cuda, staging_buffers=self.options.staging_buffers)

    def saved_gpu_bytes(self) -> int:
        return self.layout.saved_gpu_bytes(self.working_set_bytes())

    def working_set_bytes(self) -> int:
        """Device memory of the engine's static slots."""
        return self.streamer.working_set_bytes()

    def host_tensors(self) -> list[torch.Tensor]:
        """The host arenas the offloaded groups live in (pinned when the device is a GPU)."""
        return host_arenas(self.layout)

    # -------------------------------------------------------------------------------- copies

    def drain_copy_stats(self, max_records: int | None = None) -> list[dict[str, Any]]:
        """Timed copies completed since the last drain: [{direction, group, bytes, seconds}], bounded
        (a sample: see CopyLog; drain_copy_counts has every copy)."""
        return self.log.drain(max_records)

    def drain_copy_counts(self) -> list[dict[str, Any]]:
        """Every copy since the last call: [{direction, group, copies, bytes}]."""
        return self.log.drain_counts()

    def copied_bytes(self) -> dict[tuple[str, str], int]:
        """Bytes copied so far per (direction, group)."""
        return dict(self.log.totals)

    def copy_counts(self) -> dict[tuple[str, str], int]:
        return dict(self.log.counts)

    # ----------------------------------------------------------------------------- optimizer

    def optimizer(self, *, lr: float, betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.01,
                  eps: float = 1e-8) -> OffloadAdamW:
        """AdamW over the model's trainable parameters, each on the device its master lives on."""
        return OffloadAdamW(self, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)

    @property
    def update_mode(self) -> UpdateMode:
        """Where the offloaded units' optimizer updates run: cpu, gpu (the device path) or both."""
        if self.update_split is not None:
            return "both"
        return "gpu" if self.device_update is not None else "cpu"

    def plan_update_paths(self, units: Sequence[Unit]) -> list[UpdatePath]:
        """The path of each of this step's unit updates, in the order they will be submitted. With both paths,
        the split first learns from the timings of the updates drained since the last plan."""
        if self.update_split is None:
            return ["device" if self.device_update is not None else "host"] * len(units)
        self.wait_for_updates()  # (done already when the optimizer asks: every timing of the last step is in)
        timings, self._update_timings = self._update_timings, []
        if self._planned_updates > 1:  # the first step's updates made the states: not what a step takes
            self.update_split.learn(timings)
        now = time.perf_counter()
        if self._planned_at is not None:  # (no read since: this plan needs the last one's updates)
            self.update_split.learn_window((self._needed_at or now) - self._planned_at)
        self._planned_at, self._needed_at = now, None
        self._planned_updates += 1
        return self.update_split.assign([update_elements(unit) for unit in units])

    def _read_needs_update(self) -> None:
        """Unit.on_read: the first read since the last plan that needs an updated unit ends the split's window."""
        if self._planned_at is not None and self._needed_at is None:
            self._needed_at = time.perf_counter()

    def submit_update(self, unit: Unit, update: Callable[..., None], *args: Any, path: UpdatePath = "host") -> None:
        """Run a unit's optimizer update on `path`'s worker thread (at once without the pipelined update): the
        unit is not ready (its next fetch waits) until `update` sets `unit.ready` itself. Its seconds are
        timed for the split."""
        worker = self._worker(path)
        unit.ready.clear()
        self.update_paths[unit.name] = path
        task = self._timed(update, path, update_elements(unit))
        if path == "device" and self.bus_turns is not None and self.options.pipelined_update:
            task = self.bus_turns.in_turn(self.role, task)
        self._update_tasks.append(worker.submit(task, *args, inline=not self.options.pipelined_update))

    def share_bus(self, turns: BusTurns) -> None:
        """Take turns on the bus with the run's other models (bus.py): this model's device updates wait while a
        more used model claims it, unless something waits for them."""
        self.bus_turns = turns
        if self.delayed_update:
            turns.defer(self.role)
        for unit in self.units:
            unit.ready.before_wait = functools.partial(turns.hurry, self.role)

    @contextlib.contextmanager
    def claiming_bus(self) -> Iterator[None]:
        """A training phase of this model: the bus is its own (the updates of less used models wait) until the
        phase's device updates have run; under a delayed update, until the phase ends (its updates, read at the
        next training phase at the earliest, then wait behind the others': bus.py)."""
        turns = self.bus_turns
        if turns is None or self.device_update is None:
            yield
            return
        turns.claim(self.role)
        try:
            yield
        except BaseException:
            turns.release(self.role)
            raise
        if self.delayed_update:
            turns.release(self.role)
        else:
            self.after_updates(functools.partial(turns.release, self.role), path="device")

    def _worker(self, path: UpdatePath) -> HostWorker:
        if path == "host":
            return self.worker
        if self.device_worker is None:
            raise ValueError(f"the {self.role}'s optimizer update runs on the host (optimizer_update=cpu): "
                             "nothing is updated on the device")
        return self.device_worker

    def _timed(self, update: Callable[..., None], path: UpdatePath, elements: int) -> Callable[..., None]:
        """`update`, timed for the split (when there is one: otherwise nothing would read the timings)."""
        if self.update_split is None:
            return update

        @functools.wraps(update)  # (a profile names the worker's tasks by the update's name)
        def timed(*args: Any) -> None:
            started = time.perf_counter()
            update(*args)
            self._update_timings.append(UpdateTiming(path, elements, time.perf_counter() - started))
        return timed

    def after_updates(self, work: Callable[[], None], path: UpdatePath = "host") -> None:
        """Run `work` in `path`'s worker thread once the updates submitted to it so far are done (at once
        without the pipelined update, whose updates are done already)."""
        if self.options.pipelined_update:
            self._update_tasks.append(self._worker(path).submit(work, inline=False))
        else:
            work()

    def updates_drained(self) -> bool:
        """Whether every optimizer update submitted so far, on either path, has ended (without waiting)."""
        return all(task.done() for task in self._update_tasks) and all(unit.ready.is_set() for unit in self.units)

    def make_optimizer_states(self) -> None:
        """Start making the CPU optimizer's states in the worker thread, before its first update (which
        waits for them, as `wait_for_updates` does); nothing without an optimizer, or once they are made."""
        work, self.first_optimizer_states = self.first_optimizer_states, None
        if work is not None:
            self._update_tasks.append(self.worker.submit(work, inline=False))

    def wait_for_updates(self) -> None:
        """Block until every pending optimizer update has landed, on the host path and on the device path, and
        any publish started has ended (and raise if one failed)."""
        tasks, self._update_tasks = self._update_tasks, []
        if self.bus_turns is not None and not all(task.done() for task in tasks):
            self.bus_turns.hurry(self.role)  # this thread waits for them: they may not wait for it
        for task in tasks:
            task.result()
        for unit in self.units:
            unit.ready.wait()
        self._finish_publishing()

    def _finish_publishing(self) -> None:
        """Wait for the publisher, and make what it wrote the weights of the units no read has published yet (the
        next update changes their masters again; the next stale reads take what the arena holds)."""
        publishing, self._publishing = self._publishing, None
        if publishing is None:
            return
        publishing.result()
        for unit in self.units:
            if unit.publishing is not None:
                unit.finish_publish()

    def after_update(self, unit: Unit, written: set[int] | None = None) -> None:
        """The optimizer changed this unit's masters in place: refresh its compute copy (`written`: the entries
        whose arena copy the update wrote already)."""
        unit.after_update(written)

    def publish_updates(self) -> None:
        """Under a delayed update: wait for it and publish it to every unit's compute copy now, rather than at each
        unit's next read (before a checkpoint, so that a run resumed from it samples as the one that saved it
        goes on to; and before validation)."""
        for unit in self.units:
            if unit.publish_pending and not unit.stale_ok:
                unit.settled()

    @contextlib.contextmanager
    def stale_reads(self) -> Iterator[None]:
        """Inside: under a delayed update, reads take the weights from before the update still running (a
        rollout). Afterwards the first read of each unit waits for its update and publishes it."""
        if not self.delayed_update:
            yield
            return
        self._finish_publishing()
        for unit in self.units:
            unit.stale_ok = True
        try:
            yield
        finally:
            for unit in self.units:
                unit.stale_ok = False
            self._start_publishing()

    def _start_publishing(self) -> None:
        """Start writing the pending update's masters into the arenas on the publisher's thread, unit by unit in
        forward order as each unit's update ends (on a CPU, where the updates ran already: at once)."""
        pending = [unit for unit in self.units if unit.publish_pending and unit.publishing is None]
        if self.publisher is None or not pending:
            return
        events = []
        for unit in pending:
            unit.publishing = threading.Event()
            events.append(unit.publishing)

        def publish() -> None:
            for unit, event in zip(pending, events, strict=True):
                unit.publish_masters(event)

        self._publishing = self.publisher.submit(publish)

    # ------------------------------------------------------------------------------- passes


    def close(self) -> None:
        """Finish pending work and give back the device slots; the model cannot run afterwards."""
        self.wait_for_updates()
        if self.device_update is not None:
            self.device_update.release()
        self.worker.shutdown()
        if self.device_worker is not None:
            self.device_worker.shutdown()
        if self.publisher is not None:
            self.publisher.shutdown()
        self.streams.synchronize()
        for block in self.blocks:
            block.slot.give_back()
        for unit in self.units:
            unit.compute_params = []
        self.gradients.close()

    def abandon_pass(self) -> None:
        """Forget a forward or backward that raised (a CUDA out-of-memory error): give back the
        blocks it held and drop the gradients it was still sending. The masters' gradients, which
        it may have added to, are the caller's to discard."""
        self.wait_for_updates()
        self.streams.synchronize()
        self.streamer.release_all()
        self.gradients.abandon()

    # -------------------------------------------------------------------- placement per phase

    @property
    def phase(self) -> str:
        return str(self.staging.phase)

    def stageable_bytes(self, phase: str | None = None) -> dict[str, int]:
        """The CPU-resident groups a no-grad phase may copy whole to the device (Layout.stageable_bytes); of those,
        with `phase`, the ones that phase may keep (training: the head alone)."""
        return self.layout.stageable_bytes() if phase is None else self.staging.keepable_bytes(phase)

    def placed_for(self, phase: str, *,
                   budget_bytes: int | None = None) -> contextlib.AbstractContextManager[list[str]]:
        """Place the groups for one phase of a step (PhaseStaging.placed_for); yields the groups kept."""
        return self.staging.placed_for(phase, budget_bytes=budget_bytes)

    def graph_key(self) -> tuple[object, ...] | None:
        """Whether a CUDA graph may capture a no-grad forward of the model now, and of what (Streamer.graph_key)."""
        return self.streamer.graph_key() if self.streams.cuda else None

    def replayed(self) -> None:
        """A CUDA graph of a forward was replayed (Streamer.replayed)."""
        self.streamer.replayed()

    def drop_kept(self) -> list[str]:
        """Give back the device copies the current phase keeps; the groups dropped."""
        return self.staging.drop_kept()

    def enable_embedding_cache(self, *, cache_size: int, warmup_steps: int) -> EmbeddingCache | None:
        return self.rows.enable_embedding_cache(cache_size=cache_size, warmup_steps=warmup_steps)


    # ------------------------------------------------------------------------ dynamic offload


    @property
    def moves(self) -> dict[str, int]:
        """Transformer layers moved so far, "to_cpu" and "to_gpu"."""
        return self.layers.moves

    @moves.setter
    def moves(self, value: dict[str, int]) -> None:
        self.layers.moves = value

    @property
    def layers_on_gpu(self) -> int:
        """Transformer blocks on the device between passes (resident, or a compute copy kept there)."""
        return self.layers.layers_on_gpu

    def set_transformer_layers_on_gpu(self, count: int) -> tuple[int, int]:
        """Keep the first `count` transformer blocks on the device (LayerMover); the blocks moved.
        Gradients a block still holds on the device land first: its slot may go."""
        if count != self.layers.layers_on_gpu:
            self.gradients.send_deferred()
        return self.layers.set_transformer_layers_on_gpu(count)

    # ------------------------------------------------------------------------------ gradients

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """The backward passes of one mini-batch's micro-batches: the gradients of blocks kept in device
        slots of their own (dynamic offload's layers on the GPU; units on the GPU whose masters live on
        the host) add up on the device and go to the host once, when the context ends, instead of once
        a micro-batch (issue 14: every micro-batch sent all its gradients home and the host added them
        up). Only where the host keeps gradients in the compute dtype (a bf16 model with
        offload_grad_dtype bf16, or fp32 throughout): the sum is then the same; fp32 host gradients of a
        bf16 model still add up on the host, in fp32. A context left by an error drops what it held."""
        self.gradients.defer = self.layout.dtypes.grad == self.layout.dtypes.compute
        try:
            yield
        except BaseException:
            self.gradients.defer = False
            self.abandon_pass()
            raise
        self.gradients.defer = False
        self.gradients.send_deferred()


def update_elements(unit: Unit) -> int:
    """The elements a unit's optimizer update reads and writes: those of its masters with a gradient."""
    return sum(entry.parameter.numel() for entry in unit.entries if entry.parameter.grad is not None)


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


def check_delayed_update(units: Sequence[Unit], role: str) -> None:
    """A delayed update needs every trained unit's masters apart from the copy the device reads (fp32
    masters of a bf16 model, on the host): the rollout reads that copy while the update changes them."""
    shared = [unit.name for unit in units if unit.trainable and (not unit.offloaded or unit.master_is_arena)]
    if shared:
        raise ValueError(f"the {role}'s delayed_update needs fp32 masters on the CPU apart from the bf16 weights the "
                         f"GPU reads, but {', '.join(shared[:3])} {'have' if len(shared) > 1 else 'has'} none: set "
                         "fsdp_config.model_dtype=bf16 and optimizer_offload=true, or delayed_update=false")


_COMPUTE_PLACEMENT_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _compute_placement_class(model_class: type[nn.Module]) -> type[nn.Module]:
    """The model's class, reporting the compute device and dtype whatever its masters' placement.

    HF code places new tensors on `model.device` (the first parameter's device) and casts to
    `model.dtype`; with the embedding on the CPU or fp32 masters those would be wrong. One such class
    per model class (a model placed twice, or two of one class, share it).
    """
    if model_class not in _COMPUTE_PLACEMENT_CLASSES:
        _COMPUTE_PLACEMENT_CLASSES[model_class] = type(model_class.__name__, (model_class,), {
            "__module__": model_class.__module__,
            "__qualname__": model_class.__qualname__,
            "device": property(lambda self: self._offload_compute_device),
            "dtype": property(lambda self: self._offload_compute_dtype),
        })
    return _COMPUTE_PLACEMENT_CLASSES[model_class]


def _present_compute_placement(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    # object.__setattr__: nn.Module's own would register a tensor-typed attribute differently.
    object.__setattr__(model, "_offload_compute_device", device)
    object.__setattr__(model, "_offload_compute_dtype", dtype)
    model.__class__ = _compute_placement_class(type(model))
