"""The collectives a tensor-parallel stage runs: Megatron's f and g, as autograd Functions and graph modules.

- ``f`` (:class:`CopyToTP`): identity forward, all-reduce of the gradient backward. It stands before the shared
  input of each colwise group, so the input's gradient (a partial sum on every rank) is summed.
- ``g`` (:class:`ReduceFromTP`): all-reduce forward (a rowwise output is a partial sum), identity backward.

Both call a *group*: any object with ``all_reduce(tensor) -> tensor`` (the sum over the tp ranks, a new tensor).
For sequence parallelism a group also has ``all_gather(tensor, dim)`` (every rank's tensor concatenated along
``dim``, in rank order) and ``reduce_scatter(tensor, dim)`` (the sum's ``rank``-th part along ``dim``), which
:class:`GatherFromSP` (all-gather forward, reduce-scatter backward: before a colwise group) and
:class:`ScatterToSP` (reduce-scatter forward, all-gather backward: after a rowwise module) call. Each takes
``async_op=True`` too: then it gives a handle whose ``wait()`` gives the result (:class:`GatheredLinear`'s
backward all-gathers the sequence while it computes the input gradient).

Under autocast every collective here moves the autocast dtype (:func:`wire_dtype`: a float32 tensor, a layer
norm's output or the input gradient flowing back to it, is cast before the collective and back after), as
Megatron's bfloat16 runs move them; the vocab-parallel loss's per-token values stay float32.
:class:`ProcessGroupTP` wraps a ``torch.distributed`` process group; :class:`ThreadGroupTP` runs the tp ranks as
threads of one process (tests, one-process checks). :class:`TPComm` is the ``call_module`` the sharding pass
inserts: with no group set it is the identity, so a stage's local shapes run (and profile) in one process.

Vocabulary parallelism: :class:`VocabLookup` is a vocab-parallel embedding's masked lookup (the ids outside this
rank's rows give zeros; a ``reduce`` or ``scatter`` TPComm after it sums the parts), and
:func:`vocab_parallel_cross_entropy` the loss on logits split on the class dim (Megatron-LM's
``vocab_parallel_cross_entropy``): what ``F.cross_entropy`` gives on the whole logits, from three collectives
of one value per token.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["TPGroup", "Pending", "IssuingGroup", "dist_issue", "wire_dtype", "ProcessGroupTP", "ThreadGroupTP", "CopyToTP", "ReduceFromTP", "GatherFromSP", "ScatterToSP",
           "SplitToSP", "GatherWholeFromSP", "GatheredLinear", "TPComm", "set_group", "VocabLookup",
           "vocab_parallel_cross_entropy"]


class TPGroup(Protocol):
    """What f and g call: the sum of ``tensor`` over the tp ranks, as a new tensor (``async_op``: a handle
    whose ``wait()`` gives it)."""

    def all_reduce(self, tensor: torch.Tensor, *, async_op: bool = False) -> Any: ...

    def all_gather(self, tensor: torch.Tensor, dim: int, *, async_op: bool = False) -> Any: ...

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, *, async_op: bool = False) -> Any: ...


def wire_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype a tp collective of ``x`` moves in when it is not ``x``'s own: the autocast dtype while autocast
    is on for ``x``'s device and ``x`` is floating (None otherwise)."""
    dev = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        return None if dtype == x.dtype else dtype
    return None


