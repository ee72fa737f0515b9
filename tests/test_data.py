"""Token files: windows are a pure function of (seed, step, dp rank, row), disjoint within a step."""

from __future__ import annotations

import numpy as np
import torch
import pytest

from pipec.runtime.data import DataError, open_tokens, window_index


def _file(tmp_path, n, dtype="uint16", vocab=1000):
    path = tmp_path / "train.bin"
    (np.arange(n) % vocab).astype(dtype).tofile(path)
    return str(path)


@pytest.mark.parametrize("num_windows", [1, 7, 12, 1000])
def test_each_epoch_visits_every_window_once(num_windows):
    for epoch in range(3):
        seen = [window_index(epoch * num_windows + k, num_windows=num_windows, seed=5) for k in range(num_windows)]
        assert sorted(seen) == list(range(num_windows))
    first = [window_index(k, num_windows=num_windows, seed=5) for k in range(num_windows)]
    second = [window_index(num_windows + k, num_windows=num_windows, seed=5) for k in range(num_windows)]
    assert num_windows < 3 or first != second  # a new shuffle each epoch


def test_rows_are_next_token_windows_disjoint_across_replicas(tmp_path):
    path = _file(tmp_path, 17 * 40)  # 40 windows of seq + 1 = 17
    tf = open_tokens(path, dtype="uint16", seq=16, batch=4, dp_size=2, seed=0, vocab=1000)
    starts = set()
    for dp in range(2):
        x, y = tf.batch(3, dp, 2, 4)
        assert x.shape == y.shape == (4, 16) and str(x.dtype) == "torch.int64"
        assert (y[:, :-1] == x[:, 1:]).all()          # targets are the inputs shifted by one
        assert ((x[:, 1:] - x[:, :-1]) % 1000 == 1).all()  # a contiguous slice of the file
        starts |= {int(r[0]) for r in x}
    assert len(starts) == 8                             # no two rows of a step read the same window


def test_the_stream_is_a_function_of_the_step(tmp_path):
    path = _file(tmp_path, 17 * 10)
    a = open_tokens(path, dtype="uint16", seq=16, batch=2, dp_size=1, seed=3)
    b = open_tokens(path, dtype="uint16", seq=16, batch=2, dp_size=1, seed=3)
    for step in (0, 4, 9):                               # step 9 wraps past the file's end
        assert (a.batch(step, 0, 1, 2)[0] == b.batch(step, 0, 1, 2)[0]).all()
    c = open_tokens(path, dtype="uint16", seq=16, batch=2, dp_size=1, seed=4)
    assert any((a.batch(s, 0, 1, 2)[0] != c.batch(s, 0, 1, 2)[0]).any() for s in range(5))


@pytest.mark.parametrize("case, match", [
    ("dtype", "not a token type"),
    ("missing", "cannot read"),
    ("ragged", "not a whole number of uint16 tokens"),
    ("short", "one step reads 8 distinct windows"),
    ("vocab", "outside the model's vocabulary of 10"),
])
def test_mistakes_are_named(tmp_path, case, match):
    path = _file(tmp_path, 17 * 40)
    kwargs = dict(dtype="uint16", seq=16, batch=4, dp_size=2, seed=0)
    if case == "dtype":
        kwargs["dtype"] = "float32"
    elif case == "missing":
        path = str(tmp_path / "nope.bin")
    elif case == "ragged":
        with open(path, "ab") as f:
            f.write(b"\0")
    elif case == "short":
        path = _file(tmp_path, 17 * 7)
    elif case == "vocab":
        kwargs["vocab"] = 10
    with pytest.raises(DataError, match=match) as err:
        open_tokens(path, **kwargs)
    assert err.value.key == "data" and err.value.exit_code == 2


def test_synthetic_batches_fit_the_description_and_repeat():
    from pipec.runtime.data import synthetic_batch

    desc = {"inputs": [{"name": "tokens", "dtype": "int64", "shape": [8, 5], "fill": "tokens", "high": 50},
                       {"name": "attention_mask", "dtype": "int64", "shape": [8, 5], "fill": "ones"}],
            "target": {"name": "target", "dtype": "int64", "shape": [8], "fill": "classes", "high": 3}}
    x, y = synthetic_batch(desc, step=2, dp_rank=1, seed=0)
    assert x["tokens"].shape == (8, 5) and int(x["tokens"].max()) < 50 and (x["attention_mask"] == 1).all()
    assert y.shape == (8,) and y.dtype == torch.int64 and 0 <= int(y.min()) and int(y.max()) < 3
    x2, y2 = synthetic_batch(desc, step=2, dp_rank=1, seed=0)
    assert (x2["tokens"] == x["tokens"]).all() and (y2 == y).all()
    assert not (synthetic_batch(desc, step=2, dp_rank=0, seed=0)[0]["tokens"] == x["tokens"]).all()
    reg = {"inputs": [{"name": "x", "dtype": "float32", "shape": [6, 16], "fill": "normal"}],
           "target": {"name": "target", "dtype": "float32", "shape": [6, 4], "fill": "regression"}}
    x, y = synthetic_batch(reg, step=0, dp_rank=0, seed=1)
    assert y.shape == (6, 4) and y.dtype == torch.float32 and float(y.abs().max()) <= 1
    lm = {"inputs": [{"name": "tokens", "dtype": "int64", "shape": [4, 7], "fill": "tokens", "high": 9}],
          "target": {"name": "target", "dtype": "int64", "shape": [4, 7], "fill": "next_token", "of": "tokens",
                     "high": 9}}
    x, y = synthetic_batch(lm, step=0, dp_rank=0, seed=1)
    assert (y == (x["tokens"] + 1) % 9).all()
