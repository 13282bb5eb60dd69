"""The pieces an offloaded model is made of: units, blocks, slots, and their per-pass state.

- A *unit* is parameters placed, packed and moved together (the embedding, one transformer block,
  the final norm, the head), of a `UnitKind`, placed on the GPU or the CPU (`Placement`).
- A unit placed on the CPU lives in a host *arena* (layout.py packs them); it crosses the bus as
  *blocks*: one contiguous byte range copied in one copy into a static device *slot* (a transformer
  block is one block; a head in chunks is several).
- What one forward and backward did to a unit is kept apart from its layout, in `UnitPass`; whether
  the model is inside a backward, in `PassState`.

No GPU is needed to build or test any of it (a slot on the CPU is a CPU buffer).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import torch
from torch import nn

from trainer.offload.groups import Entry

ALIGNMENT = 256
ROWS_PIECE = -1
"""The "first element" UnitPass.landed records for an embedding's gradient rows (scattered over the table)."""
UPDATE_SLICE_ELEMENTS = 1 << 22
"""Elements of gradient the CPU update (and the norm) reads back in fp32 at a time when the host keeps them in
bf16 (offload_grad_dtype): a 16 MiB buffer, which stays in the cache between its write and its read (with
2**25 elements, 128 MiB, each went through memory: one tensor's update took twice as long on this project's
CPU machine, 2026-12-02), where a whole 7B embedding's would take 2.2 GB."""


class UnitKind(StrEnum):
    """How the engine runs a unit."""

    RESIDENT = "resident"
    """Parameters on the compute device; the engine does nothing."""
    HOOKED = "hooked"
    """A block swapped in around the unit's forward and backward (streamed, or a device copy)."""
    ROWS = "rows"
    """Embedding on the CPU: rows gathered on the CPU (and, when tied, the head streamed in chunks)."""
    CHUNKS = "chunks"
    """Output head on the CPU: streamed in row chunks."""


class Placement(StrEnum):
    """Where a unit lives between passes (the config's "gpu" means the compute device)."""

    GPU = "gpu"
    CPU = "cpu"


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def typed_view(buffer: torch.Tensor, offset: int, like: torch.Tensor | tuple[torch.Size, torch.dtype]) -> torch.Tensor:
    """The tensor of `like`'s shape and dtype stored at byte `offset` of a uint8 buffer."""
    shape, dtype = (like.shape, like.dtype) if isinstance(like, torch.Tensor) else like
    nbytes = shape.numel() * dtype.itemsize
    return buffer[offset:offset + nbytes].view(dtype).view(shape)


def standalone(buffer: torch.Tensor, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The tensor at byte `offset` of a uint8 host buffer, with a storage object of its own.

    Registered parameters must not be views into a larger storage: safetensors' save_model (the
    checkpoints) refuses them. This one aliases the same bytes, and keeps `buffer` alive.
    """
    nbytes = shape.numel() * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    window = buffer.numpy().data[offset:offset + nbytes]
    return torch.frombuffer(window, dtype=torch.uint8).view(dtype).view(shape)


class Slot:
    """A static device buffer that blocks are copied into."""

    def __init__(self, nbytes: int, device: torch.device):
        self.data: torch.Tensor | None = torch.empty(nbytes, dtype=torch.uint8, device=device)
        # Copies write through an alias with a version counter of its own: autograd checks that
        # tensors saved in forward were not modified since, and block i's weights saved in forward
        # are legitimately replaced by block i + n's and fetched back before block i's backward.
        self.writer: torch.Tensor | None = self.data.data
        self.holder: Block | None = None
        self.free_event: torch.cuda.Event | None = torch.cuda.Event() if device.type == "cuda" else None

    def give_back(self) -> None:
        """Drop the device memory (the slot cannot be used afterwards)."""
        self.data = self.writer = self.holder = None


@dataclass(eq=False)
class Block:
    """A byte range of a unit's arena that crosses the bus in one copy, into one slot."""

    unit: Unit
    source: torch.Tensor
    slot: Slot
    streamed: bool
    ring: int = 0
    """Which slot ring the block's slot belongs to."""
    lookahead: int = 1
    """Blocks of this block's slot ring that may be fetched ahead of the one in use."""
    rows: tuple[int, int] | None = None
    """For a chunk of the head: the weight rows it holds."""
    position: int = -1
    acquired: bool = False
    fetched_event: torch.cuda.Event | None = None
    fetched_version: int = -1

    @property
    def nbytes(self) -> int:
        return self.source.numel()


