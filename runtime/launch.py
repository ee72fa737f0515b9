"""Launching a run, both sides: the ranks started (:func:`start_ranks`, what ``pipec run`` and ``pipec tune
--measure`` call) and the torchrun entry point each rank runs: ``torchrun --nproc-per-node N -m pipec.runtime
plan.json [flags]``.

:func:`start_ranks` runs torch's own launcher in this process; each rank reads and proves the plan before it touches the network, joins the
process group (every group with an explicit timeout; a per-attempt store
prefix so that restarted ranks never meet stale addresses), builds only its
own stages, and runs the steps through the executor. Rank 0 collects every
rank's measurements, prints live progress and writes report.json and the
measured trace.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator, Mapping, Sequence, TextIO

from pipec.errors import PipecError, RunFailed
from pipec.runtime.failures import RankFailed, RankReport, deliver, linger_when_stopped

__all__ = ["main", "run_parser", "add_run_flags", "RunOptions", "LaunchError", "Env",
           "init_process_group", "plan_transport", "start_ranks", "RENDEZVOUS_FLAGS", "TimeLimitExceeded"]

DEFAULT_TIMEOUT = 300.0
"""Seconds a rank waits on a peer before the whole job ends (torch's default would be 30 minutes)."""
DEFAULT_UNIT_TIME = 0.01
"""Seconds per cost unit with --emulate."""

LINGER_S = 5.0
"""Seconds a rank the launcher stops (another rank failed) goes on, so that its own error is reported too."""
STOP_GRACE_S = 5.0
"""Seconds past :data:`LINGER_S` a rank stopped at a run's time limit is given before it is killed."""

RENDEZVOUS_FLAGS = ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "master_addr", "master_port")
"""torchrun's multi-node flags, which ``pipec run`` passes through (:func:`start_ranks`)."""

KNOWN_PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "V100": 125e12}
"""Dense bf16/fp16 tensor-core FLOP/s of known GPUs, by a substring of the device name."""


