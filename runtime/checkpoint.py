"""Distributed checkpoints keyed by canonical names: save (asynchronous), commit, validate, resume, retain.

A checkpoint is written with torch.distributed.checkpoint (DCP) by every rank
at once; each rank contributes the state of its own stages under the
unpartitioned model's names, so a checkpoint written under one plan loads
under any other plan of the same model (another pp, dp, schedule or
partition). State keys (DCP joins nested keys with dots):

- ``model.<canonical name>``: parameters (a tied weight once, under its
  canonical name: every copy saves it, DCP keeps one, and every copy loads it)
  and the model's persistent buffers;
- ``optim.state.<canonical>.<name>``, ``optim.param_groups.<canonical>.<key>``:
  optimizer state, flattened per parameter as DCP's state-dict helpers do;

Sharded state (``shard``, runtime/sharding.py) is saved as DTensor shards:
each rank writes only its own (nothing is gathered to one rank), and DCP
reshards on load, so a checkpoint loads under another dp, shard mode or
shard_size too. Under tensor parallelism tp rank 0 writes every tensor whole (a
tensor-parallel part gathered from its tp ranks) and every tp rank loads its part
of it, so a checkpoint loads under another tp too. Both together: a
tensor-parallel part is itself a DTensor over the dp shard group (FSDP2's
parameter, ZeRO-1's or FSDP2's optimizer state), so it is gathered over the
shard group first, then over the tp group, and saved whole as a plain tensor
(every dp replica's tp rank 0 writes the same one: DCP keeps one); on load each
rank slices its tp part of the whole and copies its dp shard of that part, cut
as the DTensor's own placements cut it. The tensors tp leaves whole stay DTensor
shards (written by the tp rank 0 ranks, one whole shard group of them). A
tensor-parallel tensor is thus whole on a rank while it is saved or loaded, as
under tp alone. Every tensor is loaded in place, into the parameters and
optimizer state themselves (hyperparameters come from the plan, not from the
checkpoint's ``param_groups``);
- ``step``: steps done (the data position: data is a function of the step);
- ``rng.rank<r>`` (and ``rng.cuda<r>``): each global rank's torch RNG state, the stream shared by the tp
  ranks of one (pp, dp); ``rng.tp<r>_stage<s>_cpu`` (and ``_device``): stage s's tp stream on that rank, where
  the random ops of its sharded region draw (pipec/tp/rng.py); restored only under the
  same layout (pp, dp and tp) (another layout draws its random numbers in another order
  anyway). A fresh start seeds the shared stream from (seed, tp rank 0's global rank) and each tp
  stream from (seed, global rank, stage), a resharded resume both with the step too, so runs are
  reproducible.

Folder layout under ``checkpoint_dir``::

    step_00000006/               committed: DCP's files and pipec.json (the manifest)
    step_00000009.tmp-a0/        being written by attempt 0; never loaded, removed by the next run
    attempts/run_<id>/attempt_<n>.json   goodput records (runtime/goodput.py)

Atomicity: ranks write into a ``.tmp`` folder; when every rank has finished,
each hashes a share of the files, rank 0 writes the manifest (sizes and
sha256 of every file) and renames the folder into place. A crash at any point
before the rename leaves only a ``.tmp`` folder; a checkpoint whose files no
longer match its manifest (truncated, corrupted) is rejected on load and the
next older valid one is used.

Saving is asynchronous by default (``dcp.async_save`` on a gloo group of its
own): the step is blocked only while the state is copied to host memory;
writing, hashing and the commit run in a background thread.

Why one module of ~770 lines: save, commit, validation, retention and resume
all read and write the same folder layout and manifest, and a change to one
is a change to all.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shutil
import sys
import time
import threading
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from pipec.compiler.config import TrainingConfig
from pipec.errors import PipecError
from pipec.runtime.sharding import OptimizerShards, full, init_optimizer_state, local, optimizer_state

__all__ = [
    "for_run",
    "CheckpointError",
    "Manifest",
    "Checkpointer",
    "MANIFEST",
    "list_checkpoints",
    "is_checkpoint",
    "read_manifest",
    "check_files",
    "validate",
    "model_layout",
]

FORMAT = "pipec.checkpoint/1"
MANIFEST = "pipec.json"
"""The manifest's file name inside a committed checkpoint folder."""

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^step_\d+\.tmp")


