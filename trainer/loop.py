"""The RL trainer: PPO and GRPO share this pipeline and differ only in advantage and loss.

One step reads top to bottom in `train_step`: generate, score, old log-probs, reference
log-probs, values, advantages, critic update, actor update.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import psutil
import torch

from trainer.algorithms import apply_kl_penalty, build_kl_controller, get_advantage_estimator
from trainer.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_partial_checkpoints,
    save_checkpoint,
)
from trainer.config import FSDPConfig, RunConfig, dump_config
from trainer.config.live import LiveSettings, initial_live_settings
from trainer.config.messages import (
    CheckpointMessage,
    CheckpointNowMessage,
    DownMessage,
    Phase,
    PhaseMessage,
    SettingsAckMessage,
    SettingsMessage,
    StepMessage,
    StopMessage,
    UpMessage,
)
from trainer.config.schema import FSDP_PREFIX
from trainer.data import PromptRecord, PromptSampler, load_records
from trainer.metrics import (
    MetricsLog,
    StepTimer,
    data_metrics,
    memory_metrics,
    reduce_metrics,
    throughput_metrics,
)
from trainer.models import load_critic, load_policy, load_reward_model, load_tokenizer, torch_dtype
from trainer.offload import (
    HostMemoryError,
    OffloadEngine,
    attach_offload,
    format_bytes,
    offload_engine,
    offload_message,
)
from trainer.offload.dynamic import (
    DynamicLayers,
    DynamicOffloadController,
    MemoryProbe,
    device_memory_probe,
    layers_that_fit,
)
from trainer.offload.embedding_cache import EmbeddingCache
from trainer.randomness import rng_state, seed_everything, set_rng_state
from trainer.reporting import StepObserver
from trainer.rewards import resolve_compute_score
from trainer.rewards.manager import ModelReward, RewardFunction, RuleReward, place_on_last_token
from trainer.rollout.batch import RolloutBatch
from trainer.rollout.hf_rollout import HFRollout
from trainer.rollout.prompts import encode_prompts
from trainer.workers.actor import Actor, compute_log_probs
from trainer.workers.critic import Critic
from trainer.workers.recovery import Recovery, run_in_pieces


class TelemetryLink(Protocol):
    """The trainer's side of the daemon connection (trainer/telemetry.py): never blocks."""

    def send(self, message: UpMessage) -> None: ...

    def poll(self) -> list[DownMessage]: ...


CONFIG_ROLE = {"reward": "reward_model"}  # the engine's role name -> the config's
HOST_MARGIN_BYTES = 2 << 30
"""Host memory a run leaves free beside what its offload placements need (the process, data, staging)."""


