"""What a training step needs besides the schedule, built from the plan's training config.

The torch side of :class:`~pipec.compiler.config.TrainingConfig`: the
optimizer (AdamW, Adam, SGD), the loss, the autocast dtype, the data callable
(synthetic, a token file or a user's function: :mod:`pipec.runtime.data`)
and microbatch slicing (the learning-rate schedule is plain arithmetic:
:meth:`TrainingConfig.lr_at`). Everything a user can get wrong raises
:class:`TrainingError` with the key to fix.
"""

from __future__ import annotations

import functools

from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from pipec.compiler.config import TokenData, TrainingConfig
from pipec.model.data import load_function, load_loss
from pipec.compiler.ir.plan import Plan
from pipec.errors import PipecError, UserCodeError
from pipec.runtime import data as data_mod

__all__ = [
    "TrainingError",
    "make_optimizer",
    "fastest_kernel",
    "make_loss",
    "stage_loss",
    "autocast_dtype",
    "replica_inputs",
    "make_data",
    "synthetic_batch",
    "split_microbatches",
    "dropout_off",
]


class TrainingError(PipecError):
    """A training setting cannot be used; the message names the key."""


_OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def make_optimizer(params: Iterable[torch.nn.Parameter], config: TrainingConfig) -> torch.optim.Optimizer:
    """The config's optimizer over ``params``, at its peak lr (the trainer sets each step's lr)."""
    opt = config.optimizer
    params = list(params)
    try:
        return _OPTIMIZERS[opt.name](params, lr=config.lr, **{**fastest_kernel(params, opt.kwargs), **opt.kwargs})
    except (TypeError, ValueError) as e:
        raise TrainingError(f"optimizer {opt.name}: {e}") from None


def fastest_kernel(params: Sequence[torch.nn.Parameter], kwargs: Mapping[str, Any]) -> dict[str, bool]:
    """torch's multi-tensor optimizer step (``foreach``: one op per step of the update over every parameter)
    unless the config chose a kernel; torch's own default on CPU is a Python loop per parameter. One kernel
    whatever the parameters are (plain tensors, or FSDP2's DTensors, which ``fused`` does not take on every
    device), so a run resharded from a checkpoint into another shard mode continues as the reference does."""
    if "fused" in kwargs or "foreach" in kwargs or not params:
        return {}
    return {"foreach": True}


def stage_loss(plan: Plan, name: str, search_path: Sequence[str] = (), *, tp_group: Any = None,
               tp_rank: int = 0) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The loss the last stage's executor runs: :func:`make_loss`, vocab-parallel over ``tp_group`` where the
    plan's last stage is loss-parallel (its output is tp rank ``tp_rank``'s part of the logits)."""
    last = plan.stages[-1].tp if plan.stages else None
    parallel = last is not None and last.loss_parallel
    return make_loss(name, search_path, tp_group=tp_group if parallel else None, tp_rank=tp_rank, tp=plan.mesh.tp)


def make_loss(name: str, search_path: Sequence[str] = (), *, tp_group: Any = None, tp_rank: int = 0,
              tp: int = 1) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The loss of the last stage: cross_entropy, mse or ``pkg.module:fn(output, target)`` (found on
    ``search_path``, the plan's ``model.search_path``, like the model); what it raises names it. With
    ``tp_group`` (a loss-parallel last stage: its output is tp rank ``tp_rank``'s part of ``tp`` of the logits) the
    cross_entropy computed vocab-parallel over the group."""
    fn = load_loss(name, search_path)
    if tp_group is not None:
        from pipec.tp.comm import vocab_parallel_cross_entropy

        fn = functools.partial(vocab_parallel_cross_entropy, group=tp_group, rank=tp_rank, size=tp)

    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        try:
            return fn(output, target)
        except PipecError:
            raise
        except Exception as e:  # noqa: BLE001 - a user's loss, or a built-in one given targets it cannot take
            err = UserCodeError("the loss", name, e, f"it was given the output {data_mod.shown(output)} and the "
                                f"targets {data_mod.shown(target)}")
            err.key = "loss"
            raise err from None

    return loss


