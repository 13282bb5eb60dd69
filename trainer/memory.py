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

    memory = MemoryManager(device, settings=lambda: live_settings, probe=probe, host_available=free)
    model = memory.place(model, fsdp_config, "actor")
    actor = Actor(model, ..., memory=memory.for_role("actor"))
    memory.finish_placement()                  # every model placed
    with memory.placed_for("scoring", "actor"):
        ...
    metrics.update(memory.step_metrics())
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import psutil
import torch
from torch import nn
from transformers import PreTrainedModel

from trainer.config import FSDPConfig, OptimConfig
from trainer.config.messages import Role
from trainer.config.schema import FSDP_PREFIX
from trainer.config.schema import EmbeddingCache as EmbeddingCacheConfig
from trainer.errors import RunSetupError
from trainer.offload import HostMemoryError, OffloadEngine, attach_offload, format_bytes
from trainer.offload.dynamic import (
    HYSTERESIS,
    Decision,
    DynamicSettings,
    MemoryProbe,
    ModelLayers,
    PeakProbe,
    device_memory_probe,
    device_peak_probe,
    layers_that_fit,
    plan_layers,
    relieve_layers,
)
from trainer.offload.embedding_cache import EmbeddingCache
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


def _default_peak_probe(device: torch.device, probe: MemoryProbe | None) -> PeakProbe:
    if probe is None:
        return lambda: 0
    if device.type == "cuda":
        return device_peak_probe(device, probe)
    return lambda: probe()[0]  # an injected probe (tests): what it says is in use now


