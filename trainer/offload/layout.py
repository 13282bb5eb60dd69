"""How one model is laid out for offload: units, blocks, slots, host arenas and what they cost.

Decided once, before anything is allocated, and testable without a GPU:

- Each module group is split into *units* (the embedding, each transformer block, the final norm,
  the head) of a `UnitKind`, each placed on the GPU or the CPU (`Placement`).
- A unit placed on the CPU lives in one host *arena* per group, allocated once (`pack`: page-locked
  on a GPU machine), in the compute dtype; the model's registered parameters (the *masters*, which
  the optimizer, state_dict and checkpoints see) alias it, or are fp32 copies beside it when the
  optimizer runs on the CPU with fp32 master weights.
- A unit crosses the bus as *blocks*: one contiguous byte range of its arena copied in one copy
  into a static device *slot* (a transformer block is one block; a head in chunks is several).
- `Layout.host_bytes` counts the host memory a placement needs before any is allocated, so a
  placement that does not fit is refused with a message instead of ending in the kernel's OOM killer.

The types themselves (Unit, Block, Slot, ...) are in units.py.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from trainer.config import FSDP_CONFIG
from trainer.offload.copies import pinned_empty
from trainer.offload.groups import GROUPS, TITLES, Entry, ModelParts, entries_of, find_parts, owners_in
from trainer.offload.units import (
    UPDATE_SLICE_ELEMENTS,
    Placement,
    Unit,
    UnitKind,
    aligned,
    standalone,
    typed_view,
)

GIB = 1024**3


class HostMemoryError(MemoryError):
    """The placement needs more host memory than there is; the message says how much and for what."""


@dataclass(frozen=True)
class Dtypes:
    compute: torch.dtype
    """What the device computes in: the model's dtype."""
    master: torch.dtype
    """The registered parameters' dtype: fp32 when the optimizer runs on the CPU."""
    grad: torch.dtype
    """Host gradients: the masters' dtype, or (offload_grad_dtype) the compute dtype beside fp32 masters."""

    @property
    def master_scale(self) -> int:
        return self.master.itemsize // self.compute.itemsize

    @property
    def grad_scale(self) -> int:
        return self.grad.itemsize // self.compute.itemsize


