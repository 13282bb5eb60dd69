"""metrics.jsonl on a disk that fills up: lines appended whole, partial lines dropped at resume."""

from __future__ import annotations

import errno
import json
import os

import pytest

import trainer.metrics
from trainer.metrics import MetricsLog


def full_disk_after(monkeypatch, fitting: int) -> None:
    """os.write as on a device with `fitting` bytes left: it writes what fits, then fails with ENOSPC."""
    real = os.write
    left = [fitting]

    def write(descriptor: int, data: bytes) -> int:
        if left[0] == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = real(descriptor, bytes(data[:left[0]]))
        left[0] -= written
        return written

    monkeypatch.setattr(trainer.metrics.os, "write", write)


def test_a_line_the_disk_cannot_take_leaves_no_partial_line_and_is_written_later(tmp_path, monkeypatch):
    warnings: list[str] = []
    log = MetricsLog(tmp_path / "metrics.jsonl", warn=warnings.append)
    log.append(1, {"critic/score/mean": 0.5})
    full_disk_after(monkeypatch, fitting=10)
    log.append(2, {"critic/score/mean": 0.25})  # raised JSONDecodeError at every later resume
    assert (tmp_path / "metrics.jsonl").read_text().endswith("}\n"), "no half-written line"
    assert log.failures == 1
    assert len(warnings) == 1 and "could not write step 2" in warnings[0] and "No space left" in warnings[0]
    monkeypatch.undo()  # space again
    log.append(3, {"critic/score/mean": 0.125})
    assert [row["step"] for row in log.read()] == [1, 2, 3]
    assert len(warnings) == 1


@pytest.mark.parametrize("tail", [b'{"step": 3, "critic/score/me', b'{"step": 3, "critic/score/mean": 0.1}',
                                  b'{"step": 3, "x": "\xc3'])
def test_a_partial_last_line_is_dropped_at_resume_with_a_warning(tmp_path, tail):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n' + tail)
    warnings: list[str] = []
    log = MetricsLog(path, warn=warnings.append)
    log.truncate_after(2)
    assert path.read_bytes() == b'{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n'
    assert len(warnings) == 1 and "dropped 1 partial or garbled line(s)" in warnings[0]
    log.append(3, {"a": 3.0})
    assert [row["step"] for row in log.read()] == [1, 2, 3]


def test_resume_cuts_the_file_short_without_needing_free_space(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, warn=lambda message: None)
    for step in (1, 2, 3):
        log.append(step, {"a": float(step)})

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    full_disk_after(monkeypatch, fitting=0)
    for write in ("write_bytes", "write_text"):  # a rewrite of the file would need room for its copy
        monkeypatch.setattr(trainer.metrics.Path, write, no_space)
    log.truncate_after(1)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]
