"""A deep MLP for pipec's examples and tests: ``forward(x [B, dim]) -> [B, dim]`` (an MSE-style model).

``build(layers=8, dim=256, hidden=None)``: ``layers`` blocks of Linear ->
GELU -> Linear with a residual connection, in an ``nn.ModuleList`` (one
block is the unit the balancer cuts between), then a final LayerNorm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP", "build"]


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(x)))


class MLP(nn.Module):
    def __init__(self, layers: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def build(layers: int = 8, dim: int = 256, hidden: int | None = None) -> MLP:
    """The example MLP; ``hidden`` defaults to ``4 * dim``."""
    return MLP(layers, dim, hidden or 4 * dim)