@dataclass(eq=False)
class Layout:
    """One model's units, where each lives, and the dtypes: everything decided before allocation."""

    parts: ModelParts
    placements: dict[str, Placement]
    units: list[Unit]
    dtypes: Dtypes
    optimizer_offload: bool
    dynamic_layers: bool
    """Every transformer block gets a host arena, even those placed on the GPU, so that moving one
    between device and host later is a copy, not an allocation."""
    device_update: bool = False
    """The optimizer update runs on the device over the host's masters and gradients (device_update.py): they
    are page-locked on a GPU machine, whatever their dtype, so that they cross the bus at full speed."""
    split_update: bool = False
    """Each step updates some offloaded units on the device and the others on the host's cores at once
    (update_split.py); `device_update` is set too."""

    @property
    def transformer_units(self) -> list[Unit]:
        return [unit for unit in self.units if unit.group == "transformer"]

    @property
    def layer_bytes(self) -> int:
        """Device bytes of the largest transformer block (what moving one to the CPU frees, at most)."""
        return max((unit.nbytes for unit in self.transformer_units), default=0)

    def offloaded(self, group: str | None = None) -> list[Unit]:
        return [unit for unit in self.units if unit.offloaded and group in (None, unit.group)]

    def unit_of_kind(self, kind: UnitKind) -> Unit | None:
        return next((unit for unit in self.units if unit.kind == kind), None)

    @functools.cached_property
    def group_bytes(self) -> dict[str, int]:
        return {group: sum(unit.param_bytes for unit in self.units if unit.group == group)
                for group in (*GROUPS, "other")}

    def staged_weight_index(self, unit: Unit) -> int:
        """The entry a no-grad phase may copy whole to the device: the head's weight, or the embedding's."""
        return unit.index_of(self.parts.head_weight if unit.kind == UnitKind.CHUNKS else self.parts.embedding_weight)

    def stageable_bytes(self) -> dict[str, int]:
        """The CPU-resident groups a no-grad phase may copy whole to the device, with their device
        bytes, head first (streamed, it crosses the bus whole at every forward: at every decoded
        token), then the embedding (whose rows the embedding cache or a CPU gather can serve instead)."""
        staged = {}
        for kind in (UnitKind.CHUNKS, UnitKind.ROWS):
            for unit in self.units:
                if unit.kind == kind:
                    shape, dtype = unit.compute_like[self.staged_weight_index(unit)]
                    staged[unit.group] = shape.numel() * dtype.itemsize
        return staged

    # ----------------------------------------------------------------------------- host memory

    def staging_bytes(self, staging_buffers: int) -> int:
        """The pinned region that gradients landing through the worker wait in: `staging_buffers`
        times the largest trainable offloaded unit. One region allocated once, because torch's
        pinned allocator would round each request up to a power of two and keep every block it
        ever gave out (12.5 GiB of the 7B shape's accumulated micro-batches on an H200 host,
        2026-11-30, enough for the kernel to kill the run)."""
        largest = max((trained_bytes(unit, self.dtypes.compute) for unit in self.offloaded()), default=0)
        return staging_buffers * aligned(largest)

    def host_bytes(self, *, cuda: bool, staging_buffers: int) -> dict[str, int]:
        """Host memory the placement holds once it trains, by use: "arena" (the offloaded groups in the
        compute dtype, pinned on a GPU machine), "masters" (fp32 master weights beside a bf16 arena),
        "gradients" and "optimizer" (AdamW's two states) of the trainable parameters kept there. The
        gradients and optimizer states are allocated at the first backward and step."""
        dtypes = self.dtypes
        usage = dict.fromkeys(("arena", "masters", "gradients", "optimizer"), 0)
        for group in (*GROUPS, "other"):
            units = self.offloaded(group)
            usage["arena"] += sum(aligned(unit_layout(unit, dtypes.compute)[1]) for unit in units)
            # Masters, gradients and states of the trained entries only: frozen weights (a LoRA adapter's base)
            # have their arena alone.
            trained = sum(aligned(entry.parameter.numel() * dtypes.compute.itemsize)
                          for unit in units for entry in unit.entries if entry.parameter.requires_grad)
            usage["masters"] += trained * dtypes.master_scale if dtypes.master_scale != 1 else 0
            usage["gradients"] += trained * dtypes.grad_scale  # one gradient arena per group
            usage["optimizer"] += sum(2 * entry.parameter.numel() * dtypes.master.itemsize
                                      for unit in units for entry in unit.entries if entry.parameter.requires_grad)
        if dtypes.grad != dtypes.master:
            # The update and the gradient norm read the gradients back in fp32 a slice at a time
            # (OffloadAdamW), each into a buffer of its own.
            largest = max((entry.parameter.numel() for unit in self.offloaded()
                           for entry in unit.entries if entry.parameter.requires_grad), default=0)
            usage["gradients"] += 2 * min(largest, UPDATE_SLICE_ELEMENTS) * dtypes.master.itemsize
        if cuda:
            usage["gradients"] += self.staging_bytes(staging_buffers)  # gradients to add or convert pass through it
        return usage

    def saved_gpu_bytes(self, working_set_bytes: int) -> int:
        """Device memory the placement saves against an all-GPU run: the offloaded parameters, their
        gradients, and the optimizer states (two per parameter) kept on the CPU, less the slots."""
        saved = 0
        for unit in self.offloaded():
            compute = [entry.parameter.numel() * self.dtypes.compute.itemsize for entry in unit.entries]
            trainable = sum(nbytes for nbytes, entry in zip(compute, unit.entries, strict=True)
                            if entry.parameter.requires_grad)
            if unit.placement == Placement.CPU:
                saved += sum(compute) + trainable
            saved += 2 * trainable
        return saved - working_set_bytes

    def trainable_on_host(self) -> int:
        """Elements of the trainable parameters whose masters live on the host."""
        return sum(entry.parameter.numel() for unit in self.offloaded()
                   for entry in unit.entries if entry.parameter.requires_grad)


