"""pipec: a declarative pipeline-schedule compiler for PyTorch.

The package is assembled from the repository's top-level folders:
``compiler/`` -> ``pipec.compiler``, ``schedules/`` -> ``pipec.schedules``,
``runtime/`` -> ``pipec.runtime``, ``dsl/`` -> ``pipec.dsl``, ``model/`` ->
``pipec.model``, ``tp/`` -> ``pipec.tp``, ``costs/`` -> ``pipec.costs``,
``tune/`` -> ``pipec.tune``, ``views/`` -> ``pipec.views`` and ``examples/`` ->
``pipec.examples``.

``from pipec import pipe_split`` gives the stage-boundary marker a model calls
in its ``forward``. It is imported on first use, so ``import pipec`` (and a
schedule-only ``pipec compile``) never imports torch.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "pipe_split"]


def __getattr__(name: str):
    if name == "pipe_split":
        from pipec.model.trace import pipe_split

        return pipe_split
    raise AttributeError(f"module 'pipec' has no attribute {name!r}")
