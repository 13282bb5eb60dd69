"""The RL trainer: PPO and GRPO share this pipeline and differ only in advantage and loss.

`fit` resumes, then per step: train, record, checkpoint, validate. One step reads top to bottom in `train_step`:
generate, score, old log-probs, reference log-probs, values, advantages, critic update, actor update. What else a
run needs is built and kept elsewhere: the models and their placement (build.py), a phase's weights (staging.py),
the rollout (generation.py), the scores (scoring.py), the advantages (advantage_phase.py), checkpoints
(checkpointer.py), validation (validation.py), the daemon's control (control.py) and what crosses ranks
(distributed/run_wide.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from trainer.advantage_phase import AdvantagePhase
from trainer.algorithms import build_kl_controller
from trainer.build import ModelBuilder, load_prompts, set_host_threads
from trainer.checkpointer import Checkpointer
from trainer.config import KEYS, RunConfig, dump_config
from trainer.config.live import initial_live_settings
from trainer.config.messages import Role, StepMessage
from trainer.control import Control, SettingsFeed, TelemetryLink
from trainer.data import PromptRecord
from trainer.data.user_classes import prompt_sampler
from trainer.distributed.host_adamw import HostAdamW
from trainer.distributed.ranks import Ranks, resolve_device
from trainer.distributed.run_wide import RunWide, StepShare
from trainer.divergence import DivergenceWatch
from trainer.generation import Generation, GreedyBaseline
from trainer.memory import MemoryManager, default_memory_probe, host_memory_available
from trainer.metrics import MetricsLog, StepTimer, device_peak_flops, reduce_metrics, step_figures
from trainer.models import load_tokenizer
from trainer.offload import offload_message
from trainer.offload.copies import CopyLog
from trainer.offload.dynamic import MemoryProbe
from trainer.out_of_memory import PhaseWatch
from trainer.randomness import seed_everything
from trainer.reporting import StepObserver
from trainer.rewards.time_limit import StepInterrupted
from trainer.rollout.batch import RolloutBatch
from trainer.rollout.hf_rollout import HFRollout
from trainer.scoring import Scoring
from trainer.staging import StagedPhase, Staging
from trainer.validation import Validator


def count_total_steps(config: RunConfig, steps_per_epoch: int) -> int:
    """trainer.total_training_steps when set (verl: it wins), else epochs x steps per epoch."""
    return config.trainer.total_training_steps or steps_per_epoch * config.trainer.total_epochs


class Trainer:
    """Builds the run from its config and runs the RL loop, checkpointing as it goes."""

    def __init__(self, config: RunConfig, *, observers: Sequence[StepObserver] = (), log=print, warn=print,
                 telemetry: TelemetryLink | None = None, memory_probe: MemoryProbe | None = None,
                 host_available: Callable[[], int] | None = None, ranks: Ranks | None = None):
        self.config, self.log, self.warn = config, log, warn
        # This process's rank of the run (trainer/distributed/ranks.py); one rank unless torchrun started several.
        self.ranks = ranks or Ranks.single(resolve_device(config.trainer.device))
        self.device = self.ranks.device
        self.observers = list(observers)
        self.step = 0
        self.settings = SettingsFeed(initial_live_settings(config))
        self.control = Control(telemetry, self.ranks, self.settings, completed_steps=lambda: self.step)
        self.run_dir = Path(config.trainer.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.ranks.is_main:  # the config that actually ran, every default explicit, beside its results
            (self.run_dir / "config.yaml").write_text(dump_config(config), encoding="utf-8")
        set_host_threads(config, self.ranks, log)
        seed_everything(config.trainer.seed)  # the same on every rank: each shards the same initial weights
        model_config = config.actor_rollout_ref.model
        self.tokenizer = load_tokenizer(model_config.tokenizer_path or model_config.path,
                                        trust_remote_code=model_config.trust_remote_code,
                                        chat_template=model_config.custom_chat_template)
        self.records, self.val_records = load_prompts(config, self.tokenizer, log)
        # data.shuffle's order, or data.sampler's (rank 0's on several ranks)
        self.sampler = prompt_sampler(config, self.records, agree=self.ranks.broadcast_from_main)
        self.total_steps = count_total_steps(config, self.sampler.steps_per_epoch)
        self.memory = MemoryManager(self.device, settings=self.settings.current,
                                    probe=memory_probe or default_memory_probe(self.device),
                                    host_available=host_available or host_memory_available, log=log, warn=warn)
        self.settings.subscribe(self.memory.apply_settings)
        self.models = ModelBuilder(config, self.tokenizer, self.memory, self.ranks, total_steps=self.total_steps,
                                   log=log, warn=warn).build()
        self.actor, self.critic, self.reference = self.models.actor, self.models.critic, self.models.reference
        self.memory.finish_placement()
        if self.ranks.distributed:  # the ranks sample their own shares of the prompts with their own streams
            # (the ranks of a sequence-parallel group share theirs, and draw the same samples from one stream)
            seed_everything(config.trainer.seed + self.ranks.dp_rank)
        self.run_wide = RunWide(self.ranks, config, self.control.send)
        self.staging = Staging(config, self.memory, self.models, self.ranks, log)
        # Dynamic offload acts between decode chunks too (a heartbeat goes with it).
        self.rollout = HFRollout(self.actor.model, self.tokenizer, config.actor_rollout_ref.rollout,
                                 config.data.max_response_length,
                                 safe_point=self._rollout_safe_point if self.memory.moves_layers else None,
                                 graph_safety=self.memory.engine(Role.ACTOR), synced=self.ranks.distributed,
                                 agree_active=self.ranks.count_agreement, warn=warn,
                                 record_log_probs=config.records_rollout_log_probs)
        self.generation = Generation(config, self.tokenizer, self.rollout, self.staging, self.run_wide,
                                     heartbeat=self.control.heartbeat, log=log, warn=warn)
        self.memory.enable_embedding_cache(config.actor_rollout_ref.rollout.embedding_cache)
        # ReMax's baseline: each prompt's greedy response, scored in the gen phase.
        self.greedy_baseline = GreedyBaseline(
            config, self.generation, self.models.reward, self.staging, synchronize=self._synchronize,
            safe_point=self._rollout_safe_point if self.memory.moves_layers else None, warn=warn,
        ) if config.algorithm.adv_estimator == "remax" else None
        self.score = Scoring(config, self.models.reward, self.tokenizer, self.ranks, step=lambda: self.step, log=log,
                             stopping=self.control.stop_requested.is_set)
        kl = config.algorithm.kl_ctrl
        self.kl_controller = build_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.advantages = AdvantagePhase(config, self.run_wide, self.ranks, self.kl_controller)
        # Only rank 0 writes the run's metrics (the run-wide ones); the others' MetricsLog is never appended to.
        self.metrics_log = MetricsLog(self.run_dir / "metrics.jsonl", warn=warn)
        self.checkpointer = Checkpointer(config, self.models, self.sampler, self.kl_controller, self.ranks,
                                         self.metrics_log, publish_updates=self.staging.publish_updates,
                                         send=self.control.send, log=log, warn=warn, tokenizer=self.tokenizer)
        self.validator = Validator(config, self.val_records, self.generation, self.models.reward,
                                   publish_updates=self.staging.publish_updates, log=log, observers=self.observers,
                                   step=lambda: self.step)
        self.divergence = DivergenceWatch(config.trainer.max_nonfinite_steps, warn=warn)
        self.peak_flops = device_peak_flops(self.device)  # None: no MFU figures (a CPU, an unknown GPU)
        self._resumed = False
        self._summary_sent = False
        self._copy_latency_mean_s: float | None = None  # the mean time of this rank's latest timed copies
        self._said: set[str] = set()  # the once-a-run log lines said so far

    # -------------------------------------------------------------------------------------- loop

    def fit(self) -> None:
        """Train until total steps, or until a stop is requested (then checkpoint and return)."""
        if not self._resumed:
            self.resume()
        if self.step >= self.total_steps:
            self.log(f"nothing to do: the run is complete at step {self.step}/{self.total_steps}; to train again "
                     f"choose another {KEYS.trainer.experiment_name}, or raise {KEYS.trainer.total_training_steps}")
            return
        self.checkpointer.saved_at = self.step
        if self.validator.before_training(self.step):
            self._record_step({**self.validator.timed(), "training/global_step": 0})
            if self.config.trainer.val_only:
                return
        while True:
            self.control.take_messages()
            if self.control.checkpoint_requested and self.checkpointer.saved_at != self.step:
                self.save()
            self.control.checkpoint_requested = False
            if self.step >= self.total_steps or self.control.stopping():
                break
            self.memory.safe_point()
            self.checkpointer.mark_step_start()
            share = self.run_wide.share_of(self.sampler.next_batch())
            try:
                local = self.train_step([self.records[index] for index in share.prompts], share)
            except StepInterrupted as interrupted:  # a stop while the user's reward function was stuck
                self.checkpointer.rewind_step(str(interrupted))
                break
            self.step += 1
            local["training/global_step"] = self.step
            if self.validator.due(self.step, self.total_steps):
                local.update(self.validator.timed())
            local.update(self.checkpointer.metrics())
            self._record_step(self.run_wide.metrics(local, sequences=share.sequences, step=self.step,
                                                    copy_latency_mean_s=self._copy_latency_mean_s), local=local)
            # The last step's save is the final one, below.
            save_freq = self.config.trainer.save_freq
            if save_freq > 0 and self.step % save_freq == 0 and self.step < self.total_steps:
                self.save()
        if self.checkpointer.saved_at != self.step:
            self.save(final=True)
        if self.control.stop_requested.is_set() and self.step < self.total_steps:
            self.log(f"stopped at step {self.step}/{self.total_steps} on request; checkpoint saved")

    def resume(self) -> None:
        """Continue from the checkpoint trainer.resume_mode points at, or start at step 0."""
        self._resumed = True
        self.step = self.checkpointer.resume()

    def save(self, *, final: bool = False) -> Path | None:
        """Checkpoint this step (checkpointer.py: a save the disk refuses warns; a final one raises)."""
        if not self.divergence.allows_save(self.step):
            return None
        self.control.phase_started("save_checkpoint")
        return self.checkpointer.save(self.step, final=final)

    def _record_step(self, metrics: dict[str, float], local: dict[str, float] | None = None) -> None:
        """metrics.jsonl, the daemon and every observer (the console) get the step's metrics: rank 0 the run-wide
        `metrics`; another rank sends its `local` figures to the daemon and its own log, and writes no
        metrics.jsonl."""
        run_wide = metrics  # every rank judges divergence on the same figures
        if not self.ranks.is_main:
            metrics = metrics if local is None else local
        if self.ranks.is_main:
            self.metrics_log.append(self.step, metrics)
        self.control.send(StepMessage(step=self.step, metrics=metrics))
        if self.control.telemetry is not None:
            # The placement summary goes with the first report of each trainer process.
            report = offload_message(self.memory.engines, with_summary=not self._summary_sent,
                                     plans=self.memory.plan_rows(), logs=self._rank_copies())
            self.control.send(report)
            self._summary_sent = True
            self._copy_latency_mean_s = report.copy_latency_mean_s  # what the next step's RankReport carries
        for observer in self.observers:
            observer.on_step(self.step, metrics)
        self.divergence.observe(self.step, run_wide)  # after the step's line: it shows what was not finite

    # ------------------------------------------------------------------------------------ the step

    def train_step(self, records: Sequence[PromptRecord], share: StepShare | None = None) -> dict[str, float]:
        """One RL step over a batch of prompts (`share`: how this rank samples them; None: rollout.n responses
        each, a group each); returns its metrics under verl's names."""
        share = share or StepShare(list(range(len(records))), self.config.actor_rollout_ref.rollout.n)
        watch = PhaseWatch(self.config, self.control.phase_started)  # an unrecoverable OOM: one line naming the phase
        timer = StepTimer(self._synchronize, on_phase=watch.phase_started)
        metrics: dict[str, float] = {}
        with timer.phase("step"), watch.reported():
            with timer.phase("gen"):
                batch = self.generation.generate(records, n=share.copies, groups=share.groups)
                if self.greedy_baseline is not None:
                    batch.reward_baselines = self.greedy_baseline(records, share.copies)
                    metrics["timing_s/gen_max"] = self.greedy_baseline.seconds
                self.memory.end_rollout()
            metrics.update(self.generation.decode_memory())
            with self._phase(timer, "reward", "scoring", Role.REWARD, batch):
                metrics.update(self.score(batch))
            with timer.phase("old_log_prob"):
                if self.config.algorithm.rollout_correction.bypass_mode:  # verl's bypass mode: pi_old = pi_rollout
                    batch.old_log_probs = batch.rollout_log_probs
                elif self._scores_old_log_probs(len(batch)):
                    # (Not scored, a delayed update lands at the next read of the actor's weights: LoRA's reference,
                    # or the update.)
                    with self.staging("scoring", Role.ACTOR, len(batch)):
                        batch.old_log_probs, batch.sum_pi_squared = self.actor.score_responses(
                            batch, sum_pi_squared=self.config.scores_sum_pi_squared)
            if self.reference is not None:
                with self._phase(timer, "ref", "scoring", self.reference.role, batch):
                    batch.ref_log_probs = self.reference.compute_log_probs(batch)
            if self.critic is not None:
                with self._phase(timer, "values", "scoring", Role.CRITIC, batch):
                    batch.values = self.critic.compute_values(batch)
            with timer.phase("adv"):
                batch, adv_metrics = self.advantages(batch)
                metrics.update(adv_metrics)
            if self.critic is not None:
                with self._phase(timer, "update_critic", "training", Role.CRITIC, batch):
                    metrics.update(reduce_metrics(self.critic.update(batch)))
            if self.step >= self.config.trainer.critic_warmup:  # the first critic_warmup steps train the critic only
                with self._phase(timer, "update_actor", "training", Role.ACTOR, batch):
                    metrics.update(reduce_metrics(self.actor.update(batch)))
            if batch.sum_pi_squared is not None:
                metrics.update(self.advantages.variance_proxies(batch, metrics.get("actor/grad_norm")))
            self.sampler.update(batch)  # a curriculum sampler (data.sampler) reads the step, as in verl's fit
        self._say_merging_news()
        return {**metrics, **self._step_metrics(batch, timer)}

    @contextlib.contextmanager
    def _phase(self, timer: StepTimer, name: str, staged_as: StagedPhase, role: Role,
               batch: RolloutBatch) -> Iterator[None]:
        """A timed phase of the step with the weights of the model placed as `role` staged for it."""
        with timer.phase(name), self.staging(staged_as, role, len(batch)):
            yield

    def _scores_old_log_probs(self, size: int) -> bool:
        """Whether the step scores the old log-probs in a pass of their own: when the reward's KL penalty or rollout
        correction (pi_old against the rollout's pi_rollout, before the advantages) reads them, when the sums of
        squared probabilities are scored with them (the optimal token baselines read both), or when the actor's
        update is more than one optimizer step. An update of one step computes the same log-probs in its own
        forwards, on the same weights, and takes them as the old ones (Actor.on_policy): one forward of the actor
        over the batch less a step, and under delayed_update the update's publish gets the reference's, the
        values' and the critic's update's time to finish in before the actor's weights are read."""
        if (self.config.algorithm.use_kl_in_reward or self.config.records_rollout_log_probs
                or self.config.scores_sum_pi_squared):
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

    def _step_metrics(self, batch: RolloutBatch, timer: StepTimer) -> dict[str, float]:
        critic = None if self.critic is None else (self.critic.model.config, self.critic.config.ppo_epochs)
        return {**step_figures(batch, timer, peak_flops=self.peak_flops, critic=critic,
                               actor=(self.actor.model.config, self.actor.config.ppo_epochs),
                               response_length=self.config.data.max_response_length,
                               prompt_length=self.config.data.max_prompt_length, device=self.device,
                               peaks=self.memory.step_peaks()),
                # Each model's decoder layers on the device and their moves (sharded: the layers whose local shards
                # are on this rank's device).
                **self.memory.step_metrics(), "training/epoch": self.sampler.epoch}

    def _say_merging_news(self) -> None:
        for role, worker in (("critic", self.critic), ("actor", self.actor)):
            if worker is not None:
                for line in worker.merging.news:
                    self.log(f"{role}: {line}")
                worker.merging.news.clear()

    def _rank_copies(self) -> list[CopyLog]:
        """Several ranks: the copy logs of FSDP2's copies of the shards kept on the CPU and of the optimizers that
        step sharded models on the host (HostAdamW: optimizer_offload), for the offload report beside the
        engines'."""
        host = [worker.optimizer.copies for worker in (self.actor, self.critic) if worker is not None
                and isinstance(worker.optimizer, HostAdamW) and worker.optimizer.copies is not None]
        return [*self.models.shard_copies, *host]

    def _rollout_safe_point(self) -> None:
        self.control.heartbeat()
        self.memory.safe_point()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
