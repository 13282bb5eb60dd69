"""The offload engine: parameters, gradients and optimizer states on the CPU, per module group.

How a model is laid out once the engine is attached:

- Each module group is split into *units* (the embedding, each transformer block, the final norm,
  the head). A unit placed on the CPU lives in one host *arena* per group, allocated once and
  page-locked, in the compute dtype; the model's registered parameters (the *masters*, which the
  optimizer, state_dict and checkpoints see) alias it, or are fp32 copies beside it when the
  optimizer runs on the CPU with fp32 master weights.
- A unit crosses the bus as *blocks*: one contiguous byte range copied in one H2D copy into a
  static device *slot* (a transformer block is one block; the head is split into row chunks).
  Transformer blocks rotate through `prefetch + 1` slots: block i always lands in slot i mod n, so
  tensors autograd saved in forward still point at block i's weights when its backward runs.
- A dedicated copy stream per direction, ordered with CUDA events: a copy into a slot waits for
  the compute that last read it, the compute waits for the copy. No record_stream, no synchronize
  per block. Blocks are prefetched `prefetch` ahead in forward and behind in backward.
- During a block's forward (and backward) its modules hold *compute parameters*: views into the
  slot. Their gradients go back D2H on the second copy stream, one copy per tensor, into a pinned
  gradient arena (or pinned staging, converted to fp32 by a worker thread); at the end of
  backward the masters' .grad are views into it. The device memory of gradients still on their
  way is bounded (`grads_in_flight`; the head's chunks apart, `head_grads_in_flight`) by letting
  the compute stream wait for the oldest copy.
- The embedding on the CPU is never shipped whole: the rows of the batch's distinct tokens are
  gathered on the CPU and only they cross; the device expands them (F.embedding), so its backward
  sums each token's gradient, and only those rows come back to be added into the embedding's
  gradient on the CPU.
- Placement is per phase (`placed_for`): a no-grad phase (rollout, where decode cannot afford to
  stream the head at every token; log-prob scoring) copies the CPU-resident head and embedding whole
  to the device while they fit in the budget the caller gives, and drops them when it ends.
- Units placed on the GPU stay there, untouched (with optimizer_offload, their fp32 masters and
  optimizer states live on the CPU and a compute copy stays on the GPU).

Every copy is logged (direction, group, bytes) and timed with CUDA events read lazily.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from trainer.offload.copies import D2H, H2D, CopyLog, CopyStreams, StagingRing, pinned_empty
from trainer.offload.embedding_cache import EmbeddingCache
from trainer.offload.functions import GatheredRows, PostBackward, StreamedLinear
from trainer.offload.groups import GROUPS, TITLES, Entry, entries_of, find_parts, owners_in

ALIGNMENT = 256
ROWS_PIECE = -1
"""The "first element" Unit.landed records for an embedding's gradient rows (scattered over the table)."""
GIB = 1024**3

RESIDENT = "resident"  # parameters on the compute device; the engine does nothing
HOOKED = "hooked"  # a block swapped in around the unit's forward and backward (streamed or device copy)
ROWS = "rows"  # embedding on the CPU: rows gathered on the CPU (and, when tied, the head streamed in chunks)
CHUNKS = "chunks"  # output head on the CPU: streamed in row chunks


UPDATE_SLICE_ELEMENTS = 1 << 25
"""Elements of gradient the CPU update reads back in fp32 at a time when the host keeps them in bf16
(offload_grad_dtype): a 128 MiB buffer, where a whole 7B embedding's would take 2.2 GB."""


class HostMemoryError(MemoryError):
    """The placement needs more host memory than there is; the message says how much and for what."""


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
    pipelined_update: bool = True
    """The CPU optimizer update runs in a background thread, block by block in forward order, and
    the next forward waits for each block's update only when it reaches that block. Measured on an
    H200 host (16 cores, 2026-11-30, clip folded into the update): a step of 8 7B-shaped layers took
    1376 ms with it and 1572 ms without (benchmarks/README.md)."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _typed(buffer: torch.Tensor, offset: int, like: torch.Tensor | tuple[torch.Size, torch.dtype]) -> torch.Tensor:
    """The tensor of `like`'s shape and dtype stored at byte `offset` of a uint8 buffer."""
    shape, dtype = (like.shape, like.dtype) if isinstance(like, torch.Tensor) else like
    nbytes = shape.numel() * dtype.itemsize
    return buffer[offset:offset + nbytes].view(dtype).view(shape)


def _standalone(buffer: torch.Tensor, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The tensor at byte `offset` of a uint8 host buffer, with a storage object of its own.

    Registered parameters must not be views into a larger storage: safetensors' save_model (the
    checkpoints) refuses them. This one aliases the same bytes, and keeps `buffer` alive.
    """
    nbytes = shape.numel() * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    window = memoryview(buffer.numpy())[offset:offset + nbytes]
    return torch.frombuffer(window, dtype=torch.uint8).view(dtype).view(shape)


class Slot:
    """A static device buffer that blocks are copied into."""

    def __init__(self, nbytes: int, device: torch.device):
        self.data = torch.empty(nbytes, dtype=torch.uint8, device=device)
        # Copies write through an alias with a version counter of its own: autograd checks that
        # tensors saved in forward were not modified since, and block i's weights saved in forward
        # are legitimately replaced by block i + n's and fetched back before block i's backward.
        self.writer = self.data.data
        self.holder: Block | None = None
        self.free_event = torch.cuda.Event() if device.type == "cuda" else None


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


@dataclass(eq=False)
class Unit:
    """Parameters placed, packed and moved together: the embedding, one transformer block, the norm, the head."""

    name: str
    group: str
    entries: list[Entry]
    kind: str
    placement: str
    offsets: list[int] = field(default_factory=list)
    nbytes: int = 0
    arena: torch.Tensor | None = None
    masters: list[torch.Tensor] = field(default_factory=list)
    master_is_arena: bool = True
    grad_views: list[torch.Tensor] | None = None
    grad_pinned: bool = False
    compute_params: list[nn.Parameter] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    version: int = 0
    master_version: int = 0
    swapped: bool = False
    head_weight_index: int = -1
    ready: threading.Event = field(default_factory=threading.Event)
    grads_after_update: str | None = None
    """What zero_grad asked for while the unit's update was still running: "none" or "zero"."""
    # Per backward pass:
    fresh: bool = True
    landed: set[tuple[int, int]] = field(default_factory=set)
    """(entry index, first element) of the gradient pieces sent this pass, ROWS for an embedding's
    rows: a piece sent again (the head's chunks when its forward ran twice before one backward) is
    added, not copied over."""
    accumulated: int = 0

    def __post_init__(self):
        self.ready.set()

    def landed_entries(self) -> set[int]:
        """The entries some gradient piece was sent to this pass."""
        return {index for index, _ in self.landed}

    @property
    def trainable(self) -> bool:
        return any(entry.parameter.requires_grad for entry in self.entries)

    @property
    def param_bytes(self) -> int:
        return sum(entry.parameter.numel() * entry.parameter.element_size() for entry in self.entries)

    def arena_view(self, index: int) -> torch.Tensor:
        return _typed(self.arena, self.offsets[index], self.compute_like[index])

    @functools.cached_property
    def compute_like(self) -> list[tuple[torch.Size, torch.dtype]]:
        return [(entry.parameter.shape, entry.parameter.dtype) for entry in self.entries]


