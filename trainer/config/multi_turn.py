"""verl's multi-turn and tool-calling rollout (actor_rollout_ref.rollout.multi_turn) and the Hydra configs of verl's
examples that turn it on (`--config-name=gsm8k_multiturn_grpo` and its siblings), which a launch script names.

A named config is verl's ppo_trainer with a few settings of its own; those settings are written here (verl's
examples/sglang_multiturn/config/*.yaml, without their Hydra lines), and the loader reads them under the user's
YAML file and overrides, as Hydra composes them. A named config built on ppo_megatron_trainer asks for Megatron.
geo3k_multiturn_grpo trains a vision-language model (Qwen2.5-VL) on images in several turns, with verl's Geo3kTool.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from trainer.config.fields import Section

ToolCallFormat = Literal["hermes", "qwen", "gpt-oss"]
TruncateSide = Literal["left", "right", "middle"]


class MultiTurnConfig(Section):
    enable: bool = False
    """Run the multi-turn rollout: the model's tool calls are run and their responses appended, turn after turn."""
    max_assistant_turns: int | None = Field(None, ge=1)
    """Most turns the model generates per response; null: until response_length or no more calls."""
    max_user_turns: int | None = Field(None, ge=1)
    """Most turns of tool or interaction responses per response; null: no limit but response_length."""
    tool_config_path: str | None = None
    """verl's tool config YAML (tools: [{class_name, config, tool_schema}]); null: no tools."""
    interaction_config_path: str | None = None
    """verl's interaction config YAML (interaction: [{name, class_name, config}]); null: no interaction."""
    max_parallel_calls: int = Field(1, ge=1)
    """Most tool calls of one turn that run; the others are dropped, as in verl."""
    max_tool_response_length: int = Field(256, ge=1)
    """Most characters of one tool response's text; a longer one is cut on tool_response_truncate_side."""
    tool_response_truncate_side: TruncateSide = "middle"
    """Which part of a long tool response stays: left (its start), right (its end), middle (both ends)."""
    use_inference_chat_template: bool = False
    """verl's SGLang rollout's key, with no effect here: every turn goes through the tokenizer's own chat template."""
    tokenization_sanity_check_mode: Literal["strict", "ignore_strippable", "disable"] = "strict"
    """verl's SGLang rollout's key, with no effect here: the tokens are built turn by turn, never re-tokenized."""
    format: ToolCallFormat = "hermes"
    """How the model writes a tool call: hermes (<tool_call>{name, arguments}</tool_call>), qwen (the same), gpt-oss."""
    num_repeat_rollouts: int | None = Field(None, ge=1)
    """verl's key of its legacy SGLang rollout, with no effect here: rollout.n sets the responses per prompt."""

    @property
    def runs(self) -> bool:
        """Whether the step's rollout is the multi-turn one."""
        return self.enable


# Qwen2.5-VL's chat template with tools (their schemas in the system prompt, tool responses as the user's
# <tool_response>) and images, as verl's geo3k_multiturn_grpo.yaml writes it (model.custom_chat_template).
GEO3K_CHAT_TEMPLATE = (Path(__file__).with_name("geo3k_chat_template.jinja")).read_text(encoding="utf-8")
# verl's examples/sglang_multiturn/config/*.yaml, their own settings (each composes ppo_trainer under them).
_DATA: dict[str, Any] = {"max_prompt_length": 1024, "max_response_length": 1024, "train_batch_size": 256,
                         "return_raw_chat": True}
_GSM8K: dict[str, Any] = {"data": _DATA,
                          "actor_rollout_ref": {"hybrid_engine": True,
                                                "rollout": {"name": "sglang",
                                                            "multi_turn": {"enable": True, "max_assistant_turns": 5}}}}
_SEARCH = {"data": {**_DATA, "shuffle": False},
           "actor_rollout_ref": {"hybrid_engine": True,
                                 "rollout": {"name": "sglang",
                                             "multi_turn": {"enable": True, "max_assistant_turns": 2,
                                                            "format": "qwen"}}}}
NAMED_CONFIGS: dict[str, dict[str, Any]] = {
    "gsm8k_multiturn_grpo": _GSM8K,
    "gsm8k_multiturn_grpo_w_interaction": {
        "data": _DATA,
        "actor_rollout_ref": {"hybrid_engine": True,
                              "rollout": {"name": "sglang", "multi_turn": {"enable": True, "max_user_turns": 5}}}},
    # SGLang's server mode and its HTTP client's settings: engine keys (noted).
    "gsm8k_multiturn_grpo_server": {
        "data": _DATA,
        "actor_rollout_ref": {"hybrid_engine": True,
                              "rollout": {"name": "sglang",
                                          "multi_turn": {"enable": True, "max_assistant_turns": 5},
                                          "sglang_rollout_mode": "server",
                                          "server": {"timeout": 60, "max_attempts": 3, "retry_delay": 2,
                                                     "max_connections": 1000, "max_start_wait_time": 300.0}}}},
    "retool_multiturn_grpo": {
        "data": _DATA,
        "actor_rollout_ref": {"hybrid_engine": True,
                              "rollout": {"name": "sglang",
                                          "multi_turn": {"enable": True, "max_assistant_turns": 5,
                                                         "tool_config_path": "./config/tool_config/"
                                                                             "sandbox_fusion_tool_config.yaml"}}}},
    "search_multiturn_grpo": _SEARCH,
    "search_multiturn_grpo_one_step_off": _SEARCH,
    # verl's geo3k config also sets data.return_multi_modal_inputs=False, which moves verl's image processing from
    # its dataset to its agent loop: here the rollout processes a prompt's images either way.
    "geo3k_multiturn_grpo": {
        "data": {**_DATA, "max_prompt_length": 2048, "max_response_length": 2048},
        "actor_rollout_ref": {"hybrid_engine": True, "model": {"custom_chat_template": GEO3K_CHAT_TEMPLATE},
                              "rollout": {"name": "sglang",
                                          "multi_turn": {"enable": True, "max_assistant_turns": 5}}}},
}
# Built on verl's ppo_megatron_trainer: Megatron's one refusal line (megatron.py).
MEGATRON_NAMED_CONFIGS = ("gsm8k_multiturn_megatron_grpo", "geo3k_multiturn_megatron_grpo")


def named_config(config_name: str | None) -> dict[str, Any]:
    """The settings of verl's Hydra config `config_name` beyond ppo_trainer's ({} for ppo_trainer itself, for one of
    Megatron's and for one not known: those are refused elsewhere)."""
    if config_name is None:
        return {}
    return NAMED_CONFIGS.get(config_name.removesuffix(".yaml"), {})


def under_named_config(raw: dict[str, Any], config_name: str | None) -> dict[str, Any]:
    """`raw` (a YAML file's settings) over the settings of verl's named config, as Hydra composes a primary config
    and what is given after it: a key of `raw` wins, a section is merged key by key."""
    return _merged(copy.deepcopy(named_config(config_name)), raw)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = _merged(base[key], value)
        else:
            base[key] = value
    return base

