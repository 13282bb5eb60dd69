"""Transformer layers moved at run time by dynamic offload (`LayerMover.set_transformer_layers_on_gpu`): between
passes, the first n transformer blocks stay in device slots of their own and the others stream from their host
arenas.
"""

from __future__ import annotations

import torch

from trainer.config import FSDP_CONFIG
from trainer.offload.layout import Layout
from trainer.offload.options import OffloadOptions
from trainer.offload.streamer import Streamer
from trainer.offload.units import Block, PassState, Placement, Slot, Unit, UnitKind


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
