"""Sharded data parallelism for one rank's stages: ZeRO-1, and FSDP2 driven by the plan's instructions.

The plan's ``shard`` (``plan.mesh.shard``) says what the dp replicas of a
stage share, over the shard group (``dp``, or ``dp.shard`` under HSDP):

- ``optimizer`` (ZeRO-1): :class:`OptimizerShards`. Gradients are all-reduced
  as today (``AR<s>:dp``); the optimizer steps only this rank's dim-0 shard of
  each parameter (views of the full parameter and its gradient, so nothing is
  copied), then one all-gather over the shard group puts every rank's updated
  rows back into the full parameters, inside ``OPTIM_STEP``.
- ``grads`` and ``full`` (ZeRO-2/3): :class:`ParamShards`, torch's
  ``fully_shard`` (FSDP2) on each stage module over the shard group's
  DeviceMesh, with every automatic step turned off (no resharding after
  forward or backward, no gradient sync) so that the plan's instructions drive
  it: ``UNSHARD`` posts the stage's all-gather (its next compute waits for it),
  ``RESHARD`` frees the gathered parameters, ``REDUCE_SCATTER`` runs FSDP2's
  post-backward with gradient sync on (the reduce-scatter of the gradients
  accumulated over the step's microbatches), as torch's own pipelining stage
  does for its ``REDUCE_GRAD``, but posted: FSDP2's reduce-scatter
  communication is replaced (``set_custom_reduce_scatter``) by one that posts
  the collective and keeps its work, so the stage's gradient shards (views of
  its output) are complete once :class:`PostedReduceScatter`'s ``wait``
  returns, which the executor calls in ``OPT`` (or before a reduction over
  those shards: HSDP's ``AR<s>:dp.replicate``, a tie's all-reduce), while the
  backward work still to come runs. The zero-bubble split needs nothing more:
  the weight grads ``BWD_W`` computes (model/deferred.py) land on the
  gathered parameters' ``.grad``, which FSDP2 accumulates and reduces. ``dtype
  bfloat16`` (or float16) runs FSDP2's :class:`MixedPrecisionPolicy` (the
  gathered parameters in that dtype, gradients reduced in float32, stage
  outputs cast back to float32 so what crosses stages matches the plan) instead
  of autocast.

Optimizer state of both is per parameter, sharded on dim 0 as DTensor's
``Shard(0)`` splits it (``torch.chunk``), so a checkpoint holds the same
shards whichever mode wrote it (:func:`optimizer_state`).

:func:`state_bytes` measures what a rank holds: the bytes of each distinct
storage of its parameters, gradients and optimizer state (padding included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from pipec.compiler.ir.plan import SHARDING, ShardMode

__all__ = [
    "ShardLayout",
    "ParamShards",
    "PostedReduceScatter",
    "OptimizerShards",
    "shard_stages",
    "full",
    "MIXED_PRECISION",
    "local",
    "local_grad",
    "state_bytes",
    "optimizer_state",
    "init_optimizer_state",
]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13 renamed it
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # likewise

MIXED_PRECISION = {"bfloat16": torch.bfloat16, "float16": torch.float16}
"""``dtype`` values FSDP2's mixed-precision policy runs (float32 needs none)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardLayout:
    """How this rank shards: the plan's mode, and its place in its shard group."""

    mode: str
    """``optimizer``, ``grads`` or ``full`` (``plan.mesh.shard``)."""
    ranks: tuple[int, ...]
    """The global ranks of this rank's shard group, in dp order."""
    index: int
    """This rank's place in ``ranks`` (the shard it holds)."""

    @classmethod
    def of(cls, mesh, global_rank: int) -> "ShardLayout | None":
        """The layout of ``global_rank`` under ``mesh`` (a plan's Mesh); None when nothing is sharded."""
        if not mesh.sharded:
            return None
        ranks = tuple(mesh.group_ranks(mesh.shard_group, global_rank))
        return cls(mode=mesh.shard, ranks=ranks, index=ranks.index(global_rank))

    @property
    def shard_mode(self) -> ShardMode:
        """What :attr:`mode` shards (:data:`~pipec.compiler.ir.plan.SHARDING`)."""
        return SHARDING[self.mode]

    @property
    def params_sharded(self) -> bool:
        """Parameters are sharded at rest (FSDP2: ``grads`` or ``full``)."""
        return self.shard_mode.params

    @property
    def size(self) -> int:
        return len(self.ranks)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_grad(p: nn.Parameter) -> torch.Tensor:
    """The local gradient of ``p`` (its shard for a sharded parameter), zero-filled when it has none."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return local(p.grad)


# ----------------------------------------------------------------------------- FSDP2 (grads, full)


class PostedReduceScatter:
    """One stage's reduce-scatter, posted: ``wait`` completes it (the stage's gradient shards are views of its
    output, so they hold the reduced values after). Keeps its buffers alive until then."""

    __slots__ = ("works", "buffers")

    def __init__(self, works: Sequence, buffers: Sequence[torch.Tensor]) -> None:
        self.works = list(works)
        self.buffers = list(buffers)
        """The collectives' inputs and outputs (a posted collective reads and writes them after the post returns)."""

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works, self.buffers = [], []


