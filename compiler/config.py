"""The training settings of a plan, typed: the one source of their defaults.

:class:`TrainingConfig` holds what a run trains with (steps, seed, optimizer,
learning rate and its schedule, clipping, dtype, recompute, data, loss,
checkpoints, initial weights). Its field defaults are the defaults: the
language's key table (:mod:`pipec.dsl.keys`) takes these keys' defaults from
:data:`DEFAULTS`, and the runtime reads plan.json's ``spec`` with
:meth:`TrainingConfig.from_spec`, which checks every field with the schema
reader (a malformed one is a :class:`~pipec.compiler.ir.schema.SchemaError`
naming it, ``plan.spec.lr: ...``) and fills in the fields an older plan lacks.

Torch-free, like the rest of the compiler outside ``compiler/frontend/``; the
language may import it, never the reverse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Callable, Mapping

from pipec.compiler.ir.schema import Reader, SchemaError
from pipec.compiler.limits import MAX_SEED, MAX_STAGES

__all__ = [
    "TrainingConfig",
    "Optimizer",
    "LRSchedule",
    "DEFAULTS",
    "OPTIMIZER_SETTINGS",
    "LR_SCHEDULES",
    "RUN_DTYPES",
    "INITS",
    "TokenData",
    "TOKEN_DTYPES",
]

OPTIMIZER_SETTINGS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "adamw": MappingProxyType({"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}),
    "adam": MappingProxyType({"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}),
    "sgd": MappingProxyType({"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False}),
})
"""Optimizer name -> its settings and their defaults (torch's names and defaults; the learning rate apart)."""

LR_SCHEDULES = ("constant", "cosine", "linear")
RUN_DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a run computes in (float32, or autocast to one of the others)."""
INITS = ("auto", "module", "exact")
"""``init``: ``auto`` is resolved to ``module`` or ``exact`` by ``pipec compile`` (the model front end)."""
TOKEN_DTYPES = ("uint8", "uint16", "int16", "uint32", "int32", "int64")
"""The element types a token file may hold (uint16 holds a vocabulary up to 65,536)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenData:
    """``data tokens("train.bin", dtype=uint16)``: a flat file of token ids written back to back (the
    nanoGPT layout), read memory-mapped in windows of seq + 1 tokens (:mod:`pipec.runtime.data`)."""

    path: str
    """The file, absolute (the language resolves it from the schedule file's folder)."""
    dtype: str = "uint16"
    """Its element type, one of :data:`TOKEN_DTYPES`."""

    def text(self) -> str:
        return f'tokens("{self.path}", dtype={self.dtype})'

    def to_json(self) -> dict[str, Any]:
        return {"kind": "tokens", "path": self.path, "dtype": self.dtype}


@dataclass(frozen=True, slots=True)
class Optimizer:
    """The optimizer and its settings, every setting filled in (torch's names)."""

    name: str
    """``"adamw"``, ``"adam"`` or ``"sgd"`` (:data:`OPTIMIZER_SETTINGS`)."""
    settings: tuple[tuple[str, Any], ...] = ()
    """(setting, value) pairs in the table's order; ``betas`` is a tuple."""

    @classmethod
    def of(cls, name: str, **settings: Any) -> "Optimizer":
        """``name`` with the given settings, the others at their defaults."""
        return cls(name, tuple({**OPTIMIZER_SETTINGS[name], **settings}.items()))

    @property
    def kwargs(self) -> dict[str, Any]:
        """The settings as keyword arguments for the torch optimizer (lr apart)."""
        return dict(self.settings)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, **{k: list(v) if isinstance(v, tuple) else v for k, v in self.settings}}


