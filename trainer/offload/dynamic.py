"""Dynamic offload: how many transformer layers stay on the GPU, decided from device memory in use.

Pure decision logic: the memory probe and the settings are passed in, so tests drive it with numbers.
The trainer asks it at safe points only (between steps and micro-batches: no forward or backward in
flight) and hands the decision to the engine (OffloadEngine.set_transformer_layers_on_gpu).

    controller = DynamicOffloadController(probe, settings=lambda: trainer.live_settings)
    decision = controller.decide(layers_on_gpu=engine.layers_on_gpu, total_layers=len(engine.transformer_units))
    if decision is not None:
        engine.set_transformer_layers_on_gpu(decision.layers_on_gpu)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

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
    """(used, total) of a CUDA device as the driver sees it (the caching allocator's reserve counts)."""

    def probe() -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(device)
        return total - free, total

    return probe


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
