"""Placement per phase (`PhaseStaging.placed_for`): a no-grad phase (rollout, where decode cannot afford to
stream the head at every token; log-prob scoring) copies the CPU-resident head and embedding whole to the device
while they fit in the budget the caller gives, and drops them when it ends. Transformer layers moved between
passes by dynamic offload are layer_mover.py's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from enum import StrEnum

import torch

from trainer.offload.copies import H2D, CopyLog, CopyStreams
from trainer.offload.layout import Layout
from trainer.offload.units import Unit


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
