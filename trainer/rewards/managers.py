"""verl's rule-based reward managers, by verl's names (reward_model.reward_manager; verl's
verl/workers/reward_manager/): how a batch of responses is turned into rewards with the run's scoring function
(custom_reward_function, or the built-in scorers by data_source).

- naive: each response scored in turn (manager.py's RuleReward);
- dapo: naive, plus DAPO's overlong penalty (reward_kwargs.overlong_buffer_cfg) and the raw score as `acc`;
- prime: each response scored in a pool of worker processes, a failure or a late score counting 0 (PRIME's: every
  score due within PRIME_TIMEOUT_S of the batch's start, as verl's; reward_model.reward_timeout_s does not apply);
- batch: one call of the function for the whole batch (data_sources, solution_strs, ground_truths, extra_infos,
  and reward_kwargs as keyword arguments), the whole call within one reward_model.reward_timeout_s;
- remote (verl's reward loop's): each response scored in a pool of worker processes, as prime, waiting for every
  score, a failure the run's error (or, custom_reward_function.on_error: zero, a 0), a dict result's entries reported.

A reward model (reward_model.enable) scores instead of any of them, as in verl, where a manager passes the reward
model's scores through.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from trainer.algorithms.reward_shaping import overlong_penalty
from trainer.config import KEYS, RunConfig
from trainer.config.schema import OverlongBuffer
from trainer.rewards.custom import (
    THREADS_EXHAUSTED,
    CustomRewardError,
    RewardFunctionError,
    load_custom_score,
    resolve_compute_score,
    score_in_worker,
    split_score,
    worker_ready,
)
from trainer.rewards.manager import RewardFunction, RewardScores, RuleReward, ScoreFunction, decode_responses
from trainer.rewards.sandbox_fusion import SandboxFusion, SandboxScore
from trainer.rewards.time_limit import RewardThreadsExhausted, RewardTimeoutError, StepInterrupted, call_with_time_limit
from trainer.rewards.worker_pool import WorkerPool
from trainer.rollout.batch import RolloutBatch

Warn = Callable[[str], None]


class DapoReward(RuleReward):
    """verl's dapo manager: naive's scores, each reported as `acc` too (a dict result's entries instead), with
    DAPO's overlong penalty added to responses longer than max_resp_len - overlong_buffer_cfg.len tokens
    (trainer/algorithms/reward_shaping.py); with overlong_buffer_cfg.log, each response's penalty is reported as
    `overlong_reward` and `overlong` (whether it was penalised)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, compute_score: ScoreFunction, *,
                 max_response_length: int | None, buffer: OverlongBuffer, on_error: str = "raise",
                 warn: Warn = print):
        super().__init__(tokenizer, compute_score, on_error=on_error, warn=warn)
        if buffer.enable and max_response_length is None:
            raise ValueError("the overlong buffer needs max_resp_len")
        self.max_response_length = max_response_length
        self.buffer = buffer

    def score(self, batch: RolloutBatch) -> RewardScores:
        scored = super().score(batch)
        if not self.buffer.enable:
            return scored
        assert self.max_response_length is not None
        penalties = overlong_penalty(batch.response_lengths, self.max_response_length, self.buffer.len,
                                     self.buffer.penalty_factor).to(scored.scores.device)
        if self.buffer.log:
            for reported, penalty in zip(scored.extra, penalties.tolist(), strict=True):
                reported.update(overlong_reward=penalty, overlong=penalty < 0)
        return RewardScores(scored.scores + penalties, scored.extra)

    def _texts(self, batch: RolloutBatch) -> list[str]:
        # verl's dapo drops an EOS the decoding kept as text (a tokenizer whose EOS is not a special token).
        eos = self.tokenizer.eos_token
        texts = super()._texts(batch)
        return [text[:-len(eos)] if eos and text.endswith(eos) else text for text in texts]

    def _extra(self, result: Any, score: float) -> dict[str, Any]:
        return dict(result) if isinstance(result, dict) else {"acc": score}


