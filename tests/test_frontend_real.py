"""A model not written here: torch.nn.TransformerEncoder, split inside the encoder (one layer per stage)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipec.compiler.frontend import Partition, TensorSpec, build_stage_graph
from model_requests import model_request
from test_frontend import assert_stages_match, plan_of


class Encoder(nn.Module):
    def __init__(self, layers: int = 4, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.enc(self.inp(x)))


def encoder(**kwargs) -> nn.Module:
    return Encoder(**kwargs)


def test_transformer_encoder_one_layer_per_stage():
    sg = build_stage_graph(model_request(
        target="test_frontend_real:encoder", kwargs=dict(layers=4), inputs=(TensorSpec("x", "float32", (4, 6, 32)),),
        num_microbatches=2, num_stages=4, costs="unit",
        partition=Partition("split", split_before=("enc.layers.1", "enc.layers.2", "enc.layers.3")),
    ))
    assert sg.model["trace"] == "export" and "enc" in sg.notes[0]  # fx keeps the encoder as one leaf
    for s, st in enumerate(sg.stages):
        layers = {p.split(".")[2] for p in st.params if p.startswith("enc.layers.")}
        assert layers == {str(s)}
    assert [(e.src_stage, e.dst_stage) for e in sg.edges] == [(0, 1), (1, 2), (2, 3)]
    assert [t.shape for e in sg.edges for t in e.tensors] == [(2, 6, 32)] * 3
    assert_stages_match(plan_of(sg), lambda y: F.mse_loss(y, torch.zeros_like(y)))