class MemoryManager:
    """Places the run's models and keeps them within the device's memory while the run goes on."""

    def __init__(self, device: torch.device, *, settings: Callable[[], DynamicSettings],
                 probe: MemoryProbe | None, host_available: Callable[[], int],
                 log: Callable[[str], None] = print, warn: Callable[[str], None] = print,
                 peak_probe: PeakProbe | None = None):
        self.device = device
        self.settings = settings  # read at each use: a live change acts at the next one
        self.probe = probe  # None without a GPU: nothing to measure, no dynamic or per-phase placement
        # The step's peak in use, as the probe counts (by default, on a GPU: the allocator's peak reserve).
        self.peak_probe: PeakProbe = peak_probe or _default_peak_probe(device, probe)
        self.host_available = host_available
        self.log, self.warn = log, warn
        self._engines: dict[str, OffloadEngine] = {}  # by role, in placement order
        # Engines whose transformer layers move with memory pressure (plan_layers decides for all of them).
        self._dynamic: list[OffloadEngine] = []
        self._host_pending = 0  # host bytes placed engines will allocate once they train
        self._staged_logged: dict[tuple[str, str], tuple[str, ...]] = {}
        self._moves_reported = {"to_cpu": 0, "to_gpu": 0}
        self._recoveries = 0  # out-of-memory errors recovered from since the last step's metrics
        self._roles: dict[str, ModelMemory] = {}
        self.embedding_cache: EmbeddingCache | None = None

    # --------------------------------------------------------------------------------- placement

    @property
    def engines(self) -> list[OffloadEngine]:
        """Every placed model's offload engine, in placement order (the telemetry reads them)."""
        return list(self._engines.values())

    @property
    def dynamic_engines(self) -> list[OffloadEngine]:
        """The engines whose transformer layers move with memory pressure."""
        return list(self._dynamic)

    def engine(self, role: Role) -> OffloadEngine | None:
        """The engine of the model placed as `role`; None when there is none."""
        return self._engines.get(role)

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
                                    host_budget=budget)
        except HostMemoryError as error:
            key = FSDP_PREFIX[CONFIG_ROLE.get(role, role)]
            raise RunSetupError(f"{error} (keeping {format_bytes(HOST_MARGIN_BYTES)} free): place fewer groups on the "
                                f"CPU ({key}.param_offload, .offload_policy, .optimizer_offload), keep their "
                                f"gradients in bf16 ({key}.offload_grad_dtype) or use a machine with more memory"
                                ) from None
        host = engine.host_bytes()
        self._host_pending += host["gradients"] + host["optimizer"]
        self._engines[role] = engine
        if dynamic.enabled and self.probe is not None:
            self._dynamic.append(engine)
        elif dynamic.enabled:
            self.warn(f"dynamic offload of the {role} needs a GPU to measure memory on; on {self.device} its "
                      "transformer layers stay where the offload policy puts them")
        return model

    def finish_placement(self) -> None:
        """Once every model is placed: bring each dynamic model's transformer layers to the GPU as
        far as they fit below the threshold, in placement order, leaving room for the groups its
        rollout keeps there (per-phase placement)."""
        probe = self.probe
        if probe is None:
            return  # no GPU to measure: no layer moves dynamically (`place`)
        for engine in self._dynamic:
            if engine.placements["transformer"] != "gpu":
                continue  # placed on the CPU: dynamic offload only ever takes layers off the GPU
            total = len(engine.transformer_units)
            fit = layers_that_fit(probe, threshold=self.settings().gpu_memory_threshold,
                                  layer_bytes=engine.layer_bytes, total_layers=total,
                                  reserve_bytes=sum(engine.stageable_bytes().values()))
            engine.set_transformer_layers_on_gpu(fit)
            engine.moves = {"to_cpu": 0, "to_gpu": 0}  # where it starts, not a move
            if engine.layers_on_gpu < total:
                self.log(f"dynamic offload: the {engine.role} starts with {engine.layers_on_gpu} of {total} "
                         f"transformer layers on the GPU (GPU memory threshold "
                         f"{self.settings().gpu_memory_threshold})")

    def enable_embedding_cache(self, settings: EmbeddingCacheConfig) -> EmbeddingCache | None:
        """The device cache of the actor's most frequent embedding rows, when the config asks for
        one and the embedding is on the CPU (else there is nothing to cache: a warning says so)."""
        engine = self._engines.get("actor")
        if not settings.enabled or engine is None:
            return None
        self.embedding_cache = engine.enable_embedding_cache(cache_size=settings.cache_size,
                                                             warmup_steps=settings.warmup_steps)
        if self.embedding_cache is None:
            self.warn("actor_rollout_ref.rollout.embedding_cache.enabled is set, but the actor's embedding is on "
                      "the GPU: there is nothing to cache; set actor_rollout_ref.actor.fsdp_config."
                      "offload_policy.embedding=cpu to use it")
        return self.embedding_cache

    def for_role(self, role: Role) -> ModelMemory:
        """The side of the manager that the worker of the model placed as `role` is built with."""
        return self._roles.setdefault(role, ModelMemory(self, role))

    def summary_lines(self) -> list[str]:
        """The offload summary of every model, each line after its role ("actor: Embedding: ...")."""
        return [f"{engine.role}: {line}" for engine in self._engines.values() for line in engine.summary_lines()]

    @property
    def moves_layers(self) -> bool:
        """Whether any model's transformer layers move with memory pressure (safe points matter)."""
        return bool(self._dynamic)

    # --------------------------------------------------------------------------------- per phase

    @contextlib.contextmanager
    def placed_for(self, phase: str, role: Role) -> Iterator[None]:
        """Run a phase with the groups of the model placed as `role` placed for it
        (OffloadEngine.placed_for) within the memory budget: below the live GPU memory threshold,
        counting what is in use now. No model of that role: nothing to place. A rollout first gives
        the room of the other models' dynamic layers to the rolling model's (`_layers_for_rollout`)."""
        engine = self._engines.get(role)
        layers = self._layers_for_rollout(role) if phase == "rollout" else contextlib.nullcontext()
        with layers:
            if engine is None or not engine.stageable_bytes() or self.probe is None:
                yield  # nothing on the CPU to keep, or no GPU to keep it on
                return
            with self._staged_within_budget(engine, phase):
                yield

    @contextlib.contextmanager
    def _layers_for_rollout(self, role: Role) -> Iterator[None]:
        """While the rollout decodes, the rolling model's streamed layers cross the bus at every token,
        and the other models' are not used at all: those go off the GPU (down to the live minimum) and
        the rolling model's come on as far as they fit below the threshold less the hysteresis, leaving
        room for the head and embedding its rollout keeps. Measured on an H200 (benchmarks/README.md,
        e2e_bench ppo3b): 20 of the actor's 36 layers streamed at 128 tokens cost 7 of a 17 s step,
        while the critic held its layers; moving them costs one copy each way (a few GB: tens of ms).
        Afterwards every model gets its layers back; the swap is not counted as a dynamic-offload move."""
        rolling = self._engines.get(role)
        settings = self.settings()
        if (rolling is None or rolling not in self._dynamic or self.probe is None
                or not settings.dynamic_offload_enabled):
            yield
            return
        saved = {engine: engine.layers_on_gpu for engine in self._dynamic}
        self._uncounted(lambda: self._swap_layers_in(rolling, settings))
        try:
            yield
        finally:
            def restore() -> None:
                for engine in sorted(saved, key=lambda engine: engine is not rolling):  # free room, then take it
                    engine.set_transformer_layers_on_gpu(saved[engine])

            self._uncounted(restore)

    def _uncounted(self, move: Callable[[], None]) -> None:
        """Run `move` without counting its layer moves as dynamic offload's (the step metrics' moves)."""
        counted = {engine: dict(engine.moves) for engine in self._dynamic}
        move()
        for engine, moves in counted.items():
            engine.moves = moves

    def _swap_layers_in(self, rolling: OffloadEngine, settings: DynamicSettings) -> None:
        for engine in self._dynamic:
            if engine is not rolling:
                engine.set_transformer_layers_on_gpu(min(engine.layers_on_gpu, settings.min_transformer_layers_on_gpu))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        assert self.probe is not None
        used, total = self.probe()
        room = (settings.gpu_memory_threshold - HYSTERESIS) * total - used - sum(rolling.stageable_bytes().values())
        fit = int(room // rolling.layer_bytes) if rolling.layer_bytes > 0 else len(rolling.transformer_units)
        wanted = min(len(rolling.transformer_units), rolling.layers_on_gpu + max(0, fit))
        if wanted != rolling.layers_on_gpu:
            rolling.set_transformer_layers_on_gpu(wanted)
        key = (rolling.role, "rollout layers")
        placed = tuple(engine.layers_on_gpu for engine in self._dynamic)
        if self._staged_logged.get(key) != placed:
            self._staged_logged[key] = placed
            others = [engine.role for engine in self._dynamic if engine is not rolling]
            self.log(f"per-phase placement: rollout keeps {rolling.layers_on_gpu} of the {rolling.role}'s "
                     f"{len(rolling.transformer_units)} transformer layers on the GPU"
                     + (f" (in the room of {' and '.join(f'the {other}' + chr(39) + 's' for other in others)} "
                        "layers, which the rollout does not use)" if others else ""))

    @contextlib.contextmanager
    def _staged_within_budget(self, engine: OffloadEngine, phase: str) -> Iterator[None]:
        assert self.probe is not None
        used, total = self.probe()
        budget = int(self.settings().gpu_memory_threshold * total) - used
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
                     f"the GPU memory threshold {self.settings().gpu_memory_threshold} to keep them on the GPU)")

    # ---------------------------------------------------------------------------------- run time

    def safe_point(self) -> None:
        """Between micro-batches and decode chunks, and before a step (nothing in flight): move
        transformer layers off the GPU while the memory in use is over the live threshold. None comes
        back here: the memory in use between two passes is not the step's peak (end_step)."""
        if self._dynamic and self.probe is not None:
            used, total = self.probe()
            self._move_layers(plan_layers(self._layers(), used=used, total=total, settings=self.settings(),
                                          bring_back=False))

    def end_step(self) -> None:
        """At the end of a step, before its peak memory statistics are reset (memory_metrics): place
        the layers for the step's peak, bringing back as many as fit below the threshold less the
        hysteresis, or moving enough off to get under it. A step whose peak lies between the two
        moves nothing: that is where the placement settles."""
        if self._dynamic and self.probe is not None:
            _, total = self.probe()
            self._move_layers(plan_layers(self._layers(), used=self.peak_probe(), total=total,
                                          settings=self.settings(), bring_back=True))

    def _layers(self) -> list[ModelLayers]:
        return [ModelLayers(engine.role, engine.layers_on_gpu, len(engine.transformer_units), engine.layer_bytes)
                for engine in self._dynamic]

    def _move_layers(self, decisions: dict[str, Decision]) -> None:
        for role, decision in decisions.items():
            engine = self._engines[role]
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
        settings = self.settings()
        relieved = relieve_layers(self._layers(), settings.min_transformer_layers_on_gpu) \
            if settings.dynamic_offload_enabled else {}
        for role, count in relieved.items():
            engine = self._engines[role]
            engine.set_transformer_layers_on_gpu(count)
            self.log(f"out of GPU memory: {role} keeps {engine.layers_on_gpu} transformer layers on GPU, retrying")
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
        model's) and their moves, since the last call; the embedding cache's hit ratio."""
        engines = self._engines.values()
        result = {"perf/oom_recoveries": float(self._recoveries),
                  "offload/transformer_layers_on_gpu": sum(engine.layers_on_gpu for engine in engines),
                  **{f"offload/{engine.role}/transformer_layers_on_gpu": engine.layers_on_gpu for engine in engines}}
        self._recoveries = 0
        moves = {direction: sum(engine.moves[direction] for engine in engines) for direction in ("to_cpu", "to_gpu")}
        for direction, total in moves.items():
            result[f"offload/moves_{direction}"] = total - self._moves_reported[direction]
        self._moves_reported = moves
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

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        engine = self.manager.engine(self.role)
        return engine.accumulating() if engine is not None else contextlib.nullcontext()
