"""Placement at run time: the groups a phase keeps on the device, and transformer layers moved.

- Per phase (`PhaseStaging.placed_for`): a no-grad phase (rollout, where decode cannot afford to
  stream the head at every token; log-prob scoring) copies the CPU-resident head and embedding whole
  to the device while they fit in the budget the caller gives, and drops them when it ends.
- Between passes (`LayerMover.set_transformer_layers_on_gpu`): dynamic offload keeps the first n
  transformer blocks in device slots of their own and streams the others from their host arenas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from enum import StrEnum
from typing import TYPE_CHECKING

import torch

from trainer.config import FSDP_CONFIG
from trainer.offload.copies import H2D, CopyLog, CopyStreams
from trainer.offload.layout import Layout
from trainer.offload.units import Block, PassState, Placement, Slot, Unit, UnitKind

if TYPE_CHECKING:
    from trainer.offload.engine import OffloadOptions
    from trainer.offload.streamer import Streamer


class Phase(StrEnum):
    """The phases of a step that place groups differently."""

    ROLLOUT = "rollout"
    SCORING = "scoring"
    TRAINING = "training"


class PhaseStaging:
    """Device copies of CPU-resident groups kept whole for the current phase."""

    def __init__(self, layout: Layout, streams: CopyStreams, log: CopyLog, device: torch.device):
        self.layout, self.streams, self.log, self.device = layout, streams, log, device
        self.phase = Phase.TRAINING
        # unit name -> (device weight, the unit's version it holds, the event its copy ends with or None)
        self._staged: dict[str, tuple[torch.Tensor, int, torch.cuda.Event | None]] = {}

    @property
    def staged_groups(self) -> list[str]:
        """The groups kept on the device now, in the order they were kept."""
        group_of = {unit.name: unit.group for unit in self.layout.units}
        return [group_of[name] for name in self._staged]

    def is_staged(self, unit: Unit) -> bool:
        return unit.name in self._staged

    @contextlib.contextmanager
    def placed_for(self, phase: str, *, budget_bytes: int | None = None) -> Iterator[list[str]]:
        """Place the groups for one phase of a step; yields the groups copied to the device for it.

        "rollout" and "scoring" run without gradients, so optimizer states and gradients need no
        room: the CPU-resident head and embedding are copied whole to the device, in the order of
        `Layout.stageable_bytes`, while their sum fits in `budget_bytes` (None: no limit), and no-grad
        forwards use them instead of streaming. "training" keeps only the head when it fits: its
        forward and input gradient read the kept copy (copied again after each update) instead of
        streaming it twice a micro-batch; its weight gradient still goes to the host chunk by
        chunk. On exit the copies are dropped (their memory returns to the allocator).
        """
        try:
            entered = Phase(phase)
        except ValueError:
            raise ValueError(f"offload: unknown phase {phase!r}; expected one of "
                             f"{', '.join(str(known) for known in Phase)}") from None
        previous, self.phase = self.phase, entered
        try:
            yield self._stage_within(budget_bytes)
        finally:
            self.forget()
            self.phase = previous

    def keepable_bytes(self, phase: str) -> dict[str, int]:
        """The CPU-resident groups `phase` may keep on the device, with their bytes, in the order it keeps them:
        the head and the embedding in a no-grad phase, the head alone in training."""
        candidates = self.layout.stageable_bytes()
        if Phase(phase) == Phase.TRAINING:
            # The embedding's gradient rows come from its CPU gather; a tied table is both.
            candidates = {group: nbytes for group, nbytes in candidates.items() if group == "lm_head"}
        return candidates

    def _stage_within(self, budget: int | None) -> list[str]:
        candidates = self.keepable_bytes(self.phase)
        staged: list[str] = []
        for group, nbytes in candidates.items():
            if budget is not None and nbytes > budget:
                break
            try:
                self._stage(next(unit for unit in self.layout.units if unit.group == group))
            except torch.OutOfMemoryError:
                break  # the budget was optimistic: this group and the next stream as in training
            staged.append(group)
            budget = None if budget is None else budget - nbytes
        return staged

    def drop_kept(self) -> list[str]:
        """Give back the device copies the current phase keeps (they stream from now on); the
        groups dropped. What out-of-memory relief does when no layer can move."""
        groups = self.staged_groups
        self.forget()
        return groups

    def forget(self, name: str | None = None) -> None:
        """Drop a kept copy (all of them without `name`). One still arriving on the copy stream is
        waited for by the compute stream first: its memory goes back to the compute stream's pool,
        and the copy must not write into whatever is allocated there next."""
        for key in [name] if name is not None else list(self._staged):
            if key in self._staged:
                self.streams.compute_waits(self._staged.pop(key)[2])

    def _stage(self, unit: Unit, *, ahead: bool = False) -> None:
        """Copy the unit's weight into a device tensor of its own (one copy, logged and timed).

        On the compute stream, or with `ahead` on the host-to-device stream, for the compute to
        wait for only where it reads the copy (`staged_copy`)."""
        unit.settled()
        source = unit.arena_view(self.layout.staged_weight_index(unit))
        target = torch.empty_like(source, device=self.device)
        stream = self.streams.compute()
        if ahead:
            # The new tensor's memory may have served kernels still queued on the compute stream.
            stream = self.streams.h2d
            self.streams.stream_waits(stream, self.streams.record_compute())
        end = self.log.timed(H2D, unit.group, source.numel() * source.element_size(), stream,
                             lambda: target.copy_(source, non_blocking=True))
        self.forget(unit.name)
        self._staged[unit.name] = (target, unit.version, end if ahead else None)

    def refresh_ahead(self, unit: Unit) -> None:
        """Start copying a kept weight whose masters changed (an update) before the forward reaches it,
        when its update has landed: the copy then overlaps the blocks before it. The training phase
        only: its backward waits for the copy streams before the next update writes the arena."""
        if self.phase != Phase.TRAINING or not unit.ready.is_set():
            return
        unit.sync_masters()
        if self._staged[unit.name][1] != unit.version:
            self._stage(unit, ahead=True)

    def staged(self, unit: Unit) -> tuple[int, int] | None:
        """The address and unit version of the unit's kept device weight, when it is kept and current and no
        copy into it is still on its way (what a CUDA graph of a forward would read); None otherwise."""
        if unit.name not in self._staged:
            return None
        weight, version, arrival = self._staged[unit.name]
        if version != unit.version or arrival is not None:
            return None
        return weight.data_ptr(), version

    def staged_copy(self, unit: Unit) -> torch.Tensor | None:
        """The unit's staged device weight, refreshed if its masters changed since (None when not staged)."""
        if unit.name not in self._staged:
            return None
        unit.settled()
        if self._staged[unit.name][1] != unit.version:
            self._stage(unit)
        weight, _, arrival = self._staged[unit.name]
        self.streams.compute_waits(arrival)
        return weight


