"""Runs that several of this folder's tests compare against, made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.distributed.test_ranks import PPO, launch


@pytest.fixture(scope="session")
def ppo_one_rank(tmp_path_factory) -> Path:
    """PPO on one rank: the run folder `one` (checkpoints of steps 1 and 2), which the 2-rank runs of
    test_ranks.py (data parallel) and test_sequence_parallel_trainer.py (Ulysses) must train as."""
    root = tmp_path_factory.mktemp("ppo")
    finished = launch(1, root, "one", *PPO)
    assert finished.returncode == 0, finished.stderr[-4000:]
    return root / "one"
