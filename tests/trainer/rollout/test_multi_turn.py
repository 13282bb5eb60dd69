"""verl's multi-turn, tool-calling rollout against a scripted "model": the hermes tool calls parsed, the tools run
(verl's gsm8k tool, a user's class by import path, an HTTP tool whose server is gone), their responses appended
through the chat template, the turn limits and the response length, and the loss mask that marks the model's own
tokens alone (hand-checked token by token)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from trainer.config.multi_turn import MultiTurnConfig
from trainer.data.records import PromptRecord
from trainer.rewards.manager import place_on_last_token
from trainer.rollout.batch import RolloutBatch
from trainer.rollout.multi_turn import MultiTurnRollout
from trainer.rollout.tool_calls import ToolCall, parse_tool_calls, truncated
from trainer.rollout.tools import Schema, SearchTool, load_interactions, load_tools

CALL = '<tool_call> {"name": "calc_gsm8k_reward", "arguments": {"answer": "7"}} </tool_call>'
WORDS = ["<pad>", "<eos>", "<unk>", "user:", "tool:", "assistant:", "q1", "q2", "7", "8", "####",
         "<tool_call>", "</tool_call>", '{"name":', '"calc_gsm8k_reward",', '"arguments":', '{"answer":', '"7"}}',
         '"echo",', '{"text":', '"hi"}}', "Current", "parsed", "answer='7'", "reward=1.0", "hi"]
# Each message is its role and its content; the next assistant turn opens with "assistant:".
TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
GSM8K_TOOL = Path(__file__).parents[1] / "config" / "assets" / "verl_examples" / "sglang_multiturn_config" \
    / "gsm8k_tool_config.yaml"
GSM8K_INTERACTION = GSM8K_TOOL.with_name("gsm8k_interaction_config.yaml")


def tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(vocab={word: index for index, word in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    built = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                    unk_token="<unk>", padding_side="left")
    built.chat_template = TEMPLATE
    return built


TOK = tokenizer()


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


class ScriptedModel:
    """Answers each row (known by its question, its prompt's second word after "user:", or a one-token stand-in's
    token) with its next scripted turn; records what it was shown."""

    def __init__(self, turns: dict[str, list[str]], width: int = 16):
        self.turns = {first: [ids(turn) for turn in script] for first, script in turns.items()}
        self.width = width
        self.shown: list[list[list[int]]] = []

    def __call__(self, context: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        rows = [row[keep.bool()].tolist() for row, keep in zip(context, mask, strict=True)]
        self.shown.append(rows)
        tokens = torch.zeros((len(rows), self.width), dtype=torch.long)
        generated = torch.zeros((len(rows), self.width))
        for index, row in enumerate(rows):
            turn = self.turns[TOK.convert_ids_to_tokens(row[min(1, len(row) - 1)])].pop(0)
            tokens[index, :len(turn)] = torch.tensor(turn)
            generated[index, :len(turn)] = 1.0
        return tokens, generated, None


def record(question: str, truth: str = "7", **extra: Any) -> PromptRecord:
    return PromptRecord(prompt=[{"role": "user", "content": question}], data_source="openai/gsm8k",
                        ground_truth=truth, extra_info={"tools_kwargs": {"calc_gsm8k_reward": {
                            "create_kwargs": {"ground_truth": truth}}}, **extra})


def rollout(settings: MultiTurnConfig, response_length: int = 32, **built: Any) -> MultiTurnRollout:
    return MultiTurnRollout(settings, TOK, response_length=response_length, tools=built.get("tools", {}),
                            interactions=built.get("interactions", {}))


def prompt_of(question: str) -> list[int]:
    return ids(f"user: {question} assistant:")


def test_hermes_tool_calls_are_parsed_and_a_malformed_one_is_left_out() -> None:
    text = ('I will check. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> and '
            '<tool_call>{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call><tool_call>{not json}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert calls == [ToolCall("f", {"x": 1}), ToolCall("g", {"y": 2})]
    assert content == "I will check.  and "
    assert parse_tool_calls("no call <tool_call> here") == ("no call <tool_call> here", [])


def test_a_long_tool_response_is_cut_on_its_side_as_verl_cuts_it() -> None:
    assert truncated("abcdefghij", 4, "left") == "abcd...(truncated)"
    assert truncated("abcdefghij", 4, "right") == "(truncated)...ghij"
    assert truncated("abcdefghij", 4, "middle") == "ab...(truncated)...ij"
    assert truncated("abc", 4, "middle") == "abc"


def test_a_tool_call_runs_and_only_the_model_s_tokens_are_in_the_loss_mask() -> None:
    tools = load_tools(str(GSM8K_TOOL))
    model = ScriptedModel({"q1": [CALL + " <eos>", "#### 7 <eos>"], "q2": ["8 <eos>"]})
    settings = MultiTurnConfig(enable=True, max_assistant_turns=5)
    batch = rollout(settings, tools=tools).run([record("q1"), record("q2", "8")], [prompt_of("q1"), prompt_of("q2")],
                                               model)
    call, tool_turn, answer = ids(CALL + " <eos>"), ids("tool: Current parsed answer='7' reward=1.0 assistant:"), \
        ids("#### 7 <eos>")
    assert len(call) == 8 and len(tool_turn) == 6 and len(answer) == 3
    assert batch.response_ids[0, :17].tolist() == call + tool_turn + answer
    assert batch.response_mask[0].tolist() == [1.0] * 8 + [0.0] * 6 + [1.0] * 3 + [0.0] * 15
    assert batch.response_attention[0].tolist() == [1.0] * 17 + [0.0] * 15
    assert batch.response_mask[1].tolist() == [1.0] * 2 + [0.0] * 30  # answered at once: no tool, one turn
    # The second turn saw the prompt, the call and the tool's response; q2 was not sampled again.
    assert model.shown[1] == [prompt_of("q1") + call + tool_turn]
    assert batch.records[0].extra_info["tool_rewards"] == [0.0]  # a first right answer: no penalty
    assert batch.records[0].extra_info["num_turns"] == 4  # the prompt, two assistant turns, one tool turn
    assert batch.records[1].extra_info["num_turns"] == 2 and batch.records[1].extra_info["tool_rewards"] == []
    assert batch.prompt_ids[1].tolist()[-len(prompt_of("q2")):] == prompt_of("q2")


def test_the_turn_limits_end_a_conversation_with_a_call_unanswered() -> None:
    tools = load_tools(str(GSM8K_TOOL))
    batch = rollout(MultiTurnConfig(enable=True, max_assistant_turns=1), tools=tools).run(
        [record("q1")], [prompt_of("q1")], ScriptedModel({"q1": [CALL + " <eos>"]}))
    assert batch.response_mask[0].sum() == 8 and batch.response_attention[0].sum() == 8
    assert batch.records[0].extra_info["tool_rewards"] == []


def test_a_tool_response_that_does_not_fit_the_response_length_ends_it() -> None:
    tools = load_tools(str(GSM8K_TOOL))
    batch = rollout(MultiTurnConfig(enable=True), response_length=12, tools=tools).run(
        [record("q1")], [prompt_of("q1")], ScriptedModel({"q1": [CALL + " <eos>"]}))
    assert batch.response_attention[0].tolist() == [1.0] * 8 + [0.0] * 4  # 8 + 6 tool tokens > 12: dropped, as verl


def test_the_gsm8k_tool_penalises_a_submission_that_does_not_improve() -> None:
    tools = load_tools(str(GSM8K_TOOL))
    batch = rollout(MultiTurnConfig(enable=True, max_assistant_turns=3), tools=tools).run(
        [record("q1", "9")], [prompt_of("q1")], ScriptedModel({"q1": [CALL + " <eos>", CALL + " <eos>", "<eos>"]}))
    # Each call is an instance of its own (verl creates one per call): a wrong answer (0, not above 0) costs 0.05.
    assert batch.records[0].extra_info["tool_rewards"] == [-0.05, -0.05]


class EchoTool:
    """A user's tool with verl's BaseTool methods, named in a tool config by its import path."""

    def __init__(self, config: dict[str, Any], tool_schema: Any):
        self.name = tool_schema.function.name
        self.tool_schema = tool_schema
        self.created: list[dict[str, Any]] = []

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, None]:
        self.created.append(kwargs)
        return "one", None

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[str, float, dict]:
        return parameters["text"], 0.5, {}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        pass


def test_a_users_tool_class_by_import_path_is_duck_typed(tmp_path: Path) -> None:
    config = tmp_path / "tools.yaml"
    config.write_text(json.dumps({"tools": [{"class_name": f"{__name__}.EchoTool", "config": {}, "tool_schema": {
        "type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}}]}))
    tools = load_tools(str(config))
    call = '<tool_call> {"name": "echo", "arguments": {"text": "hi"}} </tool_call> <eos>'
    one = rollout(MultiTurnConfig(enable=True), tools=tools)
    assert one.prompt_kwargs()["tools"] == [{"type": "function", "function": {"name": "echo",
                                                                              "parameters": {"type": "object"}}}]
    batch = one.run([record("q1")], [prompt_of("q1")], ScriptedModel({"q1": [call, "<eos>"]}))
    assert batch.response_ids[0, 8:11].tolist() == ids("tool: hi assistant:")
    assert batch.records[0].extra_info["tool_rewards"] == [0.5]


def test_the_gsm8k_interaction_answers_as_the_user_until_the_answer_is_right() -> None:
    interactions = load_interactions(str(GSM8K_INTERACTION))
    question = record("q1", interaction_kwargs={"name": "gsm8k", "ground_truth": "7"})
    batch = rollout(MultiTurnConfig(enable=True, max_user_turns=5), response_length=64,
                    interactions=interactions).run([question], [prompt_of("q1")],
                                                   ScriptedModel({"q1": ["#### 8 <eos>", "#### 7 <eos>"]}))
    extra = batch.records[0].extra_info
    assert extra["turn_scores"] == [0.0, 1.0] and extra["num_turns"] == 5
    # "#### 8 <eos>", then "user: Your response is incorrect! You need to reflect on your answer and try again.
    # assistant:" (16 words), "#### 7 <eos>", and "user: Your response is correct! assistant:" (6): the end.
    assert batch.response_mask[0].tolist() == [1.0] * 3 + [0.0] * 16 + [1.0] * 3 + [0.0] * 6 + [0.0] * 36
    assert batch.response_attention[0].tolist() == [1.0] * 28 + [0.0] * 36


def test_an_unreachable_search_server_is_one_error_line_naming_the_tool_and_the_url() -> None:
    said: list[str] = []
    tool = SearchTool({"retrieval_service_url": "http://127.0.0.1:9/retrieve", "timeout": 2},
                      Schema({"function": {"name": "search"}}))
    tool.report = said.append
    loop = asyncio.new_event_loop()
    instance, _ = loop.run_until_complete(tool.create())
    for _ in range(2):
        response, _, _ = loop.run_until_complete(tool.execute(instance, {"query_list": ["x"]}))
        assert "Search error" in response.text
    assert len(said) == 1 and said[0].startswith("ERROR: tool 'search' could not reach http://127.0.0.1:9/retrieve")


def test_the_score_goes_on_the_model_s_last_token_and_the_forward_reads_every_token() -> None:
    own = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    real = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    scores = place_on_last_token(torch.tensor([2.0, 3.0]), own)
    assert scores.tolist() == [[0, 0, 0, 0, 2.0, 0], [3.0, 0, 0, 0, 0, 0]]
    batch = RolloutBatch(prompt_ids=torch.ones(2, 2, dtype=torch.long), prompt_mask=torch.ones(2, 2),
                         response_ids=torch.ones(2, 6, dtype=torch.long), response_mask=own,
                         group_index=torch.arange(2), records=[None, None], response_attention=real)
    assert batch.attention_mask[0].tolist() == [1] * 8
    assert batch.response_lengths.tolist() == [6.0, 1.0]
    assert batch.select([1]).response_attention.tolist() == [real[1].tolist()]


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_max_tool_response_length_cuts_the_tools_text(side: str) -> None:
    one = rollout(MultiTurnConfig(enable=True, max_tool_response_length=4, tool_response_truncate_side=side),
                  tools=load_tools(str(GSM8K_TOOL)))
    batch = one.run([record("q1")], [prompt_of("q1")], ScriptedModel({"q1": [CALL + " <eos>", "<eos>"]}))
    # "Current parsed answer='7' reward=1.0" (4 words) cut to one word ("Cu...(truncated)...1.0" and the like).
    assert batch.response_ids[0, 8:11].tolist() == ids("tool: <unk> assistant:")
    assert batch.response_mask[0, :12].tolist() == [1.0] * 8 + [0.0] * 3 + [1.0]


def test_synced_ranks_sample_as_many_turns_a_finished_rank_with_a_stand_in() -> None:
    """Another rank's conversation goes on for 3 turns (agree says so) while this rank's ended after 1: this rank
    keeps sampling (a one-token stand-in) so that the ranks' forwards meet, and its response is unchanged."""
    other_rank_going = iter([1, 1, 1, 0])
    model = ScriptedModel({"q2": ["8 <eos>"], "<pad>": ["<eos>", "<eos>"]})
    batch = rollout(MultiTurnConfig(enable=True)).run(
        [record("q2", "8")], [prompt_of("q2")], model,
        agree=lambda going: max(going, next(other_rank_going)))
    assert len(model.shown) == 3 and model.shown[1] == [[TOK.pad_token_id]] == model.shown[2]
    assert batch.response_mask[0].tolist() == [1.0] * 2 + [0.0] * 30