def autocast_dtype(name: str | None) -> torch.dtype | None:
    """``dtype`` runs the stages under autocast (params stay float32 masters); float32 means none."""
    return {None: None, "float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def synthetic_batch(step: int, dp_rank: int, dp_size: int, *, inputs: Sequence[Mapping[str, Any]], seed: int,
                    vocab: int | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Deterministic data from (seed, step, dp rank): the data position is the step.

    Token inputs are sequences ``(start + t) mod vocab`` with random starts, and
    the targets are the next tokens: a task a model can learn, so the loss
    falls. Float inputs get a regression target (a fixed linear map of the input).
    """
    g = torch.Generator().manual_seed(hash((seed, step, dp_rank)) & 0x7FFFFFFFFFFF)
    out: dict[str, torch.Tensor] = {}
    target: torch.Tensor | None = None
    for inp in inputs:
        shape, dtype = tuple(inp["shape"]), inp["dtype"]
        if dtype.startswith("int"):
            v = vocab or 2
            start = torch.randint(0, v, (shape[0],) + (1,) * (len(shape) - 1), generator=g)
            pos = torch.arange(shape[-1]).reshape((1,) * (len(shape) - 1) + (shape[-1],))
            tokens = (start + pos) % v
            out[inp["name"]] = tokens
            if target is None:
                target = (tokens + 1) % v
        else:
            x = torch.randn(shape, generator=g, dtype=getattr(torch, dtype))
            out[inp["name"]] = x
            if target is None:
                w = torch.randn(shape[-1], shape[-1], generator=torch.Generator().manual_seed(seed)) / shape[-1] ** 0.5
                target = torch.tanh(x @ w)
    assert target is not None
    return out, target


def replica_inputs(plan: Plan) -> tuple[dict[str, Any], ...]:
    """Name, dtype and shape of each model input over one dp replica's whole batch (the ``input`` key):
    the traced microbatch signatures with the batch times the microbatches; empty without a model."""
    inputs = (plan.model or {}).get("inputs") or ()
    return tuple({"name": i["name"], "dtype": i["dtype"],
                  "shape": [i["shape"][0] * plan.num_microbatches, *i["shape"][1:]]} for i in inputs)


def make_data(config: TrainingConfig, plan: Plan) -> Callable[[int, int, int], tuple[Any, Any]]:
    """``fn(step, dp_rank, dp_size) -> (inputs, targets)`` for one replica's whole batch, from the config's
    ``data``: synthetic (from the plan's ``model["data"]``; an older plan's without it), a token file, or a
    user's function (found on the plan's ``model.search_path``, what it returns checked)."""
    model = plan.model or {}
    desc = model.get("data")
    if isinstance(config.data, TokenData):
        return _token_data(config.data, desc["inputs"] if desc else replica_inputs(plan), plan, config.seed)
    if config.data == "synthetic":
        seed = config.seed
        if desc is not None and "target" in desc:
            return lambda step, dp_rank, dp_size: data_mod.synthetic_batch(desc, step=step, dp_rank=dp_rank, seed=seed)
        inputs = replica_inputs(plan)
        vocab = (model.get("kwargs") or {}).get("vocab")

        def synthetic(step: int, dp_rank: int, dp_size: int):
            return synthetic_batch(step, dp_rank, dp_size, inputs=inputs, seed=seed, vocab=vocab)

        return synthetic
    fn = load_function(config.data, "data", model.get("search_path") or ())
    return data_mod.user_data(fn, config.data, inputs=desc["inputs"] if desc else replica_inputs(plan),
                              target_spec=(desc or {}).get("target"))


def _token_data(data: TokenData, inputs: Sequence[Mapping[str, Any]], plan: Plan,
                seed: int) -> Callable[[int, int, int], tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Batches of the token file: the model's one ``[B, T]`` input and its next tokens."""
    if len(inputs) != 1:
        raise TrainingError(f"data {data.text()} feeds a model with one int64 input [batch, seq]; this plan's "
                            f"model has {len(inputs)}", key="data")
    inp = inputs[0]
    batch, seq = inp["shape"]
    tf = data_mod.open_tokens(data.path, dtype=data.dtype, seq=seq, batch=batch, dp_size=plan.mesh.dp, seed=seed,
                              vocab=inp.get("high") if inp.get("fill") == "tokens" else None)

    def tokens(step: int, dp_rank: int, dp_size: int):
        x, y = tf.batch(step, dp_rank, dp_size, batch)
        return {inp["name"]: x}, y

    return tokens