class CheckpointError(PipecError):
    """A checkpoint that cannot be used, or a checkpoint setting that cannot hold; the message says which and why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """What a committed checkpoint holds; written last, so its presence marks the commit."""

    step: int
    """Steps done: a run resumed from here continues at this step."""
    total_steps: int
    """The writing run's ``--steps`` (its lr schedule's horizon)."""
    mesh: dict[str, int]
    placement: list[int]
    num_stages: int
    model: dict[str, Any]
    """``target``, ``kwargs`` and ``params`` (the fingerprint of the parameter names, shapes and dtypes)."""
    optimizer: str
    aliases: dict[str, list[str]]
    """Canonical name -> the other names of a tied weight in the unpartitioned model's state dict."""
    files: dict[str, list]
    """File name -> [bytes, sha256 hex digest]."""
    created: float = 0.0
    run_id: str = ""
    attempt: int = 0
    format: str = FORMAT

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Manifest":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


# ----------------------------------------------------------------------------- finding and checking


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Committed-looking checkpoint folders (``step_N``) under ``root``, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is one checkpoint (not a folder of them)."""
    p = Path(path)
    return (p / MANIFEST).exists() or (p / ".metadata").exists() or bool(_STEP_DIR.match(p.name))


def read_manifest(path: str | os.PathLike) -> Manifest:
    path = Path(path)
    mf = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: no such folder")
    try:
        with open(mf, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no {MANIFEST} manifest, so it was never committed (a write cut "
                              "short leaves a .tmp folder, never this); it is not a pipec checkpoint") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: its manifest {MANIFEST} cannot be read ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(f"checkpoint {path}: the manifest's format is {got!r}, expected {FORMAT!r}")
    try:
        return Manifest.from_json(data)
    except TypeError as e:
        raise CheckpointError(f"checkpoint {path}: the manifest is incomplete ({e})") from None


def _digest(path: Path) -> list:
    """[bytes, sha256] of a file, or [-1, reason] when it cannot be read."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return [path.stat().st_size, h.hexdigest()]
    except OSError as e:
        return [-1, e.strerror or str(e)]


def check_files(path: str | os.PathLike, manifest: Manifest, names: list[str] | None = None) -> list[str]:
    """What is wrong with the files of a checkpoint (``names``: a subset; default all), compared with its manifest."""
    path = Path(path)
    problems = []
    for name in names if names is not None else sorted(manifest.files):
        size, sha = manifest.files[name]
        f = path / name
        if not f.exists():
            problems.append(f"file {name} is missing")
            continue
        got = f.stat().st_size
        if got != size:
            problems.append(f"file {name} has {got} bytes, the manifest says {size} (truncated or overwritten)")
            continue
        if _digest(f)[1] != sha:
            problems.append(f"file {name} does not match its sha256 in the manifest (corrupted)")
    return problems


def validate(path: str | os.PathLike) -> Manifest:
    """The manifest of a checkpoint whose every file matches it; else a :class:`CheckpointError`."""
    manifest = read_manifest(path)
    problems = check_files(path, manifest)
    if problems:
        raise CheckpointError(f"checkpoint {path} is corrupt: {'; '.join(problems)}")
    return manifest


def model_layout(target: str, kwargs: Mapping[str, Any]) -> tuple[dict[str, list[str]], set[str]]:
    """Tied aliases (canonical -> other names) and persistent buffer names of the unpartitioned model."""
    from pipec.model.load import instantiate

    model, _ = instantiate(target, kwargs, mode="meta")
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canon = first.setdefault(id(p), name)
        if canon != name:
            aliases.setdefault(canon, []).append(name)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    buffers = set(model.state_dict(keep_vars=True)) - params
    return aliases, buffers


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the checkpointer


@dataclass(frozen=True, slots=True)
class _Pending:
    """A save in flight (asynchronous mode): the commit job in the background thread."""

    step: int
    tmp: Path
    job: Future


