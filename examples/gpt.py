"""A small GPT (nanoGPT-style) for pipec's examples, tests and benchmarks.

``build(layers=8, dim=256, heads=4, vocab=1000, seq=128)`` returns a model
whose ``forward(tokens)`` maps int64 tokens ``[B, T]`` (``T <= seq``) to
logits ``[B, T, vocab]``: token embedding ``wte`` plus a learned position
embedding ``wpe``; ``layers`` blocks of LayerNorm -> causal self-attention ->
residual, LayerNorm -> MLP (GELU) -> residual; a final LayerNorm; and an LM
head whose weight is tied to ``wte`` (its input scaled by ``dim**-0.5``, as T5
does with tied embeddings, so the loss starts near ``ln(vocab)``). Each attention module registers its
causal mask as a buffer in ``__init__`` (not saved in the state dict).

Every module that owns parameters is a torch.nn layer with its own
``reset_parameters()``, so ``init module`` reproduces the factory's weights
module by module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "Block", "CausalSelfAttention", "MLP", "build"]


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, seq: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"GPT needs dim divisible by heads, got dim={dim}, heads={heads}; pick heads dividing dim")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:T, :T])
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, seq: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, seq)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, seq) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.scale = dim**-0.5

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        pos = torch.arange(T, device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        # the head shares wte's N(0, 1) weights: scale by dim^-0.5 (as T5 does with tied
        # embeddings) so that the initial logits are O(1) and the loss starts near ln(vocab)
        return self.lm_head(self.ln_f(x) * self.scale)


def build(layers: int = 8, dim: int = 256, heads: int = 4, vocab: int = 1000, seq: int = 128) -> GPT:
    """The example GPT; the keyword arguments are the schedule file's ``model_args``."""
    return GPT(layers, dim, heads, vocab, seq)
