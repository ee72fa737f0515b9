"""torch.distributed.pipelining's side of bench/runtime.py: one torchrun worker per rank.

    torchrun --nproc-per-node 4 bench/torch_pipelining_worker.py --schedule 1f1b --steps 10 --out t.json

Builds the model (``--model shared``: bench/shared_gpt.py, untied, cut by its
own ``stage``; ``--model example``: ``pipec.examples.gpt:build``, whose LM
head's tied weight becomes a separate copy on the last stage, as torch has no
tied-weight sync), same seed on every rank, cuts it into ``ranks x chunks``
stages at the block boundaries pipec's plan uses (``--splits``, block indices:
a stage starts before each), wraps each of this rank's stages in a manual
``PipelineStage`` (loop placement: stage s on rank s mod P) and runs torch's
ScheduleGPipe, Schedule1F1B or ScheduleInterleaved1F1B with mean
cross-entropy, then an AdamW step (``--foreach``: the multi-tensor kernel,
pipec's default), every iteration. gloo on CPU; NCCL and ``cuda:LOCAL_RANK`` when
torch sees CUDA (as ``pipec run``).

Each step is timed as pipec's executor times one: a barrier, then the clock
runs until this rank's optimizer step is done; the step's time is the slowest
rank's. Rank 0 writes ``{"steps": [{"step", "step_time", "loss", "cpu",
"ranks"}]}`` to ``--out`` (``cpu``: each rank's process CPU seconds in the
step, every thread counted; ``ranks``: each rank's wall, compute, comm wait
and action count, from :class:`ActionClock`, what the host microseconds per
action are computed from; on CUDA compute is the host's time launching it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining import schedules as torch_schedules

from pipec.examples.gpt import build

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import shared_gpt  # noqa: E402

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


class GPTStage(shared_gpt.Stage):
    """Blocks ``lo:hi`` of the GPT, with the embeddings on the first stage and ln_f + head on the last."""

    def take_first(self, gpt: nn.Module) -> None:
        self.wte, self.wpe = gpt.wte, gpt.wpe

    def take_last(self, gpt: nn.Module) -> None:
        self.ln_f = gpt.ln_f
        self.lm_head = nn.Linear(gpt.lm_head.in_features, gpt.lm_head.out_features, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(gpt.wte.weight)  # the tied weight's own copy
        self.scale = gpt.scale

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x) * self.scale)


class ActionClock:
    """Where a step's time goes on this rank, measured as pipec's executor measures it: compute (each forward,
    backward and weight-grad action, the loss, the optimizer step), comm wait (each ``_wait_batch_p2p``), and the
    rest, the runtime's own host time; ``actions`` counts compute actions, p2p ops posted and the optimizer step
    (what pipec counts as instructions)."""

    def __init__(self) -> None:
        self.compute = self.wait = 0.0
        self.actions = 0

    def reset(self) -> None:
        self.compute = self.wait = 0.0
        self.actions = 0

    def timed(self, fn, field: str, count: int = 1):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - t)
                self.actions += count if field == "compute" else 0

        return run

    def install(self, stages, sched) -> None:
        for st in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                if hasattr(st, name):
                    setattr(st, name, self.timed(getattr(st, name), "compute"))
        sched._maybe_compute_loss = self.timed(sched._maybe_compute_loss, "compute", 0)
        torch_schedules._wait_batch_p2p = self.timed(torch_schedules._wait_batch_p2p, "wait", 0)
        post = torch_schedules._batch_p2p  # _sorted_batch_p2p posts through it too

        def counted(ops, *args, **kwargs):
            self.actions += len(ops)
            return post(ops, *args, **kwargs)

        torch_schedules._batch_p2p = counted


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
    p.add_argument("--model", choices=["example", "shared"], default="example",
                   help="example: pipec.examples.gpt (tied head, copied); shared: bench/shared_gpt.py (untied)")
    p.add_argument("--foreach", action="store_true", help="AdamW(foreach=True), pipec's default kernel")
    p.add_argument("--out")
    args = p.parse_args()
    cfg = {k: int(v) for k, v in (kv.split("=") for kv in args.model_args.split(","))}

    cuda = torch.cuda.is_available()  # as pipec run: NCCL and cuda:LOCAL_RANK when torch sees CUDA, else gloo
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    gpt = build(**cfg) if args.model == "example" else shared_gpt.build(**cfg)
    bounds = [0] + [int(s) for s in args.splits.split(",")] + [cfg["layers"]]
    num_stages = len(bounds) - 1
    if num_stages != world * args.chunks:
        raise SystemExit(f"{num_stages} stages from --splits, but {world} ranks x {args.chunks} chunks")
    stages, params = [], []
    for s in range(rank, num_stages, world):  # loop placement, as pipec's
        cut = GPTStage if args.model == "example" else shared_gpt.stage
        mod = cut(gpt, bounds[s], bounds[s + 1], first=s == 0, last=s == num_stages - 1).to(device)
        params += list(mod.parameters())
        stages.append(PipelineStage(mod, s, num_stages, device))
    del gpt
    cls = SCHEDULES[args.schedule]
    sched = cls(stages if args.chunks > 1 else stages[0], n_microbatches=args.microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(params, lr=args.lr, **({"foreach": True} if args.foreach else {}))
    clock = ActionClock()
    clock.install(stages, sched)
    has_first = any(st.is_first for st in stages)
    has_last = any(st.is_last for st in stages)

    rows = []
    for step in range(args.steps):
        x, y = (t.to(device) for t in batch(step, size=args.batch, seq=cfg["seq"], vocab=cfg["vocab"], seed=args.seed))
        losses: list[torch.Tensor] = []
        dist.barrier()
        clock.reset()
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
        t_opt = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:  # the step ends when the GPU is done, as pipec's CUDA clock resolves it
            torch.cuda.synchronize(device)
        clock.compute += time.perf_counter() - t_opt
        clock.actions += 1
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        f64 = {"dtype": torch.float64, "device": device}  # NCCL reduces device tensors
        mine = torch.tensor([cpu, wall, clock.compute, clock.wait, clock.actions], **f64)
        every = [torch.zeros(5, **f64) for _ in range(world)]
        dist.all_gather(every, mine)
        every = [h.cpu() for h in every]
        cpus, host = [h[0] for h in every], [h[1:] for h in every]
        dt = torch.tensor([wall, float(torch.stack(losses).detach().mean()) if losses else float("-inf")], **f64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        dt = dt.cpu()
        rows.append({"step": step, "step_time": float(dt[0]), "loss": float(dt[1]), "cpu": [float(c) for c in cpus],
                     "ranks": [dict(zip(("wall", "compute", "wait", "actions"), map(float, h))) for h in host]})
    if rank == 0 and args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"schedule": args.schedule, "ranks": world, "virtual": args.chunks, "splits": args.splits,
                       "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
                       "steps": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
