"""The `live_run` fixture: a real `verl train` on loopback for the dashboards and live-page tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.runs import LiveRun, verl_train


@pytest.fixture
def live_run(tmp_path: Path) -> Iterator[LiveRun]:
    """The quickstart on the CPU (small batches, GPU samples every 0.2 s, 2000 steps), stopped at the end."""
    with verl_train(tmp_path, "trainer.total_training_steps=2000") as run:
        yield run
