"""Dynamic offload: how many transformer layers stay on the GPU, decided from device memory in use.

Pure decision logic: the memory probe and the settings are passed in, so tests drive it with numbers.
The run's memory manager (trainer/memory.py) asks it at safe points only (between steps, micro-batches
and decode chunks: no forward or backward in flight) and hands the decision to the engine
(OffloadEngine.set_transformer_layers_on_gpu).

    controller = DynamicOffloadController(probe, settings=lambda: trainer.live_settings)
    decision = controller.decide(layers_on_gpu=engine.layers_on_gpu, total_layers=len(engine.transformer_units))
    if decision is not None:
        engine.set_transformer_layers_on_gpu(decision.layers_on_gpu)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from trainer.offload.engine import OffloadEngine

MemoryProbe = Callable[[], tuple[int, int]]
"""Returns (bytes in use, bytes in all) of the compute device."""

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


class DynamicOffloadController:
    """Decides, at each safe point, how many transformer layers stay on the GPU."""

    def __init__(self, probe: MemoryProbe, settings: Callable[[], DynamicSettings], *,
                 hysteresis: float = HYSTERESIS):
        self.probe = probe
        self.settings = settings
        self.hysteresis = hysteresis

    def decide(self, *, layers_on_gpu: int, total_layers: int, layer_bytes: int = 0) -> Decision | None:
        """The new number of layers on the GPU, or None to leave them as they are.

        Above the threshold: enough layers (of `layer_bytes` each, when known) to get under it, at
        least one, never below the minimum. Below threshold - hysteresis (with the layer back): one layer
        back. Settings are
        read on every call, so a live change acts at the next safe point.
        """
        settings = self.settings()
        minimum = min(settings.min_transformer_layers_on_gpu, total_layers)
        if not settings.dynamic_offload_enabled:
            return None
        used, total = self.probe()
        usage = used / total if total else 0.0
        threshold = settings.gpu_memory_threshold
        target = layers_on_gpu
        if layers_on_gpu < minimum:
            target = minimum  # a raised minimum brings layers back whatever the usage
        elif usage > threshold and layers_on_gpu > minimum:
            excess = used - threshold * total
            needed = math.ceil(excess / layer_bytes) if layer_bytes > 0 else 1
            target = max(minimum, layers_on_gpu - max(1, needed))
        elif layers_on_gpu < total_layers and usage + layer_bytes / max(total, 1) < threshold - self.hysteresis:
            # Only when the layer fits below the margin too: otherwise it would go out again next time.
            target = layers_on_gpu + 1
        if target == layers_on_gpu:
            return None
        return Decision(target, layers_on_gpu, usage, threshold)


class DynamicLayers:
    """One engine's transformer layers under a controller: `safe_point()` is what the memory manager
    calls where nothing is in flight."""

    def __init__(self, engine: OffloadEngine, controller: DynamicOffloadController, *,
                 log: Callable[[str], None] | None = None):
        self.engine = engine
        self.controller = controller
        self.log = log

    def safe_point(self) -> Decision | None:
        """Decide and move; returns the decision acted on, if any."""
        engine = self.engine
        decision = self.controller.decide(layers_on_gpu=engine.layers_on_gpu,
                                          total_layers=len(engine.transformer_units), layer_bytes=engine.layer_bytes)
        if decision is None:
            return None
        engine.set_transformer_layers_on_gpu(decision.layers_on_gpu)
        if decision.layers_on_gpu < decision.previous and engine.device.type == "cuda":
            torch.cuda.empty_cache()  # give the freed slots back, so the next reading sees them gone
        if self.log is not None:
            self.log(f"{decision.describe()} [{engine.role}]")
        return decision