class _PostingComm:
    """FSDP2's reduce-scatter communication for one stage (``set_custom_reduce_scatter``): posts the collective
    (``async_op``) and keeps its work while :attr:`posting`, instead of waiting for it.

    FSDP2 goes on after the call: it views the output as the gradient shards (nothing to wait for), but it
    would also post-divide it (an op other than AVG), cast it (an output dtype other than the parameters'), or
    add it to existing shards (:attr:`posting` is off then); any of these reads the output on the host, so the
    collective is waited for at once instead, as FSDP2's own communication is.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        """The stage's parameter dtype (FSDP2 casts an output of another dtype to it)."""
        self.posting = False
        self.posted: list[tuple[Any, torch.Tensor, torch.Tensor]] = []

    @staticmethod
    def allocate(size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        work = _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=True)
        if self.posting and op == dist.ReduceOp.AVG and output_tensor.dtype == self.dtype:
            self.posted.append((work, input_tensor, output_tensor))
        else:
            work.wait()
        return None  # FSDP2 waits for nothing it is handed back (a gloo work waited twice hangs)

    def take(self) -> PostedReduceScatter | None:
        """What was posted since the last take (None: nothing is in flight)."""
        if not self.posted:
            return None
        out = PostedReduceScatter([w for w, _, _ in self.posted], [t for _, a, b in self.posted for t in (a, b)])
        self.posted.clear()
        return out


class ParamShards:
    """FSDP2 on each of one rank's stages, driven by ``UNSHARD`` / ``RESHARD`` / ``REDUCE_SCATTER``.

    ``mesh`` is the 1-D DeviceMesh of this rank's shard group; ``dtype`` the
    plan's compute dtype (bfloat16 and float16 run FSDP2's mixed precision).
    Stages without parameters are left alone (their instructions do nothing).
    """

    def __init__(self, modules: Mapping[int, nn.Module], mesh, *, dtype: str = "float32") -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        low = MIXED_PRECISION.get(dtype)
        self.policy = None if low is None else MixedPrecisionPolicy(
            param_dtype=low, reduce_dtype=torch.float32, output_dtype=torch.float32)
        self.fully_shard = fully_shard
        self.modules = {}
        self.comms: dict[int, _PostingComm] = {}
        """Stage -> its reduce-scatter communication (what a ``REDUCE_SCATTER`` posts)."""
        for s, m in modules.items():
            if next(m.parameters(), None) is None:
                continue
            kw = {} if self.policy is None else {"mp_policy": self.policy}
            fully_shard(m, mesh=mesh, reshard_after_forward=False, **kw)
            self.modules[s] = m
            self.comms[s] = _PostingComm(next(m.parameters()).dtype)
            m.set_custom_reduce_scatter(self.comms[s])
            self._accumulate(m)

    @property
    def policy_text(self) -> str | None:
        """What ran the low-precision compute, for --check's report (None: float32)."""
        if self.policy is None:
            return None
        return (f"FSDP2 MixedPrecisionPolicy(param_dtype={str(self.policy.param_dtype)[6:]}, "
                f"reduce_dtype={str(self.policy.reduce_dtype)[6:]})")

    @staticmethod
    def _accumulate(m) -> None:
        """Backwards only accumulate the gathered parameters' grads: the plan says when to reduce and free."""
        m.set_requires_gradient_sync(False)
        m.set_reshard_after_backward(False)
        m.set_is_last_backward(False)

    def unshard(self, s: int):
        """Post stage ``s``'s all-gather; the returned handle's ``wait`` makes its parameters usable (None: nothing)."""
        m = self.modules.get(s)
        return None if m is None else m.unshard(async_op=True)

    def reshard(self, s: int) -> None:
        m = self.modules.get(s)
        if m is not None:
            m.reshard()

    def reduce_scatter(self, s: int) -> PostedReduceScatter | None:
        """Post the reduce-scatter of stage ``s``'s accumulated grads over its shard group (FSDP2's post-backward
        with sync on, its collective posted): the stage's gradient shards are complete after the returned handle's
        ``wait``. None: nothing is in flight (a stage without parameters, a shard group of one, or a reduction
        FSDP2 finishes on the host, which was waited for here; see :class:`_PostingComm`)."""
        m = self.modules.get(s)
        if m is None:
            return None
        comm = self.comms[s]
        state = self.fully_shard.state(m)
        # posted only onto no gradient shards (FSDP2 would add its output to them); the module's parameters are the
        # gathered ones here, so the shards are FSDP2's
        comm.posting = all(fp.sharded_param.grad is None for g in state._fsdp_param_groups for fp in g.fsdp_params)
        m.set_requires_gradient_sync(True)
        m.set_is_last_backward(True)
        try:
            for group in state._fsdp_param_groups:
                group.post_backward()
            state._root_post_backward_final_callback()  # clears the backward's bookkeeping (waits for no posted work)
        finally:
            comm.posting = False
        self._accumulate(m)
        return comm.take()


