"""Every message between a trainer process and its daemon, and the /v1/status body: one model each.

The trainer builds these models and its telemetry client encodes them (trainer/telemetry.py); the
daemon decodes each line into one of them (daemon/ipc.py) and hands the typed object on to the hub,
the Prometheus metrics and the REST API (api/). The transport (socket, hello, line limit) is
described in trainer/config/ipc.py; this module is the protocol's field list.

Up, trainer -> daemon (`UpMessage`, told apart by ``type``): HelloMessage, StepMessage,
PhaseMessage, OffloadMessage, LogMessage, SettingsAckMessage, CheckpointMessage, DroppedMessage,
HeartbeatMessage.
Down, daemon -> trainer (`DownMessage`): SettingsMessage, CheckpointNowMessage, StopMessage.

On the wire each message is one JSON object whose keys are the field names below (settings values
under their canonical names, e.g. ``dynamic_offload.gpu_memory_threshold``). Numbers that JSON cannot hold (NaN,
infinities) go out as null: see `to_json`, which the daemon's event stream uses too. Unknown fields
are refused, so a change of fields is a change of PROTOCOL_VERSION.

Torch-free: the daemon and the API import it.
"""

from __future__ import annotations

from enum import StrEnum
from time import time as epoch_seconds
from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from trainer.config.fields import LogLevel, Placement
from trainer.config.live import LiveSettings


def to_json(value: Any, *, exclude: dict[str, set[str]] | None = None) -> bytes:
    """`value` (models, dicts, lists, numbers, strings) as compact JSON in UTF-8, less the nested
    keys in `exclude` ({key: {nested keys}}, as pydantic takes it).

    NaN and infinities become null: JSON has neither, and a reader in another language would
    refuse the whole line for one of them. pydantic's serializer does this while it writes (no
    second walk over the data), also for values nested in plain dicts; settings values come out
    under their canonical names (aliases).
    """
    return pydantic_core.to_json(value, by_alias=True, inf_nan_mode="null", exclude=exclude)


# ------------------------------------------------------------------------------------ the names


class Phase(StrEnum):
    """What the trainer is doing: the phases of an RL step in the order a step runs them
    (trainer/loop.py's train_step; ref, values and update_critic only with those models), and
    saving a checkpoint. Each step phase is also timed, as the step metric ``timing_s/<phase>``."""

    GEN = "gen"
    REWARD = "reward"
    OLD_LOG_PROB = "old_log_prob"
    REF = "ref"
    VALUES = "values"
    ADV = "adv"
    UPDATE_CRITIC = "update_critic"
    UPDATE_ACTOR = "update_actor"
    SAVE_CHECKPOINT = "save_checkpoint"


class Direction(StrEnum):
    """Which way an offload copy went."""

    H2D = "h2d"
    """Host to device: a group coming to the GPU for a pass."""
    D2H = "d2h"
    """Device to host: gradients (or layers moved by dynamic offload) going back."""


class Group(StrEnum):
    """The module groups that offload_policy places (trainer/offload/groups.py), in model order,
    and ``other``: parameters in none of them, which always stay on the compute device."""

    EMBEDDING = "embedding"
    TRANSFORMER = "transformer"
    NORM = "norm"
    LM_HEAD = "lm_head"
    OTHER = "other"


class Role(StrEnum):
    """The models of a run that the offload engine places (bounded: they become metric labels)."""

    ACTOR = "actor"
    CRITIC = "critic"
    REF = "ref"
    REWARD = "reward"


RunState = Literal["starting", "running", "restarting", "stopping", "finished", "failed"]
"""The supervisor's state of the run (daemon/supervisor.py)."""


