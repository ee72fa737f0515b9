"""One rank's training loop around the executor: data, optimizer, clipping, --check, reports.

The executor runs a step's instructions; the trainer feeds it microbatches,
owns the optimizer (called from the plan's ``OPTIM_STEP``), gathers every
rank's measurements on rank 0, and writes report.json and the measured trace.
It trains with the plan's :class:`~pipec.compiler.config.TrainingConfig` under
the run's :class:`~pipec.runtime.launch.RunOptions`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

from pipec.compiler.config import TrainingConfig
from pipec.compiler.ir.plan import Plan
from pipec.runtime.executor import Executor, RankStep
from pipec.runtime.launch import RunOptions
from pipec.runtime.sharding import ParamShards, ShardLayout, full, local, shard_stages, state_bytes
from pipec.runtime.training import (
    TrainingError,
    autocast_dtype,
    dropout_off,
    make_data,
    make_loss,
    stage_loss,
    make_optimizer,
    replica_inputs,
    split_microbatches,
)

__all__ = ["Trainer", "CHECK_TOLERANCE", "interval_line", "activations_line"]

CHECK_TOLERANCE = {"float32": (1e-6, 1e-4), "bfloat16": (1e-3, 5e-2), "float16": (1e-3, 5e-2)}
"""--check passes when every gradient differs from the reference's by at most atol + rtol x max|reference|
of that tensor, and the loss by at most atol + rtol x |reference loss| (per dtype: (atol, rtol))."""


class Trainer:
    """One rank's training run of ``plan`` with ``config`` (the plan's training settings) under ``options``."""

    def __init__(self, plan: Plan, config: TrainingConfig, options: RunOptions, env, transport, device: torch.device,
                 *, peak_flops: float | None, peak_memory: Callable[[], int]) -> None:
        self.plan, self.config, self.options = plan, config, options
        self.env, self.transport, self.device = env, transport, device
        self.peak_flops, self.peak_memory = peak_flops, peak_memory
        self.D = plan.mesh.dp
        self.pp_rank, self.dp_rank = plan.mesh.coords(env.rank)
        self.tp_rank = plan.mesh.tp_rank(env.rank)
        self.tp_mesh = transport.tp_mesh
        """This rank's tp group as a 1-D DeviceMesh (None at tp 1): what the sharded stages run on."""
        self.steps = options.num_steps(config)
        self.own = [s for s, r in enumerate(plan.placement) if r == self.pp_rank]
        self.modules = None
        self.optimizer = None
        self.layout = ShardLayout.of(plan.mesh, env.rank)
        self.sharding: ParamShards | None = None
        self.state_bytes: dict[str, int] | None = None
        """What this rank held after its optimizer step (params, grads, optimizer state), in bytes: measured at the
        first step of this run (the sizes stay the same in every later one)."""
        self.activation_bytes: int | None = None
        """The saved activations this rank held at its peak, measured by the executor in the first step of this run
        (runtime/saved.py; the sizes stay the same in every later one)."""
        self.host_load: dict[str, float] | None = None
        """The host's load when the plan was profiled and now, and how much longer a compute takes for it
        (:meth:`check_load`); None where it does not apply."""
        self.check_pending = options.check
        self.check_result: dict[str, Any] | None = None
        self.reference = None
        """--check's unpartitioned model, kept on rank 0 for --baseline (which times a step of it after the run)."""
        self.emulation = None
        """``--emulate``: what was measured at start-up (runtime/linkprobe.py ``Emulation``)."""
        if not options.emulate:
            from pipec.runtime.stages import build_stages

            from pipec.runtime.transport import TransportTP

            tp_group = TransportTP(transport, plan.mesh.tp_group(env.rank), self.tp_rank) if plan.mesh.tp > 1 else None
            self.modules = build_stages(plan, self.own, seed=config.seed, init=config.init, device=device,
                                        tp_rank=self.tp_rank, tp_group=tp_group)
            # sharded data parallelism (runtime/sharding.py): FSDP2 on the stages, or ZeRO-1's optimizer shards
            self.sharding, self.optimizer = shard_stages(self.layout, self.modules,
                                                         lambda params: make_optimizer(params, config), transport,
                                                         dtype=config.dtype)
            self.loss_fn = make_loss(config.loss, (plan.model or {}).get("search_path") or ())
            self.stage_loss = stage_loss(plan, config.loss, (plan.model or {}).get("search_path") or (),
                                         tp_group=tp_group, tp_rank=self.tp_rank)
            self.data = make_data(config, plan)
        emulate = None
        if options.emulate:
            emulate = options.unit_time if plan.unit_costs else 1.0  # seconds per unit, or costs in seconds
        self.executor = Executor(
            plan, pp_rank=self.pp_rank, dp_rank=self.dp_rank, tp_rank=self.tp_rank, transport=transport,
            modules=self.modules,
            loss_fn=None if options.emulate else self.stage_loss, emulate=emulate, device=device,
            autocast_dtype=None if self.mixed_precision else autocast_dtype(config.dtype),
            optimizer_step=self.optimizer_step, fail_hook=self.fail_hook if options.fail_at else None,
            sharding=self.sharding,
        )
        self.inputs = replica_inputs(plan)
        self.input_names = [i["name"] for i in self.inputs]
        # checkpoints, resume and goodput (runtime/checkpoint.py): every rank, at this point
        from pipec.runtime.checkpoint import for_run

        self.checkpointer, self.attempt_log = for_run(plan, config, options, env, self.modules, self.optimizer,
                                                      self.steps, shard_mesh=transport.shard_mesh,
                                                      tp_group=getattr(transport, "tp_group", None))
        self.first_step = 0

    @property
    def mixed_precision(self) -> bool:
        """FSDP2's mixed-precision policy runs the low-precision compute (not autocast)."""
        return self.sharding is not None and self.sharding.policy is not None

    # ------------------------------------------------------------------ hooks the executor calls

    def fail_hook(self, index: int, ins) -> None:
        """--fail-at STEP:RANK: kill this rank mid-step STEP, counted from 1 as the progress lines count (the first
        attempt only, so a restart can finish)."""
        step, rank = self.options.fail_at
        if self.step + 1 == step and self.env.rank == rank and self.env.attempt == 0 \
                and index == len(self.executor.instructions) // 2:
            print(f"pipec: injected failure: {self.plan.mesh.where(rank)} killed at "
                  f"step {step}, instruction {index} ({ins.text()})", file=sys.stderr, flush=True)
            os._exit(13)

    def optimizer_step(self) -> None:
        if self.optimizer is None:
            return
        self.sum_partial_grads()
        if self.check_pending:
            self.check_pending = False
            self.check_result = self.compare_with_reference()
        if self.config.grad_clip is not None:
            self.clip_grads(self.config.grad_clip)
        self.optimizer.step()
        if self.state_bytes is None:  # what is held does not change after the first step: measured once, not every OPT
            self.state_bytes = state_bytes((p for s in self.own for p in self.modules[s].parameters()), self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)

    def sum_partial_grads(self) -> None:
        """The replicated weights used on shards (:attr:`StageTP.partial_params`: a per-head norm's weight broadcast
        over the split heads; under sequence parallelism the norms and rowwise biases used on the sequence parts)
        have a partial gradient on each tp rank (its heads', its positions'); summed over the tp group here in one
        all-reduce per step, once the dp and tie reductions are in (sums: the order does not matter), before
        --check, the clip and the step."""
        grads = []
        for s in self.own:
            record = self.plan.stages[s].tp if self.plan.stages else None
            if record is None or not record.partial_params:
                continue
            params = self.modules[s].canonical_params()
            grads += [local(params[n].grad) for n in record.partial_params if params[n].grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.executor.wait_in_optimizer_step([self.transport.all_reduce(flat, self.plan.mesh.tp_group(self.env.rank))])
        torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads)])

    def clip_grads(self, max_norm: float) -> None:
        """Global norm over one replica's pp ranks (after the dp all-reduce), each tied weight counted once;
        with sharded gradients, over the shard group's shards too; with tp, over the tp ranks' parts (a weight
        replicated on them counted once)."""
        skip = {(s, pname) for tie in self.plan.ties for s, pname in list(zip(tie.stages, tie.params))[1:]}
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = []
        for s in self.own:
            canonical = getattr(self.modules[s], "canonical", {})
            for name, p in self.modules[s].named_parameters():
                if p.grad is None:
                    continue
                g = local(p.grad)  # a sharded gradient's shard
                grads.append(g)
                # a tied weight counts once (its first copy), a tp-replicated one on tp rank 0
                if (s, name) not in skip and (self.tp_rank == 0
                                               or self._tp_split(s, canonical.get(name, name)) is not None):
                    sq += g.detach().double().pow(2).sum()
        # each collective's wait is the executor's (timed as waiting: a rank waits here for its slowest peer)
        if self.sharding is not None:
            self.executor.wait_in_optimizer_step([self.transport.all_reduce(sq, self.layout.ranks)])
        if self.plan.mesh.tp > 1:
            self.executor.wait_in_optimizer_step([self.transport.all_reduce(sq, self.plan.mesh.tp_group(self.env.rank))])
        mesh = self.plan.mesh  # the group: this rank's pipeline, every pp rank of its dp rank and its tp rank
        group = tuple(mesh.global_rank(p, self.dp_rank, self.tp_rank) for p in range(mesh.pp))
        self.executor.wait_in_optimizer_step([self.transport.all_reduce(sq, group)])
        # the scale stays on the device (no host sync inside the step); 1 when the norm is within the bound
        norm = sq.sqrt()
        scale = torch.where(norm > max_norm, max_norm / (norm + 1e-6), torch.ones_like(norm))
        if grads:
            torch._foreach_mul_(grads, scale)

    # ------------------------------------------------------------------ --check

    def compare_with_reference(self) -> dict[str, Any]:
        """Loss and every gradient of this rank's stages against one unpartitioned step on the global batch."""
        from pipec.runtime.stages import build_reference

        ref = build_reference(self.plan, seed=self.config.seed, init=self.config.init)
        batches = [self.data(self.step, d, self.D) for d in range(self.D)]
        inputs = _cat([split_microbatches(b[0], 1, "data inputs", self.input_names)[0] for b in batches])
        targets = torch.cat([b[1] for b in batches])
        args = [inputs[n] for n in self.input_names]
        dtype = autocast_dtype(self.config.dtype)
        ctx = torch.autocast("cpu", dtype=dtype) if dtype else _Null()
        with ctx:
            out = ref(*args)
        out = out[0] if isinstance(out, tuple) and len(out) == 1 else out
        loss = self.loss_fn(out, targets)
        loss.backward()
        ref_grads = {n: p.grad for n, p in ref.canonical_params().items()}
        if self.options.baseline and self.env.rank == 0:
            self.reference = ref
        atol, rtol = CHECK_TOLERANCE[self.config.dtype]
        ref_values = {n: p.detach() for n, p in ref.canonical_params().items()}
        worst = torch.zeros(2, dtype=torch.float64)  # [max abs diff, max excess over tolerance]
        rows: list[dict[str, Any]] = []  # this rank's copy of each tensor: its gradient and its value

        def compare(name: str, of: str, got: torch.Tensor, want: torch.Tensor | None) -> float:
            want = torch.zeros_like(got) if want is None else want
            diff = (got.detach().cpu().double() - want.double()).abs().max().item() if got.numel() else 0.0
            allowed = atol + rtol * (want.double().abs().max().item() if got.numel() else 0.0)
            worst[1] = max(worst[1].item(), diff - allowed)
            rows.append({"name": name, "of": of, "tp_rank": self.tp_rank, "diff": diff, "tolerance": allowed})
            return diff

        for s in self.own:
            for name, p in self.modules[s].canonical_params().items():
                g = full(p.grad) if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype)  # shards gathered
                value = full(p.data)
                if (split := self._tp_split(s, name)) is not None:  # and the tp ranks' parts
                    g, value = self._gather_tp(g, split), self._gather_tp(value, split)
                worst[0] = max(worst[0].item(), compare(name, "gradient", g, ref_grads.get(name)))
                compare(name, "value", value, ref_values.get(name))  # every tp rank's replica, as initialised
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return {"reference_loss": loss.item(), "max_grad_diff": float(worst[0]), "grad_excess": float(worst[1]),
                "atol": atol, "rtol": rtol, "policy": self.precision_policy(), "worst": self._worst_tensors(rows)}

    def _worst_tensors(self, rows: list[dict[str, Any]], num: int = 5) -> list[dict[str, Any]]:
        """The ``num`` tensors furthest over their tolerance across all ranks (each (name, tp rank, gradient or
        value) once), the worst first."""
        everyone: list[list[dict[str, Any]]] = [[] for _ in range(self.env.world_size)]
        mine = sorted(rows, key=lambda r: r["diff"] - r["tolerance"], reverse=True)[:num]
        dist.all_gather_object(everyone, mine)
        best: dict[tuple, dict[str, Any]] = {}
        for r in (r for part in everyone for r in part):
            key = (r["name"], r["of"], r["tp_rank"])
            if key not in best or r["diff"] > best[key]["diff"]:
                best[key] = r
        return sorted(best.values(), key=lambda r: r["diff"] - r["tolerance"], reverse=True)[:num]

    def _tp_split(self, s: int, canonical: str):
        """How stage ``s`` splits parameter ``canonical`` across its tp ranks (None: replicated, or tp 1)."""
        record = self.plan.stages[s].tp if self.plan.stages else None
        return record.sharded(canonical) if record is not None else None

    def _gather_tp(self, part: torch.Tensor, split) -> torch.Tensor:
        """The whole tensor from each tp rank's ``part`` (every rank gets it: the parts summed into zeros)."""
        from pipec.tp.params import unshard

        parts = torch.zeros((self.plan.mesh.tp, *part.shape), dtype=part.dtype, device=part.device)
        parts[self.tp_rank] = part.detach()
        self.transport.all_reduce(parts, self.plan.mesh.tp_group(self.env.rank)).wait()
        return unshard(list(parts.unbind(0)), split)

    def precision_policy(self) -> str:
        """What ran the compute dtype: float32, autocast, or FSDP2's mixed-precision policy (its numerics differ
        from the reference's autocast, within the dtype's tolerance)."""
        if self.mixed_precision:
            return self.sharding.policy_text
        return "float32" if autocast_dtype(self.config.dtype) is None else f"autocast {self.config.dtype}"

    # ------------------------------------------------------------------ the loop

    def batch(self, step: int):
        inputs, targets = self.data(step, self.dp_rank, self.D)
        M = self.plan.num_microbatches
        return (split_microbatches(inputs, M, "data inputs", self.input_names),
                split_microbatches(targets, M, "data targets"))

    def train(self) -> int:
        rank0 = self.env.rank == 0
        per_step: list[list[RankStep]] = []
        tokens_per_step = self.tokens_per_step()
        console = None
        if rank0 and not self.options.quiet:
            from rich.console import Console

            console = Console(stderr=True)
            tp = f" x {self.plan.mesh.tp} tp" if self.plan.mesh.tp > 1 else ""
            tp += " (sequence parallel)" if self.plan.mesh.tp > 1 and self.plan.mesh.sequence_parallel else ""
            console.print(f"[bold]pipec run[/] {self.options.plan}: {self.plan.mesh.pp} pp x {self.plan.mesh.dp} dp{tp}, "
                          f"{self.plan.num_microbatches} microbatches, {self.steps} steps"
                          + (" (emulated)" if self.options.emulate else ""))
        exit_code = 0
        start = self.first_step = self.restore()
        if start >= self.steps:
            return 0
        self.emulation = self.measure_emulation() if self.options.emulate else None
        self.check_load()
        band = self.interval()
        for step in range(start, self.steps):
            self.step = step
            if self.optimizer is not None:
                lr = self.config.lr_at(step, self.steps)
                for g in self.optimizer.param_groups:
                    g["lr"] = lr
                mb_inputs, mb_targets = self.batch(step)
            else:
                mb_inputs = mb_targets = None
            # the compared step (and the reference inside its OPT): dropout off on both sides
            no_dropout = dropout_off() if self.check_pending else None
            with no_dropout if no_dropout is not None else contextlib.nullcontext():
                result = self.executor.run_step(mb_inputs, mb_targets)
            if no_dropout is not None and self.check_result is not None:
                self.check_result["dropout_off"] = no_dropout.dropped
            if self.device.type == "cuda":  # the allocator's peak; on CPU only the process's resident size is known
                result.peak_memory_bytes = self.peak_memory()
            else:
                result.resident_bytes = self.peak_memory()
            result.state_bytes = self.state_bytes
            if result.peak_activation_bytes is not None:
                self.activation_bytes = result.peak_activation_bytes
            result.peak_activation_bytes = self.activation_bytes
            gathered = [None] * self.env.world_size if rank0 else None
            dist.gather_object(result, gathered, dst=0)
            if rank0:
                per_step.append(gathered)
                if console is not None:
                    self.progress(console, step, gathered, tokens_per_step, band)
            if self.check_result is not None and step == 0:
                ok = self.finish_check(gathered if rank0 else None)
                if not ok:
                    exit_code = 3
                    break
            if self.checkpointer is not None:
                self.checkpointer.after_step(step + 1)
            self.attempt_log.step_done(step + 1)
        if self.checkpointer is not None:
            self.checkpointer.finish(self.steps, save=exit_code == 0)
        self.attempt_log.finished()
        if rank0:
            baseline = None
            if self.options.baseline and exit_code == 0:  # one device's step, after the timed ones
                from pipec.runtime.baseline import measure_baseline

                baseline = measure_baseline(self.plan, self.config, data=self.data, loss_fn=self.loss_fn,
                                            step=self.step, device=self.device, reference=self.reference,
                                            console=console)
            self.write_outputs(per_step, tokens_per_step, baseline)
        return exit_code

    def interval(self):
        """The plan's predicted interval, where a run can be held to it: a run of the plan's own costs (not
        ``--emulate``, which sleeps them)."""
        if self.options.emulate or self.plan.prediction is None:
            return None
        return self.plan.prediction.interval

    def check_load(self) -> None:
        """Before the first step: the host's load now, beside the load the plan was profiled at (every rank waits
        while rank 0 reads it, so the ranks' own start-up is not counted), for the warning the run's steps decide
        (:func:`~pipec.compiler.sim.history.load_warning`, :meth:`write_outputs`) and report.json's ``host_load``.
        Only a CPU run of a plan whose profile recorded its load."""
        from pipec.compiler.sim.contention import host_load, load_factor

        profile = (self.plan.model or {}).get("profile") or {}
        if self.options.emulate or self.device.type != "cpu" or profile.get("host_load") is None or \
                self.plan.prediction is None:
            return
        self.transport.barrier()
        if self.env.rank == 0:
            now = host_load()
            self.host_load = {"profile": float(profile["host_load"]), "run": now, "factor": load_factor(profile, now)}
        self.transport.barrier()

    def measure_emulation(self):
        """``--emulate``: the link latency, the executor's host overhead and the sleep's excess, measured on every
        rank before the first step (runtime/linkprobe.py), for the re-simulation report.json predicts with."""
        from pipec.runtime.linkprobe import measure_emulation

        probe = Executor(self.plan, pp_rank=self.pp_rank, dp_rank=self.dp_rank, tp_rank=self.tp_rank,
                         transport=self.transport,
                         emulate=self.executor.emulate, device=self.device)  # sleeping as the run sleeps
        costs = [st.cost for st in self.plan.stages]
        shortest = min((v for c in costs for v in (c.fwd, c.bwd, c.bwd_i, c.bwd_w) if v > 0), default=1.0)
        return measure_emulation(probe, dist.get_backend(), shortest * self.executor.emulate)

    def resimulated(self):
        """The plan's program simulated under what ``--emulate`` measured (None when it measured nothing): the
        median step of runs drawing each instruction's host time, each sleep's excess and each hop from the
        probe's samples (report.json's ``emulation.draws``)."""
        if self.emulation is None:
            return None
        from pipec.compiler.sim.simulate import BUFFERED, IN_ORDER, emulated_costs, simulate_draws

        e = self.emulation
        costs = emulated_costs(self.plan, seconds_per_unit=self.options.unit_time if self.plan.unit_costs else 1.0,
                               latency_s=e.latency_s, collective_s=e.collective_s, overhead=e.overhead,
                               oversleep_s=e.oversleep_s, jitter=e.samples)
        # the median of e.draws steps drawn from the probe's samples (one at the fixed figures without them)
        return simulate_draws(self.plan, costs, IN_ORDER if e.backend == "nccl" else BUFFERED)

    def restore(self) -> int:
        """The step to start at: 0, or that of the checkpoint resumed from (``--resume``, or after a restart)."""
        start = self.checkpointer.restore() if self.checkpointer is not None else 0
        if start >= self.steps:
            if self.options.resume and self.env.attempt == 0:
                raise TrainingError(f"the checkpoint resumed from is at step {start}, and this run has {self.steps} "
                                    f"steps: nothing to run; pass --steps N with N > {start}")
            if self.env.rank == 0:
                print(f"pipec: the checkpoint is at step {start}: all {self.steps} steps are done", file=sys.stderr)
            self.checkpointer.finish(start, save=False)
        elif start > 0 and self.check_pending:
            self.check_pending = False  # --check compares with the initial weights: only a fresh run can
            if self.env.rank == 0:
                print("pipec: warning: --check is skipped: the run resumed from a checkpoint", file=sys.stderr)
        self.attempt_log.started(start)
        return start

    def finish_check(self, gathered) -> bool:
        res = self.check_result
        atol, rtol = res["atol"], res["rtol"]
        ok = torch.tensor([1.0 if res["grad_excess"] <= 0 else 0.0])
        if gathered is not None:
            losses = [g.loss for g in gathered if g.loss is not None]
            loss = sum(losses) / len(losses)
            res["loss"] = loss
            res["loss_diff"] = abs(loss - res["reference_loss"])
            if res["loss_diff"] > atol + rtol * abs(res["reference_loss"]):
                ok[0] = 0.0
        dist.broadcast(ok, src=0)
        res["passed"] = bool(ok.item())
        if self.env.rank == 0:
            verdict = "passed" if res["passed"] else "FAILED"
            print(f"pipec: --check {verdict}: loss {res['loss']:.6f} vs reference {res['reference_loss']:.6f} "
                  f"(diff {res['loss_diff']:.2e}); max gradient diff {res['max_grad_diff']:.2e} "
                  f"(tolerance {atol:g} + {rtol:g} x max|reference| per tensor; {res['policy']}"
                  + ("; the model's dropout off for this step on both sides: its masks are random" if
                     res.get("dropout_off") else "") + ")" + _worst_text(res), file=sys.stderr, flush=True)
        return res["passed"]

    def tokens_per_step(self) -> int | None:
        ints = [i for i in self.inputs if str(i["dtype"]).startswith("int")]
        if not ints:
            return None
        return int(math.prod(ints[0]["shape"])) * self.D

    def progress(self, console, step: int, gathered, tokens_per_step, band=None) -> None:
        step_time = max(g.step_time for g in gathered)
        losses = [g.loss for g in gathered if g.loss is not None]
        busy = sum(g.compute for g in gathered)
        bubble = 1 - busy / (len(gathered) * step_time) if step_time else 0.0
        parts = [f"step {step + 1}/{self.steps}"]
        if losses:
            parts.append(f"loss {sum(losses) / len(losses):.4f}")
        parts.append(f"{step_time:.3f} s")
        if tokens_per_step:
            parts.append(f"{tokens_per_step / step_time:,.0f} tok/s")
        parts.append(f"bubble {bubble:.1%}")
        if band is not None:
            parts.append("in interval" if band.holds(step_time) else
                         "above interval" if step_time > band.step_time[1] else "below interval")
        console.print("  ".join(parts))

    def write_outputs(self, per_step, tokens_per_step, baseline=None) -> None:
        from pipec.runtime.accounting import build_report

        flops = (self.plan.model or {}).get("flops_per_step") if self.plan.model else None
        if flops is not None:
            flops *= self.D
        report = build_report(self.plan, self.options.plan, per_step, tokens_per_step=tokens_per_step,
                              flops_per_step=flops, peak_flops=self.peak_flops,
                              check=self._check_json(), first_step=self.first_step, host_load=self.host_load,
                              baseline=baseline,
                              predicted=self.resimulated(),
                              emulation=None if self.emulation is None else self.emulation.to_json(),
                              goodput=self.attempt_log.summary(
                                  **({"checkpoints": self.checkpointer.stats()} if self.checkpointer else {})))
        if "interval" in report:  # held to the plan's interval: kept for the next compile's (compiler/sim/history.py)
            from pipec.compiler.sim.history import load_warning, record

            steps = report["steps"]
            held = [s["step_time"] for s in (steps[1:] if len(steps) > 1 else steps)]
            record(self.plan, held, run_load=(self.host_load or {}).get("run"))
            warning = load_warning(held, tuple(report["interval"]["step_time"]), self.plan.prediction.step_time,
                                   self.host_load)
            if self.host_load is not None:
                report["host_load"]["warned"] = warning is not None
            if warning is not None:
                report["load_warning"] = warning
                print(f"pipec: warning: {warning}", file=sys.stderr, flush=True)
        if self.options.report:
            with open(self.options.report, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)
        if self.options.trace:
            from pipec.compiler.ir.timeline import Timeline
            from pipec.views.perfetto import write_perfetto

            write_perfetto(Timeline.from_json(report["measured"]), self.options.trace, kind="measured",
                           mesh=self.plan.mesh)
        self.summary(report)

    def _check_json(self):
        if self.check_result is None:
            return None
        r = self.check_result
        return {"passed": r.get("passed", False), "loss_diff": r.get("loss_diff"), "max_grad_diff": r["max_grad_diff"],
                "tolerance": {"atol": r["atol"], "rtol": r["rtol"]}, "policy": r["policy"],
                "dropout_off": bool(r.get("dropout_off")), "worst": r["worst"]}

    def state_table(self, held):
        """report.json's ``state_bytes`` as a table: what each rank held after its last step, beside the plan's."""
        from rich.table import Table

        mesh = self.plan.mesh
        shard = f"shard {mesh.shard}, {mesh.num_shards} shards" if mesh.sharded else "not sharded"
        t = Table(title=f"state held per rank after the last step ({shard})")
        coords = _coords_title(mesh)
        for name in ("rank", coords, "params", "grads", "optimizer", "measured", "predicted", "diff"):
            t.add_column(name, justify="left" if name in ("rank", coords) else "right")
        for r in held:
            pred = r.get("predicted")
            diff = f"{(r['measured'] - pred) / pred:+.1%}" if pred else "-"
            t.add_row(str(r["rank"]), _coords_text(mesh, r["rank"]), _mib(r["params"]), _mib(r["grads"]),
                      _mib(r["optimizer"]),
                      _mib(r["measured"]), _mib(pred) if pred is not None else "-", diff)
        return t

    def summary(self, report) -> None:
        from rich.console import Console
        from rich.table import Table

        from pipec.runtime.baseline import scaling_text

        meas, pred = report["measured"], report.get("predicted")
        t = Table(title=f"measured beside predicted (median step {report['median_step']})")
        t.add_column("rank")
        t.add_column(_coords_title(self.plan.mesh))
        t.add_column("compute", justify="right")
        t.add_column("comm wait", justify="right")
        t.add_column("idle", justify="right")
        t.add_column("bubble measured", justify="right")
        t.add_column("bubble predicted", justify="right")
        pred_by_pp = {r["rank"]: r for r in (pred or {}).get("per_rank", [])}
        for r in meas["per_rank"]:
            p = pred_by_pp.get(self.plan.mesh.coords(r["rank"])[0])
            t.add_row(str(r["rank"]), _coords_text(self.plan.mesh, r["rank"]), f"{r['compute']:.3f} s",
                      f"{r['comm_wait']:.3f} s", f"{r['idle']:.3f} s", f"{r['bubble_fraction']:.1%}",
                      f"{p['bubble_fraction']:.1%}" if p else "-")
        t.add_section()
        pb = report["bubble_fraction"].get("predicted")
        t.add_row("all", "", "", "", "", f"{report['bubble_fraction']['measured']:.1%}", f"{pb:.1%}" if pb is not None else "-")
        console = Console()
        console.print(t)
        if report.get("state_bytes"):
            console.print(self.state_table(report["state_bytes"]))
        if (line := activations_line(self.plan.mesh, report)) is not None:
            console.print(line)
        extra = [f"step {meas['step_time']:.3f} s"]
        if "tokens_per_s" in report:
            extra.append(f"{report['tokens_per_s']:,.0f} tokens/s")
        if "mfu" in report:
            extra.append(f"MFU {report['mfu']:.1%}")
        if (text := scaling_text(report)) is not None:
            extra.append(text)
        if report.get("stragglers"):
            extra.append("stragglers: " + ", ".join(f"rank {s['rank']} ({s['ratio']:.2f}x)" for s in report["stragglers"]))
        console.print("  ".join(extra))
        if (line := interval_line(report)) is not None:
            console.print(line)


