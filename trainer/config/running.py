"""The sections that say how the run runs rather than what it trains: trainer (its length, checkpoints, device,
ranks and trackers), telemetry (the daemon's API) and daemon (the supervision of the trainer process). Part of
the schema (trainer/config/schema.py)."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from trainer.config.fields import GpuSampleInterval, LogLevel, PcieSampleInterval, Section, TrackerBackend, show


class TrainerConfig(Section):
    project_name: str = "verl_offload"
    """Project the run belongs to (shown in logs and telemetry)."""
    experiment_name: str = "run"
    """Name of the run; its files go to <runs_dir>/<experiment_name>/."""
    runs_dir: str = "runs"
    """Folder that holds the run directories."""
    total_epochs: int = Field(1, ge=1)
    """Passes over the training prompts."""
    total_training_steps: int | None = Field(None, ge=1)
    """Steps to train; wins over total_epochs when set."""
    save_freq: int = Field(-1, ge=-1)
    """Checkpoint every this many steps (-1: only at the end)."""
    max_ckpt_to_keep: int | None = Field(None, ge=1)
    """Keep only the newest this many checkpoints; unset keeps all (or verl's max_*_ckpt_to_keep)."""
    max_actor_ckpt_to_keep: int | None = Field(None, ge=1)
    """verl's key: checkpoints kept for the actor; one checkpoint holds both models, so the larger count wins."""
    max_critic_ckpt_to_keep: int | None = Field(None, ge=1)
    """verl's key: checkpoints kept for the critic; one checkpoint holds both models, so the larger count wins."""
    default_local_dir: str | None = None
    """verl's key: the folder of the global_step_N checkpoints; unset: <runs_dir>/<experiment_name>/checkpoints."""
    test_freq: int = Field(-1, ge=-1)
    """Validate every this many steps (-1: never; needs data.val_files)."""
    val_before_train: bool = True
    """Validate once before the first step (a fresh run with data.val_files); metrics at step 0."""
    val_only: bool = False
    """Only validate (as val_before_train does), then stop without training."""
    log_val_generations: int = Field(0, ge=0)
    """Validation samples (prompt, response, score) each validation writes to the log and trackers (0: none)."""
    validation_data_dir: str | None = None
    """A folder each validation writes all its responses to, as <step>.jsonl (input, output, gts, score, step)."""
    rollout_data_dir: str | None = None
    """A folder each step writes its responses to, every rank's, as <step>.jsonl (as validation_data_dir's)."""
    max_nonfinite_steps: int | None = Field(3, ge=1)
    """Steps in a row whose loss, gradient norm or reward is NaN or infinite that end the run (null: never)."""
    critic_warmup: int = Field(0, ge=0)
    """Steps at the start of a run that update the critic only; the actor's updates start after them."""
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    """auto resumes from the run's latest complete checkpoint; resume_path from resume_from_path."""
    resume_from_path: str | None = None
    """A checkpoint directory (global_step_N) to resume from with resume_mode resume_path."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Compute device: auto takes the GPU when there is one."""
    cpu_threads: int | None = Field(None, ge=1)
    """Threads of the trainer's CPU work (torch intra-op); unset: all cores, or a rank's share; cores - 1 spares one."""
    seed: int = 1
    """Seed of model init, sampling and everything else random."""
    nnodes: int = Field(1, ge=1)
    """Nodes of the run: one `verl train` on each, all given the same trainer.rdzv_endpoint."""
    n_gpus_per_node: int = Field(1, ge=1)
    """GPUs (ranks) per node; above 1 they run under torch.distributed's elastic launcher (device cpu: gloo ranks)."""
    node_rank: int = Field(0, ge=0)
    """This node's place in trainer.nnodes (0: global rank 0); unset: NODE_RANK, PET_NODE_RANK or SLURM_NODEID."""
    rdzv_endpoint: str | None = None
    """host:port of node 0 where the nodes meet; unset: PET_RDZV_ENDPOINT or MASTER_ADDR:MASTER_PORT."""
    logger: list[TrackerBackend] = ["console"]
    """Trackers for each step's metrics, one or a list of: console, wandb, tensorboard, mlflow, swanlab, file."""

    @field_validator("logger", mode="before")
    @classmethod
    def _one_tracker_is_a_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list | tuple):
            names = " or ".join(repr(name) for name in typing.get_args(TrackerBackend))
            raise ValueError(f"got {show(value)}; allowed: a tracker's name ({names}) or a list of them")
        return value

    @field_validator("logger")
    @classmethod
    def _each_tracker_once(cls, backends: list[str]) -> list[str]:
        """Each tracker once, in the order given (whether its library is installed: environment.py)."""
        return list(dict.fromkeys(backends))

    @field_validator("experiment_name")
    @classmethod
    def _usable_as_folder_name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise ValueError(f"got {name!r}, which cannot name a run folder; allowed: letters, digits, "
                             "'.', '_' and '-', starting with a letter or digit")
        return name

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.experiment_name

    @property
    def checkpoint_dir(self) -> Path:
        """Where the global_step_N checkpoints go: default_local_dir when set (it wins), else the run's folder."""
        if self.default_local_dir is not None:
            return Path(self.default_local_dir).expanduser()
        return self.run_dir / "checkpoints"


    @field_validator("save_freq", "test_freq", mode="before")
    @classmethod
    def _frequency_of_a_boolean(cls, value: Any) -> Any:
        """verl compares a frequency with `> 0` and takes it modulo the step, so its scripts' `test_freq=false` runs
        (never) and `true` is every step: read so here, rather than as the boolean-for-a-number mistake."""
        return (1 if value else -1) if isinstance(value, bool) else value

