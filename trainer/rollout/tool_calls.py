"""The model's tool calls in a turn's text, in verl's `hermes` format (multi_turn.format; `qwen` writes the same):
each call a JSON object {"name": ..., "arguments": {...}} between <tool_call> and </tool_call>, as Qwen2.5's and
Hermes' chat templates ask a model to write it (verl's HermesToolParser, after vLLM's)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote."""

    name: str
    """The function's name (a tool's tool_schema.function.name)."""
    arguments: dict[str, Any]
    """Its arguments, as the model wrote them (not checked against the schema: the tool reads what it needs)."""


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A turn's text -> (the text less its calls, the calls in order). A call whose JSON does not parse, or has no
    string name or no object of arguments, is left out, as verl leaves it out (no call runs for it)."""
    if "<tool_call>" not in text or "</tool_call>" not in text:
        return text, []
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                continue
        if isinstance(arguments, dict):
            calls.append(ToolCall(call["name"], arguments))
    return TOOL_CALL.sub("", text), calls


def truncated(text: str, length: int, side: str) -> str:
    """A tool response's text cut to about `length` characters as verl cuts it (multi_turn.max_tool_response_length,
    tool_response_truncate_side): left keeps its start, right its end, middle both halves; the cut is marked."""
    if len(text) <= length:
        return text
    if side == "left":
        return text[:length] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-length:]
    half = length // 2
    return text[:half] + "...(truncated)..." + text[-half:]