def trained_bytes(unit: Unit, compute_dtype: torch.dtype) -> int:
    """The unit's gradient bytes in the compute dtype: its trained entries, each aligned (0 for a frozen unit)."""
    return sum(aligned(entry.parameter.numel() * compute_dtype.itemsize)
               for entry in unit.entries if entry.parameter.requires_grad)


def unit_layout(unit: Unit, compute_dtype: torch.dtype) -> tuple[list[int], int]:
    """Where each of the unit's tensors starts in its arena (aligned), and the unit's bytes."""
    offsets, end = [], 0
    for entry in unit.entries:
        offsets.append(aligned(end))
        end = offsets[-1] + entry.parameter.numel() * compute_dtype.itemsize
    return offsets, end


# ---------------------------------------------------------------------------------------- plan


def plan_layout(model: nn.Module, placements: dict[str, str], *, optimizer_offload: bool,
                layer_classes: Sequence[str] | None, dynamic_layers: bool, layers_on_gpu: int | None,
                host_grad_dtype: torch.dtype | None) -> Layout:
    """Split `model` into units and place each (nothing is moved or allocated yet)."""
    parts = find_parts(model, layer_classes)
    resolved = _resolve_placements(placements, tied=parts.tied)
    dtypes = _dtypes(model, optimizer_offload, host_grad_dtype)
    trains = any(parameter.requires_grad for parameter in model.parameters())
    layout = Layout(parts, resolved, [], dtypes, optimizer_offload and trains, dynamic_layers)
    layout.units = _build_units(model, layout)
    if layers_on_gpu is not None:
        if not dynamic_layers:
            raise ValueError(f"offload: layers_on_gpu needs dynamic_layers ({FSDP_CONFIG.dynamic_offload.enabled})")
        # Where a dynamic run starts: the first ones on the device, the rest streamed.
        for index, unit in enumerate(layout.transformer_units):
            if index >= layers_on_gpu:
                unit.placement = Placement.CPU
    return layout


def _resolve_placements(placements: dict[str, str], *, tied: bool) -> dict[str, Placement]:
    resolved = {group: Placement(placements.get(group, "gpu")) for group in GROUPS}
    if tied:
        # One weight cannot live in two places: it goes where either group needs it on the device.
        shared = Placement.GPU if Placement.GPU in (resolved["embedding"], resolved["lm_head"]) else Placement.CPU
        resolved["embedding"] = resolved["lm_head"] = shared
    return resolved


def _dtypes(model: nn.Module, optimizer_offload: bool, host_grad_dtype: torch.dtype | None) -> Dtypes:
    compute = next(model.parameters()).dtype
    trains = any(parameter.requires_grad for parameter in model.parameters())
    # The optimizer on the CPU keeps fp32 master weights; the device computes in the model's dtype.
    master = torch.float32 if optimizer_offload and trains else compute
    grad = master
    if host_grad_dtype is not None and optimizer_offload and trains:
        if host_grad_dtype != compute:
            raise ValueError(f"offload: gradients on the host in {host_grad_dtype} need a model in that dtype, "
                             f"not {compute}")
        if not hasattr(torch.Tensor, "grad_dtype"):
            raise ValueError(f"offload: gradients in {host_grad_dtype} beside fp32 weights need torch's "
                             f"Tensor.grad_dtype, which torch {torch.__version__} does not have")
        grad = host_grad_dtype
    return Dtypes(compute, master, grad)


