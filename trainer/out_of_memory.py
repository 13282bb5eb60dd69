"""An out-of-device-memory error the trainer cannot recover from, as one ERROR line that says what to change.

Recovery (trainer/workers/recovery.py) moves layers to the CPU and splits micro-batches; once a micro-batch of one
sequence fails with nothing left to free it raises `SequenceOutOfMemory`, and a restart would meet it again. The
step's phases run inside `PhaseWatch.reported()` (trainer/loop.py), which turns that error into an
`OutOfMemoryInPhase`: a UserError, so trainer/main.py prints one line and exits 2, which the daemon does not restart.
The line names the phase, the memory torch said it had, the micro-batch (1 sequence of N tokens), and the config keys
that lower that phase's memory and are not set so already:

    ERROR: out of device memory in the critic's update (update_critic) on a micro-batch of 1 sequence of 4112 tokens
    (prompt 16, response 4096), with nothing left to move to the CPU or split: this process had 12.71 GiB in use, of
    12.00 GiB allowed, and asked for 88.00 MiB more. To lower this phase's memory: critic.model.
    enable_gradient_checkpointing=true; a shorter data.max_response_length (now 4096); ...
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from trainer.config import KEYS, RunConfig
from trainer.config.keys import Key
from trainer.errors import UserError
from trainer.workers.recovery import SequenceOutOfMemory


class OutOfMemoryInPhase(UserError):
    """One sequence of a step's phase did not fit on the device with nothing left to free: the message says which
    phase, the memory and what to change (exit code 2, not restarted)."""

    rank_local = True  # one rank can run out alone; it prints its own line


@dataclass(frozen=True)
class _Model:
    """Where a phase's model is configured: what lowers its memory."""

    name: str
    fsdp: Key
    checkpointing: Key | None
    ulysses: Key | None


def _models() -> dict[str, _Model]:
    actor = KEYS.actor_rollout_ref
    policy = _Model("actor", actor.actor.fsdp_config, actor.model.enable_gradient_checkpointing,
                    actor.actor.ulysses_sequence_parallel_size)
    critic = _Model("critic", KEYS.critic.fsdp_config, KEYS.critic.model.enable_gradient_checkpointing,
                    KEYS.critic.ulysses_sequence_parallel_size)
    return {"gen": policy, "old_log_prob": policy, "update_actor": policy, "values": critic, "update_critic": critic,
            "ref": _Model("reference", actor.ref.fsdp_config, None, actor.actor.ulysses_sequence_parallel_size),
            "reward": _Model("reward model", KEYS.reward_model.model.fsdp_config, None, None)}


PHASE_NAMES = {"gen": "the rollout", "reward": "the reward model's scores", "old_log_prob": "the actor's log-probs",
               "ref": "the reference's log-probs", "values": "the critic's values",
               "update_critic": "the critic's update", "update_actor": "the actor's update"}
"""What each phase of a step (trainer/config/messages.Phase) is, in a user's words."""

_SIZE = r"([\d.]+ [KMGTP]?i?B)"


def memory_said(detail: str) -> str:
    """The memory figures of torch's CUDA out-of-memory message, in a sentence (torch's own line where it has none
    of them)."""
    found = {name: re.search(pattern, detail) for name, pattern in (
        ("in_use", rf"this process has {_SIZE} memory in use"), ("allowed", rf"{_SIZE} allowed"),
        ("capacity", rf"total capacity of {_SIZE}"), ("asked", rf"Tried to allocate {_SIZE}"))}
    sizes = {name: match.group(1) for name, match in found.items() if match is not None}
    if "in_use" not in sizes and "asked" not in sizes:
        return f"torch said: {detail[:300]}"
    said = f"this process had {sizes['in_use']} in use" if "in_use" in sizes else "this process"
    if "allowed" in sizes:
        said += f", of {sizes['allowed']} allowed"
    elif "capacity" in sizes:
        said += f", on a card of {sizes['capacity']}"
    if "asked" in sizes:
        said += f", and asked for {sizes['asked']} more"
    return said


def lowering_keys(phase: str, config: RunConfig) -> list[str]:
    """The settings that lower the memory of `phase`, each only where the config does not set it so already."""
    model = _models().get(phase)
    advice = []
    if model is None:
        return [f"a shorter {KEYS.data.max_response_length} (now {config.data.max_response_length})"]
    if model.checkpointing is not None and phase.startswith("update") and not _value(config, model.checkpointing):
        advice.append(f"{model.checkpointing}=true (recompute each layer's activations in the backward)")
    advice.append(f"a shorter {KEYS.data.max_response_length} (now {config.data.max_response_length})")
    fsdp = model.fsdp
    if not _value(config, fsdp.param_offload) and not _value(config, fsdp.dynamic_offload.enabled):
        advice.append(f"{fsdp.param_offload}=true or {fsdp.dynamic_offload.enabled}=true (its layers stream from "
                      "the CPU)")
    elif _value(config, fsdp.dynamic_offload.enabled) and config.dynamic_offload.min_transformer_layers_on_gpu:
        advice.append(f"a lower {KEYS.dynamic_offload.min_transformer_layers_on_gpu} "
                      f"(now {config.dynamic_offload.min_transformer_layers_on_gpu})")
    if phase.startswith("update") and not _value(config, fsdp.optimizer_offload):
        advice.append(f"{fsdp.optimizer_offload}=true (the optimizer's states on the CPU)")
    if model.ulysses is not None and _value(config, model.ulysses) == 1:
        advice.append(f"{model.ulysses}=2 or more (each GPU of several holds a share of the sequence)")
    return advice


def _value(config: RunConfig, key: Key) -> object:
    value: object = config
    for part in str(key).split("."):
        value = getattr(value, part)
    return value


def describe(phase: str, error: SequenceOutOfMemory, config: RunConfig) -> str:
    """The ERROR line's text for `error` in `phase`."""
    what = PHASE_NAMES.get(phase, "a step's phase")
    tokens = ""
    if error.tokens is not None:
        prompt, response = error.tokens
        tokens = f" of {prompt + response} tokens (prompt {prompt}, response {response})"
    return (f"out of device memory in {what} ({phase}) on a micro-batch of 1 sequence{tokens}, with nothing left to "
            f"move to the CPU or split: {memory_said(error.detail)}. To lower this phase's memory: "
            + "; ".join(lowering_keys(phase, config)))


class PhaseWatch:
    """The step timer's `on_phase`: remembers the phase that runs (and passes it on), so that an out-of-memory
    error nothing could recover from is reported with the phase it happened in."""

    def __init__(self, config: RunConfig, on_phase: Callable[[str], None]):
        self.config = config
        self._on_phase = on_phase
        self.phase = "step"

    def phase_started(self, name: str) -> None:
        self.phase = name
        self._on_phase(name)

    @contextlib.contextmanager
    def reported(self) -> Iterator[None]:
        """Around a step: a SequenceOutOfMemory leaves as an OutOfMemoryInPhase (one line, exit code 2)."""
        try:
            yield
        except SequenceOutOfMemory as error:
            raise OutOfMemoryInPhase(describe(self.phase, error, self.config)) from None
