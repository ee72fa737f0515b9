"""A tensor-parallel parameter's slices and their gathering: what the runtime reads (checkpoints, the trainer's
whole-model views) and the rewrite slices each rank's parameters with.

A :class:`~pipec.compiler.ir.tensor_parallel.ShardedParam`'s dim ``dim`` is ``segments`` equal blocks (a fused
q|k|v is three), each cut into tp contiguous parts; tp rank t holds part t of each block.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from pipec.compiler.ir.tensor_parallel import ShardedParam
from pipec.model.tensors import FrontendError
from pipec.tp.rules import KEY, Shard

__all__ = ["shard_param", "unshard", "local_shape"]


def shard_param(full: torch.Tensor, sp: ShardedParam, tp: int, rank: int) -> torch.Tensor:
    """Tp rank ``rank``'s part of ``full``: part ``rank`` of each of the ``sp.segments`` blocks of ``sp.dim``."""
    n = full.shape[sp.dim]
    if n % (sp.segments * tp):
        raise FrontendError(f"parameter {sp.name} has {n} entries on dim {sp.dim}, not {sp.segments} segments divisible "
                            f"by tp {tp}", key=KEY)
    return torch.cat([b.chunk(tp, dim=sp.dim)[rank] for b in full.chunk(sp.segments, dim=sp.dim)], dim=sp.dim).contiguous()


def unshard(shards: Sequence[torch.Tensor], sp: ShardedParam) -> torch.Tensor:
    """The full tensor from every tp rank's part, in rank order (inverse of :func:`shard_param`)."""
    pieces = [s.chunk(sp.segments, dim=sp.dim) for s in shards]
    return torch.cat([pieces[r][j] for j in range(sp.segments) for r in range(len(shards))], dim=sp.dim)


def local_shape(shape: Sequence[int], s: Any, tp: int) -> tuple[int, ...]:
    """``shape`` on one tp rank: the dim ``s`` (a :class:`~.rules.Shard`, else replicated) shards, divided by tp."""
    return tuple(d // tp if isinstance(s, Shard) and i == s.dim else d for i, d in enumerate(shape))
