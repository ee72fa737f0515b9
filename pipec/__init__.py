"""pipec: a declarative pipeline-schedule compiler for PyTorch.

The package is assembled from the repository's top-level folders:
``compiler/`` -> ``pipec.compiler``, ``schedules/`` -> ``pipec.schedules``,
``runtime/`` -> ``pipec.runtime``, ``dsl/`` -> ``pipec.dsl`` and
``examples/`` -> ``pipec.examples``.
"""

__version__ = "0.1.0"
