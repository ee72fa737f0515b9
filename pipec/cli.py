"""The ``pipec`` command: one small handler per subcommand, dispatched from a table.

Errors pipec raises on purpose (:class:`pipec.errors.PipecError`: a bad
flag, a schedule rule, a malformed plan, a failed proof, a user's factory
that raised) print ``pipec: error:`` and the message and exit with the
error's code (2 for a user's mistake); never a traceback. Anything else is a
bug and keeps its traceback. Output cut short by its reader (``pipec show
plan.json | head``) ends the command quietly (exit 141, as SIGPIPE would).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence
from pipec.errors import PipecError

__all__ = ["main"]


class UsageError(PipecError):
    """A command-line mistake not caught by argparse itself."""


def _err(error: str | PipecError) -> None:
    """``pipec: error: MESSAGE``; an error located in a schedule file or flag prints as it renders, like a
    compiler's (``f.pipe:4:1: error: ...``), without a second prefix."""
    located = isinstance(error, PipecError) and error.located
    print(str(error) if located else f"pipec: error: {error}", file=sys.stderr)


def _warn(message: str) -> None:
    print(f"pipec: warning: {message}", file=sys.stderr)


def _add_reprofile(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reprofile", action="store_true", help="costs profile: time the stages and probe the links "
                   "again, ignoring the profile cache's timings (`pipec cache` shows it)")


def _add_compile_flags(p: argparse.ArgumentParser, add_flags) -> None:
    """What ``compile`` and ``check`` share: ``--verbose``, every key's flag (the key table's), ``--reprofile``."""
    p.add_argument("--verbose", action="store_true", help="also say which keys a note's defaults came from")
    add_flags(p)
    _add_reprofile(p)


def _reprofile(args: argparse.Namespace) -> None:
    """``--reprofile``: this process measures again what the profile cache holds (and replaces it)."""
    if getattr(args, "reprofile", False):
        from pipec.costs import cache

        cache.reprofile()


# ----------------------------------------------------------------------------- compile / check


def _spec(args: argparse.Namespace):
    """The resolved spec of an optional schedule file plus the flags given."""
    from pipec.dsl import load_spec
    from pipec.dsl.cli import overrides_from_args

    return load_spec(args.file, overrides_from_args(args))


def _report(diagnostics, verbose: bool = False) -> None:
    """Print warnings and notes: located ones as they render (``verbose``: with what only --verbose shows),
    others after ``pipec: <level>:``."""
    for d in diagnostics:
        text = d.render(verbose) if hasattr(d, "render") else str(d)
        print(text if getattr(d, "location", None) is not None else f"pipec: {getattr(d, 'level', 'warning')}: {text}",
              file=sys.stderr)


def cmd_compile(args: argparse.Namespace) -> int:
    from pipec.compiler.driver import compile_spec
    from pipec.compiler.ir.plan_json import write_plan
    from pipec.views.common import format_time
    from pipec.views.summary import interval_words

    _reprofile(args)
    compiled = compile_spec(_spec(args))
    _report(compiled.diagnostics, args.verbose)
    write_plan(compiled.plan, args.output)
    plan, pred = compiled.plan, compiled.plan.prediction
    what = f"model {plan.model['target']}, " if plan.model else ""
    print(f"wrote {args.output}: {what}{plan.num_stages} stages, {plan.program.num_instructions} instructions on "
          f"{_mesh_words(plan.mesh)} ranks; verified; predicted step "
          f"{format_time(pred.step_time, pred.time_unit)}" + ("" if pred.interval is None else
          f" ({interval_words(pred)})") + f", bubble {pred.bubble_fraction:.1%}")
    _plan_lines(plan)
    return 0


def _plan_lines(plan) -> None:
    """What ``compile`` and ``show`` say under the prediction: the links that priced each axis, and a profile
    taken under load (:func:`~pipec.compiler.sim.history.profiled_under_load`)."""
    from pipec.compiler.sim.history import profiled_under_load

    for line in (_links_line(plan), profiled_under_load(plan)):
        if line is not None:
            print(line)