class OffloadEngine:
    """Places one model's module groups, streams the offloaded ones, and accounts for every copy.

    Build it with `attach_offload`. The model keeps working as a plain nn.Module: forward with or
    without grad, backward (with gradient checkpointing), generate with a KV cache, state_dict.
    """

    def __init__(self, model: nn.Module, placements: dict[str, str], device: torch.device, *, role: str,
                 optimizer_offload: bool = False, options: OffloadOptions = OffloadOptions(),
                 layer_classes: Sequence[str] | None = None, dynamic_layers: bool = False,
                 layers_on_gpu: int | None = None, host_budget: int | None = None,
                 host_grad_dtype: torch.dtype | None = None):
        self.model = model
        # Every transformer block gets a host arena, even those placed on the GPU, so that moving
        # one between device and host later is a copy, not an allocation (set_transformer_layers_on_gpu).
        self.dynamic_layers = dynamic_layers
        self.moves = {"to_cpu": 0, "to_gpu": 0}
        self.embedding_cache: EmbeddingCache | None = None
        self._staged: dict[str, tuple[torch.Tensor, int]] = {}  # unit name -> (device weight, its version)
        self.phase = "training"
        self._layer_ring: list[Slot] = []
        self._ring_ids = itertools.count(1)  # ring 0: the streamed transformer blocks'
        self.device = torch.device(device)
        self.role = role
        self.options = options
        self.streams = CopyStreams(self.device)
        self.log = CopyLog(self.streams.cuda)
        self.in_backward = False
        self._backward_active = False
        self._in_flight: deque[tuple[torch.cuda.Event | None, list[torch.Tensor]]] = deque()
        self._head_in_flight: deque[tuple[torch.cuda.Event | None, list[torch.Tensor]]] = deque()
        self._grad_tasks: list[Future] = []
        # Pinned memory for gradients the worker adds or converts (sized once the units are laid out).
        self._staging = StagingRing(0, functools.partial(pinned_empty, device=self.device), ALIGNMENT)
        self._update_tasks: list[Future] = []
        self.update_lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None
        self._worker_lock = threading.Lock()
        self.blocks: list[Block] = []
        self.parts = find_parts(model, layer_classes)
        self.placements = self._resolve_placements(placements)
        self.compute_dtype = next(model.parameters()).dtype
        trainable = any(parameter.requires_grad for parameter in model.parameters())
        # The optimizer on the CPU keeps fp32 master weights; the device computes in the model's dtype.
        self.optimizer_offload = optimizer_offload and trainable
        self.master_dtype = torch.float32 if self.optimizer_offload else self.compute_dtype
        # Gradients on the host: in the masters' dtype, or (host_grad_dtype) in the compute dtype beside
        # fp32 masters, which the update reads back in fp32 (OffloadAdamW).
        self.grad_dtype = self.master_dtype
        if host_grad_dtype is not None and self.optimizer_offload:
            if host_grad_dtype != self.compute_dtype:
                raise ValueError(f"offload: gradients on the host in {host_grad_dtype} need a model in that dtype, "
                                 f"not {self.compute_dtype}")
            if not hasattr(torch.Tensor, "grad_dtype"):
                raise ValueError(f"offload: gradients in {host_grad_dtype} beside fp32 weights need torch's "
                                 f"Tensor.grad_dtype, which torch {torch.__version__} does not have")
            self.grad_dtype = host_grad_dtype
        self.units = self._build_units()
        if layers_on_gpu is not None:
            if not dynamic_layers:
                raise ValueError("offload: layers_on_gpu needs dynamic_layers (fsdp_config.dynamic_offload.enabled)")
            # Where a dynamic run starts: the first ones on the device, the rest streamed.
            for index, unit in enumerate(self.transformer_units):
                if index >= layers_on_gpu:
                    unit.placement = "cpu"
        self.group_bytes = {group: sum(unit.param_bytes for unit in self.units if unit.group == group)
                            for group in (*GROUPS, "other")}
        if host_budget is not None:
            # Packing gives back the host memory the model's weights hold now (they move into the
            # arena or to the GPU), so that memory counts as available to the placement.
            host_budget += storage_bytes(tensor for tensor in itertools.chain(model.parameters(), model.buffers())
                                         if tensor.device.type == "cpu")
            if sum(self.host_bytes().values()) > host_budget:
                raise HostMemoryError(self._host_memory_message(host_budget))
        self._pack()
        self._install_hooks()

    # ------------------------------------------------------------------------------- public

    def summary(self) -> list[dict]:
        """Each group: where it lives and its parameters' size (for the start-of-run log and /v1/status)."""
        rows = []
        for group in (*GROUPS, "other"):
            if group == "other" and not self.group_bytes["other"]:
                continue
            rows.append({"role": self.role, "group": group, "device": self.placements.get(group, "gpu"),
                         "bytes": self.group_bytes[group]})
        return rows

    def summary_lines(self) -> list[str]:
        """The offload summary in words, e.g. "Embedding: OFFLOADED to CPU (1.02 GiB)"."""
        lines = []
        layers = sum(1 for unit in self.units if unit.group == "transformer")
        # The "gpu" placement means "resident on the compute device": say which when that is not a GPU.
        on_gpu = self.device.type == "cuda"
        resident = "on GPU" if on_gpu else f"resident on the compute device, the {self.device.type.upper()}"
        for row in self.summary():
            title = TITLES[row["group"]] + (f" ({layers} layers)" if row["group"] == "transformer" else "")
            if row["group"] == "lm_head" and self.parts.tied:
                lines.append(f"{title}: tied to the embedding")
                continue
            where = "OFFLOADED to CPU" if row["device"] == "cpu" else resident
            lines.append(f"{title}: {where} ({format_bytes(row['bytes'])})")
        on_host = sum(entry.parameter.numel() for unit in self.units if unit.kind != RESIDENT
                      for entry in unit.entries if entry.parameter.requires_grad)
        if on_host:
            where = "OFFLOADED to CPU" if self.optimizer_offload else "on CPU for the groups placed there"
            lines.append(f"Optimizer: {where} ({self.master_dtype_name} master weights and AdamW states, "
                         f"{format_bytes(3 * on_host * self.master_dtype.itemsize)})")
        saved = format_bytes(self.saved_gpu_bytes())
        lines.append(f"GPU memory saved: {saved}" if on_gpu
                     else f"GPU memory saved on a GPU: {saved} (this run computes on the {self.device.type.upper()})")
        host = self.host_bytes()
        if sum(host.values()):
            pinned = " pinned" if self.streams.cuda else ""
            now = f"{format_bytes(host['arena'])}{pinned} weights"
            if host["masters"]:
                now += f" and {format_bytes(host['masters'])} {self.master_dtype_name} masters"
            later = host["gradients"] + host["optimizer"]
            lines.append(f"Host memory: {format_bytes(sum(host.values()))} ({now}"
                         + (f", {format_bytes(later)} more once it trains)" if later else ")"))
        return lines

    def host_bytes(self) -> dict[str, int]:
        """Host memory the placement holds once it trains, by use: "arena" (the offloaded groups in the
        compute dtype, pinned on a GPU machine), "masters" (fp32 master weights beside a bf16 arena),
        "gradients" and "optimizer" (AdamW's two states) of the trainable parameters kept there. The
        gradients and optimizer states are allocated at the first backward and step."""
        usage = dict.fromkeys(("arena", "masters", "gradients", "optimizer"), 0)
        scale = self.master_dtype.itemsize // self.compute_dtype.itemsize
        grad_scale = self.grad_dtype.itemsize // self.compute_dtype.itemsize
        for group in (*GROUPS, "other"):
            units = [unit for unit in self.units if unit.group == group and unit.kind != RESIDENT]
            arena = sum(_aligned(self._layout(unit)[1]) for unit in units)
            usage["arena"] += arena
            usage["masters"] += arena * scale if scale != 1 else 0
            if any(unit.trainable for unit in units):
                usage["gradients"] += arena * grad_scale  # one gradient arena per group
            usage["optimizer"] += sum(2 * entry.parameter.numel() * self.master_dtype.itemsize
                                      for unit in units for entry in unit.entries if entry.parameter.requires_grad)
        if self.grad_dtype != self.master_dtype:
            # The update and the gradient norm read the gradients back in fp32 a slice at a time
            # (OffloadAdamW), each into a buffer of its own.
            largest = max((entry.parameter.numel() for unit in self.units if unit.kind != RESIDENT
                           for entry in unit.entries if entry.parameter.requires_grad), default=0)
            usage["gradients"] += 2 * min(largest, UPDATE_SLICE_ELEMENTS) * self.master_dtype.itemsize
        if self.streams.cuda:
            usage["gradients"] += self._staging_bytes()  # accumulated (or converted) gradients pass through it
        return usage

    def _host_memory_message(self, budget: int) -> str:
        usage = self.host_bytes()
        parts = ", ".join(f"{use} {format_bytes(nbytes)}" for use, nbytes in usage.items() if nbytes)
        return (f"the {self.role}'s offload placement needs {format_bytes(sum(usage.values()))} of host memory "
                f"({parts}) and {format_bytes(max(0, budget))} is available")

    @property
    def master_dtype_name(self) -> str:
        return str(self.master_dtype).removeprefix("torch.")

    def saved_gpu_bytes(self) -> int:
        """Device memory the placement saves against an all-GPU run: the offloaded parameters, their
        gradients, and the optimizer states (two per parameter) kept on the CPU."""
        saved = 0
        for unit in self.units:
            if unit.kind == RESIDENT:
                continue
            compute = [entry.parameter.numel() * self.compute_dtype.itemsize for entry in unit.entries]
            trainable = sum(nbytes for nbytes, entry in zip(compute, unit.entries, strict=True)
                            if entry.parameter.requires_grad)
            if unit.placement == "cpu":
                saved += sum(compute) + trainable
            saved += 2 * trainable
        return saved - self.working_set_bytes()

    def working_set_bytes(self) -> int:
        """Device memory of the engine's static slots."""
        slots = {id(block.slot): block.slot for block in self.blocks}
        return sum(slot.data.numel() for slot in slots.values() if slot.data is not None)

    def drain_copy_stats(self, max_records: int | None = None) -> list[dict]:
        """Timed copies completed since the last drain: [{direction, group, bytes, seconds}], bounded
        (a sample: see CopyLog; drain_copy_counts has every copy)."""
        return self.log.drain(max_records)

    def drain_copy_counts(self) -> list[dict]:
        """Every copy since the last call: [{direction, group, copies, bytes}]."""
        return self.log.drain_counts()

    def copied_bytes(self) -> dict[tuple[str, str], int]:
        """Bytes copied so far per (direction, group)."""
        return dict(self.log.totals)

    def copy_counts(self) -> dict[tuple[str, str], int]:
        return dict(self.log.counts)

    def host_tensors(self) -> list[torch.Tensor]:
        """The host arenas the offloaded groups live in (pinned when the device is a GPU)."""
        arenas = {}
        for unit in self.units:
            if unit.arena is not None:
                arenas[unit.arena.untyped_storage().data_ptr()] = unit.arena
        return list(arenas.values())

    def optimizer(self, *, lr: float, betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.01,
                  eps: float = 1e-8):
        """AdamW over the model's trainable parameters, each on the device its master lives on."""
        from trainer.offload.optimizer import OffloadAdamW  # that module imports this one

        return OffloadAdamW(self, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)

    def wait_for_updates(self) -> None:
        """Block until every pending CPU optimizer update has landed (and raise if one failed)."""
        tasks, self._update_tasks = self._update_tasks, []
        for task in tasks:
            task.result()
        for unit in self.units:
            unit.ready.wait()

    def close(self) -> None:
        """Finish pending work and give back the device slots; the model cannot run afterwards."""
        self.wait_for_updates()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        self.streams.synchronize()
        for block in self.blocks:
            block.slot.data = block.slot.writer = block.slot.holder = None
        for unit in self.units:
            unit.compute_params = []
        self._in_flight.clear()
        self._head_in_flight.clear()
        self._staging.clear()

    def abandon_pass(self) -> None:
        """Forget a forward or backward that raised (a CUDA out-of-memory error): give back the
        blocks it held and drop the gradients it was still sending. The masters' gradients, which
        it may have added to, are the caller's to discard."""
        self.wait_for_updates()
        self.streams.synchronize()
        for unit in self.units:
            if unit.kind == HOOKED:
                self._release_unit(unit)
            for compute in unit.compute_params:
                compute.grad = None
            unit.landed.clear()
            unit.accumulated = 0
        for block in self.blocks:
            if block.acquired:
                self._release(block)
        self._in_flight.clear()
        self._head_in_flight.clear()
        tasks, self._grad_tasks = self._grad_tasks, []
        for task in tasks:
            task.exception()  # waits; a failure there is a consequence of the error being recovered
        self._staging.reset()
        self._backward_active = self.in_backward = False

    # -------------------------------------------------------------------------------- build

    def _resolve_placements(self, placements: dict[str, str]) -> dict[str, str]:
        resolved = {group: placements.get(group, "gpu") for group in GROUPS}
        if self.parts.tied:
            # One weight cannot live in two places: it goes where either group needs it on the device.
            shared = "gpu" if "gpu" in (resolved["embedding"], resolved["lm_head"]) else "cpu"
            resolved["embedding"] = resolved["lm_head"] = shared
        return resolved

    def _build_units(self) -> list[Unit]:
        model, parts = self.model, self.parts
        names = {id(module): name for name, module in model.named_modules()}
        units: list[Unit] = []
        embedding_modules = [parts.embedding] + ([parts.head] if parts.tied else [])
        units.append(self._unit("embedding", "embedding", entries_of(embedding_modules, names)))
        for index, layer in enumerate(parts.layers):
            units.append(self._unit(f"layers.{index}", "transformer", entries_of([layer], names)))
        if parts.norm is not None:
            units.append(self._unit("norm", "norm", entries_of([parts.norm], names)))
        if parts.head is not None and not parts.tied:
            units.append(self._unit("lm_head", "lm_head", entries_of([parts.head], names)))
        claimed = {id(entry.parameter) for unit in units for entry in unit.entries}
        other = [entry for entry in entries_of([model], names) if id(entry.parameter) not in claimed]
        for unit in units:
            owners_in(model, unit.entries)
        units.append(Unit("other", "other", other, RESIDENT, "gpu"))
        return [unit for unit in units if unit.entries]

    def _unit(self, name: str, group: str, entries: list[Entry]) -> Unit:
        placement = self.placements[group]
        if group == "transformer" and self.dynamic_layers:
            kind = HOOKED  # a device copy of the arena (placement gpu) or streamed from it (cpu)
        elif placement == "gpu":
            # With optimizer_offload a trainable unit on the GPU keeps its masters on the CPU and a
            # compute copy on the device, refreshed after each update.
            trains = any(entry.parameter.requires_grad for entry in entries)
            kind = HOOKED if self.optimizer_offload and trains else RESIDENT
        elif group == "embedding" and self._gathers_rows(self.parts.embedding):
            kind = ROWS
        elif group == "lm_head" and self._streams_in_chunks(self.parts.head):
            kind = CHUNKS
        else:
            kind = HOOKED
        if kind == ROWS and self.parts.tied and not self._streams_in_chunks(self.parts.head):
            kind = HOOKED
        return Unit(name, group, entries, kind, placement)

    @staticmethod
    def _gathers_rows(module: nn.Module) -> bool:
        return (type(module) is nn.Embedding and module.max_norm is None and not module.scale_grad_by_freq
                and not module.sparse)

    @staticmethod
    def _streams_in_chunks(module: nn.Module | None) -> bool:
        return type(module) is nn.Linear and module.bias is None

    # --------------------------------------------------------------------------------- pack

    def _pack(self) -> None:
        """Move resident units to the device and copy the others into their host arenas, once."""
        for module in self.model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(self.device)
        for unit in self.units:
            if unit.kind == RESIDENT:
                for entry in unit.entries:
                    entry.parameter.data = entry.parameter.data.to(self.device)
        for group in (*GROUPS, "other"):
            units = [unit for unit in self.units if unit.group == group and unit.kind != RESIDENT]
            if units:
                self._pack_group(units)
        self._make_blocks()

    def _layout(self, unit: Unit) -> tuple[list[int], int]:
        """Where each of the unit's tensors starts in its arena (aligned), and the unit's bytes."""
        offsets, end = [], 0
        for entry in unit.entries:
            offsets.append(_aligned(end))
            end = offsets[-1] + entry.parameter.numel() * self.compute_dtype.itemsize
        return offsets, end

    def _pack_group(self, units: list[Unit]) -> None:
        starts, total = [], 0
        for unit in units:
            unit.offsets, unit.nbytes = self._layout(unit)
            starts.append(total)
            total += _aligned(unit.nbytes)
        arena = pinned_empty(total, self.device)
        # fp32 masters beside a bf16 arena: the same layout at `scale` times the offsets.
        scale = self.master_dtype.itemsize // self.compute_dtype.itemsize
        masters = torch.empty(total * scale, dtype=torch.uint8) if scale != 1 else arena
        for unit, start in zip(units, starts, strict=True):
            unit.arena = arena[start:start + unit.nbytes]
            unit.master_is_arena = scale == 1
            for index, entry in enumerate(unit.entries):
                unit.arena_view(index).copy_(entry.parameter.data)
                master = _standalone(masters, (start + unit.offsets[index]) * scale, entry.parameter.shape,
                                     self.master_dtype)
                master.copy_(entry.parameter.data)
                entry.parameter.data = master
                if self.grad_dtype != self.master_dtype:
                    entry.parameter.grad_dtype = None  # its .grad is the host gradient, in grad_dtype
                unit.masters.append(master)
            unit.master_version = self._master_version(unit)

    def _make_blocks(self) -> None:
        layer_units = [unit for unit in self.units if unit.kind == HOOKED and unit.placement == "cpu"
                       and unit.group == "transformer"]
        slots = min(self.options.prefetch + 1, len(layer_units))
        ring = [Slot(max(unit.nbytes for unit in layer_units), self.device) for _ in range(slots)] if slots else []
        self._layer_ring = ring
        rings = self._ring_ids
        for unit in self.units:
            if unit.kind == HOOKED:
                slot = ring[layer_units.index(unit) % len(ring)] if unit in layer_units else Slot(unit.nbytes,
                                                                                                  self.device)
                block = Block(unit, unit.arena, slot, streamed=unit.placement == "cpu",
                              ring=0 if unit in layer_units else next(rings),
                              lookahead=max(1, len(ring) - 1) if unit in layer_units else 1)
                unit.blocks = [block]
                unit.compute_params = [self._compute_param(slot, unit, index) for index in range(len(unit.entries))]
            elif unit.kind in (ROWS, CHUNKS) and (unit.kind == CHUNKS or self.parts.tied):
                unit.blocks = self._chunk_blocks(unit, next(rings))
            self.blocks += unit.blocks
        for position, block in enumerate(self.blocks):
            block.position = position

    def _chunk_blocks(self, unit: Unit, ring: int) -> list[Block]:
        weight_index = self._index_of(unit, self.parts.head.weight)
        rows, width = self.parts.head.weight.shape
        row_bytes = width * self.compute_dtype.itemsize
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
        unit.head_weight_index = weight_index
        return blocks

    def _compute_param(self, slot: Slot, unit: Unit, index: int) -> nn.Parameter:
        master = unit.entries[index].parameter
        parameter = nn.Parameter(_typed(slot.data, unit.offsets[index], unit.compute_like[index]))
        # Registered while it requires grad; it stays for when the master is unfrozen later.
        parameter.register_post_accumulate_grad_hook(functools.partial(self._on_grad_accumulated, unit))
        return parameter.requires_grad_(master.requires_grad)

    def enable_embedding_cache(self, *, cache_size: int, warmup_steps: int) -> EmbeddingCache | None:
        """Serve no-grad lookups of a CPU-resident embedding from a device cache of its most frequent
        rows (rollout.embedding_cache); None when the embedding is not gathered on the CPU."""
        unit = next((unit for unit in self.units if unit.kind == ROWS), None)
        if unit is None:
            return None
        index = self._index_of(unit, self.parts.embedding.weight)
        self.embedding_cache = EmbeddingCache(lambda: unit.arena_view(index), lambda: unit.version, self.device,
                                              cache_size=cache_size, warmup_steps=warmup_steps)
        return self.embedding_cache

    # ---------------------------------------------------------------------- per-phase placement

    PHASES = ("rollout", "scoring", "training")

    def stageable_bytes(self) -> dict[str, int]:
        """The CPU-resident groups a no-grad phase may copy whole to the device, with their device
        bytes, in the order `placed_for` takes them: the head first (streamed, it crosses the bus
        whole at every forward: at every decoded token), then the embedding (whose rows the
        embedding cache or a CPU gather can serve instead)."""
        staged = {}
        for kind in (CHUNKS, ROWS):
            for unit in self.units:
                if unit.kind == kind:
                    weight = self._staged_weight_index(unit)
                    shape, dtype = unit.compute_like[weight]
                    staged[unit.group] = shape.numel() * dtype.itemsize
        return staged

    @contextlib.contextmanager
    def placed_for(self, phase: str, *, budget_bytes: int | None = None) -> Iterator[list[str]]:
        """Place the groups for one phase of a step; yields the groups copied to the device for it.

        "rollout" and "scoring" run without gradients, so optimizer states and gradients need no
        room: the CPU-resident head and embedding are copied whole to the device, in the order of
        `stageable_bytes`, while their sum fits in `budget_bytes` (None: no limit), and no-grad
        forwards use them instead of streaming. "training" keeps only the head when it fits: its
        forward and input gradient read the kept copy (copied again after each update) instead of
        streaming it twice a micro-batch; its weight gradient still goes to the host chunk by
        chunk. On exit the copies are dropped (their memory returns to the allocator).
        """
        if phase not in self.PHASES:
            raise ValueError(f"offload: unknown phase {phase!r}; expected one of {', '.join(self.PHASES)}")
        previous, self.phase = self.phase, phase
        staged: list[str] = []
        try:
            candidates = self.stageable_bytes()
            if phase == "training":
                # The embedding's gradient rows come from its CPU gather; a tied table is both.
                candidates = {group: nbytes for group, nbytes in candidates.items() if group == "lm_head"}
            if candidates:
                budget = budget_bytes
                for group, nbytes in candidates.items():
                    if budget is not None and nbytes > budget:
                        break
                    try:
                        self._stage(next(unit for unit in self.units if unit.group == group))
                    except torch.OutOfMemoryError:
                        break  # the budget was optimistic: this group and the next stream as in training
                    staged.append(group)
                    budget = None if budget is None else budget - nbytes
            yield staged
        finally:
            self._forget_staged()
            self.phase = previous

    def drop_kept(self) -> list[str]:
        """Give back the device copies the current phase keeps (they stream from now on); the
        groups dropped. What out-of-memory relief does when no layer can move."""
        group_of = {unit.name: unit.group for unit in self.units}
        groups = [group_of[name] for name in self._staged]  # in the order they were kept
        self._forget_staged()
        return groups

    def _forget_staged(self, name: str | None = None) -> None:
        """Drop a kept copy (all of them without `name`). One still arriving on the copy stream is
        waited for by the compute stream first: its memory goes back to the compute stream's pool,
        and the copy must not write into whatever is allocated there next."""
        for key in [name] if name is not None else list(self._staged):
            if key in self._staged:
                self.streams.compute_waits(self._staged.pop(key)[2])

    def _staged_weight_index(self, unit: Unit) -> int:
        return self._index_of(unit, self.parts.head.weight if unit.kind == CHUNKS else self.parts.embedding.weight)

    def _stage(self, unit: Unit, *, ahead: bool = False) -> None:
        """Copy the unit's weight into a device tensor of its own (one copy, logged and timed).

        On the compute stream, or with `ahead` on the host-to-device stream, for the compute to
        wait for only where it reads the copy (`_staged_copy`)."""
        unit.ready.wait()
        self._sync_masters(unit)
        source = unit.arena_view(self._staged_weight_index(unit))
        target = torch.empty_like(source, device=self.device)
        stream = self.streams.compute()
        if ahead:
            # The new tensor's memory may have served kernels still queued on the compute stream.
            stream = self.streams.h2d
            self.streams.stream_waits(stream, self.streams.record_compute())
        end = self.log.timed(H2D, unit.group, source.numel() * source.element_size(), stream,
                             lambda: target.copy_(source, non_blocking=True))
        self._forget_staged(unit.name)
        self._staged[unit.name] = (target, unit.version, end if ahead else None)

    def _refresh_staged_ahead(self, unit: Unit) -> None:
        """Start copying a kept weight whose masters changed (an update) before the forward reaches it,
        when its update has landed: the copy then overlaps the blocks before it. The training phase
        only: its backward waits for the copy streams before the next update writes the arena."""
        if self.phase != "training" or not unit.ready.is_set():
            return
        self._sync_masters(unit)
        if self._staged[unit.name][1] != unit.version:
            self._stage(unit, ahead=True)

    def _staged_copy(self, unit: Unit) -> torch.Tensor | None:
        """The unit's staged device weight, refreshed if its masters changed since (None when not staged)."""
        if unit.name not in self._staged:
            return None
        unit.ready.wait()
        self._sync_masters(unit)
        if self._staged[unit.name][1] != unit.version:
            self._stage(unit)
        weight, _, arrival = self._staged[unit.name]
        self.streams.compute_waits(arrival)
        return weight

    # ----------------------------------------------------------------------- dynamic offload

    @property
    def transformer_units(self) -> list[Unit]:
        return [unit for unit in self.units if unit.group == "transformer"]

    @property
    def layers_on_gpu(self) -> int:
        """Transformer blocks on the device between passes (resident, or a compute copy kept there)."""
        return sum(unit.placement == "gpu" for unit in self.transformer_units)

    @property
    def layer_bytes(self) -> int:
        """Device bytes of the largest transformer block (what moving one to the CPU frees, at most)."""
        return max((unit.nbytes for unit in self.transformer_units), default=0)

    def set_transformer_layers_on_gpu(self, count: int) -> tuple[int, int]:
        """Keep the first `count` transformer blocks on the device, stream the others from their host
        arena; returns the blocks moved (to the CPU, to the GPU). Only at a safe point: no forward or
        backward in flight. The host arena already holds every block (dynamic_layers), so a move to
        the CPU frees the block's device slot and a move to the GPU is one copy into a new one. A
        block whose slot cannot be allocated (out of device memory) stays on the CPU, and so do the
        ones after it: a move never ends the run."""
        if not self.dynamic_layers:
            raise RuntimeError(f"the {self.role}'s transformer layers cannot move: set "
                               "fsdp_config.dynamic_offload.enabled=true for it")
        if self._backward_active or any(block.acquired for block in self.blocks):
            raise RuntimeError("offload: transformer layers can move only between passes, not during one")
        units = self.transformer_units
        count = max(0, min(count, len(units)))
        before = [unit.placement for unit in units]
        wanted = ["gpu" if index < count else "cpu" for index in range(len(units))]
        if wanted == before:
            return 0, 0
        if self.streams.cuda:
            # Work queued on any stream may still read a slot that is about to be freed or reused.
            torch.cuda.synchronize(self.device)
        self._assign_layer_slots(wanted)
        to_cpu = sum(old == "gpu" and unit.placement == "cpu" for old, unit in zip(before, units, strict=True))
        to_gpu = sum(old == "cpu" and unit.placement == "gpu" for old, unit in zip(before, units, strict=True))
        self.moves["to_cpu"] += to_cpu
        self.moves["to_gpu"] += to_gpu
        return to_cpu, to_gpu

    def _assign_layer_slots(self, wanted: list[str]) -> None:
        """Blocks on the GPU get a slot of their own (filled now); the streamed ones share the ring.

        Slots are all a layer's size, so they change hands instead of being freed and allocated
        again, and device memory is given back before any is asked for: a move under memory
        pressure cannot fail for want of the memory it frees. Blocks leaving the GPU give their
        slots back first; blocks coming back take the ring slots no longer needed, then new ones;
        when one cannot be allocated, it and the rest stay streamed, and the ring takes back slots
        from the last arrivals if it needs them."""
        units = self.transformer_units
        ring_size = self.options.prefetch + 1
        for unit, placement in zip(units, wanted, strict=True):
            if placement == "cpu" and unit.placement == "gpu":
                if unit.blocks and not unit.blocks[0].streamed:
                    self._drop_own_slot(unit)
                unit.placement = "cpu"
        ring = self._layer_ring
        spare = ring[min(ring_size, wanted.count("cpu")):]
        ring = ring[:len(ring) - len(spare)]
        arriving: list[tuple[Unit, Slot]] = []
        for unit, placement in zip(units, wanted, strict=True):
            if placement != "gpu" or unit.placement == "gpu":
                continue
            if spare:
                slot = spare.pop()
            else:
                try:
                    slot = Slot(self.layer_bytes, self.device)
                except torch.OutOfMemoryError:
                    break  # this one and the rest stay streamed
            arriving.append((unit, slot))
        for slot in spare:
            slot.data = slot.writer = None
        streaming = sum(unit.placement == "cpu" for unit in units) - len(arriving)
        while len(ring) < min(ring_size, streaming) and arriving:
            ring.append(arriving.pop()[1])
            streaming += 1
        ring += [Slot(self.layer_bytes, self.device) for _ in range(min(ring_size, streaming) - len(ring))]
        self._layer_ring = ring
        for slot in ring:
            slot.holder = None
        for unit, slot in arriving:
            unit.placement = "gpu"
            slot.holder = None
        own = {id(unit): slot for unit, slot in arriving}
        streamed = [unit for unit in units if unit.placement == "cpu"]
        for unit in units:
            if unit.placement == "gpu" and id(unit) not in own:
                continue  # it stays in its own slot
            if unit.placement == "cpu":
                slot = ring[streamed.index(unit) % len(ring)]
                block = Block(unit, unit.arena, slot, streamed=True, ring=0, lookahead=max(1, len(ring) - 1))
            else:
                slot = own[id(unit)]
                block = Block(unit, unit.arena, slot, streamed=False, ring=next(self._ring_ids))
            unit.blocks = [block]
            unit.compute_params = [self._compute_param(slot, unit, index) for index in range(len(unit.entries))]
        self.blocks = [block for unit in self.units for block in unit.blocks]
        for position, block in enumerate(self.blocks):
            block.position = position
        for unit, _ in arriving:
            self._fetch(unit.blocks[0], required=True)

    def _drop_own_slot(self, unit: Unit) -> None:
        """Give a block's own device slot back (its compute parameters are views into it)."""
        slot = unit.blocks[0].slot
        slot.data = slot.writer = slot.holder = None
        unit.blocks = []
        unit.compute_params = []

    # -------------------------------------------------------------------------------- hooks

    def _install_hooks(self) -> None:
        self.model.register_forward_pre_hook(self._root_pre_forward)
        self.model.register_state_dict_pre_hook(lambda *_: self.wait_for_updates())
        self.model.register_load_state_dict_pre_hook(lambda *_, **__: self.wait_for_updates())
        for unit in self.units:
            if unit.kind == HOOKED:
                for module in self._hook_roots(unit):
                    module.register_forward_pre_hook(functools.partial(self._pre_forward, unit), with_kwargs=True)
                    module.register_forward_hook(functools.partial(self._post_forward, unit))
            elif unit.kind == ROWS:
                self.parts.embedding.forward = functools.partial(self._embedding_forward, unit)
                if self.parts.tied:
                    self.parts.head.forward = functools.partial(self._head_forward, unit)
            elif unit.kind == CHUNKS:
                self.parts.head.forward = functools.partial(self._head_forward, unit)
        if any(unit.kind != RESIDENT for unit in self.units):
            _present_compute_placement(self.model, self.device, self.compute_dtype)

    def _hook_roots(self, unit: Unit) -> list[nn.Module]:
        """The outermost modules of a unit (the block itself, or the embedding and the head when tied)."""
        if unit.group == "transformer":
            return [self.parts.layers[int(unit.name.split(".")[1])]]
        return {"embedding": [self.parts.embedding] + ([self.parts.head] if self.parts.tied else []),
                "norm": [self.parts.norm], "lm_head": [self.parts.head]}[unit.group]

    def _root_pre_forward(self, module: nn.Module, args) -> None:
        # A forward of the whole model never runs inside a backward pass: a flag left set by a
        # backward that raised must not turn this forward's prefetch around.
        self.in_backward = self._backward_active = False
        if not any(unit.kind == ROWS for unit in self.units):
            self._prefetch(-1, +1)
        # Otherwise the embedding prefetches once its rows are on their way: the forward needs
        # them first, and behind a block's copy they would wait for it.

    def _pre_forward(self, unit: Unit, module: nn.Module, args: tuple, kwargs: dict):
        self._acquire_unit(unit)
        if self.in_backward or not torch.is_grad_enabled():
            return None
        return self._wrap_inputs(unit, args, kwargs)

    def _post_forward(self, unit: Unit, module: nn.Module, args: tuple, output):
        if self.in_backward:
            # Recomputation for gradient checkpointing: the block is released after its backward.
            return None
        if torch.is_grad_enabled():
            outputs = [tensor for tensor in nested_tensors(output) if tensor.requires_grad]
            if outputs:
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, functools.partial(self._pre_backward, unit), mode="any")
        self._release_unit(unit)
        return None

    def _wrap_inputs(self, unit: Unit, args: tuple, kwargs: dict):
        positions = [("args", index) for index, value in enumerate(args)
                     if isinstance(value, torch.Tensor) and value.requires_grad]
        positions += [("kwargs", key) for key, value in kwargs.items()
                      if isinstance(value, torch.Tensor) and value.requires_grad]
        if not positions:
            return None
        tensors = [args[key] if where == "args" else kwargs[key] for where, key in positions]
        wrapped = PostBackward.apply(functools.partial(self._post_backward, unit), *tensors)
        args, kwargs = list(args), dict(kwargs)
        for (where, key), tensor in zip(positions, wrapped, strict=True):
            (args if where == "args" else kwargs)[key] = tensor
        return tuple(args), kwargs

    def _pre_backward(self, unit: Unit, grad) -> None:
        self._enter_backward()
        self._acquire_unit(unit)

    def _post_backward(self, unit: Unit) -> None:
        self._release_unit(unit)

    # ------------------------------------------------------------------------ fetch / release

    def _acquire_unit(self, unit: Unit) -> None:
        self._acquire(unit.blocks[0])
        if not unit.swapped:
            for entry, compute in zip(unit.entries, unit.compute_params, strict=True):
                if compute.requires_grad != entry.parameter.requires_grad:
                    compute.requires_grad_(entry.parameter.requires_grad)
                for owner, attribute in entry.owners:
                    owner._parameters[attribute] = compute
            unit.swapped = True

    def _release_unit(self, unit: Unit) -> None:
        if unit.swapped:
            for entry in unit.entries:
                for owner, attribute in entry.owners:
                    owner._parameters[attribute] = entry.parameter
            unit.swapped = False
        if unit.blocks[0].acquired:
            self._release(unit.blocks[0])

    def _acquire(self, block: Block) -> None:
        self._fetch(block, required=True)
        self.streams.compute_waits(block.fetched_event)
        block.acquired = True
        self._prefetch(block.position, -1 if self.in_backward else +1)

    def _release(self, block: Block) -> None:
        block.acquired = False
        block.slot.free_event = self.streams.record_compute(block.slot.free_event)

    def _prefetch(self, position: int, step: int) -> None:
        """Copy the next streamed blocks in this direction, in order, as far as their slot rings
        allow: at most `lookahead` blocks of a ring, and never into a slot whose block is in use or
        needed sooner."""
        ahead: dict[int, int] = {}
        index = position + step
        while 0 <= index < len(self.blocks):
            block = self.blocks[index]
            index += step
            if block.unit.name in self._staged:  # kept whole on the device for this phase
                if step > 0:
                    self._refresh_staged_ahead(block.unit)
                continue
            if not block.streamed:
                # A block kept on the device is copied again only after an update: checked here by
                # version alone, since every pass walks all the blocks ahead of each block (a full
                # _fetch each was 2.2 ms of a 28-layer forward's host time). An in-place edit of
                # the masters is still picked up when the block is acquired.
                if block.slot.holder is not block or block.fetched_version != block.unit.version:
                    self._fetch(block, required=False)
                continue
            if ahead.get(block.ring, 0) >= block.lookahead:
                break
            holder = block.slot.holder
            if holder is not None and holder is not block and (
                    holder.acquired or 0 < (holder.position - position) * step < (block.position - position) * step):
                break
            self._fetch(block, required=False)
            ahead[block.ring] = ahead.get(block.ring, 0) + 1

    def _fetch(self, block: Block, *, required: bool) -> None:
        unit = block.unit
        if not required and not unit.ready.is_set():
            return  # its optimizer update is still running: a prefetch must not wait for it
        unit.ready.wait()
        self._sync_masters(unit)
        slot = block.slot
        if slot.holder is block and block.fetched_version == unit.version:
            return
        if slot.holder is not None and slot.holder.acquired:
            if not required:
                return
            raise RuntimeError(f"offload: block {unit.name} needs the device slot that {slot.holder.unit.name} "
                               "is still using; the forward ran the model's blocks out of order")
        self.streams.stream_waits(self.streams.h2d, slot.free_event)
        target = slot.writer[:block.nbytes]
        block.fetched_event = self.log.timed(H2D, unit.group, block.nbytes, self.streams.h2d,
                                             lambda: target.copy_(block.source, non_blocking=True))
        if slot.holder is not None:
            slot.holder.fetched_version = -1
        slot.holder = block
        block.fetched_version = unit.version

    def _sync_masters(self, unit: Unit) -> None:
        """Pick up an in-place change of the masters (load_state_dict, a manual edit) before a copy."""
        version = self._master_version(unit)
        if version == unit.master_version:
            return
        if not unit.master_is_arena:
            for index, master in enumerate(unit.masters):
                unit.arena_view(index).copy_(master)
        unit.master_version = version
        unit.version += 1

    @staticmethod
    def _master_version(unit: Unit) -> int:
        return sum(entry.parameter._version for entry in unit.entries)

    def after_update(self, unit: Unit) -> None:
        """The optimizer changed this unit's masters in place: refresh its compute copy."""
        if not unit.master_is_arena:
            for index, master in enumerate(unit.masters):
                unit.arena_view(index).copy_(master)
        unit.master_version = self._master_version(unit)
        unit.version += 1

    # -------------------------------------------------------------------------------- grads

    def _enter_backward(self) -> None:
        if self._backward_active:
            return
        self._backward_active = self.in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        for unit in self.units:
            if unit.kind == RESIDENT or not unit.trainable:
                continue
            unit.fresh = all(entry.parameter.grad is None for entry in unit.entries)
            unit.landed.clear()
            unit.accumulated = 0
            if unit.kind == ROWS and not self.parts.tied and unit.fresh:
                # Zero the embedding's gradient while the backward runs; the rows are added into it last.
                self._ensure_grad_arena(unit)
                self._grad_tasks.append(self._submit(unit.grad_views[0].zero_))

    def _on_grad_accumulated(self, unit: Unit, parameter: nn.Parameter) -> None:
        self._enter_backward()
        unit.accumulated += 1
        if unit.accumulated == sum(compute.requires_grad for compute in unit.compute_params):
            self._flush_accumulated(unit)

    def _flush_accumulated(self, unit: Unit) -> None:
        pieces = []
        for index, compute in enumerate(unit.compute_params):
            if compute.grad is not None:
                pieces.append((compute.grad, index, 0))
                compute.grad = None
        if pieces:
            self._send_grads(unit, pieces)

    def _send_grads(self, unit: Unit, pieces: list[tuple[torch.Tensor, int, int]]) -> None:
        """Copy gradient pieces (tensor, entry index, first element) into the unit's host gradient."""
        self._ensure_grad_arena(unit)
        self._retire_in_flight()
        # Flatten before the event that orders the copies after the compute (a copy kernel, if any,
        # must come before it).
        pieces = [(tensor.reshape(-1), index, first) for tensor, index, first in pieces]
        # A piece's first write in a fresh pass is a copy; any other (a second piece at the same
        # place, or one after a tied embedding's rows) is added to what is there.
        first_writes = [unit.fresh and not {(index, first), (index, ROWS_PIECE)} & unit.landed
                        for _, index, first in pieces]
        # Straight into the pinned host gradient when every piece is a first write (the head's chunks
        # of one backward are each a first write of their own rows); through the worker otherwise.
        direct = unit.grad_pinned and all(first_writes)
        unit.landed.update((index, first) for _, index, first in pieces)
        if not self.streams.cuda:
            for (tensor, index, first), copy in zip(pieces, first_writes, strict=True):
                self.log.timed(D2H, unit.group, tensor.numel() * tensor.element_size(), None,
                               functools.partial(self._land, unit, index, first, tensor, copy))
            return
        self.streams.stream_waits(self.streams.d2h, self.streams.record_compute())
        if direct:
            end = None
            for tensor, index, first in pieces:
                target = unit.grad_views[index].view(-1)[first:first + tensor.numel()]
                end = self.log.timed(D2H, unit.group, tensor.numel() * tensor.element_size(), self.streams.d2h,
                                     functools.partial(target.copy_, tensor, non_blocking=True))
            self._hold_until_copied(end, [tensor for tensor, _, _ in pieces], head=unit.kind == CHUNKS)
            return
        if not self._staging.capacity:
            self._staging.capacity = self._staging_bytes()
        buffer, offset = self._staging.take(sum(_aligned(tensor.nbytes) for tensor, _, _ in pieces)), 0
        staged = []
        for (tensor, index, first), copy in zip(pieces, first_writes, strict=True):
            host = _typed(buffer, offset, tensor)
            offset += _aligned(tensor.nbytes)
            end = self.log.timed(D2H, unit.group, tensor.numel() * tensor.element_size(), self.streams.d2h,
                                 functools.partial(host.copy_, tensor, non_blocking=True))
            staged.append((host, index, first, copy))
        self._hold_until_copied(end, [tensor for tensor, _, _ in pieces], head=unit.kind == CHUNKS)
        task = self._submit(self._land_staged, unit, staged, end)
        self._grad_tasks.append(task)
        self._staging.hold_until(task)

    def _staging_bytes(self) -> int:
        """The pinned region that gradients landing through the worker wait in: `staging_buffers`
        times the largest trainable offloaded unit. One region allocated once, because torch's
        pinned allocator would round each request up to a power of two and keep every block it
        ever gave out (12.5 GiB of the 7B shape's accumulated micro-batches on an H200 host,
        2026-11-30, enough for the kernel to kill the run)."""
        largest = max((self._layout(unit)[1] for unit in self.units if unit.kind != RESIDENT and unit.trainable),
                      default=0)
        return self.options.staging_buffers * _aligned(largest)

    def _land_staged(self, unit: Unit, staged: list, end: torch.cuda.Event) -> None:
        end.synchronize()
        for host, index, first, copy in staged:
            self._land(unit, index, first, host, copy)

    def _land(self, unit: Unit, index: int, first: int, tensor: torch.Tensor, overwrite: bool) -> None:
        """Put a gradient piece into the master's gradient: copied over it (the piece's first write of
        a fresh pass) or added to it."""
        parameter = unit.entries[index].parameter
        target = parameter.grad if parameter.grad is not None else unit.grad_views[index]
        target = target.view(-1)[first:first + tensor.numel()]
        if overwrite:
            target.copy_(tensor.reshape(-1))
        else:
            target.add_(tensor.reshape(-1))

    def _ensure_grad_arena(self, unit: Unit) -> None:
        """The group's host gradient arena, in the gradient dtype (allocated at its first gradient).

        Pinned when gradients can land straight in it (same dtype as the compute copies);
        otherwise they land in pinned staging buffers and the worker converts them.
        """
        if unit.grad_views is not None:
            return
        units = [other for other in self.units if other.group == unit.group and other.kind != RESIDENT]
        scale = self.grad_dtype.itemsize // self.compute_dtype.itemsize
        total = sum(_aligned(other.nbytes) for other in units) * scale
        arena = pinned_empty(total, self.device) if scale == 1 else torch.empty(total, dtype=torch.uint8)
        start = 0
        for other in units:
            other.grad_views = [_typed(arena, (start + offset) * scale, (entry.parameter.shape, self.grad_dtype))
                                for offset, entry in zip(other.offsets, other.entries, strict=True)]
            other.grad_pinned = scale == 1 and self.streams.cuda
            start += _aligned(other.nbytes)

    def _retire_in_flight(self) -> None:
        for queue in (self._in_flight, self._head_in_flight):
            while queue and (queue[0][0] is None or queue[0][0].query()):
                queue.popleft()

    def _hold_until_copied(self, end: torch.cuda.Event, tensors: list[torch.Tensor], *, head: bool = False) -> None:
        """Keep device gradients alive until their copy to the host is done.

        The host runs ahead of the device, so waiting for the copies to finish on the host would
        keep every block's gradients alive. Instead the compute stream waits for the oldest copy
        and its tensors are released: the allocator hands their memory only to later work on the
        compute stream, which now runs after the copy (what record_stream would do, without its
        cost). The wait is free unless the copies fall behind the backward pass.
        """
        queue, limit = self._in_flight, self.options.grads_in_flight
        if head:
            queue, limit = self._head_in_flight, self.options.head_grads_in_flight
        queue.append((end, tensors))
        while limit is not None and len(queue) > limit:
            oldest, _ = queue.popleft()
            self.streams.compute_waits(oldest)

    def _finish_backward(self) -> None:
        for unit in self.units:
            if unit.kind == HOOKED and unit.accumulated:
                self._flush_accumulated(unit)
            if unit.kind == HOOKED:
                self._release_unit(unit)
        for block in self.blocks:
            if block.acquired:
                self._release(block)
        self.streams.synchronize()
        self._in_flight.clear()
        self._head_in_flight.clear()
        tasks, self._grad_tasks = self._grad_tasks, []
        for task in tasks:
            task.result()
        for unit in self.units:
            for index in unit.landed_entries():
                parameter = unit.entries[index].parameter
                if parameter.grad is None:
                    parameter.grad = unit.grad_views[index]
            unit.landed.clear()
        self._backward_active = self.in_backward = False

    def _submit(self, function: Callable, *args, inline: bool | None = None) -> Future:
        """Run `function` in the engine's worker thread (CPU-side work that waits on copies), in order.

        On a CPU-only machine gradient work runs at once (`inline` defaults to that), so results
        land in the same order as the copies that produce them.
        """
        if inline if inline is not None else not self.streams.cuda:
            future: Future = Future()
            future.set_result(function(*args))
            return future
        with self._worker_lock:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"offload-{self.role}")
            return self._worker.submit(function, *args)

    # --------------------------------------------------------------------- embedding rows

    def _embedding_forward(self, unit: Unit, input_ids: torch.Tensor) -> torch.Tensor:
        module = self.parts.embedding
        tracked = torch.is_grad_enabled() and module.weight.requires_grad
        staged = None if tracked else self._staged_copy(unit)
        if staged is not None:
            rows = F.embedding(input_ids.to(self.device), staged, module.padding_idx)
            self._prefetch(-1, +1)
            return rows
        unit.ready.wait()
        self._sync_masters(unit)
        if not tracked and self.embedding_cache is not None:
            rows = self.embedding_cache.lookup(input_ids)
            self._prefetch(-1, +1)
            return rows
        # Only the distinct tokens' rows are gathered and cross the bus; the device expands them with
        # F.embedding, whose backward sums each token's gradient (in fp32 on CUDA, rounded once, as an
        # embedding kept on the device does), so only those rows' gradients come back.
        tokens, inverse = torch.unique(input_ids.to("cpu").reshape(-1), return_inverse=True)
        padding = module.padding_idx
        padding_row = None
        if padding is not None and bool((tokens == padding).any()):
            padding_row = int(torch.searchsorted(tokens, padding))
        weight = unit.arena_view(self._index_of(unit, module.weight))
        inverse = inverse.view(input_ids.shape)

        def gather() -> torch.Tensor:
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

        positions = inverse.pin_memory().to(self.device, non_blocking=True) if self.streams.cuda else inverse
        if tracked:
            rows = GatheredRows.apply(module.weight, gather, functools.partial(self._rows_backward, unit, tokens))
        else:
            rows = gather()
        self._prefetch(-1, +1)
        return F.embedding(positions, rows, padding_row)

    def _rows_backward(self, unit: Unit, tokens: torch.Tensor, grad_rows: torch.Tensor) -> None:
        """The gradient of the distinct tokens' rows (already summed per token on the device) goes to
        the host and is added into the embedding's gradient there."""
        self._enter_backward()
        self._ensure_grad_arena(unit)
        index = self._index_of(unit, self.parts.embedding.weight)
        first_write = unit.fresh and index not in unit.landed_entries()
        zero_first = first_write and self.parts.tied
        unit.landed.add((index, ROWS_PIECE))
        # In the host gradient's dtype before the copy: the device converts in microseconds what
        # would take the host tens of milliseconds.
        grad_rows = grad_rows.to(unit.grad_views[index].dtype)
        nbytes = grad_rows.numel() * grad_rows.element_size()
        if not self.streams.cuda:
            self.log.timed(D2H, unit.group, nbytes, None,
                           lambda: self._add_rows(unit, index, tokens, grad_rows, zero_first))
            return
        self.streams.stream_waits(self.streams.d2h, self.streams.record_compute())
        host = torch.empty(grad_rows.shape, dtype=grad_rows.dtype, pin_memory=True)
        end = self.log.timed(D2H, unit.group, nbytes, self.streams.d2h,
                             functools.partial(host.copy_, grad_rows, non_blocking=True))
        self._hold_until_copied(end, [grad_rows])

        def land() -> None:
            end.synchronize()
            self._add_rows(unit, index, tokens, host, zero_first)

        self._grad_tasks.append(self._submit(land))

    def _add_rows(self, unit: Unit, index: int, tokens: torch.Tensor, rows: torch.Tensor, zero_first: bool) -> None:
        """Add one backward's gradient of the distinct tokens' rows: a dense gradient's worth, so
        accumulating micro-batches rounds as an embedding kept on the device does."""
        parameter = unit.entries[index].parameter
        target = parameter.grad if parameter.grad is not None and not unit.fresh else unit.grad_views[index]
        if zero_first:
            target.zero_()
        target.index_add_(0, tokens, rows)

    # ------------------------------------------------------------------------ head chunks

    @staticmethod
    def _index_of(unit: Unit, parameter: nn.Parameter) -> int:
        return next(index for index, entry in enumerate(unit.entries) if entry.parameter is parameter)

    def _head_forward(self, unit: Unit, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.parts.head.weight
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return StreamedLinear.apply(hidden, weight, _HeadStreamer(self, unit))
        staged = self._staged_copy(unit)
        if staged is not None:
            return F.linear(hidden, staged)
        return _HeadStreamer(self, unit).forward(hidden)


class _HeadStreamer:
    """y = x W^T for a head whose weight W streams in row chunks (see functions.StreamedLinear)."""

    def __init__(self, engine: OffloadEngine, unit: Unit):
        self.engine, self.unit = engine, unit

    def _weight(self, block: Block) -> torch.Tensor:
        first, last = block.rows
        width = self.engine.parts.head.weight.shape[1]
        return _typed(block.slot.data, 0, (torch.Size((last - first, width)), self.engine.compute_dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        engine = self.engine
        staged = engine._staged_copy(self.unit)
        if staged is not None:  # kept whole on the device for this phase
            return F.linear(hidden, staged)
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = torch.empty((flat.shape[0], engine.parts.head.weight.shape[0]), dtype=hidden.dtype, device=hidden.device)
        for block in self.unit.blocks:
            engine._acquire(block)
            first, last = block.rows
            out[:, first:last] = flat @ self._weight(block).t()
            engine._release(block)
        return out.view(*hidden.shape[:-1], out.shape[-1])

    def backward(self, hidden: torch.Tensor, grad_output: torch.Tensor, *, input_needs_grad: bool):
        engine = self.engine
        engine._enter_backward()
        flat = hidden.reshape(-1, hidden.shape[-1])
        grads = grad_output.reshape(-1, grad_output.shape[-1])
        staged = engine._staged_copy(self.unit)
        grad_input = None
        if input_needs_grad:
            grad_input = grads.mm(staged) if staged is not None else torch.zeros_like(flat)
        weight_index = self.unit.head_weight_index
        trains_weight = self.unit.entries[weight_index].parameter.requires_grad
        for block in reversed(self.unit.blocks):
            first, last = block.rows
            grad_chunk = grads[:, first:last]
            if input_needs_grad and staged is None:
                engine._acquire(block)
                grad_input.addmm_(grad_chunk, self._weight(block))
                engine._release(block)
            if trains_weight:
                weight_grad = grad_chunk.t().mm(flat)
                engine._send_grads(self.unit, [(weight_grad, weight_index, first * flat.shape[1])])
        return grad_input.view_as(hidden) if grad_input is not None else None


def nested_tensors(value) -> list[torch.Tensor]:
    """The tensors in a value of nested dicts, lists and tuples (a model's output, a state dict)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in nested_tensors(item)]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in nested_tensors(item)]
    return []


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, each counted once (views, tied weights)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def format_bytes(nbytes: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= size or unit == "KiB":
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"


@functools.cache
def _compute_placement_class(model_class: type) -> type:
    """The model's class, reporting the compute device and dtype whatever its masters' placement.

    HF code places new tensors on `model.device` (the first parameter's device) and casts to
    `model.dtype`; with the embedding on the CPU or fp32 masters those would be wrong.
    """
    return type(model_class.__name__, (model_class,), {
        "__module__": model_class.__module__,
        "__qualname__": model_class.__qualname__,
        "device": property(lambda self: self._offload_compute_device),
        "dtype": property(lambda self: self._offload_compute_dtype),
    })


def _present_compute_placement(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    model._offload_compute_device = device
    model._offload_compute_dtype = dtype
    model.__class__ = _compute_placement_class(type(model))
