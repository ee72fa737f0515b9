"""Predicted throughput metrics beside the step: MFU and the source note's scaling efficiency.

- **MFU** (Chowdhery et al. 2022, App. B): the model's FLOPs per step (forward and backward, recompute left
  out) over the step time and the devices' peak: ``flops_per_step x dp / (step x N x peak)`` (plan.json's
  ``model.flops_per_step`` is one replica's).
- **scaling efficiency** (the source note's *Throughput metrics*): the throughput at N devices over N times one
  device's, ``T_1 / (N x T_N)`` for the same global batch, where ``T_1`` is predicted from the same costs with
  the whole model on one rank (:func:`single_device_step`): every microbatch's forward and backward one after
  another, no communication, no bubble, then one optimizer step; that rank's memory is not asked (the baseline
  need not fit a device). Below 1 by construction once communication, bubbles or tp's replicated part enter.

What ``pipec run`` prints beside its measured MFU (report.json's ``scaling_efficiency``, runtime/accounting.py):
``T_1 / (N x measured step)``, with ``T_1`` one device's step measured under ``--baseline`` (rank 0 times the
unpartitioned model's step on the whole batch after the run, runtime/baseline.py), labelled as against a measured
single device; without it ``T_1`` = :func:`plan_single_device_step` (the plan's own stage costs), against a
predicted single device, and no figure at all for a plan in units.

torch-free.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from pipec.compiler.ir.tensor_parallel import in_effect
from pipec.compiler.passes.memory import local_params
from pipec.schedules.timing import Cost

__all__ = ["mfu", "single_device_step", "plan_single_device_step", "scaling_efficiency"]


def mfu(flops_per_step: float | None, *, step_time: float, dp: int, num_devices: int,
        peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation of a step (``flops_per_step``: one replica's); None where either is unknown."""
    if not flops_per_step or not peak_flops or step_time <= 0:
        return None
    return flops_per_step * dp / (step_time * num_devices * peak_flops)


def single_device_step(whole: Sequence[Cost], num_microbatches: int) -> float:
    """One device's step over the same global batch: ``num_microbatches`` (all replicas' together) forwards and
    backwards of the whole model (``whole``: its stages' costs at the microbatch shape), then its optimizer."""
    return num_microbatches * sum(c.fwd + c.bwd for c in whole) + sum(c.optim for c in whole)


def plan_single_device_step(plan) -> float | None:
    """:func:`single_device_step` from a plan's own stages (their unsharded costs, a recomputed stage's second
    forward taken out, a stage timed sharded scaled back to whole: :func:`_unsharded`) over all replicas'
    microbatches; None for a plan in units."""
    if plan.unit_costs or not plan.stages:
        return None
    recomputed = set(plan.spec.get("recompute") or ())
    whole = [_unsharded(replace(st.cost, bwd=st.cost.bwd - st.cost.fwd) if st.stage in recomputed else st.cost, st,
                        plan.mesh.tp) for st in plan.stages]
    return single_device_step(whole, plan.num_microbatches * plan.mesh.dp)


def _unsharded(cost: Cost, st, tp: int) -> Cost:
    """A stage's cost as one device would run it whole: a cost timed on one of ``tp`` ranks' sharded stage
    (``costs_local``) over its compute share, its optimizer over the share of the parameters the rank holds; any
    other cost is the unsharded stage's already."""
    stp = in_effect(st.tp, tp)
    if stp is None or not stp.costs_local:
        return cost
    k = stp.compute_share(tp)
    held = local_params(st, tp) / st.num_params if st.num_params else 1.0
    return replace(cost, fwd=cost.fwd / k, bwd=cost.bwd / k, bwd_i=cost.bwd_i / k, bwd_w=cost.bwd_w / k,
                   optim=cost.optim / held)


def scaling_efficiency(step_time: float, num_devices: int, single_step: float | None) -> float | None:
    """Throughput at ``num_devices`` over ``num_devices`` x one device's (``single_step``:
    :func:`single_device_step`); None where unknown."""
    if single_step is None or step_time <= 0 or num_devices < 1:
        return None
    return single_step / (num_devices * step_time)
