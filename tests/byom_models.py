"""Models nobody on pipec wrote, the way users bring them: factories for the bring-your-own-model tests.

Hugging Face models are built from small configs (random weights, no download) and wrapped in a module
whose forward returns the logits, as a user would write for a loss that takes a tensor. Dropout is off so
that the runs' later steps can be compared with single-process training (``--check``'s compared step runs
without it anyway: ``gpt2(dropout=True)`` keeps GPT-2's own); nothing else is tuned for pipec.
"""

from __future__ import annotations

import os

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Logits(nn.Module):
    """``forward(**inputs) -> model(**inputs).logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is None:
            return self.model(input_ids=input_ids).logits
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def gpt2(layers: int = 2, dim: int = 32, heads: int = 2, vocab: int = 96, seq: int = 16,
         dropout: bool = False) -> nn.Module:
    """GPT-2; ``dropout``: its own default dropout (0.1 on the embeddings, the residuals and attention)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    off = {} if dropout else {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return Logits(GPT2LMHeadModel(GPT2Config(
        n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=seq, use_cache=False,
        bos_token_id=0, eos_token_id=0, **off)))


def llama(layers: int = 2, dim: int = 32, heads: int = 4, vocab: int = 96, seq: int = 16) -> nn.Module:
    """A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return Logits(LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=layers, hidden_size=dim, intermediate_size=2 * dim, num_attention_heads=heads,
        num_key_value_heads=heads // 2, vocab_size=vocab, max_position_embeddings=seq, use_cache=False)))


def bert_classifier(layers: int = 2, dim: int = 32, heads: int = 2, vocab: int = 96, seq: int = 16,
                    classes: int = 3) -> nn.Module:
    """A BERT-style encoder with a sequence-classification head (inputs: token ids and an attention mask)."""
    from transformers import BertConfig, BertForSequenceClassification

    return Logits(BertForSequenceClassification(BertConfig(
        num_hidden_layers=layers, hidden_size=dim, intermediate_size=2 * dim, num_attention_heads=heads,
        vocab_size=vocab, max_position_embeddings=seq, num_labels=classes, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, classifier_dropout=0.0)))


class NanoGPT(nn.Module):
    """nanoGPT's shape: a raw ``nn.Parameter`` position embedding on the root module, blocks in a list."""

    def __init__(self, layers: int, dim: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe[: input_ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def nanogpt(layers: int = 2, dim: int = 32, vocab: int = 96, seq: int = 16) -> nn.Module:
    return NanoGPT(layers, dim, vocab, seq)


def regressor(dim: int = 16, hidden: int = 32, out: int = 4) -> nn.Module:
    """A float model: ``[B, dim] -> [B, out]``, for ``loss mse``."""
    return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, out))


def classifier(dim: int = 16, hidden: int = 32, classes: int = 5) -> nn.Module:
    """A float classifier: ``[B, dim] -> [B, classes]`` logits, for ``loss cross_entropy``."""
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))
