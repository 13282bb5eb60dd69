"""The RL trainer: PPO and GRPO share this pipeline and differ only in advantage and loss.

One step reads top to bottom in `train_step`: generate, score, old log-probs, reference
log-probs, values, advantages, critic update, actor update.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import torch

from trainer.algorithms import apply_kl_penalty, build_kl_controller, get_advantage_estimator
from trainer.algorithms.functional import WHITEN_EPSILON
from trainer.checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    FinalCheckpointError,
    is_sharded_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_sharded_into_sharded,
    load_sharded_into_single,
    load_single_into_sharded,
    load_trainer_state,
    parameter_names,
    remove_partial_checkpoints,
    save_checkpoint,
    save_sharded_checkpoint,
    save_weights,
)
from trainer.config import BUILTIN_PREFIX, FSDPConfig, RunConfig, dump_config
from trainer.config.live import LiveSettings, initial_live_settings
from trainer.config.messages import (
    CheckpointMessage,
    CheckpointNowMessage,
    DownMessage,
    HeartbeatMessage,
    Phase,
    PhaseMessage,
    RankReport,
    RanksMessage,
    Role,
    SettingsAckMessage,
    SettingsMessage,
    StepMessage,
    StopMessage,
    UpMessage,
)
from trainer.data import PromptRecord, PromptSampler, load_records, rank_share
from trainer.data.checks import check_prompts, drop_overlong_prompts
from trainer.distributed.host_adamw import HostAdamW
from trainer.distributed.layer_moves import ShardedLayers
from trainer.distributed.ranks import Ranks, host_threads_per_rank, resolve_device
from trainer.distributed.shard_copies import watch_shard_copies
from trainer.distributed.sharding import WHOLE_WEIGHTS_SHARE, Sharded, plain_forwards, shard_model, whole_weights
from trainer.errors import RunSetupError
from trainer.memory import MemoryManager, Model, ModelMemory, default_memory_probe, host_memory_available
from trainer.metrics import (
    MetricsLog,
    StepTimer,
    combine_rank_metrics,
    data_metrics,
    device_peak_flops,
    memory_metrics,
    mfu_metrics,
    rank_reduction,
    reduce_metrics,
    throughput_metrics,
    timing_per_token_metrics,
)
from trainer.models import load_critic, load_policy, load_reward_model, load_tokenizer, torch_dtype
from trainer.models.lora import LoraSettings, describe_adapter, with_adapter
from trainer.offload import OffloadEngine, format_bytes, offload_message
from trainer.offload.copies import CopyLog
from trainer.offload.dynamic import MemoryProbe
from trainer.offload.groups import parameter_groups
from trainer.randomness import restore_rank_streams, rng_state, seed_everything
from trainer.reporting import StepObserver
from trainer.rewards import resolve_compute_score
from trainer.rewards.manager import ModelReward, RewardFunction, RuleReward, place_on_last_token
from trainer.rollout.batch import RolloutBatch
from trainer.rollout.budget import KVCacheShape, over_budget_message, rows_within_budget
from trainer.rollout.hf_rollout import HFRollout
from trainer.rollout.prompts import encode_prompts
from trainer.workers.actor import Actor, compute_log_probs
from trainer.workers.critic import Critic
from trainer.workers.optimization import publish_pending
from trainer.workers.recovery import run_in_pieces
from trainer.workers.sequence_split import SequenceSplit


class TelemetryLink(Protocol):
    """The trainer's side of the daemon connection (trainer/telemetry.py): never blocks."""

    def send(self, message: UpMessage) -> None: ...

    def poll(self) -> list[DownMessage]: ...


HEARTBEAT_INTERVAL_S = 1.0
"""Heartbeats go to the daemon at most this often; the daemon restarts a trainer silent for daemon.hang_timeout_s."""


def count_total_steps(config: RunConfig, steps_per_epoch: int) -> int:
    """trainer.total_training_steps when set (verl: it wins), else epochs x steps per epoch."""
    return config.trainer.total_training_steps or steps_per_epoch * config.trainer.total_epochs


