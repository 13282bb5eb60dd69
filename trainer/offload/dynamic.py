"""Dynamic offload: how many transformer layers of each model stay on the GPU, decided from device memory.

Pure decision logic: the memory in use, the settings and the models' layers are passed in, so tests
drive it with numbers. The run's memory manager (trainer/memory.py) asks it and hands each decision to
the engines (OffloadEngine.set_transformer_layers_on_gpu). Two deciders:

- `PhasePlanner`, at the start of each phase of a step (the rollout, each model's scoring and update):
  the model the phase runs gets the room below the threshold, less what the phase needs besides the
  layers (its working memory: activations, the KV cache, logits, gradients), which the planner learns
  from the phase's peak the first time it runs (and raises after an out-of-memory error, or when a
  longer workload needs more). It takes that room from the models the phase does not run, least used
  first (the reference and the reward model once a step, the critic twice, the actor at every decoded
  token): a layer streamed in a decode crosses the bus at every token, a layer of an idle model not at
  all, and a layer that leaves the GPU costs nothing (the host arena holds every layer). A phase keeps
  its last plan while it fits below the threshold, so at steady state each phase places the same
  layers every step and the controller changes nothing: its plan changes only with the live settings,
  the workload, or an out-of-memory error. Measured on an H200 (benchmarks/README.md, e2e_bench ppo3b):
  the actor streamed 20 of its 36 layers at each of 128 decoded tokens, 390 GB a step, while the
  critic held its layers.
- `plan_layers`, at safe points (between micro-batches and decode chunks, no pass in flight): while
  the memory in use is over the threshold, enough layers leave the GPU to get under it, from the least
  used model first. Layers never come back there (the memory in use between two passes is not the
  phase's peak: the old controller brought a layer back at every decode chunk and sent it off again in
  the update, three moves a step, and never settled; issue 14).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from trainer.offload.layout import format_bytes

MemoryProbe = Callable[[], tuple[int, int]]
"""Returns (bytes in use, bytes in all) of the compute device."""


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
        # A safe point brings layers back only for a raised min_transformer_layers_on_gpu (plan_layers).
        return (f"dynamic offload: {self.moved} {plural} back to GPU (the live min_transformer_layers_on_gpu "
                f"rose; {self.layers_on_gpu} on GPU)")


def device_memory_probe(device: torch.device) -> MemoryProbe:
    """(used, total) of a CUDA device: the bytes the tensors of this process hold (the caching
    allocator's allocated bytes), plus what the device holds outside this process's allocator (the
    CUDA context, other processes), of the device's memory.

    Allocated, not reserved: under a cap the allocator's reserve grows towards the cap whatever the
    layers (cached, fragmented blocks of the rollout's growing KV cache; it frees them before it fails),
    so a controller judging the reserve moved layers off at every step and never settled (issue 14,
    measured on an H200: 6.5 moves a step). The threshold's margin below 1 covers fragmentation.
    Under a per-process cap (torch.cuda.set_per_process_memory_fraction) the budget is the cap and
    nothing outside the allocator counts (the driver's view would not see the cap)."""

    index = device.index if device.index is not None else torch.cuda.current_device()
    capacity = torch.cuda.get_device_properties(index).total_memory

    def probe() -> tuple[int, int]:
        allocated = torch.cuda.memory_allocated(device)
        fraction = torch.cuda.get_per_process_memory_fraction(index) if hasattr(
            torch.cuda, "get_per_process_memory_fraction") else 1.0
        if fraction < 1.0:
            return allocated, int(capacity * fraction)  # no driver call: safe points come every few tokens
        free, total = torch.cuda.mem_get_info(device)
        besides = max(0, total - free - torch.cuda.memory_reserved(device))
        return allocated + besides, total

    return probe


class PeakMeter(Protocol):
    """The most device memory in use since the last reset, as the memory probe counts it."""

    def reset(self) -> None: ...

    def peak(self) -> int: ...


class DevicePeakMeter:
    """A CUDA device's peak since the last reset: the allocator's peak allocated bytes, plus what the
    probe counts besides the allocator now (the CUDA context, other processes; nothing under a
    per-process cap). The memory manager resets it at each phase's start, to learn that phase's peak;
    `step_peaks` keeps the step's peaks across those resets for the step's memory metrics."""

    def __init__(self, device: torch.device, probe: MemoryProbe):
        self.device, self.probe = device, probe
        self._allocated = self._reserved = 0

    def reset(self) -> None:
        self._allocated = max(self._allocated, torch.cuda.max_memory_allocated(self.device))
        self._reserved = max(self._reserved, torch.cuda.max_memory_reserved(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        used, _ = self.probe()
        besides = max(0, used - torch.cuda.memory_allocated(self.device))
        return int(torch.cuda.max_memory_allocated(self.device)) + besides

    def step_peaks(self) -> tuple[int, int]:
        """The peak allocated and reserved bytes since the last call (the step's), across resets."""
        self.reset()
        peaks = self._allocated, self._reserved
        self._allocated = self._reserved = 0
        return peaks


class ProbePeakMeter:
    """The peak of an injected probe (tests, a CPU run): what it says is in use, sampled at each
    reading and reset."""

    def __init__(self, probe: MemoryProbe):
        self.probe = probe
        self._peak = 0

    def reset(self) -> None:
        self._peak = self.probe()[0]

    def peak(self) -> int:
        self._peak = max(self._peak, self.probe()[0])
        return self._peak


def layers_that_fit(probe: MemoryProbe, *, threshold: float, layer_bytes: int, total_layers: int,
                    reserve_bytes: int = 0, ring_slots: int = 0) -> int:
    """How many transformer layers of `layer_bytes` fit on the device now, below `threshold` of its
    memory with `reserve_bytes` kept free for the rest (activations, the KV cache, staged groups):
    where a run with dynamic offload starts (every layer streamed, through `ring_slots` slots already
    in use), so that one the GPU cannot hold whole still starts."""
    used, total = probe()
    if layer_bytes <= 0:
        return total_layers
    model = ModelLayers("", 0, total_layers, layer_bytes, ring_slots)
    room = threshold * total - (used - model.device_bytes(0)) - reserve_bytes
    return model.most_that_fit(total_layers, layer_bytes, room)


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
    ring_slots: int = 0
    """Device slots of a layer's size that the streamed layers rotate through (the engine's prefetch + 1), held
    while any layer streams: min(ring_slots, layers streamed) of them. So the last few layers to leave the GPU free
    nothing (each takes a ring slot of its size), and the last few to come back cost nothing: measured on an H200,
    a 7B actor's rollout kept 27 of its 28 layers, decoding at 28-51 ms a token with one layer streamed (no CUDA
    graph while a layer streams), in the memory that holds all 28 (issue 14)."""

    def device_bytes(self, on_gpu: int, per_layer: int | None = None) -> int:
        """Device bytes of the model's transformer layers with `on_gpu` of them kept on the GPU, each costing
        `per_layer` there (its weights, by default; in a training phase its gradients too), and the ring slots
        the streamed rest rotate through."""
        per_layer = self.layer_bytes if per_layer is None else per_layer
        return on_gpu * per_layer + min(self.ring_slots, self.total_layers - on_gpu) * self.layer_bytes

    def most_that_fit(self, most: int, per_layer: int, room: float, least: int = 0) -> int:
        """The most layers on the GPU, from `least` to `most`, whose device bytes (`device_bytes`) fit in `room`.
        When none does, the most that take no more than `least` do (streaming more would only add ring slots)."""
        room = max(room, self.device_bytes(least, per_layer))
        for count in range(most, least, -1):
            if self.device_bytes(count, per_layer) <= room:
                return count
        return least


def plan_layers(models: Sequence[ModelLayers], *, used: int, total: int,
                settings: DynamicSettings) -> dict[str, Decision]:
    """The models whose layers on the GPU should change at a safe point, and to what.

    `used` is the device memory in use of `total`. Over the threshold: layers leave the GPU, from the
    least used model first, never below the minimum, enough to get under it (at least one). A raised
    minimum brings layers back whatever the usage. Settings are read on every call, so a live change
    acts at the next safe point.
    """
    if not settings.dynamic_offload_enabled or total <= 0:
        return {}
    threshold = settings.gpu_memory_threshold
    counts = {model.role: model.layers_on_gpu for model in models}
    used += _raise_to_minimum(models, counts, settings.min_transformer_layers_on_gpu)
    if used > threshold * total:
        _take_off(list(reversed(_by_use(models))), counts, used - threshold * total,
                  settings.min_transformer_layers_on_gpu)
    usage = used / total
    return {model.role: Decision(counts[model.role], model.layers_on_gpu, usage, threshold)
            for model in models if counts[model.role] != model.layers_on_gpu}


def _raise_to_minimum(models: Sequence[ModelLayers], counts: dict[str, int], minimum: int) -> int:
    """Bring every model up to the live minimum; the bytes that takes."""
    added = 0
    for model in models:
        floor = min(minimum, model.total_layers)
        if counts[model.role] < floor:
            added += model.device_bytes(floor) - model.device_bytes(counts[model.role])
            counts[model.role] = floor
    return added


def relieve_layers(models: Sequence[ModelLayers], minimum: int) -> dict[str, int]:
    """After an out-of-memory error: layers worth half the bytes all models keep on the GPU above the
    minimum leave it (at least one layer), from the least used model first. The new layers on the GPU of
    the models that change; none when every model is at its minimum."""
    if all(model.layers_on_gpu <= min(minimum, model.total_layers) for model in models):
        return {}
    spare = sum(max(0, _freed(model, model.layers_on_gpu, min(minimum, model.total_layers))) for model in models)
    if spare <= 0:
        return {}  # the layers above the minimum would only trade places with ring slots
    counts = {model.role: model.layers_on_gpu for model in models}
    _take_off(list(reversed(_by_use(models))), counts, spare / 2, minimum)
    return {model.role: counts[model.role] for model in models if counts[model.role] != model.layers_on_gpu}


def _by_use(models: Sequence[ModelLayers]) -> list[ModelLayers]:
    """Most used first (USE_ORDER); a role it does not name counts as the most used."""
    return sorted(models, key=lambda model: USE_ORDER.index(model.role) if model.role in USE_ORDER else 0)


def _give_up_to_minimum(models: Iterable[ModelLayers], counts: dict[str, int], minimum: int) -> int:
    """Every one of `models` down to the minimum; the bytes that frees."""
    freed = 0
    for model in models:
        floor = min(minimum, model.total_layers)
        if counts[model.role] > floor:
            freed += model.device_bytes(counts[model.role]) - model.device_bytes(floor)
            counts[model.role] = floor
    return freed


def _freed(model: ModelLayers, before: int, after: int) -> int:
    """Device bytes freed when the model goes from `before` to `after` layers on the GPU (its ring slots counted);
    with layers of unknown size, one byte a layer, so that taking layers still frees something."""
    if model.layer_bytes <= 0:
        return before - after
    return model.device_bytes(before) - model.device_bytes(after)


def _fewest_to_free(model: ModelLayers, count: int, floor: int, needed: float) -> int:
    """The fewest layers the model gives (down to `floor`) to free `needed` bytes; all it can when that is too few,
    none when giving them all frees nothing (they would only trade places with ring slots)."""
    for given in range(1, count - floor + 1):
        if _freed(model, count, count - given) >= needed:
            return given
    return count - floor if _freed(model, count, floor) > 0 else 0


def _take_for(short: float, models: Sequence[ModelLayers], counts: dict[str, int], minimum: int) -> int:
    """Layers of `models`, least used first (their order reversed), down to the minimum, until `short` bytes are
    free; the bytes taken."""
    taken = 0
    for model in reversed(models):
        if short - taken <= 0:
            break
        count, floor = counts[model.role], min(minimum, model.total_layers)
        if count <= floor:
            continue
        given = _fewest_to_free(model, count, floor, short - taken) if model.layer_bytes > 0 else count - floor
        taken += _freed(model, count, count - given) if model.layer_bytes > 0 else 0
        counts[model.role] -= given
    return taken


def _take_off(models: Sequence[ModelLayers], counts: dict[str, int], excess: float, minimum: int) -> None:
    """Layers off the GPU from `models` in their order, down to the minimum, until `excess` bytes are freed (at least
    one layer; of unknown size, one a model)."""
    for model in models:
        count, floor = counts[model.role], min(minimum, model.total_layers)
        if count <= floor:
            continue
        given = _fewest_to_free(model, count, floor, excess) if model.layer_bytes > 0 else 1
        if given == 0:
            continue
        counts[model.role] -= given
        excess -= _freed(model, count, count - given)
        if excess <= 0:
            return


PLAN_MARGIN = 0.02
"""A phase plans its layers this far below the threshold, and keeps that plan while it fits below the
threshold itself: the memory in use at a phase's start varies a little from step to step (the batch's
lengths), and a plan made to the threshold exactly would change by a layer every few steps."""


TAKING_PASSES = 3
"""The fewest passes through its layers (decoded tokens, micro-batches) for which a phase takes another
model's room: below, its layers stream (see PhasePlanner.plan)."""


@dataclass(frozen=True)
class PhasePlan:
    """The layers on the GPU of every dynamic model that a phase last placed, for a threshold; whether
    the phase's working memory was known then (a first run's plan is kept for one run only)."""

    counts: dict[str, int]
    threshold: float
    learned: bool


@dataclass(frozen=True)
class PlacedPhase:
    """What `PhasePlanner.plan` decided: each model's layers on the GPU, and whether that plan is new
    (a changed plan is a dynamic-offload move; the same plan as last step is not)."""

    counts: dict[str, int]
    new: bool


class PhasePlanner:
    """Places every dynamic model's layers for each phase of a step, from what the phase is learned to
    need besides them (see the module's docstring)."""

    def __init__(self, margin: float = PLAN_MARGIN):
        self.margin = margin
        self.working: dict[str, int] = {}
        """Per phase: the most bytes it needed above what was in use at its start, its running model's
        layer gradients left out (`layer_cost` counts them)."""
        self.plans: dict[str, PhasePlan] = {}

    def plan(self, phase: str, running: str, models: Sequence[ModelLayers], *, used: int, total: int,
             settings: DynamicSettings, reserve: int = 0, training: bool = False,
             passes: int | None = None) -> PlacedPhase:
        """The layers on the GPU of each of `models` for `phase`, which runs the model `running`; `used`
        of `total` bytes are in use now, `reserve` more will be (the groups the phase keeps on the GPU) until
        the phase's working memory is learned: that is measured from the phase's start, before it keeps them,
        so it holds them already (counted twice: 2 GiB of the 7B headline's update, two layers with their gradients).
        In a training phase each of the running model's layers on the GPU also holds its gradients.

        `passes`: how many times the phase runs each of its model's layers (the decoded tokens, the
        micro-batches; None: many). A layer streamed costs a copy a pass, overlapped with the compute; one
        taken from another model costs a copy at the phase's start and one when that model needs it back,
        neither overlapped. So a phase of fewer than TAKING_PASSES passes (a scoring of one or two
        micro-batches: the reference's, once a step) takes no other model's room to keep its own layers: it
        streams what the free room does not hold. It still takes what it needs to run at all (its working
        memory and its layers at the minimum), and a training phase's first run frees the other models' room
        as every phase's first run with many passes does: an update of one merged micro-batch is two passes,
        and its working memory, unknown then, is the step's largest (measured on an H200, 2026-12-04: a 3B
        critic's first update beside the actor's 36 layers ran out of memory at a 12 GiB cap)."""
        counts = {model.role: model.layers_on_gpu for model in models}
        if not settings.dynamic_offload_enabled or total <= 0:
            return PlacedPhase(counts, new=False)
        threshold, minimum = settings.gpu_memory_threshold, settings.min_transformer_layers_on_gpu
        used += _raise_to_minimum(models, counts, minimum)
        by_role = {model.role: model for model in models}
        cost = layer_cost(by_role[running], training)
        working = self.working.get(phase)
        besides = reserve if working is None else working  # what the phase needs beside the layers
        last = self.plans.get(phase)
        if last is not None and self._still_fits(last, by_role, counts, running, used=used + besides,
                                                 total=total, threshold=threshold, minimum=minimum, cost=cost):
            return PlacedPhase(dict(last.counts), new=False)  # the plan still fits: keep it (steady state)
        others = [model for model in _by_use(models) if model.role != running]
        # Whether keeping one more of its own layers is worth taking another model's: not for a few passes.
        takes_room = passes is None or passes >= TAKING_PASSES
        run = by_role[running]
        floor = min(minimum, run.total_layers)
        # Room for the running model's layers (and the ring its streamed ones need): below the threshold less
        # the margin, less the rest.
        room = (threshold - self.margin) * total - (used - run.device_bytes(counts[running])) - besides
        if working is None:
            # The phase's first run: what it needs is not known. The models it does not run give their
            # layers (down to the minimum) and the running model keeps what it has; its peak is learned.
            if takes_room or training:
                room += _give_up_to_minimum(others, counts, minimum)
            fits = counts[running]
        else:
            wanted = run.total_layers if takes_room else floor  # else only what running at all needs
            room += _take_for(run.device_bytes(wanted, cost) - room, others, counts, minimum)
            fits = run.total_layers
        if cost > 0:
            fits = run.most_that_fit(fits, cost, room, least=min(floor, fits))
        counts[running] = max(floor, min(run.total_layers, fits))
        new = last is None or last.counts != counts
        self.plans[phase] = PhasePlan(dict(counts), threshold, learned=working is not None)
        return PlacedPhase(counts, new=new)

    @staticmethod
    def _still_fits(last: PhasePlan, by_role: dict[str, ModelLayers], counts: dict[str, int], running: str, *,
                    used: int, total: int, threshold: float, minimum: int, cost: int) -> bool:
        """Whether the phase's last plan, made once its need was known for this threshold, keeps its peak (`used`
        with the phase's need, moved to that plan) below the threshold and every model at its minimum."""
        if not last.learned or last.threshold != threshold or set(last.counts) != set(counts):
            return False
        moved = sum(by_role[role].device_bytes(last.counts[role]) - by_role[role].device_bytes(counts[role])
                    for role in counts)
        gradients = (cost - by_role[running].layer_bytes) * last.counts[running]
        floors = all(last.counts[role] >= min(minimum, by_role[role].total_layers) for role in counts)
        return used + moved + gradients <= threshold * total and floors

    def learn(self, phase: str, working: int) -> None:
        """`phase` needed `working` bytes above what was in use at its start (its peak); a phase that
        needs more than it was planned for plans again at its next start."""
        self.working[phase] = max(self.working.get(phase, 0), int(working))

    def rows(self) -> list[dict[str, object]]:
        """Every phase's plan, in the order the phases first ran, as the offload message's rows
        (messages.PhasePlanRow)."""
        return [{"phase": phase, "layers_on_gpu": dict(plan.counts), "working_bytes": self.working.get(phase),
                 "threshold": plan.threshold} for phase, plan in self.plans.items()]

    def describe(self, phase: str) -> str:
        """The plan of a phase, for the log and /v1/status: "rollout/actor: actor 36, critic 4 layers on the
        GPU (working memory 1.20 GiB)"."""
        plan = self.plans.get(phase)
        if plan is None:
            return f"{phase}: not run yet"
        placed = ", ".join(f"{role} {count}" for role, count in plan.counts.items())
        working = self.working.get(phase)
        learned = format_bytes(working) if working is not None else "not yet learned"
        return f"{phase}: {placed} layers on the GPU (working memory {learned})"


def layer_cost(model: ModelLayers, training: bool) -> int:
    """Device bytes one of a model's layers on the GPU takes in a phase: its weights, and in a training
    phase its gradients too (they add up on the device, OffloadEngine.accumulating)."""
    return model.layer_bytes * (2 if training else 1)
