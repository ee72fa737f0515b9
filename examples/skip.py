"""A model with a long skip connection, for pipec's examples and tests.

``build(layers=8, dim=64, skip_from=1, skip_to=6)``: ``forward(x [B, dim])
-> [B, dim]``. ``layers`` residual blocks (LayerNorm -> Linear -> GELU ->
Linear); the output of block ``skip_from`` is added again after block
``skip_to``, so once the model is split into stages that value travels
straight from the stage holding block ``skip_from`` to the one holding block
``skip_to`` (a skip edge over the stages between).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SkipNet", "build"]


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class SkipNet(nn.Module):
    def __init__(self, layers: int, dim: int, skip_from: int, skip_to: int) -> None:
        super().__init__()
        if not 0 <= skip_from < skip_to < layers:
            raise ValueError(
                f"SkipNet needs 0 <= skip_from < skip_to < layers, got skip_from={skip_from}, "
                f"skip_to={skip_to}, layers={layers}"
            )
        self.skip_from, self.skip_to = skip_from, skip_to
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        saved = x
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == self.skip_from:
                saved = x
            if i == self.skip_to:
                x = x + saved
        return self.head(x)


def build(layers: int = 8, dim: int = 64, skip_from: int = 1, skip_to: int = 6) -> SkipNet:
    """The example skip model."""
    return SkipNet(layers, dim, skip_from, skip_to)
