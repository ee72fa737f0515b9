"""The zero-bubble backward split: input grads now (``BWD_I``), weight grads later (``BWD_W``).

During the forward of a stage whose schedule splits its backward, every
``linear`` (``F.linear``, ``nn.Linear``, ``aten.linear``) runs through
:class:`DeferredLinear`. Its backward computes the input grad and the bias
grad at once and stashes ``(weight, x, grad_out)``; ``BWD_W`` later computes
``grad_out^T @ x`` into ``weight.grad``. Nothing of the input-grad work is
redone, as in the Zero Bubble paper's runtime (its ``WeightGradStore`` does
the same for Megatron's linear layers). Other parameters (layer norms,
embeddings) get their grads during ``BWD_I``: they are cheap.

The runtime's executor runs it; ``costs profile`` (costs.py) times a stage's split backward through it, so
the costs of ``BWD_I`` and ``BWD_W`` are what the run pays for them, not the fused backward cut in two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["WeightGradStash", "defer_weight_grads"]


class WeightGradStash:
    """The deferred weight-grad work of one (stage, microbatch)."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def run(self) -> None:
        """Accumulate the stashed weight grads (the ``BWD_W`` instruction)."""
        with torch.no_grad():
            for weight, x, grad_out in self.items:
                # under autocast the linear ran in grad_out's dtype on x cast to it; x was saved uncast
                g = grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).to(grad_out.dtype)
                g = g.to(weight.dtype)
                if weight.grad is None:
                    weight.grad = g
                else:
                    weight.grad.add_(g)
        self.items.clear()


class DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stash):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.weight = weight  # the parameter itself: under saved_tensors_hooks, saved_tensors gives back an alias
        ctx.stash = stash
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight.to(grad_out.dtype) if ctx.needs_input_grad[0] else None
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[1]:
            ctx.stash.items.append((ctx.weight, x.detach(), grad_out.detach()))
        return grad_x, None, grad_b, None


_LINEARS = (F.linear, torch.ops.aten.linear.default)


class defer_weight_grads(TorchFunctionMode):
    """Run a forward with linear weight grads deferred into ``stash``."""

    def __init__(self, stash: WeightGradStash) -> None:
        super().__init__()
        self.stash = stash

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LINEARS:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(weight, torch.nn.Parameter) or (weight.requires_grad and weight.is_leaf):
                return DeferredLinear.apply(x, weight, bias, self.stash)
        return func(*args, **kwargs)