class RunSetupError(Exception):
    """The run cannot start as configured; the message names the setting to change."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RunSetupError("trainer.device: cuda, but no CUDA GPU is visible; set trainer.device=auto or cpu")
    return torch.device(name)


def count_total_steps(config: RunConfig, steps_per_epoch: int) -> int:
    """trainer.total_training_steps when set (verl: it wins), else epochs x steps per epoch."""
    return config.trainer.total_training_steps or steps_per_epoch * config.trainer.total_epochs


class Trainer:
    """Builds the models from the config and runs the RL loop, checkpointing as it goes."""

    def __init__(self, config: RunConfig, *, observers: Sequence[StepObserver] = (), log=print, warn=print,
                 telemetry: TelemetryLink | None = None, memory_probe: MemoryProbe | None = None,
                 host_available: Callable[[], int] | None = None):
        self.config = config
        self.telemetry = telemetry
        self.live_settings: LiveSettings = initial_live_settings(config)
        self.settings_listeners: list[Callable[[LiveSettings], None]] = []
        self.run_dir = Path(config.trainer.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # The config that actually ran, every default explicit, beside its results.
        (self.run_dir / "config.yaml").write_text(dump_config(config), encoding="utf-8")
        self.observers = list(observers)
        self.log, self.warn = log, warn
        if config.trainer.cpu_threads is not None:
            torch.set_num_threads(config.trainer.cpu_threads)
        self.device = resolve_device(config.trainer.device)
        seed_everything(config.trainer.seed)
        self.tokenizer = load_tokenizer(config.actor_rollout_ref.model.tokenizer_path
                                        or config.actor_rollout_ref.model.path,
                                        trust_remote_code=config.actor_rollout_ref.model.trust_remote_code)
        self.records = load_records(config.data.train_files, config.data.prompt_key)
        self.val_records = load_records(config.data.val_files, config.data.prompt_key) if config.data.val_files else []
        try:
            self.sampler = PromptSampler(len(self.records), config.data.train_batch_size,
                                         shuffle=config.data.shuffle, seed=config.data.seed)
        except ValueError as error:
            raise RunSetupError(str(error)) from None
        self.total_steps = count_total_steps(config, self.sampler.steps_per_epoch)
        self.offload_engines: list[OffloadEngine] = []
        # Engines whose transformer layers move with memory pressure, each with its controller. All of
        # them follow the live settings (initialised from the actor's dynamic_offload section).
        self.dynamic_offload: list[DynamicLayers] = []
        self.memory_probe = memory_probe or (device_memory_probe(self.device) if self.device.type == "cuda"
                                             else None)
        self._moves_reported = {"to_cpu": 0, "to_gpu": 0}
        self.host_available = host_available or (lambda: psutil.virtual_memory().available)
        self._host_pending = 0  # host bytes placed engines will allocate once they train
        # Out-of-memory errors recovered from in the no-grad phases (the updates count their own).
        self.recovery = Recovery(relieve_memory=self.relieve_memory)
        self._staged_logged: dict[tuple[str, str], tuple[str, ...]] = {}
        self._build_models()
        self.reward_fn = self._build_reward()
        self._fit_dynamic_layers()
        self.embedding_cache = self._build_embedding_cache()
        for worker in (self.actor, self.critic):
            if worker is not None:
                worker.safe_point, worker.relieve_memory = self.offload_safe_point, self.relieve_memory
                worker.recovery = self.recovery
        if isinstance(self.reward_fn, ModelReward):
            self.reward_fn.recovery = self.recovery
        # Dynamic offload acts between decode chunks too.
        self.rollout.safe_point = self.offload_safe_point if self.dynamic_offload else None
        self.advantage_fn = get_advantage_estimator(config.algorithm.adv_estimator)
        kl = config.algorithm.kl_ctrl
        self.kl_controller = build_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.metrics_log = MetricsLog(self.run_dir / "metrics.jsonl")
        self.step = 0
        self._resumed = False
        self._checkpoint_requested = False
        self._saved_at = 0
        self._summary_sent = False
        self.stop_requested = threading.Event()

    # ------------------------------------------------------------------------------------- build

    def _build_models(self) -> None:
        config = self.config
        model_config = config.actor_rollout_ref.model
        seed = config.trainer.seed
        rollout = config.actor_rollout_ref.rollout

        def policy(fsdp_config, gradient_checkpointing: bool):
            return load_policy(model_config.path, self.tokenizer, dtype=torch_dtype(fsdp_config.model_dtype),
                               seed=seed, override_config=model_config.override_config,
                               gradient_checkpointing=gradient_checkpointing,
                               trust_remote_code=model_config.trust_remote_code)

        actor_config = config.actor_rollout_ref.actor
        actor_model = self._place(policy(actor_config.fsdp_config, model_config.enable_gradient_checkpointing),
                                  actor_config.fsdp_config, "actor")
        self.actor = Actor(actor_model,
                           actor_config, temperature=rollout.temperature, rollout_n=rollout.n,
                           log_prob_micro_batch_size=rollout.log_prob_micro_batch_size_per_gpu,
                           total_steps=self.total_steps, seed=seed)
        self.rollout = HFRollout(self.actor.model, self.tokenizer, rollout, config.data.max_response_length)
        self.reference = None
        if config.use_reference:
            reference = policy(config.actor_rollout_ref.ref.fsdp_config, False).eval().requires_grad_(False)
            self.reference = self._place(reference, config.actor_rollout_ref.ref.fsdp_config, "ref")
        self.critic = None
        if config.use_critic:
            critic = config.critic
            model = load_critic(critic.model.path, self.tokenizer, dtype=torch_dtype(critic.fsdp_config.model_dtype),
                                seed=seed, override_config=critic.model.override_config or model_config.override_config,
                                gradient_checkpointing=critic.model.enable_gradient_checkpointing,
                                trust_remote_code=critic.model.trust_remote_code)
            self.critic = Critic(self._place(model, critic.fsdp_config, "critic"), critic, rollout_n=rollout.n,
                                 forward_micro_batch_size=rollout.log_prob_micro_batch_size_per_gpu,
                                 total_steps=self.total_steps)

    def _place(self, model: torch.nn.Module, fsdp_config: FSDPConfig, role: str) -> torch.nn.Module:
        """Put each module group where the policy says (the engine streams the CPU-resident ones).

        With dynamic offload its transformer layers start streamed; once every model is placed
        they come to the GPU as far as they fit (`_fit_dynamic_layers`), so a model the GPU cannot
        hold whole still starts, and the models placed after it still find their room."""
        dynamic = fsdp_config.dynamic_offload
        layers_on_gpu = 0 if dynamic.enabled and self.memory_probe is not None else None
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
        self.offload_engines.append(engine)
        if dynamic.enabled and self.memory_probe is not None:
            controller = DynamicOffloadController(self.memory_probe, lambda: self.live_settings)
            self.dynamic_offload.append(DynamicLayers(engine, controller, log=self.log))
        elif dynamic.enabled:
            self.warn(f"dynamic offload of the {role} needs a GPU to measure memory on; on {self.device} its "
                      "transformer layers stay where the offload policy puts them")
        return model

    def _fit_dynamic_layers(self) -> None:
        """Bring each dynamic model's transformer layers to the GPU as far as they fit below the
        threshold, leaving room for the groups its rollout keeps there (per-phase placement)."""
        for dynamic in self.dynamic_offload:
            engine = dynamic.engine
            if engine.placements["transformer"] != "gpu":
                continue  # placed on the CPU: dynamic offload only ever takes layers off the GPU
            total = len(engine.transformer_units)
            fit = layers_that_fit(self.memory_probe, threshold=self.live_settings.gpu_memory_threshold,
                                  layer_bytes=engine.layer_bytes, total_layers=total,
                                  reserve_bytes=sum(engine.stageable_bytes().values()))
            engine.set_transformer_layers_on_gpu(fit)
            engine.moves = {"to_cpu": 0, "to_gpu": 0}  # where it starts, not a move
            if engine.layers_on_gpu < total:
                self.log(f"dynamic offload: the {engine.role} starts with {engine.layers_on_gpu} of {total} "
                         f"transformer layers on the GPU (GPU memory threshold "
                         f"{self.live_settings.gpu_memory_threshold})")

    def _build_embedding_cache(self) -> EmbeddingCache | None:
        settings = self.config.actor_rollout_ref.rollout.embedding_cache
        if not settings.enabled:
            return None
        cache = offload_engine(self.actor.model).enable_embedding_cache(cache_size=settings.cache_size,
                                                                        warmup_steps=settings.warmup_steps)
        if cache is None:
            self.warn("actor_rollout_ref.rollout.embedding_cache.enabled is set, but the actor's embedding is on "
                      "the GPU: there is nothing to cache; set actor_rollout_ref.actor.fsdp_config."
                      "offload_policy.embedding=cpu to use it")
        return cache

    def _build_reward(self) -> RewardFunction:
        config = self.config
        if not config.reward_model.enable:
            function = config.custom_reward_function
            return RuleReward(self.tokenizer, resolve_compute_score(function.path, function.name))
        network = config.reward_model.model
        tokenizer = load_tokenizer(network.tokenizer_path or network.path, trust_remote_code=network.trust_remote_code)
        model = load_reward_model(network.path, tokenizer, dtype=torch_dtype(network.fsdp_config.model_dtype),
                                  seed=config.trainer.seed, trust_remote_code=network.trust_remote_code)
        return ModelReward(self._place(model, network.fsdp_config, "reward"), self.tokenizer, tokenizer,
                           micro_batch_size=config.reward_model.micro_batch_size_per_gpu,
                           max_length=config.data.max_prompt_length + config.data.max_response_length)

    # -------------------------------------------------------------------------------------- loop

    def fit(self) -> None:
        """Train until total steps, or until a stop is requested (then checkpoint and return)."""
        if not self._resumed:
            self.resume()
        if self.step >= self.total_steps:
            self.log(f"nothing to do: the run is complete at step {self.step}/{self.total_steps}; to train "
                     "again choose another trainer.experiment_name, or raise trainer.total_training_steps")
            return
        self._saved_at = self.step
        while True:
            self.handle_control_messages()
            if self._checkpoint_requested and self._saved_at != self.step:
                self.save()
            self._checkpoint_requested = False
            if self.step >= self.total_steps or self.stop_requested.is_set():
                break
            self.offload_safe_point()
            records = [self.records[index] for index in self.sampler.next_batch()]
            metrics = self.train_step(records)
            self.step += 1
            self._record_step({**metrics, **self._maybe_validate()})
            if self.config.trainer.save_freq > 0 and self.step % self.config.trainer.save_freq == 0:
                self.save()
        if self._saved_at != self.step:
            self.save()
        if self.stop_requested.is_set() and self.step < self.total_steps:
            self.log(f"stopped at step {self.step}/{self.total_steps} on request; checkpoint saved")

    def _record_step(self, metrics: dict[str, float]) -> None:
        """metrics.jsonl, the daemon and every observer (the console) get the step's metrics."""
        self.metrics_log.append(self.step, metrics)
        self._send(StepMessage(step=self.step, metrics=metrics))
        if self.telemetry is not None:
            # The placement summary goes with the first report of each trainer process.
            self._send(offload_message(self.offload_engines, with_summary=not self._summary_sent))
            self._summary_sent = True
        for observer in self.observers:
            observer.on_step(self.step, metrics)

    def train_step(self, records: Sequence[PromptRecord]) -> dict[str, float]:
        """One RL step over a batch of prompts; returns its metrics under verl's names."""
        timer = StepTimer(self._synchronize, on_phase=self._phase)
        metrics: dict[str, float] = {}
        with timer.phase("step"):
            with timer.phase("gen"):
                batch = self.generate(records)
                if self.embedding_cache is not None:
                    self.embedding_cache.end_step()
            with timer.phase("reward"), self.placed_for("scoring", getattr(self.reward_fn, "model", None)):
                batch.token_level_scores = place_on_last_token(self.reward_fn(batch), batch.response_mask)
            with timer.phase("old_log_prob"), self.placed_for("scoring", self.actor.model):
                batch.old_log_probs = self.actor.compute_log_probs(batch)
            if self.reference is not None:
                with timer.phase("ref"), self.placed_for("scoring", self.reference):
                    batch.ref_log_probs = self._reference_log_probs(batch)
            if self.critic is not None:
                with timer.phase("values"), self.placed_for("scoring", self.critic.model):
                    batch.values = self.critic.compute_values(batch)
            with timer.phase("adv"):
                metrics.update(self.compute_advantages(batch))
            if self.critic is not None:
                with timer.phase("update_critic"), self.placed_for("training", self.critic.model):
                    metrics.update(reduce_metrics(self.critic.update(batch)))
            with timer.phase("update_actor"), self.placed_for("training", self.actor.model):
                metrics.update(reduce_metrics(self.actor.update(batch)))
        metrics.update(timer.metrics())
        metrics.update(data_metrics(batch, response_length=self.config.data.max_response_length,
                                    prompt_length=self.config.data.max_prompt_length))
        metrics.update(throughput_metrics(batch, timer.seconds["step"]))
        metrics.update(memory_metrics(self.device))
        metrics.update(self._offload_step_metrics(metrics))
        hit_ratio = self.embedding_cache.take_hit_ratio() if self.embedding_cache is not None else None
        if hit_ratio is not None:
            metrics["rollout/embedding_cache_hit_ratio"] = hit_ratio
        metrics["training/epoch"] = self.sampler.epoch
        return metrics

    # -------------------------------------------------------------------------- dynamic offload

    def offload_safe_point(self) -> None:
        """Between steps, micro-batches and decode chunks (nothing in flight): move transformer
        layers as the memory in use and the live settings say."""
        for dynamic in self.dynamic_offload:
            dynamic.safe_point()

    @contextlib.contextmanager
    def placed_for(self, phase: str, model: torch.nn.Module | None) -> Iterator[None]:
        """Run a phase with `model`'s groups placed for it (OffloadEngine.placed_for) within the
        memory budget: below the live GPU memory threshold, counting what is in use now."""
        engine = offload_engine(model) if model is not None else None
        if engine is None or not engine.stageable_bytes() or self.memory_probe is None:
            yield  # nothing on the CPU to keep, or no GPU to keep it on
            return
        used, total = self.memory_probe()
        budget = int(self.live_settings.gpu_memory_threshold * total) - used
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
                     f"the GPU memory threshold {self.live_settings.gpu_memory_threshold} to keep them on the GPU)")

    def relieve_memory(self) -> bool:
        """After a CUDA out-of-memory error: move half the layers above the minimum to the CPU, else
        drop the groups a phase keeps on the GPU (they stream for the rest of it). False when
        nothing could be freed (then the micro-batch is split instead)."""
        minimum = self.live_settings.min_transformer_layers_on_gpu
        moved = False
        for engine in (dynamic.engine for dynamic in self.dynamic_offload):
            spare = engine.layers_on_gpu - minimum
            if spare > 0 and self.live_settings.dynamic_offload_enabled:
                engine.set_transformer_layers_on_gpu(engine.layers_on_gpu - max(1, spare // 2))
                self.log(f"out of GPU memory: {engine.role} keeps {engine.layers_on_gpu} transformer layers "
                         "on GPU, retrying")
                moved = True
        if moved:
            return True
        for engine in self.offload_engines:
            dropped = engine.drop_kept()
            if dropped:
                self.log(f"out of GPU memory: the {engine.role}'s {' and '.join(dropped)} stream for the rest of "
                         f"the {engine.phase} phase, retrying")
                moved = True
        return moved

    def _offload_step_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Transformer layers on the GPU (all models, and each model's), moves in this step and
        out-of-memory errors recovered from."""
        recovered = sum(metrics.pop(key, 0.0) for key in ("actor/oom_recoveries", "critic/oom_recoveries"))
        recovered += self.recovery.take()
        result = {"perf/oom_recoveries": recovered,
                  "offload/transformer_layers_on_gpu": sum(engine.layers_on_gpu for engine in self.offload_engines),
                  **{f"offload/{engine.role}/transformer_layers_on_gpu": engine.layers_on_gpu
                     for engine in self.offload_engines}}
        moves = {direction: sum(engine.moves[direction] for engine in self.offload_engines)
                 for direction in ("to_cpu", "to_gpu")}
        for direction, total in moves.items():
            result[f"offload/moves_{direction}"] = total - self._moves_reported[direction]
        self._moves_reported = moves
        return result

    # ------------------------------------------------------------------------------------ phases

    def generate(self, records: Sequence[PromptRecord], rollout: HFRollout | None = None,
                 n: int | None = None) -> RolloutBatch:
        """Sample n responses per prompt; the batch holds prompt i's responses at i*n ... i*n + n - 1."""
        n = self.config.actor_rollout_ref.rollout.n if n is None else n
        repeated = [record for record in records for _ in range(n)]
        prompt_ids, prompt_mask = encode_prompts([record.prompt for record in repeated], self.tokenizer,
                                                 max_length=self.config.data.max_prompt_length,
                                                 truncation=self.config.data.truncation)
        prompt_ids, prompt_mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        rollout = rollout or self.rollout
        with self.placed_for("rollout", rollout.model):
            # A batch that runs out of device memory is retried once layers moved off, or in halves.
            pieces = run_in_pieces(lambda first, count: rollout.generate(prompt_ids[first:first + count],
                                                                         prompt_mask[first:first + count]),
                                   len(repeated), len(repeated), recovery=self.recovery, models=[rollout.model])
        response_ids = torch.cat([ids for ids, _ in pieces])
        response_mask = torch.cat([mask for _, mask in pieces])
        group_index = torch.arange(len(records), device=self.device).repeat_interleave(n)
        return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                            response_mask=response_mask, group_index=group_index, records=repeated)

    def _reference_log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        return compute_log_probs(self.reference, batch,
                                 micro_batch_size=self.config.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu,
                                 temperature=self.config.actor_rollout_ref.rollout.temperature,
                                 recovery=self.recovery)

    def compute_advantages(self, batch: RolloutBatch) -> dict[str, float]:
        """Token rewards (less the KL penalty when it is in the reward), then advantages and returns."""
        algorithm = self.config.algorithm
        metrics = {}
        if algorithm.use_kl_in_reward:
            batch.token_level_rewards, mean_kl = apply_kl_penalty(
                batch.token_level_scores, batch.old_log_probs, batch.ref_log_probs, batch.response_mask,
                kl_coef=self.kl_controller.value, estimator=algorithm.kl_penalty)
            metrics = {"actor/reward_kl_penalty": float(mean_kl),
                       "actor/reward_kl_penalty_coeff": self.kl_controller.value}
            self.kl_controller.update(float(mean_kl), n_steps=len(batch))
        else:
            batch.token_level_rewards = batch.token_level_scores
        if algorithm.adv_estimator == "gae":
            batch.advantages, batch.returns = self.advantage_fn(
                batch.token_level_rewards, batch.values, batch.response_mask, gamma=algorithm.gamma, lam=algorithm.lam)
        else:
            batch.advantages, batch.returns = self.advantage_fn(
                batch.token_level_rewards, batch.response_mask, batch.group_index,
                norm_adv_by_std=algorithm.norm_adv_by_std_in_grpo)
        return metrics

    def _maybe_validate(self) -> dict[str, float]:
        frequency = self.config.trainer.test_freq
        due = frequency > 0 and (self.step % frequency == 0 or self.step == self.total_steps)
        return self.validate() if due and self.val_records else {}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Greedy responses to the validation prompts, mean score per data source (verl's val-core keys)."""
        greedy = HFRollout(self.actor.model, self.tokenizer,
                           self.config.actor_rollout_ref.rollout.model_copy(update={"do_sample": False}),
                           self.config.data.max_response_length)
        scores: dict[str, list[float]] = {}
        size = self.config.data.val_batch_size
        for start in range(0, len(self.val_records), size):
            batch = self.generate(self.val_records[start:start + size], rollout=greedy, n=1)
            for record, score in zip(batch.records, self.reward_fn(batch).tolist(), strict=True):
                scores.setdefault(record.data_source, []).append(score)
        return {f"val-core/{source}/reward/mean@1": sum(values) / len(values) for source, values in scores.items()}

    # ------------------------------------------------------------------------------- checkpoints

    def _models(self) -> dict[str, torch.nn.Module]:
        models = {"actor": self.actor.model}
        if self.critic is not None:
            models["critic"] = self.critic.model
        return models

    def save(self) -> Path:
        self._phase("save_checkpoint")
        state = {
            "step": self.step,
            "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict() if self.critic is not None else None,
            "sampler": self.sampler.state_dict(),
            "kl_controller": self.kl_controller.state_dict(),
            "rng": rng_state(),
        }
        path = save_checkpoint(self.run_dir, self.step, self._models(), state,
                               keep=self.config.trainer.max_ckpt_to_keep)
        self._saved_at = self.step
        self.log(f"checkpoint saved: {path}")
        self._send(CheckpointMessage(step=self.step, path=str(path)))
        return path

    def resume(self) -> None:
        """Continue from the checkpoint resume_mode points at, or start at step 0."""
        mode = self.config.trainer.resume_mode
        self._resumed = True
        remove_partial_checkpoints(self.run_dir)
        if mode == "disable":
            if list_checkpoints(self.run_dir):
                raise RunSetupError(f"trainer.resume_mode: disable, but {self.run_dir} already holds checkpoints; "
                                    "set trainer.resume_mode=auto to continue that run, or choose another "
                                    "trainer.experiment_name")
            path = None
        elif mode == "resume_path":
            path = Path(self.config.trainer.resume_from_path)
        else:
            path = latest_checkpoint(self.run_dir)
        if path is None:
            self.metrics_log.truncate_after(0)
            return
        self._restore(path)

    def _restore(self, path: Path) -> None:
        try:
            state = load_checkpoint(path, self._models())
            self.actor.load_state_dict(state["actor"])
            if self.critic is not None:
                self.critic.load_state_dict(state["critic"])
            self.sampler.load_state_dict(state["sampler"])
        except ValueError as error:
            raise CheckpointError(f"cannot resume from {path}: {error}") from None
        self.kl_controller.load_state_dict(state["kl_controller"])
        set_rng_state(state["rng"])
        self.step = state["step"]
        self.metrics_log.truncate_after(self.step)
        self.log(f"resumed from {path} at step {self.step}")

    # ------------------------------------------------------------------------------------ control

    def handle_control_messages(self) -> None:
        """The safe point between steps: apply live settings, note checkpoint and stop requests."""
        if self.telemetry is None:
            return
        for message in self.telemetry.poll():
            self._dispatch(message)

    def receive_initial_settings(self, timeout_s: float = 5.0) -> bool:
        """Wait (once, before the first step) for the daemon's current settings, so a change made
        before a restart holds from the restarted trainer's first step. False if none came."""
        deadline = time.monotonic() + timeout_s
        while self.telemetry is not None and time.monotonic() < deadline:
            messages = self.telemetry.poll()
            for message in messages:
                self._dispatch(message)
            if any(isinstance(message, SettingsMessage) for message in messages):
                return True
            time.sleep(0.01)
        return False

    def _dispatch(self, message: DownMessage) -> None:
        if isinstance(message, SettingsMessage):
            self.apply_live_settings(message.version, message.values)
        elif isinstance(message, CheckpointNowMessage):
            self._checkpoint_requested = True
        elif isinstance(message, StopMessage):
            self.request_stop()

    def apply_live_settings(self, version: int, values: LiveSettings) -> None:
        """Take the daemon's settings from the next step on, and acknowledge with that step."""
        self.live_settings = values
        for listener in self.settings_listeners:
            listener(self.live_settings)
        self._send(SettingsAckMessage(version=version, step=self.step + 1, values=self.live_settings))

    def _phase(self, name: str) -> None:
        if name != "step":  # the timer's whole-step span, not a phase
            self._send(PhaseMessage(step=self.step + 1, phase=Phase(name)))

    def _send(self, message: UpMessage) -> None:
        if self.telemetry is not None:
            self.telemetry.send(message)

    def request_stop(self) -> None:
        """Checkpoint at the end of the current step and return from fit(). Safe from a signal handler."""
        self.stop_requested.set()

    def install_signal_handlers(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self.request_stop())

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