class Message(BaseModel):
    """A part of the protocol: unknown fields refused, never changed once built (the daemon's hub
    encodes an event once for all its subscribers)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


# ----------------------------------------------------------------------------- offload records


class CopySample(Message):
    """One timed host<->device copy (CUDA events; the host clock on a CPU-only machine). The
    trainer times a sample of its copies: see CopyCount for all of them."""

    direction: Direction
    group: Group
    bytes: int = Field(ge=0)
    seconds: float = Field(ge=0)
    """Time the copy took on its stream (several copies folded into one record: their sum)."""


class CopyCount(Message):
    """Every copy of one direction and group since the previous offload message."""

    direction: Direction
    group: Group
    copies: int = Field(ge=0)
    bytes: int = Field(ge=0)


class OffloadSummaryRow(Message):
    """Where one module group of one model lives, and its parameters' size."""

    role: Role
    group: Group
    placement: Placement
    """offload_policy's choice: cpu (offloaded to the host, streamed in for each pass) or gpu (resident on
    the compute device)."""
    device: Placement
    """The device that holds the group's parameters: cpu for an offloaded group, and for every group of a
    run that computes on the CPU."""
    bytes: int = Field(ge=0)


class PhasePlanRow(Message):
    """How one phase of a step places the dynamically offloaded models' layers (the phase planner of
    trainer/offload/dynamic.py), and what for."""

    phase: str
    """The phase and the model it runs: "rollout/actor", "training/critic", "scoring/ref", ..."""
    layers_on_gpu: dict[str, int]
    """Each dynamically offloaded model's transformer layers on the GPU during the phase, by role."""
    working_bytes: int | None = Field(ge=0)
    """What the phase needs on the GPU besides those layers, learned from its peak (null: not learned
    yet, the phase has not completed a run)."""
    threshold: float
    """The GPU memory threshold the plan was made for."""


# ----------------------------------------------------------------------------------- up messages


class HelloMessage(Message):
    """The first line of every connection; anything else, or a wrong token or protocol, closes it."""

    type: Literal["hello"] = "hello"
    protocol: int
    """PROTOCOL_VERSION of the trainer's side."""
    token: str
    """VERL_IPC_TOKEN, as the daemon put it in the trainer's environment."""
    pid: int
    rank: int = Field(ge=0)
    """The trainer's global rank (0 when the run is one process)."""
    local_rank: int = Field(0, ge=0)
    """Its rank on its node: the index of the local GPU it computes on (LOCAL_RANK)."""
    run_dir: str
    start_step: int = Field(ge=0)
    """The last step completed (after a reconnect: the last one reported)."""
    total_steps: int = Field(ge=0)


class StepMessage(Message):
    """A completed step and its metrics."""

    type: Literal["step"] = "step"
    step: int = Field(ge=0)
    metrics: dict[str, float | None]
    """verl's names (actor/pg_loss, timing_s/gen, ...) -> number; null for NaN and infinities."""
    time: float = Field(default_factory=epoch_seconds)


class RankReport(Message):
    """One rank's own figures at a step's end (RanksMessage)."""

    rank: int = Field(ge=0)
    local_rank: int = Field(ge=0)
    node_rank: int = Field(ge=0)
    step: int = Field(ge=0)
    gpu_memory_bytes: float | None = Field(ge=0)
    """Peak device memory torch allocated in that step (its perf/max_memory_allocated_gb)."""
    copy_latency_mean_s: float | None = Field(None, ge=0)
    """Mean time of its latest offload message's timed copies (OffloadMessage.copy_latency_mean_s; null: none timed),
    so that node 0's advisor compares the copy times of ranks on different nodes."""
    gpu_utilization_percent: float | None = Field(None, ge=0, le=100)
    """NVML's utilization of its GPU, read by the rank at the step's end (null: a CPU rank, or NVML unreadable), so
    that node 0's monitor shows the other nodes' GPUs too."""


class RanksMessage(Message):
    """Every rank's own figures at a step's end, which rank 0 gathers with the step's metrics, on a run of several
    nodes: each rank reports to its own node's daemon, so node 0's would otherwise know only node 0's ranks, and a
    monitor attached there would show a part of the run."""

    type: Literal["ranks"] = "ranks"
    step: int = Field(ge=0)
    ranks: list[RankReport]
    time: float = Field(default_factory=epoch_seconds)


class PhaseMessage(Message):
    """The trainer entered a phase."""

    type: Literal["phase"] = "phase"
    step: int = Field(ge=0)
    """The step in progress (one more than the last completed)."""
    phase: Phase
    time: float = Field(default_factory=epoch_seconds)