PRIME_TIMEOUT_S = 300.0
"""How long verl's prime manager waits for a batch's scores before it scores the late ones 0."""
PRIME_PROCESSES = 64
"""verl's prime manager's worker processes (here at most this rank's share of the host's cores)."""


class PrimeReward:
    """verl's prime manager (PRIME, Cui et al. 2025, "Process Reinforcement through Implicit Rewards"): each response
    scored by the function in a pool of worker processes, every score due within `timeout_s` of the batch's start.
    A response whose scoring raises or is late scores 0, as in verl, and is counted (reward/errors); a late one's
    worker is stopped (the pool starts again for the next batch), so a scorer stuck on one response (a program
    that loops) costs the batch `timeout_s`, not the run. It reports nothing besides the scores (verl's neither).

    The workers are started (spawned: no copy of the trainer's CUDA context or threads) at the first batch and
    kept; the function goes to them pickled (a custom function as its file and name, loaded there)."""

    name = "prime"
    zeroed_by = "as in verl"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, compute_score: ScoreFunction, *,
                 processes: int | None = None, timeout_s: float | None = PRIME_TIMEOUT_S, warn: Warn = print):
        self.tokenizer = tokenizer
        self.compute_score = compute_score
        # Each of a node's ranks scores its own share of the batch: the node's cores are shared among them.
        cores = (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.processes = processes or max(1, min(PRIME_PROCESSES, cores))
        self.timeout_s = timeout_s
        self.warn = warn
        self.errors = 0
        self._pool: multiprocessing.pool.Pool | None = None
        self._warned: set[str] = set()

    def __call__(self, batch: RolloutBatch) -> torch.Tensor:
        return self.score(batch).scores

    def score(self, batch: RolloutBatch) -> RewardScores:
        texts = decode_responses(batch, self.tokenizer)
        pool = self._pool or self._start()
        pending = [pool.apply_async(score_in_worker, (self.compute_score, record.data_source, text,
                                                      record.ground_truth, record.extra_info))
                   for record, text in zip(batch.records, texts, strict=True)]
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        scored = [self._collect(result, deadline) for result in pending]
        if any(not result.ready() for result in pending):  # a worker still at a late score: stopped with the rest
            self.close()
        return RewardScores(torch.tensor([score for score, _ in scored], dtype=torch.float32,
                                         device=batch.response_ids.device),
                            [self._extra(extra) for _, extra in scored])

    def _extra(self, extra: dict[str, Any]) -> dict[str, Any]:
        """What is reported of a result besides its score: nothing, as verl's prime."""
        return {}

    def close(self) -> None:
        """Stop the worker processes (a later batch starts new ones)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def _start(self) -> multiprocessing.pool.Pool:
        # Its shutdown ends the workers even where this process ignores SIGTERM (trainer/rewards/worker_pool.py).
        self._pool = WorkerPool(self.processes)
        # The workers' start (a Python and the scorer's imports each) is not the scores' time: it is waited for.
        self._pool.map(worker_ready, range(self.processes), chunksize=1)
        return self._pool

    def _collect(self, result: multiprocessing.pool.AsyncResult, deadline: float | None
                 ) -> tuple[float, dict[str, Any]]:
        try:
            score, extra, failure = result.get(timeout=None if deadline is None
                                               else max(0.0, deadline - time.monotonic()))
        except multiprocessing.TimeoutError:
            score, extra, failure = None, {}, f"not scored within {self.timeout_s:g} s"
        if failure is None:
            assert score is not None
            return score, extra
        self._failed(failure)
        self.errors += 1
        kind = failure.split(":")[0]
        if kind not in self._warned:  # once per kind of failure: a scorer that fails often must not flood the log
            self._warned.add(kind)
            self.warn(f"{KEYS.reward_model.reward_manager} {self.name}: a response was {failure}; it scores 0 "
                      f"({self.zeroed_by}), and the reward/errors metric counts such responses")
        return 0.0, {}

    def _failed(self, failure: str) -> None:
        """A response not scored (`failure` says why): it scores 0, as in verl's prime."""


class RemoteReward(PrimeReward):
    """verl's reward loop's remote manager: each response scored by the function in a pool of worker processes
    (verl's Ray workers, for scorers that misbehave in threads), every score waited for. A scorer that raises is the
    run's error, as in verl, or (custom_reward_function.on_error: zero) scores 0, counted (reward/errors); a dict
    result's entries are reported (reward/<name>/mean), as naive's."""

    name = "remote"
    zeroed_by = f"{KEYS.custom_reward_function.on_error}: zero"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, compute_score: ScoreFunction, *, on_error: str = "raise",
                 processes: int | None = None, warn: Warn = print):
        super().__init__(tokenizer, compute_score, processes=processes, timeout_s=None, warn=warn)
        self.on_error = on_error

    def _extra(self, extra: dict[str, Any]) -> dict[str, Any]:
        return extra

    def _failed(self, failure: str) -> None:
        if failure.startswith(THREADS_EXHAUSTED):
            raise RewardThreadsExhausted(f"{KEYS.reward_model.reward_manager} remote: a response was {failure}")
        if self.on_error != "zero":
            raise RewardFunctionError(f"{KEYS.reward_model.reward_manager} remote: a response was {failure}", "")