class Checkpointer:
    """Saves and restores one rank's share of the training state (see the module doc).

    Every rank of the job constructs one, at the same point (it creates a
    process group), with the stages it owns and their optimizer; ``config``
    is the plan's training config (its seed, optimizer and lr schedule).
    """

    def __init__(self, plan, config: TrainingConfig, modules: Mapping[int, nn.Module],
                 optimizer: torch.optim.Optimizer, *, rank: int, world_size: int, total_steps: int,
                 save_dir: str | None, every: int, keep: int | None, resume: str | None, attempt: int = 0,
                 run_id: str = "", asynchronous: bool = True, timeout: float = 300.0, log=None,
                 shard_mesh=None, tp_group=None) -> None:
        if every < 0:
            raise CheckpointError(f"checkpoint_every must be at least 0, got {every}")
        if every and not save_dir:
            raise CheckpointError("checkpoint_every needs checkpoint_dir; set checkpoint_dir in the schedule file "
                                  "or compile with --checkpoint-dir DIR")
        if keep is not None and keep < 1:
            raise CheckpointError(f"--keep-checkpoints must be at least 1, got {keep}; omit it to keep every checkpoint")
        self.plan = plan
        self.config = config
        self.modules = dict(modules)
        self.optimizer = optimizer
        self.shard_mesh = shard_mesh
        """ZeRO-1's shard group (its optimizer state is saved as DTensor shards over it)."""
        self.tp_group = tp_group
        """This rank's tp process group (tp > 1): tensor-parallel parts are gathered over it to be saved whole."""
        self.rank, self.world_size = rank, world_size
        self.total_steps = total_steps
        self.save_dir = Path(save_dir) if save_dir and every else None
        self.every, self.keep = every, keep
        self.resume, self.attempt, self.run_id = resume, attempt, run_id
        self.asynchronous, self.timeout = asynchronous, timeout
        self.log = log
        self._group = None
        model = plan.model or {}
        self.target, self.kwargs = str(model.get("target")), dict(model.get("kwargs") or {})
        self.aliases, self.buffers = model_layout(self.target, self.kwargs)
        self.canonical = {f"stage{s}.{local}": canon for s, m in self.modules.items()
                          for local, canon in m.canonical.items()}
        self.pending: _Pending | None = None
        self.last_saved: int | None = None
        self.blocked: list[float] = []
        self.committed: list[int] = []

    @property
    def group(self):
        """DCP's collectives (and the async writer thread's) get a gloo group of their own, so they never
        interleave with the training's collectives on other groups. Made on first use (a save or a load:
        every rank reaches those at the same point), so a run that neither saves nor loads keeps no idle
        group polling."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))
        return self._group

    # ------------------------------------------------------------------ state <-> canonical keys

    def _canon(self, fqn: str) -> str | None:
        """Canonical name of a container key (``stage3.lm_head.weight`` -> ``wte.weight``); None: not saved."""
        if fqn in self.canonical:
            return self.canonical[fqn]
        local = fqn.partition(".")[2]
        return local if local in self.buffers else None

    def _params(self) -> tuple[dict[str, nn.Parameter], list[tuple[nn.Parameter, str]]]:
        """Canonical name -> this rank's first copy of the parameter, and every further copy (a tied weight
        held by several of this rank's stages) with its canonical name."""
        first: dict[str, nn.Parameter] = {}
        more: list[tuple[nn.Parameter, str]] = []
        for s, m in sorted(self.modules.items()):
            for local_name, p in m.named_parameters():
                canon = self.canonical[f"stage{s}.{local_name}"]
                if canon in first:
                    more.append((p, canon))
                else:
                    first[canon] = p
        return first, more

    def _layout_matches(self, manifest: Manifest) -> bool:
        mesh = self.plan.mesh
        written = (manifest.mesh.get("pp"), manifest.mesh.get("dp"), manifest.mesh.get("tp", 1))
        return (written == (mesh.pp, mesh.dp, mesh.tp) and list(manifest.placement) == list(self.plan.placement)
                and manifest.num_stages == self.plan.num_stages)

    @property
    def writes_model(self) -> bool:
        """This rank writes its stages' model and optimizer state: tp rank 0 of each (pp, dp) coordinate, which
        saves every tensor-parallel part whole (gathered from its tp ranks, and first over its dp shard group
        under ``shard``: :meth:`_tp_whole`) and the rest as it holds it (whole, or its DTensor shard); the other
        tp ranks write their RNG state alone."""
        return self.plan.mesh.tp_rank(self.rank) == 0

    def _state(self, *, rng: bool, saving: bool = False) -> tuple[dict[str, Any], list[tuple[torch.Tensor, str]]]:
        """The canonical state dict of this rank (its tensors are the live parameters and optimizer state,
        DTensor shards where sharded; a tensor-parallel part is put whole: :meth:`_tp_whole`), and the model
        tensors it leaves out: further tied copies by canonical name. ``saving``: what this rank writes (a tp rank
        above 0 writes its RNG state only, after taking part in the gathers)."""
        model: dict[str, Any] = {}
        copies: list[tuple[torch.Tensor, str]] = []
        for s, m in sorted(self.modules.items()):
            for fqn, value in m.state_dict().items():  # FSDP2 stages give their shards
                canon = self._canon(f"stage{s}.{fqn}")
                if canon is None:
                    continue
                if canon in model:
                    copies.append((value, canon))  # tied copies on one rank: the first (they are equal)
                else:
                    model[canon] = value
        first, _ = self._params()
        optim = optimizer_state(self.optimizer, first, self.shard_mesh)
        state: dict[str, Any] = {"model": model, "optim": optim, "step": 0}
        self._tp_whole(state, first, gather=saving)
        if saving and not self.writes_model:
            state = {"model": {}, "optim": {}, "step": 0}
        if rng:
            state["rng"] = self._rng_state()
        return state, copies

    def _tp_whole(self, state: dict[str, Any], first: Mapping[str, nn.Parameter], *, gather: bool) -> None:
        """Put each tensor-parallel part in ``state`` (a parameter and its optimizer state) whole, so that a
        checkpoint loads under any tp: ``gather`` (saving) the tp ranks' parts; else (loading) an empty whole
        tensor to load into, kept in ``self._tp_parts`` with the live part it is sliced into after the load.

        Under ``shard`` a part is a DTensor over the dp shard group: saving gathers it over that group first
        (its ``full_tensor``), loading copies only this rank's dp shard of the sliced part (:func:`_dp_shard`).
        Memory: each such tensor is whole on the rank while it is saved (until DCP has staged it) or loaded,
        as under tp alone; the dp shard group's gather adds one tp part."""
        self._tp_parts: list[tuple[torch.Tensor, torch.Tensor, Any]] = []
        tp = self.plan.mesh.tp
        if tp == 1:
            return
        from pipec.tp.params import shard_param, unshard

        splits = {sp.name: sp for s in self.modules if self.plan.stages[s].tp is not None
                  for sp in self.plan.stages[s].tp.params}
        for canon, sp in splits.items():
            p = first.get(canon)
            if p is None:
                continue
            keys = [("model", canon)] + [("optim", k) for k, v in state["optim"].items()
                                         if k.startswith(f"state.{canon}.") and isinstance(v, torch.Tensor)
                                         and v.shape == p.shape]
            for part, key in keys:
                live = state[part][key]
                if gather:
                    with torch.no_grad():
                        mine = full(live.detach()).contiguous()  # this rank's tp part (its dp shards gathered)
                    pieces = [torch.empty_like(mine) for _ in range(tp)]
                    dist.all_gather(pieces, mine, group=self.tp_group)
                    del mine
                    state[part][key] = unshard(pieces, sp)
                else:
                    shape = list(live.shape)  # a DTensor's is its whole tp part's
                    shape[sp.dim] *= tp
                    whole = torch.empty(shape, dtype=live.dtype, device=local(live).device)
                    state[part][key] = whole
                    self._tp_parts.append((live, whole, sp))
        self._tp_slice = lambda whole, sp: shard_param(whole, sp, tp, self.plan.mesh.tp_rank(self.rank))

    def _rng_state(self) -> dict[str, torch.Tensor]:
        """This rank's random streams: the shared one (``rank<r>``, ``cuda<r>``) and each stage's tp stream
        (``tp<r>_stage<s>_cpu``, ``_device``: pipec/tp/rng.py), copies."""
        out = {f"rank{self.rank}": torch.get_rng_state()}
        if torch.cuda.is_available():
            out[f"cuda{self.rank}"] = torch.cuda.get_rng_state()
        for s, stream in self._streams().items():
            for kind, t in stream.state().items():
                out[f"tp{self.rank}_stage{s}_{kind}"] = t
        return out

    def _streams(self) -> dict[int, Any]:
        """Each stage's tp stream (pipec/tp/rng.py ``TPStream``: its random ops on shards draw there)."""
        if self.plan.mesh.tp == 1:
            return {}
        from pipec.tp.rng import stream_of

        return {s: st for s, m in sorted(self.modules.items()) if (st := stream_of(m)) is not None}

    # ------------------------------------------------------------------ save

    def after_step(self, steps_done: int) -> None:
        """Save when ``checkpoint_every`` divides the steps done (called after every step)."""
        if self.save_dir is not None and steps_done % self.every == 0:
            self.save(steps_done)

    def finish(self, steps_done: int, *, save: bool = True) -> None:
        """At the end of the run: save the final state (when checkpointing), and wait for every save to commit."""
        if save and self.save_dir is not None and self.last_saved != steps_done:
            self.save(steps_done)
        t = time.perf_counter()
        self.wait()
        if self.log is not None and self.save_dir is not None:
            self.log.blocked(time.perf_counter() - t)

    def save(self, steps_done: int) -> None:
        """Write the state after ``steps_done`` steps; returns once it is staged (async) or committed (sync)."""
        assert self.save_dir is not None
        if self.log is not None:
            self.log.checkpoint_requested(steps_done)
        t = time.perf_counter()
        self.wait()  # one save in flight at a time
        tmp = self.save_dir / f"step_{steps_done:08d}.tmp-a{self.attempt}"
        state, _ = self._state(rng=True, saving=True)
        state["step"] = steps_done
        if self.asynchronous:
            upload = dcp.async_save(state, checkpoint_id=tmp, process_group=self.group)
            self.pending = _Pending(steps_done, tmp, _in_background(self._finish_save, upload, steps_done, tmp))
        else:
            dcp.save(state, checkpoint_id=tmp, process_group=self.group)
            self._commit(steps_done, tmp)
        self.last_saved = steps_done
        blocked = time.perf_counter() - t
        self.blocked.append(blocked)
        if self.log is not None:
            self.log.blocked(blocked)

    def wait(self) -> None:
        """Wait for the save in flight to commit; a failed save is reported and training goes on."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.job.result()
        except Exception as e:  # noqa: BLE001 - a failed checkpoint must not end the run: say so, keep the last one
            if self.rank == 0:
                last = f"step_{self.committed[-1]:08d}" if self.committed else "none"
                _say(f"pipec: warning: the checkpoint of step {pending.step} failed ({type(e).__name__}: {e}); "
                     f"its folder {pending.tmp} is left uncommitted; the newest checkpoint is {last}")

    def _finish_save(self, upload: Future, steps_done: int, tmp: Path) -> None:
        upload.result()  # every rank's files and DCP's .metadata are written
        self._commit(steps_done, tmp)

    def _commit(self, steps_done: int, tmp: Path) -> None:
        """Hash the files (each rank a share), then rank 0 writes the manifest and renames the folder into place."""
        names = sorted(p.name for p in tmp.iterdir() if p.is_file())
        mine = {n: _digest(tmp / n) for n in names[self.rank::self.world_size]}
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.group)
        if self.rank != 0:
            self.committed.append(steps_done)
            return
        files = {n: d for part in gathered for n, d in part.items()}
        bad = [f"{n}: {d[1]}" for n, d in files.items() if d[0] < 0]
        if bad:
            raise CheckpointError(f"checkpoint {tmp}: cannot read back {'; '.join(bad)}")
        manifest = Manifest(
            step=steps_done, total_steps=self.total_steps, mesh=_mesh(self.plan.mesh),
            placement=list(self.plan.placement), num_stages=self.plan.num_stages,
            model={"target": self.target, "kwargs": self.kwargs, "params": self._params_fingerprint()},
            optimizer=self.config.optimizer.name,
            aliases=self.aliases, files=files, created=time.time(), run_id=self.run_id, attempt=self.attempt,
        )
        with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
            json.dump(manifest.to_json(), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        final = _publish(tmp, f"step_{steps_done:08d}")
        self.committed.append(steps_done)
        if self.keep is not None:
            for _, old in list_checkpoints(final.parent)[self.keep:]:
                shutil.rmtree(old, ignore_errors=True)

    def _params_fingerprint(self) -> str | None:
        return ((self.plan.model or {}).get("fingerprint_parts") or {}).get("params")

    # ------------------------------------------------------------------ restore

    def source(self) -> tuple[Path | None, bool]:
        """Where to resume from, and whether the user named it (``--resume``) rather than a restart choosing it.

        After a restart (attempt > 0) the run's own ``checkpoint_dir`` comes
        first, when it holds a checkpoint; then ``--resume``; else the start.
        """
        if self.attempt > 0 and self.save_dir is not None and list_checkpoints(self.save_dir):
            return self.save_dir, False
        if self.resume:
            return Path(self.resume), True
        return None, False

    def restore(self) -> int:
        """Load the newest valid checkpoint (see :meth:`source`) into this rank's stages; returns the start step."""
        src, explicit = self.source()
        if self.rank == 0 and self.save_dir is not None:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            for p in self.save_dir.iterdir():  # writes cut short by an earlier attempt or run
                if p.is_dir() and _TMP_DIR.match(p.name):
                    shutil.rmtree(p, ignore_errors=True)
        if src is not None or self.save_dir is not None:  # wait for rank 0's clean-up before anyone looks
            dist.barrier(group=self.group)
        rejected: set[Path] = set()
        chosen: tuple[Path, Manifest] | None = None
        if src is not None:
            chosen = self._choose(src, explicit, rejected)
        self._check_save_dir(chosen[1].step if chosen else 0, rejected, chosen)
        if chosen is None:
            self._seed_rng(0)
            return 0
        return self._load(*chosen)

    def _seed_rng(self, step: int, streams: Any = None) -> None:
        """A fresh start (or a resharded resume) draws random numbers from (seed, global rank, step): the shared
        stream from tp rank 0's (a region run replicated on the tp ranks of one (pp, dp) must compute the same
        thing), each stage's tp stream (its random ops on shards) from (seed, this rank, stage, step), Megatron's
        two streams. ``streams``: the tp streams to seed, alone (None: every stream)."""
        if streams is None:
            rank = self.rank - self.plan.mesh.tp_rank(self.rank)
            digest = hashlib.sha256(f"pipec-rng:{self.config.seed}:{rank}:{step}".encode()).digest()
            torch.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        from pipec.tp.rng import derived_seed

        for s, stream in (self._streams() if streams is None else streams).items():
            stream.seed(derived_seed("pipec-tp-rng", self.config.seed, self.rank, s, step))

    def _choose(self, src: Path, explicit: bool, rejected: set[Path]) -> tuple[Path, Manifest] | None:
        if not src.exists():
            raise CheckpointError(f"--resume {src}: no such folder; give a checkpoint_dir or one of its step_N folders")
        single = is_checkpoint(src)
        candidates = [src] if single else [p for _, p in list_checkpoints(src)]
        if not candidates:
            if explicit:
                raise CheckpointError(f"--resume {src}: no checkpoint in it (no step_N folder); "
                                      "give the run's checkpoint_dir or one of its step_N folders")
            return None
        reasons: list[str] = []
        for path in candidates:
            problem = self._check_distributed(path)
            if problem is None:
                if reasons and self.rank == 0:
                    _say(f"pipec: warning: {'; '.join(reasons)}; resuming from {path} instead")
                return path, read_manifest(path)
            rejected.add(path)
            reasons.append(problem)
            if single:
                raise CheckpointError(f"{problem}; resume from its parent folder {src.parent} to use the newest "
                                      "valid checkpoint there")
        if self.rank == 0:
            _say(f"pipec: warning: {'; '.join(reasons)}")
        raise CheckpointError(f"{src}: no valid checkpoint ({len(candidates)} rejected, see above); "
                              "remove the corrupt folders, or start afresh with an empty checkpoint_dir")

    def _check_distributed(self, path: Path) -> str | None:
        """Check a checkpoint against its manifest, every rank hashing a share of its files; the problem, or None."""
        try:
            manifest = read_manifest(path)
            names = sorted(manifest.files)
            problems = check_files(path, manifest, names[self.rank::self.world_size])
        except CheckpointError as e:
            problems = [str(e)]
            manifest = None
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, problems, group=self.group)
        found = sorted({p for part in gathered for p in part})
        if not found:
            assert manifest is not None
            return self._compatible(path, manifest)
        if manifest is None:
            return found[0]
        return f"checkpoint {path} is corrupt: {'; '.join(found)}"

    def _compatible(self, path: Path, manifest: Manifest) -> str | None:
        mine = self._params_fingerprint()
        theirs = manifest.model.get("params")
        if (mine and theirs and mine != theirs) or manifest.model.get("target") != self.target:
            raise CheckpointError(
                f"checkpoint {path} was written for the model {manifest.model.get('target')} "
                f"{manifest.model.get('kwargs')}, whose parameters (names, shapes, dtypes) differ from this plan's "
                f"{self.target} {self.kwargs}; resume from a checkpoint of this model, or compile the plan for that one")
        mine_opt = self.config.optimizer.name
        if manifest.optimizer != mine_opt:
            raise CheckpointError(f"checkpoint {path} holds {manifest.optimizer} optimizer state, this plan's optimizer "
                                  f"is {mine_opt}; use the same optimizer to resume")
        return None

    def _load(self, path: Path, manifest: Manifest) -> int:
        rng = self._layout_matches(manifest)
        first, more = self._params()
        init_optimizer_state(self.optimizer, [p for s in sorted(self.modules) for p in self.modules[s].parameters()])
        state, copies = self._state(rng=rng)
        if rng:  # what the checkpoint holds of this rank's streams (one written before the tp streams, or on a host
            # without the device, holds fewer): the others start afresh below
            saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
            state["rng"] = {k: v for k, v in state["rng"].items() if f"rng.{k}" in saved}
        # hyperparameters are the plan's: only the optimizer's tensors (and its step counts) are loaded
        state["optim"] = {k: v for k, v in state["optim"].items() if k.startswith("state.")}
        dcp.load(state, checkpoint_id=path, process_group=self.group)  # in place, resharded as needed
        with torch.no_grad():  # a tensor-parallel part is sliced from its whole tensor
            for live, whole, sp in self._tp_parts:
                local(live).copy_(_dp_shard(self._tp_slice(whole, sp), live))
                if whole is state["model"].get(sp.name):
                    state["model"][sp.name] = live
        with torch.no_grad():  # every further tied copy takes its canonical value, and its optimizer state
            for value, canon in copies:
                local(value).copy_(local(state["model"][canon]))
            for p, canon in more:
                src = _opt_state(self.optimizer, first[canon])
                for key, t in _opt_state(self.optimizer, p).items():
                    if isinstance(t, torch.Tensor):
                        local(t).copy_(local(src[key]))
        step = int(state["step"])
        if rng:
            torch.set_rng_state(state["rng"][f"rank{self.rank}"])
            if torch.cuda.is_available() and f"cuda{self.rank}" in state["rng"]:
                torch.cuda.set_rng_state(state["rng"][f"cuda{self.rank}"])
            afresh = {}
            for s, stream in self._streams().items():
                kept = {kind: state["rng"].get(f"tp{self.rank}_stage{s}_{kind}") for kind in stream.state()}
                if None in kept.values():
                    afresh[s] = stream
                else:
                    stream.set_state(kept)
            self._seed_rng(step, afresh)
        else:
            self._seed_rng(step)
        if self.rank == 0:
            resharded = not rng or _mesh(self.plan.mesh) != manifest.mesh
            shard = f" shard {manifest.mesh['shard']}" if "shard" in manifest.mesh else ""
            tp = f" x tp {manifest.mesh['tp']}" if manifest.mesh.get("tp", 1) > 1 else ""
            note = "" if not resharded else (
                f" (written under pp {manifest.mesh['pp']} x dp {manifest.mesh['dp']}{tp}{shard}, {manifest.num_stages} "
                f"stage{'s' if manifest.num_stages != 1 else ''}: resharded{'' if rng else '; RNG streams start afresh'})")
            _say(f"pipec: resumed from {path} at step {step}{note}")
            lr_sched = self.config.lr_schedule.name
            if manifest.total_steps != self.total_steps and lr_sched != "constant":
                _say(f"pipec: warning: the checkpoint's run had {manifest.total_steps} steps, this one has "
                     f"{self.total_steps}: the {lr_sched} lr schedule continues on the new horizon")
        self.last_saved = step if self.save_dir is not None and path.parent == self.save_dir else None
        return step

    def _check_save_dir(self, start: int, rejected: set[Path], chosen) -> None:
        """Saving into a checkpoint_dir that holds another timeline's checkpoints would mix two runs: refuse."""
        if self.save_dir is None:
            return
        others = [(step, p) for step, p in list_checkpoints(self.save_dir)
                  if p not in rejected and (chosen is None or p != chosen[0])]
        if chosen is None and others:
            raise CheckpointError(
                f"checkpoint_dir {self.save_dir} already holds checkpoints (newest {others[0][1].name}) of an earlier "
                f"run; resume it with --resume {self.save_dir}, or use an empty checkpoint_dir")
        newer = [p.name for step, p in others if step >= start]
        if chosen is not None and newer:
            raise CheckpointError(
                f"checkpoint_dir {self.save_dir} holds checkpoints at or beyond step {start} ({', '.join(newer)}) "
                f"that this run, resumed from {chosen[0]}, would mix with its own; resume from {self.save_dir} "
                "itself, or use an empty checkpoint_dir")

    def stats(self) -> dict[str, Any]:
        """What the saves cost this attempt (for report.json's goodput)."""
        out: dict[str, Any] = {"mode": "async" if self.asynchronous else "sync", "saves": len(self.blocked),
                               "committed": list(self.committed)}
        if self.blocked:
            out["blocked_s"] = {"mean": sum(self.blocked) / len(self.blocked), "max": max(self.blocked),
                                "total": sum(self.blocked)}
        return out