def _to(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return x if dtype is None or x.dtype == dtype else x.to(dtype)


class Pending:
    """An asynchronous tp collective: :meth:`wait` waits for its work (on CUDA: the caller's stream waits for
    it) and gives its result."""

    def __init__(self, work: Any, finish: Any) -> None:
        self.work, self.finish = work, finish

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.finish()


class IssuingGroup:
    """A :class:`TPGroup` over one call, :meth:`issue` (``kind`` ``all_reduce``: ``tensor`` summed in place;
    ``all_gather``: ``out`` is every rank's ``tensor`` one after the other on dim 0; ``reduce_scatter``: ``out``
    is the ``rank``-th block of dim 0 of the sum of ``tensor``; asynchronous: a work with ``wait()``): the layouts along
    ``dim`` around it, and, for a kind not in ``native`` (the backend lacks it), an all-reduce of the zero-padded
    whole, then the part. Subclasses: :class:`ProcessGroupTP`, the runtime's ``TransportTP``."""

    def __init__(self, size: int, rank: int, native: frozenset[str]) -> None:
        self.size, self.rank, self.native = size, rank, native

    def issue(self, kind: str, out: torch.Tensor, tensor: torch.Tensor) -> Any:
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor, *, async_op: bool = False) -> Any:
        out = tensor.detach().contiguous().clone()
        done = Pending(self.issue("all_reduce", out, out), lambda: out)
        return done if async_op else done.wait()

    def all_gather(self, tensor: torch.Tensor, dim: int, *, async_op: bool = False) -> Any:
        """Every rank's ``tensor`` concatenated on ``dim`` in rank order."""
        n, x = self.size, tensor.detach()
        dim = dim % x.dim()
        if "all_gather" not in self.native:  # each rank's part summed into zeros
            parts = [torch.zeros_like(x) for _ in range(n)]
            parts[self.rank] = x
            return self.all_reduce(torch.cat(parts, dim=dim), async_op=async_op)
        x = x.contiguous()
        buf = x.new_empty((n * x.shape[0], *x.shape[1:]))  # the parts one after the other on dim 0
        work = self.issue("all_gather", buf, x)
        done = Pending(work, lambda: buf if dim == 0 else
                       buf.view(n, *x.shape).movedim(0, dim).flatten(dim, dim + 1))
        return done if async_op else done.wait()

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, *, async_op: bool = False) -> Any:
        """This rank's part on ``dim`` of the sum over the ranks."""
        n, x = self.size, tensor.detach()
        dim = dim % x.dim()
        if "reduce_scatter" not in self.native:
            whole = self.all_reduce(x, async_op=True)
            done = Pending(None, lambda: whole.wait().chunk(n, dim=dim)[self.rank].contiguous())
            return done if async_op else done.wait()
        # rank r's part the r-th block of dim 0
        src = x if dim == 0 else x.unflatten(dim, (n, -1)).movedim(dim, 0).contiguous().flatten(0, 1)
        src = src.contiguous()
        out = src.new_empty((src.shape[0] // n, *src.shape[1:]))
        done = Pending(self.issue("reduce_scatter", out, src), lambda: out)
        return done if async_op else done.wait()


def dist_issue(kind: str, out: torch.Tensor, tensor: torch.Tensor, group: Any) -> Any:
    """:meth:`IssuingGroup.issue` on a ``torch.distributed`` process group, asynchronous, issued with the
    current (compute) stream current: NCCL makes the group's own stream wait for the compute so far and runs it
    there (torch 2.13's ``all_gather_single`` / ``reduce_scatter_single``; earlier ones' ``*_into_tensor`` /
    ``*_tensor``)."""
    import torch.distributed as dist

    if kind == "all_reduce":
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    if kind == "all_gather":
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return fn(out, tensor, group=group, async_op=True)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)


class ProcessGroupTP(IssuingGroup):
    """A ``torch.distributed`` process group (the stage's tp ranks; None: the world) as a :class:`TPGroup`,
    each collective issued on the compute stream (:func:`dist_issue`), the backend's own all-gather and
    reduce-scatter where it has them (:data:`~pipec.compiler.ir.tensor_parallel.NATIVE`)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist
        from pipec.compiler.ir.tensor_parallel import NATIVE

        self.group = group
        super().__init__(dist.get_world_size(group), dist.get_rank(group),
                         frozenset(NATIVE.get(dist.get_backend(group), ())))

    def issue(self, kind: str, out: torch.Tensor, tensor: torch.Tensor) -> Any:
        return dist_issue(kind, out, tensor, self.group)


class ThreadGroupTP:
    """``size`` tp ranks as threads of one process: :meth:`rank` gives rank ``r``'s :class:`TPGroup`.

    Every rank must call the same collectives in the same order (as processes would); each gets the same sum,
    added in rank order, so the ranks' results are bitwise equal. CPU tensors only where a backward runs a
    collective: autograd runs a CUDA backward on one device thread shared by every rank, which would wait on
    the barrier for ranks queued behind it."""

    def __init__(self, size: int, *, timeout: float = 60.0) -> None:
        self.size = size
        self._slots: list[torch.Tensor | None] = [None] * size
        self._barrier = threading.Barrier(size, timeout=timeout)

    def rank(self, r: int) -> "_ThreadRank":
        assert 0 <= r < self.size, (r, self.size)
        return _ThreadRank(self, r)

    def _exchange(self, r: int, tensor: torch.Tensor, combine: Any) -> torch.Tensor:
        self._slots[r] = tensor.detach()
        self._barrier.wait()
        out = combine(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return out

    def _all_reduce(self, r: int, tensor: torch.Tensor) -> torch.Tensor:
        def total(slots: list) -> torch.Tensor:
            out = slots[0].clone()
            for t in slots[1:]:
                out = out + t
            return out

        return self._exchange(r, tensor, total)


class _Later:
    """A thread group's asynchronous collective: it runs at ``wait()`` (every rank waits in the same order)."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def wait(self) -> torch.Tensor:
        return self.run()


class _ThreadRank:
    def __init__(self, owner: ThreadGroupTP, r: int) -> None:
        self.owner, self.r = owner, r

    def all_reduce(self, tensor: torch.Tensor, *, async_op: bool = False) -> Any:
        if async_op:
            return _Later(lambda: self.all_reduce(tensor))
        return self.owner._all_reduce(self.r, tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int, *, async_op: bool = False) -> Any:
        if async_op:
            return _Later(lambda: self.all_gather(tensor, dim))
        return self.owner._exchange(self.r, tensor, lambda slots: torch.cat(slots, dim=dim))

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, *, async_op: bool = False) -> Any:
        if async_op:
            return _Later(lambda: self.reduce_scatter(tensor, dim))
        return self.all_reduce(tensor).chunk(self.owner.size, dim=dim)[self.r].contiguous()


class CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward; the gradient all-reduced backward (in the autocast dtype)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group, ctx.wire = group, wire_dtype(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _to(ctx.group.all_reduce(_to(grad, ctx.wire)), grad.dtype), None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: the partial sums all-reduced forward (in the autocast dtype); identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        return _to(group.all_reduce(_to(x, wire_dtype(x))), x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _exchange(name: str, forward: str, backward: str, doc: str) -> type:
    """An autograd Function running group method ``forward`` along ``dim`` forward and ``backward`` on the
    gradient (the other's inverse: all-gather and reduce-scatter)."""

    def fwd(ctx: Any, x: torch.Tensor, group: TPGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.wire = group, dim, wire_dtype(x)
        return _to(getattr(group, forward)(_to(x, ctx.wire), dim), x.dtype)

    def bwd(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _to(getattr(ctx.group, backward)(_to(grad, ctx.wire), ctx.dim), grad.dtype), None, None

    return type(name, (torch.autograd.Function,), {"__doc__": doc, "__module__": __name__,
                                                   "forward": staticmethod(fwd), "backward": staticmethod(bwd)})


GatherFromSP = _exchange("GatherFromSP", "all_gather", "reduce_scatter",
                         "Sequence parallelism's entry to a tp region: all-gather along ``dim`` forward, "
                         "reduce-scatter backward.")
ScatterToSP = _exchange("ScatterToSP", "reduce_scatter", "all_gather",
                        "Sequence parallelism's exit from a tp region: reduce-scatter along ``dim`` forward, "
                        "all-gather backward.")


class SplitToSP(torch.autograd.Function):
    """A replicated value entering the sequence-parallel region: this rank's part along ``dim`` forward (no
    collective: every rank holds the whole), all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup, dim: int, size: int, rank: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.wire = group, dim, wire_dtype(x)
        return x.chunk(size, dim=dim)[rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        whole = ctx.group.all_gather(_to(grad.contiguous(), ctx.wire), ctx.dim)
        return _to(whole, grad.dtype), None, None, None, None


class GatherWholeFromSP(torch.autograd.Function):
    """Sequence parallelism's exit to a consumer replicated on the tp ranks (a replicated Linear, the loss):
    all-gather along ``dim`` forward; backward, the gradient is whole on every rank: this rank's part of it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup, dim: int, size: int, rank: int) -> torch.Tensor:
        ctx.dim, ctx.size, ctx.rank = dim, size, rank
        return _to(group.all_gather(_to(x, wire_dtype(x)), dim), x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None, None, None


class GatheredLinear(torch.autograd.Function):
    """Colwise Linears on the all-gathered sequence, saving only this rank's part (Korthikanti et al. 2022,
    4.2.2): one all-gather forward, then each linear (``params``: weight, bias of each, the bias None where it has
    none; several when q, k, v or an MLP's gate and up share the input); backward, the sequence all-gathered again
    for the weights' gradients, started first and overlapped with the input gradient's matmuls (the sum over
    the linears), which is then reduce-scattered once, overlapped with the weights' gradients (Megatron's
    overlap). Under autocast the part is cast to the autocast dtype once, before the forward's gather (what
    the linears would cast it to), and saved so. Under a split backward (``stash``: the zero-bubble
    :class:`~pipec.model.deferred.WeightGradStash`) the weights' gradients are stashed for ``BWD_W``. One linear
    gives its output, several a tuple."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup, dim: int, stash: Any,
                *params: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        weights, biases = params[0::2], params[1::2]
        ctx.group, ctx.dim, ctx.stash, ctx.has_bias = group, dim, stash, [b is not None for b in biases]
        ctx.wire, ctx.x_dtype = wire_dtype(x), x.dtype
        part = _to(x, ctx.wire)
        ctx.save_for_backward(part, *weights)
        ctx.weights = weights  # the parameters themselves (saved_tensors may give back aliases)
        full = group.all_gather(part, dim)
        out = tuple(torch.nn.functional.linear(full, w, b) for w, b in zip(weights, biases))
        return out[0] if len(out) == 1 else out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        part, *weights = ctx.saved_tensors
        need = ctx.needs_input_grad
        # the weights' gather first, in flight while the input gradient's matmuls run
        gather = ctx.group.all_gather(part.detach(), ctx.dim, async_op=True) if any(need[4::2]) else None
        scatter = None
        if need[0]:
            total = sum(g @ w.to(g.dtype) for g, w in zip(grads, weights))
            scatter = ctx.group.reduce_scatter(_to(total, ctx.wire), ctx.dim, async_op=True)
        out: list[Any] = [None, None, None, None]
        full = gather.wait() if gather is not None else None
        for i, (g, w) in enumerate(zip(grads, weights)):
            grad_w = grad_b = None
            if need[4 + 2 * i]:
                if ctx.stash is not None:
                    ctx.stash.items.append((ctx.weights[i], full, g.detach()))
                else:
                    grad_w = (g.reshape(-1, g.shape[-1]).t() @ full.reshape(-1, full.shape[-1]).to(g.dtype)).to(w.dtype)
            if ctx.has_bias[i] and need[5 + 2 * i]:
                grad_b = g.reshape(-1, g.shape[-1]).sum(0)
            out += [grad_w, grad_b]
        if scatter is not None:  # in flight while the weights' gradients ran
            out[0] = _to(scatter.wait(), ctx.x_dtype)
        return tuple(out)


def _weight_grad_stash() -> Any:
    """The zero-bubble split's stash when a stage's forward runs under ``defer_weight_grads``, else None."""
    from pipec.model.deferred import defer_weight_grads

    for mode in torch.overrides._get_current_function_mode_stack():
        if isinstance(mode, defer_weight_grads):
            return mode.stash
    return None


class TPComm(nn.Module):
    """One kind of collective in a sharded stage's graph: ``"copy"`` (f), ``"reduce"`` (g), or sequence
    parallelism's ``"gather"`` / ``"scatter"`` / ``"split"`` / ``"gather_whole"`` along ``dim`` (tp rank
    ``rank`` of ``size``); ``"gather_linear"`` takes ``(x, weight, bias, ...)``: colwise Linears (a weight and a
    bias, or None, each) on the gathered sequence that save this rank's part (:class:`GatheredLinear`; several
    give a tuple). With ``segments`` > 1, ``dim`` is that many
    blocks (a flattened ``[B T]``), each cut into the tp parts: the collective acts on each block.

    ``group`` is set when the stage is built for its rank (:func:`set_group`); while it is None the module runs
    one rank alone: f and g are identities, a gather repeats this rank's part ``size`` times and a scatter or
    split keeps part ``rank`` (the local shapes of one rank, run in one process)."""

    KINDS = ("copy", "reduce", "gather", "scatter", "split", "gather_whole", "gather_linear")

    def __init__(self, kind: str, dim: int = 1, *, size: int = 1, rank: int = 0, segments: int = 1) -> None:
        super().__init__()
        assert kind in self.KINDS, kind
        self.kind, self.dim, self.size, self.rank, self.segments = kind, dim, size, rank, segments
        self.group: TPGroup | None = None

    def forward(self, x: torch.Tensor, *params: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.segments > 1:  # each block on its own: the blocks as a dim of their own, then flattened back
            d = self.dim
            out = self._forward(x.unflatten(d, (self.segments, -1)), params, d + 1)
            return out.flatten(d, d + 1) if isinstance(out, torch.Tensor) else tuple(o.flatten(d, d + 1) for o in out)
        return self._forward(x, params, self.dim)

    def _forward(self, x: torch.Tensor, params: tuple[torch.Tensor | None, ...],
                 dim: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
        kind = self.kind
        if kind == "gather_linear":
            if self.group is None:
                full = torch.cat([x] * self.size, dim=dim)
                out = tuple(torch.nn.functional.linear(full, w, b) for w, b in zip(params[0::2], params[1::2]))
                return out[0] if len(out) == 1 else out
            return GatheredLinear.apply(x, self.group, dim, _weight_grad_stash(), *params)
        if self.group is None:
            if kind in ("gather", "gather_whole") and self.size > 1:
                return torch.cat([x] * self.size, dim=dim)
            if kind in ("scatter", "split") and self.size > 1:
                return x.chunk(self.size, dim=dim)[self.rank].contiguous()
            return x
        if kind == "copy":
            return CopyToTP.apply(x, self.group)
        if kind == "reduce":
            return ReduceFromTP.apply(x, self.group)
        if kind in ("split", "gather_whole"):
            fn = SplitToSP if kind == "split" else GatherWholeFromSP
            return fn.apply(x, self.group, dim, self.size, self.rank)
        return (GatherFromSP if kind == "gather" else ScatterToSP).apply(x, self.group, dim)

    def extra_repr(self) -> str:
        segs = f", segments={self.segments}" if self.segments > 1 else ""
        return self.kind if self.kind in ("copy", "reduce") else f"{self.kind}, dim={self.dim}{segs}"


def set_group(module: nn.Module, group: TPGroup | None) -> None:
    """Point every :class:`TPComm` in ``module`` at ``group`` (None: identities again)."""
    for sub in module.modules():
        if isinstance(sub, TPComm):
            sub.group = group


class VocabLookup(nn.Module):
    """Tp rank ``rank``'s lookup in a vocab-parallel embedding holding rows ``[rank rows, (rank + 1) rows)`` of
    the whole table (``rows`` each): ``forward(ids, weight)`` gives the embedding of the ids in that range and
    zeros for the others (their gradient too). ``padding_idx`` is the whole table's (None: none)."""

    def __init__(self, rows: int, *, rank: int = 0, padding_idx: int | None = None) -> None:
        super().__init__()
        self.rows, self.start = rows, rank * rows
        local = None if padding_idx is None else padding_idx - self.start
        self.padding_idx = local if local is not None and 0 <= local < rows else None

    def forward(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight, self.padding_idx)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    def extra_repr(self) -> str:
        return f"rows {self.start}..{self.start + self.rows}"


class _VocabParallelCE(torch.autograd.Function):
    """The mean cross-entropy of ``[N, V / tp]`` logits (this rank's classes ``start..start + V / tp``) against
    ``[N]`` class ids over the tp group; ``ignore_index`` targets count for nothing, as in ``F.cross_entropy``."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: TPGroup, start: int,
                ignore_index: int) -> torch.Tensor:
        rows = logits.shape[-1]
        top = group.all_gather(logits.detach().amax(dim=-1, keepdim=True), -1).amax(dim=-1, keepdim=True)
        shifted = logits.detach() - top
        exp = shifted.exp()
        total = group.all_reduce(exp.sum(dim=-1))
        local = target - start
        inside = (local >= 0) & (local < rows)
        idx = local.clamp(0, rows - 1)
        picked = group.all_reduce(shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * inside)
        valid = target != ignore_index
        count = valid.sum()
        loss = ((total.log() - picked) * valid).sum() / count
        ctx.save_for_backward(exp / total.unsqueeze(-1), idx, inside & valid, valid, count)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        softmax, idx, hit, valid, count = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, idx.unsqueeze(-1), -hit.to(g.dtype).unsqueeze(-1))
        g *= (valid.to(g.dtype) * (grad / count)).unsqueeze(-1)
        return g, None, None, None, None


def vocab_parallel_cross_entropy(output: torch.Tensor, target: torch.Tensor, group: TPGroup, *, rank: int,
                                 size: int, ignore_index: int = -100) -> torch.Tensor:
    """``cross_entropy``'s value on tp rank ``rank``'s part (of ``size``) of the logits (class dim last, split
    in rank order across the group), as pipec's built-in loss takes them: ``[..., C]`` against ``[...]`` class
    ids (a 2-D ``[B, C]`` against ``[B]``); every rank gets the same loss and its part of the logits' gradient.
    A class id outside ``[0, C)`` (and not ``ignore_index``) raises, as ``F.cross_entropy`` does: on CPU at
    once; on a GPU without syncing the host each microbatch: the first call of a process checks on the host
    (one sync: the located error), every later one asserts on the device (``torch._assert_async``: the run
    stops at its next sync rather than train on a class that is not there)."""
    global _TARGETS_CHECKED
    rows = output.shape[-1]
    flat = target.reshape(-1)
    bad = ((flat < 0) | (flat >= rows * size)) & (flat != ignore_index)
    if flat.device.type == "cpu" or not _TARGETS_CHECKED:
        _TARGETS_CHECKED = True
        if bool(bad.any()):
            raise IndexError(f"Target {int(flat[bad][0])} is out of bounds: the logits have {rows * size} classes")
    else:
        torch._assert_async(~bad.any(), f"a target is out of bounds: the logits have {rows * size} classes")
    return _VocabParallelCE.apply(output.reshape(-1, rows).float(), flat, group, rank * rows, ignore_index)


_TARGETS_CHECKED = False
"""Whether this process's first vocab-parallel loss on a GPU has checked its targets on the host."""