def _mesh_words(mesh) -> str:
    """``2 pp x 1 dp``, and ``x 2 tp`` with tp > 1."""
    return f"{mesh.pp} pp x {mesh.dp} dp" + (f" x {mesh.tp} tp" if mesh.tp > 1 else "")


def _links_line(plan) -> str | None:
    """``links (4 devices per node, 2 nodes): pp hops 1 intra, 2 inter; dp groups 2 intra``: which link priced
    each axis's hops and collectives; None when the plan is not priced by node."""
    from pipec.compiler.sim.simulate import NODE_SIDES, link_sides

    sides = link_sides(plan)
    if not sides:
        return None
    mesh = plan.mesh
    parts = [f"{axis} {'hops' if axis == 'pp' else 'groups'} "
             + ", ".join(f"{n} {side}" for side in NODE_SIDES if (n := counts[side])) for axis, counts in sides.items()]
    return f"links ({mesh.devices_per_node} devices per node, {mesh.num_nodes} nodes): " + "; ".join(parts)


def cmd_check(args: argparse.Namespace) -> int:
    if args.file.endswith(".json"):
        from pipec.compiler.ir.plan_json import read_plan
        from pipec.compiler.passes.verify import verify

        plan = read_plan(args.file)
        verify(plan)
        tp = f" x {plan.mesh.tp} tp" if plan.mesh.tp > 1 else ""
        print(f"{args.file}: verified ({plan.program.num_instructions} instructions, {plan.mesh.pp} pp ranks x "
              f"{plan.mesh.dp} dp{tp}): matching, dependencies, collectives, no deadlock (buffered and in-order)")
        return 0
    from pipec.compiler.driver import compile_spec

    _reprofile(args)
    spec = _spec(args)
    untraced = bool(spec["model"]) and args.no_model
    compiled = compile_spec(spec, trace=not untraced)  # --no-model: the schedule alone, at unit costs
    _report(compiled.diagnostics, args.verbose)
    plan = compiled.plan
    if untraced:
        print(f"{args.file}: checked, schedule compiled and verified (the model {spec['model']} was not traced: "
              "--no-model)")
        return 0
    print(f"{args.file}: checked, compiled and verified ({plan.program.num_instructions} instructions, "
          f"{_mesh_words(plan.mesh)}; predicted bubble {plan.prediction.bubble_fraction:.1%})")
    return 0


def cmd_fmt(args: argparse.Namespace) -> int:
    from pipec.dsl import format_file

    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise UsageError(f"{args.file}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{args.file}: not UTF-8 text") from None
    out = format_file(text, filename=args.file)
    if args.write:
        with open(args.file, "w", encoding="utf-8") as f:
            f.write(out)
    else:
        sys.stdout.write(out)
    return 0


def _load_measured(path: str, plan_mesh):
    """The measured Timeline of a report.json, the run's mesh (its ``mesh``, read once into a
    :class:`~pipec.compiler.ir.plan.Mesh`; ``pp`` absent: ``plan_mesh``'s), and its re-simulated prediction: a
    report whose ``predicted`` was re-simulated under what the run measured (``--emulate``) keeps the plan's own
    as ``planned``; None when it has no ``planned`` (its ``predicted`` is the plan's)."""
    import json

    from pipec.compiler.ir.plan import Mesh
    from pipec.compiler.ir.schema import SchemaError
    from pipec.compiler.ir.timeline import Timeline

    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except OSError as e:
        raise UsageError(f"{path}: cannot read report: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not a JSON file: {e}") from None
    if not isinstance(report, dict) or "measured" not in report:
        raise UsageError(f"{path}: not a report.json (no 'measured' timeline); write one with `pipec run --report`")
    raw = report.get("mesh") or {}
    try:
        mesh = Mesh(pp=int(raw.get("pp", plan_mesh.pp)), dp=int(raw.get("dp", 1)), tp=int(raw.get("tp", 1)))
    except (AttributeError, TypeError, ValueError):
        raise UsageError(f"{path}: mesh: expected pp, dp and tp as integers (a report.json's mesh), got "
                         f"{report.get('mesh')!r}; write the report with `pipec run --report`") from None
    try:
        resim = Timeline.from_json(report["predicted"], f"{path}: predicted") \
            if "planned" in report and "predicted" in report else None
        return Timeline.from_json(report["measured"], f"{path}: measured"), mesh, resim
    except SchemaError as e:
        raise UsageError(str(e)) from None