def split_microbatches(batch: Any, num_microbatches: int, what: str, names: Sequence[str] = ()) -> list:
    """Slice a batch (a tensor, a tuple of tensors, or a name -> tensor dict) into equal microbatches on dim 0."""
    if isinstance(batch, torch.Tensor):
        if names:
            batch = {names[0]: batch}
        else:
            return _split_tensor(batch, num_microbatches, what)
    if isinstance(batch, (tuple, list)):
        batch = dict(zip(names, batch)) if names else {str(i): t for i, t in enumerate(batch)}
    if not isinstance(batch, Mapping):
        raise TrainingError(f"{what}: expected a tensor, a tuple of tensors or a dict of them, got {type(batch).__name__}")
    parts = {k: _split_tensor(v, num_microbatches, f"{what} {k!r}") for k, v in batch.items()}
    return [{k: parts[k][m] for k in parts} for m in range(num_microbatches)]


def _split_tensor(t: torch.Tensor, num_microbatches: int, what: str) -> list[torch.Tensor]:
    if not isinstance(t, torch.Tensor):
        raise TrainingError(f"{what}: expected a tensor, got {type(t).__name__}")
    if t.shape[0] % num_microbatches:
        raise TrainingError(
            f"{what}: a batch of {t.shape[0]} does not split into {num_microbatches} equal microbatches; "
            f"use a batch that {num_microbatches} divides, or another microbatch count")
    return list(t.chunk(num_microbatches))


def _dropouts() -> dict[Any, int]:
    """Every dropout a model can call (Python function, torch function or aten op), with the position of its
    ``p`` argument (its ``training`` flag follows it)."""
    import torch.nn.functional as F

    aten = torch.ops.aten
    out: dict[Any, int] = {f: 1 for f in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                                          F.feature_alpha_dropout, torch.dropout, torch.alpha_dropout,
                                          torch.feature_dropout, torch.feature_alpha_dropout)}
    for name in ("dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"):
        out[getattr(aten, name).default] = 1
    return out


def _attentions() -> dict[Any, tuple[int, str]]:
    """Every scaled-dot-product attention a model can call, with the position and name of its ``dropout_p``."""
    import torch.nn.functional as F

    aten = torch.ops.aten
    return {F.scaled_dot_product_attention: (4, "dropout_p"), aten.scaled_dot_product_attention.default: (4, "dropout_p"),
            aten._scaled_dot_product_flash_attention_for_cpu.default: (3, "dropout_p"),
            aten._scaled_dot_product_flash_attention.default: (3, "dropout_p"),
            aten._scaled_dot_product_efficient_attention.default: (5, "dropout_p"),
            aten._scaled_dot_product_cudnn_attention.default: (5, "dropout_p")}


class dropout_off(torch.overrides.TorchFunctionMode):
    """``--check``'s compared step: every dropout is the identity (attention's ``dropout_p`` is 0), in the
    pipelined stages and in the reference alike (their masks are random and drawn in another order: the two steps could not agree with them on).
    ``dropped`` says whether any dropout met would have dropped something (``p`` > 0 in training)."""

    def __init__(self) -> None:
        super().__init__()
        self.table, self.attention = _dropouts(), _attentions()
        self.dropped = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        at = self.table.get(func)
        if at is None:
            attention = self.attention.get(func)
            if attention is not None:  # attention's own dropout (HF models pass attn_pdrop here in training)
                i, name = attention
                if len(args) > i:
                    self.dropped |= float(args[i]) > 0
                    args = (*args[:i], 0.0, *args[i + 1:])
                elif name in kwargs:
                    self.dropped |= float(kwargs[name]) > 0
                    kwargs = {**kwargs, name: 0.0}
            return func(*args, **kwargs)
        p = args[at] if len(args) > at else kwargs.get("p", 0.5)
        train = args[at + 1] if len(args) > at + 1 else kwargs.get("training", kwargs.get("train", True))
        self.dropped |= bool(train) and float(p) > 0
        x = args[0] if args else kwargs["input"]
        if func is torch.ops.aten.native_dropout.default:
            return x, torch.ones_like(x, dtype=torch.bool)
        return x
