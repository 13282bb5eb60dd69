"""The user's errors: one base class in a leaf module, which every error the user can fix derives from, so that
trainer/main.py turns each into one ERROR line and exit code 2 (`except UserError`)."""

from __future__ import annotations

import importlib

import pytest

from tests.support import REPO
from tests.test_layering import LAYERS, imported_modules
from trainer.errors import UserError


def test_the_errors_module_imports_nothing_of_the_project():
    """Any module may derive its errors from UserError: importing it must not pull the trainer in (it once imported
    six packages to list the error types, so that `import trainer.distributed.ranks` loaded 45 modules)."""
    source = (REPO / "trainer" / "errors.py").read_text(encoding="utf-8")
    found = [(line, name) for line, name in imported_modules(source, "trainer.errors", is_package=False)
             if name.split(".")[0] in LAYERS]
    assert found == []


@pytest.mark.parametrize(("module", "name", "also"), [
    ("trainer.checkpoint", "CheckpointError", Exception),
    ("trainer.checkpoint", "CheckpointWriteError", Exception),
    ("trainer.data", "DataError", Exception),
    ("trainer.models", "ModelLoadError", Exception),
    ("trainer.rewards", "CustomRewardError", ValueError),
    ("trainer.rewards.custom", "RewardFunctionError", ValueError),
    ("trainer.rewards", "UnknownDataSource", ValueError),
    ("trainer.rollout.prompts", "PromptTooLong", ValueError),
    ("trainer.offload.options", "WorkerThreadsError", ValueError),
    ("trainer.errors", "RunSetupError", Exception),
])
def test_every_error_the_user_can_fix_is_a_user_error(module: str, name: str, also: type[Exception]):
    """Each keeps the base it had before UserError (a caller catching ValueError still catches PromptTooLong)."""
    error = getattr(importlib.import_module(module), name)
    assert issubclass(error, UserError) and issubclass(error, also)
