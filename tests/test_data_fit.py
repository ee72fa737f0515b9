"""Synthetic data derived from the traced model and the loss; the loss checked on the meta device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipec.compiler.frontend.data import describe_data
from pipec.compiler.frontend.trace import FrontendError, InputSpec
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
                     (InputSpec("tokens", "int64", (2, 16)),))
    data = describe_data(traced, loss="cross_entropy", num_microbatches=4)
    (tokens,) = data["inputs"]
    assert tokens == {"name": "tokens", "dtype": "int64", "shape": [8, 16], "fill": "tokens", "high": 77}
    assert data["target"] == {"name": "target", "dtype": "int64", "shape": [8, 16], "fill": "next_token",
                              "of": "tokens", "high": 77}


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_a_classifier_gets_class_targets_and_mask_inputs(mode):
    traced = _traced(f"{__name__}:build_classifier", {},
                     (InputSpec("tokens", "int64", (4, 5)), InputSpec("attention_mask", "int64", (4, 5))), mode)
    data = describe_data(traced, loss="cross_entropy", num_microbatches=2)
    assert [(i["fill"], i.get("high")) for i in data["inputs"]] == [("tokens", 50), ("ones", None)]
    assert data["target"] == {"name": "target", "dtype": "int64", "shape": [8], "fill": "classes", "high": 3}


def test_mse_targets_take_the_outputs_shape():
    traced = _traced(f"{__name__}:build_regressor", {}, (InputSpec("x", "float32", (8, 16)),))
    data = describe_data(traced, loss="mse", num_microbatches=4)
    assert data["inputs"] == [{"name": "x", "dtype": "float32", "shape": [32, 16], "fill": "normal"}]
    assert data["target"] == {"name": "target", "dtype": "float32", "shape": [32, 4], "fill": "regression"}


def test_declared_targets_the_loss_cannot_take_are_refused():
    traced = _traced(f"{__name__}:build_regressor", {}, (InputSpec("x", "float32", (8, 16)),))
    with pytest.raises(FrontendError, match=r"loss mse cannot take the model's output float32\[8, 4\]") as err:
        describe_data(traced, loss="mse", num_microbatches=4, targets=(InputSpec("y", "float32", (32, 16)),))
    assert err.value.key == "targets"
    flat = _traced("torch.nn:Identity", {}, (InputSpec("input", "float32", (8,)),))
    with pytest.raises(FrontendError, match="cross_entropy needs the model's output to end in a class") as err:
        describe_data(flat, loss="cross_entropy", num_microbatches=1)
    assert err.value.key == "loss"


def test_the_derived_targets_fit_the_real_loss():
    traced = _traced(f"{__name__}:build_classifier", {},
                     (InputSpec("tokens", "int64", (4, 5)), InputSpec("attention_mask", "int64", (4, 5))))
    target = describe_data(traced, loss="cross_entropy", num_microbatches=1)["target"]
    out = torch.randn(4, 3)
    y = torch.randint(0, target["high"], tuple(target["shape"]))
    assert torch.nn.functional.cross_entropy(out, y).ndim == 0