def run_parser(prog: str = "pipec.runtime") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run a compiled plan on this rank (under torchrun).")
    add_run_flags(p)
    return p


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """The flags ``pipec run`` and ``python -m pipec.runtime`` share."""
    p.add_argument("plan", help="plan.json from `pipec compile`")
    p.add_argument("--steps", type=int, help="training steps (overrides the plan's)")
    p.add_argument("--check", action="store_true",
                   help="after the first step, compare loss and every gradient with an unpartitioned single-process step")
    p.add_argument("--baseline", action="store_true",
                   help="after the steps, time the unpartitioned model's step on the whole batch on rank 0: the "
                        "scaling efficiency is then against a measured single device")
    p.add_argument("--emulate", action="store_true",
                   help="sleep for each compute instruction's predicted cost instead of computing")
    p.add_argument("--unit-time", type=float, default=DEFAULT_UNIT_TIME,
                   help=f"seconds per cost unit with --emulate (default {DEFAULT_UNIT_TIME:g})")
    p.add_argument("--report", metavar="FILE", help="write report.json here")
    p.add_argument("--trace", metavar="FILE", help="write the measured Perfetto trace here")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds a rank waits for a peer before the job ends (default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--resume", metavar="DIR", help="resume from the newest checkpoint in DIR")
    p.add_argument("--keep-checkpoints", type=int, default=None, metavar="N", help="keep the newest N checkpoints")
    p.add_argument("--sync-checkpoints", action="store_true",
                   help="block each step until its checkpoint is written (default: training goes on once the state "
                        "is copied to host memory)")
    p.add_argument("--fail-at", metavar="STEP:RANK", help="kill global rank RANK in step STEP (from 1, as the progress lines count; first attempt only)")
    p.add_argument("--peak-flops", type=float, help="device peak FLOP/s for MFU (known GPUs are detected)")
    p.add_argument("--quiet", action="store_true", help="no per-step progress lines")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOptions:
    """What a run takes on top of the plan: the flags of :func:`add_run_flags`, parsed and checked once.

    Each field is the flag of the same name (``--unit-time`` for ``unit_time``).
    """

    plan: str
    """The plan.json file."""
    steps: int | None = None
    """Training steps, overriding the plan's; None: the plan's (:meth:`num_steps`)."""
    check: bool = False
    """After the first step, compare loss and every gradient with an unpartitioned single-process step."""
    baseline: bool = False
    """After the steps, time one device's step (the unpartitioned model on the whole batch, on rank 0:
    runtime/baseline.py), the single device the scaling efficiency is measured against."""
    emulate: bool = False
    """Sleep for each compute instruction's predicted cost instead of computing."""
    unit_time: float = DEFAULT_UNIT_TIME
    """Seconds per cost unit of a plan whose costs are units (schedule-only, or ``costs unit``) with --emulate."""
    report: str | None = None
    """Where rank 0 writes report.json; None: nowhere."""
    trace: str | None = None
    """Where rank 0 writes the measured Perfetto trace; None: nowhere."""
    timeout: float = DEFAULT_TIMEOUT
    """Seconds a rank waits for a peer before the job ends."""
    resume: str | None = None
    """A checkpoint_dir (its newest valid checkpoint) or one checkpoint folder to resume from."""
    keep_checkpoints: int | None = None
    """Keep the newest N checkpoints; None: every one."""
    sync_checkpoints: bool = False
    """Block each step until its checkpoint is written (not only copied to host memory)."""
    fail_at: tuple[int, int] | None = None
    """(step, global rank) to kill at that step, on the first attempt only (fault injection)."""
    peak_flops: float | None = None
    """Device peak FLOP/s for MFU; None: the plan's, else a known GPU's."""
    quiet: bool = False
    """No per-step progress lines."""

    def __post_init__(self) -> None:
        for ok, message in (
            (self.steps is None or self.steps >= 1, f"--steps must be at least 1, got {self.steps}"),
            (self.timeout > 0, f"--timeout must be positive, got {self.timeout:g}"),
            (self.unit_time > 0, f"--unit-time must be positive, got {self.unit_time:g}"),
            (not (self.check and self.emulate),
             "--check compares real gradients: it cannot be combined with --emulate"),
            (not (self.baseline and self.emulate),
             "--baseline times the model's real step on one device: it cannot be combined with --emulate"),
            (not (self.resume and self.emulate),
             "--resume loads trained state, but --emulate trains nothing; drop one of them"),
        ):
            if not ok:
                raise LaunchError(message)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RunOptions":
        """The options of parsed flags (``pipec run``'s own, such as ``--nproc``, are left out)."""
        given = {f.name: getattr(args, f.name) for f in fields(cls)}
        return cls(**{**given, "fail_at": _fail_at(args.fail_at)})

    def flags(self) -> list[str]:
        """These options as flags for the ranks' command line (the plan apart; defaults left out)."""
        out: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            flag = f"--{f.name.replace('_', '-')}"
            if value is True:
                out.append(flag)
            elif f.name != "plan" and value != f.default:
                out += [flag, ":".join(map(str, value)) if f.name == "fail_at" else str(value)]
        return out

    def num_steps(self, config) -> int:
        """The run's steps: ``--steps``, else the plan's (``config``: its TrainingConfig)."""
        return self.steps if self.steps is not None else config.steps


class LaunchError(PipecError):
    """A run that cannot start; the message says why and how to fix it."""


@dataclass(frozen=True)
class Env:
    rank: int
    world_size: int
    local_rank: int
    attempt: int


def _env() -> Env:
    try:
        return Env(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)),
                   int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    except KeyError as e:
        raise LaunchError(f"{e.args[0]} is not set: start ranks with `pipec run plan.json --nproc N` or "
                          "`torchrun --nproc-per-node N -m pipec.runtime plan.json`") from None


