"""Where each of a run's models lives, and how that changes while the run goes on.

`MemoryManager` owns the placement of every model of the run, so that the trainer only orchestrates
the RL step:

- the host budget: each model's offload placement must fit in the host memory left by the ones
  placed before it (with a margin for the process), or the run stops at start naming the settings;
- placement in two stages: each model is placed as it is built (`place`: its offload policy, its
  transformer layers streamed at first when they move dynamically), then, once every model is
  placed, what stays on the GPU is decided for all of them together (`finish_placement`). That is
  the one place where placement across models is decided (today: first placed, first fitted), as
  `placed_for` is for each phase and `safe_point` while the run goes on;
- per-phase placement (`placed_for`): a phase of the step keeps a model's CPU-resident head and
  embedding on the GPU within the room below the live GPU memory threshold;
- run time: safe points (the dynamic-offload controllers), relief after an out-of-memory error,
  and the step metrics of all that (layers on the GPU, their moves, the errors recovered from);
- the embedding cache of the actor's rollout.

Workers get one model's side of it (`for_role`, a workers.recovery.WorkerMemory) when they are
built. Its dependencies (the device's memory probe, the host's free memory, the live settings, the
log) are passed in, so tests build it with fakes:

    memory = MemoryManager(device, settings=live_settings, probe=probe, host_available=free)
    feed.subscribe(memory.apply_settings)      # (trainer/control.py) each live change, from then on
    model = memory.place(model, fsdp_config, "actor")
    actor = Actor(model, ..., memory=memory.for_role("actor"))
    memory.finish_placement()                  # every model placed
    with memory.placed_for("scoring", "actor"):
        ...
    metrics.update(memory.step_metrics())
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import psutil
import torch
from torch import nn
from transformers import PreTrainedModel

from trainer.config import KEYS, FSDPConfig, OptimConfig, fsdp_key
from trainer.config.messages import Role
from trainer.config.schema import EmbeddingCache as EmbeddingCacheConfig
from trainer.errors import RunSetupError
from trainer.offload import HostMemoryError, OffloadEngine, attach_offload, format_bytes
from trainer.offload.bus import BusTurns
from trainer.offload.dynamic import (
    USE_ORDER,
    Decision,
    DevicePeakMeter,
    DynamicSettings,
    MemoryProbe,
    ModelLayers,
    PeakMeter,
    PhasePlanner,
    PlacedPhase,
    ProbePeakMeter,
    device_memory_probe,
    layers_that_fit,
    plan_layers,
    relieve_layers,
)
from trainer.offload.embedding_cache import EmbeddingCache
from trainer.offload.options import OffloadOptions
from trainer.workers.optimization import build_optimizer

CONFIG_ROLE = {"reward": "reward_model"}  # the engine's role name -> the config's
HOST_MARGIN_BYTES = 2 << 30
"""Host memory a run leaves free beside what its offload placements need (the process, data, staging)."""

Model = TypeVar("Model", bound=nn.Module)


def host_memory_available() -> int:
    """Host memory free now, as the kernel counts it (what the host budget starts from)."""
    return int(psutil.virtual_memory().available)


def default_memory_probe(device: torch.device) -> MemoryProbe | None:
    """The device's memory probe; None on a CPU, which has no device memory of its own to watch."""
    return device_memory_probe(device) if device.type == "cuda" else None


def _default_meter(device: torch.device, probe: MemoryProbe | None) -> PeakMeter | None:
    if probe is None:
        return None
    if device.type == "cuda":
        return DevicePeakMeter(device, probe)
    return ProbePeakMeter(probe)  # an injected probe (tests): what it says is in use, at each reading


class LayerHolder(Protocol):
    """A model whose transformer layers the manager moves: one rank's offload engine, or a sharded model's layers
    on several ranks (trainer/distributed/layer_moves.py)."""

    role: str
    device: torch.device
    ring_slots: int
    layer_bytes: int
    moves: dict[str, int]

    @property
    def layers_on_gpu(self) -> int: ...

    @property
    def transformer_units(self) -> Sequence[object]: ...

    def stageable_bytes(self, phase: str | None = None) -> dict[str, int]: ...

    def set_transformer_layers_on_gpu(self, count: int) -> tuple[int, int]: ...