def for_run(plan, config: TrainingConfig, options, env, modules, optimizer, total_steps: int, *, shard_mesh=None,
            tp_group=None):
    """The trainer's checkpointer (None under ``--emulate``: no state) and this attempt's goodput log.

    ``options`` are the run's :class:`~pipec.runtime.launch.RunOptions`. Every rank calls this at
    the same point (a save or a load creates the checkpointer's process group). ``shard_mesh``: the
    DeviceMesh of this rank's shard group (ZeRO-1 saves its optimizer state as DTensor shards over it).
    """
    from pipec.runtime.goodput import AttemptLog

    every = config.checkpoint_every
    save_dir = config.checkpoint_dir if every else None
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    log = AttemptLog(save_dir, attempt=env.attempt, run_id=run_id, write=env.rank == 0)
    if not every and env.rank == 0 and (options.keep_checkpoints is not None or options.sync_checkpoints):
        print("pipec: warning: --keep-checkpoints and --sync-checkpoints do nothing here: the plan writes no "
              "checkpoints; compile it with --checkpoint-dir DIR --checkpoint-every N", file=sys.stderr, flush=True)
    if options.emulate:  # RunOptions refuses --resume with it
        return None, log
    ckpt = Checkpointer(plan, config, modules, optimizer, rank=env.rank, world_size=env.world_size,
                        total_steps=total_steps, save_dir=save_dir, every=every, keep=options.keep_checkpoints,
                        resume=options.resume, attempt=env.attempt, run_id=run_id, timeout=options.timeout, log=log,
                        asynchronous=not options.sync_checkpoints, shard_mesh=shard_mesh, tp_group=tp_group)
    return ckpt, log


