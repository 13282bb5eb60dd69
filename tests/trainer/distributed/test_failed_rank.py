"""The launcher's report of the rank that failed first (trainer/distributed/failed_rank.py), on log files as the
trainer writes them: the daemon then reads that rank's cause from trainer.log, not rank 0's view of it."""

from __future__ import annotations

from pathlib import Path

from daemon.failures import last_error_line
from trainer.distributed.failed_rank import last_error_record, log_sizes, report_failed_rank

EARLIER_ATTEMPT = """2026-12-07 10:00:00,100 ERROR the trainer crashed: RuntimeError: an earlier attempt's
Traceback (most recent call last):
  File "/x/trainer/loop.py", line 170, in fit
RuntimeError: an earlier attempt's
"""

RANK_1 = """2026-12-07 10:01:00,100 INFO run directory /runs/a; device cpu; rank 1 of 2; 2 steps
2026-12-07 10:01:02,480 ERROR custom_reward_function 'compute_score' at /u/reward.py:5 raised ValueError
Traceback (most recent call last):
  File "/u/reward.py", line 5, in compute_score
    raise ValueError("rank 1's judge is down")
ValueError: rank 1's judge is down
"""

RANK_0 = """2026-12-07 10:01:00,050 INFO run directory /runs/a; device cpu; rank 0 of 2; 2 steps
2026-12-07 10:01:03,010 ERROR the trainer crashed: RuntimeError: [gloo] Connection closed by peer
Traceback (most recent call last):
  File "/x/trainer/distributed/ranks.py", line 218, in _reduce
    dist.all_reduce(tensor, op=op)
RuntimeError: [gloo] Connection closed by peer
"""


def test_the_run_log_ends_with_the_failed_ranks_record_so_its_cause_is_the_daemons(tmp_path: Path) -> None:
    rank_1_log = tmp_path / "trainer-rank1.log"
    rank_1_log.write_text(EARLIER_ATTEMPT)
    since = log_sizes(tmp_path)  # the launcher starts its ranks
    with rank_1_log.open("a") as file:
        file.write(RANK_1)
    (tmp_path / "trainer.log").write_text(RANK_0)
    assert last_error_line((tmp_path / "trainer.log").read_text()).startswith("RuntimeError: [gloo")  # as it was

    report_failed_rank(tmp_path, 1, "exit code 2", since=since)
    text = (tmp_path / "trainer.log").read_text()
    assert text.startswith(RANK_0)
    added = text[len(RANK_0):].splitlines()
    assert added[0].endswith(f" ERROR rank 1 failed first (exit code 2), and the group ended with it; its log "
                             f"({rank_1_log}) says:")
    assert "\n".join(added[1:]) + "\n" == RANK_1.split("\n", 1)[1]  # its ERROR record and traceback, not before
    assert last_error_line(text) == "ValueError: rank 1's judge is down"


def test_a_silent_rank_is_named_unless_it_was_a_config_problem_and_rank_0_adds_nothing(tmp_path: Path) -> None:
    (tmp_path / "trainer.log").write_text(RANK_0)
    (tmp_path / "trainer-rank1.log").write_text(EARLIER_ATTEMPT)
    since = log_sizes(tmp_path)
    report_failed_rank(tmp_path, 0, "exit code 1", since=since)
    assert (tmp_path / "trainer.log").read_text() == RANK_0  # rank 0's own traceback stays the last
    report_failed_rank(tmp_path, 1, "exit code 2", since=since, user_error=True)  # a config problem: rank 0 says it
    assert (tmp_path / "trainer.log").read_text() == RANK_0
    report_failed_rank(tmp_path, 1, "exit code 3", since=since)  # it died writing nothing (os._exit)
    assert last_error_line((tmp_path / "trainer.log").read_text()) == (
        f"rank 1 failed first (exit code 3), and the group ended with it; nothing in its log "
        f"({tmp_path / 'trainer-rank1.log'}) says why")


def test_the_last_error_record_runs_to_the_next_record() -> None:
    text = RANK_1 + "2026-12-07 10:01:02,900 INFO rank 1 stops\n"
    record = last_error_record(text)
    assert record is not None and record.startswith("2026-12-07 10:01:02,480 ERROR custom_reward_function")
    assert record.endswith("ValueError: rank 1's judge is down")
    assert last_error_record("2026-12-07 10:01:00,100 INFO step 1\n") is None
