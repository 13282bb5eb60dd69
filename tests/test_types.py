"""The type checker's verdict on the code it is strict on (pyproject.toml [tool.mypy]: the offload engine and
the torch-free config and wire schema). `make lint` runs the same check."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mypy_is_clean_on_the_strictly_typed_packages():
    completed = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
    assert "Success: no issues found" in completed.stdout