def _mesh(mesh) -> dict[str, Any]:
    """A manifest's ``mesh``: pp and dp (and tp above 1), and how the state is sharded when it is."""
    out: dict[str, Any] = {"pp": mesh.pp, "dp": mesh.dp}
    if mesh.tp > 1:
        out["tp"] = mesh.tp
    if mesh.sharded:
        out |= {"shard": mesh.shard, "shard_size": mesh.num_shards}
    return out


def _dp_shard(part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``part`` as the DTensor ``like`` holds its own (FSDP2's and ZeRO-1's dim-0 chunks,
    uneven ones included, cut by ``like``'s placements, no collective); ``part`` itself when ``like`` is a plain
    tensor."""
    if not isinstance(like, DTensor):
        return part
    return distribute_tensor(part, like.device_mesh, like.placements, src_data_rank=None).to_local()


def _opt_state(optimizer, p: nn.Parameter) -> dict[str, Any]:
    """The optimizer state of parameter ``p`` (ZeRO-1: of the rows of it this rank steps)."""
    if isinstance(optimizer, OptimizerShards):
        return optimizer.state[optimizer.shard_of[id(p)]]
    return optimizer.state[p]


def _publish(tmp: Path, name: str) -> Path:
    """The commit: rename a written checkpoint folder into place (replacing a rejected one of the same step)."""
    final = tmp.with_name(name)
    if final.exists():
        old = final.with_name(f"{name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


def _in_background(fn, *args) -> Future:
    """Run ``fn(*args)`` in a daemon thread (a rank that dies mid-save must not wait for it at exit)."""
    future: Future = Future()

    def body() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            future.set_exception(e)

    threading.Thread(target=body, name="pipec-checkpoint", daemon=True).start()
    return future


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
