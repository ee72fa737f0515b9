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
def test_no_traceback_when_the_reader_of_the_output_goes_away(cli_process, tmp_path, args):
    assert cli_process("compile", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8", "-o", "plan.json").returncode == 0
    code, err = closed_pipe(*args, cwd=tmp_path)
    # argparse drops a failed write (0); rich stops with 1 when its write fails; pipec's own with 128 + SIGPIPE
    assert code == (0 if "--help" in args else 141 if "--text" in args else 1), err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


def test_pipec_show_gives_every_keys_resolved_value(cli, tmp_path):
    from pipec.dsl.keys import KEYS
    from pipec.views.keys import KEY_ORDER

    assert sorted(k for group in KEY_ORDER for k in group) == sorted(KEYS)  # every key, once
    assert cli("compile", "--model", "pipec.examples.gpt:build", "--model-arg", "layers=4, dim=16, heads=2, vocab=64, "
               "seq=16", "--input", "tokens: int64[4, 16]", "--costs", "unit", "--schedule", "interleaved_1f1b",
               "--ranks", "2", "--dp", "2", "--shard", "full", "--microbatches", "4", "-o", "p.json").returncode == 0
    out = cli("show", "p.json")
    assert out.returncode == 0, out.stderr
    assert max(len(line) for line in out.stdout.splitlines()) <= 80  # the timeline, tables, keys: a terminal's width
    keys = out.stdout.split("keys, as resolved:\n", 1)[1].splitlines()
    words = {part.split(" ", 1)[0] for line in keys for part in line.strip().split("  ")}
    assert set(KEYS) <= words, set(KEYS) - words
    text = "\n".join(keys)
    for shown in ("virtual 2", "stages 4", "placement loop", "init module", "trace auto (traced with fx)",
                  "shard full", "links pp(latency=10us, bandwidth=25GB/s)", "input tokens: int64[4, 16]"):
        assert shown in text, (shown, text)