def activations_line(mesh, report) -> str | None:
    """The saved activations each rank held at its peak (measured in the first step) beside its pp rank's
    prediction, in one line; None where none was measured (``--emulate``)."""
    from pipec.views.summary import format_bytes

    pred = {r["rank"]: r.get("peak_activation_bytes") for r in (report.get("predicted") or {}).get("per_rank", [])}
    parts = []
    for r in report["measured"]["per_rank"]:
        got = r.get("peak_activation_bytes")
        if got is None:
            continue
        want = pred.get(mesh.coords(r["rank"])[0])
        parts.append(f"rank {r['rank']} {format_bytes(got)}"
                     + (f" ({(got - want) / want:+.1%} of {format_bytes(want)})" if want else ""))
    return "saved activations at their peak (first step), beside the prediction: " + ", ".join(parts) if parts else None


def interval_line(report) -> str | None:
    """The run's steps against the plan's interval (report.json ``interval``), in one line; None without one."""
    got = report.get("interval")
    if got is None:
        return None
    lo, hi = got["step_time"]
    med = report["measured"]["step_time"]
    where = "inside" if got["median_inside"] else "above" if med > hi else "below"
    return (f"median step {med:.3f} s: {where} the predicted {got['coverage']:.0%} interval {lo:.3f}-{hi:.3f} s "
            f"(predicted {report['predicted']['step_time']:.3f} s); {got['steps_inside']} of {got['steps_counted']} "
            f"steps{' after the first' if got['after_first'] else ''} inside")


def _worst_text(res: dict[str, Any]) -> str:
    """A failing check's worst tensors, one line each (empty when it passed)."""
    over = [r for r in res.get("worst", ()) if r["diff"] > r["tolerance"]]
    if res.get("passed", True) or not over:
        return ""
    return "; the worst tensors:" + "".join(f"\n  {r['name']} ({r['of']}, tp rank {r['tp_rank']}): diff {r['diff']:.2e}, "
                                            f"tolerance {r['tolerance']:.2e}" for r in over)


def _coords_title(mesh) -> str:
    """A table's column of a rank's coordinates: ``pp, dp``, and ``pp, dp, tp`` with tp > 1."""
    return "pp, dp" if mesh.tp == 1 else "pp, dp, tp"


def _coords_text(mesh, rank: int) -> str:
    pp, dp = mesh.coords(rank)
    return f"{pp}, {dp}" if mesh.tp == 1 else f"{pp}, {dp}, {mesh.tp_rank(rank)}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _cat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None
