"""A token file end to end: compiled, read by the runtime, and resumed mid-stream bit-identically.

In-process: ``data tokens(...)`` compiles against a generated file (a numpy
``tofile``), the path resolved from the schedule file's folder, recorded
absolute; the runtime's batches are windows of that file with their next
tokens; a missing file and a model without one int64 [B, T] input are
refused at the ``data`` key. Under torchrun (2 ranks, gloo, CPU): a 2N-step
run that checkpoints every N steps, and a run resumed from its step-N
checkpoint to 2N (in a later launch, tests/launches.py), end with
bit-identical parameters and optimizer state, and the resumed steps have the
uninterrupted run's losses: the stream continued.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipec.compiler.config import TokenData, TrainingConfig
from pipec.compiler.driver import compile_spec
from pipec.compiler.ir.plan_json import write_plan
from pipec.dsl import load_spec
from pipec.errors import PipecError
from pipec.runtime.checkpoint import list_checkpoints
from pipec.runtime.training import make_data
from conftest import LAUNCHES, run_job
from test_checkpoint import assert_ran, assert_same_state, full_state, losses, with_checkpoints

VOCAB, SEQ, BATCH = 32, 8, 8
N = 3
"""Steps before the stop; the runs take 2N."""

SCHEDULE = f'''
model "pipec.examples.gpt:build" (layers=4, dim=16, heads=2, vocab={VOCAB}, seq={SEQ})
input tokens: int64[{BATCH}, {SEQ}]
data tokens("corpus/train.bin", dtype=uint16)
pp 2  microbatches 4  costs unit
partition balanced(by=params)
'''


def write_tokens(path: Path) -> None:
    """A token file of 40 windows (byte-level ids mod the vocabulary)."""
    text = ("pipec reads a flat file of token ids, written back to back. " * 12).encode()
    ids = np.frombuffer(text, dtype=np.uint8)[: 40 * (SEQ + 1)] % VOCAB
    ids.astype(np.uint16).tofile(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A schedule file and, beside it, a token file."""
    root = tmp_path_factory.mktemp("tokens")
    (root / "corpus").mkdir()
    write_tokens(root / "corpus" / "train.bin")
    (root / "run.pipe").write_text(SCHEDULE)
    return root


def compiled(folder: Path, **flags):
    return compile_spec(load_spec(str(folder / "run.pipe"), flags)).plan


def test_a_token_file_compiles_and_feeds_windows_with_their_next_tokens(folder):
    plan = compiled(folder)
    config = TrainingConfig.from_spec(plan.spec)
    assert config.data == TokenData(path=str(folder / "corpus" / "train.bin"), dtype="uint16")
    assert plan.spec["data"] == {"kind": "tokens", "path": str(folder / "corpus" / "train.bin"), "dtype": "uint16"}
    ids = np.fromfile(folder / "corpus" / "train.bin", dtype=np.uint16).astype(np.int64)
    windows = {tuple(ids[i:i + SEQ + 1]) for i in range(0, len(ids) - SEQ, SEQ + 1)}
    x, y = make_data(config, plan)(5, 0, 1)
    assert x["tokens"].shape == y.shape == (BATCH, SEQ)
    for row, target in zip(x["tokens"].tolist(), y.tolist()):
        assert (*row, target[-1]) in windows and row[1:] == target[:-1]


def test_a_missing_file_and_a_model_it_cannot_feed_are_refused_at_data(folder):
    with pytest.raises(PipecError, match=r"data tokens: cannot read '.*/corpus/nope.bin'") as err:
        compiled(folder, data='tokens("corpus/nope.bin", dtype=uint16)')
    assert err.value.located and "error" in str(err.value)
    with pytest.raises(PipecError, match=r"feeds a model with one int64 input \[batch, seq\]; this model's inputs"):
        compile_spec(load_spec(None, {"model": "torch.nn:Identity", "input": "input: float32[8, 4]", "loss": "mse",
                                      "costs": "unit", "data": f'tokens("{folder}/corpus/train.bin")'}))


@pytest.mark.parametrize("flags, match", [
    ({"data": 'tokens("corpus/train.bin", dtype=float32)'}, r"--data: unknown dtype 'float32'"),
    ({"data": "tokens(dtype=uint16)"}, r"tokens takes the file's path as a string"),
    ({"data": 'tokens("corpus/train.bin", size=3)'}, r"unknown tokens setting 'size'"),
    ({"data": "tokenz"}, r"unknown data 'tokenz'"),
    ({"targets": "y: int64[8, 8]"}, r"data tokens\(...\) makes the targets"),
    ({"data": "synthetic", "targets": "y: int64[8, 8], z: int64[8]"}, r"targets takes one tensor, got 2"),
])
def test_the_language_refuses_what_data_and_targets_cannot_say(folder, flags, match):
    with pytest.raises(PipecError, match=match) as err:
        load_spec(str(folder / "run.pipe"), flags)
    assert err.value.exit_code == 2 and ":1:" in str(err.value)  # located (a flag, or the file's statement)


def _token_runs(root: Path) -> dict[str, dict]:
    """The reference: 2N steps of the schedule file's plan, a checkpoint every N."""
    (root / "corpus").mkdir()
    write_tokens(root / "corpus" / "train.bin")
    (root / "run.pipe").write_text(SCHEDULE)
    write_plan(compiled(root), str(root / "plan.json"))
    ref = with_checkpoints(root / "plan.json", root / "ref.json", root / "ref", every=N)
    return {"ref": run_job(ref, "--steps", str(2 * N))}


def _token_resumed(folder: Path) -> dict[str, dict]:
    """The plan resumed from the reference's step N, to 2N."""
    root = LAUNCHES.folder("token_runs")
    resumed = with_checkpoints(root / "plan.json", folder / "resumed.json", folder / "resumed", every=N)
    return {"resumed": run_job(resumed, "--steps", str(2 * N), "--resume", str(root / "ref" / f"step_{N:08d}"))}


token_runs = LAUNCHES.runs("token_runs", world=2, make=_token_runs)
token_resumed = LAUNCHES.runs("token_resumed", world=2, round=2, after=("token_runs",), make=_token_resumed)


@pytest.mark.timeout(900)
def test_stop_and_resume_continues_the_token_stream_bit_identically(token_runs, token_resumed):
    root, folder = LAUNCHES.folder("token_runs"), LAUNCHES.folder("token_resumed")
    ref, resumed = token_runs["ref"], token_resumed["resumed"]
    assert_ran(ref)
    assert_ran(resumed)
    assert [s for s, _ in list_checkpoints(root / "ref")] == [2 * N, N]
    ref_losses = losses(ref)
    assert losses(resumed) == {k: v for k, v in ref_losses.items() if k > N}  # steps count from 1
    assert len(set(ref_losses.values())) == 2 * N  # each step read other windows
    assert_same_state(full_state(folder / "resumed" / f"step_{2 * N:08d}"),
                      full_state(root / "ref" / f"step_{2 * N:08d}"))
    assert json.loads((root / "plan.json").read_text())["model"]["data"]["inputs"][0]["high"] == VOCAB
