"""Tensor parallelism (Megatron's layout, found by a dataflow analysis of each stage's graph).

The public entry points, re-exported here: :func:`plan_stages` (the compile's analysis: what each stage's
record says tp does to it), :func:`shard_stage` (a stage rewritten to one tp rank's part),
:func:`shard_param` and :func:`unshard` (a parameter's slice and its gathering). :mod:`.comm` holds the
collectives the rewritten stages call.
"""

from pipec.tp.tensor_parallel import KEY, SP_KEY, plan_stage, plan_stages, shard_param, shard_stage, unshard

__all__ = ["KEY", "SP_KEY", "plan_stage", "plan_stages", "shard_param", "shard_stage", "unshard"]
