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
from trainer.rewards.time_limit import (
    RewardThreadsExhausted,
    RewardTimeoutError,
    StepInterrupted,
    call_with_time_limit,
)

ComputeScore = Callable[..., Any]


class CustomRewardError(UserError, ValueError):
    """The custom reward function cannot be loaded, or returned something that is not a score."""


class RewardFunctionError(CustomRewardError):
    """The custom reward function raised. `what` names the function, where it raised and the exception
    (the message adds what to do); `traceback_text` is the full traceback, for the run's log."""

    rank_local = True

    def __init__(self, what: str, traceback_text: str):
        super().__init__(f"{what}; fix the function, or set {KEYS.custom_reward_function.on_error}=zero to score "
                         "such responses 0")
        self.what = what
        self.traceback_text = traceback_text

    @classmethod
    def from_exception(cls, error: Exception, path: str, name: str, data_source: str, *,
                       scoring: str | None = None) -> RewardFunctionError:
        """`scoring`: what the function was scoring, in words (a response of `data_source` unless given)."""
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
        scoring = scoring or f"a response of data_source {data_source!r}"
        what = f"{KEYS.custom_reward_function} {name!r}{where} raised {exception} (scoring {scoring})"
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


def split_score(value: Any) -> tuple[float, dict[str, Any]]:
    """A scorer's result as (its score, what else it reported): a number or a bool reports nothing else; a dict's
    entries are all reported, its "score" included (verl's reward_extra_info)."""
    return as_float_score(value), dict(value) if isinstance(value, dict) else {}


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
    if not math.isfinite(score):
        raise CustomRewardError(f"the reward function returned {score}; a reward that is not finite would spoil "
                                "every update")
    return score


def resolve_compute_score(path: str | None, name: str, keywords: dict[str, Any] | None = None,
                          timeout_s: float | None = None) -> Callable[..., Any]:
    """The run's scorer: the custom function when ``path`` is set (called with `keywords` too:
    custom_reward_function.reward_kwargs, each call within `timeout_s`: reward_model.reward_timeout_s), else the
    built-in ones (which take no keywords, as in verl)."""
    if path is None:
        return default_compute_score
    return CustomScore(path, name, keywords, timeout_s)


class CustomScore:
    """The user's function ``name`` of the file at ``path``, called as verl calls it: (data_source, solution_str,
    ground_truth, extra_info). What it raises becomes a RewardFunctionError naming where; what it returns is
    passed on as it is (a number, or a dict with a "score" key and anything else it reports).

    `keywords` (custom_reward_function.reward_kwargs) are passed on each call as keyword arguments.

    Pickled as its path, name and keywords, so that a worker process (the prime manager's) loads the file itself."""

    def __init__(self, path: str, name: str, keywords: dict[str, Any] | None = None, timeout_s: float | None = None):
        self.path, self.name = path, name
        self.keywords = dict(keywords or {})
        self.timeout_s = timeout_s  # reward_model.reward_timeout_s: each call's limit (trainer/rewards/time_limit.py)
        self.stopping: Callable[[], bool] | None = None  # the trainer's stop request, watched while a call runs
        self.function = load_custom_score(path, name)  # loaded now: a missing file or name fails before training

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any,
                 extra_info: dict[str, Any] | None = None) -> Any:
        try:
            return call_with_time_limit(
                self.function, (data_source, solution_str, ground_truth, extra_info), self.keywords,
                limit_s=self.timeout_s, stopping=self.stopping,
                what=lambda: f"{KEYS.custom_reward_function} {self.name!r} ({self.path}) scoring a response of "
                             f"data_source {data_source!r}")
        except (RewardTimeoutError, RewardThreadsExhausted, StepInterrupted):  # not the function's own
            raise
        except Exception as error:  # the user's code: anything it raises is theirs to fix
            raise RewardFunctionError.from_exception(error, self.path, self.name, data_source) from error

    def __reduce__(self) -> tuple[type[CustomScore], tuple[str, str, dict[str, Any], float | None]]:
        return CustomScore, (self.path, self.name, self.keywords, self.timeout_s)


THREADS_EXHAUSTED = "refused in a worker"
"""How score_in_worker's failure starts when the worker's calls are refused (RewardThreadsExhausted): the run's
error whatever custom_reward_function.on_error says, since every later response of that worker would be refused."""


def score_in_worker(compute_score: Callable[..., Any], data_source: str, solution_str: str, ground_truth: Any,
                    extra_info: dict[str, Any] | None) -> tuple[float | None, dict[str, Any], str | None]:
    """In a worker process of the prime or remote manager: (score, what else a dict result reported, None), or
    (None, {}, why it was not scored). Never raises:
    an exception pickled back could fail to unpickle, and the manager needs only the fact of the failure. Kept in
    this module, which imports no torch, so that a worker starts fast."""
    try:
        result = compute_score(data_source, solution_str, ground_truth, extra_info)
        if isinstance(result, list | tuple) and result:  # verl's prime reads a sequence's first item
            result = result[0]
        score, extra = split_score(result)
        return score, extra, None
    except RewardThreadsExhausted as error:  # the worker's own pool is spent: not a response's failure
        return None, {}, f"{THREADS_EXHAUSTED}: {error}"
    except RewardFunctionError as error:
        return None, {}, f"not scored: {error.what}"
    except Exception as error:  # the scorer's own code, or a result that is no score
        return None, {}, f"not scored: {type(error).__name__}: {' '.join(str(error).split())[:300]}"


def worker_ready(_: int) -> bool:
    """A prime worker has started (it ran this)."""
    return True


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
