"""A Hugging Face transformers GPT-2 (small config, random weights, no download) through the front end.

transformers comes with the test extra (and alone as ``pipec[hf]``); its import is slow, so this file holds
the few tests that need it.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'transformers>=5,<6')")

from pipec.compiler.frontend import TensorSpec, build_stage_graph, resolve_init  # noqa: E402
from pipec.runtime.stages import build_stages  # noqa: E402
from pipec.model.weights import initial_values  # noqa: E402
from test_frontend import assert_stages_match, plan_of  # noqa: E402
from model_requests import changed, model_request  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def gpt2(layers: int = 3, dim: int = 32, heads: int = 4, vocab: int = 64, seq: int = 16):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=seq, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def loss(logits: torch.Tensor) -> torch.Tensor:
    targets = torch.arange(logits.shape[0] * logits.shape[1]).remainder(logits.shape[-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)


@pytest.mark.parametrize("init", ["module", "exact"])
def test_gpt2_stages_reproduce_outputs_and_gradients(init):
    sg = build_stage_graph(model_request(
        target="test_hf:gpt2", inputs=(TensorSpec("input_ids", "int64", (4, 16)),), num_microbatches=2, num_stages=3,
        costs="unit",
    ))
    assert sg.model["trace"] == "export" and "fx failed" in sg.notes[0]
    (tie,) = sg.ties  # the LM head is tied to the token embedding
    assert tie.name == "transformer.wte.weight" and tie.stages == (0, 2)
    assert all(st.num_params for st in sg.stages)
    assert_stages_match(plan_of(sg), loss, init=init, atol=1e-5)


class Logits(torch.nn.Module):
    """A Hugging Face model wrapped as a user would: forward returns the logits tensor."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def wrapped_gpt2() -> torch.nn.Module:
    return Logits(gpt2(layers=2))


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return Logits(LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=16, use_cache=False)))


def test_init_auto_is_module_for_wrapped_hugging_face_models_and_independent_of_the_partition():
    # GPT-2's Conv1D and Llama's RMSNorm have no reset_parameters(): the enclosing PreTrainedModel's _init_weights
    assert resolve_init("auto", "test_hf:llama", {}) == "module"
    values, _ = initial_values("test_hf:llama", {}, ["model.model.norm.weight", "model.model.layers.0.mlp.up_proj.weight"],
                               seed=0, init="module")
    assert torch.equal(values["model.model.norm.weight"], torch.ones(32))  # _init_weights: RMSNorm weights are 1
    assert values["model.model.layers.0.mlp.up_proj.weight"].std() > 0
    req = model_request(target="test_hf:wrapped_gpt2", inputs=(TensorSpec("input_ids", "int64", (4, 16)),),
                        num_microbatches=2, num_stages=2, costs="unit")
    sg = build_stage_graph(req)
    assert sg.model["init"] == "module" and sg.model["notes"] == list(sg.notes)
    _, ref = assert_stages_match(plan_of(sg), loss, init="module", atol=1e-5)
    ref_params = ref.canonical_params()
    other = plan_of(build_stage_graph(changed(req, num_stages=3)))
    for mod in build_stages(other, range(3), seed=3, init="module").values():
        for name, p in mod.canonical_params().items():
            assert torch.equal(p, ref_params[name]), name
