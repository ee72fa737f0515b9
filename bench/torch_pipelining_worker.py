"""torch.distributed.pipelining's side of bench/runtime.py: one torchrun worker per rank.

    torchrun --nproc-per-node 4 bench/torch_pipelining_worker.py --schedule 1f1b --steps 10 --out t.json

Builds the example GPT (``pipec.examples.gpt:build``, same seed on every
rank), cuts it into ``ranks x chunks`` stages at the same block boundaries
pipec's plan uses (``--splits``, block indices: a stage starts before each),
wraps each of this rank's stages in a manual ``PipelineStage`` (loop
placement: stage s on rank s mod P) and runs torch's ScheduleGPipe,
Schedule1F1B or ScheduleInterleaved1F1B with mean cross-entropy, then an
AdamW step, every iteration. The LM head's weight, tied to ``wte`` in the
model, is a separate copy on the last stage (torch has no tied-weight sync;
pipec all-reduces the tie, so it does a little more work).

Each step is timed as pipec's executor times one: a barrier, then the clock
runs until this rank's optimizer step is done; the step's time is the slowest
rank's. Rank 0 writes ``{"steps": [{"step", "step_time", "loss", "cpu"}]}`` to ``--out``
(``cpu``: each rank's process CPU seconds in the step, every thread counted).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from pipec.examples.gpt import build

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


class GPTStage(nn.Module):
    """Blocks ``lo:hi`` of the GPT, with the embeddings on the first stage and ln_f + head on the last."""

    def __init__(self, gpt: nn.Module, lo: int, hi: int, *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        if last:
            self.ln_f = gpt.ln_f
            self.lm_head = nn.Linear(gpt.lm_head.in_features, gpt.lm_head.out_features, bias=False)
            with torch.no_grad():
                self.lm_head.weight.copy_(gpt.wte.weight)  # the tied weight's own copy
            self.scale = gpt.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.wte(x) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x) * self.scale)
        return x


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def batch(step: int, *, size: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token sequences ``(start + t) mod vocab`` from random starts (the task pipec's synthetic data poses)."""
    g = torch.Generator().manual_seed(seed * 1000003 + step)
    tokens = (torch.randint(0, vocab, (size, 1), generator=g) + torch.arange(seq)) % vocab
    return tokens, (tokens + 1) % vocab


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", choices=sorted(SCHEDULES), required=True)
    p.add_argument("--chunks", type=int, default=1, help="stages per rank (interleaved_1f1b: 2)")
    p.add_argument("--splits", required=True, help="block indices a stage starts before, e.g. 2,4,6")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--model-args", default="layers=8,dim=256,heads=4,vocab=1000,seq=128")
    p.add_argument("--out")
    args = p.parse_args()
    cfg = {k: int(v) for k, v in (kv.split("=") for kv in args.model_args.split(","))}

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    gpt = build(**cfg)
    bounds = [0] + [int(s) for s in args.splits.split(",")] + [cfg["layers"]]
    num_stages = len(bounds) - 1
    if num_stages != world * args.chunks:
        raise SystemExit(f"{num_stages} stages from --splits, but {world} ranks x {args.chunks} chunks")
    device = torch.device("cpu")
    stages, params = [], []
    for s in range(rank, num_stages, world):  # loop placement, as pipec's
        mod = GPTStage(gpt, bounds[s], bounds[s + 1], first=s == 0, last=s == num_stages - 1)
        params += list(mod.parameters())
        stages.append(PipelineStage(mod, s, num_stages, device))
    del gpt
    cls = SCHEDULES[args.schedule]
    sched = cls(stages if args.chunks > 1 else stages[0], n_microbatches=args.microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(params, lr=args.lr)
    has_first = any(st.is_first for st in stages)
    has_last = any(st.is_last for st in stages)

    rows = []
    for step in range(args.steps):
        x, y = batch(step, size=args.batch, seq=cfg["seq"], vocab=cfg["vocab"], seed=args.seed)
        losses: list[torch.Tensor] = []
        dist.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        if has_first and has_last:
            sched.step(x, target=y, losses=losses)
        elif has_first:
            sched.step(x)
        elif has_last:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        cpus = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(cpus, torch.tensor([cpu], dtype=torch.float64))
        dt = torch.tensor([wall,
                           float(torch.stack(losses).detach().mean()) if losses else float("-inf")], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        rows.append({"step": step, "step_time": float(dt[0]), "loss": float(dt[1]), "cpu": [float(c) for c in cpus]})
    if rank == 0 and args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"schedule": args.schedule, "ranks": world, "virtual": args.chunks, "splits": args.splits,
                       "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
                       "steps": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
