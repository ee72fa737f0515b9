"""Shared test helpers: the ``--slow`` option, the launches' queue, and plans compiled once per run.

- ``--slow``: the tests marked ``slow`` (the long tail: soaks, tune's whole space, every Hugging Face
  family, the full schedule x layout matrices under torchrun) run only with it, and only they do:
  ``./dev test`` and ``./dev test --slow`` split the suite, and CI (``.ci/run``) runs both. A test named
  on the command line (``FILE::NAME``) runs either way.
- :data:`LAUNCHES` (tests/launches.py): the tests' processes, queued and run in the background while the
  in-process tests run (the tests that wait for them run last): runs under torchrun batched over the
  whole test run (tests/runtime_worker.py, one launch per world size and round) for the tests that need
  only each run's outcome, and whole commands for those that must see a process end.
- :func:`compiled`: a plan compiled once per run, however many tests and launches use it.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Iterator

import pytest

from launches import LAUNCHES, Launches, call_job, run_job  # noqa: F401 - the tests import them from here

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


# ----------------------------------------------------------------------------- exit


_STATUS: dict[str, int] = {}


def pytest_sessionfinish(session, exitstatus) -> None:
    _STATUS["exit"] = int(exitstatus)


@atexit.register  # registered at import, before torch is imported: runs after torch's own atexit handlers
def _exit_without_teardown() -> None:
    """Leave with pytest's exit status once the Python-level exit handlers ran: the interpreter's C-level teardown
    of torch and transformers (freeing what the tests built, no Python frame) takes 5 s or more and checks nothing."""
    if "exit" in _STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_STATUS["exit"])


@pytest.fixture(scope="session", autouse=True)
def _profile_cache(tmp_path_factory):
    """The whole run's profile cache (costs profile's timings, the links probed) is a temporary folder, never the
    user's: ``XDG_CACHE_HOME`` for this process and every one it starts. Tests of the cache itself set their own."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    # the host's load here is the suite's own: a profile keeps and marks it but neither waits for the cores nor
    # times a marked entry again (costs/load.py; tests/test_profile_cache.py tests both with a simulated load)
    os.environ["PIPEC_PROFILE_LOAD"] = "record"
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


# ----------------------------------------------------------------------------- --slow


def pytest_addoption(parser) -> None:
    parser.addoption("--slow", action="store_true", default=False,
                     help="run only the tests marked slow (the long tail, which a plain run leaves out)")


def pytest_collection_modifyitems(config, items) -> None:
    slow = config.getoption("--slow")
    named = [arg for arg in config.args if "::" in arg]

    def chosen(item) -> bool:
        if (item.get_closest_marker("slow") is not None) == slow:
            return True
        return any(item.nodeid == arg or item.nodeid.startswith(arg + "[") or item.nodeid.endswith("/" + arg)
                   for arg in named)

    keep = [item for item in items if chosen(item)]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if not chosen(item)])
    # the tests that time the host run first, before the launches' queue starts; those that wait for the queue
    # run last, so that it runs while the others do
    timed = [item for item in keep if item.get_closest_marker("timed") is not None]
    waits = [item for item in keep if set(getattr(item, "fixturenames", ())) & set(LAUNCHES.needs)]
    items[:] = timed + [item for item in keep if item not in waits and item not in timed] + waits
    LAUNCHES.needed = {name for item in items for name in getattr(item, "fixturenames", ())}


# ----------------------------------------------------------------------------- processes


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


