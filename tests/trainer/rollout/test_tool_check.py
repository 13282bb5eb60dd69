"""`verl train --check` builds the multi-turn rollout's tools and interactions as the trainer builds them (the
class imported, its schema read as verl's OpenAIFunctionToolSchema reads it, the class built with its config, verl's
methods there): each one that cannot be is one line naming the key, the file, the entry and its class, not a
failure at step 1. verl's MCP tools load, and are one line at --check naming the package they need."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainer.check import check_run
from trainer.config import load_config
from trainer.rollout.tools import ToolConfigError, load_tools

ASSETS = Path(__file__).parents[1] / "config" / "assets" / "verl_examples" / "sglang_multiturn_config"
KEY = "actor_rollout_ref.rollout.multi_turn"
SCHEMA = {"type": "function", "function": {"name": "calc", "description": "Checks an answer.", "parameters": {
    "type": "object", "properties": {"answer": {"type": "string", "description": "the answer"}},
    "required": ["answer"]}}}
# verl's examples/sglang_multiturn/config/tool_config/mcp_tool_config.yaml, as it is.
MCP = {"tools": [{"class_name": "verl.tools.mcp_search_tool.MCPSearchTool",
                  "config": {"rate_limit": 120, "timeout": 120, "type": "mcp"},
                  "mcp": {"mcp_servers_config_path": "./mcp_server.json",
                          "tool_selected_list": ["tavily_search_tool"]}}]}


class StrictTool:
    """A user's tool whose config must name a unit."""

    def __init__(self, config: dict[str, Any], tool_schema: Any):
        if "unit" not in config:
            raise ValueError("config.unit is required")
        self.tool_schema = tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, None]:
        return "one", None

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[str, float, dict]:
        return "", 0.0, {}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        pass


class NoExecute:
    """A user's class that forgot verl's execute."""

    def __init__(self, config: dict[str, Any], tool_schema: Any):
        pass

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, None]:
        return "one", None

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        pass


def tool(class_name: str, config: dict[str, Any] | None = None, schema: dict[str, Any] | None = None
         ) -> dict[str, Any]:
    return {"class_name": class_name, "config": config or {"type": "native"}, "tool_schema": schema or SCHEMA}


def checked(tmp_path: Path, tools: list[dict[str, Any]] | None = None,
            interactions: list[dict[str, Any]] | None = None, enable: bool = True) -> list[str]:
    """check_run's lines for a multi-turn run with these tool and interaction config files."""
    overrides = [f"{KEY}.enable={str(enable).lower()}"]
    if tools is not None:
        (tmp_path / "tools.yaml").write_text(yaml.safe_dump({"tools": tools}))
        overrides.append(f"{KEY}.tool_config_path={tmp_path / 'tools.yaml'}")
    if interactions is not None:
        (tmp_path / "interactions.yaml").write_text(yaml.safe_dump({"interaction": interactions}))
        overrides.append(f"{KEY}.interaction_config_path={tmp_path / 'interactions.yaml'}")
    return check_run(load_config(None, overrides))


def test_verls_tool_and_interaction_files_pass_the_check() -> None:
    config = load_config(None, [f"{KEY}.enable=true", f"{KEY}.tool_config_path={ASSETS / 'gsm8k_tool_config.yaml'}",
                                f"{KEY}.interaction_config_path={ASSETS / 'gsm8k_interaction_config.yaml'}"])
    assert check_run(config) == []


def test_a_typo_in_a_users_class_name_is_one_line_naming_the_entry_and_the_class(tmp_path: Path) -> None:
    [line] = checked(tmp_path, [tool(f"{__name__}.StrictTool", {"unit": "cm"}), tool(f"{__name__}.StrictTol")])
    assert line.startswith(f"{KEY}.tool_config_path: '{tmp_path / 'tools.yaml'}' tools[1] ({__name__}.StrictTol): ")
    assert f"class_name '{__name__}.StrictTol' cannot be imported (AttributeError" in line
    [line] = checked(tmp_path, [tool("my_tools_not_installed.Calc")])
    assert "tools[0] (my_tools_not_installed.Calc)" in line
    assert "ModuleNotFoundError: No module named 'my_tools_not_installed'" in line


def test_a_config_the_class_refuses_and_a_class_without_verls_methods_are_each_a_line(tmp_path: Path) -> None:
    lines = checked(tmp_path, [tool(f"{__name__}.StrictTool"), tool(f"{__name__}.NoExecute"),
                               tool("verl.tools.search_tool.SearchTool")])
    assert len(lines) == 3
    assert "tools[0]" in lines[0] and "raised ValueError: config.unit is required" in lines[0]
    assert "tools[1]" in lines[1] and "the class has no execute" in lines[1]
    assert "tools[2] (verl.tools.search_tool.SearchTool)" in lines[2]
    assert "config.retrieval_service_url is missing" in lines[2]


@pytest.mark.parametrize(("schema", "phrase"), [
    ({"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {
        "answer": {"description": "no type"}}}}}, "tool_schema.function.parameters.properties.answer.type is missing"),
    ({"type": "function", "function": {"name": "calc", "description": 3}},
     "tool_schema.function.description is 3, not a string"),
    ({"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "required": "answer"}}},
     "tool_schema.function.parameters.required is 'answer', not a list of names"),
    ({"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {
        "unit": {"type": "string", "enum": ["cm", 2]}}}}},
     "tool_schema.function.parameters.properties.unit.enum is ['cm', 2], not a list of strings"),
])
def test_a_schema_verl_would_not_read_is_one_line(tmp_path: Path, schema: dict[str, Any], phrase: str) -> None:
    [line] = checked(tmp_path, [tool("verl.tools.gsm8k_tool.Gsm8kTool", schema=schema)])
    assert phrase in line and "allowed: an OpenAI function schema" in line


def test_an_interaction_class_that_cannot_be_imported_is_one_line(tmp_path: Path) -> None:
    [line] = checked(tmp_path, interactions=[{"name": "gsm8k", "class_name": "my_interactions.Gsm8k", "config": {}}])
    assert line.startswith(f"{KEY}.interaction_config_path: '{tmp_path / 'interactions.yaml'}' interaction[0] "
                           "(my_interactions.Gsm8k): class_name 'my_interactions.Gsm8k' cannot be imported")


def test_tools_of_a_run_without_the_multi_turn_rollout_are_not_built(tmp_path: Path) -> None:
    assert checked(tmp_path, [tool("my_tools_not_installed.Calc")], enable=False) == []


def test_verls_mcp_tool_config_loads_and_is_one_line_at_check_naming_the_package(tmp_path: Path) -> None:
    (tmp_path / "mcp_tool_config.yaml").write_text(yaml.safe_dump(MCP))
    config = load_config(None, [f"{KEY}.enable=true", f"{KEY}.tool_config_path={tmp_path / 'mcp_tool_config.yaml'}"])
    [line] = check_run(config)
    assert line.startswith(f"{KEY}.tool_config_path: '{tmp_path / 'mcp_tool_config.yaml'}' tools[0] "
                           "(verl.tools.mcp_search_tool.MCPSearchTool): an MCP tool")
    installed = importlib.util.find_spec("fastmcp") is not None  # not a dependency: installed by hand at most
    assert "the `fastmcp` package, " + ("" if installed else "which is not installed, ") in line
    assert "'./mcp_server.json'" in line and "MCP tools are not built here" in line
    # The trainer, started without --check, stops on the same line before its first step.
    with pytest.raises(ToolConfigError) as caught:
        load_tools(str(tmp_path / "mcp_tool_config.yaml"))
    assert str(caught.value) == line
