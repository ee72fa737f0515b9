"""Tensor parallelism (Megatron's layout, found by a dataflow analysis of each stage's graph).

:mod:`.rules` holds what the analysis recognises and each op's rule, as tables; :mod:`.analysis` the
analysis and the entry points :func:`plan_stage` and :func:`plan_stages` (the compile's: what each stage's
record says tp does to it); :mod:`.sequence` sequence parallelism; :mod:`.record` the stage's record and the
checks of tied parameters; :mod:`.rewrite` :func:`shard_stage` (a stage rewritten to one tp rank's part) and
its proof; :mod:`.params` :func:`shard_param` and :func:`unshard` (a parameter's slice and its gathering);
:mod:`.comm` the collectives the rewritten stages call.
"""

from pipec.tp.analysis import plan_stage, plan_stages
from pipec.tp.params import shard_param, unshard
from pipec.tp.rewrite import shard_stage
from pipec.tp.rules import KEY
from pipec.tp.sequence import SP_KEY

__all__ = ["KEY", "SP_KEY", "plan_stage", "plan_stages", "shard_param", "shard_stage", "unshard"]