class OffloadMessage(Message):
    """The offload engines' copies since the previous offload message (one a step)."""

    type: Literal["offload"] = "offload"
    copies: list[CopySample]
    """A sample of the copies, timed (at most MAX_RECORDS_PER_DRAIN of trainer/offload/copies.py)."""
    counts: list[CopyCount]
    """Every copy, counted."""
    summary: list[OffloadSummaryRow] | None = None
    """Every model's placement; sent with a trainer process's first offload message, else null."""
    plans: list[PhasePlanRow] | None = None
    """Every phase's plan of the dynamic layers so far (null: no model's layers move dynamically)."""
    time: float = Field(default_factory=epoch_seconds)

    @property
    def copy_latency_mean_s(self) -> float | None:
        """The mean time of the timed copies (None: none timed), as a rank reports it to another node (RankReport)."""
        return sum(copy.seconds for copy in self.copies) / len(self.copies) if self.copies else None


class LogMessage(Message):
    """A line of the trainer's log, for the daemon's stream."""

    type: Literal["log"] = "log"
    level: LogLevel
    message: str
    time: float = Field(default_factory=epoch_seconds)


class SettingsAckMessage(Message):
    """The trainer runs settings `version` from `step` on."""

    type: Literal["settings_ack"] = "settings_ack"
    version: int = Field(ge=0)
    step: int = Field(ge=0)
    """The first step that runs with them."""
    values: LiveSettings
    time: float = Field(default_factory=epoch_seconds)


class CheckpointMessage(Message):
    """A checkpoint was saved."""

    type: Literal["checkpoint"] = "checkpoint"
    step: int = Field(ge=0)
    path: str
    time: float = Field(default_factory=epoch_seconds)


class DroppedMessage(Message):
    """Messages the trainer's client dropped (daemon absent or slow) since its last report."""

    type: Literal["dropped"] = "dropped"
    count: int = Field(ge=1)
    time: float = Field(default_factory=epoch_seconds)


class HeartbeatMessage(Message):
    """The trainer's main thread is making progress (sent from its loop and from inside long phases, at most
    about once a second). A trainer that sends neither this nor a step, phase, checkpoint or settings
    acknowledgement for daemon.hang_timeout_s is taken to hang."""

    type: Literal["heartbeat"] = "heartbeat"
    step: int = Field(ge=0)
    """The step in progress (one more than the last completed)."""
    time: float = Field(default_factory=epoch_seconds)


UpMessage = Annotated[HelloMessage | StepMessage | PhaseMessage | OffloadMessage | LogMessage | SettingsAckMessage
                      | CheckpointMessage | DroppedMessage | HeartbeatMessage | RanksMessage,
                      Field(discriminator="type")]
"""Any message from a trainer to its daemon."""

# --------------------------------------------------------------------------------- down messages


class SettingsMessage(Message):
    """Every live setting's current value: the trainer applies them at its next safe point and
    acknowledges (SettingsAckMessage). Sent after each hello too, so a change outlives a restart."""

    type: Literal["settings"] = "settings"
    version: int = Field(ge=0)
    values: LiveSettings


class CheckpointNowMessage(Message):
    """Save a checkpoint at the next safe point."""

    type: Literal["checkpoint_now"] = "checkpoint_now"


class StopMessage(Message):
    """Save a checkpoint at the next safe point and exit 0."""

    type: Literal["stop"] = "stop"


DownMessage = Annotated[SettingsMessage | CheckpointNowMessage | StopMessage, Field(discriminator="type")]
"""Any message from the daemon to a trainer."""

UP_MESSAGES: TypeAdapter[UpMessage] = TypeAdapter(UpMessage)
DOWN_MESSAGES: TypeAdapter[DownMessage] = TypeAdapter(DownMessage)

# --------------------------------------------------------------------------- the /v1/status body


