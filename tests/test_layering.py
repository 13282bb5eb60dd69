"""docs/design.md's import rules ("Folders"), checked on the source of every module (not by memory).

- api/ and daemon/ never import torch, transformers or accelerate (the daemon must outlive a trainer
  crash and start in a fraction of a second);
- api/ and daemon/ import only the torch-free trainer.config from trainer/ (the settings and the wire
  messages both sides share);
- trainer/ never imports api/ or daemon/;
- trainer/config/ (and trainer/__init__.py, which every `import trainer.config` runs) import no torch;
- trainer/offload/ has no import cycle, not even through imports made for the type checker alone.

The same rules (but the cycles) are ruff rules too (banned-api, TID251, in the ruff.toml of api/, daemon/, trainer/
and trainer/config/), so that an editor shows a violation as it is typed; the tests below check that those files
keep up with trainer/'s modules and that ruff applies them.

The checker reads imports with `ast`, so a module is judged without being imported: a violation is found
even in a module whose other imports would fail.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("trainer", "daemon", "api")
HEAVY = ("torch", "transformers", "accelerate")
# Modules the daemon imports on its own: they must stay importable without torch.


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a module's source, relative ones resolved.

    `from a import b` yields a.b (b may be a submodule); importlib.import_module("x") and __import__("x")
    with a literal name count as imports of x.
    """
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base_parts = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join(base_parts + ([node.module] if node.module else []))
            found += [(node.lineno, base if alias.name == "*" else f"{base}.{alias.name}".lstrip("."))
                      for alias in node.names]
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func) and node.args:
            name = node.args[0]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                found.append((node.lineno, name.value))
    return found


def _is_dynamic_import(function: ast.expr) -> bool:
    if isinstance(function, ast.Name):
        return function.id in ("__import__", "import_module")
    return isinstance(function, ast.Attribute) and function.attr == "import_module"


def broken_rule(importer: str, imported: str) -> str | None:
    """Why `importer` may not import `imported`, or None when it may."""
    layer, top = importer.split(".")[0], imported.split(".")[0]
    if layer in ("api", "daemon") and top in HEAVY:
        return f"{layer}/ never imports {', '.join(HEAVY)}"
    if layer in ("api", "daemon") and top == "trainer" and not _within(imported, "trainer.config"):
        return f"{layer}/ may import only trainer.config from trainer/"
    if layer == "trainer" and top in ("api", "daemon"):
        return "trainer/ never imports api/ or daemon/"
    if importer == "trainer" or _within(importer, "trainer.config"):
        if top in HEAVY:
            return f"{importer} must not import {', '.join(HEAVY)}: the daemon imports it"
        if top == "trainer" and not _within(imported, "trainer.config"):
            return f"{importer} imports no trainer module but trainer.config: another might pull in torch"
    return None