class LayerMover:
    """Which transformer blocks stay on the device between passes (dynamic offload)."""

    def __init__(self, layout: Layout, streamer: Streamer, passes: PassState, options: OffloadOptions,
                 device: torch.device, role: str):
        self.layout, self.streamer, self.passes = layout, streamer, passes
        self.options, self.device, self.role = options, device, role
        self.moves = {"to_cpu": 0, "to_gpu": 0}

    @property
    def layers_on_gpu(self) -> int:
        """Transformer blocks on the device between passes (resident, or a compute copy kept there)."""
        return sum(unit.placement == Placement.GPU for unit in self.layout.transformer_units)

    def set_transformer_layers_on_gpu(self, count: int) -> tuple[int, int]:
        """Keep the first `count` transformer blocks on the device, stream the others from their host
        arena; returns the blocks moved (to the CPU, to the GPU). Only at a safe point: no forward or
        backward in flight. The host arena already holds every block (dynamic_layers), so a move to
        the CPU frees the block's device slot and a move to the GPU is one copy into a new one. A
        block whose slot cannot be allocated (out of device memory) stays on the CPU, and so do the
        ones after it: a move never ends the run."""
        if not self.layout.dynamic_layers:
            raise RuntimeError(f"the {self.role}'s transformer layers cannot move: set "
                               f"{FSDP_CONFIG.dynamic_offload.enabled}=true for it")
        if self.passes.backward_active or any(block.acquired for block in self.streamer.blocks):
            raise RuntimeError("offload: transformer layers can move only between passes, not during one")
        units = self.layout.transformer_units
        count = max(0, min(count, len(units)))
        before = [unit.placement for unit in units]
        wanted = [Placement.GPU if index < count else Placement.CPU for index in range(len(units))]
        if wanted == before:
            return 0, 0
        if self.streamer.streams.cuda:
            # Work queued on any stream may still read a slot that is about to be freed or reused.
            torch.cuda.synchronize(self.device)
        self._assign_layer_slots(wanted)
        moved = list(zip(before, units, strict=True))
        to_cpu = sum(old == Placement.GPU and unit.placement == Placement.CPU for old, unit in moved)
        to_gpu = sum(old == Placement.CPU and unit.placement == Placement.GPU for old, unit in moved)
        self.moves["to_cpu"] += to_cpu
        self.moves["to_gpu"] += to_gpu
        return to_cpu, to_gpu

    def _assign_layer_slots(self, wanted: list[Placement]) -> None:
        """Blocks on the GPU get a slot of their own (filled now); the streamed ones share the ring.

        Slots are all a layer's size, so they change hands instead of being freed and allocated
        again, and device memory is given back before any is asked for: a move under memory
        pressure cannot fail for want of the memory it frees. Blocks leaving the GPU give their
        slots back first; blocks coming back take the ring slots no longer needed, then new ones;
        when one cannot be allocated, it and the rest stay streamed, and the ring takes back slots
        from the last arrivals if it needs them."""
        units = self.layout.transformer_units
        ring_size = self.options.prefetch + 1
        for unit, placement in zip(units, wanted, strict=True):
            if placement == Placement.CPU and unit.placement == Placement.GPU:
                if unit.blocks and not unit.blocks[0].streamed:
                    unit.blocks[0].slot.give_back()
                    unit.blocks, unit.compute_params = [], []
                unit.placement = Placement.CPU
        ring = self.streamer.layer_ring
        spare = ring[min(ring_size, wanted.count(Placement.CPU)):]
        ring = ring[:len(ring) - len(spare)]
        arriving = self._slots_for_arrivals(units, wanted, spare)
        for slot in spare:
            slot.data = slot.writer = None
        streaming = sum(unit.placement == Placement.CPU for unit in units) - len(arriving)
        while len(ring) < min(ring_size, streaming) and arriving:
            ring.append(arriving.pop()[1])
            streaming += 1
        ring += [Slot(self.layout.layer_bytes, self.device) for _ in range(min(ring_size, streaming) - len(ring))]
        self.streamer.layer_ring = ring
        for slot in ring:
            slot.holder = None
        for unit, slot in arriving:
            unit.placement = Placement.GPU
            slot.holder = None
        self._rebuild_blocks(units, ring, {id(unit): slot for unit, slot in arriving})
        for unit, _ in arriving:
            self.streamer.fetch(unit.blocks[0], required=True)

    def _slots_for_arrivals(self, units: list[Unit], wanted: list[Placement],
                            spare: list[Slot]) -> list[tuple[Unit, Slot]]:
        """A slot for each block coming to the GPU: a spare ring slot, else a new one, until one fails."""
        arriving: list[tuple[Unit, Slot]] = []
        for unit, placement in zip(units, wanted, strict=True):
            if placement != Placement.GPU or unit.placement == Placement.GPU:
                continue
            if spare:
                slot = spare.pop()
            else:
                try:
                    slot = Slot(self.layout.layer_bytes, self.device)
                except torch.OutOfMemoryError:
                    break  # this one and the rest stay streamed
            arriving.append((unit, slot))
        return arriving

    def _rebuild_blocks(self, units: list[Unit], ring: list[Slot], own: dict[int, Slot]) -> None:
        streamed = [unit for unit in units if unit.placement == Placement.CPU]
        for unit in units:
            if unit.placement == Placement.GPU and id(unit) not in own:
                continue  # it stays in its own slot
            assert unit.arena is not None and unit.kind == UnitKind.HOOKED
            if unit.placement == Placement.CPU:
                slot = ring[streamed.index(unit) % len(ring)]
                block = Block(unit, unit.arena, slot, streamed=True, ring=0, lookahead=max(1, len(ring) - 1))
            else:
                block = Block(unit, unit.arena, own[id(unit)], streamed=False, ring=self.streamer.new_ring())
            self.streamer.give_blocks(unit, [block])
        self.streamer.renumber()
