"""The resolved value of every key of a plan, as a schedule file would set it (``pipec show``).

A plan holds every key's value: the mesh, the stages and placement, the
model record, the links, and ``spec`` for the rest. :func:`key_lines` writes
them back in the language's syntax, a few short keys to a line, so the user
sees what each default resolved to (``virtual 2``, ``costs profile``, ``init
module``, the links measured) without opening plan.json. :data:`KEY_ORDER`
lists every key of the language's table (a test holds them equal).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

__all__ = ["KEY_ORDER", "key_values", "key_lines"]

KEY_ORDER: tuple[tuple[str, ...], ...] = (
    ("schedule", "pp", "dp", "tp", "shard", "shard_size", "devices_per_node"),
    ("tensor_parallel", "sequence_parallel"),
    ("virtual", "stages", "microbatches", "placement"),
    ("policy",), ("order",),
    ("model",), ("model_args",), ("input",), ("targets",),
    ("partition", "trace", "init"),
    ("costs", "peak_flops", "device_memory"),
    ("links",),
    ("steps", "seed", "lr", "grad_clip", "dtype"),
    ("optimizer",), ("lr_schedule",), ("recompute",),
    ("data",), ("loss",), ("checkpoint_dir", "checkpoint_every"),
)
"""Every key, grouped as they are printed (a group's keys share a line while it fits)."""


def _number(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:g}"
    return "none" if x is None else str(x)


def _call(name: str, settings: Mapping[str, Any]) -> str:
    """``adamw(betas=(0.9, 0.999), eps=1e-08)``."""
    def value(v: Any) -> str:
        if isinstance(v, (list, tuple)):
            return "(" + ", ".join(value(x) for x in v) + ")"
        if isinstance(v, str):
            return v
        return _number(v)

    args = ", ".join(f"{k}={value(v)}" for k, v in settings.items() if k != "name")
    return f"{name}({args})" if args else name


def _tensors(tensors: Sequence[Mapping[str, Any]] | None) -> str:
    if not tensors:
        return "none"
    return ", ".join(f"{t['name']}: {t['dtype']}[{', '.join(map(str, t['shape']))}]" for t in tensors)


def _bytes(n: int | None) -> str:
    if n is None:
        return "none"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _placement(plan) -> str:
    p, placement = plan.mesh.pp, list(plan.placement)
    if placement == [s % p for s in range(len(placement))]:
        return "loop"
    if len(placement) == 2 * p and placement == [s if s < p else 2 * p - 1 - s for s in range(2 * p)]:
        return "v"
    return ", ".join(map(str, placement))


def _partition(part: Mapping[str, Any] | None) -> str:
    if not part:
        return "none"
    method = part.get("method")
    if method == "split":
        return "split before " + ", ".join(part.get("split_before") or ())
    if method == "balanced":
        return f"balanced(by={part.get('by', 'flops')})"
    return str(method)


def _links(plan) -> str:
    return ", ".join(f"{axis}(latency={link.latency_s * 1e6:.4g}us, bandwidth={link.bandwidth_Bps / 1e9:.4g}GB/s)"
                     + (" measured" if link.measured else "") for axis, link in plan.links.items())


def _model(plan) -> str:
    return "none (a schedule-only plan)" if plan.model is None else json.dumps(str(plan.model["target"]))


def _recompute(stages: Sequence[int] | None) -> str:
    return "stages " + ", ".join(map(str, stages)) if stages else "none"


def _data(data: Any) -> str:
    if isinstance(data, Mapping) and data.get("kind") == "tokens":
        return f'tokens({json.dumps(data["path"])}, dtype={data["dtype"]})'
    return str(data)


def _order(order: Mapping[str, Any] | None) -> str:
    if not order:
        return "none"
    return "; ".join(f"rank {r}: {actions}" for r, actions in enumerate(order.get("ranks", ())))


def _tensor_parallel(value: Any) -> str:
    """``auto``, or ``"blocks.*.qkv": colwise, ...`` (plan.json: a list of ``{"module", "style"}``)."""
    if isinstance(value, str):
        return value
    return ", ".join(f'{json.dumps(e["module"])}: {e["style"]}' for e in value)


def _policy(policy: Mapping[str, Any] | None) -> str:
    return "none" if not policy else _call("", policy)


_VALUES: dict[str, Callable[[Any, Mapping[str, Any]], str]] = {
    "schedule": lambda p, s: str(s.get("schedule")),
    "pp": lambda p, s: str(p.mesh.pp),
    "dp": lambda p, s: str(p.mesh.dp),
    "tp": lambda p, s: str(p.mesh.tp),
    "tensor_parallel": lambda p, s: _tensor_parallel(s.get("tensor_parallel", "auto")),
    "sequence_parallel": lambda p, s: "on" if p.mesh.sequence_parallel else "off",
    "shard": lambda p, s: str(p.mesh.shard),
    "shard_size": lambda p, s: str(p.mesh.shard_size) if p.mesh.shard_size else "dp",
    "devices_per_node": lambda p, s: _number(p.mesh.devices_per_node),
    "virtual": lambda p, s: str(p.num_stages // max(1, p.mesh.pp)),
    "stages": lambda p, s: str(p.num_stages),
    "microbatches": lambda p, s: str(p.num_microbatches),
    "placement": lambda p, s: _placement(p),
    "policy": lambda p, s: _policy(s.get("policy")),
    "order": lambda p, s: _order(s.get("order")),
    "model": lambda p, s: _model(p),
    "model_args": lambda p, s: ", ".join(f"{k}={v}" for k, v in (p.model or {}).get("kwargs", {}).items()) or "none",
    "input": lambda p, s: _tensors(s.get("input")),
    "targets": lambda p, s: _tensors(s.get("targets")),
    "partition": lambda p, s: _partition(s.get("partition")),
    "trace": lambda p, s: str(s.get("trace", "auto")) + (f" (traced with {p.model['trace']})"
                                                          if p.model and s.get("trace") == "auto" else ""),
    "init": lambda p, s: str((p.model or {}).get("init") or s.get("init")),
    "costs": lambda p, s: str(s.get("costs")),
    "peak_flops": lambda p, s: _number(s.get("peak_flops")),
    "device_memory": lambda p, s: _bytes(s.get("device_memory")),
    "links": lambda p, s: _links(p),
    "steps": lambda p, s: _number(s.get("steps")),
    "seed": lambda p, s: _number(s.get("seed")),
    "lr": lambda p, s: _number(s.get("lr")),
    "grad_clip": lambda p, s: _number(s.get("grad_clip")),
    "dtype": lambda p, s: str(s.get("dtype")),
    "optimizer": lambda p, s: _call(s["optimizer"]["name"], s["optimizer"]) if s.get("optimizer") else "adamw",
    "lr_schedule": lambda p, s: _call(s["lr_schedule"]["name"], s["lr_schedule"]) if s.get("lr_schedule")
    else "constant",
    "recompute": lambda p, s: _recompute(s.get("recompute")),
    "data": lambda p, s: _data(s.get("data", "synthetic")),
    "loss": lambda p, s: str(s.get("loss", "cross_entropy")),
    "checkpoint_dir": lambda p, s: json.dumps(s["checkpoint_dir"]) if s.get("checkpoint_dir") else "none",
    "checkpoint_every": lambda p, s: _number(s.get("checkpoint_every", 0)),
}


def key_values(plan) -> dict[str, str]:
    """Every key's resolved value in the language's syntax, in :data:`KEY_ORDER`."""
    spec = plan.spec or {}
    return {key: _VALUES[key](plan, spec) for group in KEY_ORDER for key in group}


def key_lines(plan, width: int = 80) -> list[str]:
    """The keys as schedule-file lines of at most ``width`` columns (a group's keys share a line while they
    fit; a longer value goes on at its commas, indented)."""
    values = key_values(plan)
    out: list[str] = []
    for group in KEY_ORDER:
        line = ""
        for key in group:
            part = f"{key} {values[key]}"
            if line and len(line) + 2 + len(part) > width:
                out.append(line)
                line = ""
            line = f"{line}  {part}" if line else part
        out.extend(_wrapped(line, width))
    return out


def _wrapped(line: str, width: int, indent: str = "    ") -> list[str]:
    """``line`` broken after its commas so that each piece fits ``width`` (a piece without one stays long)."""
    out: list[str] = []
    while len(line) > width:
        cut = line.rfind(", ", 0, width - 1)
        if cut <= len(indent):
            break
        out.append(line[:cut + 1])
        line = indent + line[cut + 2:]
    return [*out, line]
