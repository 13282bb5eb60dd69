"""The multi-turn rollout's tool and interaction config files, read when a config is loaded: verl's YAML layout,
and classes that are verl's built here (trainer/rollout/tools.py) or a user's, by import path (resolved when the
trainer starts: the daemon imports no user code)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from trainer.config.errors import ConfigProblem
from trainer.config.multi_turn import MultiTurnConfig

# verl's own tool and interaction classes -> this project's implementations (trainer/rollout/tools.py); any other
# class_name is a user's class by import path, with verl's BaseTool (or BaseInteraction) methods.
VERL_TOOLS = {"verl.tools.gsm8k_tool.Gsm8kTool": "Gsm8kTool",
              "verl.tools.geo3k_tool.Geo3kTool": "Geo3kTool",
              "verl.tools.search_tool.SearchTool": "SearchTool",
              "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "SandboxFusionTool"}
VERL_INTERACTIONS = {"verl.interactions.gsm8k_interaction.Gsm8kInteraction": "Gsm8kInteraction"}
# verl's MCP tools (config.type: mcp): accepted here, said at `verl train --check` (trainer/rollout/tools.py).
MCP_TOOLS = ("verl.tools.mcp_search_tool.MCPSearchTool", "verl.tools.mcp_base_tool.MCPBaseTool")
_KEY = "actor_rollout_ref.rollout.multi_turn"


def check_tool_files(config: Any) -> list[ConfigProblem]:
    """The multi-turn rollout's tool and interaction config files (a RunConfig's): each a YAML file in verl's
    layout, naming verl's classes built here or a class by its import path."""
    settings: MultiTurnConfig = config.actor_rollout_ref.rollout.multi_turn
    problems = []
    for name, path, section, known in (("tool_config_path", settings.tool_config_path, "tools", VERL_TOOLS),
                                       ("interaction_config_path", settings.interaction_config_path, "interaction",
                                        VERL_INTERACTIONS)):
        if path is not None:
            problems += _entries_problems(f"{_KEY}.{name}", path, section, known)
    return problems


def _entries_problems(key: str, path: str, section: str, known: dict[str, str]) -> list[ConfigProblem]:
    file = Path(path).expanduser()
    if not file.is_file():
        return [ConfigProblem(key, f"got {path!r}, which is not a file; allowed: a YAML file of verl's layout "
                                   f"({section}: [{{class_name, config, ...}}])")]
    try:
        loaded = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        return [ConfigProblem(key, f"got {path!r}, which is not readable YAML ({error}".splitlines()[0] + ")")]
    entries = loaded.get(section) if isinstance(loaded, dict) else None
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        return [ConfigProblem(key, f"got {path!r}, which has no `{section}` list; allowed: a YAML file of verl's "
                                   f"layout ({section}: [{{class_name, config, ...}}])")]
    problems = []
    for index, entry in enumerate(entries):
        class_name = entry.get("class_name")
        where = f"{path!r} {section}[{index}]"
        if not isinstance(class_name, str) or "." not in class_name:
            problems.append(ConfigProblem(key, f"{where}: class_name is {class_name!r}; allowed: verl's "
                                               f"{', '.join(known)}, or a class by its import path (module.Class)"))
        elif class_name.startswith("verl.") and class_name not in known and class_name not in MCP_TOOLS:
            problems.append(ConfigProblem(key, f"{where}: class_name is {class_name!r}, a class of verl's not built "
                                               f"here; allowed: verl's {', '.join(known)}, or a class of your own by "
                                               "its import path (module.Class) with verl's methods"))
        if section == "tools" and is_mcp(entry):
            servers = entry.get("mcp")
            if not isinstance(servers, dict) or not isinstance(servers.get("mcp_servers_config_path"), str):
                problems.append(ConfigProblem(key, f"{where}: an MCP tool without mcp.mcp_servers_config_path; "
                                                   "allowed: mcp: {mcp_servers_config_path: servers.json, "
                                                   "tool_selected_list: [...]}, as verl reads it"))
        elif section == "tools":
            schema = entry.get("tool_schema")
            function = schema.get("function") if isinstance(schema, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                problems.append(ConfigProblem(key, f"{where}: tool_schema.function.name is missing; allowed: an "
                                                   "OpenAI function schema (type: function, function: {name, "
                                                   "description, parameters})"))
    return problems


def is_mcp(entry: dict[str, Any]) -> bool:
    """Whether a tool config entry is verl's MCP tool (config.type: mcp, or one of verl's MCP classes)."""
    config = entry.get("config")
    return (isinstance(config, dict) and config.get("type") == "mcp") or entry.get("class_name") in MCP_TOOLS

