"""A torchrun worker for the runtime tests: several plans in one process group.

    torchrun --standalone --nproc-per-node N tests/runtime_worker.py OUT.json STEPS PLAN...

For each plan (whose pp x dp must equal N): run STEPS training steps with
``--check`` through the real launcher pieces and Trainer; then, on rank 0,
train the unpartitioned reference for the same steps on the same data and
record both loss curves; and check that every tied weight's copies are
identical on every rank. Rank 0 writes one JSON record per plan to OUT.json.

Also the data functions of the tests of errors on some ranks only, and of resharded checkpoints.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from pipec.compiler.ir.plan_json import read_plan
from pipec.runtime.stages import build_reference
from pipec.compiler.passes.verify import verify
from pipec.compiler.config import TrainingConfig
from pipec.runtime.launch import Env, RunOptions, init_process_group, plan_transport, run_parser
from pipec.runtime.sharding import local
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
    the copies of each dp rank's shard are."""
    mine = {}
    shard = trainer.dp_rank if trainer.sharding is not None else 0
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


def main() -> None:
    out_path, steps, plans = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    env = Env(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)), 0)
    backend, device = init_process_group(env, timeout=120)
    records = []
    for path in plans:
        plan = read_plan(path)
        verify(plan)
        report = os.path.join(tempfile.gettempdir(), f"pipec-test-{os.getpid()}-{len(records)}.json")
        report = [report]
        dist.broadcast_object_list(report, src=0)
        options = RunOptions.from_args(run_parser().parse_args(
            [path, "--steps", str(steps), "--check", "--quiet", "--report", report[0], "--timeout", "120"]))
        transport = plan_transport(plan, env, 120, backend, device)
        trainer = Trainer(plan, TrainingConfig.from_spec(plan.spec), options, env, transport, device, peak_flops=None,
                          peak_memory=lambda: 0)
        rc = trainer.train()
        ties_ok = tied_copies_equal(plan, trainer)
        if env.rank == 0:
            with open(report[0], encoding="utf-8") as f:
                rep = json.load(f)
            records.append({
                "plan": path, "rc": rc, "check": rep.get("check"), "losses": [s["loss"] for s in rep["steps"]],
                "reference_losses": reference_losses(plan, steps), "ties": len(plan.ties), "ties_equal": ties_ok,
                "bubble": rep["bubble_fraction"], "state_bytes": rep.get("state_bytes"),
            })
        dist.barrier()
    if env.rank == 0:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(records, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
