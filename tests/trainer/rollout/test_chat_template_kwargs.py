"""verl's data.apply_chat_template_kwargs reach the tokenizer's chat template wherever a prompt is templated: the
rollout's prompt ids, data.filter_overlong_prompts and the start checks count the same tokens."""

from __future__ import annotations

from trainer.config import load_config_with_notes
from trainer.data.checks import drop_overlong_prompts
from trainer.data.records import PromptRecord
from trainer.models.tiny import build_tiny_tokenizer
from trainer.rollout.prompts import encode_prompts, prompt_token_ids

# The tiny template, with a keyword (as gpt-oss's reads reasoning_effort) that writes a word before the messages.
TEMPLATE = ("{% if reasoning_effort is defined %}{{ reasoning_effort }} {% endif %}"
            "{% for message in messages %}{{ message['content'] }} {% endfor %}")
MESSAGES = [{"role": "user", "content": "1 2"}]


def tokenizer():
    built = build_tiny_tokenizer()
    built.chat_template = TEMPLATE
    return built


def test_the_template_kwargs_change_a_prompts_tokens() -> None:
    tok = tokenizer()
    assert prompt_token_ids(MESSAGES, tok) == tok("1 2")["input_ids"]
    assert prompt_token_ids(MESSAGES, tok, {"reasoning_effort": "9"}) == tok("9 1 2")["input_ids"]
    ids, mask = encode_prompts([MESSAGES], tok, max_length=8, template_kwargs={"reasoning_effort": "9"})
    assert ids[0].tolist() == tok("9 1 2")["input_ids"] and mask.sum().item() == 3


def test_filter_overlong_prompts_counts_the_tokens_the_kwargs_add() -> None:
    records = [PromptRecord(prompt=MESSAGES, data_source="x")]
    assert drop_overlong_prompts(records, tokenizer(), 2) == records  # "1 2": two tokens
    assert drop_overlong_prompts(records, tokenizer(), 2, {"reasoning_effort": "9"}) == []  # "9 1 2": three


def test_a_verl_script_s_template_kwarg_loads_as_a_setting_not_a_note() -> None:
    config, notes, _ = load_config_with_notes(None, ["+data.apply_chat_template_kwargs.reasoning_effort=medium"])
    assert config.data.apply_chat_template_kwargs == {"reasoning_effort": "medium"}
    assert not [note for note in notes if "apply_chat_template_kwargs" in note.key]
