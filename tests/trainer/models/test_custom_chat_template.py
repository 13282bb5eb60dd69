"""verl's model.custom_chat_template replaces the tokenizer's own: verl's geo3k multi-turn config sets Qwen2.5-VL's
template with tools, so that the tools' schemas reach the system prompt and a tool's response is the user's
<tool_response>, as verl writes them."""

from __future__ import annotations

from pathlib import Path

from trainer.config import load_config_with_notes
from trainer.config.multi_turn import GEO3K_CHAT_TEMPLATE
from trainer.models import load_tokenizer
from trainer.rollout.tools import load_tools, tool_schemas

GEO3K_TOOL = Path(__file__).parents[1] / "config" / "assets" / "verl_examples" / "sglang_multiturn_config" \
    / "geo3k_tool_config.yaml"


def test_the_geo3k_named_config_sets_verls_chat_template_and_a_users_own_wins(tmp_path: Path) -> None:
    named = load_config_with_notes(None, [f"trainer.runs_dir={tmp_path}"], "geo3k_multiturn_grpo").config
    assert named.actor_rollout_ref.model.custom_chat_template == GEO3K_CHAT_TEMPLATE
    assert GEO3K_CHAT_TEMPLATE.startswith("{% set image_count = namespace(value=0) %}")
    own = load_config_with_notes(None, [f"trainer.runs_dir={tmp_path}",
                                        "actor_rollout_ref.model.custom_chat_template='{{ messages[0].content }}'"],
                                 "geo3k_multiturn_grpo").config
    assert own.actor_rollout_ref.model.custom_chat_template == "{{ messages[0].content }}"


def test_the_custom_template_writes_the_tools_and_their_responses_as_verl_does() -> None:
    tokenizer = load_tokenizer("builtin:tiny-qwen2-vl", chat_template=GEO3K_CHAT_TEMPLATE)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1 + 1"}], add_generation_prompt=True,
                                           tools=tool_schemas(load_tools(str(GEO3K_TOOL))), tokenize=False)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert '{"type": "function", "function": {"name": "calc_geo3k_reward"' in prompt
    assert prompt.endswith("</tool_call><|im_end|>\n<|im_start|>user\n1 + 1<|im_end|>\n<|im_start|>assistant\n")
    answer = tokenizer.apply_chat_template([{"role": "tool", "content": "reward=1.0"}], add_generation_prompt=True,
                                           tokenize=False)
    assert answer.endswith("<|im_start|>user\n<tool_response>\nreward=1.0\n</tool_response><|im_end|>\n"
                           "<|im_start|>assistant\n")
    assert load_tokenizer("builtin:tiny-qwen2-vl").apply_chat_template(
        [{"role": "user", "content": "1"}], tokenize=False) == "1 "  # without it, the tokenizer's own
