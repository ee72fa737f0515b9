"""Shared test helpers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Hashable, Iterable

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


@pytest.fixture(scope="session", autouse=True)
def _profile_cache(tmp_path_factory):
    """The whole run's profile cache (costs profile's timings, the links probed) is a temporary folder, never the
    user's: ``XDG_CACHE_HOME`` for this process and every one it starts. Tests of the cache itself set their own."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


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


def on_threads(rank: Callable, keys: Iterable[Hashable]) -> dict:
    """``rank(*key)`` for every key at once, one thread each (ranks over the fake transport); the results
    by key. A rank's exception is raised here."""
    keys = list(keys)
    with ThreadPoolExecutor(len(keys)) as pool:
        return dict(zip(keys, pool.map(lambda k: rank(*k), keys)))


def run_in_session(cmd: list[str], timeout: float, cwd: str | os.PathLike | None = None,
                   env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` (a launcher and its ranks) in its own session (in ``cwd``, tests/ by default, with ``env`` over
    this environment); on timeout kill the whole session, so no rank outlives the test, and fail with the end of
    its stderr."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=cwd or REPO / "tests", env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:4])} ... did not finish in {timeout} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture
def cli(tmp_path):
    def _run(*args: str, timeout: float = 120, env: dict | None = None):
        return run_cli(*args, cwd=tmp_path, timeout=timeout, env=env)

    return _run
