"""The key table: every key of a schedule file, in one place.

Each :class:`Key` gives the key's name, the kind of value it takes (which
checks it: :mod:`pipec.dsl.kinds`), its default, its ``pipec compile`` flag,
its meaning, its constraints and an example. The semantic pass
(:mod:`pipec.dsl.check`), the flags (:mod:`pipec.dsl.cli`) and the reference
page (:mod:`pipec.dsl.reference`, ``docs/reference.md``) are all driven from
:data:`KEYS`, so they cannot drift apart. Names and flags are DESIGN.md's
contract ("Keys and flags").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from pipec.compiler.config import DEFAULTS as TRAINING
from pipec.compiler.config import INITS, RUN_DTYPES, TOKEN_DTYPES
from pipec.compiler.limits import (
    MAX_DEVICES_PER_NODE, MAX_MICROBATCHES, MAX_RANKS, MAX_REPLICAS, MAX_SEED, MAX_STAGES, MAX_STEPS, MAX_TP,
)
from pipec.compiler.ir.plan import SHARD_MODES
from pipec.dsl import kinds as k
from pipec.dsl import structured as sk
from pipec.dsl.values import Links, Partition
from pipec.schedules import SCHEDULES, schedule_elsewhere
from pipec.schedules.policy import PRESETS

__all__ = ["Key", "KEYS", "GROUPS", "DERIVED", "key_of_flag"]


class _Derived:
    """Marks a default computed from other keys (described by ``default_doc``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DERIVED"


DERIVED: Any = _Derived()


@dataclass(frozen=True, slots=True, kw_only=True)
class Key:
    name: str
    kind: k.Kind
    default: Any
    """The typed default, or :data:`DERIVED` when other keys decide it."""
    default_doc: str
    """The default as the reference page shows it."""
    flag: str = ""
    """Left out: ``--foo-bar`` for key ``foo_bar`` (DESIGN.md's rule; its fixed names are given)."""
    aliases: tuple[str, ...] = ()
    group: str = ""
    """The reference page's group the key is listed in: the one :data:`KEYS` lists it under."""
    meaning: str
    constraints: str = ""
    example: str
    repeatable: bool = False
    """The flag may be given several times (``--model-arg k=v``)."""

    def __post_init__(self) -> None:
        if not self.flag:
            object.__setattr__(self, "flag", "--" + self.name.replace("_", "-"))

    @property
    def flags(self) -> tuple[str, ...]:
        return (self.flag, *self.aliases)


def _table(*rows: str | Key) -> dict[str, Key]:
    """The key table from its rows: a string names a group of the reference page, and the keys after it are
    in that group."""
    keys: dict[str, Key] = {}
    group = ""
    for row in rows:
        if isinstance(row, str):
            group = row
        else:
            assert group and row.name not in keys, row.name
            keys[row.name] = replace(row, group=group)
    return keys


KEYS: dict[str, Key] = _table(
    "Schedule and mesh",
    Key(name="schedule", kind=k.Choice(tuple(SCHEDULES), schedule_elsewhere), default="1f1b", default_doc="1f1b",
        meaning=f"The named pipeline schedule, one of {', '.join(SCHEDULES)} (each one's chunks per rank, "
                "placement and microbatch rule: \"Named schedules\" in docs/reference.md). With `policy` or "
                "`order` the schedule is custom and this key reads `policy` or `order`.",
        constraints="Each schedule's rules on chunks and microbatches apply (zbv: exactly 2 chunks per rank "
                    "on the v placement; interleaved_1f1b: at least 2 chunks). Not together with `policy` "
                    "or `order`.",
        example="schedule interleaved_1f1b"),
    Key(name="pp", kind=k.Int(1, MAX_RANKS, "pipeline ranks"), default=2, default_doc="2",
        flag="--ranks", aliases=("--pp",),
        meaning="Pipeline ranks P: the number of places in the pipeline.",
        constraints=f"1..{MAX_RANKS} (pipec's limit).",
        example="pp 4"),
    Key(name="dp", kind=k.Int(1, MAX_REPLICAS), default=1, default_doc="1",
        meaning="Data-parallel replicas D of the whole pipeline. World size is pp x dp x tp; global rank = "
                "(pp_rank x dp + dp_rank) x tp + tp_rank (with tp 1: pp_rank x dp + dp_rank).",
        constraints=f"1..{MAX_REPLICAS}.",
        example="dp 2"),
    Key(name="tp", kind=k.Int(1, MAX_TP, "tensor-parallel ranks"), default=1, default_doc="1",
        meaning="Tensor-parallel ranks T per (pp rank, dp rank): the innermost mesh dimension, so a tp group is "
                "T consecutive global ranks (one node, with devices_per_node). Each stage's layers are split "
                "across its tp group (see `tensor_parallel`); every tp rank runs its pp rank's program, and "
                "messages between pp ranks go between tp peers (same dp and tp rank). A stage the sharding pass "
                "leaves whole runs replicated on its tp ranks. The dp groups (gradient all-reduce, shard groups) "
                "are the dp ranks of one pp rank and one tp rank.",
        constraints=f"1..{MAX_TP} (pipec's limit). With devices_per_node G: tp divides G (tp groups inside a "
                    "node), or is a multiple of G, which warns (every tp collective then crosses nodes).",
        example="tp 2"),
    Key(name="tensor_parallel", kind=sk.TensorParallelKind(), default="auto", default_doc="auto",
        meaning="How each stage's modules are split across its tp ranks: `auto` (the compiler picks Megatron's "
                "column / row pairs, token embeddings vocab-parallel and, under cross_entropy, a loss-parallel "
                "LM head), or an explicit plan of module-path globs, each with a style: `colwise` (the output "
                "features split), `rowwise` (the input features split; the output all-reduced), `vocab` (an "
                "embedding's rows split; the lookups all-reduced), `replicated` (not split). A colwise LM head "
                "at the last stage under cross_entropy leaves its logits split on the vocabulary and the loss is "
                "computed on the parts (loss parallel). A module matched by no pattern is replicated.",
        constraints="Read only with tp > 1 (warns otherwise). Patterns are quoted globs over module paths "
                    "(dotted names, with * ? and [...]), each given once; that a pattern matches a module of "
                    "the model is checked when the model is traced.",
        example='tensor_parallel "blocks.*.attn.qkv": colwise, "blocks.*.attn.proj": rowwise'),
    Key(name="sequence_parallel", kind=k.Switch(), default=False, default_doc="off",
        meaning="Megatron's sequence parallelism (Korthikanti et al. 2022) inside each tp group: the "
                "activations between a rowwise module and the next colwise one (layer norms, dropout, residual "
                "adds) are cut on the sequence dimension (dim 1 of the model's input) across the tp ranks, so "
                "they are saved at 1/tp; the colwise input's all-reduce becomes an all-gather forward "
                "(reduce-scatter backward), the rowwise output's a reduce-scatter forward (all-gather backward). "
                "The weights used there (norms, rowwise biases) have partial gradients on each tp rank, summed "
                "over the tp group before the optimizer step. Messages between pp ranks carry each tp rank's "
                "part of the sequence.",
        constraints="Read only with tp > 1 (warns otherwise). The sequence length divides by tp; a stage where "
                    "the sequence shard cannot be followed (an op mixing positions outside attention) is "
                    "refused, located.",
        example="sequence_parallel on"),
    Key(name="shard", kind=k.Choice(SHARD_MODES), default="none", default_doc="none",
        meaning="Sharded data parallelism: how the dp replicas share each stage's state. `none`: every "
                "replica holds all of it and gradients are all-reduced. `optimizer` (ZeRO-1): optimizer state "
                "sharded; gradients all-reduced; the optimizer step updates its shard and gathers the "
                "parameters. `grads` (ZeRO-2, FSDP2 reshard_after_forward=False): gradients and optimizer "
                "state sharded, parameters sharded at rest and gathered once per step (UNSHARD, kept until "
                "the stage's last backward), gradients reduce-scattered once per step (REDUCE_SCATTER). "
                "`full` (ZeRO-3, FSDP FULL_SHARD): parameters also resharded after each forward and gathered "
                "again for the backward.",
        constraints="Needs dp >= 2. Shards are padded as FSDP2 pads them (dim 0 rounded up to a multiple "
                    "of the shard size). Shard groups are consecutive dp ranks.",
        example="shard full"),
    Key(name="shard_size", kind=k.Maybe(k.Int(1, MAX_REPLICAS)), default=None, default_doc="dp",
        meaning="Replicas that shard a stage's state among themselves. Below dp (HSDP, a 2-D dp mesh "
                "replicate x shard) the state is sharded within groups of this many consecutive dp ranks "
                "(group `dp.shard`) and replicated across the groups (group `dp.replicate`, whose all-reduce "
                "follows the reduce-scatter).",
        constraints="Divides dp; needs shard other than none.",
        example="shard_size 4"),
    Key(name="virtual", kind=k.Int(1, MAX_STAGES), default=DERIVED, default_doc="the schedule's chunks per rank "
        "(1; interleaved_1f1b, looped_bfs and zbv: 2)",
        meaning="Chunks v per rank (virtual stages): each rank holds v of the S = pp x v stages.",
        constraints=f"stages = pp x virtual <= {MAX_STAGES}; gpipe, 1f1b and zb_h1 take 1, zbv exactly 2, "
                    "interleaved_1f1b and looped_bfs 2 or more.",
        example="virtual 2"),
    Key(name="stages", kind=k.Int(1, MAX_STAGES, "stages"), default=DERIVED,
        default_doc="pp x virtual",
        meaning="Stages S the model is cut into. Give it or `virtual`, not necessarily both.",
        constraints=f"A multiple of pp; must equal pp x virtual; 1..{MAX_STAGES} (pipec's limit).",
        example="stages 8"),
    Key(name="placement", kind=sk.PlacementKind(), default=DERIVED,
        default_doc="the schedule's (loop; zbv: v)",
        meaning="Which pp rank holds each stage: `loop` (stage s on rank s mod P), `v` (the V shape: "
                "s < P on rank s, then back down), or an explicit list giving each stage's rank.",
        constraints="`v` needs exactly 2 chunks per rank. A list has one entry per stage, each in "
                    "0..pp-1, every rank holding `virtual` stages. A named schedule needs its own "
                    "placement.",
        example="placement 0, 1, 1, 0"),
    Key(name="microbatches", kind=k.Int(1, MAX_MICROBATCHES, "microbatches"), default=DERIVED,
        default_doc="2 x pp (with an input: the largest divisor of its batch up to 2 x pp)",
        meaning="Microbatches M per step; each input's batch (its first dimension) is split into M.",
        constraints=f"1..{MAX_MICROBATCHES} (pipec's limit); divides each input's batch; the schedule's rules "
                    "(interleaved_1f1b: M divisible by max(1, M // P)). 1f1b with M < pp warns.",
        example="microbatches 8"),
    "Custom schedules",
    Key(name="policy", kind=sk.PolicyKind(tuple(PRESETS)), default=None, default_doc="none",
        meaning="A custom schedule declared by policy: warm-up depth per rank, backward or forward "
                "priority, backward split, where weight-grad work goes, chunk order. See "
                "\"Custom schedules\" above.",
        constraints="Settings: warmup (expression or all), priority (backward|forward), split_backward "
                    "(on|off), weight_grad (immediate|bubbles|end; not immediate needs split_backward on), "
                    "chunk_order (depth_first|breadth_first), backward_microbatches (ascending|descending), "
                    "max_in_flight (expression or max; with weight_grad bubbles). Placement loop or v.",
        example="policy (warmup=min(P - rank, M), priority=backward)"),
    Key(name="order", kind=sk.OrderKind(), default=None, default_doc="none",
        meaning="A custom schedule given as an explicit per-rank order: rank clauses, or a "
                "torch.distributed.pipelining compute-only CSV file (path relative to the schedule file).",
        constraints="Every (stage, microbatch) gets one F and one backward (B, or I then W) on the rank "
                    "that holds the stage. pp, microbatches, virtual and placement default to what the "
                    "order covers.",
        example='order "schedule.csv"'),
    "Model",
    Key(name="model", kind=k.Maybe(k.Target()), default=None, default_doc="none (a schedule-only plan)",
        meaning="The model factory, \"pkg.module:function\", optionally followed by its keyword "
                "arguments (which set `model_args`).",
        constraints="A dotted module path, a colon and a function name; the factory is imported when "
                    "the plan is compiled, not when the file is checked.",
        example='model "pipec.examples.gpt:build" (layers=8, dim=256, heads=4, vocab=1000, seq=128)'),
    Key(name="model_args", kind=sk.Kwargs(), default=MappingProxyType({}), default_doc="none",
        flag="--model-arg", repeatable=True,
        meaning="Keyword arguments of the model factory. `--model-arg k=v` sets one (repeatable) and "
                "keeps the file's others.",
        constraints="Literal values: numbers, strings, true/false, none, tuples. Not together with "
                    "arguments written after `model`.",
        example="model_args (layers=8, dim=256)"),
    Key(name="input", kind=k.Maybe(sk.Tensors()), default=None, default_doc="none",
        meaning="The example input of one dp replica's whole batch: name, dtype and shape of each "
                "model input. The model is traced with it; its batch is split into microbatches.",
        constraints=f"dtypes: {', '.join(sk.DTYPES)}. Required with `model`.",
        example="input tokens: int64[16, 128]"),
    Key(name="targets", kind=k.Maybe(sk.Tensors("y: float32[32, 4]", one=True)), default=None,
        default_doc="derived from the model and the loss",
        meaning="The targets of one dp replica's whole batch, as the loss takes them: name, dtype and shape "
                "(written like `input`). Synthetic targets then have this shape and dtype, and a data "
                "function's targets are checked against it. Left out, the targets are derived from the traced "
                "output and the loss. `pipec compile` runs loss(output, targets) on the meta device and refuses "
                "a mismatch.",
        constraints="Its batch (dim 0) is the input's. Not with `data tokens(...)`, whose targets "
                    "are the next tokens.",
        example="targets y: float32[32, 4]"),
    Key(name="partition", kind=sk.PartitionKind(), default=Partition("auto"),
        default_doc="auto",
        meaning="How the model is cut into stages: `auto` (the model's pipe_split() markers if it has "
                "any, else balanced by flops), `markers`, balanced by params, flops, time (measured) or "
                "memory (minimising the slowest stage), or split before the named modules.",
        constraints="`split before` names stages - 1 module paths in model order (checked against "
                    "the model when it is traced). flops balance is the default: reproducible and "
                    "machine-independent.",
        example="partition split before blocks.2, blocks.4, blocks.6"),
    Key(name="trace", kind=k.Choice(("auto", "fx", "export")), default="auto", default_doc="auto",
        meaning="How the model is traced: torch.fx, torch.export, or auto (fx, falling back to export).",
        example="trace export"),
    Key(name="init", kind=k.Choice(INITS), default=TRAINING.init, default_doc=TRAINING.init,
        meaning="Initial weights: `module` (each module's reset_parameters(), then the nearest _init_weights "
                "(a Hugging Face model's) applied to it and its enclosing modules, as the model's own "
                "initialisation does, under a generator seeded from (seed, module name); independent "
                "of the partition), `exact` (the factory's own initialisation, the whole model on each "
                "rank's CPU; needed for a factory that loads pretrained weights), or `auto`: `module` when "
                "every module that owns parameters has such an init path, else `exact` up to 1e9 "
                "parameters, else a compile-time error naming the modules. `pipec compile` resolves it; "
                "plan.json's spec.init records the result.",
        example="init exact"),
    "Costs and hardware",
    Key(name="costs", kind=k.Choice(("unit", "flops", "profile")), default=DERIVED,
        default_doc="unit without a model; with one, flops if peak_flops is set, else profile",
        meaning="Where stage costs come from: unit (F=1, B=2, I=W=1), flops (FLOPs at peak_flops: "
                "reproducible and machine-independent, the choice when compiling for other hardware), "
                "profile (measured on this machine: best when compiling on the target hardware; the timings are "
                "kept in the profile cache, ~/.cache/pipec or $XDG_CACHE_HOME/pipec, for the next compile: "
                "--reprofile measures again, pipec cache shows and clears it).",
        constraints="flops and profile need a model; flops needs peak_flops.",
        example="costs profile"),
    Key(name="peak_flops", kind=k.Maybe(k.FLOP_RATE), default=None, default_doc="none",
        meaning="The device's peak FLOP rate: converts flops costs to seconds, and gives a run's MFU.",
        constraints="Positive; FLOP/s, GFLOP/s, TFLOP/s, PFLOP/s (or a plain number in FLOP/s).",
        example="peak_flops 312TFLOP/s"),
    Key(name="device_memory", kind=k.Maybe(k.SIZE), default=None, default_doc="none (not checked)",
        meaning="Memory per device: a plan whose predicted peak exceeds it on any rank is refused.",
        constraints="Positive; B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (or a plain number of bytes).",
        example="device_memory 80GB"),
    Key(name="links", kind=sk.LinksKind(), default=Links(pp=sk.DEFAULT_LINK, dp=sk.DEFAULT_LINK),
        default_doc="pp(latency=10us, bandwidth=25GB/s), dp(latency=10us, bandwidth=25GB/s)",
        meaning="Latency and bandwidth per mesh axis: a message costs latency + bytes / bandwidth; "
                "an all-reduce over n replicas 2(n-1)/n x bytes / bandwidth. `intra` (within a node) and "
                "`inter` (across nodes) price each hop by where its ranks sit, with `devices_per_node`: a pp "
                "edge whose two ranks share a node (in every replica) pays intra, else inter; a dp, tie or "
                "shard group inside one node is a ring on intra; one spanning k nodes, m of its n members on "
                "a node, a hierarchical ring: the ring over the m on intra, then over the k nodes on inter "
                "with each node's 1/m share (all-reduce: 2(m-1)/m x bytes / intra + 2(k-1)/k x bytes / m / "
                "inter, plus both latencies). inter's bandwidth is per device (its share of the node's "
                "network).",
        constraints="Axes pp, dp, tp (the tp groups' collectives), intra and inter; an axis or setting left out "
                    "keeps its default (tp: none, the cost model's fallback). intra and "
                    "inter need devices_per_node to matter; one left out falls back to the axis's own link "
                    "(pp for pp edges, dp for dp groups), so with neither given hops are priced as without "
                    "nodes. --links replaces "
                    "the whole key. Not given, a model plan with costs profile measures its links (and the "
                    "executor's host time per instruction) with a short job of two local ranks, marked measured "
                    "in plan.json; on a cluster, measure them there with `torchrun ... -m pipec.runtime.linkprobe "
                    "-o links.json` and give its numbers here.",
        example="links pp(latency=5us, bandwidth=50GB/s), dp(latency=20us, bandwidth=12.5GB/s)"),
    Key(name="devices_per_node", kind=k.Maybe(k.Int(1, MAX_DEVICES_PER_NODE, "devices per node")), default=None,
        default_doc="none (not said: the pp and dp links price every hop)",
        meaning="Devices G per node: nodes hold G consecutive global ranks (global rank = (pp_rank x dp + "
                "dp_rank) x tp + tp_rank, so a node holds whole tp groups when tp divides G, and whole dp groups "
                "when dp x tp divides G). With `links intra(...)` and/or "
                "`inter(...)` each pp edge and each dp, tie and shard collective is priced by the nodes its "
                "ranks sit on (see `links`); `pipec show` says which link each axis used.",
        constraints="At least 1; divides the world size pp x dp x tp, or is at least it (one node).",
        example="devices_per_node 8"),
    "Training",
    Key(name="steps", kind=k.Int(1, MAX_STEPS), default=TRAINING.steps, default_doc=str(TRAINING.steps),
        meaning="Optimizer steps a run takes (`pipec run --steps` overrides the plan's).",
        example="steps 100"),
    Key(name="seed", kind=k.Int(0, MAX_SEED), default=TRAINING.seed, default_doc=str(TRAINING.seed),
        meaning="Seed of the initial weights and the synthetic data.",
        example="seed 1234"),
    Key(name="optimizer", kind=sk.OptimizerKind(),
        default=TRAINING.optimizer, default_doc=sk.OptimizerKind().show(TRAINING.optimizer),
        meaning="The optimizer and its settings (torch's names and defaults; settings left out keep "
                "them). adamw: betas, eps, weight_decay (0.01); adam: the same (weight_decay 0); "
                "sgd: momentum, dampening, weight_decay, nesterov.",
        constraints="The learning rate is the `lr` key, not a setting.",
        example="optimizer adamw(betas=(0.9, 0.95), weight_decay=0.1)"),
    Key(name="lr", kind=k.Real(0.0, lo_open=True), default=TRAINING.lr, default_doc="3e-4",
        meaning="Peak learning rate.", constraints="Positive.", example="lr 1e-3"),
    Key(name="lr_schedule", kind=sk.LRScheduleKind(), default=TRAINING.lr_schedule,
        default_doc=sk.LRScheduleKind().show(TRAINING.lr_schedule),
        meaning="Learning rate over the steps: `warmup` steps ramping linearly from 0, then constant, "
                "or a cosine or linear decay to `min_lr` at the last step.",
        constraints="warmup < steps (warns otherwise); min_lr <= lr.",
        example="lr_schedule cosine(warmup=10, min_lr=3e-5)"),
    Key(name="grad_clip", kind=k.Maybe(k.Real(0.0, lo_open=True)), default=TRAINING.grad_clip, default_doc="none",
        meaning="Clip the global gradient norm (over one replica's pp ranks, each tied weight once) "
                "to this value before each step.",
        constraints="Positive, or none.", example="grad_clip 1.0"),
    Key(name="dtype", kind=k.Choice(RUN_DTYPES), default=TRAINING.dtype,
        default_doc=TRAINING.dtype,
        meaning="Parameter and activation dtype of the run.", example="dtype bfloat16"),
    Key(name="recompute", kind=sk.RecomputeKind(), default=TRAINING.recompute, default_doc="none",
        meaning="Activation recomputation: none, all stages, or the listed stages. A recomputed stage "
                "saves only its inputs and runs its forward again in the backward.",
        constraints="Stages in 0..stages-1. The resolved value is the tuple of stages.",
        example="recompute stages 0, 1"),
    Key(name="data", kind=sk.DataKind(), default=TRAINING.data, default_doc=TRAINING.data,
        meaning="Training data. `synthetic`: made from the seed to fit the model and the loss (token ids in the "
                "range of the embedding they feed, class indices in [0, C) for cross_entropy over the output's "
                "last dimension, the output's shape and dtype for mse; see `targets`). "
                "`tokens(\"train.bin\", dtype=uint16)`: a flat file of token ids written back to back (the "
                "nanoGPT layout, e.g. `numpy.array(ids, dtype=numpy.uint16).tofile(\"train.bin\")`), read "
                "memory-mapped: each row of a batch is a window of seq + 1 tokens (the input and its next-token "
                "targets) chosen by (seed, step, dp rank, row), replicas disjoint within a step, wrapping at the "
                "end of the file, so a resumed run continues the same stream. \"pkg.module:fn\": called as "
                "fn(step, dp_rank, dp_size), returning (inputs, targets) for that replica's whole batch; inputs is "
                "a tensor (one model input), a tuple in input order, or a dict by input name, each shaped as "
                "`input` says; targets is one tensor (as `targets` says, when set). It must be a pure function "
                "of its arguments.",
        constraints="tokens: the path is relative to the schedule file (a flag's: to the current folder); "
                    f"dtype one of {', '.join(TOKEN_DTYPES)} (default uint16); the model has one int64 input "
                    "[batch, seq]; the file holds at least batch x dp windows, ids below the embedding's size "
                    "(checked by pipec compile). A function is found like the model (the schedule file's folder, "
                    "the current folder, then the installed packages); what it returns is checked on every call.",
        example='data tokens("train.bin", dtype=uint16)'),
    Key(name="loss", kind=k.Target(("cross_entropy", "mse")), default=TRAINING.loss,
        default_doc=TRAINING.loss,
        meaning="Loss of the last stage: cross_entropy, mse, or \"pkg.module:fn\" called as "
                "fn(output, target). The step's loss is the mean over microbatches. pipec derives synthetic "
                "targets only for cross_entropy and mse: a custom loss needs `targets` or a data function.",
        example="loss mse"),
    Key(name="checkpoint_dir", kind=k.Maybe(k.Text()), default=TRAINING.checkpoint_dir, default_doc="none",
        meaning="Folder of the run's distributed checkpoints (torch.distributed.checkpoint).",
        example='checkpoint_dir "ckpt/run1"'),
    Key(name="checkpoint_every", kind=k.Int(0, MAX_STEPS), default=TRAINING.checkpoint_every,
        default_doc=f"{TRAINING.checkpoint_every} (off)",
        meaning="Write a checkpoint every N steps; 0 writes none.",
        constraints="Above 0 needs checkpoint_dir.", example="checkpoint_every 50"),
)
"""Every key, in the order of the reference page."""

GROUPS: tuple[str, ...] = tuple(dict.fromkeys(key.group for key in KEYS.values()))
"""The reference page's groups, in its order."""


def key_of_flag(flag: str) -> str | None:
    """The key a flag sets (aliases included), or None."""
    for key in KEYS.values():
        if flag in key.flags:
            return key.name
    return None
