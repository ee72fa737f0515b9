"""torch._dynamo imported only when something uses it, not by the first meta-tensor op.

torch wraps many of its Python kernels (the reference implementations behind meta tensors: a ``tril`` or a
``normal_`` on meta, every type-promoting elementwise op) in ``torch._compile._disable_dynamo``, whose wrapper
imports torch._dynamo on its first call to ask dynamo not to trace the kernel. Building and tracing a model on
meta calls such kernels, so every compile paid dynamo's import (0.5-0.8 s on 2 cores: a fifth of a warm
compile) for a ``disable`` that guards against a tracer that is not running: dynamo traces nothing it has not
been imported for.

:func:`defer_dynamo_import` gives each such wrapper, those torch has made and those it makes later, a body that
calls the kernel directly while torch._dynamo is not imported, and does what torch's does once it is (a
``torch.export`` fallback, a user's ``torch.compile``). Where torch's wrapper is not the one this was written
against (its free variables differ), nothing is changed and the import happens as before.
"""

from __future__ import annotations

import gc
import sys
from types import FunctionType

__all__ = ["defer_dynamo_import"]

_done = False


def _wrapper(fn, recursive):
    # a body for torch's own wrapper function: it keeps that function's closure (fn, recursive) and globals
    def inner(*args, **kwargs):
        import sys
        if "torch._dynamo" not in sys.modules:  # nothing can be tracing: the disable is a no-op
            return fn(*args, **kwargs)
        disable_fn = getattr(fn, "__dynamo_disable", None)
        if disable_fn is None:
            import torch._dynamo
            disable_fn = torch._dynamo.disable(fn, recursive, wrapping=False)
            fn.__dynamo_disable = disable_fn
        return disable_fn(*args, **kwargs)

    return inner


def defer_dynamo_import() -> bool:
    """Make torch's ``_disable_dynamo`` wrappers import torch._dynamo only once something else has (once per
    process; True where torch's wrapper is the expected one and was changed). Safe to call anywhere: a
    wrapper's behaviour is unchanged once dynamo is imported."""
    global _done
    if _done or "torch._dynamo" in sys.modules:
        return _done
    import torch
    import torch._compile as tc

    original = tc._disable_dynamo
    old = original(lambda: None).__code__
    new = _wrapper(None, True).__code__
    if old.co_freevars != new.co_freevars:
        return False
    for obj in gc.get_objects():  # the wrappers torch made at its import
        if type(obj) is FunctionType and obj.__code__ is old:
            obj.__code__ = new

    def disable_dynamo(fn=None, recursive=True):
        wrapped = original(fn, recursive)
        if fn is not None and getattr(wrapped, "__code__", None) is old:
            wrapped.__code__ = new
        return wrapped

    tc._disable_dynamo = disable_dynamo  # the wrappers of modules torch imports later
    torch._disable_dynamo = disable_dynamo
    _done = True
    return True