class Trainer:
    """Builds the models from the config and runs the RL loop, checkpointing as it goes."""

    def __init__(self, config: RunConfig, *, observers: Sequence[StepObserver] = (), log=print, warn=print,
                 telemetry: TelemetryLink | None = None, memory_probe: MemoryProbe | None = None,
                 host_available: Callable[[], int] | None = None, ranks: Ranks | None = None):
        self.config = config
        # This process's rank of the run (trainer/distributed/ranks.py); one rank unless torchrun started several.
        self.ranks = ranks or Ranks.single(resolve_device(config.trainer.device))
        self.telemetry = telemetry
        self.live_settings: LiveSettings = initial_live_settings(config)
        self.settings_listeners: list[Callable[[LiveSettings], None]] = []
        self.run_dir = Path(config.trainer.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_dir = config.trainer.checkpoint_dir  # verl's trainer.default_local_dir, when it is set
        if self.ranks.is_main:  # the config that actually ran, every default explicit, beside its results
            (self.run_dir / "config.yaml").write_text(dump_config(config), encoding="utf-8")
        self.observers = list(observers)
        self.log, self.warn = log, warn
        if config.trainer.cpu_threads is not None:
            torch.set_num_threads(config.trainer.cpu_threads)
        elif self.ranks.distributed:
            # torchrun's command line starts each rank with OMP_NUM_THREADS=1, and the launcher used as a library
            # (verl train) with every core: the host's AdamW and gradient arithmetic of optimizer_offload would run
            # on one core, or each rank would claim all of them.
            threads = host_threads_per_rank(config.trainer.n_gpus_per_node)
            torch.set_num_threads(threads)
            if self.ranks.is_main:
                self.log(f"each rank computes on the host with {threads} threads, its share of this node's cores "
                         "(trainer.cpu_threads sets it)")
        self.device = self.ranks.device
        seed_everything(config.trainer.seed)  # the same on every rank: each shards the same initial weights
        self.tokenizer = load_tokenizer(config.actor_rollout_ref.model.tokenizer_path
                                        or config.actor_rollout_ref.model.path,
                                        trust_remote_code=config.actor_rollout_ref.model.trust_remote_code)
        # The built-in rule scorers compare each response with the row's ground truth.
        builtin_scoring = not config.reward_model.enable and config.custom_reward_function.path is None
        self.records = self._filtered("data.train_files", load_records(
            config.data.train_files, config.data.prompt_key, require_ground_truth=builtin_scoring))
        self.val_records = self._filtered("data.val_files", load_records(
            config.data.val_files, config.data.prompt_key, require_ground_truth=builtin_scoring)
        ) if config.data.val_files else []
        self._check_prompts()
        try:
            self.sampler = PromptSampler(len(self.records), config.data.train_batch_size,
                                         shuffle=config.data.shuffle, seed=config.prompt_order_seed)
        except ValueError as error:
            raise RunSetupError(str(error)) from None
        self.total_steps = count_total_steps(config, self.sampler.steps_per_epoch)
        # Every model's placement; dynamic offload follows the live settings (initialised from the
        # actor's dynamic_offload section). The log and warnings go where self.log and self.warn point.
        self._sharded: dict[str, Sharded] = {}  # several ranks: how each model is sharded
        self._shard_copies: list[CopyLog] = []  # several ranks: FSDP2's copies up of each model's CPU shards
        self._whole_weights_said: dict[str, bool] = {}  # several ranks: each model's last whole_weights decision
        self.memory = MemoryManager(self.device, settings=lambda: self.live_settings,
                                    probe=memory_probe or default_memory_probe(self.device),
                                    host_available=host_available or host_memory_available,
                                    log=lambda message: self.log(message), warn=lambda message: self.warn(message))
        self._build_models()
        self.reward_fn = self._build_reward()
        self.memory.finish_placement()
        if self.ranks.distributed:  # the ranks sample their own shares of the prompts with their own streams
            # (the ranks of a sequence-parallel group share theirs, and draw the same samples from one stream)
            seed_everything(config.trainer.seed + self.ranks.dp_rank)
        # Dynamic offload acts between decode chunks too (a heartbeat goes with it).
        self.rollout = HFRollout(self.actor.model, self.tokenizer, config.actor_rollout_ref.rollout,
                                 config.data.max_response_length,
                                 safe_point=self._rollout_safe_point if self.memory.moves_layers else None,
                                 graph_safety=self.memory.engine(Role.ACTOR), synced=self.ranks.distributed,
                                 agree_active=self.ranks.count_agreement, warn=self.warn)
        self.memory.enable_embedding_cache(config.actor_rollout_ref.rollout.embedding_cache)
        self.advantage_fn = get_advantage_estimator(config.algorithm.adv_estimator)
        kl = config.algorithm.kl_ctrl
        self.kl_controller = build_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        # Only rank 0 writes the run's metrics (the run-wide ones); the others' MetricsLog is never appended to.
        self.metrics_log = MetricsLog(self.run_dir / "metrics.jsonl", warn=lambda message: self.warn(message))
        self.peak_flops = device_peak_flops(self.device)  # None: no MFU figures (a CPU, an unknown GPU)
        self.checkpoint_failures = 0  # saves that failed since the last step's metrics (checkpoint/failures)
        self._checkpoint_failing = False  # the latest save failed (checkpoint/failing)
        self._checkpoint_seconds = 0.0  # spent saving since the last step's metrics (timing_s/save_checkpoint)
        self.step = 0
        self._resumed = False
        self._checkpoint_requested = False
        self._saved_at = 0
        self._summary_sent = False
        # The mean time of the timed copies of this rank's latest offload report (None: none yet).
        self._copy_latency_mean_s: float | None = None
        self._said: set[str] = set()  # the once-a-run log lines said so far
        self._decode_memory_logged = 0.0  # GiB the static decode held when the log last said so
        self._heartbeat_at = -math.inf
        self._over_budget_warned = False  # rollout.gpu_memory_utilization leaves no room: said once
        self.stop_requested = threading.Event()
        self._stop_agreed = False  # several ranks: the stop they agreed on at the last safe point

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
        # Ulysses (trainer/workers/sequence_split.py): the policy's forwards run on this rank's sequence shards.
        policy_split = self._sequence_split(actor_config.ulysses_sequence_parallel_size,
                                            remove_padding=model_config.use_remove_padding)
        # With LoRA the adapter is in the model before the engine lays it out; self.actor_adapter (peft's
        # wrapper) disables it for the reference policy and saves it in the checkpoints.
        actor_model, self.actor_adapter = with_adapter(
            policy(actor_config.fsdp_config, model_config.enable_gradient_checkpointing),
            LoraSettings.of(model_config, "actor_rollout_ref.model"), role="actor", seed=seed)
        actor_model = self._place(actor_model, self._policy_placement(actor_config.fsdp_config), Role.ACTOR,
                                  policy_split)
        self.actor = Actor(actor_model,
                           actor_config, temperature=rollout.temperature, rollout_n=rollout.n,
                           log_prob_micro_batch_size=rollout.log_prob_micro_batch_size_per_gpu,
                           total_steps=self.total_steps, seed=seed, memory=self._worker_memory(Role.ACTOR),
                           ranks=self.ranks, sequence_split=policy_split,
                           remove_padding=model_config.use_remove_padding,
                           log_prob_max_token_len=(rollout.log_prob_max_token_len_per_gpu
                                                   if rollout.log_prob_use_dynamic_bsz else None))
        self.reference = None
        self.reference_split = policy_split  # the reference runs with the actor's degree
        if config.use_reference and self.actor_adapter is None:
            reference = policy(config.actor_rollout_ref.ref.fsdp_config, False).eval().requires_grad_(False)
            self.reference = self._place(reference, self._policy_placement(config.actor_rollout_ref.ref.fsdp_config),
                                         Role.REF, policy_split)
        self._log_adapters()
        self.critic, self.critic_adapter = None, None
        if config.use_critic:
            critic = config.critic
            model = load_critic(critic.model.path, self.tokenizer, dtype=torch_dtype(critic.fsdp_config.model_dtype),
                                seed=seed, override_config=critic.model.override_config or model_config.override_config,
                                gradient_checkpointing=critic.model.enable_gradient_checkpointing,
                                trust_remote_code=critic.model.trust_remote_code)
            model, self.critic_adapter = with_adapter(model, LoraSettings.of(critic.model, "critic.model"),
                                                      role="critic", seed=seed + 1)
            if self.critic_adapter is not None:
                self.log(describe_adapter(self.critic_adapter, "critic"))
            critic_split = self._sequence_split(critic.ulysses_sequence_parallel_size,
                                                remove_padding=critic.model.use_remove_padding)
            self.critic = Critic(self._place(model, critic.fsdp_config, Role.CRITIC, critic_split), critic,
                                 rollout_n=rollout.n,
                                 forward_micro_batch_size=rollout.log_prob_micro_batch_size_per_gpu,
                                 total_steps=self.total_steps, memory=self._worker_memory(Role.CRITIC),
                                 ranks=self.ranks, sequence_split=critic_split)

    def _sequence_split(self, degree: int, *, remove_padding: bool) -> SequenceSplit | None:
        """The sequence split of a model of Ulysses `degree` (1 or the run's, as the config checked): None for
        degree 1, whose forwards run whole sequences (its sp group's ranks repeat them). With `remove_padding`
        it splits each micro-batch's padding-free row."""
        if degree == 1:
            return None
        return SequenceSplit.of(self.ranks, self.tokenizer.pad_token_id, remove_padding=remove_padding)

    def _policy_placement(self, fsdp_config: FSDPConfig) -> FSDPConfig:
        """actor.sequence_parallel_offload: the policy's embedding and head on the CPU (FSDP2's CPUOffloadPolicy
        over all ranks), so each rank keeps and copies only its own 1/world of their rows: no rank of a
        sequence-parallel group carries the whole vocabulary's copies."""
        if not self.config.actor_rollout_ref.actor.sequence_parallel_offload:
            return fsdp_config
        policy = fsdp_config.offload_policy.model_copy(update={"embedding": "cpu", "lm_head": "cpu"})
        return fsdp_config.model_copy(update={"offload_policy": policy})

    def _place(self, model: Model, fsdp_config: FSDPConfig, role: Role,
               sequence_split: SequenceSplit | None = None) -> Model:
        """One rank: the memory manager places the model's groups (the offload engine). Several: FSDP2 shards it
        over the ranks, CPU placement through its CPUOffloadPolicy (trainer/distributed/sharding.py); with a
        `sequence_split` its attention is Ulysses' first."""
        if sequence_split is not None:
            sequence_split.prepare(model, "critic.ulysses_sequence_parallel_size" if role == Role.CRITIC
                                   else "actor_rollout_ref.actor.ulysses_sequence_parallel_size")
            ranks = self.ranks
            split = ("each micro-batch's padding-free row" if sequence_split.remove_padding else "every sequence")
            self.log(f"{role}: Ulysses sequence parallelism: each of the {ranks.sp_size} ranks of a group computes "
                     f"1/{ranks.sp_size} of {split} ({ranks.dp_size} data-parallel group(s) of the prompts); FSDP2 "
                     f"shards the model over all {ranks.world_size} ranks")
        if not self.ranks.distributed:
            return self.memory.place(model, fsdp_config, role)
        sharded = shard_model(model, fsdp_config, self.ranks, role=role, log=lambda message: self.log(message))
        self._sharded[role] = sharded
        copies = CopyLog(cuda=self.device.type == "cuda")
        watch_shard_copies(model, copies, parameter_groups(sharded.parts))
        self._shard_copies.append(copies)
        if sharded.parts.layers:
            layers = ShardedLayers(role, sharded.parts.layers, self.device, optimizer=lambda: self._optimizer_of(role))
            self.memory.add_sharded(layers, dynamic=fsdp_config.dynamic_offload.enabled
                                    and not sharded.on_cpu["transformer"])
        return model

    def _optimizer_of(self, role: str) -> torch.optim.Optimizer | None:
        """The optimizer that steps the model placed as `role` (built after it is placed); None for a frozen one."""
        worker = {Role.ACTOR: getattr(self, "actor", None), Role.CRITIC: getattr(self, "critic", None)}.get(role)
        return getattr(worker, "optimizer", None)

    def _worker_memory(self, role: Role) -> ModelMemory | None:
        """The memory manager's side for a worker; None for a sharded model, which it does not place (the
        worker's optimizer is then torch's AdamW over the local shards, and errors propagate)."""
        return None if self.ranks.distributed else self.memory.for_role(role)

    def _log_adapters(self) -> None:
        """Say what the actor's LoRA adapter trains, and that the reference policy is the actor without it."""
        if self.actor_adapter is None:
            return
        self.log(describe_adapter(self.actor_adapter, "actor"))
        if self.config.use_reference:
            ignored = " (actor_rollout_ref.ref.fsdp_config is not used)" \
                if self.config.actor_rollout_ref.ref.fsdp_config != FSDPConfig() else ""
            self.log("reference policy: the actor with its LoRA adapter disabled, no second copy of the "
                     f"weights{ignored}")

    def _filtered(self, files_key: str, records: list[PromptRecord]) -> list[PromptRecord]:
        """data.filter_overlong_prompts: the records whose prompt fits data.max_prompt_length (as verl's dataset
        filters them at load); the count dropped goes to the log."""
        data = self.config.data
        if not data.filter_overlong_prompts:
            return records
        kept = drop_overlong_prompts(records, self.tokenizer, data.max_prompt_length)
        self.log(f"data.filter_overlong_prompts: dropped {len(records) - len(kept)} of {len(records)} prompts of "
                 f"{files_key} longer than data.max_prompt_length={data.max_prompt_length} tokens")
        if not kept:
            raise RunSetupError(f"data.filter_overlong_prompts: every prompt of {files_key} is longer than "
                                f"data.max_prompt_length={data.max_prompt_length} tokens; raise it")
        return kept

    def _check_prompts(self) -> None:
        """Every prompt's length, and how much of the prompts the tokenizer knows: before any model is
        built, since the tokenizer alone is cheap and a model build is not."""
        data, model = self.config.data, self.config.actor_rollout_ref.model
        source = model.tokenizer_path or model.path
        name = (f"{source}'s built-in {len(self.tokenizer)}-token tokenizer" if source.startswith(BUILTIN_PREFIX)
                else repr(source))
        for files_key, records in (("data.train_files", self.records), ("data.val_files", self.val_records)):
            check_prompts(records, self.tokenizer, files_key=files_key, max_length=data.max_prompt_length,
                          truncation=data.truncation, tokenizer_setting="actor_rollout_ref.model.tokenizer_path",
                          tokenizer_name=name)

    def _build_reward(self) -> RewardFunction:
        config = self.config
        if not config.reward_model.enable:
            function = config.custom_reward_function
            return RuleReward(self.tokenizer, resolve_compute_score(function.path, function.name),
                              on_error=function.on_error, warn=lambda message: self.warn(message))
        network = config.reward_model.model
        tokenizer = load_tokenizer(network.tokenizer_path or network.path, trust_remote_code=network.trust_remote_code,
                                   setting="reward_model.model.tokenizer_path")
        model = load_reward_model(network.path, tokenizer, dtype=torch_dtype(network.fsdp_config.model_dtype),
                                  seed=config.trainer.seed, trust_remote_code=network.trust_remote_code)
        return ModelReward(self._place(model, network.fsdp_config, Role.REWARD), self.tokenizer, tokenizer,
                           micro_batch_size=config.reward_model.micro_batch_size_per_gpu,
                           max_length=config.data.max_prompt_length + config.data.max_response_length,
                           memory=self._worker_memory(Role.REWARD))

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
        if self.step == 0 and self.val_records and (self.config.trainer.val_before_train
                                                     or self.config.trainer.val_only):
            self._validate_before_training()
            if self.config.trainer.val_only:
                return
        while True:
            self.handle_control_messages()
            if self._checkpoint_requested and self._saved_at != self.step:
                self.save()
            self._checkpoint_requested = False
            if self.step >= self.total_steps or self._stopping():
                break
            self.memory.safe_point()
            records = [self.records[index] for index in self._share_of(self.sampler.next_batch())]
            local = self.train_step(records)
            self.step += 1
            local.update({"training/global_step": self.step, **self._maybe_validate(), **self._checkpoint_metrics()})
            self._record_step(self._run_wide(local, sequences=len(records) * self.config.actor_rollout_ref.rollout.n),
                              local=local)
            # The last step's save is the final one, below.
            if (self.config.trainer.save_freq > 0 and self.step % self.config.trainer.save_freq == 0
                    and self.step < self.total_steps):
                self.save()
        if self._saved_at != self.step:
            self.save(final=True)
        if self.stop_requested.is_set() and self.step < self.total_steps:
            self.log(f"stopped at step {self.step}/{self.total_steps} on request; checkpoint saved")

    def _validate_before_training(self) -> None:
        """trainer.val_before_train: the validation scores of the weights the run starts from, as step 0's line
        (verl logs them at global step 0 too). Only a run starting at step 0: a resumed one has trained."""
        start = time.perf_counter()
        metrics = self.validate()
        self._record_step({**metrics, "timing_s/testing": time.perf_counter() - start, "training/global_step": 0})

    def _share_of(self, batch: list[int]) -> list[int]:
        """This rank's prompts of the global batch (all of it on one rank): a slice of each actor mini-batch."""
        if not self.ranks.distributed:
            return batch
        # The ranks of a sequence-parallel group take the same share: they split its sequences instead.
        return rank_share(batch, rank=self.ranks.dp_rank, world_size=self.ranks.dp_size,
                          mini_batch_size=self.config.actor_rollout_ref.actor.ppo_mini_batch_size)

    def _run_wide(self, local: dict[str, float], *, sequences: int) -> dict[str, float]:
        """The step's metrics over every rank (the same keys; metrics.rank_reduction says how each combines)."""
        if not self.ranks.distributed:
            return local
        tokens = local.get("perf/total_num_response_tokens", 0.0)
        everyone = self.ranks.gather_objects((local, float(sequences), float(tokens), self._rank_report_figures()))
        self._report_ranks([(figures, reported) for figures, _, _, reported in everyone])
        gathered = [(figures, counted, tokens) for figures, counted, tokens, _ in everyone]
        combined = combine_rank_metrics(gathered)
        if self.ranks.sp_size > 1:
            # The ranks of a sequence-parallel group (consecutive ranks) hold the same sequences: counts and other
            # sums take each group's once; means and extremes are unchanged by the repeats.
            once = combine_rank_metrics(gathered[::self.ranks.sp_size])
            combined.update({key: value for key, value in once.items() if rank_reduction(key) == "sum"})
        return combined

    def _rank_report_figures(self) -> dict[str, float | None]:
        """What this rank adds to rank 0's report of a run of several nodes (RankReport): the mean time of its latest
        timed copies, and NVML's utilization of its GPU now. Nothing is read for a run of one node."""
        if self.config.trainer.nnodes <= 1:
            return {}
        utilization = None
        if self.device.type == "cuda":
            # torch reads it through pynvml (nvidia-ml-py, a dependency), for the GPU CUDA_VISIBLE_DEVICES maps.
            with contextlib.suppress(Exception):  # no NVML (a driver without it): the row shows no utilization
                utilization = float(torch.cuda.utilization(self.device))
        return {"copy_latency_mean_s": self._copy_latency_mean_s, "gpu_utilization_percent": utilization}

    def _report_ranks(self, every_rank: list[tuple[dict[str, float], dict[str, float | None]]]) -> None:
        """Rank 0 of a run of several nodes: every rank's own figures of the step, the mean time of its latest timed
        copies and its GPU's utilization (gathered for the run-wide metrics already) to node 0's daemon, which shows
        the other nodes' ranks beside its own and compares their copy times (RanksMessage)."""
        trainer = self.config.trainer
        if not self.ranks.is_main or trainer.nnodes <= 1 or not every_rank:
            return
        reports = [RankReport(rank=rank, local_rank=rank % trainer.n_gpus_per_node,
                              node_rank=rank // trainer.n_gpus_per_node, step=self.step,
                              gpu_memory_bytes=_bytes_of_gib(figures.get("perf/max_memory_allocated_gb")),
                              copy_latency_mean_s=reported.get("copy_latency_mean_s"),
                              gpu_utilization_percent=reported.get("gpu_utilization_percent"))
                   for rank, (figures, reported) in enumerate(every_rank)]
        self._send(RanksMessage(step=self.step, ranks=reports))

    def _record_step(self, metrics: dict[str, float], local: dict[str, float] | None = None) -> None:
        """metrics.jsonl, the daemon and every observer (the console) get the step's metrics: rank 0 the
        run-wide `metrics`; another rank sends its `local` figures to the daemon and its own log, and writes
        no metrics.jsonl."""
        if not self.ranks.is_main:
            metrics = metrics if local is None else local
        for key, value in metrics.items():
            if key.endswith("skipped_steps") and value > 0:
                self.warn(f"STEP {self.step}: {key.split('/')[0]} skipped its optimizer update on a non-finite "
                          f"gradient norm ({key} {value:g}); its weights did not change. Lower the learning rate "
                          "or check the data and the reward if it goes on")
        if self.ranks.is_main:
            self.metrics_log.append(self.step, metrics)
        self._send(StepMessage(step=self.step, metrics=metrics))
        if self.telemetry is not None:
            # The placement summary goes with the first report of each trainer process.
            report = offload_message(self.offload_engines, with_summary=not self._summary_sent,
                                     plans=self.memory.plan_rows(), logs=self._rank_copies())
            self._send(report)
            self._summary_sent = True
            self._copy_latency_mean_s = report.copy_latency_mean_s  # what the next step's RankReport carries
        for observer in self.observers:
            observer.on_step(self.step, metrics)

    def train_step(self, records: Sequence[PromptRecord]) -> dict[str, float]:
        """One RL step over a batch of prompts; returns its metrics under verl's names."""
        timer = StepTimer(self._synchronize, on_phase=self._phase)
        metrics: dict[str, float] = {}
        with timer.phase("step"):
            with timer.phase("gen"):
                batch = self.generate(records)
                self.memory.end_rollout()
            metrics.update(self._decode_memory())
            size, reward_errors = len(batch), self.reward_fn.errors
            with timer.phase("reward"), self.memory.placed_for("scoring", Role.REWARD,
                                                               self._passes("scoring", Role.REWARD, size)), \
                    self._whole_weights(Role.REWARD):
                batch.token_level_scores = place_on_last_token(self.reward_fn(batch), batch.response_mask)
            metrics["reward/errors"] = self.reward_fn.errors - reward_errors
            with timer.phase("old_log_prob"):
                if self._scores_old_log_probs(size):
                    # (Not scored, a delayed update lands at the next read of the actor's weights: LoRA's reference,
                    # or the update.)
                    with self.memory.placed_for("scoring", Role.ACTOR, self._passes("scoring", Role.ACTOR, size)), \
                            self._whole_weights(Role.ACTOR):
                        batch.old_log_probs = self.actor.compute_log_probs(batch)
            if self.config.use_reference:
                role = Role.REF if self.reference is not None else Role.ACTOR  # LoRA: the actor, adapter off
                with timer.phase("ref"), self.memory.placed_for("scoring", role, self._passes("scoring", role, size)), \
                        self._whole_weights(role):
                    batch.ref_log_probs = self._reference_log_probs(batch)
            if self.critic is not None:
                with timer.phase("values"), self.memory.placed_for("scoring", Role.CRITIC,
                                                                   self._passes("scoring", Role.CRITIC, size)), \
                        self._whole_weights(Role.CRITIC):
                    batch.values = self.critic.compute_values(batch)
            with timer.phase("adv"):
                metrics.update(self.compute_advantages(batch))
            if self.critic is not None:
                with timer.phase("update_critic"), self.memory.placed_for("training", Role.CRITIC,
                                                                          self._passes("training", Role.CRITIC, size)):
                    metrics.update(reduce_metrics(self.critic.update(batch)))
            if self.step >= self.config.trainer.critic_warmup:  # the first critic_warmup steps train the critic only
                with timer.phase("update_actor"), self.memory.placed_for("training", Role.ACTOR,
                                                                         self._passes("training", Role.ACTOR, size)):
                    metrics.update(reduce_metrics(self.actor.update(batch)))
        for role, worker in (("critic", self.critic), ("actor", self.actor)):
            if worker is not None:
                for line in worker.merging.news:
                    self.log(f"{role}: {line}")
                worker.merging.news.clear()
        metrics.update(timer.metrics())
        metrics.update(timing_per_token_metrics(batch, timer.seconds))
        scored = timer.seconds if batch.old_log_probs is not None else {
            phase: seconds for phase, seconds in timer.seconds.items() if phase != "old_log_prob"}
        metrics.update(mfu_metrics(batch, scored, peak_flops=self.peak_flops,
                                   actor=(self.actor.model.config, self.actor.config.ppo_epochs),
                                   critic=None if self.critic is None else (self.critic.model.config,
                                                                            self.critic.config.ppo_epochs)))
        metrics.update(data_metrics(batch, response_length=self.config.data.max_response_length,
                                    prompt_length=self.config.data.max_prompt_length))
        metrics.update(throughput_metrics(batch, timer.seconds["step"]))
        metrics.update(memory_metrics(self.device, peaks=self.memory.step_peaks()))
        # Each model's decoder layers on the device and their moves (sharded: the layers whose local shards are on
        # this rank's device).
        metrics.update(self.memory.step_metrics())
        metrics["training/epoch"] = self.sampler.epoch
        return metrics

    def _scores_old_log_probs(self, size: int) -> bool:
        """Whether the step scores the old log-probs in a pass of their own: when the reward's KL penalty reads
        them, or when the actor's update is more than one optimizer step. An update of one step computes the same
        log-probs in its own forwards, on the same weights, and takes them as the old ones (Actor.on_policy): one
        forward of the actor over the batch less a step, and under delayed_update the update's publish gets the
        reference's, the values' and the critic's update's time to finish in before the actor's weights are read."""
        if self.config.algorithm.use_kl_in_reward:
            return True
        updates = self.step >= self.config.trainer.critic_warmup
        scored = updates and not self.actor.on_policy(size)
        reason = None if scored else (
            "the actor's update is one optimizer step (one mini-batch, one PPO epoch), whose own forwards give the "
            "same log-probs on the same weights, taken detached as the old ones, as verl's actor does"
            if updates else "the actor does not update during the critic's warm-up")
        if reason is not None and reason not in self._said:
            self._said.add(reason)
            self.log(f"old_log_prob: not scored in a pass of its own: {reason}")
        return scored

    def _passes(self, phase: str, role: Role, size: int) -> int:
        """How many times `phase` runs each layer of the model placed as `role` over `size` sequences: the
        tokens a rollout decodes, a scoring's micro-batches, an update's forward and backward passes. What a
        layer kept on the GPU for the phase saves in copies (the memory manager's phase plans weigh it)."""
        config = self.config
        if phase == "rollout":
            return config.data.max_response_length
        if phase == "training":
            worker = self.critic if role == Role.CRITIC else self.actor
            assert worker is not None
            return 2 * worker.config.ppo_epochs * worker.update_micro_batches(size)
        # The micro-batches each scoring runs in (the workers' own sizes where they keep them).
        micro_batch = {Role.ACTOR: self.actor.log_prob_micro_batch_size,
                       Role.REF: config.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu,
                       Role.CRITIC: self.critic.forward_micro_batch_size if self.critic is not None else size,
                       Role.REWARD: config.reward_model.micro_batch_size_per_gpu}[role]
        return math.ceil(size / max(1, micro_batch))

    def _decode_memory(self) -> dict[str, float]:
        """The static decode's KV cache and CUDA graphs' pool (rollout/kv_cache_gb, rollout/graph_pool_gb), said in
        the log the first time and when they grow by more than a tenth: device memory the rollout holds besides the
        weights, which the phase planner counts in the rollout's working memory."""
        held = self.rollout.decode_memory()
        if held:
            total = held["rollout/kv_cache_gb"] + held["rollout/graph_pool_gb"]
            if total > 1.1 * self._decode_memory_logged:
                self._decode_memory_logged = total
                self.log(f"static decode: KV cache {held['rollout/kv_cache_gb']:.2f} GiB, CUDA graphs' pool "
                         f"{held['rollout/graph_pool_gb']:.2f} GiB on the device beside the weights (the rollout's "
                         "working memory, which the phase planner learns)")
        return held

    @property
    def offload_engines(self) -> list[OffloadEngine]:
        """Every model's offload engine: the telemetry's offload message reports their copies."""
        return self.memory.engines

    # ------------------------------------------------------------------------------------ phases

    def generate(self, records: Sequence[PromptRecord], rollout: HFRollout | None = None,
                 n: int | None = None) -> RolloutBatch:
        """Sample n responses per prompt; the batch holds prompt i's responses at i*n ... i*n + n - 1."""
        n = self.config.actor_rollout_ref.rollout.n if n is None else n
        repeated = [record for record in records for _ in range(n)]
        prompt_ids, prompt_mask = encode_prompts([record.prompt for record in repeated], self.tokenizer,
                                                 max_length=self.config.data.max_prompt_length,
                                                 truncation=self.config.data.truncation)
        prompt_ids, prompt_mask = self._pad_like_other_ranks(prompt_ids, prompt_mask)
        prompt_ids, prompt_mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        rollout = rollout or self.rollout  # either samples with the actor's weights
        self.heartbeat()  # once per validation batch too
        with self.memory.placed_for("rollout", Role.ACTOR, self._passes("rollout", Role.ACTOR, len(repeated))), \
                self._whole_weights(Role.ACTOR, updated=False) as whole, \
                plain_forwards(self._sharded[Role.ACTOR].model) if whole else contextlib.nullcontext(False) as plain:
            # Several ranks that each hold the whole weights, FSDP2's hooks off, decode alone (and in CUDA graphs);
            # otherwise every forward gathers, and the ranks step together.
            rollout.synced = self.ranks.distributed and not plain
            # A batch that runs out of device memory is retried once layers moved off, or in halves.
            pieces = run_in_pieces(lambda first, count: rollout.generate(prompt_ids[first:first + count],
                                                                         prompt_mask[first:first + count]),
                                   len(repeated), self._rollout_rows(len(repeated), prompt_ids.shape[1]),
                                   memory=self._worker_memory(Role.ACTOR))
        response_ids = torch.cat([ids for ids, _ in pieces])
        response_mask = torch.cat([mask for _, mask in pieces])
        # The ranks of a sequence-parallel group sampled the same prompts from the same random stream; their first
        # rank's responses go to the others, so that a kernel not bitwise deterministic on another device cannot
        # give the group different sequences to split.
        response_ids, response_mask = self.ranks.broadcast_in_sequence_group([response_ids, response_mask])
        group_index = torch.arange(len(records), device=self.device).repeat_interleave(n)
        return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                            response_mask=response_mask, group_index=group_index, records=repeated)

    def _rank_copies(self) -> list[CopyLog]:
        """Several ranks: the copy logs of FSDP2's copies of the shards kept on the CPU (shard_copies.py) and of the
        optimizers that step sharded models on the host (HostAdamW: optimizer_offload), for the offload report
        beside the engines' copies."""
        workers = [worker for worker in (self.actor, self.critic) if worker is not None]
        host = [worker.optimizer.copies for worker in workers
                if isinstance(worker.optimizer, HostAdamW) and worker.optimizer.copies is not None]
        return [*self._shard_copies, *host]

    @contextlib.contextmanager
    def _whole_weights(self, role: str, *, updated: bool = True) -> Iterator[bool]:
        """Several ranks: the sharded model's whole weights on every rank for a phase without gradients (the rollout,
        a scoring) where they fit, gathered once, not at every forward (sharding.whole_weights); the decision is
        said when it changes. Yields whether they are held. One rank: nothing (False). `updated`: the weights as
        updated, so a HostAdamW update still computed in the background (the actor's delayed_update, the critic's)
        lands before the gather; the rollout reads the weights from before a delayed update (False)."""
        if updated:
            worker = {Role.ACTOR: self.actor, Role.CRITIC: self.critic}.get(role)  # (LoRA's reference: the actor)
            publish_pending(getattr(worker, "optimizer", None))
        sharded = self._sharded.get(role)
        if sharded is None:
            yield False
            return
        with whole_weights(sharded, self.ranks) as whole:
            if whole != self._whole_weights_said.get(role):
                self._whole_weights_said[role] = whole
                size = format_bytes(sharded.whole_bytes)
                self.log(f"{role}: every rank holds the whole weights ({size}) for the forwards without gradients "
                         "(rollout, scoring): one gather of each unit a phase, not one a forward" if whole else
                         f"{role}: the whole weights ({size}) take more than {WHOLE_WEIGHTS_SHARE:.0%} of some rank's "
                         "free device memory: each forward without gradients gathers every unit's shards")
            yield whole

    def _pad_like_other_ranks(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """With several ranks, every rank's prompts left-padded to the longest of all of them: each sequence then
        has the same positions and padding as in a one-rank run of the whole batch."""
        width = self.ranks.max(prompt_ids.shape[1])
        padding = width - prompt_ids.shape[1]
        if padding == 0:
            return prompt_ids, prompt_mask
        pad_id = self.tokenizer.pad_token_id
        return (torch.nn.functional.pad(prompt_ids, (padding, 0), value=pad_id),
                torch.nn.functional.pad(prompt_mask, (padding, 0), value=0))

    def _rollout_rows(self, rows: int, prompt_length: int) -> int:
        """`_rows_that_fit`, the fewest of any rank's: every rank of a sharded model must run as many generate
        calls (each forward gathers the layers' shards from all of them)."""
        fitting = self._rows_that_fit(rows, prompt_length)
        return int(self.ranks.reduce_many([float(fitting)], "min")[0]) if self.ranks.distributed else fitting

    def _rows_that_fit(self, rows: int, prompt_length: int) -> int:
        """How many of `rows` sequences decode at once: all of them, or as many as rollout.gpu_memory_utilization
        leaves room for beside what is in use now (trainer/rollout/budget.py; a GPU only)."""
        utilization = self.config.actor_rollout_ref.rollout.gpu_memory_utilization
        if utilization is None or self.memory.probe is None:
            return rows
        in_use, capacity = self.memory.probe()
        element_bytes = torch_dtype(self.config.actor_rollout_ref.actor.fsdp_config.model_dtype).itemsize
        per_row = KVCacheShape.of(self.actor.model.config).bytes_per_sequence(
            prompt_length + self.config.data.max_response_length, element_bytes)
        fitting = rows_within_budget(rows, utilization=utilization, in_use=in_use, capacity=capacity,
                                     bytes_per_row=per_row)
        if fitting == 0 and not self._over_budget_warned:
            self._over_budget_warned = True
            self.warn(over_budget_message(utilization=utilization, in_use=in_use, capacity=capacity,
                                          bytes_per_row=per_row))
        return max(1, fitting)

    def _reference_log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        """The reference policy's log-probs: its own model's, or with LoRA the actor's with the adapter disabled
        (the frozen base weights, as verl does)."""
        model, role, adapter_off = self.reference, Role.REF, contextlib.nullcontext()
        if self.reference is None:
            assert self.actor_adapter is not None, "a run that needs the reference policy builds one, or LoRA's"
            model, role, adapter_off = self.actor.model, Role.ACTOR, self.actor_adapter.disable_adapter()
        ref = self.config.actor_rollout_ref.ref
        with adapter_off:
            return compute_log_probs(model, batch, micro_batch_size=ref.log_prob_micro_batch_size_per_gpu,
                                     temperature=self.config.actor_rollout_ref.rollout.temperature,
                                     memory=self._worker_memory(role), sequence_split=self.reference_split,
                                     remove_padding=self.config.actor_rollout_ref.model.use_remove_padding,
                                     max_token_len=ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz
                                     else None, ranks=self.ranks)

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
            if self.ranks.distributed:
                batch.advantages = self._whitened_over_ranks(batch.returns - batch.values, batch.response_mask)
        else:
            batch.advantages, batch.returns = self.advantage_fn(
                batch.token_level_rewards, batch.response_mask, batch.group_index,
                norm_adv_by_std=algorithm.norm_adv_by_std_in_grpo)
        return metrics

    def _whitened_over_ranks(self, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """GAE's advantages whitened over the whole batch, every rank's response tokens (as one rank whitens
        its whole batch: masked_whiten's unbiased variance), not over this rank's share alone."""
        advantages = advantages * mask
        count, total, squares = self.ranks.sum_tensor_over_data(torch.stack(
            [mask.sum(), advantages.sum(), (advantages ** 2).sum()]).double()).tolist()
        mean = total / max(count, 1.0)
        variance = max(squares / max(count, 1.0) - mean ** 2, 0.0) * count / max(count - 1, 1.0)
        return ((advantages - mean) * (variance + WHITEN_EPSILON) ** -0.5 * mask).to(advantages.dtype)

    def _maybe_validate(self) -> dict[str, float]:
        frequency = self.config.trainer.test_freq
        due = frequency > 0 and (self.step % frequency == 0 or self.step == self.total_steps)
        if not (due and self.val_records):
            return {}
        start = time.perf_counter()
        metrics = self.validate()
        return {**metrics, "timing_s/testing": time.perf_counter() - start}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Greedy responses to the validation prompts, mean score per data source (verl's val-core keys).
        With several ranks each scores its share of every validation batch, and the scores are gathered."""
        self._publish_updates()  # validation scores the weights after the last step
        greedy = HFRollout(self.actor.model, self.tokenizer,
                           self.config.actor_rollout_ref.rollout.model_copy(update={"do_sample": False}),
                           self.config.data.max_response_length, graph_safety=self.memory.engine(Role.ACTOR),
                           synced=self.ranks.distributed, agree_active=self.ranks.count_agreement)
        scores: dict[str, list[float]] = {}
        size = self.config.data.val_batch_size or len(self.val_records)  # null: all at once, as verl
        for start in range(0, len(self.val_records), size):
            records, scored = self._validation_share(self.val_records[start:start + size])
            batch = self.generate(records, rollout=greedy, n=1)
            mine = [(record.data_source, score)
                    for record, score in zip(batch.records, self.reward_fn(batch).tolist(), strict=True)][:scored]
            for rank_scores in self.ranks.gather_objects(mine):
                for source, score in rank_scores:
                    scores.setdefault(source, []).append(score)
        return {f"val-core/{source}/reward/mean@1": sum(values) / len(values) for source, values in scores.items()}

    def _validation_share(self, records: Sequence[PromptRecord]) -> tuple[list[PromptRecord], int]:
        """This rank's slice of a validation batch and how many of it count. Every rank generates as many
        sequences (the sharded model's forwards are collective, and so are the pieces a batch decodes in): a
        short slice is filled up with the batch's first prompt, unscored. By data-parallel group: the ranks of a
        sequence-parallel group generate alike (`generate` makes their responses one), and their repeated scores
        leave each source's mean as it is."""
        share = math.ceil(len(records) / self.ranks.dp_size)
        mine = list(records[self.ranks.dp_rank * share:(self.ranks.dp_rank + 1) * share])
        return mine + [records[0]] * (share - len(mine)), len(mine)

    # ------------------------------------------------------------------------------- checkpoints

    def _models(self) -> dict[str, torch.nn.Module]:
        """What the checkpoints hold of each trained model: its weights, or its LoRA adapter (peft's wrapper)."""
        models: dict[str, torch.nn.Module] = {
            "actor": self.actor.model if self.actor_adapter is None else self.actor_adapter}
        if self.critic is not None:
            models["critic"] = self.critic.model if self.critic_adapter is None else self.critic_adapter
        return models

    def save(self, *, final: bool = False) -> Path | None:
        """Checkpoint this step. A checkpoint the disk cannot take does not end the run: it warns, counts,
        and the next save tries again; when it is the `final` one, the policy's weights are written
        alone instead and FinalCheckpointError says so."""
        self._phase("save_checkpoint")
        start = time.perf_counter()
        try:
            return self._save(final)
        finally:
            self._checkpoint_seconds += time.perf_counter() - start

    def _publish_updates(self, *, engines: bool = True) -> None:
        """A delayed update (fsdp_config.delayed_update) applied, waiting for the host's arithmetic: a sharded
        model's (HostAdamW) before anything but the rollout reads the weights; with `engines`, one rank's engine's
        too, before a checkpoint and validation, so that the run after a checkpoint samples as one resumed from it
        does (elsewhere each of its units publishes at its first read, while the later ones still update)."""
        for role, worker in ((Role.ACTOR, self.actor), (Role.CRITIC, self.critic)):
            publish_pending(getattr(worker, "optimizer", None))
            engine = self.memory.engine(role) if engines and worker is not None else None
            if engine is not None:
                engine.publish_updates()

    def _save(self, final: bool) -> Path | None:
        self._publish_updates()  # the checkpoint holds the weights and states after the last step
        state = {
            "step": self.step,
            "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict() if self.critic is not None else None,
            "sampler": self.sampler.state_dict(),
            "kl_controller": self.kl_controller.state_dict(),
            "rng": rng_state(),
        }
        try:
            if self.ranks.distributed:
                state["rank_rngs"] = self.ranks.gather_objects(state["rng"])  # each rank's own sampling streams
                path = save_sharded_checkpoint(self.checkpoint_dir, self.step, self._trained(), state,
                                               ranks=self.ranks, keep=self.config.checkpoints_to_keep)
            else:
                # The names of the optimizers' parameters let a resume on several ranks find each one's states.
                state["parameter_names"] = self._parameter_names()
                path = save_checkpoint(self.checkpoint_dir, self.step, self._models(), state,
                                       keep=self.config.checkpoints_to_keep)
        except CheckpointWriteError as error:
            self._checkpoint_failed(error, final=final)
            return None
        self._saved_at = self.step
        self._checkpoint_failing = False
        self.log(f"checkpoint saved: {path}")
        self._send(CheckpointMessage(step=self.step, path=str(path)))
        return path

    def _parameter_names(self) -> dict[str, list[str]]:
        """Each trained model's optimizer parameters by name, where they are the model's own (an offloaded bf16
        model's fp32 masters are not: that checkpoint resumes on one rank only)."""
        names = {}
        for role, (model, optimizer) in self._trained().items():
            with contextlib.suppress(CheckpointError):
                names[role] = parameter_names(model, optimizer)
        return names

    def _trained(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        """Each trained model with its optimizer, by the checkpoint's role names."""
        trained: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {
            "actor": (self.actor.model, self.actor.optimizer)}
        if self.critic is not None:
            trained["critic"] = (self.critic.model, self.critic.optimizer)
        return trained

    def _checkpoint_failed(self, error: CheckpointWriteError, *, final: bool) -> None:
        self.checkpoint_failures += 1
        self._checkpoint_failing = True
        complete = list_checkpoints(self.checkpoint_dir)
        latest = f"step {complete[-1][0]}" if complete else "none"
        if not final:
            self.warn(f"CHECKPOINT NOT SAVED: {error}; training goes on and the next save tries again (the latest "
                      f"complete checkpoint, which a restart resumes from: {latest})")
            return
        if self.ranks.distributed:
            raise FinalCheckpointError(f"the final checkpoint of step {self.step} was not saved: {error}; the latest "
                                       f"complete checkpoint: {latest}") from None
        try:
            weights = save_weights(self.checkpoint_dir, self.step, self._models()["actor"])
        except CheckpointWriteError as weights_error:
            kept = f"the actor's weights alone could not be written either ({weights_error})"
        else:
            kept = (f"the actor's weights alone are in {weights} (safetensors; without optimizer states they "
                    "cannot resume the run)")
        raise FinalCheckpointError(f"the final checkpoint of step {self.step} was not saved: {error}; {kept}; the "
                                   f"latest complete checkpoint: {latest}") from None

    def _checkpoint_metrics(self) -> dict[str, float]:
        """checkpoint/failures: saves that failed since the previous step's metrics; checkpoint/failing: 1
        while the latest save has failed (a crash would lose every step since the last one written)."""
        metrics = {"checkpoint/failures": float(self.checkpoint_failures),
                   "checkpoint/failing": float(self._checkpoint_failing)}
        if self._checkpoint_seconds > 0:
            # A save follows the line of the step it checkpoints (a crash between them must not lose the
            # line), so its time, as its failure, goes with the next step's metrics.
            metrics["timing_s/save_checkpoint"] = self._checkpoint_seconds
        self.checkpoint_failures, self._checkpoint_seconds = 0, 0.0
        return metrics

    def resume(self) -> None:
        """Continue from the checkpoint resume_mode points at, or start at step 0."""
        mode = self.config.trainer.resume_mode
        self._resumed = True
        if self.ranks.is_main:  # one rank clears the shared folder while the others wait
            remove_partial_checkpoints(self.checkpoint_dir)
        self.ranks.barrier()
        if mode == "disable":
            if list_checkpoints(self.checkpoint_dir):
                raise RunSetupError(f"trainer.resume_mode: disable, but {self.checkpoint_dir} already holds "
                                    "checkpoints; set trainer.resume_mode=auto to continue that run, or choose another "
                                    "trainer.experiment_name")
            path = None
        elif mode == "resume_path":
            path = Path(self.config.trainer.resume_from_path)
        else:
            path = latest_checkpoint(self.checkpoint_dir)
        if path is None:
            if self.ranks.is_main:
                self.metrics_log.truncate_after(-1)  # a fresh start: not even a step 0 (validation) line stays
            return
        self._restore(path)

    def _restore(self, path: Path) -> None:
        try:
            state = (self._restore_models(path) if self.ranks.distributed or is_sharded_checkpoint(path)
                     else load_checkpoint(path, self._models()))
            self.actor.load_state_dict(state["actor"])
            if self.critic is not None:
                self.critic.load_state_dict(state["critic"])
            self.sampler.load_state_dict(state["sampler"])
        except ValueError as error:
            raise CheckpointError(f"cannot resume from {path}: {error}") from None
        self.kl_controller.load_state_dict(state["kl_controller"])
        restore_rank_streams(state["rng"], state.get("rank_rngs"), rank=self.ranks.rank, dp_rank=self.ranks.dp_rank,
                             world_size=self.ranks.world_size, seed=self.config.trainer.seed, step=state["step"])
        self.step = state["step"]
        if self.ranks.is_main:
            self.metrics_log.truncate_after(self.step)
        self.log(f"resumed from {path} at step {self.step}")

    def _restore_models(self, path: Path) -> dict:
        """Weights and optimizer states across world sizes: a checkpoint of several ranks (DCP shards) into this
        run's sharded or whole models, or a one-rank checkpoint into sharded ones. Returns the trainer state."""
        state = load_trainer_state(path)
        trained = self._trained()
        if is_sharded_checkpoint(path):
            (load_sharded_into_sharded if self.ranks.distributed else load_sharded_into_single)(path, trained)
            return state
        names = state.get("parameter_names", {})
        load_single_into_sharded(path, trained, {role: {"optimizer": state[role]["optimizer"],
                                                        **({"parameter_names": names[role]} if role in names else {})}
                                                 for role in trained})
        for role in trained:
            state[role]["optimizer"] = None  # loaded into the shards above
        return state

    # ------------------------------------------------------------------------------------ control

    def handle_control_messages(self) -> None:
        """The safe point between steps: apply live settings, note checkpoint and stop requests.

        With several ranks this is a collective: rank 0 (which holds the daemon's control) broadcasts what
        arrived, every rank applies it here, at the same step, and a stop any rank was signalled stops all."""
        if self.telemetry is None and not self.ranks.distributed:
            return
        self.heartbeat()
        for message in self._agreed_messages(self.telemetry.poll() if self.telemetry is not None else []):
            self._dispatch(message)
        if self.ranks.distributed:
            stop = self.ranks.reduce_many([float(self.stop_requested.is_set())], "max")[0]
            if stop:
                self.stop_requested.set()
            self._stop_agreed = bool(stop)

    def _agreed_messages(self, messages: list[DownMessage]) -> list[DownMessage]:
        """Rank 0's messages on every rank (another rank's own connection only reports: what its daemon sends
        it is dropped)."""
        return self.ranks.broadcast_from_main(messages if self.ranks.is_main else [])

    def _stopping(self) -> bool:
        """Whether the loop stops now: on several ranks, what they agreed at the last safe point (a signal
        arriving since must not stop one rank a step before the others)."""
        return self._stop_agreed if self.ranks.distributed else self.stop_requested.is_set()

    def receive_initial_settings(self, timeout_s: float = 5.0) -> bool:
        """Wait (once, before the first step) for the daemon's current settings, so a change made
        before a restart holds from the restarted trainer's first step. False if a daemon is there but sent
        none (on several ranks rank 0 waits and every rank applies what it received)."""
        received: list[DownMessage] = []
        waiting = self.telemetry is not None and self.ranks.is_main
        deadline = time.monotonic() + timeout_s
        while waiting and self.telemetry is not None and time.monotonic() < deadline:
            messages = self.telemetry.poll()
            received += messages
            if not self.ranks.distributed:
                for message in messages:
                    self._dispatch(message)
            if any(isinstance(message, SettingsMessage) for message in messages):
                break
            time.sleep(0.01)
        if self.ranks.distributed:
            for message in self._agreed_messages(received):
                self._dispatch(message)
        answered = not waiting or any(isinstance(message, SettingsMessage) for message in received)
        return bool(self.ranks.broadcast_from_main(answered))

    def _dispatch(self, message: DownMessage) -> None:
        if isinstance(message, SettingsMessage):
            self.apply_live_settings(message.version, message.values)
        elif isinstance(message, CheckpointNowMessage):
            self._checkpoint_requested = True
        elif isinstance(message, StopMessage):
            self.request_stop()

    def apply_live_settings(self, version: int, values: LiveSettings) -> None:
        """Take the daemon's settings from the next step on, and acknowledge with that step (on several
        ranks, every rank calls this at the same safe point: rank 0 acknowledges once all have applied)."""
        self.live_settings = values
        for listener in self.settings_listeners:
            listener(self.live_settings)
        self.ranks.barrier()
        if self.ranks.is_main:
            self._send(SettingsAckMessage(version=version, step=self.step + 1, values=self.live_settings))

    def heartbeat(self) -> None:
        """Tell the daemon this thread is making progress (at most every HEARTBEAT_INTERVAL_S): call it from
        the loop and from inside long phases, never from another thread (it would hide a hang)."""
        now = time.monotonic()
        if self.telemetry is not None and now - self._heartbeat_at >= HEARTBEAT_INTERVAL_S:
            self._heartbeat_at = now
            self.telemetry.send(HeartbeatMessage(step=self.step + 1))

    def _rollout_safe_point(self) -> None:
        self.heartbeat()
        self.memory.safe_point()

    def _phase(self, name: str) -> None:
        if name != "step":  # the timer's whole-step span, not a phase
            self._send(PhaseMessage(step=self.step + 1, phase=Phase(name)))

    def _send(self, message: UpMessage) -> None:
        if self.telemetry is not None:
            self.telemetry.send(message)

    def request_stop(self) -> None:
        """Checkpoint at the end of the current step and return from fit(). Safe from a signal handler."""
        self.stop_requested.set()

    def install_signal_handlers(self) -> Callable[[], None]:
        """SIGTERM and SIGINT ask for a stop at the next safe point; returns the function that puts the previous
        handlers back. Call it when training ends: a handler is a reference from the interpreter to this trainer,
        whose sharded models hold the process groups, and a group still alive when the interpreter finalizes can
        abort the process (its gloo threads then drop tensors without a live interpreter)."""
        previous = {signum: signal.signal(signum, lambda *_: self.request_stop())
                    for signum in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return restore

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _bytes_of_gib(gib: float | None) -> float | None:
    return None if gib is None or gib != gib else max(0.0, gib) * 2**30