# ----------------------------------------------------------------------------- ZeRO-1 (optimizer)


def _rows(n: int, size: int, index: int) -> tuple[int, int]:
    """Rows [start, stop) of dim 0's shard ``index`` of ``size``, as ``torch.chunk`` (and DTensor ``Shard(0)``) cut."""
    per = -(-n // size)
    start = min(n, per * index)
    return start, min(n, start + per)


class OptimizerShards:
    """ZeRO-1: ``make_optimizer`` steps this rank's dim-0 shard of each parameter, then the shards are gathered.

    The optimizer's parameters are views of the full parameters' rows (so its
    update lands in the full parameter), their gradients views of the full
    (all-reduced) gradients; its state covers only those rows. ``step`` then
    all-gathers every rank's rows over the shard group (one collective, each
    parameter's shard padded to the same number of rows). Exposes what the
    trainer uses of an optimizer: ``param_groups``, ``step``, ``zero_grad``,
    ``state``.
    """

    def __init__(self, params: Sequence[nn.Parameter], make_optimizer, layout: ShardLayout, group) -> None:
        self.params = list(params)
        self.layout = layout
        self.group = group
        size, index = layout.size, layout.index
        self.full = [p.detach().reshape(1) if p.dim() == 0 else p.detach() for p in self.params]
        """Each parameter as rows (a scalar as one row), sharing its storage."""
        self.rows = [_rows(f.shape[0], size, index) for f in self.full]
        self.views = [f[a:b] for f, (a, b) in zip(self.full, self.rows)]
        self.widths = [-(-f.shape[0] // size) * (f[0].numel() if f.shape[0] else 0) for f in self.full]
        """Elements of each parameter's padded shard in the gathered buffer."""
        assert len({p.dtype for p in self.params}) <= 1, "ZeRO-1 gathers one dtype"
        self.optimizer = make_optimizer(self.views)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.shard_of = {id(p): v for p, v in zip(self.params, self.views)}
        """id(full parameter) -> the view of its rows the optimizer steps."""

    def step(self) -> None:
        for p, v, (a, b) in zip(self.params, self.views, self.rows):
            v.grad = None if p.grad is None else p.grad.reshape(-1, *v.shape[1:])[a:b]
        self.optimizer.step()
        self.gather()

    def gather(self) -> None:
        """Every rank's updated rows into the full parameters: one all-gather of the padded shards."""
        size = self.layout.size
        if size == 1 or not self.params:
            return
        total = sum(self.widths)
        mine = torch.zeros(total, dtype=self.params[0].dtype, device=self.params[0].device)
        offset = 0
        for v, width in zip(self.views, self.widths):
            mine[offset:offset + v.numel()] = v.reshape(-1)
            offset += width
        out = torch.empty(size * total, dtype=mine.dtype, device=mine.device)
        _all_gather(out, mine, group=self.group)
        with torch.no_grad():
            for k in range(size):
                offset = k * total
                for f, width in zip(self.full, self.widths):
                    a, b = _rows(f.shape[0], size, k)
                    if b > a:
                        f[a:b] = out[offset:offset + (b - a) * f[0].numel()].view(b - a, *f.shape[1:])
                    offset += width

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def full_state(self, p: nn.Parameter, mesh) -> dict[str, torch.Tensor]:
        """The optimizer state of full parameter ``p``, its row-sharded tensors as DTensors over ``mesh``."""
        out = {}
        for name, t in self.state.get(self.shard_of[id(p)], {}).items():
            if isinstance(t, torch.Tensor) and t.dim() and p.dim():
                t = DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
            out[name] = t
        return out


def shard_stages(layout: ShardLayout | None, modules: Mapping[int, nn.Module], make_optimizer, transport, *,
                 dtype: str) -> tuple[ParamShards | None, Any]:
    """This rank's stages sharded as ``layout`` says, and the optimizer over what it steps:
    (the FSDP2 driver or None, the optimizer). ``make_optimizer(params)`` builds the plan's optimizer."""
    sharding = None
    if layout is not None and layout.params_sharded:
        sharding = ParamShards(modules, transport.shard_mesh, dtype=dtype)
    params = [p for s in sorted(modules) for p in modules[s].parameters()]
    if layout is not None and not layout.params_sharded:  # the optimizer state alone is sharded (ZeRO-1)
        return sharding, OptimizerShards(params, make_optimizer, layout, transport.groups.get(layout.ranks))
    return sharding, make_optimizer(params)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective over its mesh), else the tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


# ----------------------------------------------------------------------------- checkpoints and measurement


def init_optimizer_state(optimizer, params: Iterable[nn.Parameter]) -> None:
    """Give every parameter its optimizer state (as a first step would, changing nothing), so a checkpoint
    can be loaded into it in place: one step at lr 0 on zero gradients, the gradients then cleared."""
    params = list(params)
    if all(optimizer.state.get(p) for p in getattr(optimizer, "views", params)):
        return
    saved = [(g, g["lr"]) for g in optimizer.param_groups]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g, _ in saved:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in saved:
        g["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad


def optimizer_state(optimizer, named: Mapping[str, nn.Parameter], mesh=None) -> dict[str, Any]:
    """The optimizer's state by canonical name, flattened as DCP's state-dict helpers flatten it
    (``state.<name>.<key>``, ``param_groups.<name>.<setting>``): the tensors themselves (DTensor shards
    where sharded), so a checkpoint loads into them in place. ``named``: canonical name -> parameter
    (each once); ``mesh``: the shard group's DeviceMesh under ZeRO-1."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out: dict[str, Any] = {}
    for name, p in named.items():
        if isinstance(optimizer, OptimizerShards):
            state, group = optimizer.full_state(p, mesh), group_of[id(optimizer.shard_of[id(p)])]
        else:
            state, group = optimizer.state.get(p, {}), group_of[id(p)]
        for key, value in state.items():
            out[f"state.{name}.{key}"] = value
        for key, value in group.items():
            if key != "params":
                out[f"param_groups.{name}.{key}"] = value
    return out


def state_bytes(params: Iterable[nn.Parameter], optimizer) -> dict[str, int]:
    """Bytes of each distinct local storage of ``params``, their grads and ``optimizer``'s state (padding
    included: a DTensor counts its local shard's whole storage)."""
    params = list(params)
    state = optimizer.state if optimizer is not None else {}
    tensors = {
        "params": [local(p) for p in params],
        "grads": [local(p.grad) for p in params if p.grad is not None],
        "optimizer": [local(t) for s in state.values() for t in s.values() if isinstance(t, torch.Tensor)],
    }
    return {kind: _storage_bytes(ts) for kind, ts in tensors.items()}


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[(st.data_ptr(), st.nbytes())] = st.nbytes()
    return sum(seen.values())
