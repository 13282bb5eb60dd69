"""Fixtures for the API tests: a real uvicorn server on 127.0.0.1 (a free port) in a background thread."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest
from fastapi import FastAPI

from tests.support import serve_app


@pytest.fixture(scope="session")
def serve() -> Callable[[FastAPI], AbstractContextManager[str]]:
    """`with serve(app) as url:` runs the app on a real server for the block."""
    return serve_app
