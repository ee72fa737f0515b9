"""Tracing: fx or export on meta tensors, node annotations, the fingerprint."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipec.model.annotate import propagate
from pipec.model.load import instantiate
from pipec.model.tensors import FrontendError, TensorSpec, example_inputs
from pipec.model.trace import is_pipe_split, trace_model

GPT = "pipec.examples.gpt:build"
ARGS = dict(layers=2, dim=16, heads=2, vocab=32, seq=8)
TOKENS = (TensorSpec("tokens", "int64", (2, 8)),)


def trace(target=GPT, kwargs=ARGS, inputs=TOKENS, mode="auto", split_paths=()):
    model, _ = instantiate(target, kwargs, mode="meta")
    example = example_inputs(inputs)
    traced = trace_model(model, inputs, example, mode=mode, split_paths=split_paths)
    propagate(traced, example)
    return traced


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(x)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if x.sum() > 0 else x


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) * 2


class Optional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 2.0) -> torch.Tensor:
        y = self.a(x)
        if mask is not None:
            y = y + mask
        return y * scale


def test_fx_traces_the_gpt_on_meta_and_annotates_every_node():
    traced = trace()
    assert traced.path == "fx" and not traced.fallback
    assert all(p.device.type == "meta" for p in traced.model.parameters())
    nodes = {n.name: n for n in traced.gm.graph.nodes}
    qkv = nodes["blocks_0_attn_qkv"]
    assert tuple(qkv.meta["tensor_meta"].shape) == (2, 8, 48)
    assert qkv.meta["pipec_flops"] == 2 * (2 * 8) * 16 * 48
    assert nodes["scaled_dot_product_attention"].meta["pipec_flops"] > 0
    assert nodes["blocks_0_attn_mask"].op == "get_attr"  # the causal-mask buffer is proxied, not baked in
    assert nodes["getattr_1"].meta["pipec_value"] == torch.Size([2, 8])
    # the tied weight has one canonical name, reachable from both of its names
    assert traced.canonical["lm_head.weight"] == "wte.weight" and traced.canonical["wte.weight"] == "wte.weight"


def test_saved_bytes_leave_out_parameters():
    traced = trace("test_trace:Plain", {}, (TensorSpec("x", "float32", (4, 8)),))
    nodes = {n.name: n for n in traced.gm.graph.nodes}
    # the linear saves its input (weights are parameters, not activations); relu saves its output; x2 saves nothing
    assert sum(b for _, b in nodes["fc"].meta["pipec_saved"]) == 4 * 8 * 4
    assert sum(b for _, b in nodes["relu"].meta["pipec_saved"]) == 4 * 16 * 4
    assert nodes["mul"].meta["pipec_saved"] == ()


def test_fingerprint_is_stable_and_names_its_parts():
    a, b = trace(), trace()
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 64
    assert a.fingerprint_parts["torch"] == ".".join(torch.__version__.split(".")[:2])
    deeper = trace(kwargs=dict(ARGS, layers=3))
    assert {k for k in a.fingerprint_parts if a.fingerprint_parts[k] != deeper.fingerprint_parts[k]} == {"graph", "params"}
    wider = trace(kwargs=dict(ARGS, dim=32))
    assert {k for k in a.fingerprint_parts if a.fingerprint_parts[k] != wider.fingerprint_parts[k]} == {"params"}
    exported = trace(mode="export")
    assert exported.path == "export" and exported.fingerprint_parts["trace"] == "export"
    assert exported.fingerprint != a.fingerprint


def test_auto_falls_back_to_export_when_a_leaf_hides_layers():
    x = (TensorSpec("x", "float32", (2, 4, 16)),)
    traced = trace("test_trace:Encoder", {}, x)
    assert traced.path == "export" and "'enc'" in traced.fallback
    layers = {n.meta["nn_module_stack"] and list(n.meta["nn_module_stack"].values())[-1][0] for n in traced.gm.graph.nodes
              if n.op == "call_function"}
    assert {"enc.layers.0.linear1", "enc.layers.2.norm2"} <= layers
    with pytest.raises(FrontendError, match="one leaf node.*use trace export"):
        trace("test_trace:Encoder", {}, x, mode="fx")


def test_trace_failures_are_frontend_errors():
    x = (TensorSpec("x", "float32", (2, 4)),)
    with pytest.raises(FrontendError, match="torch.fx cannot trace DataDependent.*use trace export"):
        trace("test_trace:DataDependent", {}, x, mode="fx")
    with pytest.raises(FrontendError, match=r"torch.export cannot capture DataDependent \(fx failed"):
        trace("test_trace:DataDependent", {}, x, mode="auto")
    with pytest.raises(FrontendError, match="trace must be one of auto, fx, export"):
        trace(mode="jit")
    with pytest.raises(FrontendError, match="int65"):
        example_inputs((TensorSpec("x", "int65", (2,)),))


def test_pipe_split_is_recorded_by_both_tracers():
    from test_partition import Marked

    for mode in ("fx", "export"):
        model = Marked().to("meta")
        inputs = (TensorSpec("x", "float32", (2, 8)),)
        traced = trace_model(model, inputs, example_inputs(inputs), mode=mode)
        assert sum(is_pipe_split(n) for n in traced.gm.graph.nodes) == 2
    Marked()(torch.randn(2, 8))  # eagerly, a no-op


def test_forward_arguments_left_at_their_defaults_are_specialised():
    traced = trace("test_trace:Optional", {}, (TensorSpec("x", "float32", (2, 4)),), mode="fx")
    assert [n.target for n in traced.gm.graph.nodes if n.op == "placeholder"] == ["x"]
    assert [n.op for n in traced.gm.graph.nodes] == ["placeholder", "call_module", "call_function", "output"]


# ----------------------------------------------------------------------------- a forward that fails, said as the user wrote it

BAD_MODEL = '''
import torch
from torch import nn


class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 12)

    def forward(self, x):
        return self.fc(x).view(x.shape[0], 5, -1)  # 12 features are no 5 heads


def build():
    return Heads()
'''


@pytest.mark.parametrize("flags", [{}, {"trace": "export"}, {"dtype": "bfloat16"}])
def test_a_forward_that_fails_on_the_inputs_names_the_users_file_and_line(tmp_path, flags):
    from pipec.compiler.driver import compile_spec
    from pipec.dsl import load_spec

    from pipec.errors import PipecError

    (tmp_path / "heads.py").write_text(BAD_MODEL)
    (tmp_path / "heads.pipe").write_text('model "heads.py:build"\ninput x: float32[4, 12]\nloss mse\ncosts unit\n')
    with pytest.raises(PipecError) as err:
        compile_spec(load_spec(str(tmp_path / "heads.pipe"), flags))
    text = str(err.value)
    assert "heads.py:12 (in forward: return self.fc(x).view(x.shape[0], 5, -1)" in text, text
    assert "heads.pipe:2:7: error: the model's forward fails on the declared inputs at " in text, text
    assert "While executing" not in text and "tlparse" not in text and "make forward traceable" not in text


def test_an_input_longer_than_the_models_positions_is_said_so_without_torchs_log_lines(cli_process):
    out = cli_process("compile", "--model", GPT, "--model-arg", "layers=2, dim=16, heads=2, vocab=64, seq=16", "--input",
              "tokens: int64[4, 32]", "--costs", "unit", "--dtype", "bfloat16", "-o", "p.json")
    assert out.returncode == 2
    assert "error: input tokens has 32 positions (dim 1), more than the model's 16: its position embedding wpe is " \
           "nn.Embedding(16, 16)" in out.stderr, out.stderr
    assert "fake_tensor.py" not in out.stderr and "Traceback" not in out.stderr and "make forward" not in out.stderr
    assert len(out.stderr.splitlines()) == 4, out.stderr  # the message, the source line, the caret, the hint


def test_torch_log_records_are_dropped_while_tracing_unless_torch_logs_is_set(monkeypatch):
    import logging

    from pipec.model.trace import quiet_torch

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    logger.addHandler(handler)
    try:
        with quiet_torch():
            logger.error("inside")
        logger.error("outside")
        monkeypatch.setenv("TORCH_LOGS", "+dynamo")
        with quiet_torch():
            logger.error("asked for")
    finally:
        logger.removeHandler(handler)
    assert seen == ["outside", "asked for"]