@dataclass
class UnitPass:
    """What the current forward and backward pass did to one unit (reset as a backward begins)."""

    swapped: bool = False
    """Its modules hold the compute parameters (between its forward's pre- and post-hook)."""
    fresh: bool = True
    """The masters had no gradient when this backward began: a piece's first write is a copy."""
    landed: set[tuple[int, int]] = field(default_factory=set)
    """(entry index, first element) of the gradient pieces sent this pass, ROWS_PIECE for an
    embedding's rows: a piece sent again (the head's chunks when its forward ran twice before one
    backward) is added, not copied over."""
    accumulated: int = 0
    """Compute parameters whose gradient autograd finished this pass."""
    square: torch.Tensor | None = None
    """The sum of squares (fp32, on the device) of the gradient pieces sent this pass, while each was the first
    write of its place in a fresh host gradient, not rounded on the way (GradientPath.add_square): the host
    gradient is then exactly those pieces, and this its square (Unit.grad_square once the pass ends)."""
    square_exact: bool = True
    """No piece sent this pass broke that (an addition, a narrower host gradient, no device square taken)."""

    def begin(self, *, fresh: bool) -> None:
        self.fresh = fresh
        self.landed.clear()
        self.accumulated = 0
        self.square, self.square_exact = None, True

    def landed_entries(self) -> set[int]:
        """The entries some gradient piece was sent to this pass."""
        return {index for index, _ in self.landed}


class UpdateDone(threading.Event):
    """Set while no optimizer update of a unit runs (Unit.ready). A wait for it that would block first calls
    `before_wait` (the engine's: let the unit's model's updates cross the bus now, bus.BusTurns.hurry)."""

    def __init__(self) -> None:
        super().__init__()
        self.before_wait: Callable[[], None] | None = None

    def wait(self, timeout: float | None = None) -> bool:
        if not self.is_set() and self.before_wait is not None:
            self.before_wait()
        return super().wait(timeout)