class RunInfo(Message):
    """Which run this is and where to find it."""

    name: str
    project: str
    run_dir: str
    config_path: str
    daemon_pid: int
    trainer_pids: list[int]
    state: RunState
    started_at: float
    """When the daemon started (epoch seconds)."""
    uptime_s: float
    url: str
    """The API's base URL."""
    node_rank: int = Field(0, ge=0)
    """The node this daemon serves (trainer.node_rank); node 0's daemon holds the run-wide control."""
    nnodes: int = Field(1, ge=1)
    world_size: int = Field(1, ge=1)
    """Trainer ranks of the whole run (trainer.nnodes * trainer.n_gpus_per_node)."""


class Progress(Message):
    """How far the run is, as the rank-0 trainer last reported."""

    step: int = Field(ge=0)
    """The last completed step."""
    total_steps: int | None = Field(ge=0)
    """The step the run is to reach (null: not yet known, before the trainer's first hello)."""
    phase: Phase | None
    """The phase in progress; null while no trainer is connected."""
    phase_since: float | None
    """When that phase began (epoch seconds, the daemon's clock)."""


class Restarts(Message):
    """Trainer restarts so far, and how many the daemon allows."""

    total: int = Field(ge=0)
    max: int = Field(ge=0)
    """daemon.max_restarts."""
    by_reason: dict[str, int]
    """crash, signal, oom, ... -> count."""
    last_failure: str | None = None
    """Why the latest trainer failed: the final line of its last traceback or ERROR line, where it hung, or what
    killed it (null: none failed)."""


class SettingsState(Message):
    """The live settings: the current version and whether the trainer runs it yet."""

    version: int = Field(ge=0)
    values: LiveSettings
    acknowledged_version: int = Field(ge=0)
    """The newest version the trainer has acknowledged."""
    applied_at_step: int | None
    """The step from which the trainer runs the acknowledged version (null: not yet known)."""


class TelemetryHealth(Message):
    """Whether the daemon's telemetry sees everything."""

    nvml: bool
    """NVML answers: GPU metrics are live."""
    dropped_messages: int = Field(ge=0)
    """Trainer messages lost so far (dropped by the trainer's client, or refused as malformed)."""


class OffloadPlacement(Message):
    """Where each model's module groups live (empty until the trainer's first offload message), and how
    each phase places the dynamically offloaded layers (empty until a phase has run, or without them)."""

    summary: list[OffloadSummaryRow]
    plans: list[PhasePlanRow] = []


class RankStatus(Message):
    """One trainer rank, as it last reported: one of this daemon's node or, on node 0's daemon, one of another node
    (as rank 0 gathered its figures at the last step's end: no process here)."""

    rank: int = Field(ge=0)
    """Its global rank."""
    local_rank: int = Field(ge=0)
    """Its rank on its node: the local GPU it computes on."""
    node_rank: int = Field(0, ge=0)
    """The node it runs on (trainer.node_rank of that node's daemon)."""
    pid: int | None
    """Its process (null: not connected yet in this attempt, or on another node)."""
    connected: bool
    """Connected to this daemon; for another node's rank, reported by rank 0 within the daemon's hang timeout."""
    step: int | None = Field(ge=0)
    """The last step it completed (null: none reported yet)."""
    heard_s_ago: float | None = Field(ge=0)
    """Seconds since its last message (null: never heard from)."""
    gpu_memory_bytes: float | None = Field(ge=0)
    """Peak device memory torch allocated in its latest step (perf/max_memory_allocated_gb)."""
    copy_latency_mean_s: float | None = Field(ge=0)
    """Mean time of its recent timed offload copies (null: none timed yet)."""
    gpu_utilization_percent: float | None = Field(None, ge=0, le=100)
    """Another node's rank: NVML's utilization of its GPU at its latest step's end, as rank 0 reported it (null for
    this node's ranks, whose GPUs the daemon samples itself)."""


class RunStatus(Message):
    """The GET /v1/status body."""

    run: RunInfo
    progress: Progress
    restarts: Restarts
    settings: SettingsState
    telemetry: TelemetryHealth
    offload: OffloadPlacement
    ranks: list[RankStatus] = []
    """Every trainer rank of this node, by rank (one with rank 0 for a single-process run); on node 0's daemon of a
    run of several nodes, the other nodes' ranks too."""
