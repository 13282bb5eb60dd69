"""The daemon run in a process that goes on (a test, a caller's own event loop) gives SIGTERM and SIGINT back as it
found them: while it stops on a signal it ignores late repeats of it, and left so, every process started later
(prime's reward workers) inherited an ignored SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from tests.daemon.test_service import eventually, make_daemon


def _callers_handler(signum: int, frame: object) -> None:
    raise AssertionError("the caller's handler ran: the daemon's own was not in place")


@pytest.fixture
def callers_handlers():
    """SIGTERM and SIGINT as a caller of the daemon set them, put back after the test whatever it did."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, _callers_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("restore", [True, False])
def test_a_daemon_stopped_by_sigterm_gives_the_signals_back_as_it_found_them(tmp_path: Path, monkeypatch,
                                                                             callers_handlers, restore: bool) -> None:
    daemon = make_daemon(tmp_path, monkeypatch, total_steps="100000", step_s="0.05")
    daemon._restore_signals = restore  # the `verl` process's daemon (run_daemon) keeps them ignored: it ends next

    async def scenario() -> int:
        run = asyncio.create_task(daemon.run())
        await eventually(lambda: daemon.progress.step >= 2, what="two steps")
        os.kill(os.getpid(), signal.SIGTERM)
        return await asyncio.wait_for(run, 30)

    assert asyncio.run(scenario()) == 0
    if restore:
        assert signal.getsignal(signal.SIGTERM) is _callers_handler
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    else:
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN == signal.getsignal(signal.SIGINT)