def _fail_at(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        step, rank = text.split(":")
        return int(step), int(rank)
    except ValueError:
        raise LaunchError(f"--fail-at {text!r}: expected STEP:RANK, e.g. --fail-at 2:1") from None


def init_process_group(env: Env, timeout: float):
    """The world process group, on a per-attempt store prefix; returns (backend, device)."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    device = torch.device("cuda", env.local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    td = datetime.timedelta(seconds=timeout)
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    tcp = dist.TCPStore(addr, port, env.world_size, is_master=(not agent_store and env.rank == 0), timeout=td)
    # a restarted attempt must not read the addresses an earlier attempt left in the store
    store = dist.PrefixStore(f"pipec/attempt_{env.attempt}", tcp)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=td)
    return backend, device


def plan_transport(plan, env: Env, timeout: float, backend: str, device):
    """The DeviceMesh of this plan and every group a rank of it uses, each with an explicit timeout.

    The mesh's dims are ``pp``, ``dp`` and ``tp`` (innermost: global rank = (pp x dp + dp rank) x tp + tp
    rank), or under HSDP (``shard_size`` < dp) ``pp``, ``dp_replicate``, ``dp_shard`` and ``tp`` (shard
    groups are consecutive dp ranks); dims of size 1 are left out. Each dim's group holds the ranks that
    differ only in it: the pp group (the p2p peers and the grad clip) and the dp groups keep the tp rank.
    The transport's ``shard_mesh`` is the 1-D mesh of this rank's shard group (FSDP2 and ZeRO-1 work over
    it), its ``tp_mesh`` / ``tp_group`` this rank's tp group (None at tp 1), for the stages the tensor-parallel
    pass shards.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipec.runtime.transport import TorchTransport

    td = datetime.timedelta(seconds=timeout)
    opts = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    opts._timeout = td  # subgroups do not inherit the world group's timeout
    mesh = plan.mesh
    P, D, T = mesh.pp, mesh.dp, mesh.tp
    pp_rank, dp_rank = mesh.coords(env.rank)
    tp_rank = mesh.tp_rank(env.rank)
    hybrid = mesh.hybrid
    S = mesh.num_shards if hybrid else D
    # dims of size 1 are left out, but for HSDP's shard dim (shard_size 1: FSDP2 over a mesh of one rank)
    dims = [(name, size) for name, size in (("pp", P), *((("dp_replicate", D // S), ("dp_shard", S)) if hybrid
                                                         else (("dp", D),)), ("tp", T))
            if size > 1 or name == "dp_shard"]
    # each dim's group, by the dp-group name the plan's instructions use
    ranks_of = {"pp": mesh.pp_group(env.rank), "dp": tuple(mesh.replicas(pp_rank, tp_rank)),
                "tp": mesh.tp_group(env.rank)}
    if hybrid:
        ranks_of |= {f"dp_{g}": tuple(mesh.group_ranks(f"dp.{g}", env.rank)) for g in ("shard", "replicate")}
    groups: dict[tuple[int, ...], Any] = {}
    device_mesh = None
    if len(dims) == 1:
        # one axis spans the world: a 1-D mesh reuses the world group (every idle gloo group costs a
        # polling thread), whose timeout init_process_group set
        device_mesh = init_device_mesh(device.type, (mesh.world_size,), mesh_dim_names=(dims[0][0],))
    elif dims:
        names = tuple(name for name, _ in dims)
        device_mesh = init_device_mesh(device.type, tuple(size for _, size in dims), mesh_dim_names=names,
                                       backend_override=dict.fromkeys(names, (backend, opts)))
    for name, size in dims:
        if size > 1:
            groups[ranks_of[name]] = device_mesh[name].get_group()
    if hybrid and (P > 1 or T > 1):  # the whole dp group too (ZeRO-1 all-reduces gradients over it): one per (pp, tp)
        mine, _ = dist.new_subgroups_by_enumeration([list(mesh.replicas(p, t)) for p in range(P) for t in range(T)],
                                                    timeout=td, backend=backend)
        groups[ranks_of["dp"]] = mine
    elif hybrid:
        groups[ranks_of["dp"]] = dist.group.WORLD
    shard_mesh = device_mesh["dp_shard" if hybrid else "dp"] if mesh.sharded else None
    tp_mesh = device_mesh["tp"] if T > 1 else None
    # tie groups: one per (dp, tp) replica of the pipeline; every rank creates every group, in the same order
    for tie in plan.ties:
        members = plan.tie_ranks(tie.name)
        if len(members) < 2:
            continue
        for d in range(D):
            for t in range(T):
                ranks = [mesh.global_rank(p, d, t) for p in members]
                g = dist.new_group(ranks, timeout=td, backend=backend)
                if env.rank in ranks:
                    groups[tuple(ranks)] = g
    return TorchTransport(groups, shard_mesh=shard_mesh, tp_mesh=tp_mesh)


def _peak_flops(options: RunOptions, config) -> float | None:
    """``--peak-flops``, else the plan's ``peak_flops``, else a known GPU's."""
    import torch

    given = options.peak_flops or config.peak_flops
    if given:
        return given
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, value in KNOWN_PEAKS.items():
            if key in name:
                return value
    return None


def _peak_memory(device) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def run(args: argparse.Namespace, env: Env) -> int:
    import torch.distributed as dist

    from pipec.compiler.config import TrainingConfig
    from pipec.compiler.ir.plan_json import read_plan
    from pipec.compiler.passes.verify import verify
    from pipec.runtime.executor import RunError
    from pipec.runtime.trainer import Trainer

    plan = read_plan(args.plan)
    verify(plan)  # a plan that fails its proofs is never launched
    from pipec.compiler.ir.plan import world_text

    world = plan.mesh.world_size
    if env.world_size != world:
        raise LaunchError(f"the plan needs {world_text(plan.mesh)} ranks, but {env.world_size} were started; "
                          f"use --nproc {world} (or recompile for {env.world_size} ranks)")
    if plan.model is None and not args.emulate:
        raise LaunchError(f"{args.plan} is a schedule-only plan (no model): it runs only with --emulate")
    options = RunOptions.from_args(args)
    config = TrainingConfig.from_spec(plan.spec)  # a malformed training setting is refused before the network
    backend, device = init_process_group(env, args.timeout)
    trainer = transport = None
    try:
        transport = plan_transport(plan, env, args.timeout, backend, device)
        trainer = Trainer(plan, config, options, env, transport, device, peak_flops=_peak_flops(options, config),
                          peak_memory=lambda: _peak_memory(device))
        return trainer.train()
    except RuntimeError as e:  # a peer died or timed out outside an instruction (between steps)
        raise RankFailed(plan.mesh.where(env.rank), RunError(f"between steps: {type(e).__name__}: {e}")) from e
    except PipecError as e:  # a RunError names the instruction too; main() reports it
        raise RankFailed(plan.mesh.where(env.rank), e) from e
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # The trainer's reference cycles hold process groups (and their gloo threads): free them now, while the
        # interpreter is whole; freed during its shutdown instead, gloo can abort the process ("terminate called
        # without an active exception").
        trainer = transport = None
        gc.collect()


def main(argv: Sequence[str] | None = None) -> int:
    args = run_parser().parse_args(argv)
    try:
        env = _env()
    except LaunchError as e:
        print(f"pipec: error: {e}", file=sys.stderr)
        return 2
    linger_when_stopped(LINGER_S)
    try:
        return run(args, env)
    except PipecError as e:  # every rank reports its own error (runtime/failures.py); `pipec run` prints each once
        where = e.where if isinstance(e, RankFailed) else f"global rank {env.rank}"
        deliver(RankReport.of(e, rank=env.rank, where=where))
        return e.exit_code


# ----------------------------------------------------------------------------- the launcher's side


class TimeLimitExceeded(RunFailed):
    """The ranks :func:`start_ranks` started ran past its ``time_limit`` (they were stopped)."""


def start_ranks(where: Callable[[int], str], options: RunOptions, *, nproc: int, max_restarts: int = 0,
                rendezvous: Mapping[str, Any] | None = None, verbose: bool = False, log_dir: str | None = None,
                time_limit: float | None = None, errors: TextIO | None = None) -> int:
    """Start ``nproc`` ranks of the plan ``options.plan`` on this machine with torch's own launcher, in this
    process; 0, or the exit code of the failure, every rank's error printed once on ``errors``, else stderr
    (:func:`~pipec.runtime.failures.summarise`, ``where`` naming a global rank: the plan's ``Mesh.where``).

    The caller has read and proven the plan. ``rendezvous``: torchrun's multi-node flags by name
    (:data:`RENDEZVOUS_FLAGS`, None values left out); none: this machine alone (``--standalone``).
    ``verbose``: torchrun's own log lines shown. ``log_dir``: the ranks' stdout and stderr go to files
    under it instead of this process's. ``time_limit``: seconds after which the ranks are stopped (found
    in /proc: Linux) and :class:`TimeLimitExceeded` is raised. The launcher's signal handlers and
    environment are this process's own again afterwards.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from pipec.runtime.failures import quiet_launcher, summarise

    argv = ["--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts)]
    given = {flag: value for flag, value in (rendezvous or {}).items() if value is not None}
    if given:
        for flag, value in given.items():
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    else:
        argv.append("--standalone")
    if log_dir is not None:
        argv += ["--redirects", "3", "--log-dir", log_dir]
    argv += ["-m", "pipec.runtime", options.plan, *options.flags()]
    try:
        with _launcher_state_kept(), quiet_launcher(verbose), _time_limit(time_limit):
            run(parse_args(argv))
    except ChildFailedError as e:  # every rank's error, keyed by global rank: each message once, causes first
        return summarise(e.failures, where, errors)
    return 0


_LAUNCHER_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
                          if hasattr(signal, name))
"""The signals torch's launcher takes over in the main thread (and leaves taken over)."""


@contextlib.contextmanager
def _launcher_state_kept() -> Iterator[None]:
    """This process's signal handlers and environment as they were before torch's launcher ran (it installs
    handlers that raise its own exception, and sets ``OMP_NUM_THREADS`` for its ranks in ``os.environ``)."""
    import threading

    main = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.getsignal(sig) for sig in _LAUNCHER_SIGNALS} if main else {}
    environ = dict(os.environ)
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        for key, value in environ.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


@contextlib.contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    """Once ``seconds`` have passed, stop the ranks this process started, and any it starts later, until the
    block ends; then raise :class:`TimeLimitExceeded` in place of what the block ended with (the launcher's
    failure: its ranks ended). Torch's launcher is never interrupted (an exception raised into it while it
    starts its ranks loses them), it sees its ranks end. Each rank gets SIGTERM once (it reports within
    :data:`LINGER_S`), then SIGKILL."""
    if seconds is None:
        yield
        return
    import threading

    done, expired = threading.Event(), threading.Event()

    def watch() -> None:
        if done.wait(seconds):
            return
        expired.set()
        stopped: dict[int, float] = {}   # rank -> when it was sent SIGTERM
        while not done.is_set():
            now = time.monotonic()
            for pid in _rank_children():
                if pid not in stopped:
                    stopped[pid], sig = now, signal.SIGTERM
                elif now - stopped[pid] > LINGER_S + STOP_GRACE_S:
                    sig = signal.SIGKILL
                else:
                    continue
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            done.wait(0.1)

    watcher = threading.Thread(target=watch, name="pipec-time-limit", daemon=True)
    watcher.start()
    try:
        yield
    except Exception:
        done.set()
        watcher.join()
        if expired.is_set():
            raise TimeLimitExceeded(f"the run took over {seconds:.0f} s") from None
        raise
    done.set()
    watcher.join()
    if expired.is_set():
        raise TimeLimitExceeded(f"the run took over {seconds:.0f} s")


def _rank_children() -> list[int]:
    """The running processes this one started that run a rank (``-m pipec.runtime``), from /proc (none where
    there is no /proc)."""
    me, out = os.getpid(), []
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    state, ppid = f.read().rpartition(b")")[2].split()[:2]
                if int(ppid) != me or state == b"Z":
                    continue
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if b"pipec.runtime" in f.read().split(b"\0"):
                        out.append(int(name))
            except (OSError, ValueError):
                continue                # ended meanwhile
    return out
