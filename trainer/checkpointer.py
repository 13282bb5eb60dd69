"""Checkpoints of a run: saving them as it goes, resuming from one, and what happens when the disk says no.

A checkpoint holds every trained model (its weights, or its LoRA adapter), their optimizers and the trainer's state
(the step, the prompt sampler, the KL controller, the random streams), written at once and atomically
(trainer/checkpoint.py). One rank writes safetensors; several write torch.distributed.checkpoint shards, and either
resumes at another world size.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.algorithms import KLController
from trainer.build import Models
from trainer.checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    FinalCheckpointError,
    is_sharded_checkpoint,
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
from trainer.checkpoint_manifest import verify_checkpoint
from trainer.config import KEYS, RunConfig
from trainer.config.messages import CheckpointMessage, UpMessage
from trainer.data import PromptSampler
from trainer.distributed.ranks import Ranks
from trainer.errors import RunSetupError
from trainer.metrics import MetricsLog
from trainer.randomness import restore_rank_streams, rng_state, set_rng_state


class Checkpointer:
    """Saves and resumes the run's checkpoints under trainer.checkpoint_dir."""

    def __init__(self, config: RunConfig, models: Models, sampler: PromptSampler, kl_controller: KLController,
                 ranks: Ranks, metrics_log: MetricsLog, *, publish_updates: Callable[[], None],
                 send: Callable[[UpMessage], None], log: Callable[[str], None], warn: Callable[[str], None],
                 tokenizer: Any = None):
        self.config = config
        self.directory = config.trainer.checkpoint_dir  # verl's trainer.default_local_dir, when it is set
        self.models = models
        self.sampler = sampler
        self.kl_controller = kl_controller
        self.ranks = ranks
        self.metrics_log = metrics_log
        self.publish_updates = publish_updates  # the checkpoint holds the weights and states after the last step
        self.send = send
        self.log, self.warn = log, warn
        self.tokenizer = tokenizer  # written beside the actor's weights: each checkpoint's actor is a model directory
        self.saved_at = 0  # the step of the latest checkpoint this process wrote (or resumed from)
        self.failures = 0  # saves that failed since the last step's metrics (checkpoint/failures)
        self._failing = False  # the latest save failed (checkpoint/failing)
        self._seconds = 0.0  # spent saving since the last step's metrics (timing_s/save_checkpoint)
        self._step_start: tuple[dict[str, Any], dict[str, Any]] | None = None  # the sampler's and RNG's states

    # ---------------------------------------------------------------------------------------- saving

    def save(self, step: int, *, final: bool = False) -> Path | None:
        """Checkpoint `step`. A checkpoint the disk cannot take does not end the run: it warns, counts, and the
        next save tries again; when it is the `final` one, the policy's weights are written alone instead and
        FinalCheckpointError says so."""
        start = time.perf_counter()
        try:
            return self._save(step, final)
        finally:
            self._seconds += time.perf_counter() - start

    def _save(self, step: int, final: bool) -> Path | None:
        self.publish_updates()
        state: dict[str, Any] = {
            "step": step,
            "actor": self.models.actor.state_dict(),
            "critic": self.models.critic.state_dict() if self.models.critic is not None else None,
            "sampler": self.sampler.state_dict(),
            "kl_controller": self.kl_controller.state_dict(),
            "rng": rng_state(),
        }
        keep = self.config.checkpoints_to_keep
        try:
            if self.ranks.distributed:
                state["rank_rngs"] = self.ranks.gather_objects(state["rng"])  # each rank's own sampling streams
                path = save_sharded_checkpoint(self.directory, step, self.models.trained(), state, ranks=self.ranks,
                                               keep=keep)
            else:
                # The names of the optimizers' parameters let a resume on several ranks find each one's states.
                state["parameter_names"] = self._parameter_names()
                path = save_checkpoint(self.directory, step, self.models.saved(), state, keep=keep,
                                       tokenizer=self.tokenizer)
        except CheckpointWriteError as error:
            self._failed(error, step, final=final)
            return None
        self.saved_at = step
        self._failing = False
        self.log(f"checkpoint saved: {path}")
        self.send(CheckpointMessage(step=step, path=str(path)))
        return path

    def _parameter_names(self) -> dict[str, list[str]]:
        """Each trained model's optimizer parameters by name, where they are the model's own (an offloaded bf16
        model's fp32 masters are not: that checkpoint resumes on one rank only)."""
        names = {}
        for role, (model, optimizer) in self.models.trained().items():
            with contextlib.suppress(CheckpointError):
                names[role] = parameter_names(model, optimizer)
        return names

    def _failed(self, error: CheckpointWriteError, step: int, *, final: bool) -> None:
        self.failures += 1
        self._failing = True
        complete = list_checkpoints(self.directory)
        latest = f"step {complete[-1][0]}" if complete else "none"
        if not final:
            self.warn(f"CHECKPOINT NOT SAVED: {error}; training goes on and the next save tries again (the latest "
                      f"complete checkpoint, which a restart resumes from: {latest})")
            return
        if self.ranks.distributed:
            raise FinalCheckpointError(f"the final checkpoint of step {step} was not saved: {error}; the latest "
                                       f"complete checkpoint: {latest}") from None
        try:
            weights = save_weights(self.directory, step, self.models.saved()["actor"])
        except CheckpointWriteError as weights_error:
            kept = f"the actor's weights alone could not be written either ({weights_error})"
        else:
            kept = (f"the actor's weights alone are in {weights} (safetensors; without optimizer states they "
                    "cannot resume the run)")
        raise FinalCheckpointError(f"the final checkpoint of step {step} was not saved: {error}; {kept}; the "
                                   f"latest complete checkpoint: {latest}") from None

    def metrics(self) -> dict[str, float]:
        """checkpoint/failures: saves that failed since the previous step's metrics; checkpoint/failing: 1 while the
        latest save has failed (a crash would lose every step since the last one written)."""
        metrics = {"checkpoint/failures": float(self.failures), "checkpoint/failing": float(self._failing)}
        if self._seconds > 0:
            # A save follows the line of the step it checkpoints (a crash between them must not lose the line), so
            # its time, as its failure, goes with the next step's metrics.
            metrics["timing_s/save_checkpoint"] = self._seconds
        self.failures, self._seconds = 0, 0.0
        return metrics

    def mark_step_start(self) -> None:
        """Remember what a step changes before its updates (the prompt sampler's position, the random streams), so
        that a step abandoned before them (a stop during a stuck reward call) can be undone: `rewind_step`."""
        self._step_start = (self.sampler.state_dict(), rng_state())

    def rewind_step(self, why: str) -> None:
        """Undo the abandoned step's draws: the checkpoint then saved is the last completed step's, as if the step
        had never started (its weights were not updated yet)."""
        assert self._step_start is not None, "mark_step_start() was not called"
        sampler, rng = self._step_start
        self.sampler.load_state_dict(sampler)
        set_rng_state(rng)
        self.log(f"{why}: the step is abandoned; the last completed step is checkpointed")

    # -------------------------------------------------------------------------------------- resuming

    def resume(self) -> int:
        """Continue from the checkpoint trainer.resume_mode points at; returns its step (0: a fresh start)."""
        mode = self.config.trainer.resume_mode
        if self.ranks.is_main:  # one rank clears the shared folder while the others wait
            remove_partial_checkpoints(self.directory)
        self.ranks.barrier()
        if mode == "disable":
            if list_checkpoints(self.directory):
                raise RunSetupError(f"{KEYS.trainer.resume_mode}: disable, but {self.directory} already holds "
                                    f"checkpoints; set {KEYS.trainer.resume_mode}=auto to continue that run, or choose "
                                    f"another {KEYS.trainer.experiment_name}")
            path = None
        elif mode == "resume_path":
            path = Path(self.config.trainer.resume_from_path)
            self._verified(path)
        else:
            # One rank reads the shared folder's checksums; every rank loads what it chose.
            path = self.ranks.broadcast_from_main(self._newest_verified() if self.ranks.is_main else None)
        if path is None:
            if self.ranks.is_main:
                self.metrics_log.truncate_after(-1)  # a fresh start: not even a step 0 (validation) line stays
            return 0
        step = self._restore(path)
        self.saved_at = step
        return step

    def _verified(self, path: Path) -> None:
        """The checkpoint the user named (trainer.resume_from_path), refused when its manifest says it is damaged:
        resume_path means that one, so there is nothing to fall back to."""
        verdict = verify_checkpoint(path) if path.is_dir() else None
        if verdict is not None and not verdict.ok:
            raise CheckpointError(f"cannot resume from {path}: {verdict.problem}; name another checkpoint in "
                                  f"{KEYS.trainer.resume_from_path}")
        if verdict is not None and not verdict.has_manifest:
            self.log(f"note: {path} predates checkpoint manifests: loaded without verifying its files")

    def _newest_verified(self) -> Path | None:
        """The newest checkpoint whose files are those its manifest lists (one without a manifest, written before
        checkpoints carried one, loads as before, with a note); a damaged newer one is one WARNING naming the
        damaged file and the step resumed from instead. None: a fresh start (no checkpoint, or none verifies: a
        WARNING says so)."""
        checkpoints = list_checkpoints(self.directory)
        damaged: list[tuple[int, str]] = []
        for step, path in reversed(checkpoints):
            verdict = verify_checkpoint(path)
            if not verdict.ok:
                damaged.append((step, verdict.problem or ""))
                continue
            if not verdict.has_manifest:
                self.log(f"note: {path} predates checkpoint manifests: loaded without verifying its files")
            if damaged:
                self.warn(f"the checkpoint of step {damaged[0][0]} is damaged ({damaged[0][1]}); resuming from the "
                          f"newest one that verifies, step {step}"
                          + (f" (also damaged: steps {', '.join(str(s) for s, _ in damaged[1:])})"
                             if len(damaged) > 1 else ""))
            return path
        if damaged:
            # Step 0 is the one state every run can rebuild (from trainer.seed): the run starts again from there, and
            # its saves replace the damaged checkpoints step by step.
            self.warn(f"every checkpoint in {self.directory} is damaged (the newest, step {damaged[0][0]}: "
                      f"{damaged[0][1]}); starting again from step 0")
        return None

    def _restore(self, path: Path) -> int:
        models = self.models
        try:
            state = (self._restore_models(path) if self.ranks.distributed or is_sharded_checkpoint(path)
                     else load_checkpoint(path, models.saved()))
            models.actor.load_state_dict(state["actor"])
            if models.critic is not None:
                models.critic.load_state_dict(state["critic"])
            self.sampler.load_state_dict(state["sampler"])
        except ValueError as error:
            raise CheckpointError(f"cannot resume from {path}: {error}") from None
        self.kl_controller.load_state_dict(state["kl_controller"])
        restore_rank_streams(state["rng"], state.get("rank_rngs"), rank=self.ranks.rank, dp_rank=self.ranks.dp_rank,
                             world_size=self.ranks.world_size, seed=self.config.trainer.seed, step=state["step"])
        step: int = state["step"]
        if self.ranks.is_main:
            self.metrics_log.truncate_after(step)
        self.log(f"resumed from {path} at step {step}")
        return step

    def _restore_models(self, path: Path) -> dict[str, Any]:
        """Weights and optimizer states across world sizes: a checkpoint of several ranks (DCP shards) into this
        run's sharded or whole models, or a one-rank checkpoint into sharded ones. Returns the trainer state."""
        state = load_trainer_state(path)
        trained = self.models.trained()
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