def _build_units(model: nn.Module, layout: Layout) -> list[Unit]:
    parts = layout.parts
    names = {id(module): name for name, module in model.named_modules()}
    units: list[Unit] = []
    embedding_modules = [parts.embedding] + ([parts.head] if parts.tied and parts.head is not None else [])
    units.append(_unit(layout, "embedding", "embedding", entries_of(embedding_modules, names)))
    for index, layer in enumerate(parts.layers):
        units.append(_unit(layout, f"layers.{index}", "transformer", entries_of([layer], names)))
    if parts.norm is not None:
        units.append(_unit(layout, "norm", "norm", entries_of([parts.norm], names)))
    if parts.head is not None and not parts.tied:
        units.append(_unit(layout, "lm_head", "lm_head", entries_of([parts.head], names)))
    claimed = {id(entry.parameter) for unit in units for entry in unit.entries}
    other = [entry for entry in entries_of([model], names) if id(entry.parameter) not in claimed]
    for unit in units:
        owners_in(model, unit.entries)
    units.append(Unit("other", "other", other, UnitKind.RESIDENT, Placement.GPU))
    return [unit for unit in units if unit.entries]


def _unit(layout: Layout, name: str, group: str, entries: list[Entry]) -> Unit:
    placement, parts = layout.placements[group], layout.parts
    if group == "transformer" and layout.dynamic_layers:
        kind = UnitKind.HOOKED  # a device copy of the arena (placement gpu) or streamed from it (cpu)
    elif placement == Placement.GPU:
        # With optimizer_offload a trainable unit on the GPU keeps its masters on the CPU and a
        # compute copy on the device, refreshed after each update.
        trains = any(entry.parameter.requires_grad for entry in entries)
        kind = UnitKind.HOOKED if layout.optimizer_offload and trains else UnitKind.RESIDENT
    elif group == "embedding" and gathers_rows(parts.embedding):
        kind = UnitKind.ROWS
    elif group == "lm_head" and streams_in_chunks(parts.head):
        kind = UnitKind.CHUNKS
    else:
        kind = UnitKind.HOOKED
    if kind == UnitKind.ROWS and parts.tied and not streams_in_chunks(parts.head):
        kind = UnitKind.HOOKED
    return Unit(name, group, entries, kind, placement)


def gathers_rows(module: nn.Module) -> bool:
    return (type(module) is nn.Embedding and module.max_norm is None and not module.scale_grad_by_freq
            and not module.sparse)


def streams_in_chunks(module: nn.Module | None) -> bool:
    return type(module) is nn.Linear and module.bias is None


# ---------------------------------------------------------------------------------------- pack


