"""The model's tool calls in a turn's text, in verl's formats (multi_turn.format, verl's tool parsers):

- `hermes` (`qwen` writes the same): each call a JSON object {"name": ..., "arguments": {...}} between <tool_call>
  and </tool_call>, as Qwen2.5's and Hermes' chat templates ask a model to write it (verl's HermesToolParser, after
  vLLM's).
- `gpt-oss`: OpenAI's harmony messages (https://cookbook.openai.com/articles/openai-harmony), a call being a message
  to a function that ends in <|call|>, `<|start|>assistant<|channel|>commentary to=functions.NAME
  <|constrain|>json<|message|>{...}<|call|>` (verl's GptOssToolParser, after SGLang's); the tools' responses are
  written back by hand (`gpt_oss_tool_responses`), since gpt-oss's chat template renders a tool message only after
  the assistant message that called it.
"""

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


# One harmony message: an optional <|start|>, its header (role, channel, recipient, content type), <|message|>, its
# body, and what ends it (<|end|>, <|call|> for a call, <|return|> for the last; the text's end for a cut one).
_HARMONY_MESSAGE = re.compile(r"(?:<\|start\|>)?(?P<header>(?:(?!<\|start\|>|<\|message\|>).)*)<\|message\|>"
                              r"(?P<body>(?:(?!<\|start\|>).)*?)(?P<end><\|end\|>|<\|call\|>|<\|return\|>|$)",
                              re.DOTALL)
_RECIPIENT = re.compile(r"to=functions\.(?P<name>[^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(?P<channel>\w+)")


def parse_gpt_oss_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A gpt-oss turn's text (special tokens kept) -> (the text less its calls and its analysis, the calls in order).

    A call is a message whose header names a recipient `to=functions.NAME` (after its channel, as the model writes
    it, or before, as gpt-oss's chat template writes past calls) and that ends in <|call|>; its body is the
    arguments' JSON. The analysis channel (the chain of thought) may mention calls and is never read as one, as in
    verl; a body that is not a JSON object is left out (no call runs for it), as `parse_tool_calls` leaves one out.
    The turn may start inside its first message (the prompt ended in `<|start|>assistant`).
    """
    calls, kept, last = [], [], 0
    for message in _HARMONY_MESSAGE.finditer(text):
        header = message["header"]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        kept.append(text[last:message.start()])
        last = message.end()
        if channel is not None and channel["channel"] == "analysis":
            continue
        if recipient is not None and message["end"] == "<|call|>":
            try:
                arguments = json.loads(message["body"])
            except json.JSONDecodeError:
                continue
            if isinstance(arguments, dict):
                calls.append(ToolCall(recipient["name"], arguments))
            continue
        kept.append(message.group(0))
    kept.append(text[last:])
    return "".join(kept), calls


def gpt_oss_tool_responses(texts: list[str], names: list[str]) -> str:
    """The tools' responses as gpt-oss reads them, one harmony message each from `functions.NAME` to the assistant,
    then the next assistant turn's opening (verl's build_gpt_oss_tool_response_text)."""
    return "".join(f"<|start|>functions.{name} to=assistant<|channel|>commentary<|message|>{text}<|end|>"
                   for text, name in zip(texts, names, strict=True)) + "<|start|>assistant"


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