@dataclass(frozen=True, slots=True)
class LRSchedule:
    """Learning rate over steps: ``warmup`` steps of linear ramp from 0, then
    ``constant``, or a ``cosine``/``linear`` decay to ``min_lr`` at the last step."""

    name: str
    """One of :data:`LR_SCHEDULES`."""
    warmup: int = 0
    """Steps of linear ramp from 0 to the peak lr."""
    min_lr: float = 0.0
    """Where a decay ends (at the last step); unused by ``constant``."""

    def factor(self, step: int, num_steps: int, base_lr: float) -> float:
        """The multiplier of ``base_lr`` at ``step`` (0-based) of a run of ``num_steps``."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.name == "constant":
            return 1.0
        floor = self.min_lr / base_lr if base_lr else 0.0
        progress = min(1.0, (step - self.warmup) / max(1, num_steps - self.warmup - 1))
        if self.name == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * (1 - progress)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "warmup": self.warmup}
        if self.name != "constant":
            out["min_lr"] = self.min_lr
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingConfig:
    """What a run of the plan trains with: plan.json's training keys, typed (see the module doc).

    Each field is the key of the same name (``docs/reference.md`` has its
    full meaning); the defaults here are the keys' defaults.
    """

    steps: int = 10
    """Optimizer steps a run takes (``pipec run --steps`` overrides it)."""
    seed: int = 0
    """Seed of the initial weights, the synthetic data and each rank's RNG."""
    optimizer: Optimizer = Optimizer.of("adamw")
    """The optimizer and its settings (AdamW at torch's defaults, weight decay 0.01)."""
    lr: float = 3e-4
    """Peak learning rate."""
    lr_schedule: LRSchedule = LRSchedule("constant")
    """The learning rate over the steps: warm-up, then constant or a decay to ``min_lr``."""
    grad_clip: float | None = None
    """Clip the global gradient norm to this before each step; None: no clipping."""
    dtype: str = "float32"
    """Compute dtype: float32, or autocast to bfloat16 or float16 (float32 master weights)."""
    recompute: tuple[int, ...] = ()
    """Stages that save only their inputs and run their forward again in the backward."""
    data: str | TokenData = "synthetic"
    """Training data: ``synthetic`` (derived from the model and the loss at compile time), a token file
    (:class:`TokenData`), or ``pkg.module:fn(step, dp_rank, dp_size)`` returning ``(inputs, targets)``."""
    loss: str = "cross_entropy"
    """Loss of the last stage: ``cross_entropy``, ``mse`` or ``pkg.module:fn(output, target)``."""
    checkpoint_dir: str | None = None
    """Folder of the run's distributed checkpoints; None: none are written."""
    checkpoint_every: int = 0
    """Write a checkpoint every N steps; 0 writes none (above 0 needs ``checkpoint_dir``)."""
    init: str = "auto"
    """Initial weights: ``module`` (each module's init path, seeded by name), ``exact`` (the factory's), or
    ``auto`` (an older plan's or an unresolved one: the ranks resolve it as the compiler does)."""
    peak_flops: float | None = None
    """The device's peak FLOP/s as compiled (the run's MFU uses it unless ``--peak-flops`` is given)."""

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], where: str = "plan.spec") -> "TrainingConfig":
        """The config of plan.json's ``spec``: each field checked, a missing (or null) one at its default."""
        rd = Reader(dict(spec), where)
        given = {name: read(rd, name) for name, read in _READERS.items()}
        return cls(**{name: value for name, value in given.items() if value is not None})

    def to_json(self) -> dict[str, Any]:
        """These keys as plan.json's ``spec`` records them."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_json() if hasattr(value, "to_json") else list(value) if isinstance(value, tuple) else value
        return out

    def lr_at(self, step: int, num_steps: int) -> float:
        """The learning rate of ``step`` (0-based) in a run of ``num_steps``."""
        return self.lr * self.lr_schedule.factor(step, num_steps, self.lr)


DEFAULTS = TrainingConfig()
"""Every training key at its default: the key table's source."""


# ----------------------------------------------------------------------------- reading plan.json's spec


def _positive(rd: Reader, key: str) -> float | None:
    v = rd.num(key, lo=0.0, required=False)
    if v == 0.0:
        raise rd.error(key, "expected a number > 0", v)
    return v


