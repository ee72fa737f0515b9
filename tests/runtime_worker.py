"""A torchrun worker for the runtime tests: several runs in one process group, one launch for them all.

    torchrun --standalone --nproc-per-node N tests/runtime_worker.py JOBS.json OUT.json

JOBS.json lists runs, each ``{"plan": PATH, "flags": [FLAG...], "reference": BOOL}`` (every plan's pp x dp
must equal N). Each is what ``python -m pipec.runtime PATH FLAGS --quiet`` runs on a rank: its plan read and
proven, its mesh's process groups, the Trainer (checkpoints, --resume, --check, --emulate and report.json as
a run has them), one run after another in this process group. For each, rank 0 records its exit code, its
report.json, what every rank printed to stderr meanwhile, whether every tied weight's copies are identical
on every rank, and, with ``reference``, the losses of the unpartitioned model trained as many steps on the
same data in this process. A job ``{"function": "module:name"}`` instead calls that function on every rank
(the world process group up); its record holds what each rank returned. OUT.json: the records, in the order
of the jobs (tests/launches.py reads them).

A run that reads another run's checkpoint must come from another launch: one process that trained and then
"resumed" keeps what it had in memory (its random streams, say), which a resume from disk must restore.

Also the data functions of the tests of errors on some ranks only, and of resharded checkpoints.
"""

from __future__ import annotations

import gc
import importlib
import io
import json
import os
import sys
from contextlib import redirect_stderr

import torch
import torch.distributed as dist

from pipec.compiler.config import TrainingConfig
from pipec.compiler.ir.plan_json import read_plan
from pipec.compiler.passes.verify import verify
from pipec.runtime.launch import Env, RunOptions, init_process_group, plan_transport, run_parser
from pipec.runtime.sharding import local
from pipec.runtime.stages import build_reference
from pipec.runtime.trainer import Trainer
from pipec.runtime.training import make_data, make_loss, make_optimizer, replica_inputs, split_microbatches


def uneven_batches(step: int, dp_rank: int, dp_size: int):
    """A data function whose batch on dp rank 1 has 6 rows where the plan expects 8; dp rank 0's is right."""
    return _tokens(6 if dp_rank == 1 else 8)


def short_batches(step: int, dp_rank: int, dp_size: int):
    """A data function whose batch has 6 rows where the plan expects 8, on every rank."""
    return _tokens(6)


def same_batches(step: int, dp_rank: int, dp_size: int):
    """Every replica gets the same batch (8 rows of 8 tokens, vocab 32, from the step): training is then the
    same under any dp, so a checkpoint resharded to another dp continues as the run that wrote it."""
    g = torch.Generator().manual_seed(step)
    x = (torch.randint(0, 32, (8, 1), generator=g) + torch.arange(8)) % 32
    return x, (x + 1) % 32


def _tokens(rows: int):
    x = torch.arange(rows * 8).reshape(rows, 8) % 32
    return x, (x + 1) % 32


def reference_losses(plan, steps: int) -> list[float]:
    """Single-process training on the global batch (every replica's data), same init, optimizer and lr."""
    config = TrainingConfig.from_spec(plan.spec)
    ref = build_reference(plan, seed=config.seed, init=config.init)
    opt = make_optimizer(ref.parameters(), config)
    loss_fn, data = make_loss(config.loss), make_data(config, plan)
    names = [i["name"] for i in replica_inputs(plan)]
    D = plan.mesh.dp
    out = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = config.lr_at(step, steps)
        batches = [data(step, d, D) for d in range(D)]
        inputs = [split_microbatches(b[0], 1, "inputs", names)[0] for b in batches]
        x = [torch.cat([i[n] for i in inputs]) for n in names]
        y = torch.cat([b[1] for b in batches])
        res = ref(*x)
        loss = loss_fn(res[0] if isinstance(res, tuple) else res, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss))
    return out


