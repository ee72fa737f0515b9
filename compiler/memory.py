"""The memory model: what each pp rank holds, and the ``device_memory`` refusal.

A rank holds, for every parameter copy of its stages, :data:`BYTES_PER_PARAM`
bytes of parameter, gradient and optimizer state (a tied weight counts on
every stage holding a copy): :func:`state_bytes`. The simulator adds each
rank's saved activations at its peak (per stage, bytes per microbatch times
the microbatches it holds at that moment) and reports the sum as the
predicted Timeline's ``peak_memory_bytes``; :func:`check_memory` refuses a
plan whose peak on some rank exceeds ``device_memory``. The prediction is
before any sharding (ZeRO/FSDP would divide the state across dp).

No torch (nor networkx) here: the driver runs it on every compile.
"""

from __future__ import annotations

from pipec.compiler.plan import Plan
from pipec.errors import PipecError

__all__ = ["BYTES_PER_PARAM", "MemoryBudgetError", "state_bytes", "check_memory"]

BYTES_PER_PARAM = 16
"""Mixed-precision Adam: 2 (bf16 weight) + 2 (bf16 grad) + 4 (fp32 master) + 8 (fp32 moments)."""


class MemoryBudgetError(PipecError):
    """A rank's predicted peak memory exceeds ``device_memory``."""


def state_bytes(plan: Plan) -> list[int] | None:
    """Per pp rank: params, grads and optimizer state of every parameter copy it holds; None if unknown."""
    if not plan.stages or any(st.num_params is None for st in plan.stages):
        return None
    out = [0] * plan.mesh.pp
    for st in plan.stages:
        out[st.rank] += BYTES_PER_PARAM * st.num_params
    return out


def check_memory(plan: Plan, device_memory: int) -> None:
    """Raise :class:`MemoryBudgetError` (key ``device_memory``) naming the first pp rank whose predicted
    peak exceeds ``device_memory`` bytes, with what makes it up and the fixes. A plan whose prediction has
    no memory (schedule-only) passes."""
    state = state_bytes(plan)
    for rt in plan.prediction.per_rank if plan.prediction else ():
        if rt.peak_memory_bytes is None or rt.peak_memory_bytes <= device_memory:
            continue
        assert state is not None, "a predicted peak needs the stages' parameter counts"
        params = sum(st.num_params or 0 for st in plan.stages if st.rank == rt.rank)
        raise MemoryBudgetError(
            f"pp rank {rt.rank} needs {_gib(rt.peak_memory_bytes)} at its peak but device_memory is "
            f"{_gib(device_memory)}: parameters, gradients and optimizer state {_gib(state[rt.rank])} "
            f"({params:,} parameters x {BYTES_PER_PARAM} bytes) + activations "
            f"{_gib(rt.peak_memory_bytes - state[rt.rank])} ({rt.peak_activations} stage-microbatches in flight "
            "at the peak); use more pp ranks, recompute, a schedule with fewer microbatches in flight, or a "
            "larger device_memory", key="device_memory")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
