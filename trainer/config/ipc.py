"""The messages between a trainer process and its daemon (no torch: both sides import it).

Transport: a Unix stream socket whose path the daemon passes in ``VERL_IPC_SOCKET``; one JSON
object per line (UTF-8, at most MAX_MESSAGE_BYTES). The connection is authenticated: the
socket file is mode 0600 and the first line must be a ``hello`` carrying ``VERL_IPC_TOKEN``;
anything else closes the connection. The trainer never waits on the daemon: messages it cannot
send at once are dropped and counted.

Up, trainer -> daemon (``type`` and fields):
- hello: protocol, token, pid, rank, run_dir, start_step, total_steps
- step: step, metrics (verl's names -> number or null), time
- phase: step (the step in progress), phase (gen, reward, old_log_prob, ref, values, adv,
  update_critic, update_actor, save_checkpoint, validate, idle), time
- offload: copies [{direction: h2d|d2h, group, bytes, seconds}] (the copies timed since the last
  offload message: a sample), counts [{direction, group, copies, bytes}] (every copy since the
  last one), summary [{role, group, device, bytes}] (summary only when it changes)
- log: level, message
- settings_ack: version, step (the first step that runs with them), values
- checkpoint: step, path
- dropped: count (messages the client dropped since the last report)

Down, daemon -> trainer:
- settings: version, values (every live setting, by public name)
- checkpoint_now: (no fields) save a checkpoint at the next safe point
- stop: (no fields) checkpoint at the next safe point and exit 0
"""

from __future__ import annotations

import json
from typing import Any

PROTOCOL_VERSION = 1
ENV_SOCKET = "VERL_IPC_SOCKET"
ENV_TOKEN = "VERL_IPC_TOKEN"
MAX_MESSAGE_BYTES = 1 << 20

UP_TYPES = ("hello", "step", "phase", "offload", "log", "settings_ack", "checkpoint", "dropped")
DOWN_TYPES = ("settings", "checkpoint_now", "stop")


class ProtocolError(ValueError):
    """A line that is not a message of this protocol."""


def encode(message: dict[str, Any]) -> bytes:
    """One message as a JSON line; NaN and infinities become null (JSON has neither)."""
    return (json.dumps(message, allow_nan=False, default=_jsonable, separators=(",", ":"))
            .encode("utf-8") + b"\n") if _finite(message) else encode(_nulls(message))


def decode(line: bytes, allowed_types: tuple[str, ...]) -> dict[str, Any]:
    """Parse one line; ProtocolError unless it is a JSON object with an allowed ``type``."""
    if len(line) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(line)} bytes, over the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        message = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ProtocolError(f"not a JSON line: {error}") from None
    if not isinstance(message, dict) or message.get("type") not in allowed_types:
        raise ProtocolError(f"unknown message type {message.get('type') if isinstance(message, dict) else None!r}")
    return message


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if isinstance(value, dict):
        return all(_finite(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(item) for item in value)
    return True


def _nulls(value: Any) -> Any:
    if isinstance(value, float) and not _finite(value):
        return None
    if isinstance(value, dict):
        return {key: _nulls(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nulls(item) for item in value]
    return value


def _jsonable(value: Any) -> Any:
    # numpy scalars and the like: anything with .item() becomes a plain number.
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