def _betas(rd: Reader, key: str) -> tuple[float, float] | None:
    v = rd.list(key, required=False)
    if v is None:
        return None
    if len(v) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in v):
        raise rd.error(key, "expected two numbers in [0, 1), such as [0.9, 0.999]", v)
    return (float(v[0]), float(v[1]))


def _bool(rd: Reader, key: str) -> bool | None:
    v = rd.obj.get(key)
    if v is not None and not isinstance(v, bool):
        raise rd.error(key, "expected true or false", v)
    return v


_SETTING_READERS: Mapping[str, Callable[[Reader, str], Any]] = {
    "betas": _betas,
    "eps": _positive,
    "weight_decay": lambda rd, k: rd.num(k, lo=0.0, required=False),
    "momentum": lambda rd, k: rd.num(k, lo=0.0, hi=1.0, required=False),
    "dampening": lambda rd, k: rd.num(k, lo=0.0, hi=1.0, required=False),
    "nesterov": _bool,
}
"""How each optimizer setting is checked (every name of :data:`OPTIMIZER_SETTINGS` has one)."""


def _optimizer(rd: Reader, key: str) -> Optimizer | None:
    sub = rd.sub(key, required=False)
    if sub is None:
        return None
    name = sub.str("name", choices=tuple(OPTIMIZER_SETTINGS))
    table = OPTIMIZER_SETTINGS[name]
    unknown = sorted(set(sub.obj) - {"name", *table})
    if unknown:
        raise SchemaError(f"{sub.where}.{unknown[0]}: {name} takes no setting {unknown[0]!r} "
                          f"(its settings: {', '.join(table)})")
    given = {k: _SETTING_READERS[k](sub, k) for k in table}
    return Optimizer.of(name, **{k: v for k, v in given.items() if v is not None})


def _data(rd: Reader, key: str) -> str | TokenData | None:
    """``"synthetic"``, ``"pkg.module:fn"``, or a token file ``{"kind": "tokens", "path", "dtype"}``."""
    if not isinstance(rd.obj.get(key), dict):
        return rd.str(key, required=False)
    sub = rd.sub(key)
    sub.str("kind", choices=("tokens",))
    return TokenData(path=sub.str("path"), dtype=sub.str("dtype", choices=TOKEN_DTYPES))


def _lr_schedule(rd: Reader, key: str) -> LRSchedule | None:
    sub = rd.sub(key, required=False)
    if sub is None:
        return None
    warmup = sub.int("warmup", lo=0, required=False)
    min_lr = sub.num("min_lr", lo=0.0, required=False)
    return LRSchedule(sub.str("name", choices=LR_SCHEDULES), warmup or 0, min_lr or 0.0)


_READERS: Mapping[str, Callable[[Reader, str], Any]] = {
    "steps": lambda rd, k: rd.int(k, lo=1, required=False),
    "seed": lambda rd, k: rd.int(k, lo=0, hi=MAX_SEED, required=False),
    "optimizer": _optimizer,
    "lr": _positive,
    "lr_schedule": _lr_schedule,
    "grad_clip": _positive,
    "dtype": lambda rd, k: rd.str(k, choices=RUN_DTYPES, required=False),
    "recompute": lambda rd, k: rd.ints(k, lo=0, hi=MAX_STAGES - 1, required=False),
    "data": _data,
    "loss": lambda rd, k: rd.str(k, required=False),
    "checkpoint_dir": lambda rd, k: rd.str(k, required=False),
    "checkpoint_every": lambda rd, k: rd.int(k, lo=0, required=False),
    "init": lambda rd, k: rd.str(k, choices=INITS, required=False),
    "peak_flops": _positive,
}
"""Field -> how plan.json's spec gives it (None: absent, so the default holds)."""
assert set(_READERS) == {f.name for f in fields(TrainingConfig)}, "every field is read"
