"""The error of the rank that failed first, in the run's log (logs/trainer.log), where the user and the daemon look.

Rank 0 writes the run's log; another rank its own (logs/trainer-rank<N>.log). When rank 1 fails alone (its reward
function raises, its step crashes), rank 0 then fails too, of what rank 1's exit did to it (gloo's "Connection
closed by peer" in its next collective), and its traceback was the last one in trainer.log: the daemon's "exited
with code N" line, /v1/status and the monitor gave rank 0's view as the cause. The launcher knows which rank failed
first (launch.first_failed_rank), so once the group has ended it appends that rank's last ERROR record (its line
and traceback, as the rank wrote it into its own log) to trainer.log, after one line naming the rank. The last
traceback in trainer.log is then the failed rank's, and the daemon reads its cause from it as from a single rank's
(daemon/failures.py). With several nodes, this is what this node's launcher saw first.

No torch here: the launcher calls it after its ranks ended, and the tests run it alone.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Mapping
from pathlib import Path

RUN_LOG = "trainer.log"
"""Rank 0's log, the run's."""
_RECORD = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:,\d+)? (?P<level>[A-Z]+) ")
"""The start of one record of a trainer's log (trainer/reporting.py's format: time, level, message)."""


def rank_log(logs: Path, rank: int) -> Path:
    """The log a rank writes (trainer/main.py): the run's for rank 0, its own for another."""
    return logs / (RUN_LOG if rank == 0 else f"trainer-rank{rank}.log")


def log_sizes(logs: Path) -> dict[Path, int]:
    """The size of every trainer log under `logs` now: what a later failure's search starts after."""
    sizes = {}
    for path in logs.glob("trainer*.log"):
        with contextlib.suppress(OSError):
            sizes[path] = path.stat().st_size
    return sizes


def last_error_record(text: str) -> str | None:
    """The last ERROR record of a trainer's log text: its line and what follows it up to the next record (a
    traceback), or None when the text has none."""
    lines = text.splitlines()
    starts = [index for index, line in enumerate(lines) if _RECORD.match(line)]
    for position in range(len(starts) - 1, -1, -1):
        match = _RECORD.match(lines[starts[position]])
        assert match is not None
        if match.group("level") in ("ERROR", "CRITICAL"):
            end = starts[position + 1] if position + 1 < len(starts) else len(lines)
            return "\n".join(lines[starts[position]:end]).rstrip()
    return None


def report_failed_rank(logs: Path, rank: int, how: str, since: Mapping[Path, int], *, user_error: bool = False
                       ) -> None:
    """Append to the run's log one line naming `rank`, which failed first (`how`: "exit code 2"), and its last ERROR
    record written since `since` (log_sizes before the ranks started). Nothing for rank 0: its record is the run's
    log's already, and a line after it would hide its traceback from the daemon. Nothing either for a `user_error`
    (exit code 2) the rank logged nothing of: every rank found the same problem in the config, and rank 0's ERROR
    lines in the terminal say it. Best effort: a log that cannot be read or written changes nothing else."""
    if rank == 0:
        return
    path = rank_log(logs, rank)
    record = None
    with contextlib.suppress(OSError), path.open("rb") as file:
        file.seek(since.get(path, 0))
        record = last_error_record(file.read().decode("utf-8", errors="replace"))
    if record is None and user_error:
        return
    said = f"its log ({path}) says:\n{record}" if record is not None else f"nothing in its log ({path}) says why"
    with contextlib.suppress(OSError), (logs / RUN_LOG).open("a", encoding="utf-8") as file:
        file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} ERROR rank {rank} failed first ({how}), and the group "
                   f"ended with it; {said}\n")
