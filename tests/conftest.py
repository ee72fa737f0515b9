"""Shared test helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def run_cli(*args: str, cwd: str | os.PathLike | None = None, timeout: float = 120, env: dict | None = None):
    """Run ``python -m pipec ARGS`` in a fresh process (cwd outside the repo by default)."""
    return subprocess.run(
        [PYTHON, "-m", "pipec", *args],
        cwd=cwd or REPO / "tests",
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def cli(tmp_path):
    def _run(*args: str, timeout: float = 120, env: dict | None = None):
        return run_cli(*args, cwd=tmp_path, timeout=timeout, env=env)

    return _run