def pack(model: nn.Module, layout: Layout, device: torch.device) -> None:
    """Move resident units to the device and copy the others into their host arenas, once."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    for unit in layout.units:
        if not unit.offloaded:
            for entry in unit.entries:
                entry.parameter.data = entry.parameter.data.to(device)
    for group in (*GROUPS, "other"):
        units = layout.offloaded(group)
        if units:
            _pack_group(units, layout.dtypes, device, pin_masters=layout.device_update)


def _pack_group(units: list[Unit], dtypes: Dtypes, device: torch.device, *, pin_masters: bool) -> None:
    starts, total = [], 0
    for unit in units:
        unit.offsets, unit.nbytes = unit_layout(unit, dtypes.compute)
        starts.append(total)
        total += aligned(unit.nbytes)
    arena = pinned_empty(total, device)
    # fp32 masters beside a bf16 arena, for the trained entries: a frozen weight (a LoRA adapter's base) needs
    # none, its master is its arena copy. Page-locked when the update runs on the device (device_update.py).
    separate = dtypes.master_scale != 1
    nbytes = sum(trained_bytes(unit, dtypes.compute) for unit in units) * dtypes.master_scale
    if not separate:
        masters = arena
    else:
        masters = pinned_empty(nbytes, device) if pin_masters else torch.empty(nbytes, dtype=torch.uint8)
    position = 0
    for unit, start in zip(units, starts, strict=True):
        unit.arena = arena[start:start + unit.nbytes]
        for index, entry in enumerate(unit.entries):
            unit.arena_view(index).copy_(entry.parameter.data)
            if separate and entry.parameter.requires_grad:
                master = standalone(masters, position, entry.parameter.shape, dtypes.master)
                position += aligned(entry.parameter.numel() * dtypes.compute.itemsize) * dtypes.master_scale
                master.copy_(entry.parameter.data)
            else:
                master = standalone(arena, start + unit.offsets[index], entry.parameter.shape, dtypes.compute)
                unit.arena_masters.add(index)
            entry.parameter.data = master
            if dtypes.grad != dtypes.master and entry.parameter.requires_grad:
                entry.parameter.grad_dtype = None  # its .grad is the host gradient, in the gradient dtype
            unit.masters.append(master)
        unit.master_is_arena = len(unit.arena_masters) == len(unit.entries)
        unit.frozen_entries = frozenset(index for index, entry in enumerate(unit.entries)
                                        if not entry.parameter.requires_grad)
        unit.master_version = unit.masters_version()


def allocate_grad_arena(layout: Layout, group: str, device: torch.device) -> None:
    """The group's host gradient arena, in the gradient dtype, with each unit's views into it.

    Pinned when gradients can land straight in it (same dtype as the compute copies); otherwise
    they land in pinned staging and the worker converts them.
    """
    units = layout.offloaded(group)
    compute, grad, scale = layout.dtypes.compute, layout.dtypes.grad, layout.dtypes.grad_scale
    # The trained entries only: a frozen weight (a LoRA adapter's base) gets no gradient.
    total = sum(trained_bytes(unit, compute) for unit in units) * scale
    pinned = scale == 1 or layout.device_update
    arena = pinned_empty(total, device) if pinned else torch.empty(total, dtype=torch.uint8)
    start = 0
    for unit in units:
        views: list[torch.Tensor | None] = []
        for entry in unit.entries:
            if not entry.parameter.requires_grad:
                views.append(None)
                continue
            views.append(typed_view(arena, start * scale, (entry.parameter.shape, grad)))
            start += aligned(entry.parameter.numel() * compute.itemsize)
        unit.grad_views = views
        unit.grad_pinned = scale == 1 and device.type == "cuda"


def host_arenas(layout: Layout) -> list[torch.Tensor]:
    """The host arenas the offloaded groups live in (pinned when the device is a GPU)."""
    arenas = {}
    for unit in layout.units:
        if unit.arena is not None:
            arenas[unit.arena.untyped_storage().data_ptr()] = unit.arena
    return list(arenas.values())


# ------------------------------------------------------------------------------------- summary


def summary_rows(layout: Layout, role: str, device: torch.device) -> list[dict[str, object]]:
    """Each group: its offload_policy placement, the device that holds it and its parameters' size (for
    the start-of-run log and /v1/status). The "gpu" placement means "resident on the compute device",
    which on a CPU-only run is the CPU: `device` names that one, not the placement's word."""
    compute = Placement.GPU if device.type == "cuda" else Placement.CPU
    rows: list[dict[str, object]] = []
    for group in (*GROUPS, "other"):
        if group == "other" and not layout.group_bytes["other"]:
            continue
        placement = layout.placements.get(group, Placement.GPU)
        rows.append({"role": role, "group": group, "placement": str(placement),
                     "device": str(Placement.CPU if placement == Placement.CPU else compute),
                     "bytes": layout.group_bytes[group]})
    return rows


