"""What pipec prints, as a user sees it: no traceback when the reader goes away, tables that fit a terminal,
notes only where they help. Run as real processes (``python -m pipec``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO


def closed_pipe(*args: str, cwd) -> tuple[int, str]:
    """Run ``pipec ARGS`` with its stdout a pipe whose reader has already gone (``pipec ... | head -0``)."""
    read, write = os.pipe()
    os.close(read)  # no reader: the first write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "pipec", *args], stdout=write, stderr=subprocess.PIPE,
                              cwd=cwd, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        os.close(write)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("args", [("compile", "--help"), ("show", "plan.json"), ("show", "plan.json", "--text")])
def test_no_traceback_when_the_reader_of_the_output_goes_away(cli, tmp_path, args):
    assert cli("compile", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8", "-o", "plan.json").returncode == 0
    code, err = closed_pipe(*args, cwd=tmp_path)
    # argparse drops a failed write (0); rich stops with 1 when its write fails; pipec's own with 128 + SIGPIPE
    assert code == (0 if "--help" in args else 141 if "--text" in args else 1), err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err
