"""verl's multi-turn, tool-calling rollout (its ToolAgentLoop) on the built-in engine.

Each conversation: the prompt through the chat template (with the tools' schemas, `tools=`); then turn after turn,
the model generates; its tool calls (multi_turn.format: hermes, qwen or gpt-oss) run, at most max_parallel_calls of
them, and their responses, as `tool` messages through the chat template (gpt-oss's written by hand), are appended;
with an interaction and no call, the interaction answers as the user. A conversation ends when the model calls
nothing, at max_assistant_turns or max_user_turns, when the response reaches response_length, or when the
interaction says so.

The response is every token after the prompt, the model's and the tools' (the attention reads them all); its loss
mask (RolloutBatch.response_mask) marks the model's own tokens only, so that tool and interaction tokens are left out
of the loss, the advantages, the KL and the critic, as in verl.

Batched by turns: each turn samples the conversations still going in one batch (rows that called a tool wait while
the others finish theirs); their tools then run.

A vision-language model's conversation (verl's geo3k example) holds its prompt's image tokens from the start, and
every turn's sampling gets the row's multi-modal inputs (pixel_values, image_grid_thw) with its context, as verl's
agent loop passes its image_data to each generate; the tools answer in text.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

import torch
from transformers import PreTrainedTokenizerBase

from trainer.config.multi_turn import MultiTurnConfig
from trainer.rollout.tool_calls import (
    ToolCall,
    gpt_oss_tool_responses,
    parse_gpt_oss_tool_calls,
    parse_tool_calls,
    truncated,
)
from trainer.rollout.tools import has_media, load_interactions, load_tools, text_of, tool_schemas

# One turn's sampling: [b, T] left-padded contexts and mask (and, for a vision-language model, the b rows' multi-modal
# inputs) -> ([b, R] tokens, [b, R] mask of those generated (EOS included), [b, R] their log-probs or None).
Sample = Callable[..., Sequence[torch.Tensor | None]]


@dataclass
class Conversation:
    """One row's state through the turns."""

    record: Any
    """Its PromptRecord."""
    messages: list[dict[str, Any]]
    """The chat so far as messages (the prompt's, then the tools' and the interaction's)."""
    prompt: list[int]
    """The prompt's tokens (chat template applied, tools included)."""
    response: list[int] = field(default_factory=list)
    """Every token after the prompt: the model's and the tools' or the user's."""
    own: list[int] = field(default_factory=list)
    """1 where `response` is the model's own token, 0 where a tool's or the user's."""
    log_probs: list[float] = field(default_factory=list)
    """The rollout's log-prob of each model token (0 for the others), when it records them."""
    assistant_turns: int = 0
    user_turns: int = 0
    tool_rewards: list[float] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    interaction: Any = None
    interaction_id: str | None = None
    done: bool = False

    def extra_info(self) -> dict[str, Any]:
        """The row's extra_info as its reward reads it: the data's, with verl's num_turns (the user and assistant
        turns and the prompt's), turn_scores (the interaction's) and tool_rewards."""
        return {**self.record.extra_info, "num_turns": self.assistant_turns + self.user_turns + 1,
                "turn_scores": list(self.turn_scores), "tool_rewards": list(self.tool_rewards)}


@dataclass
class MultiTurnBatch:
    """The conversations as tensors. B rows, P the longest prompt, R = response_length."""

    prompt_ids: torch.Tensor
    """[B, P] left-padded."""
    prompt_mask: torch.Tensor
    """[B, P]."""
    response_ids: torch.Tensor
    """[B, R] every token after the prompt, right-padded."""
    response_mask: torch.Tensor
    """[B, R] float: 1 on the model's own tokens only (the loss mask)."""
    response_attention: torch.Tensor
    """[B, R] float: 1 on every real response token (the model's, the tools' and the user's)."""
    log_probs: torch.Tensor | None
    """[B, R] the rollout's log-probs of the model's tokens, 0 elsewhere (None: not recorded)."""
    records: list[Any]
    """B PromptRecords, each extra_info with num_turns, turn_scores and tool_rewards."""


