"""The multi-turn rollout's tools and interactions, from verl's config files (multi_turn.tool_config_path,
interaction_config_path): `tools: [{class_name, config, tool_schema}]`, `interaction: [{name, class_name, config}]`.

verl's own classes map to this project's implementations (trainer/config/tool_files.py names them): its gsm8k and
geo3k tools, its gsm8k interaction, and its search and sandbox-fusion tools as HTTP clients of their configured URL.
Any other class_name is a user's class by its import path, built as verl builds it (`cls(config, tool_schema)`,
`cls(config)`) and called through verl's BaseTool and BaseInteraction methods (async create, execute, calc_reward,
release; start_interaction, generate_response, calculate_score, finalize_interaction): duck-typed, verl not needed.

verl's MCP tools (config.type: mcp, their schemas fetched from MCP servers) need verl's MCP client, the `fastmcp`
package, which is not a dependency here, and are not built: `tool_problems` says so in one line at
`verl train --check`, and the trainer stops with the same line at its start.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import uuid4

import yaml

from trainer.config.tool_files import VERL_INTERACTIONS, VERL_TOOLS, is_mcp
from trainer.errors import UserError
from trainer.rewards.scorers import same_geo3k_answer, score_gsm8k


class ToolConfigError(UserError, ValueError):
    """A tool or interaction of the config cannot be built; the message names the file and the class."""


class Schema(dict):
    """A tool's OpenAI function schema (a dict, as the chat template reads it) that a user's class may also read as
    verl's pydantic OpenAIFunctionToolSchema: `schema.function.name`, `schema.model_dump()`."""

    def __getattr__(self, name: str) -> Any:
        try:
            value = self[name]
        except KeyError:
            raise AttributeError(name) from None
        return Schema(value) if isinstance(value, dict) else value

    def model_dump(self, **_: Any) -> dict[str, Any]:
        return json.loads(json.dumps(self))


class Response:
    """What a tool's execute returns (verl's ToolResponse, text only)."""

    def __init__(self, text: str | None = None):
        self.text = text


def text_of(response: Any) -> str:
    """A tool's or a user's class's response as text: verl's ToolResponse (.text), a str, or a dict's "text"."""
    if response is None:
        return ""
    if isinstance(response, str):
        return response
    if isinstance(response, dict):
        return str(response.get("text") or "")
    return str(getattr(response, "text", None) or "")


def has_media(response: Any) -> bool:
    """Whether a tool's response carries images or video (verl's ToolResponse.image, .video, or a dict's)."""
    if isinstance(response, dict):
        return bool(response.get("image") or response.get("video"))
    return bool(getattr(response, "image", None) or getattr(response, "video", None))


class BuiltinTool:
    """verl's BaseTool: one instance per call (create, execute, release), its state kept by instance id."""

    def __init__(self, config: dict[str, Any], tool_schema: Schema):
        self.config = config
        self.tool_schema = tool_schema
        self.name: str = tool_schema.function.name
        self._instances: dict[str, dict[str, Any]] = {}
        self.report: Callable[[str], None] = print
        """Where an unreachable server is said (the trainer's log); set by the rollout."""

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, Response]:
        instance_id = instance_id or uuid4().hex
        self._instances[instance_id] = {"create_kwargs": kwargs.get("create_kwargs", {}), "reward": 0.0}
        return instance_id, Response()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[Any, float, dict]:
        raise NotImplementedError

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> Any:
        return self._instances[instance_id]["reward"]

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)


class Gsm8kTool(BuiltinTool):
    """verl's gsm8k tool: the model submits its answer and gets its score back. The ground truth comes from the row's
    extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth; each execute scores the answer (GSM8K's
    flexible rule: the last number) and rewards -0.05 for a submission that does not improve on the last one."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[Any, float, dict]:
        state = self._instances[instance_id]
        answer = str(parameters.get("answer", ""))
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = score_gsm8k(state["response"], state["create_kwargs"].get("ground_truth"), method="flexible")
        tool_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return Response(f"Current parsed {answer=} {reward=}"), tool_reward, {}


class Geo3kTool(BuiltinTool):
    """verl's geo3k tool (verl/tools/geo3k_tool.py): the model submits its answer to the geometry problem and gets its
    score back. The ground truth comes from the row's extra_info.tools_kwargs.calc_geo3k_reward.create_kwargs
    .ground_truth; each execute scores the answer as it is (verl's geo3k rule with use_boxed=False and no format
    score: 1.0 right, 0.0 not) and rewards -0.05 for a submission that does not improve on the last one."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[Any, float, dict]:
        state = self._instances[instance_id]
        answer = str(parameters.get("answer", ""))
        reward = float(same_geo3k_answer(answer, state["create_kwargs"].get("ground_truth")))
        tool_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return Response(f"Current parsed {answer=} {reward=}"), tool_reward, {}


