"""Code rewards run in a SandboxFusion service (https://github.com/bytedance/SandboxFusion), as verl's
default_compute_score runs them when reward_model.sandbox_fusion.url is set (verl/utils/reward_score/sandbox_fusion):
the response's code block runs once per test case (the case's input on stdin), each run one POST of verl's JSON
payload to the URL, and the score is the share of the first ten cases whose output matches.

The HTTP API (SandboxFusion's /run_code): the request {"code", "stdin", "language", "compile_timeout",
"run_timeout", "memory_limit_MB", "files", "fetch_files"}; the answer {"status": "Success" | "Failed" |
"SandboxError", "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "stdout", "stderr",
"return_code"}, "compile_result": ...}. httpx is the client (STYLE.md: a well-kept library).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from trainer.config import KEYS
from trainer.errors import RunSetupError, UserError
from trainer.rewards.scorers import default_compute_score

CODE_DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")
"""The data sources verl's default_compute_score scores in the sandbox."""
CASE_TIMEOUT_S = 10
"""verl's compile and run timeout of one test case (sandbox_fusion.compute_score's timeout)."""
API_TIMEOUT_S = 10
"""verl's margin of the HTTP request over the case's timeouts."""
CASES_SCORED = 10
"""verl's continuous score: the share of the first ten cases passed."""


class SandboxError(UserError):
    """The sandbox cannot be reached or answers with an HTTP error; one line naming the URL's key."""


class SandboxFusion:
    """A client of one SandboxFusion URL: at most `max_concurrent` requests in flight (verl's semaphore), each
    with a memory limit. Pickled without its semaphore (a process of the prime manager makes its own)."""

    def __init__(self, url: str, *, max_concurrent: int = 64, memory_limit_mb: int = 1024,
                 case_timeout_s: float = CASE_TIMEOUT_S):
        self.url, self.max_concurrent, self.memory_limit_mb = url, max_concurrent, memory_limit_mb
        self.case_timeout_s = case_timeout_s
        self._slots = threading.BoundedSemaphore(max_concurrent)

    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "_slots"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._slots = threading.BoundedSemaphore(self.max_concurrent)

    def run(self, code: str, stdin: str | None = None, language: str = "python") -> dict[str, Any]:
        """The sandbox's answer to running `code` with `stdin`."""
        payload = {"compile_timeout": self.case_timeout_s, "run_timeout": self.case_timeout_s, "code": code,
                   "stdin": stdin, "memory_limit_MB": self.memory_limit_mb, "language": language, "files": {},
                   "fetch_files": []}
        with self._slots:
            try:
                response = httpx.post(self.url, json=payload, timeout=2 * self.case_timeout_s + API_TIMEOUT_S)
                response.raise_for_status()
                answer: dict[str, Any] = response.json()
            except (httpx.HTTPError, ValueError) as error:
                detail = " ".join(str(error).split())[:200]
                raise SandboxError(f"{KEYS.reward_model.sandbox_fusion.url}: the sandbox at {self.url!r} did not "
                                   f"run the code ({type(error).__name__}: {detail})") from None
        return answer

    def check_reachable(self) -> None:
        """One run of a trivial program, at start: an unreachable URL is one line before any step."""
        try:
            self.run("print(1)")
        except SandboxError as error:
            raise RunSetupError(f"{error}; allowed: the URL of a running SandboxFusion service's /run_code") from None

    def passes(self, code: str, stdin: str | None, expected: Any) -> bool:
        """Whether `code` run on `stdin` prints `expected` (trailing newlines aside), as verl judges a case."""
        answer = self.run(code, stdin)
        run = answer.get("run_result") or {}
        if answer.get("status") != "Success" or run.get("status") != "Finished":
            return False
        return expected is None or str(run.get("stdout") or "").rstrip("\n") == str(expected).rstrip("\n")

    def score(self, solution_str: str, ground_truth: Any) -> float:
        """verl's continuous code score: the share of the first ten test cases of `ground_truth` ({"inputs",
        "outputs"} or {"assert_case"}, a dict or its JSON) that the response's code block passes; 0 without a code
        block or with cases it cannot read."""
        code = code_block(solution_str)
        cases = _test_cases(ground_truth)
        if code is None or cases is None:
            return 0.0
        inputs, outputs, asserts = cases
        chosen = list(range(min(len(inputs), CASES_SCORED)))
        if not chosen:
            return 0.0
        with ThreadPoolExecutor(max_workers=min(len(chosen), self.max_concurrent)) as pool:
            passed = list(pool.map(lambda index: self.passes(code + "\n\n" + asserts[index],
                                                             None if inputs[index] is None else str(inputs[index]),
                                                             outputs[index]), chosen))
        return sum(passed) / len(chosen)


def code_block(completion: str) -> str | None:
    """The code of a response as verl reads it: the last ```python block, else the first ``` block (a language
    name on its first line dropped); None without one."""
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    parts = completion.split("```")
    if len(parts) < 2:
        return None
    code = parts[1]
    if "\n" in code:
        first, rest = code.split("\n", 1)
        if first.strip().isalpha():
            code = rest
    return code


def _test_cases(ground_truth: Any) -> tuple[list[Any], list[Any], list[str]] | None:
    """(inputs, outputs, assert code per case) of verl's test cases, or None where they cannot be read."""
    cases = ground_truth
    if isinstance(cases, str):
        try:
            cases = json.loads(cases)
        except json.JSONDecodeError:
            return None
    if not isinstance(cases, dict):
        return None
    if isinstance(cases.get("assert_case"), list):
        asserts = [str(case) for case in cases["assert_case"]]
        return (cases.get("inputs", [""] * len(asserts)), cases.get("outputs", [None] * len(asserts)), asserts)
    if "inputs" not in cases or "outputs" not in cases or len(cases["inputs"]) != len(cases["outputs"]):
        return None
    return list(cases["inputs"]), list(cases["outputs"]), [""] * len(cases["inputs"])


class SandboxScore:
    """verl's default_compute_score with a sandbox: the code data sources scored in it, the others by the built-in
    scorers."""

    def __init__(self, sandbox: SandboxFusion):
        self.sandbox = sandbox

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any,
                 extra_info: dict[str, Any] | None = None) -> float:
        if data_source in CODE_DATA_SOURCES:
            return self.sandbox.score(solution_str, ground_truth)
        return default_compute_score(data_source, solution_str, ground_truth, extra_info)
