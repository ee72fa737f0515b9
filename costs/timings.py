"""The timings a cut needs: read from the profile cache, or measured (:mod:`.profile`) and kept there.

What decides each timing is its key (:mod:`pipec.costs.cache`); every key holds the host's fields
(:func:`_host_key`: threads per rank, the cores this process may use, the CPU count and model, torch's
version, :data:`~.profile.PROFILE_METHOD`):

- ``stage``, a stage timed alone: the stage's own graph wherever it sits (:func:`stage_digest`: its nodes,
  the modules it calls with their source where the model defines them, its parameters, inputs and outputs)
  and the microbatch's dtype. The same stage in another cut is the same entry, and so is a stage of other
  layers alike (a transformer's middle stages: one is timed, in a compile or across compiles); recompute is
  not in it (a recomputed stage's cost is derived from its timing, nothing is timed).
- ``crowd``, the slowdown of the run's ranks here computing at once: the model's fingerprint, the
  microbatch's inputs (names, shapes, dtypes), the dtype and the ranks sharing the host. It has no cut in
  it: it is measured once per microbatch shape and shared by every cut of it. ``pipec tune`` measures one
  crowd per search, at one shape, and keeps it under every other shape it prices whose key holds none, with
  ``measured_at`` (that shape's inputs and when): a compile of the tuned file reads it as tune priced it.
- ``host``, the host's reference time (:func:`~.profile._reference`) every timing is scaled to: kept from
  the first profile here (or the last ``--reprofile``), so timings taken at different times are priced at
  one host speed; an entry measured at another reference time is rescaled to it.

So a recompile of the same model (another schedule, another microbatch count at the same microbatch
shape, another pp, another shard mode) times only stages it has not timed before, and a warm one times
nothing.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import platform
import statistics
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.fx.node import map_arg

from pipec.compiler import progress

from pipec.costs import cache
from pipec.costs.load import Watch, acting, crowded, read_load, timed_at, wait_for_cores
from pipec.model.fingerprint import _target_str
from pipec.model.load import instantiate
from pipec.model.partition import Split, _unit_key
from pipec.model.stages import resolve
from pipec.costs.profile import (PROFILE_METHOD, Profiling, _cost, _least_sample, _median_slowdown,
                                             _rel_spread, _Sample, _stage_runner, _threads, _total, crowd,
                                             usable_cores)
from pipec.compiler.ir.plan import Cost
from pipec.compiler.ir.tensor_parallel import in_effect

__all__ = ["profile_stages", "stage_digest"]


# ----------------------------------------------------------------------------- what decides a timing


def _device_name() -> str:
    """The CPU's model name (Linux), else what the platform says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _host_key(threads: int) -> dict[str, Any]:
    """The key fields of every timing: threads per rank, the host (cores, CPU), torch's version, the method."""
    return {"threads": threads, "cores": usable_cores(), "cpu_count": os.cpu_count(), "device": _device_name(),
            "torch": torch.__version__, "method": PROFILE_METHOD}


_SOURCES: dict[Any, str] = {}


def _source(obj: Any) -> str:
    """A digest of the Python source of a class or function outside torch (a model's own module or function a
    stage calls: editing it changes the stage's key); "" for torch's and builtins."""
    if obj in _SOURCES:
        return _SOURCES[obj]
    mod = getattr(obj, "__module__", None) or ""
    digest = ""
    if mod.split(".")[0] not in ("torch", "builtins", "operator", "math", "_operator", "typing"):
        try:
            digest = hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]
        except (OSError, TypeError):
            digest = f"{mod}.{getattr(obj, '__qualname__', '')}"
    _SOURCES[obj] = digest
    return digest


