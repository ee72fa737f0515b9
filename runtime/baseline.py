"""``pipec run --baseline``: one device's training step, measured, and the scaling efficiency the run says.

Rank 0, after the run's timed steps, trains the unpartitioned model (:func:`~pipec.runtime.stages.build_reference`:
the run's initial weights; ``--check``'s reference itself where the run built one) on the whole global batch as
one process would: every replica's microbatches one after another, forward and backward accumulating the
gradients, the clip if the plan clips, then the optimizer step. :data:`WARMUP` steps go untimed, then
:data:`REPEATS` are timed; their median is the single device's step T_1, and report.json's scaling efficiency
is T_1 / (N x the measured step) (runtime/accounting.py, :func:`~pipec.compiler.sim.metrics.scaling_efficiency`).
It runs with the rank's own thread count (one per rank when torchrun starts several), and trains a model and an
optimizer of its own under a forked RNG, so the run's training, checkpoints and random streams are what they
would be without it.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from typing import Any, Callable, Mapping

import torch

from pipec.runtime.training import autocast_dtype, make_optimizer, replica_inputs, split_microbatches

__all__ = ["measure_baseline", "scaling_text", "WARMUP", "REPEATS"]

WARMUP = 1
"""Untimed single-device steps before the timed ones (allocations, kernel caches)."""
REPEATS = 3
"""Timed single-device steps; T_1 is their median."""


def measure_baseline(plan, config, *, data: Callable[[int, int, int], tuple[Any, Any]],
                     loss_fn: Callable[[Any, Any], torch.Tensor], step: int, device: torch.device,
                     reference: torch.nn.Module | None = None, console=None, repeats: int = REPEATS,
                     warmup: int = WARMUP) -> dict[str, Any] | None:
    """report.json's ``baseline``, ``{"step_time_s", "repeats", "warmup", "step_times_s"}``: steps of ``plan``'s
    unpartitioned model (``reference``, trained in place, so one the run does not train; None: one built here)
    on every replica's batch of step ``step`` (``data``), with ``config``'s optimizer, clip and dtype, on
    ``device``. None, with a warning, where the model's step does not fit the device. The build and the steps
    run under a forked RNG (``torch.random.fork_rng``): the caller's random streams are as they were."""
    from pipec.runtime.stages import build_reference

    if console is not None:
        console.print(f"--baseline: the unpartitioned step on rank 0 ({warmup} warm-up, {repeats} timed)")
    names = [i["name"] for i in replica_inputs(plan)]
    M, D = plan.num_microbatches, plan.mesh.dp
    cuda = device.type == "cuda"
    try:
        with torch.random.fork_rng(devices=[device] if cuda else []):
            ref = reference if reference is not None else build_reference(plan, seed=config.seed, init=config.init)
            microbatches = [(_to(x, device), _to(y, device)) for inputs, targets in (data(step, d, D) for d in range(D))
                            for x, y in zip(split_microbatches(inputs, M, "data inputs", names),
                                            split_microbatches(targets, M, "data targets"))]
            times = _time_steps(ref.to(device), microbatches, names, loss_fn, config, device, repeats, warmup)
    except torch.OutOfMemoryError:
        print("pipec: warning: --baseline: the unpartitioned model's step does not fit one device; the scaling "
              "efficiency is against a predicted single device", file=sys.stderr, flush=True)
        return None
    return {"step_time_s": statistics.median(times), "repeats": repeats, "warmup": warmup, "step_times_s": times}


def _time_steps(ref, microbatches, names, loss_fn, config, device, repeats: int, warmup: int) -> list[float]:
    """Seconds of each timed step of ``ref`` over ``microbatches`` (after ``warmup`` untimed ones)."""
    ref.zero_grad(set_to_none=True)
    optimizer = make_optimizer(ref.parameters(), config)
    dtype = autocast_dtype(config.dtype)
    scale = 1.0 / len(microbatches)  # the mean over every replica's microbatches, as the pipelined step's grads

    def one_step() -> None:
        for x, y in microbatches:
            with torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext():
                out = ref(*[x[n] for n in names])
            out = out[0] if isinstance(out, tuple) and len(out) == 1 else out
            (loss_fn(out, y) * scale).backward()
        if config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        one_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def scaling_text(report: Mapping[str, Any]) -> str | None:
    """report.json's scaling efficiency as the run's summary says it; None without one."""
    got = report.get("scaling_efficiency")
    if got is None:
        return None
    base = report.get("baseline")
    return (f"scaling efficiency {got['value']:.1%} against a {got['against']} single device"
            + (f" ({base['step_time_s']:.3f} s a step, median of {base['repeats']})" if base else ""))


def _to(value: Any, device: torch.device) -> Any:
    """A microbatch (a tensor, or a name -> tensor dict) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value