def tied_copies_equal(plan, trainer) -> bool:
    """Every tied weight's copies (on whichever ranks hold them) are bit-identical after training; sharded,
    the copies of each dp rank's shard are, and of each tp rank's part (a vocab-parallel embedding tied to a
    loss-parallel head)."""
    mine = {}
    shard = (trainer.dp_rank if trainer.sharding is not None else 0, trainer.tp_rank)
    for tie in plan.ties:
        for s, pname in zip(tie.stages, tie.params):
            if s in trainer.own:
                p = dict(trainer.modules[s].named_parameters())[pname]
                mine[(tie.name, shard, s)] = local(p).detach().clone()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    by_tie: dict[tuple[str, int], list[torch.Tensor]] = {}
    for part in everyone:
        for (name, shard, _s), t in part.items():
            by_tie.setdefault((name, shard), []).append(t)
    return all(all(torch.equal(ts[0], t) for t in ts[1:]) for ts in by_tie.values())


class _Tee(io.TextIOBase):
    """stderr kept for the record and still shown (a hung run's last words reach the test)."""

    def __init__(self, stream) -> None:
        self.stream, self.kept = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def run_job(job: dict, index: int, out_path: str, env: Env, backend: str, device) -> dict | None:
    """One run of the job's plan on every rank; rank 0's record of it (None on the other ranks)."""
    path = job["plan"]
    plan = read_plan(path)
    verify(plan)  # as a run does: a plan that fails its proofs is never launched
    report = f"{out_path}.{index}.report.json"
    options = RunOptions.from_args(run_parser().parse_args(
        [path, "--quiet", "--timeout", "120", "--report", report, *job.get("flags", [])]))
    err = _Tee(sys.stderr)
    with redirect_stderr(err):
        transport = plan_transport(plan, env, options.timeout, backend, device)
        trainer = Trainer(plan, TrainingConfig.from_spec(plan.spec), options, env, transport, device,
                          peak_flops=None, peak_memory=lambda: 0)
        rc = trainer.train()
    ties_ok = tied_copies_equal(plan, trainer) if trainer.modules is not None else None  # --emulate: no weights
    said = [None] * env.world_size
    dist.all_gather_object(said, err.kept.getvalue())
    record = None
    if env.rank == 0:
        with open(report, encoding="utf-8") as f:
            rep = json.load(f)
        record = {
            "plan": path, "rc": rc, "report": rep, "stderr": "".join(said), "check": rep.get("check"),
            "losses": [s.get("loss") for s in rep["steps"]], "bubble": rep["bubble_fraction"],
            "state_bytes": rep.get("state_bytes"), "ties": len(plan.ties), "ties_equal": ties_ok,
            "reference_losses": reference_losses(plan, trainer.steps) if job.get("reference") else None,
        }
    # the trainer's groups (and their gloo threads) go before the next run makes its own, as a run's exit frees them
    del trainer, transport
    gc.collect()
    dist.barrier()
    return record


def call_job(job: dict, env: Env) -> dict | None:
    """The job's function on every rank; rank 0's record of what each returned."""
    module, name = job["function"].split(":")
    returned = getattr(importlib.import_module(module), name)()
    everyone = [None] * env.world_size
    dist.all_gather_object(everyone, returned)
    return {"function": job["function"], "returned": everyone} if env.rank == 0 else None


def main() -> None:
    jobs_path, out_path = sys.argv[1], sys.argv[2]
    with open(jobs_path, encoding="utf-8") as f:
        jobs = json.load(f)
    env = Env(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)), 0)
    backend, device = init_process_group(env, timeout=120)
    records = []
    for i, job in enumerate(jobs):
        try:
            records.append(call_job(job, env) if "function" in job else run_job(job, i, out_path, env, backend, device))
        except BaseException:
            print(f"runtime_worker: job {i} failed on rank {env.rank}: {json.dumps(job)}", file=sys.stderr, flush=True)
            raise
    if env.rank == 0:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(records, f, indent=1)
    dist.destroy_process_group()
    # Every record is written: leave without the interpreter's teardown of what the runs left (seconds per
    # launch, growing with the runs); a run's own exit is that of pipec run, which other tests launch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