def stage_digest(split: Split, s: int) -> str:
    """The fingerprint of stage ``s`` as it is timed, wherever it sits in the model: its nodes in order (op; target,
    a module path with the layer it is in written by its place among the stage's layers; arguments, a node by its
    place; the output's shape and dtype), the modules it calls (repr and, for a model's own, their source), the
    tensors it reads by attribute (shape, dtype), the functions it calls that are not torch's (their source), its
    parameters (shape, dtype) and its inputs (shape, dtype, whether a gradient flows back) and outputs. The same
    stage of another cut has the same one; so do two stages of layers alike (one ModuleList's children with the
    same code and shapes): a transformer's middle stages are one timing."""
    traced = split.traced
    part = split.parts[s]
    nodes = {n.name: n for n in traced.gm.graph.nodes}
    units: dict[str, str] = {}
    for name in part.nodes:
        if name in nodes and not (key := _unit_key(nodes[name], traced.model)).startswith("node:"):
            units.setdefault(key, f"#{len(units)}")
    prefixes = sorted(units, key=len, reverse=True)

    def placed(path: str) -> str:
        for key in prefixes:
            if path == key or path.startswith(key + "."):
                return units[key] + path[len(key):]
        return path

    gm = traced.gm
    index: dict[Any, int] = {}
    rows = []
    for i, n in enumerate(split.stage_graph(s).nodes):
        index[n] = i
        args = map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}")
        meta = n.meta.get("tensor_meta")
        shape = [list(meta.shape), str(meta.dtype)] if hasattr(meta, "shape") else None
        if n.op == "call_module":
            mod = gm.get_submodule(str(n.target))
            target = [placed(str(n.target)), repr(mod), sorted({_source(type(m)) for m in mod.modules()} - {""})]
        elif n.op == "get_attr":
            obj = resolve(gm, str(n.target))
            target = [placed(str(n.target)),
                      [list(obj.shape), str(obj.dtype)] if isinstance(obj, torch.Tensor) else type(obj).__name__]
        elif n.op == "call_function":
            target = [_target_str(n.target), _source(n.target)]
        else:
            target = [str(n.target) if n.op == "call_method" else ""]
        rows.append([n.op, target, repr(args), shape])
    params = [[placed(c), list(traced.param_of[c].shape), str(traced.param_of[c].dtype)] for c in part.params]
    inputs = [[list(x.shape), x.dtype, src >= 0] for x, src in zip(part.inputs, part.sources)]
    outputs = [[list(x.shape), x.dtype] for x in part.outputs]
    text = json.dumps([rows, params, inputs, outputs], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _floats(value: Any, n: int) -> list[float]:
    if not isinstance(value, list) or len(value) != n or not all(isinstance(x, (int, float)) and x >= 0 for x in value):
        raise ValueError(f"expected {n} non-negative numbers")
    return [float(x) for x in value]


def _check_host(value: Mapping[str, Any]) -> None:
    if not float(value["reference_s"]) > 0:
        raise ValueError("reference_s must be positive")


def _check_stage(value: Mapping[str, Any]) -> None:
    _floats(value["least"], 5)
    _check_host({"reference_s": value["baseline_s"]})
    int(value["rounds"]), float(value["spread"]), float(value["host_spread"])


def _check_crowd(value: Mapping[str, Any]) -> None:
    _floats(value["slowdown"], 4)
    for r in value["repeats"]:
        _floats(r, 4)
    _check_host({"reference_s": value["baseline_s"]})
    float(value["spread"]), float(value["host_spread"])


# ----------------------------------------------------------------------------- the profile


def _runners(split: Split, stages: Sequence[int], autocast: str | None, target: str, kwargs: Mapping[str, Any],
             search_path: Sequence[str], tps: Sequence[Any] = (), tp: int = 1) -> dict[int, Callable[[], _Sample]]:
    """Stage runners of ``stages``, each on its stage module with seeded random parameters (the same in any cut);
    a stage with tensor parallelism (``tps[s]``, at ``tp`` ranks) as tp rank 0 runs it: sharded, its inputs at that rank's shapes
    (a sequence part under sequence parallelism), its collectives left out (they are priced on the links)."""
    from pipec.model.stages import materialize  # profile -> stages -> partition; late to keep layers clear

    _, buffers = instantiate(target, kwargs, mode="skeleton", search_path=search_path)
    gen = torch.Generator().manual_seed(0)
    values = {c: (torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype) for c, p in split.traced.param_of.items()}
    out = {}
    for s in stages:
        mod = materialize(split, s, {c: values[c] for c in split.parts[s].params}, buffers, "cpu")
        sigs = split.parts[s].inputs
        if (stp := _tp(tps, tp, s)) is not None:
            from pipec.tp.rewrite import shard_stage

            mod = shard_stage(mod, stp, 0, tp=tp)
            seq = dict(stp.seq_inputs)
            sigs = [replace(x, shape=tuple(d // tp if i == seq[x.name] else d for i, d in enumerate(x.shape)))
                    if x.name in seq else x for x in sigs]
        out[s] = _stage_runner(mod, sigs, split.parts[s].sources, autocast)
    return out


def _tp(tps: Sequence[Any], tp: int, s: int) -> Any:
    """Stage ``s``'s tensor parallelism where it shards anything (``tp`` >= 2), else None."""
    return in_effect(tps[s] if tps else None, tp)


def _tp_key(stp: Any, tp: int) -> dict[str, Any]:
    """A sharded stage's part of its profile cache key: its record and the degree (the mesh's ``tp``)."""
    return {"tp": tp, **stp.to_json()}


def profile_stages(split: Split, profile: Profiling, *, autocast: str | None, target: str, kwargs: Mapping[str, Any],
                   search_path: Sequence[str], tps: Sequence[Any] = (), tp: int = 1,
                   stages: Sequence[int] | None = None,
                   crowd_of: Sequence[int] | None = None,
                   crowd_from: Any | None = None) -> tuple[list[Cost], dict[str, Any]]:
    """The cost of every stage of ``stages`` (None: all of the split's), in that order (its least alone times the
    crowd's slowdown per part; its spread the crowd's, with one rank its own), and plan.json's ``model["profile"]``
    (:func:`_record`), timing only what the profile cache does not hold. ``tps``: each stage's tensor parallelism
    at ``tp`` ranks (none: tp 1); a sharded stage is timed as its tp rank 0 runs it (:func:`_runners`), its cost that rank's. The
    crowd, where it is measured, runs the stages of ``stages`` at the places ``crowd_of`` (None: all of them;
    :mod:`.pieces` times a few pieces of the model and crowds only its layers). ``crowd_from``: the same model's
    trace at another microbatch shape (a split's ``traced``), whose crowd the caller measured: where the cache
    holds no crowd of this shape, that one's slowdown is kept under this shape's key, marked as measured at that
    shape (:func:`_borrowed`; ``pipec tune`` measures one crowd per search), and nothing is crowded here."""
    host = _host_key(profile.threads)
    dtype = autocast or "float32"
    chosen = list(range(split.num_stages)) if stages is None else list(stages)
    num, many = len(chosen), profile.num_ranks > 1
    keys = [{"stage": stage_digest(split, s), "inputs": [[list(x.shape), x.dtype] for x in split.parts[s].inputs],
             "dtype": dtype, **host, **({"tp": _tp_key(stp, tp)} if (stp := _tp(tps, tp, s)) is not None else {})}
            for s in chosen]
    entries: dict[int, cache.Entry] = {}
    for i in range(num):
        if (e := cache.lookup("stage", keys[i], _check_stage)) is not None:
            entries[i] = e
    cores, need_alone, need_crowd = usable_cores(), profile.threads, profile.num_ranks * profile.threads
    crowd_key = _crowd_key(split.traced, dtype, profile.num_ranks, host)
    if any(_tp(tps, tp, s) is not None for s in chosen):  # the crowd's processes run the sharded stages
        crowd_key["tp"] = [_tp_key(stp, tp) if (stp := _tp(tps, tp, s)) is not None else None for s in chosen]
    shared = cache.lookup("crowd", crowd_key, _check_crowd) if many else None
    if shared is None and many and crowd_from is not None and "tp" not in crowd_key:
        source = _crowd_key(crowd_from, dtype, profile.num_ranks, host)
        if (lent := cache.lookup("crowd", source, _check_crowd)) is not None:
            shared = cache.store("crowd", crowd_key, _borrowed(lent, source["inputs"]))
    shared = _retime_marked(entries, shared, cores, need_alone, need_crowd if many else 0)
    host_entry = cache.lookup("host", host, _check_host)
    baseline = float(host_entry.value["reference_s"]) if host_entry else None
    if baseline is None and entries:  # the host's entry lost: the stages' own speed
        baseline = float(next(iter(entries.values())).value["baseline_s"])
        cache.store("host", host, {"reference_s": baseline})
    todo = [i for i in range(num) if i not in entries]
    first: dict[str, int] = {}   # stages alike (one key) are timed once: the first of them
    same = {i: first.setdefault(json.dumps(keys[i], sort_keys=True), i) for i in todo}
    todo = [i for i in todo if same[i] == i]
    restore = _threads(profile.threads)
    try:
        crowded = list(range(num)) if crowd_of is None else list(crowd_of)
        built = sorted(set(todo) | (set(crowded) if many and shared is None else set()))
        by_stage = _runners(split, [chosen[i] for i in built], autocast, target, kwargs, search_path, tps, tp) if built \
            else {}
        runners = {i: by_stage[chosen[i]] for i in built}
        if todo:
            before = wait_for_cores(need_alone, cores, "profiling stages alone")
            with Watch(need_alone) as watch:
                samples, speed = profile.alone({i: runners[i] for i in todo}, baseline=baseline)
            load = timed_at(before, watch, need_alone, cores)
            if baseline is None:
                baseline = statistics.median(speed)
                cache.store("host", host, {"reference_s": baseline})
            for i in todo:
                entries[i] = cache.store("stage", keys[i], {
                    "least": list(_least_sample(samples[i])), "rounds": len(samples[i]), "baseline_s": baseline,
                    "spread": _rel_spread([_total(x) for x in samples[i]]), "host_spread": _rel_spread(speed),
                    **load})
        entries.update((i, entries[j]) for i, j in same.items() if i != j)
        assert baseline is not None
        alone = {i: [x * baseline / float(e.value["baseline_s"]) for x in e.value["least"]] for i, e in entries.items()}
        if many and shared is None:
            before = wait_for_cores(need_crowd, cores, f"profiling {profile.num_ranks} processes at once")
            with Watch(need_crowd) as watch:
                got = crowd(profile, dict(enumerate(runners[i] for i in crowded)),
                            dict(enumerate(alone[i] for i in crowded)), len(crowded), baseline)
            load = timed_at(before, watch, need_crowd, cores)
            shared = cache.store("crowd", crowd_key, {
                "slowdown": list(_median_slowdown(got.repeats)), "repeats": [list(r) for r in got.repeats],
                "spread": got.spread, "baseline_s": baseline, "host_spread": _rel_spread(got.speed), **load,
                "num_stages": len(crowded)})
    finally:
        restore()
        progress.done()
    slowdown = tuple(float(x) for x in shared.value["slowdown"]) if shared else None
    factor = (*slowdown, slowdown[2]) if slowdown else (1.0,) * 5  # the weight half is a backward's
    costs = [_cost([x * f for x, f in zip(alone[i], factor)],
                   float(shared.value["spread"]) if shared else float(entries[i].value["spread"]),
                   stage=entries[i].value, crowd=shared.value if shared else None) for i in range(num)]
    return costs, _record(profile, [entries[i] for i in range(num)], shared)


def _retime_marked(entries: dict[int, cache.Entry], shared: cache.Entry | None, cores: int, need_alone: int,
                   need_crowd: int) -> cache.Entry | None:
    """On a host quiet enough now, the entries taken under load (``loaded``, :mod:`.load`) are dropped from
    ``entries`` (and the crowd returned as None) to be timed again, with a note; the crowd otherwise. Nothing is
    read where no entry is marked, or under ``PIPEC_PROFILE_LOAD=record``."""
    marked = [i for i, e in entries.items() if e.value.get("loaded")]
    crowd_marked = shared is not None and bool(shared.value.get("loaded"))
    if not (marked or crowd_marked) or not acting():
        return shared
    now = read_load()
    was = [float(entries.pop(i).value.get("load", 0)) for i in marked if not crowded(now, need_alone, cores)]
    if crowd_marked and not crowded(now, need_crowd, cores):
        was.append(float(shared.value.get("load", 0)))
        shared = None
    if was:
        cache.note(f"profile cache: {len(was)} timing{'s' if len(was) != 1 else ''} taken under load up to "
                   f"{max(was):g} timed again on a quieter host (load {now:g} now)")
    return shared


def _crowd_key(traced: Any, dtype: str, ranks: int, host: Mapping[str, Any]) -> dict[str, Any]:
    """A crowd's cache key: the model's fingerprint, the microbatch's inputs, the dtype, the ranks sharing the host."""
    return {"model": traced.fingerprint, "inputs": [[x.name, list(x.shape), x.dtype] for x in traced.inputs],
            "dtype": dtype, "ranks": ranks, **host}


def _borrowed(lent: cache.Entry, inputs: list) -> dict[str, Any]:
    """A crowd measured at another microbatch shape (``lent``, whose key has ``inputs``), as kept under this shape's
    key: its slowdown, repeats and spread, and ``measured_at``, the shape it was measured at and when (a crowd
    itself borrowed keeps its own source)."""
    return {**lent.value, "measured_at": lent.value.get("measured_at") or {"inputs": inputs, "at": lent.at}}


def _record(profile: Profiling, stages: Sequence[cache.Entry], crowd: cache.Entry | None) -> dict[str, Any]:
    """plan.json's ``model["profile"]``: how the stages were timed, each timing's provenance (``stages[s]`` and
    ``crowd``: ``at``, when it was measured, and ``reused``, whether an earlier compile measured it), the slowdown
    measured, ``host_spread`` (the reference kernel's standard deviation over its median, in the rounds that timed
    them: the median of the timings'), ``host_load`` (the processes wanting a core besides the compile when the
    timings that set the costs' level were taken: the crowd's, else the median of the stages') and notes of the
    profile cache."""
    out: dict[str, Any] = {"concurrent_ranks": profile.num_ranks, "threads_per_rank": profile.threads,
                           "reps": profile.reps, "max_reps": profile.max_reps, "spread_target": profile.spread_target,
                           "cpu_count": os.cpu_count(), "cores": usable_cores(), "host": _host_key(profile.threads)}
    out["stages"] = [{"stage": s, "at": e.at, "reused": e.reused, "rounds": int(e.value["rounds"]),
                      **_load_of(e)} for s, e in enumerate(stages)]
    timings = [*stages, *([crowd] if crowd else [])]
    out["host_spread"] = round(statistics.median(float(e.value["host_spread"]) for e in timings), 4)
    loads = [e.value.get("load") for e in ([crowd] if crowd else stages)]
    loads = [float(x) for x in loads if isinstance(x, (int, float))]
    if loads:
        out["host_load"] = round(statistics.median(loads), 2)
    if crowd is not None:
        out["min_time_s"] = profile.min_time_s
        out["crowd_repeats"] = len(crowd.value["repeats"])
        out["slowdown"] = dict(zip(_PARTS, (round(float(x), 4) for x in crowd.value["slowdown"])))
        out["crowd"] = {"at": crowd.at, "reused": crowd.reused, "repeats": len(crowd.value["repeats"]),
                        "spread": round(float(crowd.value["spread"]), 4), **_load_of(crowd)}
        if isinstance(at := crowd.value.get("measured_at"), Mapping):   # measured at another shape (_borrowed)
            out["crowd"]["measured_at"] = {"inputs": at.get("inputs"), "at": at.get("at")}
    notes = cache.take_notes()
    if notes:
        out["notes"] = notes
    return out


def _load_of(e: cache.Entry) -> dict[str, Any]:
    """An entry's load as plan.json keeps it: ``load`` (other processes wanting a core while it was timed) and
    ``loaded`` (fewer cores than it needed were free, :mod:`.load`); nothing for an entry that kept none."""
    load = e.value.get("load")
    if not isinstance(load, (int, float)):
        return {}
    return {"load": round(float(load), 2), "loaded": bool(e.value.get("loaded", False))}


_PARTS = ("fwd", "bwd_i", "bwd", "optim")
