"""Synthetic data derived from the traced model and the loss; the loss checked on the meta device.

Then through the compiler and the runtime: a mismatch refused by ``pipec
compile`` at the key, a float model's default data fitting its loss, and a
data function's contract (what it returns, what it raises).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from pipec.compiler.config import TrainingConfig
from pipec.compiler.driver import compile_spec
from pipec.model.data import describe_data
from pipec.runtime.stages import build_reference
from pipec.model.tensors import FrontendError, TensorSpec
from pipec.dsl import load_spec
from pipec.errors import PipecError
from pipec.runtime.training import make_data, make_loss
from test_partition import traced_model as _traced


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens, attention_mask):
        return self.head((self.emb(tokens) * attention_mask.unsqueeze(-1)).mean(1))


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x)


def build_classifier():
    return Classifier()


def build_regressor():
    return Regressor()


def test_an_lm_gets_next_token_targets_in_its_embedding_range():
    traced = _traced("pipec.examples.gpt:build", dict(layers=2, dim=32, heads=2, vocab=77, seq=16),
                     (TensorSpec("tokens", "int64", (2, 16)),))
    data = describe_data(traced, loss="cross_entropy", num_microbatches=4)
    (tokens,) = data["inputs"]
    assert tokens == {"name": "tokens", "dtype": "int64", "shape": [8, 16], "fill": "tokens", "high": 77}
    assert data["target"] == {"name": "target", "dtype": "int64", "shape": [8, 16], "fill": "next_token",
                              "of": "tokens", "high": 77}


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_a_classifier_gets_class_targets_and_mask_inputs(mode):
    traced = _traced(f"{__name__}:build_classifier", {},
                     (TensorSpec("tokens", "int64", (4, 5)), TensorSpec("attention_mask", "int64", (4, 5))), mode)
    data = describe_data(traced, loss="cross_entropy", num_microbatches=2)
    assert [(i["fill"], i.get("high")) for i in data["inputs"]] == [("tokens", 50), ("ones", None)]
    assert data["target"] == {"name": "target", "dtype": "int64", "shape": [8], "fill": "classes", "high": 3}


def test_mse_targets_take_the_outputs_shape():
    traced = _traced(f"{__name__}:build_regressor", {}, (TensorSpec("x", "float32", (8, 16)),))
    data = describe_data(traced, loss="mse", num_microbatches=4)
    assert data["inputs"] == [{"name": "x", "dtype": "float32", "shape": [32, 16], "fill": "normal"}]
    assert data["target"] == {"name": "target", "dtype": "float32", "shape": [32, 4], "fill": "regression"}


def test_declared_targets_the_loss_cannot_take_are_refused():
    traced = _traced(f"{__name__}:build_regressor", {}, (TensorSpec("x", "float32", (8, 16)),))
    with pytest.raises(FrontendError, match=r"loss mse cannot take the model's output float32\[8, 4\]") as err:
        describe_data(traced, loss="mse", num_microbatches=4, targets=(TensorSpec("y", "float32", (32, 16)),))
    assert err.value.key == "targets"
    flat = _traced("torch.nn:Identity", {}, (TensorSpec("input", "float32", (8,)),))
    with pytest.raises(FrontendError, match="cross_entropy needs the model's output to end in a class") as err:
        describe_data(flat, loss="cross_entropy", num_microbatches=1)
    assert err.value.key == "loss"


def test_the_derived_targets_fit_the_real_loss():
    traced = _traced(f"{__name__}:build_classifier", {},
                     (TensorSpec("tokens", "int64", (4, 5)), TensorSpec("attention_mask", "int64", (4, 5))))
    target = describe_data(traced, loss="cross_entropy", num_microbatches=1)["target"]
    out = torch.randn(4, 3)
    y = torch.randint(0, target["high"], tuple(target["shape"]))
    assert torch.nn.functional.cross_entropy(out, y).ndim == 0


# ----------------------------------------------------------------------------- through the compiler and the runtime

REGRESSOR = '''
import torch
from torch import nn


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def build():
    return Regressor()
'''

DATA_FNS = '''
import torch


def good(step, dp_rank, dp_size):
    return (torch.randn(32, 16),), torch.zeros(32, 4)


def wrong_dtype(step, dp_rank, dp_size):
    return {"x": torch.zeros(32, 16, dtype=torch.float64)}, torch.zeros(32, 4)


def not_a_pair(step, dp_rank, dp_size):
    return torch.zeros(32, 16)


def wrong_targets(step, dp_rank, dp_size):
    return torch.zeros(32, 16), torch.zeros(32, 16)


def raising(step, dp_rank, dp_size):
    raise KeyError("shard 7")
'''


@pytest.fixture
def regressor(tmp_path):
    """A float model (float32[32, 16] -> [32, 4]) and data functions beside its schedule file (no PYTHONPATH)."""
    (tmp_path / "regmodel.py").write_text(REGRESSOR)
    (tmp_path / "regdata.py").write_text(DATA_FNS)
    pipe = tmp_path / "reg.pipe"
    pipe.write_text('model "regmodel:build"\ninput x: float32[32, 16]\nloss mse\npp 2\ncosts unit\n')
    return pipe


def test_a_loss_the_targets_do_not_fit_is_refused_by_pipec_compile_at_the_key(cli, regressor):
    regressor.write_text(regressor.read_text() + "targets y: float32[32, 16]\n")
    out = cli("compile", str(regressor), "-o", "p.json")
    assert out.returncode == 2, out.stderr
    assert "reg.pipe:6:9: error: loss mse cannot take the model's output float32[8, 4] with the declared targets " \
           "float32[8, 16] (one microbatch): mse needs the target's shape [8, 16] to equal the output's [8, 4]" \
           in out.stderr
    assert "make `targets` match what the loss takes" in out.stderr and "Traceback" not in out.stderr
    out = cli("compile", str(regressor), "--loss", "cross_entropy", "--targets", "y: int64[32, 4]", "-o", "p.json")
    assert out.returncode == 2 and "<command line>:1:" in out.stderr and "error: loss cross_entropy cannot take" \
        in out.stderr, out.stderr


def _plan(pipe, **flags):
    return compile_spec(load_spec(str(pipe), flags)).plan


def test_a_float_model_with_mse_and_default_data_compiles_and_its_batch_fits(regressor):
    plan = _plan(regressor)
    assert plan.model["data"]["target"] == {"name": "target", "dtype": "float32", "shape": [32, 4],
                                            "fill": "regression"}
    config = TrainingConfig.from_spec(plan.spec)
    x, y = make_data(config, plan)(0, 0, 1)
    model = build_reference(plan, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no broadcasting warning, nor any other
        (out,) = model(x["x"])  # the reference returns the last stage's outputs
        loss = make_loss(config.loss, plan.model["search_path"])(out, y)
    assert loss.ndim == 0 and torch.isfinite(loss)


@pytest.mark.parametrize("fn, match", [
    ("wrong_dtype", r"returned float64\[32, 16\] for input 'x', which the plan expects as float32\[32, 16\]"),
    ("not_a_pair", r"returned float32\[32, 16\], not a pair \(inputs, targets\)"),
    ("wrong_targets", r"returned targets float32\[32, 16\], which the plan expects as float32\[32, 4\]"),
    ("raising", r"the data function 'regdata:raising' raised KeyError: 'shard 7'"),
])
def test_a_data_function_that_breaks_its_contract_is_named(regressor, fn, match):
    flags = {"data": f"regdata:{fn}"} | ({"targets": "y: float32[32, 4]"} if fn == "wrong_targets" else {})
    plan = _plan(regressor, **flags)
    data = make_data(TrainingConfig.from_spec(plan.spec), plan)
    with pytest.raises(PipecError, match=match) as err:
        data(3, 0, 1)
    assert err.value.exit_code == 2 and err.value.key == "data"
    if fn != "raising":
        assert "a data function's contract" in "\n".join(err.value.hints)
    else:
        assert "fn(step=3, dp_rank=0, dp_size=1)" in str(err.value) and err.value.__cause__ is None


def test_a_good_data_function_passes_and_a_missing_one_is_refused_at_compile(regressor):
    plan = _plan(regressor, data="regdata:good")
    assert "target" not in plan.model["data"]  # a data function's targets are unknown without `targets`
    x, y = make_data(TrainingConfig.from_spec(plan.spec), plan)(0, 0, 1)
    assert list(x) == ["x"] and y.shape == (32, 4)
    with pytest.raises(PipecError, match=r"data 'regdata:nope': module 'regdata' has no callable 'nope'") as err:
        _plan(regressor, data="regdata:nope")
    assert err.value.located and "<command line>:1:" in str(err.value)


CUSTOM_LOSS = '''
import torch.nn.functional as F


def smooth(output, target):
    return F.cross_entropy(output, target)
'''


def test_a_custom_loss_without_targets_is_refused_at_the_loss_key_and_works_with_them(cli, regressor):
    """pipec derives targets only for its own losses: a user's loss taking [B, C] logits gets no made-up
    regression targets; with `targets`, or a data function, it compiles."""
    (regressor.parent / "mylosses.py").write_text(CUSTOM_LOSS)
    regressor.write_text(regressor.read_text().replace("loss mse", 'loss "mylosses:smooth"'))
    out = cli("compile", str(regressor), "-o", "p.json")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "reg.pipe:3:6: error: loss mylosses:smooth is your own function, so pipec cannot tell what targets " \
           "it takes" in out.stderr, out.stderr
    assert "`targets NAME: DTYPE[SHAPE]`" in out.stderr and "or set `data` to your own data function" in out.stderr
    plan = _plan(regressor, targets="y: int64[32]")
    assert plan.model["data"]["target"] == {"name": "y", "dtype": "int64", "shape": [32], "fill": "classes",
                                            "high": 2}
    assert "target" not in _plan(regressor, data="regdata:good").model["data"]
    with pytest.raises(PipecError, match="your own function") as err:
        describe_data(_traced("pipec.examples.mlp:build", dict(layers=2, dim=8), (TensorSpec("x", "float32", (4, 8)),)),
                      loss="mylosses:smooth", num_microbatches=1, search_path=(str(regressor.parent),))
    assert err.value.key == "loss"