class HttpTool(BuiltinTool):
    """A tool that posts to its configured server and waits at most its timeout; a server it cannot reach is said in
    one ERROR line naming the tool and the URL (once), and the call's response says it failed, as verl's does."""

    url_key = ""
    timeout_key = "timeout"

    def __init__(self, config: dict[str, Any], tool_schema: Schema):
        super().__init__(config, tool_schema)
        self.url = str(config.get(self.url_key) or "")
        if not self.url:
            raise ToolConfigError(f"tool {self.name!r}: config.{self.url_key} is missing; allowed: the server's URL")
        self.timeout = float(config.get(self.timeout_key, 30))
        self._unreachable_said = False

    def post(self, payload: dict[str, Any], timeout: float) -> tuple[dict[str, Any] | None, str | None]:
        """(the server's JSON answer, None), or (None, why it failed)."""
        request = urllib.request.Request(self.url, data=json.dumps(payload).encode(), method="POST",
                                         headers={"Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310 (the user's URL)
                return json.loads(answer.read().decode()), None
        except (urllib.error.URLError, TimeoutError, OSError, ValueError) as error:
            reason = getattr(error, "reason", error)
            if not self._unreachable_said:
                self._unreachable_said = True
                self.report(f"ERROR: tool {self.name!r} could not reach {self.url} within {timeout:g} s ({reason}); "
                            "its calls answer with the error until it does")
            return None, f"{type(error).__name__}: {reason}"


class SearchTool(HttpTool):
    """verl's search tool (Search-R1's retriever): posts {queries, topk, return_scores} to retrieval_service_url and
    answers with the passages as verl formats them ("Doc 1 (Title: ...)")."""

    url_key = "retrieval_service_url"

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[Any, float, dict]:
        queries = parameters.get("query_list")
        if not queries or not isinstance(queries, list):
            return Response(json.dumps({"result": "Error: 'query_list' is missing, empty, or not a list in "
                                                  "parameters."})), 0.0, {}
        answer, error = self.post({"queries": queries, "topk": int(self.config.get("topk", 3)),
                                   "return_scores": True}, self.timeout)
        if error is not None:
            return Response(json.dumps({"result": f"Search error: {error}"})), 0.0, {"error": error}
        results = (answer or {}).get("result", [])
        if not results:
            return Response(json.dumps({"result": "No search results found."})), 0.0, {"total_results": 0}
        text = "\n---\n".join(_passages(result) for result in results)
        self._instances[instance_id].setdefault("results", []).append(text)
        return Response(json.dumps({"result": text}, ensure_ascii=False)), 0.0, {"query_count": len(queries)}


def _passages(retrieved: list[dict[str, Any]]) -> str:
    """One query's passages as verl writes them: "Doc i (Title: first line)" and the rest of the passage."""
    lines = []
    for index, item in enumerate(retrieved):
        title, _, body = str(item.get("document", {}).get("contents", "")).partition("\n")
        lines.append(f"Doc {index + 1} (Title: {title})\n{body}\n")
    return "\n".join(lines).strip()


class SandboxFusionTool(HttpTool):
    """verl's code interpreter: posts the code to a SandboxFusion server's run_code (sandbox_fusion_url) and answers
    with its stdout and stderr."""

    url_key = "sandbox_fusion_url"
    timeout_key = "default_timeout"

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[Any, float, dict]:
        timeout = float(parameters.get("timeout", self.timeout))
        answer, error = self.post({"compile_timeout": timeout, "run_timeout": timeout,
                                   "code": str(parameters.get("code", "")), "stdin": None,
                                   "memory_limit_MB": int(self.config.get("memory_limit_mb", 1024)),
                                   "language": parameters.get("language", self.config.get("default_language",
                                                                                           "python")),
                                   "files": {}, "fetch_files": []}, timeout + 10)
        if error is not None:
            return Response(f"Error when executing tool: {error}"), 0.0, {"error": error}
        run = (answer or {}).get("run_result") or {}
        if run.get("status") == "Finished":
            return Response((run.get("stdout") or "") + (run.get("stderr") or "")), 0.0, {}
        return Response("no stdout here"), 0.0, {}


class Gsm8kInteraction:
    """verl's gsm8k interaction: the user says whether the model's last answer is right (GSM8K's strict rule: the
    number after "#### "); a right one ends the conversation, a wrong one asks the model to try again. The turn's
    score is the answer's."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.name = config.get("name", "gsm8k")
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, ground_truth: str | None = None,
                                **kwargs: Any) -> str:
        instance_id = instance_id or uuid4().hex
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> tuple[bool, str, float, dict]:
        content = next((str(message.get("content") or "") for message in reversed(messages)
                        if message.get("role") == "assistant"), "")
        self._instances[instance_id]["response"] = content
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, "Your response is correct!", reward, {}
        return False, "Your response is incorrect! You need to reflect on your answer and try again.", reward, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        state = self._instances[instance_id]
        return score_gsm8k(state["response"], state["ground_truth"], method="strict")

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)


_BUILTIN: dict[str, type] = {"Gsm8kTool": Gsm8kTool, "Geo3kTool": Geo3kTool, "SearchTool": SearchTool,
                             "SandboxFusionTool": SandboxFusionTool, "Gsm8kInteraction": Gsm8kInteraction}


TOOLS_KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
INTERACTIONS_KEY = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"


def _class_of(class_name: str, known: dict[str, str], where: str) -> type:
    if class_name in known:
        return _BUILTIN[known[class_name]]
    module_name, _, attribute = class_name.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except Exception as error:  # noqa: BLE001 (a user's module may raise anything as it imports)
        raise ToolConfigError(f"{where}: class_name {class_name!r} cannot be imported ({type(error).__name__}: "
                              f"{error}); allowed: verl's {', '.join(known)}, or a class importable by that path"
                              ) from None
    if not isinstance(found, type):
        raise ToolConfigError(f"{where}: class_name {class_name!r} is a {type(found).__name__}, not a class; "
                              f"allowed: verl's {', '.join(known)}, or a class importable by that path")
    return found


def _entries(path: str, section: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load(Path(path).expanduser().read_text(encoding="utf-8"))[section])


def schema_problem(schema: Any) -> str | None:
    """What makes a tool_schema other than verl's OpenAIFunctionToolSchema reads it, or None. A function without a
    description, parameters without properties or required are let through (verl asks for them; a chat template
    writes none)."""
    if not isinstance(schema, dict) or not isinstance(schema.get("type"), str):
        return "tool_schema.type is missing"
    function = schema.get("function")
    if not isinstance(function, dict):
        return "tool_schema.function is missing"
    if not isinstance(function.get("name"), str):
        return f"tool_schema.function.name is {function.get('name')!r}, not a string"
    if function.get("description") is not None and not isinstance(function["description"], str):
        return f"tool_schema.function.description is {function['description']!r}, not a string"
    parameters = function.get("parameters")
    if parameters is None:
        return None
    where = "tool_schema.function.parameters"
    if not isinstance(parameters, dict) or not isinstance(parameters.get("type"), str):
        return f"{where}.type is missing"
    properties, required = parameters.get("properties", {}), parameters.get("required", [])
    if not isinstance(properties, dict):
        return f"{where}.properties is {properties!r}, not a mapping"
    for name, value in properties.items():
        if not isinstance(value, dict) or not isinstance(value.get("type"), str):
            return f"{where}.properties.{name}.type is missing"
        if value.get("enum") is not None and not (isinstance(value["enum"], list)
                                                  and all(isinstance(item, str) for item in value["enum"])):
            return f"{where}.properties.{name}.enum is {value['enum']!r}, not a list of strings"
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        return f"{where}.required is {required!r}, not a list of names"
    return None


SCHEMA = ("an OpenAI function schema as verl's OpenAIFunctionToolSchema reads it (type: function, function: {name, "
          "description, parameters: {type: object, properties: {NAME: {type, description}}, required: [NAME, ...]}})")


def _build_tool(entry: dict[str, Any], where: str, report: Callable[[str], None]) -> Any:
    """One tool of a tool config file, as verl builds it; ToolConfigError naming `where` if it cannot be."""
    class_name = entry.get("class_name")
    if is_mcp(entry):
        servers = (entry.get("mcp") or {}).get("mcp_servers_config_path")
        missing = importlib.util.find_spec("fastmcp") is None
        raise ToolConfigError(
            f"{where}: an MCP tool (config.type: mcp, servers in {servers!r}) needs verl's MCP client, the "
            f"`fastmcp` package, {'which is not installed, ' if missing else ''}and MCP tools are not built here; "
            f"allowed: a native tool (verl's {', '.join(VERL_TOOLS)}, or your class by import path)")
    cls = _class_of(str(class_name), VERL_TOOLS, where)
    problem = schema_problem(entry.get("tool_schema"))
    if problem is not None:
        raise ToolConfigError(f"{where}: {problem}; allowed: {SCHEMA}")
    schema = Schema(entry["tool_schema"])
    try:
        tool = cls(config=entry.get("config") or {}, tool_schema=schema)
    except ToolConfigError as error:
        raise ToolConfigError(f"{where}: {error}") from None
    except Exception as error:  # noqa: BLE001 (a user's class may raise anything on its config)
        raise ToolConfigError(f"{where}: building it with its config and tool_schema raised "
                              f"{type(error).__name__}: {error}; allowed: a config its class accepts") from None
    _check_methods(tool, ("create", "execute", "release"), "BaseTool", where)
    if isinstance(tool, BuiltinTool):
        tool.report = report
    return tool


def _check_methods(built: Any, methods: tuple[str, ...], base: str, where: str) -> None:
    missing = [method for method in methods if not callable(getattr(built, method, None))]
    if missing:
        raise ToolConfigError(f"{where}: the class has no {', '.join(missing)}; allowed: a class with verl's {base} "
                              f"methods (async {', '.join(methods)})")


def _build_interaction(entry: dict[str, Any], where: str) -> Any:
    cls = _class_of(str(entry.get("class_name")), VERL_INTERACTIONS, where)
    try:
        interaction = cls(config={**(entry.get("config") or {}), "name": entry.get("name", "")})
    except Exception as error:  # noqa: BLE001 (a user's class may raise anything on its config)
        raise ToolConfigError(f"{where}: building it with its config raised {type(error).__name__}: {error}; "
                              "allowed: a config its class accepts") from None
    _check_methods(interaction, ("start_interaction", "generate_response", "finalize_interaction"),
                   "BaseInteraction", where)
    return interaction


def _where(key: str, path: str, section: str, index: int, entry: dict[str, Any]) -> str:
    return f"{key}: {path!r} {section}[{index}] ({entry.get('class_name')})"


def load_tools(path: str, report: Callable[[str], None] = print) -> dict[str, Any]:
    """{function name: tool} of a tool config file (its layout checked when the config loaded: tool_files.py)."""
    tools = {}
    for index, entry in enumerate(_entries(path, "tools")):
        tool = _build_tool(entry, _where(TOOLS_KEY, path, "tools", index, entry), report)
        tools[getattr(tool, "name", None) or Schema(entry["tool_schema"]).function.name] = tool
    return tools


def tool_problems(config: Any) -> list[str]:
    """`verl train --check`: each tool and interaction of the run's multi-turn rollout built as the trainer builds
    it (its class imported, its schema as verl's, its config accepted), one line per one that cannot be."""
    settings = config.actor_rollout_ref.rollout.multi_turn
    if not settings.runs:
        return []
    problems = []
    for key, path, section in ((TOOLS_KEY, settings.tool_config_path, "tools"),
                               (INTERACTIONS_KEY, settings.interaction_config_path, "interaction")):
        if path is None:
            continue
        for index, entry in enumerate(_entries(path, section)):
            where = _where(key, path, section, index, entry)
            try:
                _build_tool(entry, where, print) if section == "tools" else _build_interaction(entry, where)
            except ToolConfigError as error:
                problems.append(str(error))
    return problems


def tool_schemas(tools: dict[str, Any]) -> list[dict[str, Any]]:
    """The tools' function schemas, as the chat template takes them (`tools=`)."""
    return [Schema(tool.tool_schema).model_dump() if isinstance(tool.tool_schema, dict)
            else tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in tools.values()]


def load_interactions(path: str) -> dict[str, Any]:
    """{name: interaction} of an interaction config file; a row names its interaction in
    extra_info.interaction_kwargs.name."""
    interactions = {}
    for index, entry in enumerate(_entries(path, "interaction")):
        interaction = _build_interaction(entry, _where(INTERACTIONS_KEY, path, "interaction", index, entry))
        interactions[entry.get("name") or getattr(interaction, "name", "")] = interaction
    return interactions
