"""A user's scoring function, loaded from a Python file (custom_reward_function.path / .name)."""

from __future__ import annotations

import importlib.util
import math
import numbers
import sys
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from trainer.config import KEYS
from trainer.errors import UserError
from trainer.rewards.scorers import default_compute_score

ComputeScore = Callable[..., Any]


class CustomRewardError(UserError, ValueError):
    """The custom reward function cannot be loaded, or returned something that is not a score."""


class RewardFunctionError(CustomRewardError):
    """The custom reward function raised. `what` names the function, where it raised and the exception
    (the message adds what to do); `traceback_text` is the full traceback, for the run's log."""

    def __init__(self, what: str, traceback_text: str):
        super().__init__(f"{what}; fix the function, or set {KEYS.custom_reward_function.on_error}=zero to score "
                         "such responses 0")
        self.what = what
        self.traceback_text = traceback_text

    @classmethod
    def from_exception(cls, error: Exception, path: str, name: str, data_source: str) -> RewardFunctionError:
        # The wrapper's own frame is not the user's business.
        user_traceback = error.__traceback__.tb_next if error.__traceback__ is not None else None
        frames = traceback.extract_tb(user_traceback)
        file = str(Path(path).expanduser().resolve())
        # Where the user's file raised (or called what raised); the innermost frame if none is theirs.
        frame = next((frame for frame in reversed(frames) if str(Path(frame.filename).resolve()) == file),
                     frames[-1] if frames else None)
        where = f" at {frame.filename}:{frame.lineno}" if frame is not None else ""
        detail = " ".join(str(error).split())
        exception = f"{type(error).__name__}: {detail[:300]}" if detail else type(error).__name__
        what = (f"{KEYS.custom_reward_function} {name!r}{where} raised {exception} (scoring a response of data_source "
                f"{data_source!r})")
        return cls(what, "".join(traceback.format_exception(type(error), error, user_traceback)))


def load_custom_score(path: str, name: str) -> ComputeScore:
    """The function ``name`` of the Python file at ``path``."""
    module = _import_file(path)
    if not hasattr(module, name):
        defined = _defined_callables(module)
        listing = f"callables it defines: {', '.join(defined)}" if defined else "it defines no callables"
        raise CustomRewardError(f"{KEYS.custom_reward_function.path} {path!r} has no {name!r} ({listing}); "
                                f"set {KEYS.custom_reward_function.name}")
    function = getattr(module, name)
    if not callable(function):
        raise CustomRewardError(f"{name!r} in {KEYS.custom_reward_function.path} {path!r} is a "
                                f"{type(function).__name__}, not a function")
    return function


def as_float_score(value: Any) -> float:
    """A scorer's result as a float: a number, a bool, or a dict with a "score" key."""
    if isinstance(value, dict):
        if "score" not in value:
            raise CustomRewardError(f"the reward function returned a dict without a 'score' key "
                                    f"(keys: {', '.join(map(str, value))})")
        value = value["score"]
    # numbers.Real also admits numpy scalars, which user scorers often return.
    if not isinstance(value, numbers.Real):
        raise CustomRewardError(f"the reward function returned {type(value).__name__}; "
                                "return a float or a dict with a 'score' key")
    score = float(value)
    if math.isnan(score):
        raise CustomRewardError("the reward function returned nan; a nan reward would spoil every update")
    return score


def resolve_compute_score(path: str | None, name: str) -> Callable[..., float]:
    """The run's scorer: the custom function when ``path`` is set, else the built-in ones."""
    if path is None:
        return default_compute_score
    function = load_custom_score(path, name)

    def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                      extra_info: dict[str, Any] | None = None) -> float:
        try:
            value = function(data_source, solution_str, ground_truth, extra_info)
        except Exception as error:  # the user's code: anything it raises is theirs to fix
            raise RewardFunctionError.from_exception(error, path, name, data_source) from error
        return as_float_score(value)

    return compute_score


def _import_file(path: str) -> ModuleType:
    file = Path(path).expanduser()
    if not file.is_file():
        raise CustomRewardError(f"{KEYS.custom_reward_function.path} {path!r} does not exist; give a Python file")
    # A fresh name per load, so two runs' files (or two loads of one file) never share a module.
    module_name = f"custom_reward_{file.stem}_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise CustomRewardError(f"{KEYS.custom_reward_function.path} {path!r} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    # Registered before running, because dataclasses and pickling look the module up by name.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        message = " ".join(str(error).split())
        raise CustomRewardError(f"{KEYS.custom_reward_function.path} {path!r} raised {type(error).__name__} "
                                f"on import: {message}") from error
    return module


def _defined_callables(module: ModuleType) -> list[str]:
    return sorted(name for name, value in vars(module).items()
                  if callable(value) and not name.startswith("_")
                  and getattr(value, "__module__", None) == module.__name__)
