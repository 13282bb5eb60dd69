"""Where and when one model's optimizer updates run: the engine's update scheduling (OffloadEngine.updates).

OffloadAdamW computes each unit's update; this decides the rest:

- the path of each unit's update: the host worker's thread (the host's cores), the device worker's (the
  compute device, over states streamed through the bus: device_update.py), or, with optimizer_update both,
  a split between the two that learns from each step's timings (update_split.py);
- the pipelined update: a unit's update runs in its worker's thread and the next forward waits for that
  unit only when it reaches it (Unit.ready);
- the bus's turns across a run's models (bus.py);
- a delayed update (ZeRO-Offload's delayed parameter update): the rollout reads the weights from before
  the update still running (`stale_reads`), and the publisher writes the updated masters into the arenas
  afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from trainer.offload.bus import BusTurns
from trainer.offload.copies import CopyLog
from trainer.offload.device_update import DeviceUpdate
from trainer.offload.gradients import HostWorker
from trainer.offload.layout import Layout
from trainer.offload.options import OffloadOptions
from trainer.offload.units import Unit
from trainer.offload.update_split import UpdateMode, UpdatePath, UpdateSplit, UpdateTiming


class UnitUpdates:
    """The optimizer updates of one model's units: their threads, the path each takes, and a delayed update."""

    def __init__(self, layout: Layout, log: CopyLog, worker: HostWorker, device: torch.device, *, role: str,
                 options: OffloadOptions, delayed_update: bool):
        self.layout, self.worker, self.device, self.role = layout, worker, device, role
        self.pipelined = options.pipelined_update
        if delayed_update:
            check_delayed_update(layout.units, role)
        self.delayed_update = delayed_update
        """The optimizer's CPU update runs during the next rollout, which reads the weights from before it
        (ZeRO-Offload's delayed parameter update); `stale_reads` opens that window."""
        self.update_lock = threading.Lock()
        """Held while an update's end and zero_grad decide who clears a unit's gradients."""
        self._tasks: list[Future[Any]] = []
        self.first_optimizer_states: Callable[[], None] | None = None
        """Makes the CPU optimizer's states (OffloadAdamW sets it; make_optimizer_states runs it)."""
        dtypes = layout.dtypes
        self.device_update = DeviceUpdate(device, log, master_dtype=dtypes.master, grad_dtype=dtypes.grad,
                                          compute_dtype=dtypes.compute) if layout.device_update else None
        """Runs the optimizer update of the offloaded units on the device (device_update.py); None: on the CPU."""
        self.device_worker = HostWorker(cuda=worker.cuda, role=f"{role}-device-update",
                                        threads=options.worker_threads) if self.device_update else None
        """The device path's own thread: its updates run beside the host worker's (which lands gradients and
        runs the host path), each path's units in the order they were submitted."""
        self.publisher = HostWorker(cuda=worker.cuda, role=f"{role}-publish",
                                    threads=options.worker_threads) if delayed_update else None
        """Under a delayed update: writes each unit's updated masters into its arena once the rollout's stale reads
        end, in forward order, while the first forward after them runs (each of its reads waits for its own unit
        only), instead of that forward writing each on the main thread while the GPU waits (`stale_reads`)."""
        self._publishing: Future[Any] | None = None
        self.update_split = UpdateSplit.guessed(self.device_update.bytes_each_way()) \
            if self.device_update is not None and layout.split_update else None
        """With optimizer_update both: which units each step updates on the device and which on the host."""
        self._planned_at: float | None = None
        self._needed_at: float | None = None
        """The last plan's time and the first read after it that needed its updates (perf_counter seconds): the
        split's window, learned at the next plan."""
        if self.update_split is not None:
            for unit in layout.units:
                unit.on_read = self._read_needs_update
        self.bus_turns: BusTurns | None = None
        """The run's turns on the bus for device updates, across its models (`share_bus`); None: never held."""
        self.update_paths: dict[str, UpdatePath] = {}
        """Where each unit's latest optimizer update went, by unit name."""
        self._timings: list[UpdateTiming] = []  # appended by the workers, read once they are drained
        self._planned_updates = 0  # optimizer steps planned so far (the first one's timings are not learned)

    @property
    def units(self) -> list[Unit]:
        return self.layout.units

    @property
    def mode(self) -> UpdateMode:
        """Where the offloaded units' optimizer updates run: cpu, gpu (the device path) or both."""
        if self.update_split is not None:
            return "both"
        return "gpu" if self.device_update is not None else "cpu"

    # ------------------------------------------------------------------------------ submitting

    def plan_update_paths(self, units: Sequence[Unit]) -> list[UpdatePath]:
        """The path of each of this step's unit updates, in the order they will be submitted. With both paths,
        the split first learns from the timings of the updates drained since the last plan."""
        if self.update_split is None:
            return ["device" if self.device_update is not None else "host"] * len(units)
        self.wait_for_updates()  # (done already when the optimizer asks: every timing of the last step is in)
        timings, self._timings = self._timings, []
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
        if path == "device" and self.bus_turns is not None and self.pipelined:
            task = self.bus_turns.in_turn(self.role, task)
        self._tasks.append(worker.submit(task, *args, inline=not self.pipelined))

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
            self._timings.append(UpdateTiming(path, elements, time.perf_counter() - started))
        return timed

    def after_updates(self, work: Callable[[], None], path: UpdatePath = "host") -> None:
        """Run `work` in `path`'s worker thread once the updates submitted to it so far are done (at once
        without the pipelined update, whose updates are done already)."""
        if self.pipelined:
            self._tasks.append(self._worker(path).submit(work, inline=False))
        else:
            work()

    def after_update(self, unit: Unit, written: set[int] | None = None) -> None:
        """The optimizer changed this unit's masters in place: refresh its compute copy (`written`: the entries
        whose arena copy the update wrote already)."""
        unit.after_update(written)

    def make_optimizer_states(self) -> None:
        """Start making the CPU optimizer's states in the worker thread, before its first update (which
        waits for them, as `wait_for_updates` does); nothing without an optimizer, or once they are made."""
        work, self.first_optimizer_states = self.first_optimizer_states, None
        if work is not None:
            self._tasks.append(self.worker.submit(work, inline=False))

    # --------------------------------------------------------------------------------- waiting

    def updates_drained(self) -> bool:
        """Whether every optimizer update submitted so far, on either path, has ended (without waiting)."""
        return all(task.done() for task in self._tasks) and all(unit.ready.is_set() for unit in self.units)

    def wait_for_updates(self) -> None:
        """Block until every pending optimizer update has landed, on the host path and on the device path, and
        any publish started has ended (and raise if one failed)."""
        tasks, self._tasks = self._tasks, []
        if self.bus_turns is not None and not all(task.done() for task in tasks):
            self.bus_turns.hurry(self.role)  # this thread waits for them: they may not wait for it
        for task in tasks:
            task.result()
        for unit in self.units:
            unit.ready.wait()
        self._finish_publishing()

    # ------------------------------------------------------------------------- a delayed update

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

    # -------------------------------------------------------------------------------- the bus

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

    def close(self) -> None:
        """Finish pending updates and stop the threads of the device path and the publisher (the host worker is
        the engine's: it lands gradients too)."""
        self.wait_for_updates()
        if self.device_update is not None:
            self.device_update.release()
        for worker in (self.device_worker, self.publisher):
            if worker is not None:
                worker.shutdown()


def update_elements(unit: Unit) -> int:
    """The elements a unit's optimizer update reads and writes: those of its masters with a gradient."""
    return sum(entry.parameter.numel() for entry in unit.entries if entry.parameter.grad is not None)


def check_delayed_update(units: Sequence[Unit], role: str) -> None:
    """A delayed update needs every trained unit's masters apart from the copy the device reads (fp32
    masters of a bf16 model, on the host): the rollout reads that copy while the update changes them."""
    shared = [unit.name for unit in units if unit.trainable and (not unit.offloaded or unit.master_is_arena)]
    if shared:
        raise ValueError(f"the {role}'s delayed_update needs fp32 masters on the CPU apart from the bf16 weights the "
                         f"GPU reads, but {', '.join(shared[:3])} {'have' if len(shared) > 1 else 'has'} none: set "
                         "fsdp_config.model_dtype=bf16 and optimizer_offload=true, or delayed_update=false")