def run_cli_here(*args: str, cwd: str | os.PathLike, env: dict | None = None) -> subprocess.CompletedProcess:
    """``pipec ARGS`` in this process (the folder and ``env`` changed for the call only): its exit code and
    what it wrote, as :func:`run_cli` returns them, without a fresh interpreter's torch import. A traceback
    is an exception here, so the test fails on it as on a process's."""
    from pipec.cli import main

    out, err = io.StringIO(), io.StringIO()
    here, saved = os.getcwd(), dict(os.environ)
    os.chdir(cwd)
    os.environ.update(env or {})
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["pipec", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture
def cli(tmp_path):
    """``pipec ARGS`` run in this process from the test's folder (:func:`run_cli_here`)."""
    def _run(*args: str, env: dict | None = None):
        return run_cli_here(*args, cwd=tmp_path, env=env)

    return _run


@pytest.fixture
def cli_process(tmp_path):
    """``python -m pipec ARGS`` in a fresh process from the test's folder: for what only a process shows (its
    exit at the interpreter's end, warnings filters, torchrun)."""
    def _run(*args: str, timeout: float = 120, env: dict | None = None):
        return run_cli(*args, cwd=tmp_path, timeout=timeout, env=env)

    return _run


# ----------------------------------------------------------------------------- launches


@pytest.fixture(scope="session", autouse=True)
def launches(tmp_path_factory) -> Iterator[Launches]:
    """The queue of the tests' processes (tests/launches.py), its files under this run's temporary folder."""
    LAUNCHES.root = tmp_path_factory.mktemp("launches")
    yield LAUNCHES
    LAUNCHES.stop_all()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    # between tests, before this one's fixtures: collect what ended, start what is next; a test that times the
    # host runs beside none of the queue's processes
    if item.get_closest_marker("timed") is not None:
        LAUNCHES.hold()
    else:
        LAUNCHES.poll()


# ----------------------------------------------------------------------------- compiled once


_PLANS: dict[str, Any] = {}


def compiled(overrides: dict[str, Any]):
    """The plan of ``compile_spec(load_spec(None, overrides))``, compiled once per distinct ``overrides`` in the
    whole run (plans are immutable: every caller gets the same one)."""
    key = json.dumps(overrides, sort_keys=True)
    if key not in _PLANS:
        from pipec.compiler.driver import compile_spec
        from pipec.dsl import load_spec

        _PLANS[key] = compile_spec(load_spec(None, overrides)).plan
    return _PLANS[key]


def assert_located(text: str, where: str, message: str) -> None:
    """Compiling schedule-file ``text`` (as ``a.pipe``) is refused at ``where`` (``a.pipe:LINE:COL``) with
    ``message``."""
    from pipec.compiler.driver import compile_spec
    from pipec.dsl import DSLError, parse_spec

    with pytest.raises(DSLError) as err:
        compile_spec(parse_spec(text, filename="a.pipe"))
    assert str(err.value).startswith(f"{where}: error: {message}")


def located_refusals(*cases: tuple[str, str, str]) -> Callable:
    """A test, one case per ``(text, where, message)`` in ``cases``, that compiling ``text`` is refused at
    ``where`` with ``message`` (``assert_located``). A module binds it to a ``test_*`` name."""

    @pytest.mark.parametrize(("text", "where", "message"), cases)
    def test(text: str, where: str, message: str) -> None:
        assert_located(text, where, message)

    return test


def small_gpt_pipe(*, batch: int = 4, dp: int = 1, extra: str = "") -> str:
    """A schedule file for the 4-layer toy GPT (dim 32, sequences of 8) on pp 2 and ``dp`` under 1f1b with 2
    microbatches of a ``batch``-sequence step, costs by flops at 1 TFLOP/s; ``extra`` lines after."""
    return f'''model "pipec.examples.gpt:build" (layers=4, dim=32, heads=2, vocab=64, seq=8)
input tokens: int64[{batch}, 8]
schedule 1f1b
pp 2  dp {dp}  microbatches 2
costs flops  peak_flops 1TFLOP/s
{extra}'''


def spec_file(tmp_path_factory, text: str, name: str = "model.pipe") -> str:
    """``text`` written as a schedule file in a folder of its own; its path."""
    path = tmp_path_factory.mktemp("spec") / name
    path.write_text(text)
    return str(path)
