"""How a trainer process and its daemon talk (no torch: both sides import it).

Transport: a Unix stream socket whose path the daemon passes in ``VERL_IPC_SOCKET``; one JSON
object per line (UTF-8, at most MAX_MESSAGE_BYTES). The connection is authenticated: the
socket file is mode 0600 and the first line must be a ``hello`` carrying ``VERL_IPC_TOKEN``;
anything else closes the connection. The trainer never waits on the daemon: messages it cannot
send at once are dropped and counted.

The messages, every type and field, are the models of trainer/config/messages.py: `UpMessage`
(trainer -> daemon) and `DownMessage` (daemon -> trainer). `encode` writes one of them as a line;
`decode_up` and `decode_down` read a line back into its model, or raise ProtocolError saying
what is wrong with it.
"""

from __future__ import annotations

import signal
from typing import TypeVar

from pydantic import TypeAdapter, ValidationError
from pydantic_core import ErrorDetails

from trainer.config.messages import DOWN_MESSAGES, UP_MESSAGES, DownMessage, UpMessage, to_json

PROTOCOL_VERSION = 7  # 2: heartbeats; 3: hello.local_rank; 4: the ranks message (several nodes); 5: its copy latency;
# 6: its GPU utilization; 7: live settings under their canonical names (dynamic_offload.gpu_memory_threshold)
ENV_SOCKET = "VERL_IPC_SOCKET"
ENV_TOKEN = "VERL_IPC_TOKEN"
ENV_DAEMON_PID = "VERL_DAEMON_PID"
"""The daemon's pid: a trainer whose daemon has died stops (trainer/telemetry.py: die_with_daemon)."""
STACK_DUMP_SIGNAL = signal.SIGUSR1
"""On this signal a trainer writes every thread's Python stack to logs/trainer.log (faulthandler): the
daemon sends it to a trainer that hangs, before it restarts it."""
MAX_MESSAGE_BYTES = 1 << 20
MAX_PROBLEMS_SHOWN = 3
"""A ProtocolError names at most this many bad fields of one line."""

Decoded = TypeVar("Decoded")


class ProtocolError(ValueError):
    """A line that is not a message of this protocol; the text says why."""


def encode(message: UpMessage | DownMessage) -> bytes:
    """One message as a JSON line (NaN and infinities as null: see messages.to_json)."""
    return to_json(message) + b"\n"


def decode_up(line: bytes) -> UpMessage:
    """A trainer's line as its message; ProtocolError unless it is one."""
    return _decode(line, UP_MESSAGES)


def decode_down(line: bytes) -> DownMessage:
    """A daemon's line as its message; ProtocolError unless it is one."""
    return _decode(line, DOWN_MESSAGES)


def _decode(line: bytes, messages: TypeAdapter[Decoded]) -> Decoded:
    if len(line) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(line)} bytes, over the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        return messages.validate_json(line)
    except ValidationError as error:
        raise ProtocolError(_describe(error.errors(include_url=False))) from None


def _describe(problems: list[ErrorDetails]) -> str:
    """pydantic's findings as one line: what kind of line it was and each bad field with its value."""
    first = problems[0]
    if first["type"] == "json_invalid":
        return f"not a JSON line ({_uncapitalized(first['msg'])})"
    if first["type"] in ("union_tag_invalid", "union_tag_not_found", "dict_type", "model_type"):
        return f"not a message of this protocol: {_uncapitalized(first['msg'])}"
    kind = first["loc"][0]  # the discriminated union puts the message's type first
    fields = "; ".join(_field_problem(problem) for problem in problems[:MAX_PROBLEMS_SHOWN])
    more = len(problems) - MAX_PROBLEMS_SHOWN
    return f"bad {kind} message: {fields}" + (f" (and {more} more)" if more > 0 else "")


def _field_problem(problem: ErrorDetails) -> str:
    """E.g. "copies.0.direction: input should be 'h2d' or 'd2h', got 'sideways'"."""
    field = ".".join(str(part) for part in problem["loc"][1:]) or "message"
    if problem["type"] == "missing":
        return f"{field}: {_uncapitalized(problem['msg'])}"
    given = repr(problem["input"])
    return f"{field}: {_uncapitalized(problem['msg'])}, got {given[:60] + '...' if len(given) > 60 else given}"


def _uncapitalized(text: str) -> str:
    return text[:1].lower() + text[1:]