def _within(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    return [f"{module}:{line} imports {imported}: {rule}"
            for line, imported in imported_modules(source, module, is_package)
            if (rule := broken_rule(module, imported))]


def module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def source_files(layer: str) -> list[Path]:
    return sorted(path for path in (ROOT / layer).rglob("*.py") if "__pycache__" not in path.parts)


# ------------------------------------------------------------------------------------- the rules


@pytest.mark.parametrize("layer", LAYERS)
def test_every_module_keeps_the_import_rules(layer: str) -> None:
    files = source_files(layer)
    assert files, f"no Python files found under {layer}/: the check would pass without looking"
    found = []
    for path in files:
        module, is_package = module_name(path)
        found += violations(path.read_text(encoding="utf-8"), module, is_package)
    assert found == []


def test_importing_the_config_loads_no_torch() -> None:
    """What the source says, checked at run time too: pydantic or yaml plugins could pull torch in."""
    heavy = ", ".join(repr(name) for name in HEAVY)
    script = (f"import sys, trainer.config; loaded = [m for m in ({heavy},) if m in sys.modules]; "
              "print(loaded); sys.exit(1 if loaded else 0)")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------------------- the checker catches things


@pytest.mark.parametrize(("module", "is_package", "source"), [
    ("daemon.cli", False, "import torch\n"),
    ("daemon.cli", False, "from transformers import AutoModel\n"),
    ("daemon.supervisor", False, "def start():\n    import accelerate.utils\n"),
    ("daemon.cli", False, "from trainer.models import build_model\n"),
    ("daemon.cli", False, "from trainer import loop\n"),
    ("daemon.cli", False, "import trainer\n"),
    ("api.app", False, "from trainer.loop import Trainer\n"),
    ("api.hub", False, "from trainer import telemetry\n"),
    ("api.app", False, "import importlib\nimportlib.import_module('torch')\n"),
    ("api", True, "__import__('torch.cuda')\n"),
    ("trainer.loop", False, "from daemon.ipc import Client\n"),
    ("trainer.loop", False, "from ..api import schemas\n"),
    ("trainer.offload.engine", False, "from ...daemon import cli\n"),
    ("trainer.config", False, "import torch\n"),
    ("trainer.config", False, "from . import models\n"),
    ("trainer", True, "from .models import build_model\n"),
])
def test_the_checker_catches_a_violation(module: str, is_package: bool, source: str) -> None:
    assert len(violations(source, module, is_package)) == 1


@pytest.mark.parametrize(("module", "is_package", "source"), [
    ("daemon.cli", False, "from trainer.config import load_config, ConfigError\n"),
    ("daemon.cli", False, "from trainer import config\n"),
    ("daemon.cli", False, "import trainer.config\nfrom api import app\nimport pydantic\n"),
    ("api.app", False, "from fastapi import FastAPI\nfrom . import schemas\n"),
    ("api.hub", False, "from trainer.config.messages import StepMessage\nfrom trainer import config\n"),
    ("trainer.loop", False, "import torch\nfrom transformers import AutoModel\nfrom . import config\n"),
    ("trainer.offload.engine", False, "from ..config import FSDPConfig\nimport torch\n"),
    ("trainer.config", False, "import yaml\nfrom pydantic import BaseModel\n"),
])
def test_the_checker_allows_what_the_design_allows(module: str, is_package: bool, source: str) -> None:
    assert violations(source, module, is_package) == []


def test_relative_imports_resolve_to_absolute_names() -> None:
    source = "from . import a\nfrom .. import b\nfrom ..c import d\nfrom .e import *\n"
    assert [name for _, name in imported_modules(source, "trainer.offload.engine", False)] == [
        "trainer.offload.a", "trainer.b", "trainer.c.d", "trainer.offload.e"]
    assert [name for _, name in imported_modules("from . import a\n", "trainer.offload", True)] == [
        "trainer.offload.a"]


# ------------------------------------------------------------------------------- import cycles


def package_sources(package: str) -> dict[str, tuple[str, bool]]:
    """Module name -> (source, is_package) of every module of `package`."""
    sources = {}
    for path in source_files(package.replace(".", "/")):
        module, is_package = module_name(path)
        sources[module] = (path.read_text(encoding="utf-8"), is_package)
    return sources


def import_graph(sources: Mapping[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the modules among `sources` it imports: every import in its source, those under TYPE_CHECKING and
    inside functions too. `from a.b import C` counts as an import of a.b (of a.b.C when that is a module itself).

    A module's import of its own package's __init__, which Python runs before any of its submodules, is not counted
    unless the module names the package (`from trainer.offload import X`): counted, every submodule would make a
    cycle with an __init__ that imports it."""
    graph = {}
    for module, (source, is_package) in sources.items():
        imported = set()
        for _, name in imported_modules(source, module, is_package):
            while name and name not in sources:
                name = name.rpartition(".")[0]
            if name and name != module:
                imported.add(name)
        graph[module] = imported
    return graph


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (a, b, ..., a), or None when it has none."""
    path: list[str] = []
    finished: set[str] = set()

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in finished:
            return None
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if (cycle := visit(imported)) is not None:
                return cycle
        path.pop()
        finished.add(module)
        return None

    for module in sorted(graph):
        if (cycle := visit(module)) is not None:
            return cycle
    return None


def test_the_offload_engine_has_no_import_cycle() -> None:
    """Its modules import each other one way (options and units below, the engine on top), so each can be read,
    typed and tested from the ones below it; `TYPE_CHECKING` imports count: they hid six modules' cycle through
    the engine's OffloadOptions."""
    sources = package_sources("trainer.offload")
    assert len(sources) > 10, "the offload modules were not found: the check would pass without looking"
    cycle = find_cycle(import_graph(sources))
    assert cycle is None, " -> ".join(cycle or [])


@pytest.mark.parametrize("sources", [
    {"p.a": ("from p.b import B\n", False), "p.b": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                     "    from p.a import A\n", False)},
    {"p.a": ("from . import b\n", False), "p.b": ("def f():\n    from .c import C\n", False),
     "p.c": ("import p.a\n", False)},
    {"p": ("from p.a import A\n", True), "p.a": ("from p import helper\n", False)},
])
def test_the_cycle_check_finds_a_cycle(sources: dict[str, tuple[str, bool]]) -> None:
    assert find_cycle(import_graph(sources)) is not None


def test_the_cycle_check_allows_a_package_that_imports_its_modules() -> None:
    sources = {"p": ("from p.a import A\nfrom p.b import B\n", True), "p.a": ("from p.b import B\n", False),
               "p.b": ("import torch\n", False)}
    assert import_graph(sources) == {"p": {"p.a", "p.b"}, "p.a": {"p.b"}, "p.b": set()}
    assert find_cycle(import_graph(sources)) is None


# ------------------------------------------------------------------------------------ the ruff rules


def banned_imports(config: Path) -> set[str]:
    """The modules a ruff.toml bans (flake8-tidy-imports banned-api), those of the configs it extends included
    when it has none of its own (ruff replaces the table, it does not add to it)."""
    settings = tomllib.loads(config.read_text(encoding="utf-8"))
    banned = settings.get("lint", {}).get("flake8-tidy-imports", {}).get("banned-api")
    if banned is None and "extend" in settings and settings["extend"].endswith("ruff.toml"):
        return banned_imports((config.parent / settings["extend"]).resolve())
    return set(banned or {})


def trainer_modules_but_the_config() -> set[str]:
    """trainer.X for each module and subpackage of trainer/ but config (ruff bans a module with all below it)."""
    return {f"trainer.{path.stem if path.is_file() else path.name}" for path in (ROOT / "trainer").iterdir()
            if path.name not in ("__init__.py", "config")
            and (path.suffix == ".py" or (path / "__init__.py").is_file())}


@pytest.mark.parametrize(("folder", "expected"), [
    ("api", {*HEAVY, *trainer_modules_but_the_config()}),
    ("daemon", {*HEAVY, *trainer_modules_but_the_config()}),
    ("trainer", {"api", "daemon"}),
    ("trainer/config", {"api", "daemon", *HEAVY, *trainer_modules_but_the_config()}),
])
def test_each_layers_ruff_config_bans_what_its_rules_forbid(folder: str, expected: set[str]) -> None:
    """A new module of trainer/ must be added to the lists of api/ruff.toml and trainer/config/ruff.toml."""
    assert banned_imports(ROOT / folder / "ruff.toml") == expected


def ruff_check(path: str, source: str) -> subprocess.CompletedProcess[str]:
    """`ruff check` of `source` as if it were the file at `path` (ruff picks the ruff.toml nearest to it), without
    writing it there."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    return subprocess.run([ruff, "check", "--no-cache", "--select", "TID251", "--output-format", "concise",
                           "--stdin-filename", path, "-"], cwd=ROOT, input=source, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize(("path", "source", "banned"), [
    ("api/_probe.py", "import torch\nfrom trainer.loop import Trainer\n", ["torch", "trainer.loop"]),
    ("daemon/_probe.py", "from transformers import AutoModel\nfrom trainer import offload\n",
     ["transformers", "trainer.offload"]),
    ("trainer/offload/_probe.py", "from daemon import cli\n", ["daemon"]),
    ("trainer/config/_probe.py", "import torch.cuda\nimport api.app\n", ["torch", "api"]),
])
def test_ruff_reports_a_banned_import_where_it_is_banned(path: str, source: str, banned: list[str]) -> None:
    result = ruff_check(path, source)
    assert [f"`{name}` is banned" in result.stdout for name in banned] == [True] * len(banned), result.stdout


@pytest.mark.parametrize(("path", "source"), [
    ("api/_probe.py", "from trainer.config import RunConfig\nfrom trainer.config.messages import StepMessage\n"),
    ("daemon/_probe.py", "import api.app\nfrom trainer.config.ipc import ENV_SOCKET\n"),
    ("trainer/offload/_probe.py", "import torch\nfrom trainer.loop import Trainer\n"),
])
def test_ruff_allows_what_the_rules_allow(path: str, source: str) -> None:
    result = ruff_check(path, source)
    assert result.returncode == 0, result.stdout + result.stderr