class MultiTurnRollout:
    """Runs conversations of tool calls (and interactions) with `sample` as the model."""

    def __init__(self, settings: MultiTurnConfig, tokenizer: PreTrainedTokenizerBase, *, response_length: int,
                 tools: Mapping[str, Any], interactions: Mapping[str, Any],
                 template_kwargs: Mapping[str, Any] | None = None, log: Callable[[str], None] = print):
        self.settings = settings
        self.log = log
        self._media_said: set[str] = set()  # the tools whose images the log has named
        self.tokenizer = tokenizer
        self.response_length = response_length
        self.tools = dict(tools)
        self.interactions = dict(interactions)
        self.template_kwargs = dict(template_kwargs or {})
        self._system_prefix = self._template_prefix()
        self.loop = asyncio.new_event_loop()
        self._recorded = False  # whether the last run's sampling recorded log-probs
        self._vision = False  # whether the last run's rows have images (a vision-language model's)

    # ----------------------------------------------------------------------------------------- the turns

    def run(self, records: Sequence[Any], prompts: Sequence[list[int]], sample: Sample,
            agree: Callable[[int], int] | None = None,
            multi_modal: Sequence[dict[str, torch.Tensor]] | None = None) -> MultiTurnBatch:
        """Each record's conversation from its prompt's tokens (chat template applied), to the end. `agree`: where
        the ranks' forwards meet (a rollout synced over ranks), the most conversations going on any rank; a rank
        whose conversations have all ended samples a one-token stand-in while another's go on. `multi_modal`: a
        vision-language model's inputs of each row's prompt images, passed with the row's context to every turn's
        `sample` (the context holds the prompt's image tokens all along; the tools answer in text)."""
        conversations = [self._start(record, prompt) for record, prompt in zip(records, prompts, strict=True)]
        self._recorded, self._vision = False, multi_modal is not None
        while True:
            going = [index for index, conversation in enumerate(conversations) if not conversation.done]
            if (agree(len(going)) if agree is not None else len(going)) == 0:
                break
            contexts = [conversations[index].prompt + conversations[index].response for index in going]
            images = None if multi_modal is None else [multi_modal[index] for index in going]
            if not going:  # another rank's conversations go on
                contexts, images = self._stand_in(conversations, multi_modal)
            ids, mask = self._left_padded(contexts)
            tokens, generated, *log_probs = sample(ids, mask, *(() if images is None else (images,)))
            assert tokens is not None and generated is not None
            for row, conversation in enumerate(conversations[index] for index in going):
                kept = generated[row] > 0
                turn = tokens[row][kept].tolist()
                recorded = bool(log_probs) and log_probs[0] is not None
                self._recorded = self._recorded or recorded
                turn_log_probs = log_probs[0][row][kept].tolist() if recorded else None
                self._after_turn(conversation, turn, turn_log_probs)
        for conversation in conversations:
            if conversation.interaction is not None:
                self.loop.run_until_complete(conversation.interaction.finalize_interaction(
                    conversation.interaction_id))
        return self._batch(conversations)

    def _stand_in(self, conversations: list[Conversation], multi_modal: Sequence[dict[str, torch.Tensor]] | None
                  ) -> tuple[list[list[int]], list[dict[str, torch.Tensor]] | None]:
        """The one row a rank whose conversations have all ended samples while another rank's go on (its output is
        dropped): a pad token; with images, the first prompt and its images, so that this rank's forward runs the
        vision tower as the other ranks' forwards do (a sharded tower's weights are gathered by all of them)."""
        if multi_modal is None or not conversations or not multi_modal[0]:
            return [[self.tokenizer.pad_token_id]], None if multi_modal is None else [{}]
        return [conversations[0].prompt], [multi_modal[0]]

    def _start(self, record: Any, prompt: list[int]) -> Conversation:
        messages = list(record.prompt) if isinstance(record.prompt, list) else [{"role": "user",
                                                                                  "content": record.prompt}]
        conversation = Conversation(record, messages, list(prompt))
        if self.interactions:
            kwargs = dict(record.extra_info.get("interaction_kwargs") or {})
            name = kwargs.get("name")
            if name not in self.interactions:
                raise ValueError(f"{record.source or 'a row'}: extra_info.interaction_kwargs.name is {name!r}; "
                                 f"allowed: one of the interaction config's {', '.join(self.interactions)}")
            conversation.interaction = self.interactions[name]
            conversation.interaction_id = self.loop.run_until_complete(
                conversation.interaction.start_interaction(uuid4().hex, **kwargs))
        return conversation

    def _after_turn(self, conversation: Conversation, turn: list[int], log_probs: list[float] | None) -> None:
        """The model's turn appended; then the tools' responses or the interaction's, or the end."""
        settings = self.settings
        turn = turn[:self.response_length - len(conversation.response)]
        conversation.response += turn
        conversation.own += [1] * len(turn)
        conversation.log_probs += (log_probs or [0.0] * len(turn))[:len(turn)]
        conversation.assistant_turns += 1
        if (len(conversation.response) >= self.response_length
                or (settings.max_assistant_turns and conversation.assistant_turns >= settings.max_assistant_turns)
                or (settings.max_user_turns and conversation.user_turns >= settings.max_user_turns)):
            conversation.done = True
            return
        _, calls = self._parse(self.tokenizer.decode(turn)) if self.tools else ("", [])
        if calls:
            messages = self.loop.run_until_complete(self._call_tools(conversation, calls))
            calls = calls[:self.settings.max_parallel_calls]
        elif conversation.interaction is not None:
            conversation.messages.append({"role": "assistant",
                                          "content": self.tokenizer.decode(turn, skip_special_tokens=True)})
            messages = self.loop.run_until_complete(self._interact(conversation))
        else:
            conversation.done = True
            return
        conversation.messages += messages
        added = self.gpt_oss_tail(messages, calls) if calls and self.settings.format == "gpt-oss" else \
            self.template_tail(messages)
        if calls and len(conversation.response) + len(added) >= self.response_length:
            conversation.done = True  # verl drops tool responses that do not fit
            return
        added = added[:self.response_length - len(conversation.response)]
        conversation.response += added
        conversation.own += [0] * len(added)
        conversation.log_probs += [0.0] * len(added)
        conversation.user_turns += 1
        if len(conversation.response) >= self.response_length:
            conversation.done = True

    async def _call_tools(self, conversation: Conversation, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """The first max_parallel_calls calls run together; one `tool` message each, in order."""
        answers = await asyncio.gather(*(self._call_tool(conversation, call)
                                         for call in calls[:self.settings.max_parallel_calls]))
        messages = []
        for text, reward in answers:
            if reward is not None:
                conversation.tool_rewards.append(float(reward))
            messages.append({"role": "tool", "content": text})
        return messages

    async def _call_tool(self, conversation: Conversation, call: ToolCall) -> tuple[str, float | None]:
        """One call: create, execute, release (verl's order); what it raises is its response, as verl answers."""
        tool, instance_id = self.tools.get(call.name), None
        try:
            if tool is None:
                raise KeyError(f"no tool named {call.name!r}; the tools: {', '.join(self.tools)}")
            kwargs = (conversation.record.extra_info.get("tools_kwargs") or {}).get(call.name) or {}
            instance_id, _ = await tool.create(create_kwargs=kwargs.get("create_kwargs") or {})
            response, reward, _ = await tool.execute(instance_id, call.arguments, agent_data=conversation)
        except Exception as error:  # noqa: BLE001 (a tool's failure is the model's to read, as in verl)
            return f"Error when executing tool: {error}", 0.0
        finally:
            if tool is not None and instance_id is not None:
                await tool.release(instance_id)
        if has_media(response) and call.name not in self._media_said:
            self._media_said.add(call.name)
            self.log(f"NOTE: tool {call.name!r} answered with images or video, which the multi-turn rollout does "
                     "not pass on to a vision-language model (only the prompt's images): only the response's text "
                     "is passed on" if self._vision else
                     f"NOTE: tool {call.name!r} answered with images or video, which this text-only model cannot "
                     "read: only the response's text is passed on (vision-language models take them)")
        text = truncated(text_of(response), self.settings.max_tool_response_length,
                         self.settings.tool_response_truncate_side)
        return text, reward

    async def _interact(self, conversation: Conversation) -> list[dict[str, Any]]:
        kwargs = dict(conversation.record.extra_info.get("interaction_kwargs") or {})
        finished, text, score, _ = await conversation.interaction.generate_response(
            conversation.interaction_id, conversation.messages, **kwargs)
        if score is not None:
            conversation.turn_scores.append(float(score))
        if finished:
            conversation.done = True
        return [{"role": "user", "content": text}]

    # ------------------------------------------------------------------------------------- the template

    def _parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A turn's text -> (its text less the calls, the calls), in multi_turn.format."""
        return parse_gpt_oss_tool_calls(text) if self.settings.format == "gpt-oss" else parse_tool_calls(text)

    def gpt_oss_tail(self, messages: list[dict[str, Any]], calls: list[ToolCall]) -> list[int]:
        """The tools' responses (one `tool` message per call, in order) in gpt-oss's harmony format, written by hand
        as verl writes them, with the next assistant turn's opening."""
        text = gpt_oss_tool_responses([str(message["content"]) for message in messages],
                                      [call.name for call in calls])
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_kwargs(self) -> dict[str, Any]:
        """The chat template's keywords for a prompt: the data's, and the tools' schemas."""
        return {**self.template_kwargs, **({"tools": tool_schemas(self.tools)} if self.tools else {})}

    def template_tail(self, messages: list[dict[str, Any]]) -> list[int]:
        """The tokens of `messages` (tool or user turns) as the chat template writes them after a conversation, with
        the next assistant turn's opening (add_generation_prompt) and without the template's system prompt."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  **self.template_kwargs)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        prefix = self._system_prefix
        return ids[len(prefix):] if ids[:len(prefix)] == prefix else ids

    def _template_prefix(self) -> list[int]:
        """What the chat template writes before the first message (a default system prompt): the tokens of one empty
        user message less those one more such message adds (verl's initialize_system_prompt)."""
        def ids(count: int) -> list[int]:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": ""}] * count,
                                                      add_generation_prompt=False, tokenize=False,
                                                      **self.template_kwargs)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

        one, two = ids(1), ids(2)
        return one[:len(one) - (len(two) - len(one))]

    # ---------------------------------------------------------------------------------------- tensors

    def _left_padded(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(row) for row in rows)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for index, row in enumerate(rows):
            ids[index, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[index, width - len(row):] = 1
        return ids, mask

    def _batch(self, conversations: list[Conversation]) -> MultiTurnBatch:
        prompt_ids, prompt_mask = self._left_padded([conversation.prompt for conversation in conversations])
        rows, length = len(conversations), self.response_length
        response_ids = torch.full((rows, length), self.tokenizer.pad_token_id, dtype=torch.long)
        own = torch.zeros((rows, length))
        attention = torch.zeros((rows, length))
        log_probs = torch.zeros((rows, length))
        for row, conversation in enumerate(conversations):
            count = len(conversation.response)
            response_ids[row, :count] = torch.tensor(conversation.response, dtype=torch.long)
            own[row, :count] = torch.tensor(conversation.own, dtype=torch.float32)
            attention[row, :count] = 1.0
            log_probs[row, :count] = torch.tensor(conversation.log_probs, dtype=torch.float32)
        records = [dataclasses.replace(conversation.record, extra_info=conversation.extra_info())
                   for conversation in conversations]
        return MultiTurnBatch(prompt_ids, prompt_mask, response_ids, own, attention,
                              log_probs * own if self._recorded else None, records)


def multi_turn_rollout(config: Any, tokenizer: PreTrainedTokenizerBase,
                       log: Callable[[str], None]) -> MultiTurnRollout | None:
    """The run's multi-turn rollout (a RunConfig's actor_rollout_ref.rollout.multi_turn), its tools and interactions
    built from their config files; None where multi_turn.enable is off."""
    settings: MultiTurnConfig = config.actor_rollout_ref.rollout.multi_turn
    if not settings.runs:
        return None
    tools = load_tools(settings.tool_config_path, report=log) if settings.tool_config_path else {}
    interactions = load_interactions(settings.interaction_config_path) if settings.interaction_config_path else {}
    log(f"multi-turn rollout: tools {', '.join(tools) or 'none'}; interactions {', '.join(interactions) or 'none'}; "
        f"at most {settings.max_assistant_turns or 'any number of'} assistant turns and "
        f"{settings.max_user_turns or 'any number of'} user turns in {config.data.max_response_length} tokens")
    return MultiTurnRollout(settings, tokenizer, response_length=config.data.max_response_length, tools=tools,
                            interactions=interactions, template_kwargs=config.data.apply_chat_template_kwargs,
                            log=log)
