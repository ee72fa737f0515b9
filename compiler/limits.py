"""pipec's size limits: the one table every part checks against.

A value beyond one of these is refused with an error before any work is
done: by the language where it is written (``pp 5000`` is located at the
5000), by :func:`pipec.compiler.ir.plan.check_limits` for a request that did
not come from a schedule file (``pipec tune``, ``pipec import``), and by the
plan reader for a plan file. The language (:mod:`pipec.dsl`) imports this
module, so it imports nothing.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

__all__ = [
    "MAX_RANKS",
    "MAX_STAGES",
    "MAX_MICROBATCHES",
    "MAX_INSTRUCTIONS",
    "MAX_REPLICAS",
    "MAX_DEVICES_PER_NODE",
    "MAX_TP",
    "MAX_STEPS",
    "MAX_SEED",
    "MAX_DIM",
    "LIMITS",
]

MAX_RANKS = 4096
"""Pipeline ranks P (key ``pp``; an order's ranks, a torch CSV's rows)."""
MAX_STAGES = 65536
"""Stages S (keys ``stages``, ``pp`` x ``virtual``, ``placement``'s entries; stage indices are below it)."""
MAX_MICROBATCHES = 65536
"""Microbatches M (key ``microbatches``; microbatch indices are below it)."""
MAX_INSTRUCTIONS = 5_000_000
"""Instructions of a program, all ranks together; also the actions an order may expand to."""
MAX_REPLICAS = 65536
"""Data-parallel replicas D (key ``dp``) and a shard group's size (key ``shard_size``)."""
MAX_DEVICES_PER_NODE = 1 << 20
"""Devices per node (key ``devices_per_node``)."""
MAX_TP = 4096
"""Tensor-parallel ranks per (pp, dp) coordinate (key ``tp``): each one shards a stage's layers."""
MAX_STEPS = 10**9
"""Optimizer steps (keys ``steps``, ``checkpoint_every``, ``lr_schedule``'s ``warmup``)."""
MAX_SEED = 2**63 - 1
"""The largest seed (key ``seed``): a signed 64-bit integer."""
MAX_DIM = 2**31
"""The largest dimension of an input or target tensor (keys ``input``, ``targets``)."""

LIMITS: Mapping[str, int] = MappingProxyType({
    "pp": MAX_RANKS,
    "num_stages": MAX_STAGES,
    "num_microbatches": MAX_MICROBATCHES,
    "instructions": MAX_INSTRUCTIONS,
})
"""The limits a compile request and a plan file are checked against, by the plan field they bound."""
