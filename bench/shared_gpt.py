"""The runtime benchmark's shared model: one GPT that pipec and torch.distributed.pipelining both run.

``build(layers=8, dim=32, heads=4, vocab=1000, seq=16)`` returns a GPT with
untied embeddings (``wte`` and a separate ``head``), a raw position-embedding
parameter (``pos``, an ``nn.Parameter`` on the root, not an ``nn.Embedding``),
``layers`` pre-LN blocks of causal scaled-dot-product attention and a 4x GELU
MLP, a final LayerNorm and the head. Its ``forward(tokens)`` maps int64 tokens
``[B, T]`` to logits ``[B, T, vocab]``.

:func:`stage` cuts it as both runtimes do: blocks ``lo:hi``, with the
embeddings on the first stage and the final norm and head on the last (pipec
traces the whole model and splits before ``blocks.i``; torch's side builds the
same pieces with :func:`stage`). Nothing is tied, so both runtimes do the same
work: no tie all-reduce on pipec's side, no unsynchronised copy on torch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SharedGPT", "Block", "Stage", "build", "stage"]


class Block(nn.Module):
    """Pre-LN: x + attn(ln1(x)), then x + mlp(ln2(x)); causal SDPA, a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} must be divisible by heads {heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class SharedGPT(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The token embeddings plus the positions: the first stage's work before its blocks."""
        return self.wte(tokens) + self.pos[: tokens.shape[1]]

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the head: the last stage's work after its blocks."""
        return self.head(self.ln_f(x))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.finish(x)


def build(layers: int = 8, dim: int = 32, heads: int = 4, vocab: int = 1000, seq: int = 16) -> SharedGPT:
    return SharedGPT(layers, dim, heads, vocab, seq)


class Stage(nn.Module):
    """Blocks ``lo:hi`` of a :class:`SharedGPT`, the embeddings first and the norm and head last.

    Another GPT's stage overrides the four hooks: which modules the first and last stages take
    (:meth:`take_first`, :meth:`take_last`) and what they do with them (:meth:`embed`, :meth:`finish`)."""

    def __init__(self, gpt: nn.Module, lo: int, hi: int, *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.take_first(gpt)
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        if last:
            self.take_last(gpt)

    def take_first(self, gpt: SharedGPT) -> None:
        self.wte, self.pos = gpt.wte, gpt.pos

    def take_last(self, gpt: SharedGPT) -> None:
        self.ln_f, self.head = gpt.ln_f, gpt.head

    # the model's own code, run on the modules the stage took from it (under the model's names)
    embed = SharedGPT.embed
    finish = SharedGPT.finish

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.finish(x)
        return x


def stage(gpt: SharedGPT, lo: int, hi: int, *, first: bool, last: bool) -> nn.Module:
    """The stage of ``gpt`` holding blocks ``lo:hi`` (its parameters are the model's own, not copies)."""
    return Stage(gpt, lo, hi, first=first, last=last)
