"""verl's multi-turn keys and files at load: the named configs under a script's settings, the tool and interaction
config files checked (each problem naming the key, the file and what is allowed), the data's mirror of the tool
config path."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import ConfigError, load_config, load_config_with_notes

ASSETS = Path(__file__).parent / "assets" / "verl_examples" / "sglang_multiturn_config"
KEY = "actor_rollout_ref.rollout.multi_turn"


def problems_of(*overrides: str, config_name: str | None = None) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        load_config_with_notes(None, list(overrides), config_name)
    return [(problem.path, problem.message) for problem in caught.value.problems]


def test_multi_turn_is_off_by_default_with_verls_defaults() -> None:
    multi_turn = load_config().actor_rollout_ref.rollout.multi_turn
    assert not multi_turn.enable and multi_turn.format == "hermes" and multi_turn.max_tool_response_length == 256
    assert multi_turn.tool_response_truncate_side == "middle" and multi_turn.max_parallel_calls == 1


def test_a_named_config_sits_under_the_scripts_settings() -> None:
    config, notes, _ = load_config_with_notes(None, ["data.max_response_length=300"], "gsm8k_multiturn_grpo")
    assert config.actor_rollout_ref.rollout.multi_turn.enable
    assert config.actor_rollout_ref.rollout.multi_turn.max_assistant_turns == 5
    assert config.data.max_response_length == 300 and config.data.train_batch_size == 256
    assert config.actor_rollout_ref.rollout.name == "sglang"
    search, _, _ = load_config_with_notes(None, [], "search_multiturn_grpo.yaml")
    assert search.actor_rollout_ref.rollout.multi_turn.format == "qwen" and not search.data.shuffle


def test_an_unknown_config_name_lists_the_ones_understood() -> None:
    [(path, message)] = problems_of(config_name="my_own_config")
    assert path == "--config-name" and "gsm8k_multiturn_grpo" in message and "ppo_trainer" in message


def test_a_missing_tool_config_file_is_named_with_its_key(tmp_path: Path) -> None:
    [(path, message)] = problems_of(f"{KEY}.tool_config_path={tmp_path / 'none.yaml'}")
    assert path == f"{KEY}.tool_config_path" and "which is not a file" in message


def test_a_tool_class_of_verls_not_built_here_is_refused_at_load(tmp_path: Path) -> None:
    config = tmp_path / "zoom.yaml"
    config.write_text("tools:\n  - class_name: verl.tools.image_zoom_in_tool.ImageZoomInTool\n    config: {}\n"
                      "    tool_schema: {type: function, function: {name: zoom}}\n")
    [(path, message)] = problems_of(f"{KEY}.tool_config_path={config}")
    assert path == f"{KEY}.tool_config_path"
    assert "'verl.tools.image_zoom_in_tool.ImageZoomInTool', a class of verl's not built here" in message
    assert "verl.tools.gsm8k_tool.Gsm8kTool" in message


def test_an_mcp_tool_loads_and_one_without_its_servers_file_is_named(tmp_path: Path) -> None:
    tools = tmp_path / "mcp.yaml"
    tools.write_text("tools:\n  - class_name: verl.tools.mcp_search_tool.MCPSearchTool\n    config: {type: mcp}\n"
                     "    mcp: {mcp_servers_config_path: ./mcp_server.json}\n")
    assert load_config(None, [f"{KEY}.tool_config_path={tools}"]).actor_rollout_ref.rollout.multi_turn.tool_config_path
    tools.write_text("tools:\n  - class_name: my.McpTool\n    config: {type: mcp}\n")
    [(path, message)] = problems_of(f"{KEY}.tool_config_path={tools}")
    assert path == f"{KEY}.tool_config_path" and "an MCP tool without mcp.mcp_servers_config_path" in message


def test_a_tool_without_a_function_name_and_an_interaction_without_a_class_are_both_named(tmp_path: Path) -> None:
    tools, interactions = tmp_path / "tools.yaml", tmp_path / "interactions.yaml"
    tools.write_text("tools:\n  - class_name: my.Tool\n    tool_schema: {type: function}\n")
    interactions.write_text("interaction:\n  - name: gsm8k\n")
    found = problems_of(f"{KEY}.tool_config_path={tools}", f"{KEY}.interaction_config_path={interactions}")
    assert [path for path, _ in found] == [f"{KEY}.tool_config_path", f"{KEY}.interaction_config_path"]
    assert "tool_schema.function.name is missing" in found[0][1] and "class_name is None" in found[1][1]


def test_verls_files_load_and_the_datas_mirror_of_the_path_is_accepted() -> None:
    tools = ASSETS / "gsm8k_tool_config.yaml"
    config = load_config(None, [f"{KEY}.enable=true", f"{KEY}.tool_config_path={tools}",
                                f"+data.tool_config_path={tools}",
                                f"{KEY}.interaction_config_path={ASSETS / 'gsm8k_interaction_config.yaml'}"])
    assert config.actor_rollout_ref.rollout.multi_turn.tool_config_path == str(tools)
    [(path, message)] = problems_of(f"+data.tool_config_path={tools}")
    assert path == "data.tool_config_path"
    assert "mirrors actor_rollout_ref.rollout.multi_turn.tool_config_path" in message  # given alone: not a mirror


def test_a_format_not_built_is_refused_naming_the_allowed_ones() -> None:
    [(path, message)] = problems_of(f"{KEY}.format=llama3_json")
    assert path == f"{KEY}.format" and "'hermes' or 'qwen' or 'gpt-oss'" in message
