"""Models whose replicated parameters get a partial gradient on each tp rank: factories for the tp runs.

Hugging Face Qwen3 normalises each head of q and k by a per-head RMSNorm (``q_norm``, ``k_norm``) whose weight
(of one head's size) is shared by every head: once the attention is split by heads, each tp rank's gradient of
that weight is the sum over its own heads only. The factory nudges those weights away from their init (ones),
in their own ``_init_weights`` so that ``init module`` (and the reference) give every rank the same values.
"""

from __future__ import annotations

import os

import torch
from byom_models import Logits
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _nudge(norm: nn.Module) -> None:
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.5 * torch.randn(norm.weight.shape))


def qwen3(layers: int = 2, dim: int = 32, heads: int = 4, vocab: int = 96, seq: int = 16,
          nudge: bool = True) -> nn.Module:
    """Qwen3 (per-head q/k norms, grouped-query attention of 2 kv heads); ``nudge``: the norms' weights drawn
    around 1 (see the module doc) rather than left at ones."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    class NudgedNorm(Qwen3RMSNorm):
        """Qwen3's RMSNorm, its weight initialised around 1 (by its own ``_init_weights``, the nearest one)."""

        def _init_weights(self, module: nn.Module) -> None:
            if module is self:
                _nudge(self)

    model = Qwen3ForCausalLM(Qwen3Config(
        num_hidden_layers=layers, hidden_size=dim, intermediate_size=2 * dim, num_attention_heads=heads,
        num_key_value_heads=heads // 2, head_dim=dim // heads, vocab_size=vocab, max_position_embeddings=seq,
        use_cache=False, attention_dropout=0.0))
    if nudge:
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.__class__ = NudgedNorm
                _nudge(norm)
    return Logits(model)


class ScaledHeads(nn.Module):
    """Every head of q multiplied by one learned gain of a head's size (replicated, through a tanh, broadcast over
    the split heads: its gradient is partial on each tp rank)."""

    def __init__(self, dim: int = 16, heads: int = 4, vocab: int = 32) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.gain = nn.Parameter(torch.ones(dim // heads))
        self.q = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        s = torch.tanh(self.gain)  # computed before q: a cut before q sends it to the next stage
        q = self.q(h).unflatten(-1, (self.heads, -1)) * s
        return self.head(self.o(q.flatten(2)))


def scaled_heads() -> nn.Module:
    return ScaledHeads()


class Rolled(nn.Module):
    """An attention-like block whose q features are rolled by one (an op the tp rules do not prove to act shard by
    shard): ``tensor_parallel auto`` leaves ``q`` replicated, and says so; its MLP (``up``, ``down``) is split."""

    def __init__(self, dim: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.q = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.o(torch.roll(self.q(h), 1, dims=-1))
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(h)


def rolled() -> nn.Module:
    return Rolled()
