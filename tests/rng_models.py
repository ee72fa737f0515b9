"""A small GPT with dropout everywhere Megatron has it, for the RNG tests (tests/test_rng.py).

``build(dim=32, heads=4, vocab=65, seq=16, p=0.5)``: tokens ``[B, T]`` -> logits ``[B, T, vocab]``. Dropout on
the embeddings, on the attention probabilities (written out, so the dropout is a module of its own), on the
MLP's hidden activations (``F.dropout``) and on both residual branches. At tp 2 the attention's and the MLP's
dropouts act on shards (heads, hidden units); the embeddings' and the residuals' on replicated values (on this
rank's positions under sequence parallelism). The vocabulary of 65 keeps the embedding and the head whole.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, seq: int, p: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(p)
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.heads))
        att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(dim=-1)
        y = self.drop(att) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Net(nn.Module):
    def __init__(self, dim: int, heads: int, vocab: int, seq: int, p: float) -> None:
        super().__init__()
        self.p = p
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.drop = nn.Dropout(p)
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, seq, p)
        self.resid1 = nn.Dropout(p)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.resid2 = nn.Dropout(p)
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(pos))
        x = x + self.resid1(self.attn(self.ln1(x)))
        hidden = F.dropout(F.gelu(self.fc(self.ln2(x))), self.p, self.training)
        x = x + self.resid2(self.out(hidden))
        return self.head(self.ln_f(x))


def build(dim: int = 32, heads: int = 4, vocab: int = 65, seq: int = 16, p: float = 0.5) -> Net:
    return Net(dim, heads, vocab, seq, p)
