"""verl's `gpt-oss` tool-call format (multi_turn.format: gpt-oss): calls parsed from hand-written harmony outputs of
the model (the analysis channel never read as a call), the tools' responses written back by hand as verl writes
them, and a conversation's loss mask with a gpt-oss tool turn (hand-checked token by token)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from trainer.config import load_config
from trainer.config.multi_turn import MultiTurnConfig
from trainer.data.records import PromptRecord
from trainer.rollout.multi_turn import MultiTurnRollout
from trainer.rollout.tool_calls import ToolCall, gpt_oss_tool_responses, parse_gpt_oss_tool_calls
from trainer.rollout.tools import Gsm8kTool, Schema

# What gpt-oss writes after its prompt's `<|start|>assistant` (special tokens kept, as verl decodes them).
ANALYSIS_THEN_CALL = ('<|channel|>analysis<|message|>I could call to=functions.calc_gsm8k_reward with 8, but it is '
                      '7.<|end|><|start|>assistant<|channel|>commentary to=functions.calc_gsm8k_reward '
                      '<|constrain|>json<|message|>{"answer": "7"}<|call|>')


def test_a_call_after_the_analysis_is_parsed_and_the_analysis_is_left_out() -> None:
    content, calls = parse_gpt_oss_tool_calls(ANALYSIS_THEN_CALL)
    assert calls == [ToolCall("calc_gsm8k_reward", {"answer": "7"})]
    assert content == ""


def test_a_final_answer_is_no_call_and_stays_the_content() -> None:
    text = "<|channel|>analysis<|message|>2 + 5 = 7.<|end|><|start|>assistant<|channel|>final<|message|>7<|return|>"
    assert parse_gpt_oss_tool_calls(text) == ("<|start|>assistant<|channel|>final<|message|>7<|return|>", [])
    assert parse_gpt_oss_tool_calls("plain text") == ("plain text", [])


def test_two_calls_the_chat_templates_order_and_malformed_or_unfinished_ones() -> None:
    text = ('<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"query_list": ["a"]}<|call|>'
            # gpt-oss's chat template writes the recipient before the channel
            '<|start|>assistant to=functions.calc<|channel|>commentary json<|message|>{"answer": "3"}<|call|>'
            # not a JSON object: left out, as a malformed hermes call is
            '<|start|>assistant<|channel|>commentary to=functions.calc <|constrain|>json<|message|>[3]<|call|>'
            # cut off before <|call|>: no call
            '<|start|>assistant<|channel|>commentary to=functions.calc <|constrain|>json<|message|>{"answer": ')
    _, calls = parse_gpt_oss_tool_calls(text)
    assert calls == [ToolCall("search", {"query_list": ["a"]}), ToolCall("calc", {"answer": "3"})]


def test_the_tools_responses_are_written_as_verl_writes_them() -> None:
    assert gpt_oss_tool_responses(["4", "none"], ["calc", "search"]) == (
        "<|start|>functions.calc to=assistant<|channel|>commentary<|message|>4<|end|>"
        "<|start|>functions.search to=assistant<|channel|>commentary<|message|>none<|end|><|start|>assistant")


def test_the_format_is_accepted_by_the_config() -> None:
    config = load_config(None, ["actor_rollout_ref.rollout.multi_turn.format=gpt-oss"])
    assert config.actor_rollout_ref.rollout.multi_turn.format == "gpt-oss"


HARMONY = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>"]
WORDS = ["<pad>", "<unk>", "user", "q1", "assistant", "analysis", "final", "commentary", "json", "think",
         "to=functions.calc_gsm8k_reward", '{"answer":', '"7"}', "7", "functions.calc_gsm8k_reward", "to=assistant",
         "Current", "parsed", "answer='7'", "reward=1.0"]


def harmony_tokenizer() -> PreTrainedTokenizerFast:
    """Words, and harmony's markers as special tokens (split out wherever they stand, as gpt-oss's tokenizer does)."""
    backend = Tokenizer(models.WordLevel(vocab={word: index for index, word in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    built = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                    padding_side="left")
    built.add_special_tokens({"additional_special_tokens": HARMONY})
    built.chat_template = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>"
                           "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
    return built


def test_a_gpt_oss_tool_turn_is_out_of_the_loss_mask_and_the_next_turn_reads_it() -> None:
    tokenizer = harmony_tokenizer()

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    call = ids("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary "
               'to=functions.calc_gsm8k_reward <|constrain|>json<|message|>{"answer": "7"}<|call|>')
    answer = ids("<|channel|>final<|message|>7<|return|>")
    turns, shown = [call, answer], []

    def sample(context: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shown.append(context[0][mask[0].bool()].tolist())
        turn = turns.pop(0)
        return torch.tensor([turn]), torch.ones((1, len(turn))), None

    schema = Schema({"type": "function", "function": {"name": "calc_gsm8k_reward", "description": "d"}})
    rollout = MultiTurnRollout(MultiTurnConfig(enable=True, format="gpt-oss"), tokenizer, response_length=40,
                               tools={"calc_gsm8k_reward": Gsm8kTool({}, schema)}, interactions={})
    record = PromptRecord(prompt=[{"role": "user", "content": "q1"}], data_source="openai/gsm8k", ground_truth="7",
                          extra_info={"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "7"}}}})
    prompt = ids("<|start|>user<|message|>q1<|end|><|start|>assistant")
    batch = rollout.run([record], [prompt], sample)
    tool_turn = ids("<|start|>functions.calc_gsm8k_reward to=assistant<|channel|>commentary<|message|>Current parsed "
                    "answer='7' reward=1.0<|end|><|start|>assistant")
    assert len(call) == 16 and len(tool_turn) == 13 and len(answer) == 5
    assert batch.response_ids[0, :34].tolist() == call + tool_turn + answer
    assert batch.response_mask[0].tolist() == [1.0] * 16 + [0.0] * 13 + [1.0] * 5 + [0.0] * 6
    assert batch.response_attention[0].tolist() == [1.0] * 34 + [0.0] * 6
    assert shown[1] == prompt + call + tool_turn
    assert batch.records[0].extra_info["tool_rewards"] == [0.0] and batch.records[0].extra_info["num_turns"] == 4
