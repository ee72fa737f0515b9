"""The ``pipec`` command: one small handler per subcommand, dispatched from a table.

User mistakes (any ``ValueError`` raised by pipec's own modules: a bad flag,
a schedule rule, a malformed plan, a failed proof) print ``pipec: error:``
and the message, and exit with code 2; never a traceback. Anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

__all__ = ["main"]


class UsageError(ValueError):
    """A command-line mistake not caught by argparse itself."""


def _err(message: str) -> None:
    print(f"pipec: error: {message}", file=sys.stderr)


def _warn(message: str) -> None:
    print(f"pipec: warning: {message}", file=sys.stderr)


# ----------------------------------------------------------------------------- compile / check


def cmd_compile(args: argparse.Namespace) -> int:
    from pipec.compiler.driver import compile_plan
    from pipec.compiler.plan import write_plan

    if args.schedule is None or args.ranks is None or args.microbatches is None:
        raise UsageError("pipec compile needs --schedule NAME --ranks P --microbatches M (and -o plan.json)")
    compiled = compile_plan(
        schedule=args.schedule,
        num_ranks=args.ranks,
        num_microbatches=args.microbatches,
        num_chunks=args.virtual,
        dp=args.dp,
        spec={"schedule": args.schedule, "pp": args.ranks, "dp": args.dp, "microbatches": args.microbatches,
              "virtual": args.virtual},
    )
    for w in compiled.warnings:
        _warn(w)
    write_plan(compiled.plan, args.output)
    pred = compiled.plan.prediction
    print(f"wrote {args.output}: {compiled.plan.program.num_instructions} instructions on "
          f"{compiled.plan.mesh.pp} pp ranks, verified; predicted bubble {pred.bubble_fraction:.1%}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from pipec.compiler.plan import read_plan
    from pipec.compiler.verify import verify

    plan = read_plan(args.file)
    verify(plan)
    print(f"{args.file}: verified ({plan.program.num_instructions} instructions, {plan.mesh.pp} pp ranks x "
          f"{plan.mesh.dp} dp): matching, dependencies, collectives, no deadlock (buffered and in-order)")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from pipec.compiler.plan import read_plan

    plan = read_plan(args.file)
    if args.text:
        print(plan.program.text())
        return 0
    if plan.prediction is None:
        raise UsageError(f"{args.file} has no prediction; run `pipec check` or recompile it")
    pred = plan.prediction
    print(f"step time {pred.step_time:g} {pred.time_unit}, bubble {pred.bubble_fraction:.1%}")
    return 0


# ----------------------------------------------------------------------------- parser


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipec", description="Compile, verify, predict and run pipeline schedules.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    c = sub.add_parser("compile", help="compile a schedule into a verified plan.json")
    c.add_argument("--schedule", help="schedule name (gpipe, 1f1b, interleaved_1f1b, looped_bfs, zb_h1, zbv)")
    c.add_argument("--ranks", "--pp", dest="ranks", type=int, help="pp ranks")
    c.add_argument("--microbatches", type=int, help="microbatches per step")
    c.add_argument("--virtual", type=int, help="chunks (virtual stages) per rank")
    c.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    c.add_argument("-o", "--output", default="plan.json", help="where to write the plan (default plan.json)")
    c.set_defaults(func=cmd_compile)

    k = sub.add_parser("check", help="prove a plan.json (exit 0, or 2 with the error)")
    k.add_argument("file")
    k.set_defaults(func=cmd_check)

    s = sub.add_parser("show", help="show a plan's predicted timeline and summary")
    s.add_argument("file")
    s.add_argument("--text", action="store_true", help="print the program in text form instead")
    s.set_defaults(func=cmd_show)
    return p


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {}


def main(argv: Sequence[str] | None = None) -> int:
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
    except ValueError as e:
        if not type(e).__module__.startswith(("pipec.", "__main__")):
            raise
        _err(str(e))
        return 2
    except KeyboardInterrupt:
        _err("interrupted")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
