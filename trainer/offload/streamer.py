"""The streamer: blocks swapped into static device slots around their modules' forward and backward.

Transformer blocks rotate through `prefetch + 1` slots: block i always lands in slot i mod n, so
tensors autograd saved in forward still point at block i's weights when its backward runs. A
dedicated copy stream per direction is ordered with CUDA events: a copy into a slot waits for the
compute that last read it, the compute waits for the copy. No record_stream, no synchronize per
block. Blocks are prefetched `prefetch` ahead in forward and behind in backward.

During a block's forward (and backward) its modules hold *compute parameters*: views into the slot,
whose gradients go to the gradient path (`on_grad_accumulated`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainer.offload.copies import H2D, CopyLog, CopyStreams
from trainer.offload.functions import post_backward
from trainer.offload.layout import Layout
from trainer.offload.options import OffloadOptions
from trainer.offload.placement import PhaseStaging
from trainer.offload.units import Block, PassState, Placement, Slot, Unit, UnitKind, typed_view

GradHook = Callable[[Unit, nn.Parameter], None]


class Streamer:
    """Owns the device slots and blocks of one model; fetches, prefetches and swaps them in."""

    def __init__(self, layout: Layout, streams: CopyStreams, log: CopyLog, options: OffloadOptions,
                 passes: PassState, staging: PhaseStaging, device: torch.device, on_grad_accumulated: GradHook):
        self.layout, self.streams, self.log, self.options = layout, streams, log, options
        self.passes, self.staging, self.device = passes, staging, device
        self._on_grad_accumulated = on_grad_accumulated
        self.blocks: list[Block] = []
        self.layer_ring: list[Slot] = []
        """The slots the streamed transformer blocks rotate through (ring 0)."""
        self._ring_ids = itertools.count(1)
        self.steady_forwards = True
        """A forward without gradients where every hooked block is on the device and current skips the
        per-block copy checks, stream waits and prefetch (see `_steady`); off, every block goes the
        general way (the tests compare the two)."""
        self._steady: list[Block] | None = None
        """The blocks of the forward running now, while it is a steady one."""
        self._make_blocks()

    # --------------------------------------------------------------------------------- blocks

    def new_ring(self) -> int:
        return next(self._ring_ids)

    def _make_blocks(self) -> None:
        layer_units = [unit for unit in self.layout.units if unit.kind == UnitKind.HOOKED
                       and unit.placement == Placement.CPU and unit.group == "transformer"]
        slots = min(self.options.prefetch + 1, len(layer_units))
        ring = [Slot(max(unit.nbytes for unit in layer_units), self.device) for _ in range(slots)] if slots else []
        self.layer_ring = ring
        for unit in self.layout.units:
            if unit.kind == UnitKind.HOOKED:
                assert unit.arena is not None
                in_ring = unit in layer_units
                slot = ring[layer_units.index(unit) % len(ring)] if in_ring else Slot(unit.nbytes, self.device)
                block = Block(unit, unit.arena, slot, streamed=unit.placement == Placement.CPU,
                              ring=0 if in_ring else self.new_ring(), lookahead=max(1, len(ring) - 1) if in_ring else 1)
                self.give_blocks(unit, [block])
            elif unit.kind == UnitKind.CHUNKS or unit.kind == UnitKind.ROWS and self.layout.parts.tied:
                unit.blocks = self._chunk_blocks(unit, self.new_ring())
        self.renumber()

    def _chunk_blocks(self, unit: Unit, ring: int) -> list[Block]:
        weight = self.layout.parts.head_weight
        assert unit.arena is not None
        weight_index = unit.index_of(weight)
        rows, width = weight.shape
        row_bytes = width * self.layout.dtypes.compute.itemsize
        per_chunk = max(1, min(rows, self.options.head_chunk_bytes // row_bytes))
        if per_chunk >= 128:
            # Whole multiples of 128 rows: aligned leading dimensions and offsets keep the chunks'
            # matrix products on cuBLAS's fast kernels.
            per_chunk -= per_chunk % 128
        chunks = -(-rows // per_chunk)
        count = self.options.head_slots or self.options.prefetch + 1
        slots = [Slot(per_chunk * row_bytes, self.device) for _ in range(min(count, chunks))]
        blocks = []
        for number, first in enumerate(range(0, rows, per_chunk)):
            last = min(rows, first + per_chunk)
            offset = unit.offsets[weight_index]
            source = unit.arena[offset + first * row_bytes: offset + last * row_bytes]
            blocks.append(Block(unit, source, slots[number % len(slots)], streamed=True, ring=ring,
                                lookahead=max(1, len(slots) - 1), rows=(first, last)))
        return blocks

    def give_blocks(self, unit: Unit, blocks: list[Block]) -> None:
        """Make `blocks` the unit's, with compute parameters that are views into the first one's slot."""
        unit.blocks = blocks
        unit.compute_params = [self._compute_param(blocks[0].slot, unit, index) for index in range(len(unit.entries))]

    def _compute_param(self, slot: Slot, unit: Unit, index: int) -> nn.Parameter:
        master = unit.entries[index].parameter
        assert slot.data is not None
        parameter = nn.Parameter(typed_view(slot.data, unit.offsets[index], unit.compute_like[index]))
        # Registered while it requires grad; it stays for when the master is unfrozen later.
        parameter.register_post_accumulate_grad_hook(functools.partial(self._on_grad_accumulated, unit))
        parameter.requires_grad_(master.requires_grad)
        return parameter

    def renumber(self) -> None:
        """Collect the units' blocks in forward order (the prefetch walks them by position)."""
        self.blocks = [block for unit in self.layout.units for block in unit.blocks]
        for position, block in enumerate(self.blocks):
            block.position = position

    def working_set_bytes(self) -> int:
        """Device memory of the static slots."""
        slots = {id(block.slot): block.slot for block in self.blocks}
        return sum(slot.data.numel() for slot in slots.values() if slot.data is not None)

    # ---------------------------------------------------------------------------------- hooks

    def install_hooks(self, model: nn.Module, on_backward: Callable[[], None]) -> None:
        """Hooks that swap each hooked unit's block in around its forward and backward; `on_backward`
        runs when a backward first reaches one of them."""
        model.register_forward_pre_hook(self._root_pre_forward)
        model.register_forward_hook(self._root_post_forward)
        for unit in self.layout.units:
            if unit.kind == UnitKind.HOOKED:
                for module in self._hook_roots(unit):
                    module.register_forward_pre_hook(functools.partial(self._pre_forward, unit, on_backward),
                                                     with_kwargs=True)
                    module.register_forward_hook(functools.partial(self._post_forward, unit, on_backward))

    def _hook_roots(self, unit: Unit) -> list[nn.Module]:
        """The outermost modules of a unit (the block itself, or the embedding and the head when tied)."""
        parts = self.layout.parts
        if unit.group == "transformer":
            return [parts.layers[int(unit.name.split(".")[1])]]
        roots = {"embedding": [parts.embedding] + ([parts.head] if parts.tied else []),
                 "norm": [parts.norm], "lm_head": [parts.head]}[unit.group]
        return [module for module in roots if module is not None]

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        # A forward of the whole model never runs inside a backward pass: a flag left set by a
        # backward that raised must not turn this forward's prefetch around.
        self.passes.end()
        self._steady = self._steady_blocks()
        if self._steady is not None:
            return
        if self.layout.unit_of_kind(UnitKind.ROWS) is None:
            self.prefetch(-1, +1)
        # Otherwise the embedding prefetches once its rows are on their way: the forward needs
        # them first, and behind a block's copy they would wait for it.

    def _steady_blocks(self) -> list[Block] | None:
        """The hooked blocks, when this forward needs no copy and no wait: no gradients, and each block in
        a device slot of its own holding the unit's current weights, with no update running that the
        forward may not read past (what `acquire` would check at each block, and its prefetch at each block
        ahead: 36 layers' worth of host time per decoded token). None otherwise."""
        if not self.steady_forwards or torch.is_grad_enabled():
            return None
        blocks = []
        for unit in self.layout.units:
            if unit.kind != UnitKind.HOOKED:
                continue
            block = self._in_own_slot(unit)
            if (block is None or not unit.usable
                    or (not unit.stale_ok if unit.publish_pending else unit.masters_version() != unit.master_version)):
                # (A delayed update to publish before this read, or an in-place change of the masters.)
                return None
            blocks.append(block)
        for block in blocks:  # a copy made outside a pass (a layer moved to the GPU) not waited for yet
            self._compute_waits_for(block)
        return blocks

    def _in_own_slot(self, unit: Unit) -> Block | None:
        """A hooked unit's block when it sits in a device slot of its own holding the unit's current arena (not
        streamed, not replaced by a copy the phase keeps); None otherwise."""
        block = unit.blocks[0]
        if (block.streamed or block.slot.holder is not block or block.fetched_version != unit.version
                or self.staging.is_staged(unit)):
            return None
        return block

    def graph_key(self) -> tuple[object, ...] | None:
        """What a CUDA graph of a no-grad forward reads, when one may be captured now (StaticDecoder): every
        hooked block in a device slot of its own holding its unit's current weights with no copy left to
        wait for, every CPU-resident head and embedding kept whole on the device for the phase, and no
        optimizer update running or to be published that the forward may not read past (a delayed update's, in
        the rollout's stale reads, it may: the device copies keep the weights from before it until it is
        published, so the graph reads what an eager forward would). The key holds those tensors' addresses and
        versions: a graph replays the addresses it captured, so one captured under another key must not be
        replayed (a publish makes a new version). None when a forward would copy, wait or gather rows on the
        host."""
        key: list[object] = []
        for unit in self.layout.units:
            if not unit.usable or (unit.publish_pending and not unit.stale_ok):
                return None
            if unit.kind == UnitKind.HOOKED:
                block = self._in_own_slot(unit)
                if (block is None or block.fetched_event is not None
                        or (not unit.publish_pending and unit.masters_version() != unit.master_version)):
                    return None
                assert block.slot.data is not None
                key.append((block.slot.data.data_ptr(), unit.version))
            elif unit.kind in (UnitKind.ROWS, UnitKind.CHUNKS):
                staged = self.staging.staged(unit)
                if staged is None:
                    return None
                key.append(staged)
        return tuple(key)

    def replayed(self) -> None:
        """After a CUDA graph of a forward ran on the compute stream: a later copy into a hooked block's slot
        waits for it (the graph's capture recorded no event: `_root_post_forward`)."""
        event = self.streams.record_compute()
        for unit in self.layout.units:
            if unit.kind == UnitKind.HOOKED:
                unit.blocks[0].slot.free_event = event

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        steady, self._steady = self._steady, None
        if steady and self.streams.cuda and torch.cuda.is_current_stream_capturing():
            return  # an event recorded in a capture is the graph's own: `replayed` records the real one
        if steady:
            # One event after the whole forward stands for each block's own: a later copy into one of these
            # slots (after an update) waits for every read of it.
            event = self.streams.record_compute()
            for block in steady:
                block.slot.free_event = event

    def _pre_forward(self, unit: Unit, on_backward: Callable[[], None], module: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self.acquire_unit(unit)
        if self.passes.in_backward or not torch.is_grad_enabled():
            return None
        return self._wrap_inputs(unit, args, kwargs)

    def _post_forward(self, unit: Unit, on_backward: Callable[[], None], module: nn.Module, args: tuple[Any, ...],
                      output: Any) -> None:
        if self.passes.in_backward:
            # Recomputation for gradient checkpointing: the block is released after its backward.
            return None
        if torch.is_grad_enabled():
            outputs = [tensor for tensor in nested_tensors(output) if tensor.requires_grad]
            if outputs:
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, functools.partial(self._pre_backward, unit, on_backward), mode="any")
        self.release_unit(unit)
        return None

    def _wrap_inputs(self, unit: Unit, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        positions: list[tuple[str, Any]] = [("args", index) for index, value in enumerate(args)
                                            if isinstance(value, torch.Tensor) and value.requires_grad]
        positions += [("kwargs", key) for key, value in kwargs.items()
                      if isinstance(value, torch.Tensor) and value.requires_grad]
        if not positions:
            return None
        tensors = [args[key] if where == "args" else kwargs[key] for where, key in positions]
        wrapped = post_backward(functools.partial(self.release_unit, unit), *tensors)
        new_args, new_kwargs = list(args), dict(kwargs)
        for (where, key), tensor in zip(positions, wrapped, strict=True):
            if where == "args":
                new_args[key] = tensor
            else:
                new_kwargs[key] = tensor
        return tuple(new_args), new_kwargs

    def _pre_backward(self, unit: Unit, on_backward: Callable[[], None], grad: Any) -> None:
        on_backward()
        self.acquire_unit(unit)

    # ------------------------------------------------------------------------ fetch / release

    def acquire_unit(self, unit: Unit) -> None:
        self.acquire(unit.blocks[0])
        if not unit.passing.swapped:
            for entry, compute in zip(unit.entries, unit.compute_params, strict=True):
                if compute.requires_grad != entry.parameter.requires_grad:
                    compute.requires_grad_(entry.parameter.requires_grad)
                for owner, attribute in entry.owners:
                    owner._parameters[attribute] = compute
            unit.passing.swapped = True

    def release_unit(self, unit: Unit) -> None:
        if unit.passing.swapped:
            for entry in unit.entries:
                for owner, attribute in entry.owners:
                    owner._parameters[attribute] = entry.parameter
            unit.passing.swapped = False
        if unit.blocks[0].acquired:
            self.release(unit.blocks[0])

    def release_all(self) -> None:
        """Give back every block a pass holds (at its end, or after it raised)."""
        for unit in self.layout.units:
            if unit.kind == UnitKind.HOOKED:
                self.release_unit(unit)
        for block in self.blocks:
            if block.acquired:
                self.release(block)
        self._steady = None

    def acquire(self, block: Block) -> None:
        if self._steady is not None and block.unit.kind == UnitKind.HOOKED:
            block.acquired = True  # in its slot, current, and waited for by the compute stream already
            return
        # (A steady forward vouches for the hooked blocks alone: a head streamed in chunks is fetched as ever.)
        self.fetch(block, required=True)
        self._compute_waits_for(block)
        block.acquired = True
        self.prefetch(block.position, -1 if self.passes.in_backward else +1)

    def _compute_waits_for(self, block: Block) -> None:
        """The compute stream waits for the block's last copy, once: it runs in order after that."""
        if block.fetched_event is not None:
            self.streams.compute_waits(block.fetched_event)
            block.fetched_event = None

    def release(self, block: Block) -> None:
        block.acquired = False
        if self._steady is not None and block.unit.kind == UnitKind.HOOKED:
            return  # the forward's end records the event for every steady block
        block.slot.free_event = self.streams.record_compute(block.slot.free_event)

    def prefetch(self, position: int, step: int) -> None:
        """Copy the next streamed blocks in this direction, in order, as far as their slot rings
        allow: at most `lookahead` blocks of a ring, and never into a slot whose block is in use or
        needed sooner."""
        ahead: dict[int, int] = {}
        index = position + step
        while 0 <= index < len(self.blocks):
            block = self.blocks[index]
            index += step
            if self.staging.is_staged(block.unit):  # kept whole on the device for this phase
                if step > 0:
                    self.staging.refresh_ahead(block.unit)
                continue
            if not block.streamed:
                # A block kept on the device is copied again only after an update: checked here by
                # version alone, since every pass walks all the blocks ahead of each block (a full
                # fetch each was 2.2 ms of a 28-layer forward's host time). An in-place edit of
                # the masters is still picked up when the block is acquired.
                if block.slot.holder is not block or block.fetched_version != block.unit.version:
                    self.fetch(block, required=False)
                continue
            if ahead.get(block.ring, 0) >= block.lookahead:
                break
            holder = block.slot.holder
            if holder is not None and holder is not block and (
                    holder.acquired or 0 < (holder.position - position) * step < (block.position - position) * step):
                break
            self.fetch(block, required=False)
            ahead[block.ring] = ahead.get(block.ring, 0) + 1

    def fetch(self, block: Block, *, required: bool) -> None:
        unit = block.unit
        if not required and not unit.usable:
            return  # its optimizer update is still running: a prefetch must not wait for it
        unit.settled()
        slot = block.slot
        if slot.holder is block and block.fetched_version == unit.version:
            return
        if slot.holder is not None and slot.holder.acquired:
            if not required:
                return
            raise RuntimeError(f"offload: block {unit.name} needs the device slot that {slot.holder.unit.name} "
                               "is still using; the forward ran the model's blocks out of order")
        self.streams.stream_waits(self.streams.h2d, slot.free_event)
        assert slot.writer is not None
        target = slot.writer[:block.nbytes]
        # The slot still holding this block, after an update of a partly frozen unit (a LoRA adapter's layer):
        # only the trained entries changed, a few MB of a layer of hundreds.
        ranges = unit.trained_ranges(block.fetched_version) \
            if slot.holder is block and block.rows is None and block.fetched_version >= 0 else None
        if ranges is None:
            block.fetched_event = self.log.timed(H2D, unit.group, block.nbytes, self.streams.h2d,
                                                 lambda: target.copy_(block.source, non_blocking=True))
        else:
            block.fetched_event = self.log.timed(H2D, unit.group, sum(end - start for start, end in ranges),
                                                 self.streams.h2d, lambda: _copy_ranges(target, block.source, ranges))
        if slot.holder is not None:
            slot.holder.fetched_version = -1
        slot.holder = block
        block.fetched_version = unit.version


def _copy_ranges(target: torch.Tensor, source: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
    for start, end in ranges:
        target[start:end].copy_(source[start:end], non_blocking=True)


def nested_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a value of nested dicts, lists and tuples (a model's output, a state dict)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in nested_tensors(item)]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in nested_tensors(item)]
    return []