@dataclass
class _RunningPhase:
    """The phase whose working memory is being measured: its plan's key, its model, and what was in
    use when it started (or after the last relief)."""

    key: str
    engine: LayerHolder
    training: bool
    start: int
    total: int

    def gradient_bytes(self) -> int:
        """The running model's layer gradients on the device in a training phase (layer_cost counts them)."""
        return self.engine.layers_on_gpu * self.engine.layer_bytes if self.training else 0


class MemoryManager:
    """Places the run's models and keeps them within the device's memory while the run goes on."""

    def __init__(self, device: torch.device, *, settings: DynamicSettings,
                 probe: MemoryProbe | None, host_available: Callable[[], int],
                 log: Callable[[str], None] = print, warn: Callable[[str], None] = print,
                 meter: PeakMeter | None = None):
        self.device = device
        self.settings = settings  # the live settings now: apply_settings takes a change, which acts at next use
        self.probe = probe  # None without a GPU: nothing to measure, no dynamic or per-phase placement
        # Each phase's peak in use, as the probe counts (on a GPU: the allocator's peak allocated bytes).
        self.meter = meter or _default_meter(device, probe)
        self.planner = PhasePlanner()  # what each phase of a step keeps on the GPU (dynamic layers)
        self._running: _RunningPhase | None = None
        self._swapped = 0  # layers a phase's unchanged plan brought to the GPU, since the last step's metrics
        self.host_available = host_available
        self.log, self.warn = log, warn
        self._engines: dict[str, OffloadEngine] = {}  # by role, in placement order
        # Models whose transformer layers move with memory pressure (plan_layers decides for all of them): engines,
        # and on several ranks sharded models (add_sharded).
        self._dynamic: list[LayerHolder] = []
        self._sharded: dict[str, LayerHolder] = {}  # several ranks: every sharded model's layers, by role
        self.sharded_summaries: dict[str, list[str]] = {}  # several ranks: each sharded model's offload summary
        self._host_pending = 0  # host bytes placed engines will allocate once they train
        self._staged_logged: dict[tuple[str, str], tuple[str, ...]] = {}
        self._moves_reported = {"to_cpu": 0, "to_gpu": 0}
        self._recoveries = 0  # out-of-memory errors recovered from since the last step's metrics
        self._roles: dict[str, ModelMemory] = {}
        self.embedding_cache: EmbeddingCache | None = None
        self.bus = BusTurns()  # the models' device updates take turns on the bus, the most used first

    def apply_settings(self, settings: DynamicSettings) -> None:
        """The live settings changed (the trainer's one subscription, trainer/control.py): the threshold, the
        layer minimum and the dynamic-offload switch act from their next use on."""
        self.settings = settings

    # --------------------------------------------------------------------------------- placement

    @property
    def engines(self) -> list[OffloadEngine]:
        """Every placed model's offload engine, in placement order (the telemetry reads them)."""
        return list(self._engines.values())

    @property
    def dynamic_engines(self) -> list[OffloadEngine]:
        """The engines whose transformer layers move with memory pressure."""
        return [holder for holder in self._dynamic if isinstance(holder, OffloadEngine)]

    def add_sharded(self, layers: LayerHolder, *, dynamic: bool) -> None:
        """Several ranks: a sharded model's layers (layer_moves.ShardedLayers), which this rank moves between its
        device and its host from its own memory when `dynamic` (dynamic_offload.enabled), as one rank moves an
        engine's; counted in the step metrics either way."""
        self._sharded[layers.role] = layers
        if not dynamic:
            return
        if self.probe is not None:
            self._dynamic.append(layers)
        else:
            self.warn(f"dynamic offload of the {layers.role} needs a GPU to measure memory on; on {self.device} its "
                      "transformer layers stay where the offload policy puts them")

    def _holder(self, role: str) -> LayerHolder | None:
        """The model placed as `role` whose layers move dynamically; None when there is none."""
        return next((holder for holder in self._dynamic if holder.role == role), None)

    def engine(self, role: Role) -> OffloadEngine | None:
        """The engine of the model placed as `role`; None when there is none."""
        return self._engines.get(role)

    def _options(self) -> OffloadOptions:
        """The engines' options. On a CPU compute device the head is one chunk: it is in host memory already, so
        chunks save no device memory, and they would sum the input's gradient over the vocabulary in pieces, in
        another order than the resident run's one product (SmolLM2's 49,152 rows: 1.3e-7 of KL apart)."""
        return OffloadOptions(head_chunk_bytes=1 << 62) if self.device.type == "cpu" else OffloadOptions()

    def place(self, model: Model, fsdp_config: FSDPConfig, role: Role) -> Model:
        """Put each module group where the policy says (the engine streams the CPU-resident ones).

        With dynamic offload its transformer layers start streamed; once every model is placed
        they come to the GPU as far as they fit (`finish_placement`), so a model the GPU cannot
        hold whole still starts, and the models placed after it still find their room."""
        dynamic = fsdp_config.dynamic_offload
        layers_on_gpu = 0 if dynamic.enabled and self.probe is not None else None
        budget = self.host_available() - self._host_pending - HOST_MARGIN_BYTES
        try:
            engine = attach_offload(model, fsdp_config, self.device, role=role, layers_on_gpu=layers_on_gpu,
                                    host_budget=budget, options=self._options())
        except HostMemoryError as error:
            key = fsdp_key(CONFIG_ROLE.get(role, role))
            raise RunSetupError(f"{error} (keeping {format_bytes(HOST_MARGIN_BYTES)} free): place fewer groups on the "
                                f"CPU ({key}.param_offload, .offload_policy, .optimizer_offload), keep their "
                                f"gradients in bf16 ({key}.offload_grad_dtype) or use a machine with more memory"
                                ) from None
        host = engine.host_bytes()
        self._host_pending += host["gradients"] + host["optimizer"]
        engine.share_bus(self.bus)
        self._engines[role] = engine
        if dynamic.enabled and self.probe is not None:
            self._dynamic.append(engine)
        elif dynamic.enabled:
            self.warn(f"dynamic offload of the {role} needs a GPU to measure memory on; on {self.device} its "
                      "transformer layers stay where the offload policy puts them")
        return model

    def finish_placement(self) -> None:
        """Once every model is placed: start making the CPU optimizers' states in the background, and
        bring each dynamic model's transformer layers to the GPU as far as they fit below the
        threshold, in placement order, leaving room for the groups its rollout keeps there."""
        for engine in self._engines.values():
            engine.make_optimizer_states()  # in the background: every model's host budget is counted by now
        probe = self.probe
        if probe is None:
            return  # no GPU to measure: no layer moves dynamically (`place`)
        for engine in self.dynamic_engines:  # (a sharded model's layers start on the device: FSDP2 put them there)
            if engine.placements["transformer"] != "gpu":
                continue  # placed on the CPU: dynamic offload only ever takes layers off the GPU
            total = len(engine.transformer_units)
            fit = layers_that_fit(probe, threshold=self.settings.gpu_memory_threshold,
                                  layer_bytes=engine.layer_bytes, total_layers=total,
                                  reserve_bytes=sum(engine.stageable_bytes().values()),
                                  ring_slots=engine.ring_slots if engine.layers_on_gpu < total else 0)
            engine.set_transformer_layers_on_gpu(fit)
            engine.moves = {"to_cpu": 0, "to_gpu": 0}  # where it starts, not a move
            if engine.layers_on_gpu < total:
                self.log(f"dynamic offload: the {engine.role} starts with {engine.layers_on_gpu} of {total} "
                         f"transformer layers on the GPU (GPU memory threshold "
                         f"{self.settings.gpu_memory_threshold})")

    def enable_embedding_cache(self, settings: EmbeddingCacheConfig) -> EmbeddingCache | None:
        """The device cache of the actor's most frequent embedding rows, when the config asks for
        one and the embedding is on the CPU (else there is nothing to cache: a warning says so)."""
        engine = self._engines.get("actor")
        if not settings.enabled or engine is None:
            return None
        self.embedding_cache = engine.enable_embedding_cache(cache_size=settings.cache_size,
                                                             warmup_steps=settings.warmup_steps)
        if self.embedding_cache is None:
            self.warn(f"{KEYS.actor_rollout_ref.rollout.embedding_cache.enabled} is set, but the actor's embedding is "
                      "on the GPU: there is nothing to cache; set "
                      f"{KEYS.actor_rollout_ref.actor.fsdp_config.offload_policy.embedding}=cpu to use it")
        return self.embedding_cache

    def for_role(self, role: Role) -> ModelMemory:
        """The side of the manager that the worker of the model placed as `role` is built with."""
        return self._roles.setdefault(role, ModelMemory(self, role))

    def summary_lines(self) -> list[str]:
        """The offload summary of every model under the article's heading ("FSDP Offload Summary"), each line after
        its role ("actor: Embedding: ..."), and with dynamic offload how the phases will place the layers."""
        lines = [f"{engine.role}: {line}" for engine in self._engines.values() for line in engine.summary_lines()]
        lines += [f"{role}: {line}" for role, summary in self.sharded_summaries.items() for line in summary]
        if lines:
            lines.insert(0, "FSDP Offload Summary: where each module group of each model lives, and the GPU memory "
                            "that saves")
        if self._dynamic:
            layers = ", ".join(f"{engine.role} {engine.layers_on_gpu} of {len(engine.transformer_units)}"
                               for engine in self._dynamic)
            moving = {holder.role for holder in self._dynamic}
            order = ", ".join(role for role in reversed(USE_ORDER) if role in moving)
            lines.append(f"dynamic offload: transformer layers on the GPU now: {layers}. Each phase of a step "
                         "gives them to the model it runs, less what the phase needs besides them, taken from the "
                         f"models it does not run in this order: {order}; the first step learns what each phase "
                         "needs, the next places for it (\"placement plan\" lines, GET /v1/status)")
        return lines

    @property
    def moves_layers(self) -> bool:
        """Whether any model's transformer layers move with memory pressure (safe points matter)."""
        return bool(self._dynamic)

    # --------------------------------------------------------------------------------- per phase

    @contextlib.contextmanager
    def placed_for(self, phase: str, role: Role, passes: int | None = None) -> Iterator[None]:
        """Run a phase with the model placed as `role` placed for it: its dynamic layers and the
        other models' as the phase planner decides (`_layers_for_phase`), then its CPU-resident head
        and embedding kept on the GPU within the room left below the live threshold
        (OffloadEngine.placed_for). `passes`: how many times the phase runs each of the model's layers
        (PhasePlanner.plan). No model of that role: nothing to place."""
        engine = self._engines.get(role)
        # A rollout under a delayed update reads the weights from before the update running meanwhile
        # (fsdp_config.delayed_update); everything it places (layers, kept groups) copies those.
        stale = engine.stale_reads() if engine is not None and phase == "rollout" else contextlib.nullcontext()
        # A model's training phase and its updates have the bus before the less used models' updates (bus.py).
        bus = engine.claiming_bus() if engine is not None and phase == "training" else contextlib.nullcontext()
        with stale, bus, self._layers_for_phase(phase, role, passes):
            if engine is None or not engine.stageable_bytes() or self.probe is None:
                yield  # nothing on the CPU to keep, or no GPU to keep it on
                return
            with self._staged_within_budget(engine, phase):
                yield

    @contextlib.contextmanager
    def _layers_for_phase(self, phase: str, role: Role, passes: int | None) -> Iterator[None]:
        """Place every dynamic model's layers for the phase (dynamic.PhasePlanner: the running model
        takes the room of the ones the phase does not run, less the phase's learned working memory),
        and learn the phase's working memory from its peak. Nothing moves while dynamic offload is
        paused, or when the running model's layers do not move dynamically."""
        running = self._holder(role)
        settings = self.settings
        if (running is None or self.probe is None or self.meter is None
                or not settings.dynamic_offload_enabled):
            yield
            return
        key = f"{phase}/{role}"
        training = phase == "training"
        used, total = self.probe()
        placed = self.planner.plan(key, role, self._layers(), used=used, total=total, settings=settings,
                                   reserve=sum(running.stageable_bytes(phase).values()), training=training,
                                   passes=passes)
        self._place_layers(key, placed)
        measured = _RunningPhase(key, running, training, start=self.probe()[0], total=total)
        self._running = measured
        self.meter.reset()
        try:
            yield
        finally:
            self._running = None
        # Only a phase that completed: its peak is what it needed (a failed one raised past here).
        self.planner.learn(key, max(0, self.meter.peak() - measured.start - measured.gradient_bytes()))

    def _place_layers(self, key: str, placed: PlacedPhase) -> None:
        """Apply a phase's plan, freeing room before taking it. A new plan is a dynamic-offload move (the
        step metrics' moves) and is logged; the same plan as last time is the phase's placement, counted
        as `offload/phase_swaps` (the layers it copied to the GPU)."""
        engines = sorted(self._dynamic, key=lambda engine: placed.counts[engine.role] >= engine.layers_on_gpu)
        before = {engine: dict(engine.moves) for engine in self._dynamic}
        for engine in engines:
            if placed.counts[engine.role] != engine.layers_on_gpu:
                engine.set_transformer_layers_on_gpu(placed.counts[engine.role])
        if self.device.type == "cuda" and any(engine.moves["to_cpu"] != before[engine]["to_cpu"]
                                              for engine in self._dynamic):
            torch.cuda.empty_cache()  # give the freed slots back (another process may want them)
        if placed.new:
            self.log(f"placement plan: {self.planner.describe(key)}")
            return
        for engine, moves in before.items():
            self._swapped += engine.moves["to_gpu"] - moves["to_gpu"]
            engine.moves = moves

    def plan_rows(self) -> list[dict[str, object]] | None:
        """Each phase's plan as the offload message's rows; None when no model's layers move dynamically."""
        return self.planner.rows() if self._dynamic else None

    def plan_lines(self) -> list[str]:
        """Each phase's plan (the layers every dynamic model keeps on the GPU for it, and the working
        memory it was planned for), in the order the phases first ran."""
        return [self.planner.describe(key) for key in self.planner.plans]

    @contextlib.contextmanager
    def _staged_within_budget(self, engine: OffloadEngine, phase: str) -> Iterator[None]:
        assert self.probe is not None
        used, total = self.probe()
        budget = int(self.settings.gpu_memory_threshold * total) - used
        with engine.placed_for(phase, budget_bytes=budget) as staged:
            self._log_staged(engine, phase, staged)
            yield

    def _log_staged(self, engine: OffloadEngine, phase: str, staged: list[str]) -> None:
        """Say which groups a phase copies to the GPU, when that changes (not at every step)."""
        key = (engine.role, phase)
        if self._staged_logged.get(key) == tuple(staged):
            return
        self._staged_logged[key] = tuple(staged)
        if staged:
            sizes = engine.stageable_bytes()
            self.log(f"per-phase placement: {phase} keeps the {engine.role}'s {' and '.join(staged)} on the GPU "
                     f"({format_bytes(sum(sizes[group] for group in staged))})")
        else:
            self.log(f"per-phase placement: {phase} streams the {engine.role}'s CPU-resident groups (no room below "
                     f"the GPU memory threshold {self.settings.gpu_memory_threshold} to keep them on the GPU)")

    # ---------------------------------------------------------------------------------- run time

    def safe_point(self) -> None:
        """Between micro-batches and decode chunks, and before a step (nothing in flight): move
        transformer layers off the GPU while the memory in use is over the live threshold. None comes
        back here: the memory in use between two passes is not the phase's peak; each phase's plan
        brings layers to the GPU (`placed_for`)."""
        if self._dynamic and self.probe is not None:
            used, total = self.probe()
            self._move_layers(plan_layers(self._layers(), used=used, total=total, settings=self.settings))

    def step_peaks(self) -> tuple[int, int] | None:
        """The step's peak allocated and reserved device bytes across the phases' resets of the peak
        statistics (the step's perf/max_memory_* metrics); None where the device's own statistics say it."""
        return self.meter.step_peaks() if isinstance(self.meter, DevicePeakMeter) else None

    def _layers(self) -> list[ModelLayers]:
        return [ModelLayers(engine.role, engine.layers_on_gpu, len(engine.transformer_units), engine.layer_bytes,
                            engine.ring_slots) for engine in self._dynamic]

    def _move_layers(self, decisions: dict[str, Decision]) -> None:
        for role, decision in decisions.items():
            engine = self._holder(role)
            assert engine is not None
            engine.set_transformer_layers_on_gpu(decision.layers_on_gpu)
            if decision.layers_on_gpu < decision.previous and engine.device.type == "cuda":
                torch.cuda.empty_cache()  # give the freed slots back, so the next reading sees them gone
            self.log(f"{decision.describe()} [{role}]")

    def relieve_memory(self) -> bool:
        """After a CUDA out-of-memory error: move layers worth half of what every model keeps above the
        minimum to the CPU, from the least used model first (dynamic.relieve_layers: an OOM in the
        critic's update no longer halves the actor's layers, which the rollout reads at every token),
        else drop the groups a phase keeps on the GPU (they stream for the rest of it). False when
        nothing could be freed (then the micro-batch is split instead)."""
        settings = self.settings
        running = self._running
        if running is not None:
            # The phase needed more than was free at its start: what it is learned to need.
            self.planner.learn(running.key, running.total - running.start - running.gradient_bytes())
        relieved = relieve_layers(self._layers(), settings.min_transformer_layers_on_gpu) \
            if settings.dynamic_offload_enabled else {}
        for role, count in relieved.items():
            holder = self._holder(role)
            assert holder is not None
            holder.set_transformer_layers_on_gpu(count)
            self.log(f"out of GPU memory: {role} keeps {holder.layers_on_gpu} transformer layers on GPU, retrying")
        if running is not None and self.probe is not None and self.meter is not None:
            running.start = self.probe()[0]  # the retry's peak is measured from here
            self.meter.reset()
        if relieved:
            return True
        moved = False
        for engine in self._engines.values():
            dropped = engine.drop_kept()
            if dropped:
                self.log(f"out of GPU memory: the {engine.role}'s {' and '.join(dropped)} stream for the rest of "
                         f"the {engine.phase} phase, retrying")
                moved = True
        return moved

    def release(self, role: Role) -> None:
        """Forget the failed pass of the model placed as `role` and give the cached device memory back."""
        engine = self._engines.get(role)
        if engine is not None:
            engine.abandon_pass()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def count_recoveries(self, count: int) -> None:
        """Out-of-memory errors recovered from, reported in the next step's metrics."""
        self._recoveries += count

    def end_rollout(self) -> None:
        """After each step's rollout: the embedding cache counts its warm-up, and fills once warm."""
        if self.embedding_cache is not None:
            self.embedding_cache.end_step()

    def step_metrics(self) -> dict[str, float]:
        """Out-of-memory errors recovered from, transformer layers on the GPU (all models, and each
        model's) and their moves, since the last call; the embedding cache's hit ratio; with the update split
        between the device and the host, each model's host share of its last update and the window it learned
        (update_split.py)."""
        engines: list[LayerHolder] = [*self._engines.values(), *self._sharded.values()]
        result = {"perf/oom_recoveries": float(self._recoveries),
                  "offload/transformer_layers_on_gpu": sum(engine.layers_on_gpu for engine in engines),
                  **{f"offload/{engine.role}/transformer_layers_on_gpu": engine.layers_on_gpu for engine in engines}}
        self._recoveries = 0
        moves = {direction: sum(engine.moves[direction] for engine in engines) for direction in ("to_cpu", "to_gpu")}
        for direction, total in moves.items():
            result[f"offload/moves_{direction}"] = total - self._moves_reported[direction]
        self._moves_reported = moves
        result["offload/phase_swaps"] = self._swapped
        self._swapped = 0
        for engine in self._engines.values():  # optimizer_update both: where the last update went, and why
            split = engine.update_split
            if split is not None and split.last_host_share is not None:
                result[f"offload/{engine.role}/update_host_share"] = split.last_host_share
                if split.window is not None:
                    result[f"offload/{engine.role}/update_window_s"] = split.window
        hit_ratio = self.embedding_cache.take_hit_ratio() if self.embedding_cache is not None else None
        if hit_ratio is not None:
            result["rollout/embedding_cache_hit_ratio"] = hit_ratio
        return result


class ModelMemory:
    """One model's side of the memory manager (a workers.recovery.WorkerMemory): what its worker
    needs, without knowing the other models or the engines."""

    def __init__(self, manager: MemoryManager, role: Role):
        self.manager = manager
        self.role = role

    def safe_point(self) -> None:
        self.manager.safe_point()  # every model's layers: the memory in use is the device's

    def relieve_memory(self) -> bool:
        return self.manager.relieve_memory()

    def release(self) -> None:
        self.manager.release(self.role)

    def count_recoveries(self, count: int) -> None:
        self.manager.count_recoveries(count)

    def build_optimizer(self, model: PreTrainedModel, config: OptimConfig) -> torch.optim.Optimizer:
        return build_optimizer(model, config, self.manager.engine(self.role))

    def update_streams_layers(self) -> bool:
        # On a CPU compute device nothing moves: the "streamed" layers are in host memory already, so merging
        # micro-batches saves no copy and would only sum the gradient in another order than the resident run.
        engine = self.manager.engine(self.role)
        return (engine is not None and engine.device.type != "cpu"
                and engine.layers_on_gpu < len(engine.transformer_units))

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        engine = self.manager.engine(self.role)
        return engine.accumulating() if engine is not None else contextlib.nullcontext()
