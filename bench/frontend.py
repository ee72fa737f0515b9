"""Front-end benchmark: trace + partition + predict GPT-125M, 1.3B and 13B on the meta device.

Each configuration runs in a fresh process (so peak RSS is its own) and is
compiled by the driver as ``pipec compile`` does: build the example GPT on
meta, trace, propagate shapes/FLOPs/saved bytes, balance into 8 stages by
FLOPs, split with torch.fx, cost by FLOPs, then lower 1F1B, verify and
simulate, which predicts each pp rank's peak memory (the one memory model,
:mod:`pipec.compiler.passes.memory`). Prints seconds (import of torch and pipec
apart) and peak RSS, and checks that the 13B plan's state at pp=8 is 16 bytes
per held parameter copy (goal: 13B in <= 10 s and <= 2 GB RSS).

    .venv/bin/python bench/frontend.py            # all three
    .venv/bin/python bench/frontend.py 13b        # one
"""

from __future__ import annotations

import io
import json
import resource
import subprocess
import sys
import time

CONFIGS = {
    "125m": dict(layers=12, dim=768, heads=12, vocab=50304, seq=2048),
    "1.3b": dict(layers=24, dim=2048, heads=16, vocab=50304, seq=2048),
    "13b": dict(layers=40, dim=5120, heads=40, vocab=50304, seq=2048),
}
PP = 8
MICROBATCHES = 8
BATCH = 8  # one dp replica's batch: 8 x 2048 tokens, microbatch 1 x 2048


def one(name: str) -> dict:
    t0 = time.perf_counter()
    import torch  # noqa: F401

    from pipec.compiler.driver import compile_request
    from pipec.compiler.passes.memory import state_bytes
    from pipec.compiler.config import TrainingConfig
    from pipec.compiler.ir.plan import Mesh
    from pipec.compiler.request import CompileRequest, ModelSpec, Partition, TensorSpec
    from pipec.views.stage_table import stage_table

    t1 = time.perf_counter()
    cfg = CONFIGS[name]
    model = ModelSpec(target="pipec.examples.gpt:build", kwargs=cfg,
                      inputs=(TensorSpec("tokens", "int64", (BATCH, cfg["seq"])),),
                      partition=Partition("balanced", "flops"), costs="flops", trace="auto")
    plan = compile_request(CompileRequest(schedule="1f1b", mesh=Mesh(pp=PP), num_microbatches=MICROBATCHES, model=model,
                                          training=TrainingConfig(peak_flops=989e12))).plan
    t2 = time.perf_counter()
    held = sum(st.num_params for st in plan.stages)
    total = sum(p.numel() for p in _meta_params(cfg))
    tied = sum(t.num_bytes // 4 * (len(t.stages) - 1) for t in plan.ties)
    state = sum(state_bytes(plan))
    return {
        "config": name, "params": total, "held_param_copies": held, "import_s": t1 - t0, "frontend_s": t2 - t1,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "state_bytes": state, "state_ok": state == 16 * held and held == total + tied,
        "max_stage_fwd_s": max(st.cost.fwd for st in plan.stages), "table": _text(stage_table(plan)),
    }


def _text(table) -> str:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=120)
    console.print(table)
    return console.file.getvalue()


def _meta_params(cfg: dict):
    import torch

    from pipec.examples.gpt import build

    with torch.device("meta"):
        return list(build(**cfg).parameters())


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(one(sys.argv[2])))
        return
    names = sys.argv[1:] or list(CONFIGS)
    print(f"{'config':>6} {'params':>8} {'import s':>9} {'compile s':>11} {'total s':>8} {'peak RSS':>9}  16 B/param copy")
    for name in names:
        t = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:>6} {r['params'] / 1e9:>7.2f}B {r['import_s']:>9.2f} {r['frontend_s']:>11.2f} {wall:>8.2f} "
              f"{r['peak_rss_mb']:>7.0f}MB  {'ok' if r['state_ok'] else 'WRONG'} "
              f"({r['state_bytes'] / 1e9:.1f} GB for {r['held_param_copies'] / 1e9:.2f}B held copies)")
        if name == "13b":
            print(r["table"])


if __name__ == "__main__":
    main()
