"""Dynamic offload: how many transformer layers of each model stay on the GPU, decided from device memory.

Pure decision logic (`plan_layers`): the memory in use, the settings and the models' layers are passed
in, so tests drive it with numbers. The run's memory manager (trainer/memory.py) asks it at safe points
(no forward or backward in flight) and hands each decision to the engines
(OffloadEngine.set_transformer_layers_on_gpu). It settles instead of following the memory in use:

- Layers come back only at the end of a step, from the step's peak: as many as fit below the threshold
  less the hysteresis, at once. Between micro-batches and decode chunks the memory in use is not the
  step's peak (a rollout uses less than an update), so a layer brought back there went out again at
  the next update: the controller moved layers three times a step and never settled (issue 14).
- Layers leave the GPU at any safe point where the memory in use is over the threshold, enough to get
  under it, from the models used least often per step first (the reference and the reward model once
  a step, the critic twice, the actor at every decoded token), and come back in the opposite order.
- At steady state (a step's peak between the threshold less the hysteresis and the threshold) nothing
  moves; a move follows a change of the live settings, of the workload, or an out-of-memory error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

MemoryProbe = Callable[[], tuple[int, int]]
"""Returns (bytes in use, bytes in all) of the compute device."""
PeakProbe = Callable[[], int]
"""Returns the most bytes in use since the device's peak statistics were last reset (each step's end)."""

HYSTERESIS = 0.05
"""Layers come back only once usage is this far below the threshold: a move that frees exactly
enough to get under it must not be undone at the next check (no flapping)."""


class DynamicSettings(Protocol):
    """What the controller reads at each decision (trainer.config.live.LiveSettings has these)."""

    gpu_memory_threshold: float
    min_transformer_layers_on_gpu: int
    dynamic_offload_enabled: bool


@dataclass(frozen=True)
class Decision:
    """Move to `layers_on_gpu` transformer layers on the GPU, because of `usage` (0 to 1)."""

    layers_on_gpu: int
    previous: int
    usage: float
    threshold: float

    @property
    def moved(self) -> int:
        return abs(self.layers_on_gpu - self.previous)

    def describe(self) -> str:
        """The log line, e.g. "dynamic offload: 4 layers to CPU (GPU memory 0.91 > threshold 0.85)"."""
        plural = "layer" if self.moved == 1 else "layers"
        if self.layers_on_gpu < self.previous:
            return (f"dynamic offload: {self.moved} {plural} to CPU (GPU memory {self.usage:.2f} > threshold "
                    f"{self.threshold:.2f}; {self.layers_on_gpu} on GPU)")
        return (f"dynamic offload: {self.moved} {plural} back to GPU (GPU memory {self.usage:.2f} < threshold "
                f"{self.threshold:.2f} - {HYSTERESIS}; {self.layers_on_gpu} on GPU)")


def device_memory_probe(device: torch.device) -> MemoryProbe:
    """(used, total) of a CUDA device as the driver sees it (the caching allocator's reserve counts).

    Under a per-process cap (torch.cuda.set_per_process_memory_fraction) the budget is this
    process's: (bytes its allocator holds, the cap); the driver's view would not see the cap."""

    def probe() -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        fraction = torch.cuda.get_per_process_memory_fraction(index) if hasattr(
            torch.cuda, "get_per_process_memory_fraction") else 1.0
        if fraction < 1.0:
            return torch.cuda.memory_reserved(device), int(total * fraction)
        return total - free, total

    return probe


def device_peak_probe(device: torch.device, probe: MemoryProbe) -> PeakProbe:
    """The peak of what `probe` counts since the allocator's peak statistics were reset (memory_metrics
    resets them at each step's end): the allocator's peak reserve, plus what the probe counts besides
    the allocator now (the CUDA context, other processes; nothing under a per-process cap)."""

    def peak() -> int:
        used, _ = probe()
        besides = max(0, used - torch.cuda.memory_reserved(device))
        return int(torch.cuda.max_memory_reserved(device)) + besides

    return peak


def layers_that_fit(probe: MemoryProbe, *, threshold: float, layer_bytes: int, total_layers: int,
                    reserve_bytes: int = 0) -> int:
    """How many transformer layers of `layer_bytes` fit on the device now, below `threshold` of its
    memory with `reserve_bytes` kept free for the rest (activations, the KV cache, staged groups):
    where a run with dynamic offload starts, so that one the GPU cannot hold whole still starts."""
    used, total = probe()
    room = threshold * total - used - reserve_bytes
    if layer_bytes <= 0:
        return total_layers
    return max(0, min(total_layers, int(room // layer_bytes)))


USE_ORDER = ("actor", "critic", "ref", "reward")
"""The models by how often a step runs their transformer layers, most first: the actor at every decoded
token of the rollout and in its update, the critic in values and its update, the reference and the
reward model once a step. Layers leave the GPU from the end of this order and come back from its start."""


@dataclass(frozen=True)
class ModelLayers:
    """One dynamically offloaded model as the planner sees it."""

    role: str
    layers_on_gpu: int
    total_layers: int
    layer_bytes: int
    """Device bytes of one transformer layer (what moving one frees or takes)."""


def plan_layers(models: Sequence[ModelLayers], *, used: int, total: int, settings: DynamicSettings,
                bring_back: bool, hysteresis: float = HYSTERESIS) -> dict[str, Decision]:
    """The models whose layers on the GPU should change, and to what.

    `used` is the device memory in use (at the end of a step: the step's peak) of `total`. Over the
    threshold: layers leave the GPU, from the least used model first, never below the minimum, enough to
    get under it (at least one). With `bring_back` (the end of a step) and the peak below the threshold
    less the hysteresis: as many layers as fit below that margin come back, most used model first. A
    raised minimum brings layers back whatever the usage. Settings are read on every call, so a live
    change acts at the next safe point.
    """
    if not settings.dynamic_offload_enabled or total <= 0:
        return {}
    threshold = settings.gpu_memory_threshold
    counts = {model.role: model.layers_on_gpu for model in models}
    for model in models:
        floor = min(settings.min_transformer_layers_on_gpu, model.total_layers)
        if counts[model.role] < floor:
            used += (floor - counts[model.role]) * model.layer_bytes
            counts[model.role] = floor
    ordered = _by_use(models)
    if used > threshold * total:
        _take_off(reversed(ordered), counts, used - threshold * total, settings.min_transformer_layers_on_gpu)
    elif bring_back:
        _bring_back(ordered, counts, (threshold - hysteresis) * total - used)
    usage = used / total
    return {model.role: Decision(counts[model.role], model.layers_on_gpu, usage, threshold)
            for model in models if counts[model.role] != model.layers_on_gpu}


def relieve_layers(models: Sequence[ModelLayers], minimum: int) -> dict[str, int]:
    """After an out-of-memory error: layers worth half the bytes all models keep on the GPU above the
    minimum leave it (at least one layer), from the least used model first. The new layers on the GPU of
    the models that change; none when every model is at its minimum."""
    spare = sum(max(0, model.layers_on_gpu - min(minimum, model.total_layers)) * max(model.layer_bytes, 1)
                for model in models)
    if spare == 0:
        return {}
    counts = {model.role: model.layers_on_gpu for model in models}
    _take_off(reversed(_by_use(models)), counts, spare / 2, minimum)
    return {model.role: counts[model.role] for model in models if counts[model.role] != model.layers_on_gpu}


def _by_use(models: Sequence[ModelLayers]) -> list[ModelLayers]:
    """Most used first (USE_ORDER); a role it does not name counts as the most used."""
    return sorted(models, key=lambda model: USE_ORDER.index(model.role) if model.role in USE_ORDER else 0)


def _take_off(models: Iterable[ModelLayers], counts: dict[str, int], excess: float, minimum: int) -> None:
    for model in models:
        spare = counts[model.role] - min(minimum, model.total_layers)
        if spare <= 0:
            continue
        needed = math.ceil(excess / model.layer_bytes) if model.layer_bytes > 0 else 1
        moved = min(spare, max(1, needed))
        counts[model.role] -= moved
        excess -= moved * max(model.layer_bytes, 1)
        if excess <= 0:
            return


def _bring_back(models: Iterable[ModelLayers], counts: dict[str, int], room: float) -> None:
    for model in models:
        missing = model.total_layers - counts[model.role]
        if missing <= 0:
            continue
        fits = missing if model.layer_bytes <= 0 else min(missing, int(room // model.layer_bytes))
        if fits <= 0:
            return  # the most used model's layer does not fit: no less used one goes before it
        counts[model.role] += fits
        room -= fits * model.layer_bytes
