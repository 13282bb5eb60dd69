"""Shared test setup: tests marked `gpu` skip cleanly on machines without CUDA."""

from __future__ import annotations

import signal

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    # The marker itself: a keyword match would also take a parameter whose id is "gpu" (optimizer_update=gpu).
    gpu_tests = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_tests or _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible to torch)")
    for item in gpu_tests:
        item.add_marker(skip)


def pytest_itemcollected(item):
    # Every end-to-end test runs `verl train` (a daemon and its trainer) for real: slow by what it is.
    if "e2e" in item.path.parts:
        item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _stop_signals_restored():
    """`run_daemon` (the `verl` command's daemon) keeps SIGTERM and SIGINT ignored once its stop begins, until the
    process ends: a test that calls it in this process leaves them so. Left so, the worker's later tests spawn
    processes that inherit them ignored (a `verl monitor` in a terminal then never saw its Ctrl-C)."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        if signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)