def summary_lines(layout: Layout, *, role: str, device: torch.device, host: dict[str, int],
                  saved_gpu_bytes: int) -> list[str]:
    """The offload summary in words, in the words of the article this project answers ("verl CPU offloading实战":
    "Embedding: OFFLOADED to CPU (1.02 GiB)", "Transformer (28 layers): KEPT on GPU (12.15 GiB)", "Total GPU
    Memory Saved: 1.02 GiB"), so that a reader who greps a log for them finds them."""
    lines = []
    layers = len(layout.transformer_units)
    # The "gpu" placement means "resident on the compute device": say which when that is not a GPU.
    on_gpu = device.type == "cuda"
    resident = "KEPT on GPU" if on_gpu else f"KEPT on the compute device, the {device.type.upper()}"
    for row in summary_rows(layout, role, device):
        group = str(row["group"])
        title = TITLES[group] + (f" ({layers} layers)" if group == "transformer" else "")
        if group == "lm_head" and layout.parts.tied:
            lines.append(f"{title}: tied to the embedding")
            continue
        where = "OFFLOADED to CPU" if row["placement"] == Placement.CPU else resident
        lines.append(f"{title}: {where} ({format_bytes(layout.group_bytes[group])})")
    trained = [entry.parameter for unit in layout.units for entry in unit.entries if entry.parameter.requires_grad]
    total = sum(entry.parameter.numel() for unit in layout.units for entry in unit.entries)
    if trained and len(trained) < sum(len(unit.entries) for unit in layout.units):
        # A LoRA adapter (or any partly frozen model): what trains, which alone has gradients and optimizer states.
        count = sum(parameter.numel() for parameter in trained)
        nbytes = format_bytes(count * layout.dtypes.compute.itemsize)
        lines.append(f"Trainable: {count:,} of {total:,} parameters ({nbytes}, {100 * count / total:.2f}%); the "
                     "other weights are frozen (no gradients, no optimizer states)")
    on_host = layout.trainable_on_host()
    master = layout.dtypes.master
    master_name = str(master).removeprefix("torch.")
    if on_host:
        where = "OFFLOADED to CPU" if layout.optimizer_offload else "on CPU for the groups placed there"
        update = f"; {update_paths_in_words(layout, on_gpu, device)}" if layout.optimizer_offload else ""
        lines.append(f"Optimizer: {where} ({master_name} master weights and AdamW states, "
                     f"{format_bytes(3 * on_host * master.itemsize)}{update})")
    saved = format_bytes(saved_gpu_bytes)
    lines.append(f"Total GPU Memory Saved: {saved}" if on_gpu
                 else f"Total GPU Memory Saved on a GPU: {saved} (this run computes on the {device.type.upper()})")
    if sum(host.values()):
        pinned = " pinned" if on_gpu else ""
        now = f"{format_bytes(host['arena'])}{pinned} weights"
        if host["masters"]:
            now += f" and {format_bytes(host['masters'])} {master_name} masters"
        later = host["gradients"] + host["optimizer"]
        lines.append(f"Host memory: {format_bytes(sum(host.values()))} ({now}"
                     + (f", {format_bytes(later)} more once it trains)" if later else ")"))
    return lines


def update_paths_in_words(layout: Layout, on_gpu: bool, device: torch.device) -> str:
    """Where an offloaded optimizer's update runs (fsdp_config.optimizer_update), for the summary."""
    runs_on = "GPU" if on_gpu else device.type.upper()
    if layout.split_update:
        return (f"AdamW runs on the {runs_on}, streaming them through it, and on the host's cores at once, "
                "each step's units split between the two by their measured speed")
    if layout.device_update:
        return f"AdamW runs on the {runs_on}, streaming them through it"
    return "AdamW runs on the host's cores"


def host_memory_message(role: str, usage: dict[str, int], budget: int) -> str:
    parts = ", ".join(f"{use} {format_bytes(nbytes)}" for use, nbytes in usage.items() if nbytes)
    return (f"the {role}'s offload placement needs {format_bytes(sum(usage.values()))} of host memory "
            f"({parts}) and {format_bytes(max(0, budget))} is available")


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, each counted once (views, tied weights)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def model_host_bytes(model: nn.Module) -> int:
    """Host memory the model's weights and buffers hold now (packing gives it back)."""
    return storage_bytes(tensor for tensor in itertools.chain(model.parameters(), model.buffers())
                         if tensor.device.type == "cpu")


def format_bytes(nbytes: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= size or unit == "KiB":
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"
