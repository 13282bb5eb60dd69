"""Why a trainer failed, read from what it left behind: the final line of its last traceback (or its last ERROR
line) in its output (logs/trainer.out), or where its main thread was when it hung (the stacks it wrote into
logs/trainer.log). The daemon puts the cause in its "exited with code N" line, in /v1/status (and so the monitor),
and compares one failure with the next: a restart that fails at the same step with the same cause cannot help.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

TAIL_BYTES = 256 * 1024
"""How much of the end of a trainer's output is searched for its cause."""
_TRACEBACK = "Traceback (most recent call last):"
_ERROR = re.compile(r"^(?:ERROR:|.*\bERROR\b)\s*(?P<message>.+)$")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')


@dataclass(frozen=True)
class Failure:
    """One trainer failure: the last step the run completed before it, and its cause (None: unknown, such as a
    death by a signal, which is never taken for a repeat)."""
    step: int | None
    cause: str | None
    shown: str | None = None
    """What /v1/status shows when there is no cause to compare (a death by a signal, a hang without stacks)."""

    def __post_init__(self) -> None:
        if self.shown is None:
            object.__setattr__(self, "shown", self.cause)

    def repeats(self, previous: Failure | None) -> bool:
        """Whether this failure is `previous` again: the same step and the same known cause."""
        return previous is not None and self.cause is not None and (self.step, self.cause) == (previous.step,
                                                                                              previous.cause)


def read_tail(path: Path | None, since: int = 0) -> str:
    """The text of `path` from byte `since` (what the current trainer wrote), at most its last TAIL_BYTES."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as file:
            size = file.seek(0, 2)
            file.seek(max(since, size - TAIL_BYTES))
            return file.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def last_error_line(text: str) -> str | None:
    """The cause a trainer's output gives last: the final line of its last traceback ("RuntimeError: probability
    tensor contains either inf, nan or element < 0"), or its last ERROR line, whichever comes later."""
    lines = text.splitlines()
    found: tuple[int, str] | None = None
    for index, line in enumerate(lines):
        if line.startswith(_TRACEBACK):
            # The exception's line: the first unindented line after the frames.
            for later in range(index + 1, len(lines)):
                if lines[later] and not lines[later].startswith((" ", "\t")):
                    found = (later, lines[later].strip())
                    break
    for index in range(len(lines) - 1, -1, -1):
        match = _ERROR.match(lines[index].strip())
        if match and not lines[index].startswith((" ", "\t")):
            if found is None or index > found[0]:
                found = (index, match.group("message").strip())
            break
    return found[1][:500] if found else None


def hang_place(text: str) -> str | None:
    """Where a hung trainer was stuck, from the stacks faulthandler wrote (`text`: the log from the daemon's hang
    marker on): the innermost frame of the current (main) thread ("reward.py:12 in compute_score"), unless it only
    waits (in the standard library, or for a user's function on a thread of the reward time limit's pool:
    reward_model.reward_timeout_s), then the first other thread's innermost frame that does not only wait. None
    when no stacks were written (a stopped process cannot write them)."""
    innermost: list[tuple[bool, str]] = []  # (is the current thread, its innermost frame), in the dump's order
    current = False
    for line in text.splitlines():
        if line.startswith(("Current thread", "Thread 0x")):
            current = line.startswith("Current thread")
            innermost.append((current, ""))
            continue
        match = _FRAME.match(line)
        if match and innermost and not innermost[-1][1]:
            innermost[-1] = (current, f"{match.group('file')}:{match.group('line')} in {match.group('function')}")
    frames = [frame for is_current, frame in sorted(innermost, key=lambda item: not item[0]) if frame]
    if not frames:
        return None
    return next((frame for frame in frames if not _only_waits(frame)), frames[0])


_REWARD_TIME_LIMIT_WAITS = ("trainer/rewards/time_limit.py:", (" in call_with_time_limit", " in _work"))
"""The reward time limit's own waits (trainer/rewards/time_limit.py): the caller waiting for a call, an idle worker
of its pool waiting for the next one; a file name, not an import (the daemon imports no trainer code)."""


def _only_waits(frame: str) -> bool:
    """Whether a thread whose innermost frame is `frame` only waits: in the standard library, or in the reward
    time limit's waits (whose waiting is a C call, with no frame of its own)."""
    path = frame.rsplit(":", 1)[0]
    if "/lib/python3" in path and "-packages/" not in path:
        return True
    file, functions = _REWARD_TIME_LIMIT_WAITS
    return file in frame and frame.endswith(functions)