def cmd_show(args: argparse.Namespace) -> int:
    from pipec.compiler.ir.plan_json import read_plan

    plan = read_plan(args.file)
    if args.text:
        print(plan.program.text())
        return 0
    if plan.prediction is None:
        from pipec.compiler.driver import prove_and_predict

        plan = prove_and_predict(plan)
    measured, mesh, resim = _load_measured(args.measured, plan.mesh) if args.measured else (None, plan.mesh, None)
    from pipec.views.picture import render_image
    from pipec.views.summary import show

    title = args.file
    predicted = plan.prediction
    if resim is not None:  # beside the measured: what the run predicts under its measured links and overhead
        predicted = resim
        title += " (predicted: re-simulated under the run's measured links and overhead)"
    show(predicted, measured=measured, mesh=mesh, title=title)
    _plan_lines(plan)
    from pipec.views.stage_table import stage_table, tp_lines

    table = stage_table(plan)
    if table is not None:
        from rich.console import Console

        Console().print(table)
    for line in tp_lines(plan):
        print(line)
    from pipec.views.keys import key_lines

    print("keys, as resolved:")
    for line in key_lines(plan, width=78):
        print(f"  {line}")
    if args.graph:
        from pipec.views.graph import render_graph

        print(render_graph(plan, args.graph))
    for path in filter(None, (args.svg, args.png)):
        render_image(predicted, path, measured=measured, mesh=mesh, title=title)
        print(f"wrote {path}")
    if args.trace:
        from pipec.views.perfetto import write_perfetto

        write_perfetto(predicted, args.trace, measured=measured, mesh=mesh)
        print(f"wrote {args.trace} (open it at https://ui.perfetto.dev)")
    return 0


def _check_flag(check, *args) -> None:
    """Run a check of key values that came from flags, its complaint worded as the flag the user gave."""
    try:
        check(*args)
    except PipecError as e:
        raise UsageError(f"--{e.key.replace('_', '-')}: {e}" + "".join(f"; {h}" for h in e.hints)) from None