@dataclass(eq=False)
class Unit:
    """Parameters placed, packed and moved together: the embedding, one transformer block, the norm, the head."""

    name: str
    group: str
    entries: list[Entry]
    kind: UnitKind
    placement: Placement
    # The arena layout (set by `pack`).
    offsets: list[int] = field(default_factory=list)
    nbytes: int = 0
    arena: torch.Tensor | None = None
    masters: list[torch.Tensor] = field(default_factory=list)
    master_is_arena: bool = True
    """Every entry's master is its arena copy (`arena_masters` holds them all)."""
    arena_masters: set[int] = field(default_factory=set)
    """The entries whose master is their arena copy: all of them when masters have the compute dtype, the
    frozen ones (a LoRA adapter's base weights) beside fp32 masters of the trained ones."""
    grad_views: list[torch.Tensor | None] | None = None
    """The host gradient of each trained entry, None for a frozen one (allocated at the unit's first gradient)."""
    grad_pinned: bool = False
    grad_square: torch.Tensor | None = None
    """The sum of squares (fp32, on the device) of the unit's host gradient, while that gradient is exactly
    what the device sent in one pass (UnitPass.square): the gradient norm then reads it instead of the host
    gradient. Any other landing into the gradient, or clearing it, drops it."""
    # On the device (set by the streamer).
    compute_params: list[nn.Parameter] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    # The masters and the arena copy the device reads.
    version: int = 0
    """Bumped whenever the arena's content changes (an update, an in-place edit of the masters)."""
    frozen_version: int = 0
    """The version at which the arena of an entry that does not train last changed (an in-place edit of a
    frozen master): a device copy of the unit fetched at or after it differs from the arena in the trained
    entries alone, which are all a LoRA adapter's update changes."""
    frozen_entries: frozenset[int] = frozenset()
    """The entries that did not train when `frozen_version` was last set."""
    master_version: int = 0
    ready: UpdateDone = field(default_factory=UpdateDone)
    """Set while no optimizer update of the unit runs."""
    grads_after_update: str | None = None
    """What zero_grad asked for while the unit's update was still running: "none" or "zero"."""
    publish_pending: bool = False
    """A delayed update (OffloadEngine.delayed_update) changes, or changed, the masters, and the arena
    still holds the weights from before it: the next read that may not be stale publishes it first."""
    stale_ok: bool = False
    """Reads may take the weights from before a pending update (the rollout under a delayed update)."""
    publishing: threading.Event | None = None
    """Set once the engine's publisher has written the pending update's masters into the arena (at the end of the
    rollout's stale reads, OffloadEngine.stale_reads); None: the read that publishes writes them itself."""
    publish_error: Exception | None = None
    """What stopped the publisher writing this unit's arena (raised again by `finish_publish`)."""
    on_read: Callable[[], None] | None = None
    """Called by each read that needs the unit's latest update (not a stale one): the engine's, to learn how long
    its optimizer updates may take before they are needed (UpdateSplit.window)."""
    passing: UnitPass = field(default_factory=UnitPass)

    def __post_init__(self) -> None:
        self.ready.set()

    @property
    def trainable(self) -> bool:
        return any(entry.parameter.requires_grad for entry in self.entries)

    @property
    def param_bytes(self) -> int:
        return sum(entry.parameter.numel() * entry.parameter.element_size() for entry in self.entries)

    @property
    def offloaded(self) -> bool:
        """Whether the engine keeps a host arena for it (every unit but the resident ones)."""
        return self.kind != UnitKind.RESIDENT

    def grad_view(self, index: int) -> torch.Tensor:
        """The host gradient of a trained entry (the gradient arena allocated)."""
        assert self.grad_views is not None, f"{self.name} has no host gradient yet"
        view = self.grad_views[index]
        assert view is not None, f"{self.entries[index].name} is frozen: it has no gradient"
        return view

    def arena_view(self, index: int) -> torch.Tensor:
        assert self.arena is not None, f"{self.name} has no host arena"
        return typed_view(self.arena, self.offsets[index], self.compute_like[index])

    def index_of(self, parameter: torch.Tensor) -> int:
        return next(index for index, entry in enumerate(self.entries) if entry.parameter is parameter)

    @functools.cached_property
    def compute_like(self) -> list[tuple[torch.Size, torch.dtype]]:
        return [(entry.parameter.shape, entry.parameter.dtype) for entry in self.entries]

    def settled(self) -> None:
        """Wait for the unit's optimizer update, then pick up any in-place change of its masters. Under a
        delayed update: a read that may be stale takes the arena as it is (the weights from before the
        update, which runs meanwhile); any other waits for the update and publishes it to the arena."""
        if self.publish_pending and self.stale_ok:
            return
        if self.on_read is not None:
            self.on_read()
        if self.publish_pending:
            self.ready.wait()
            self.finish_publish()
            return
        self.ready.wait()
        self.sync_masters()

    def finish_publish(self) -> None:
        """A delayed update whose own update has ended becomes the unit's weights: the arena takes the new masters
        (written already by the engine's publisher when it started one, else here), and the next fetch copies
        them."""
        publishing, self.publishing = self.publishing, None
        if publishing is None:
            self._masters_to_arena()
        else:
            publishing.wait()
            error, self.publish_error = self.publish_error, None
            if error is not None:
                raise RuntimeError(f"offload: publishing {self.name}'s delayed update failed") from error
        self.publish_pending = False
        self.master_version = self.masters_version()
        self.version += 1

    def publish_masters(self, publishing: threading.Event) -> None:
        """The engine's publisher (its own thread): once the unit's update has ended, write its masters into the
        arena, which no read takes until `finish_publish` (the prefetch waits for `publishing`: `usable`), then
        set `publishing`, the event the engine gave the unit (its first read may have taken it off the unit
        already, to wait for it)."""
        try:
            self.ready.wait()
            self._masters_to_arena()
        except Exception as error:  # noqa: BLE001 (raised again by the read that publishes, on its own thread)
            self.publish_error = error
        finally:
            publishing.set()

    @property
    def usable(self) -> bool:
        """Whether a read need not wait (for a prefetch, which never waits): no update runs and no publisher
        writes the arena, or the read may take the weights from before the update."""
        if self.publish_pending and self.stale_ok:
            return True
        return self.ready.is_set() and (self.publishing is None or self.publishing.is_set())

    def sync_masters(self) -> None:
        """Pick up an in-place change of the masters (load_state_dict, a manual edit) before a copy; not
        while a delayed update is to be published (`settled` publishes it)."""
        if self.publish_pending:
            return
        version = self.masters_version()
        if version == self.master_version:
            return
        self._masters_to_arena()
        self.master_version = version
        self.version += 1
        self.frozen_version = self.version  # which entries the edit changed is not known

    def after_update(self, written: set[int] | None = None) -> None:
        """The optimizer changed the masters in place: refresh the arena the device copies from (but the
        entries in `written`, whose arena copy the update made already)."""
        self._masters_to_arena(written or set())
        self.master_version = self.masters_version()
        self.version += 1

    def masters_version(self) -> int:
        return sum(entry.parameter._version for entry in self.entries)

    def trained_ranges(self, fetched_version: int) -> list[tuple[int, int]] | None:
        """The byte ranges of the arena (its trained entries', adjacent ones merged) that can differ from a
        device copy fetched at `fetched_version`; None when anything else may differ too (a frozen weight
        edited since, a weight frozen or unfrozen, or nothing frozen: then the whole unit is one copy)."""
        frozen = frozenset(index for index, entry in enumerate(self.entries) if not entry.parameter.requires_grad)
        if frozen != self.frozen_entries:
            self.frozen_entries, self.frozen_version = frozen, self.version
        if not frozen or fetched_version < self.frozen_version:
            return None
        ranges: list[tuple[int, int]] = []
        for index, entry in enumerate(self.entries):
            if index in frozen:
                continue
            start = self.offsets[index]
            end = start + entry.parameter.numel() * self.compute_like[index][1].itemsize
            if ranges and aligned(ranges[-1][1]) == start:
                ranges[-1] = (ranges[-1][0], end)
            else:
                ranges.append((start, end))
        return ranges

    def _masters_to_arena(self, skip: set[int] | frozenset[int] = frozenset()) -> None:
        if not self.master_is_arena:
            for index, master in enumerate(self.masters):
                if index not in skip and index not in self.arena_masters:
                    self.arena_view(index).copy_(master)


@dataclass
class PassState:
    """Whether the engine's model is inside a backward pass (its hooks turn prefetch around)."""

    in_backward: bool = False
    """Autograd runs a backward through the model (a forward now is gradient checkpointing's recompute)."""
    backward_active: bool = False
    """A backward began and its end-of-backward callback is queued."""

    def end(self) -> None:
        self.in_backward = self.backward_active = False
