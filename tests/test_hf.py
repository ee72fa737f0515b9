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

from pipec.compiler.frontend import InputSpec, ModelRequest, build_stage_graph  # noqa: E402
from test_frontend import assert_stages_match, plan_of  # noqa: E402

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
    sg = build_stage_graph(ModelRequest(
        target="test_hf:gpt2", inputs=(InputSpec("input_ids", "int64", (4, 16)),), num_microbatches=2, num_stages=3,
        costs="unit", partition=None,
    ))
    assert sg.model["trace"] == "export" and "fx failed" in sg.notes[0]
    (tie,) = sg.ties  # the LM head is tied to the token embedding
    assert tie.name == "transformer.wte.weight" and tie.stages == (0, 2)
    assert all(st.num_params for st in sg.stages)
    assert_stages_match(plan_of(sg), loss, init=init, atol=1e-5)