def cmd_import(args: argparse.Namespace) -> int:
    from pipec.compiler.driver import compile_plan, prove_and_predict
    from pipec.compiler.ir.plan import Mesh, Plan, Stage, check_shard
    from pipec.compiler.ir.plan_json import write_plan
    from pipec.compiler.ir.torch_csv import read_torch_csv
    from pipec.compiler.request import CompileRequest

    sched = read_torch_csv(args.file)
    mesh = Mesh(pp=sched.num_ranks, dp=args.dp, shard=args.shard, shard_size=args.shard_size)
    _check_flag(check_shard, mesh)
    if sched.kind == "compute_comms":  # the program as given: no compute order to lower
        plan = Plan(
            mesh=mesh,
            num_stages=sched.num_stages,
            num_microbatches=sched.num_microbatches,
            placement=sched.placement,
            program=sched.to_program(mesh=mesh),
            stages=tuple(Stage(stage=s, rank=r) for s, r in enumerate(sched.placement)),  # edges: the chain
            spec=CompileRequest(schedule="order", mesh=mesh, num_microbatches=sched.num_microbatches).spec_json(),
        )
        plan = prove_and_predict(plan)
    else:
        plan = compile_plan(num_ranks=sched.num_ranks, num_microbatches=sched.num_microbatches,
                            order=sched.to_order(), dp=args.dp, shard=args.shard, shard_size=args.shard_size).plan
    write_plan(plan, args.output)
    print(f"wrote {args.output}: {sched.kind.replace('_', '-')} torch schedule, {sched.num_ranks} ranks, "
          f"{sched.num_stages} stages, {sched.num_microbatches} microbatches; verified, predicted bubble "
          f"{plan.prediction.bubble_fraction:.1%}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pipec.compiler.ir.plan_json import read_plan
    from pipec.compiler.ir.torch_csv import write_torch_csv
    from pipec.compiler.passes.verify import verify

    plan = read_plan(args.file)
    verify(plan)  # never hand on a plan that fails its proofs
    write_torch_csv(plan.program, args.torch_csv, form=args.form)
    print(f"wrote {args.torch_csv} ({'compute-only' if args.form == 'compute_only' else 'compute+comms'} form)")
    return 0


def cmd_export_checkpoint(args: argparse.Namespace) -> int:
    """One state dict of the unpartitioned model from a checkpoint (runtime/export.py)."""
    from pipec.runtime.checkpoint_export import export_checkpoint

    res = export_checkpoint(args.dir, args.output)
    print(f"wrote {args.output}: {res.num_tensors} tensors ({res.num_aliases} of them tied aliases) of "
          f"{res.manifest.model.get('target')} from {res.path} (step {res.manifest.step})")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Launch the plan's ranks with torch's own launcher (torchrun), after proving the plan here."""
    from pipec.compiler.ir.plan_json import read_plan
    from pipec.compiler.passes.verify import verify
    from pipec.runtime.launch import RENDEZVOUS_FLAGS, LaunchError, RunOptions, start_ranks

    plan = read_plan(args.plan)
    verify(plan)  # a plan that fails its proofs is never launched
    from pipec.compiler.ir.plan import world_text

    world = plan.mesh.world_size
    multi_node = args.nnodes not in (None, "1") or args.rdzv_endpoint is not None
    if not multi_node and args.nproc != world:
        raise LaunchError(f"the plan needs {world_text(plan.mesh)} ranks; use --nproc {world}")
    if plan.model is None and not args.emulate:
        raise LaunchError(f"{args.plan} is a schedule-only plan (no model): it runs only with --emulate")
    rendezvous = {flag: getattr(args, flag) for flag in RENDEZVOUS_FLAGS} if multi_node else None
    # the ranks report their errors here (each message once); torchrun's log lines hidden unless --verbose
    return start_ranks(plan.mesh.where, RunOptions.from_args(args), nproc=args.nproc, max_restarts=args.max_restarts,
                       rendezvous=rendezvous, verbose=args.verbose)


def cmd_tune(args: argparse.Namespace) -> int:
    """Search layouts, schedules, microbatches, partitions and recompute; write the best plan."""
    import json

    from pipec.compiler.ir.plan import check_node_size
    from pipec.compiler.ir.plan_json import write_plan
    from pipec.tune.search import tune
    from pipec.tune.space import TuneRequest
    from pipec.tune.report import frontier_table, pipe_lines, result_json, table, why
    from pipec.dsl import load_spec
    from rich.console import Console
    from rich.progress import Progress

    from pipec.compiler import progress as steps

    _reprofile(args)
    overrides = {k: v for k, v in (("device_memory", args.device_memory), ("peak_flops", args.peak_flops)) if v}
    spec = load_spec(args.file, overrides)
    if args.devices_per_node is not None:
        _check_flag(check_node_size, args.devices_per_node, args.devices, f"--devices {args.devices}")
    keep = frozenset(k.strip() for k in (args.keep or "").split(",") if k.strip())
    err = Console(stderr=True)
    with Progress(console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("searching", total=1)
        progress = lambda done, total: bar.update(task, completed=done, total=total)  # noqa: E731
        step = lambda text: bar.update(task, description=text or "searching")  # noqa: E731 - a profile's steps
        try:
            with steps.routed(step):
                result = tune(TuneRequest(base=spec.request, num_devices=args.devices, global_batch=args.global_batch,
                                          keep=keep, num_top=args.top, progress=progress,
                                          devices_per_node=args.devices_per_node))
        except PipecError as e:
            raise spec.locate(e) from None
        notes: list[str] = []
        if args.measure:
            from pipec.tune.measure import measure

            bar.update(task, description=f"measuring the top {args.measure}", completed=0, total=args.measure)
            result, notes = measure(result, args.measure, workdir=args.measure_dir, steps=args.measure_steps,
                                    progress=progress)
    write_plan(result.best.plan, args.output)
    lines = pipe_lines(result.best.candidate, result.best.plan)
    pipe = _tuned_pipe(args.file, lines)
    if args.pipe:
        with open(args.pipe, "w", encoding="utf-8") as f:
            f.write(pipe)
    if args.json:
        print(json.dumps(result_json(result, plan_path=args.output, pipe=args.pipe, notes=notes), indent=2))
        return 0
    out = Console() if sys.stdout.isatty() else Console(width=80)
    out.print(f"searched {result.num_candidates} candidates on {result.num_devices} devices (global batch "
              f"{result.global_batch}) in {result.seconds:.1f} s: {result.num_compiled} compiled, "
              f"{result.num_pruned} pruned by bounds, {result.num_over_budget} over budget; "
              f"{result.num_traces} traces, {result.num_cuts} cuts" + (
                  "" if result.num_pieces is None else f", priced from {result.num_pieces} timed pieces; "
                  f"{result.num_timed} timed on their own stages (the file's own, the fastest), the other rows at "
                  f"summed x {result.level:.2f} (the level: timed / summed)"), highlight=False)
    out.print(table(result.top, "top candidates (predicted)", measured=bool(args.measure)))
    out.print(frontier_table(result))
    for note in notes:
        _warn(note)
    out.print("why this one:", highlight=False)
    for line in why(result):
        out.print(f"  - {line}", highlight=False)
    out.print("as schedule-file lines:", highlight=False)
    for line in lines:
        out.print(f"  {line}", highlight=False)
    if (links := _links_line(result.best.plan)) is not None:
        out.print(links, highlight=False)
    print(f"wrote {args.output}" + (f" and {args.pipe}" if args.pipe else "") + ": verified")
    return 0


def _tuned_pipe(path: str, lines: list[str]) -> str:
    """A complete schedule file: the file's statements but the ones tune set, then tune's lines."""
    from pipec.tune.space import TUNED_KEYS
    from pipec.dsl import format_file
    from pipec.dsl.fmt import statement_text
    from pipec.dsl.parse import parse_source

    with open(path, encoding="utf-8") as f:
        parsed = parse_source(f.read(), filename=path)
    drop = {*TUNED_KEYS, "input", "targets", "stages", "placement", "policy", "order"}
    drop |= {line.split()[0] for line in lines}  # a line tune writes replaces the file's
    kept = [statement_text(st) for st in parsed.file.statements if st.key.name not in drop]
    text = "\n".join([f"# written by pipec tune from {os.path.basename(path)}", *kept, *lines]) + "\n"
    return format_file(text, filename=path)


def cmd_cache(args: argparse.Namespace) -> int:
    """Show the profile cache (where, its entries, their size), or with ``--clear`` empty it."""
    from pipec.costs import cache

    got = cache.clear() if args.clear else cache.summary()
    kinds = ", ".join(f"{n} {kind}" for kind, n in got["by_kind"].items() if n)
    what = f"{got['entries']} entries" + (f" ({kinds})" if kinds else "") + f", {_size_text(got['bytes'])}"
    if args.clear:
        print(f"cleared the profile cache at {got['path']}: {what} removed")
    else:
        print(f"profile cache at {got['path']}: {what}")
    return 0


def _size_text(num: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num >= size:
            return f"{num / size:.1f} {unit}"
    return f"{num} bytes"


def cmd_demo(args: argparse.Namespace) -> int:
    from pipec.demo import run_demo

    _reprofile(args)
    return run_demo(ranks=args.ranks, microbatches=args.microbatches, run=not args.no_run, out=args.out,
                    steps=args.steps)


# ----------------------------------------------------------------------------- parser


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipec", description="Compile, verify, predict and run pipeline schedules.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    from pipec.dsl.cli import add_flags
    from pipec.dsl.keys import KEYS

    c = sub.add_parser("compile", help="compile a schedule file and/or flags into a verified plan.json")
    c.add_argument("file", nargs="?", help="a schedule file (.pipe); optional: flags alone make a spec")
    c.add_argument("-o", "--output", default="plan.json", help="where to write the plan (default plan.json)")
    _add_compile_flags(c, add_flags)
    c.set_defaults(func=cmd_compile)

    k = sub.add_parser("check", help="prove a plan.json, or check (and compile and prove) a schedule file")
    k.add_argument("file")
    k.add_argument("--no-model", action="store_true", help="a .pipe naming a model: check the file only, trace nothing")
    _add_compile_flags(k, add_flags)
    k.set_defaults(func=cmd_check)

    f = sub.add_parser("fmt", help="print a schedule file in canonical form")
    f.add_argument("file")
    f.add_argument("-w", "--write", action="store_true", help="rewrite the file in place")
    f.set_defaults(func=cmd_fmt)

    s = sub.add_parser("show", help="show a plan's predicted timeline and summary")
    s.add_argument("file")
    s.add_argument("--text", action="store_true", help="print the program in text form instead")
    s.add_argument("--svg", metavar="FILE", help="also draw the timeline as an SVG picture")
    s.add_argument("--png", metavar="FILE", help="also draw the timeline as a PNG picture")
    s.add_argument("--trace", metavar="FILE", help="also write a Perfetto / Chrome trace")
    s.add_argument("--measured", metavar="REPORT", help="draw a run's measured timeline (report.json) beside; an "
                   "--emulate report's beside its re-simulated prediction (under the measured links and overhead)")
    s.add_argument("--graph", metavar="FILE", help="draw the stage graph (.svg, .png, .pdf or .dot; needs graphviz)")
    s.set_defaults(func=cmd_show)

    i = sub.add_parser("import", help="import a torch.distributed.pipelining schedule CSV as a verified plan")
    i.add_argument("file")
    i.add_argument("-o", "--output", default="plan.json")
    i.add_argument("--dp", type=int, default=1, help="data-parallel replicas (REDUCE_GRAD becomes AR:dp)")
    i.add_argument("--shard", default=KEYS["shard"].default, choices=KEYS["shard"].kind.options,
                   help="the replicas' sharding: with grads or full, UNSHARD/RESHARD/REDUCE_GRAD become UN/RE/RS")
    i.add_argument("--shard-size", type=int, help="replicas that shard among themselves (default dp)")
    i.set_defaults(func=cmd_import)

    e = sub.add_parser("export", help="export a plan as a torch.distributed.pipelining schedule CSV")
    e.add_argument("file")
    e.add_argument("--torch-csv", required=True, metavar="FILE")
    e.add_argument("--form", choices=("compute_only", "compute_comms"), default="compute_only")
    e.set_defaults(func=cmd_export)

    x = sub.add_parser("export-checkpoint", help="write a checkpoint as one state dict of the unpartitioned model")
    x.add_argument("dir", help="a checkpoint folder (step_N), or a checkpoint_dir: its newest valid checkpoint")
    x.add_argument("-o", "--output", required=True, metavar="FILE", help="FILE.pt (torch.save) or FILE.safetensors")
    x.set_defaults(func=cmd_export_checkpoint)

    r = sub.add_parser("run", help="run a plan under torchrun (gloo on CPU, NCCL on GPU)")
    from pipec.runtime.launch import RENDEZVOUS_FLAGS, add_run_flags

    add_run_flags(r)
    r.add_argument("--nproc", type=int, required=True, help="ranks on this node (pp x dp x tp on one node)")
    r.add_argument("--max-restarts", type=int, default=0, help="torchrun's elastic restarts")
    r.add_argument("--verbose", action="store_true", help="also show torchrun's own log lines")
    for flag in RENDEZVOUS_FLAGS:
        r.add_argument(f"--{flag.replace('_', '-')}", help="passed to torchrun (multi-node rendezvous)")
    r.set_defaults(func=cmd_run)

    t = sub.add_parser("tune", help="search layout, schedule, microbatches, partition and recompute; write the best")
    t.add_argument("file", help="a schedule file naming a model: its layout and schedule are the starting point")
    t.add_argument("--devices", type=int, required=True, help="devices to lay the model out on (pp x dp)")
    t.add_argument("--global-batch", type=int, help="sequences per step over all replicas (default: input x dp)")
    t.add_argument("--keep", metavar="KEY,...", help="keys pinned to the file's value (pp,dp,shard,shard_size,"
                   "schedule,virtual,microbatches,partition,recompute)")
    t.add_argument("--device-memory", metavar="SIZE", help="bytes per device (default: the file's device_memory)")
    t.add_argument("--devices-per-node", type=int, metavar="G", help="devices per node: with the file's intra / "
                   "inter links, hops are priced by node (default: the file's devices_per_node)")
    t.add_argument("--peak-flops", metavar="RATE", help="FLOP/s per device (default: the file's peak_flops)")
    t.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    t.add_argument("--measure", type=int, default=0, metavar="K", help="run the top K here and re-rank by measured step")
    t.add_argument("--measure-steps", type=int, default=10,
                   help="steps of each --measure run; its median but the first (a warm-up) counts (default 10)")
    t.add_argument("--measure-dir", default="pipec-tune", help="folder for --measure's plans and reports")
    t.add_argument("--json", action="store_true", help="print the result as JSON (fields: docs/reference.md)")
    t.add_argument("--pipe", metavar="FILE", help="also write the winner as a complete schedule file")
    t.add_argument("-o", "--output", default="plan.json", help="where to write the best plan (default plan.json)")
    _add_reprofile(t)
    t.set_defaults(func=cmd_tune)

    d = sub.add_parser("demo", help="the main job: compile, show and compare schedules")
    d.add_argument("--ranks", type=int, default=4)
    d.add_argument("--microbatches", type=int, default=8)
    d.add_argument("--no-run", action="store_true", help="only the compile part (no torchrun)")
    d.add_argument("--steps", type=int, default=4, help="training steps of each GPT run")
    d.add_argument("--out", default="pipec-demo", help="folder for the plans, reports and pictures")
    _add_reprofile(d)
    d.set_defaults(func=cmd_demo)

    h = sub.add_parser("cache", help="show the profile cache (costs profile's timings, the links probed), or clear it")
    h.add_argument("--clear", action="store_true", help="remove every entry: the next compile measures again")
    h.set_defaults(func=cmd_cache)
    return p


SIGPIPE_EXIT = 141
"""Exit status when the reader of pipec's output went away (``pipec show plan.json | head``): 128 + SIGPIPE,
what a command killed by the signal reports."""


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # the reader went away: no traceback, and nothing more written
        _drop_stdout()
        return SIGPIPE_EXIT


def _drop_stdout() -> None:
    """Point stdout at the null device, so that the interpreter's last flush at exit does not fail again."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError):  # stdout is no file (a test's capture): nothing to flush
        pass


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed its message
        return 2 if e.code not in (0, None) else 0
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except PipecError as e:  # a user's mistake (2), a failed run (1), a --check mismatch (3); else a bug
        _err(e)
        return e.exit_code
    except KeyboardInterrupt:
        _err("interrupted")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