class TelemetryConfig(Section):
    host: str = "127.0.0.1"
    """Address the API binds; anything but loopback exposes it beyond this machine (token still needed)."""
    port: int = Field(0, ge=0, le=65535)
    """API port; 0 picks a free one (printed at start and kept in the runtime file)."""
    public_metrics: bool = False
    """Serve /metrics without the token, for a Prometheus that cannot send it."""
    gpu_sample_interval_s: GpuSampleInterval = 1.0
    """Seconds between GPU samples (utilization, memory, power, temperature)."""
    pcie_sample_interval_s: PcieSampleInterval = 10.0
    """Seconds between PCIe throughput samples (each NVML call blocks ~20 ms)."""
    history_seconds: int = Field(900, ge=10, le=86400)
    """How far back the daemon keeps samples for monitors that attach late."""
    allowed_origins: list[str] = []
    """Extra browser origins allowed to open the WebSocket stream (the API's own is always allowed)."""


class DaemonConfig(Section):
    max_restarts: int = Field(3, ge=0)
    """Restart a crashed trainer at most this many times, resuming from its latest checkpoint."""
    restart_backoff_s: float = Field(1.0, ge=0.0, le=600.0)
    """Wait before the first restart; doubles with each further one."""
    restart_backoff_max_s: float = Field(60.0, ge=0.0, le=3600.0)
    """Longest wait between restarts."""
    stop_timeout_s: float = Field(300.0, gt=0.0)
    """On stop, how long the trainer may take to reach a safe point and checkpoint before it is killed."""
    force_stop_grace_s: float = Field(10.0, ge=0.0, le=3600.0)
    """A SIGTERM/SIGINT this long after the first kills the trainer without a checkpoint; sooner, the same stop."""
    hang_timeout_s: float | None = Field(None, gt=0.0)
    """Restart a trainer silent this long (stacks to logs/trainer.log); unset: 5x the median step, >= 600 s."""
    state_dir: str | None = None
    """Where runtime files live; unset uses $VERL_STATE_DIR, else $XDG_STATE_HOME/verl, else ~/.local/state/verl."""
    log_level: LogLevel = "info"
    """Least severe log lines kept by the daemon and the trainer."""