class BatchReward:
    """verl's batch manager: the function scores the whole batch in one call, with keyword arguments
    data_sources, solution_strs, ground_truths and extra_infos (lists of B), and reward_kwargs; it returns B scores
    (numbers, or dicts with a "score" key and what else it reports). A function that raises is the run's error,
    or (custom_reward_function.on_error: zero) scores the batch 0, every response counted (reward/errors)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, function: Callable[..., Any], keywords: dict[str, Any], *,
                 path: str, name: str, on_error: str = "raise", warn: Warn = print, timeout_s: float | None = None):
        self.tokenizer = tokenizer
        self.function = function
        self.timeout_s = timeout_s  # reward_model.reward_timeout_s
        self.stopping: Callable[[], bool] | None = None  # the trainer's stop request, watched while the call runs
        self.keywords = keywords
        self.path, self.name = path, name
        self.on_error = on_error
        self.warn = warn
        self.errors = 0

    def __call__(self, batch: RolloutBatch) -> torch.Tensor:
        return self.score(batch).scores

    def score(self, batch: RolloutBatch) -> RewardScores:
        records = batch.records
        device = batch.response_ids.device
        arguments = {"data_sources": [record.data_source for record in records],
                     "solution_strs": decode_responses(batch, self.tokenizer),
                     "ground_truths": [record.ground_truth for record in records],
                     "extra_infos": [record.extra_info for record in records], **self.keywords}
        try:
            results = call_with_time_limit(
                self.function, (), arguments, limit_s=self.timeout_s, stopping=self.stopping,
                what=lambda: f"{KEYS.custom_reward_function} {self.name!r} ({self.path}) scoring a batch of "
                             f"{len(records)} responses (data_source {records[0].data_source!r})")
        except (RewardTimeoutError, RewardThreadsExhausted, StepInterrupted):  # not the function's own
            raise
        except Exception as error:  # the user's code: anything it raises is theirs to fix
            failure = RewardFunctionError.from_exception(error, self.path, self.name, "",
                                                         scoring=f"a batch of {len(records)} responses")
            if self.on_error != "zero":
                raise failure from error
            self.errors += len(records)
            if self.errors == len(records):
                self.warn(f"{failure.what}: scored 0 ({KEYS.custom_reward_function.on_error}: zero); the "
                          "reward/errors metric counts such responses")
            return RewardScores(torch.zeros(len(records), dtype=torch.float32, device=device),
                                [{} for _ in records])
        scored = [split_score(result) for result in self._results(results, len(records))]
        return RewardScores(torch.tensor([score for score, _ in scored], dtype=torch.float32, device=device),
                            [extra for _, extra in scored])

    def _results(self, results: Any, count: int) -> Sequence[Any]:
        if isinstance(results, str | bytes | dict) or not hasattr(results, "__len__") or len(results) != count:
            got = f"{len(results)} results" if hasattr(results, "__len__") and not isinstance(results, str | dict) \
                else type(results).__name__
            raise CustomRewardError(f"{KEYS.custom_reward_function} {self.name!r} ({KEYS.reward_model.reward_manager}"
                                    f": batch) returned {got} for a batch of {count} responses; return one score "
                                    "(or dict with a 'score' key) per response, in order")
        return list(results)


def build_rule_reward(config: RunConfig, tokenizer: PreTrainedTokenizerBase, *, warn: Warn = print
                      ) -> RewardFunction:
    """The run's rule-based reward: the manager reward_model.reward_manager names, with the run's function."""
    return REWARD_MANAGERS[config.reward_model.reward_manager](config, tokenizer, warn)


def _scorer(config: RunConfig, *, limited: bool = True) -> ScoreFunction:
    """The run's function (custom_reward_function, with its reward_kwargs, each call within
    reward_model.reward_timeout_s unless not `limited`), or the built-in scorers."""
    function = config.custom_reward_function
    sandbox = config.reward_model.sandbox_fusion
    if function.path is None and sandbox.url is not None:  # verl's default_compute_score with its sandbox
        client = SandboxFusion(sandbox.url, max_concurrent=sandbox.max_concurrent,
                               memory_limit_mb=sandbox.memory_limit_mb)
        client.check_reachable()
        return SandboxScore(client)
    return resolve_compute_score(function.path, function.name, function.reward_kwargs,
                                 config.reward_model.reward_timeout_s if limited else None)


def _naive(config: RunConfig, tokenizer: PreTrainedTokenizerBase, warn: Warn) -> RewardFunction:
    return RuleReward(tokenizer, _scorer(config), on_error=config.custom_reward_function.on_error, warn=warn)


def _dapo(config: RunConfig, tokenizer: PreTrainedTokenizerBase, warn: Warn) -> RewardFunction:
    keywords = config.reward_model.reward_kwargs
    return DapoReward(tokenizer, _scorer(config), max_response_length=keywords.max_resp_len,
                      buffer=keywords.overlong_buffer_cfg, on_error=config.custom_reward_function.on_error, warn=warn)


def _prime(config: RunConfig, tokenizer: PreTrainedTokenizerBase, warn: Warn) -> RewardFunction:
    # prime's own deadline bounds each response (verl's: PRIME_TIMEOUT_S, a late one scores 0 and the run goes on),
    # not reward_model.reward_timeout_s, which would end the run or, inside a worker, leave threads stuck there.
    return PrimeReward(tokenizer, _scorer(config, limited=False), warn=warn)


def _remote(config: RunConfig, tokenizer: PreTrainedTokenizerBase, warn: Warn) -> RewardFunction:
    return RemoteReward(tokenizer, _scorer(config), on_error=config.custom_reward_function.on_error, warn=warn)


def _batch(config: RunConfig, tokenizer: PreTrainedTokenizerBase, warn: Warn) -> RewardFunction:
    function = config.custom_reward_function
    assert function.path is not None  # the config's rules require it for the batch manager
    # verl calls the function with custom_reward_function's reward_kwargs and then all the manager's
    keywords = {**function.reward_kwargs, **config.reward_model.reward_kwargs.given()}
    return BatchReward(tokenizer, load_custom_score(function.path, function.name), keywords, path=function.path,
                       name=function.name, on_error=function.on_error, warn=warn,
                       timeout_s=config.reward_model.reward_timeout_s)


REWARD_MANAGERS: dict[str, Callable[[RunConfig, PreTrainedTokenizerBase, Warn], RewardFunction]] = {
    "naive": _naive, "dapo": _dapo, "prime": _prime, "batch": _batch, "remote": _remote,
}
"""verl's reward managers by the names reward_model.reward_manager takes."""
