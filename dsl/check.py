"""The semantic pass: statements and flags -> a :class:`~pipec.dsl.spec.Spec`.

Driven by the key table: each statement's key must be in :data:`KEYS`
(did-you-mean otherwise), each value is converted by its key's kind (a
flag's was converted once, by :mod:`pipec.dsl.flags`), flags override the
file, and defaults are filled in. Then the cross-key rules run, in order,
each a small function of the resolution state (``RULES``): the mesh (stages
= pp x virtual, placement), the model's input and partition, the policy's
expressions, the training settings. Every error points at the value at
fault; a rule broken by a default points at the statement that made the
rule apply. Last, the keys are resolved into the compiler's request
(:mod:`pipec.dsl.boundary`). A schedule's own rules (1f1b's chunks, an
order's invariants, a policy's warm-up bounds) are the compiler driver's:
it checks them when it builds the order, and the boundary locates its
complaints.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from pipec.compiler.limits import MAX_MICROBATCHES, MAX_STAGES
from pipec.compiler.request import check_batch
from pipec.dsl import ast
from pipec.dsl.ast import NO_SPAN, Span
from pipec.dsl.boundary import request_of
from pipec.dsl.errors import DSLError, DSLWarning, Source, did_you_mean
from pipec.dsl.expr import ExprError, referenced_names
from pipec.dsl.flags import Flags, read_flags
from pipec.dsl.keys import DERIVED, KEYS
from pipec.dsl.kinds import Ctx
from pipec.dsl.structured import DTYPES, OrderDraft
from pipec.dsl.order import ORDER_NAMES, expand_block, read_csv, shape
from pipec.dsl.parse import Parsed
from pipec.dsl.spec import Origin, Spec, placement_ranks
from pipec.dsl.values import OrderSpec
from pipec.errors import PipecError
from pipec.schedules import SCHEDULES
from pipec.schedules.order import ScheduleError, loop_placement, v_placement

__all__ = ["check", "base_dir_of"]

_UNSET = object()
"""A given key's value not converted yet (a file's statement; a flag's arrives converted)."""

CUSTOM = ("schedule", "policy", "order")
"""The keys that choose the schedule: at most one of them is given."""


# ----------------------------------------------------------------------------- the resolution state


class _State:
    """Values, their origins and syntax nodes while keys are resolved."""

    def __init__(self, anchor: Source, base_dir: str) -> None:
        self.anchor = anchor
        self.base_dir = base_dir
        self.values: dict[str, Any] = {}
        self.origins: dict[str, Origin] = {}
        self.warnings: list[DSLWarning] = []
        self.form = "named"
        self.order_draft: OrderDraft | None = None
        self.policy = None
        """The bound :class:`~pipec.schedules.policy.Policy` of a policy schedule."""

    def given(self, key: str) -> bool:
        return key in self.origins and self.origins[key].given

    def default(self, key: str, value: Any, note: str = "") -> None:
        self.values[key] = value
        self.origins[key] = Origin("default", note=note)

    def _place(self, key: str, fallback: tuple[str, ...]) -> tuple[Source, Span]:
        for k in (key, *fallback):
            origin = self.origins.get(k)
            if origin is not None and origin.given:
                return origin.source, origin.span
        return self.anchor, NO_SPAN

    def _note(self, key: str) -> str:
        """For a key left at its default, a line saying so."""
        own = self.origins.get(key)
        if own is not None and not own.given:
            return f"{key} was not set: its default is {self.values.get(key)!s}" + (
                f" ({own.note})" if own.note else "") + f"; set `{key}` to change it"
        return ""

    def error(self, key: str, message: str, *hints: str, fallback: tuple[str, ...] = ()) -> DSLError:
        """An error at ``key``'s value; at the first given of ``fallback`` when ``key`` is a default."""
        source, span = self._place(key, fallback)
        return source.error(span, message, *hints, self._note(key))

    def item_error(self, key: str, index: int, message: str, *hints: str) -> DSLError:
        """An error at the ``index``-th item of ``key``'s (given) value."""
        return self.origins[key].source.error(self.item_span(key, index), message, *hints)

    def warn(self, key: str, message: str, *hints: str, fallback: tuple[str, ...] = ()) -> None:
        source, span = self._place(key, fallback)
        self.warnings.append(source.warning(span, message, *hints, self._note(key)))

    def item_span(self, key: str, index: int) -> Span:
        node = self.origins[key].node
        items = getattr(node, "items", None) or ()
        return items[index].span if 0 <= index < len(items) else self.origins[key].span


# ----------------------------------------------------------------------------- collection


def _collect(parsed: Parsed | None, flags: Flags, st: _State) -> dict[str, tuple[ast.Node, Origin, Any]]:
    """Each given key's syntax node, origin and (a flag's) converted value: the
    file's statements, then the flags over them."""
    given: dict[str, tuple[ast.Node, Origin, Any]] = {}
    if parsed is not None:
        source = parsed.source
        for stmt in parsed.file.statements:
            name = stmt.key.name
            if name not in KEYS:
                raise source.error(stmt.key.span, f"unknown key '{name}'", *_unknown_key_hints(name, given))
            if name == "model_args" and "model_args" in given and "model" in given:
                raise source.error(stmt.key.span, "model_args is set twice: here and after model",
                                   "keep the arguments in one place")
            if name in given:
                first = given[name][1].span
                raise source.error(stmt.key.span, f"'{name}' is set twice",
                                   f"it is first set at line {first.line}; remove one")
            value = stmt.value
            if name == "model" and "model_args" in given and isinstance(value, ast.Call):
                raise source.error(value.span, "model_args is set twice: here and by the model_args key",
                                   "keep the arguments in one place")
            if name == "model" and isinstance(value, ast.Call) and isinstance(value.func, ast.String):
                if value.args:
                    raise source.error(value.args[0].span, "model arguments are written name=value")
                args = _args_span(value)
                given["model_args"] = (ast.Group((), value.kwargs, args),
                                       Origin("file", source, args, node=value), _UNSET)
                value = value.func
            given[name] = (value, Origin("file", source, value.span, node=value), _UNSET)
    if any(k in CUSTOM for k in flags):  # a flag that chooses the schedule replaces the file's choice
        for k in CUSTOM:
            given.pop(k, None)
    for key, flag in flags.entries.items():
        origin = Origin("flag", flags.source, flag.node.span, flag=KEYS[key].flag, node=flag.node)
        value = flag.value
        if key == "model_args" and key in given:  # --model-arg k=v changes one argument, keeps the others
            old_node, old_origin, _ = given[key]
            kept = KEYS[key].kind.convert(old_node, Ctx(key, old_origin.source, st.base_dir))
            value = type(value)({**kept, **value})
        given[key] = (flag.node, origin, value)
    return given


def _args_span(call: ast.Call) -> Span:
    """The span of a call's arguments: from the first to the closing parenthesis."""
    if not call.kwargs:
        return call.span
    first = call.kwargs[0].span
    return Span(first.line, first.col, call.span.end_line, call.span.end_col)


def _unknown_key_hints(name: str, given: Mapping[str, Any]) -> tuple[str, ...]:
    if name in DTYPES and "input" in given:
        return ("an input is written NAME: DTYPE[DIMS]; is the ':' after the input's name missing?",)
    hint = did_you_mean(name, KEYS)
    return (hint,) if hint else ("the keys are listed in docs/reference.md",)


def _convert(given: Mapping[str, tuple[ast.Node, Origin, Any]], st: _State) -> None:
    for key, (node, origin, value) in given.items():
        st.values[key] = (KEYS[key].kind.convert(node, Ctx(key, origin.source, st.base_dir))
                          if value is _UNSET else value)
        st.origins[key] = origin


# ----------------------------------------------------------------------------- rules


def _form(st: _State) -> None:
    """Which of schedule / policy / order chooses the schedule."""
    chosen = [k for k in CUSTOM if st.given(k)]
    if len(chosen) > 1:
        first, second = chosen[0], chosen[1]
        raise st.error(second, f"{first} and {second} both choose the schedule",
                       f"keep one: `{first} ...` or `{second} ...`")
    st.form = chosen[0] if chosen and chosen[0] != "schedule" else "named"
    if st.form == "named":
        if not st.given("schedule"):
            st.default("schedule", KEYS["schedule"].default)
    else:  # `schedule` reads "policy" or "order", from where that was given
        st.values["schedule"], st.origins["schedule"] = st.form, st.origins[st.form]
    if st.form == "order":
        st.order_draft = st.values.pop("order")  # resolved with the mesh, in _mesh_of_order
    for key in ("policy", "order"):
        if key != st.form:
            st.default(key, None)


def _input_batch(st: _State) -> int | None:
    inputs = st.values.get("input")
    if not inputs:
        return None
    batch = inputs[0].shape[0]
    for t in inputs[1:]:
        if t.shape[0] != batch:
            raise st.error("input", f"inputs disagree on the batch size (their first dimension): "
                           f"{inputs[0].name} has {batch}, {t.name} has {t.shape[0]}")
    return batch


def _default_microbatches(st: _State) -> None:
    pp = st.values["pp"]
    batch = _input_batch(st)
    if batch is None:
        st.default("microbatches", min(2 * pp, MAX_MICROBATCHES), "2 x pp")
    else:
        best = max(d for d in range(1, min(2 * pp, batch) + 1) if batch % d == 0)
        st.default("microbatches", best, f"the largest divisor of the input batch {batch} up to 2 x pp")


def _mesh(st: _State) -> None:
    """pp, virtual, stages, placement, microbatches of a named or policy schedule."""
    if st.form == "order":
        return _mesh_of_order(st)
    if not st.given("pp"):
        st.default("pp", KEYS["pp"].default)
    pp = st.values["pp"]
    placement = st.values.get("placement") if st.given("placement") else None
    if not st.given("virtual"):
        if st.given("stages"):
            if st.values["stages"] % pp:
                raise st.error("stages", f"stages {st.values['stages']} is not a multiple of pp {pp}",
                               "every rank holds the same number of stages")
            st.default("virtual", st.values["stages"] // pp, "stages / pp")
        elif isinstance(placement, tuple):
            if len(placement) % pp:
                raise st.error("placement", f"placement lists {len(placement)} stages, not a multiple of pp {pp}")
            st.default("virtual", len(placement) // pp, "placement's stages / pp")
        elif placement == "v":
            st.default("virtual", 2, "the v placement")
        elif st.form == "named":
            st.default("virtual", SCHEDULES[st.values["schedule"]].default_chunks, "the schedule's")
        else:
            preset = st.values["policy"].preset
            st.default("virtual", SCHEDULES[preset].default_chunks if preset in SCHEDULES else 1,
                       "the preset's" if preset else "1")
    v = st.values["virtual"]
    if pp * v > MAX_STAGES:
        raise st.error("virtual", f"pp x virtual = {pp} x {v} = {pp * v} stages, beyond pipec's limit of {MAX_STAGES}",
                       fallback=("pp",))
    if st.given("stages") and st.values["stages"] != pp * v:
        raise st.error("stages", f"stages {st.values['stages']} must equal pp x virtual = {pp} x {v} = {pp * v}",
                       "give stages or virtual; the other follows")
    if not st.given("stages"):
        st.default("stages", pp * v, "pp x virtual")
    if not st.given("microbatches"):
        _default_microbatches(st)


def _placement(st: _State) -> None:
    """placement: given (checked against the mesh and the schedule) or the schedule's."""
    if st.form == "order":
        return
    pp, v, stages = st.values["pp"], st.values["virtual"], st.values["stages"]
    if not st.given("placement"):
        if st.form == "named":
            st.default("placement", SCHEDULES[st.values["schedule"]].placement, "the schedule's")
        else:
            st.default("placement", "loop")
    placement = st.values["placement"]
    if placement == "v" and v != 2 and st.given("placement"):  # a named schedule's own: the driver's rule
        raise st.error("placement", f"the v placement needs exactly 2 chunks per rank, got virtual {v}",
                       "use virtual 2, or placement loop", fallback=("virtual",))
    if isinstance(placement, tuple):
        if st.form == "policy":
            raise st.error("placement", "a policy places stages by loop or v, not by an explicit list",
                           "an explicit placement needs an explicit order")
        if len(placement) != stages:
            raise st.error("placement", f"placement lists {len(placement)} stages, but there are {stages} "
                           f"(pp {pp} x virtual {v})")
        for i, r in enumerate(placement):
            if r >= pp:
                raise st.item_error("placement", i, f"rank {r} is outside the pipeline: pp is {pp}",
                                    f"ranks are 0..{pp - 1}")
        counts = [placement.count(r) for r in range(pp)]
        if any(c != v for c in counts):
            r = next(r for r, c in enumerate(counts) if c != v)
            raise st.error("placement", f"rank {r} holds {counts[r]} stages; every rank must hold "
                           f"virtual = {v}")


def _mesh_of_order(st: _State) -> None:
    """pp, microbatches, stages, virtual and placement of an explicit order:
    what it covers, unless given (then they must agree)."""
    draft = st.order_draft
    origin = st.origins["order"]
    names = {ORDER_NAMES[n] for n in referenced_names(draft.block) if n in ORDER_NAMES} if draft.block else set()
    env: dict[str, int] = {}
    for canonical, key, alias in (("ranks", "pp", "P"), ("microbatches", "microbatches", "M"),
                                  ("chunks", "virtual", "V")):
        if canonical in names and not st.given(key):
            raise st.error("order", f"the order uses {canonical} ({alias}), so {key} must be set",
                           f"set {key}, or write the order without {alias}")
        if canonical in names or (key == "pp" and st.given("pp")):
            env[canonical] = st.values[key]
    if draft.block is not None:
        expanded = expand_block(draft.block, env, origin.source)
    else:
        expanded = read_csv(draft.path, draft.base_dir, draft.node, origin.source)
    num_ranks, num_mb, placement = shape(expanded)
    for key, found, what in (("pp", num_ranks, "ranks"), ("microbatches", num_mb, "microbatches")):
        if key not in st.values:
            st.default(key, found, "from the order")
        elif st.values[key] < found:
            raise st.error(key, f"the order uses {found} {what}, but {key} is {st.values[key]}",
                           f"set {key} {found}", fallback=("order",))
    pp = st.values["pp"]
    if num_ranks < pp:
        raise st.error("order", f"the order has actions for {num_ranks} rank{'s' if num_ranks != 1 else ''}, but pp is {pp}",
                       f"add rank clauses up to rank {pp - 1}")
    stages = len(placement)
    if stages % pp or any(placement.count(r) != stages // pp for r in range(pp)):
        raise st.error("order", "every rank must hold the same number of stages; the order places "
                       + ", ".join(f"{placement.count(r)} on rank {r}" for r in range(pp)))
    v = stages // pp
    for key, found in (("stages", stages), ("virtual", v)):
        if key not in st.values:
            st.default(key, found, "from the order")
        elif st.values[key] != found:
            raise st.error(key, f"the order has {found} {'stages' if key == 'stages' else 'chunks per rank'}, "
                           f"but {key} is {st.values[key]}", f"set {key} {found}, or leave it out")
    named = "loop" if placement == loop_placement(pp, stages) else (
        "v" if stages == 2 * pp and placement == v_placement(pp, stages) else placement)
    if st.given("placement"):
        want = st.values["placement"]
        want_list = (loop_placement(pp, stages) if want == "loop" else
                     v_placement(pp, stages) if want == "v" and stages == 2 * pp else want)
        if tuple(want_list) != placement:
            s = next((i for i in range(stages) if i >= len(want_list) or want_list[i] != placement[i]), 0)
            raise st.error("placement", f"the order runs stage {s} on rank {placement[s]}, but placement "
                           f"{KEYS['placement'].kind.show(want)} puts it "
                           + (f"on rank {want_list[s]}" if s < len(want_list) else "nowhere"),
                           "leave placement out: an order places its own stages")
    else:
        st.default("placement", named, "from the order")
    ranks = tuple(tuple(expanded.actions.get(r, ())) for r in range(pp))
    st.values["order"] = OrderSpec("inline" if draft.block is not None else "csv", draft.path, ranks, expanded)


def _defaults(st: _State) -> None:
    """Every key still unset whose default is a value (not derived from other keys): the table's default."""
    for key in KEYS.values():
        if key.name not in st.values and key.default is not DERIVED:
            st.default(key.name, key.default)


def _model(st: _State) -> None:
    """The model's input, microbatches, costs, partition and recompute."""
    has_model = st.values["model"] is not None
    if has_model and not st.values["input"]:
        raise st.error("model", "a model needs an example input to be traced",
                       "add the input of one dp replica's batch, such as: input tokens: int64[16, 128]")
    if st.given("model_args") and not has_model:
        raise st.error("model_args", "model_args without a model", 'add: model "pkg.module:factory"')
    if st.given("input") and not has_model:
        st.warn("input", "input is used only with a model; this plan is schedule-only")
    if st.given("targets") and not has_model:
        st.warn("targets", "targets is used only with a model; this plan is schedule-only")
    if st.given("targets") and not isinstance(st.values["data"], str):
        raise st.error("targets", "data tokens(...) makes the targets (each row's next tokens); targets cannot "
                       "declare others", "leave targets out")
    if _input_batch(st) is not None:  # the inputs agree on it: the rule is the compiler's, located here
        try:
            check_batch(st.values["input"], st.values["microbatches"])
        except PipecError as err:
            raise st.error(err.key, str(err), *err.hints, fallback=("input",)) from None
    if not st.given("costs"):
        if not has_model:
            st.default("costs", "unit", "no model")
        elif st.values["peak_flops"] is not None:
            st.default("costs", "flops", "a model and peak_flops are given")
        else:
            st.default("costs", "profile", "a model without peak_flops")
    elif st.values["costs"] != "unit" and not has_model:
        raise st.error("costs", f"costs {st.values['costs']} needs a model to measure",
                       "use costs unit for a schedule-only plan, or add a model")
    elif st.values["costs"] == "flops" and st.values["peak_flops"] is None:
        raise st.error("costs", "costs flops converts FLOPs to seconds at the device's peak, but peak_flops "
                       "is not set", "set peak_flops (such as peak_flops 989TFLOP/s, an H100 in bf16), or "
                       "use costs profile")
    part = st.values["partition"]
    stages = st.values["stages"]
    if part.method == "split" and len(part.split_before) + 1 != stages:
        num = len(part.split_before)
        raise st.error("partition", f"{num} split point{'s' if num != 1 else ''} make{'s' if num == 1 else ''} {num + 1} "
                       f"stages, but there are {stages}",
                       f"give {stages - 1} split point{'s' if stages != 2 else ''}", fallback=("stages",))
    recompute = st.values["recompute"]
    if recompute == "all":
        st.values["recompute"] = tuple(range(stages))
    else:
        for i, s in enumerate(recompute):
            if s >= stages:
                raise st.item_error("recompute", i, f"stage {s} does not exist: there are {stages} stages",
                                    f"stages are 0..{stages - 1}")


def _policy(st: _State) -> None:
    """A policy schedule's Policy for these counts: its expressions evaluated
    on every rank, its settings checked together (where a setting is written)."""
    if st.form != "policy":
        return
    origin = st.origins["policy"]
    try:
        st.policy = st.values["policy"].policy(
            placement=st.values["placement"], num_ranks=st.values["pp"],
            num_microbatches=st.values["microbatches"], num_chunks=st.values["virtual"])
    except ExprError as err:
        raise origin.source.error(err.span, err.message, *err.hints) from None
    except ScheduleError as err:
        field = err.rule.rpartition(".")[2]
        kwargs = {kw.name.name: kw for kw in getattr(origin.node, "kwargs", ())}
        raise origin.source.error(kwargs[field].span if field in kwargs else origin.span, str(err)) from None


def _tensor_parallel(st: _State) -> None:
    """An explicit ``tensor_parallel`` plan is read only with tp > 1."""
    if st.given("tensor_parallel") and st.values["tp"] == 1 and st.values["tensor_parallel"] != "auto":
        st.warn("tensor_parallel", "tensor_parallel is used only with tp > 1; at tp 1 every stage runs whole",
                "set tp 2 or more, or leave tensor_parallel out")
    if st.given("sequence_parallel") and st.values["tp"] == 1 and st.values["sequence_parallel"]:
        st.warn("sequence_parallel", "sequence_parallel is used only with tp > 1; at tp 1 every stage runs whole",
                "set tp 2 or more, or leave sequence_parallel out")


def _training(st: _State) -> None:
    sched = st.values["lr_schedule"]
    if sched.min_lr > st.values["lr"]:
        raise st.error("lr_schedule", f"min_lr {sched.min_lr:g} is above lr {st.values['lr']:g}",
                       "min_lr is where the decay ends; keep it at or below lr")
    if sched.warmup and sched.warmup >= st.values["steps"]:
        st.warn("lr_schedule", f"the warm-up lasts {sched.warmup} steps but the run takes "
                f"{st.values['steps']}: the learning rate never reaches lr", fallback=("steps",))
    if st.values["checkpoint_every"] and st.values["checkpoint_dir"] is None:
        raise st.error("checkpoint_every", "checkpoint_every needs checkpoint_dir",
                       'add: checkpoint_dir "ckpt"')
    if st.given("checkpoint_dir") and not st.values["checkpoint_every"]:
        st.warn("checkpoint_dir", "checkpoint_dir is set but checkpoint_every is 0: no checkpoint is written",
                "add: checkpoint_every 100")


RULES: tuple[Callable[[_State], None], ...] = (
    _form, _mesh, _placement, _defaults, _model, _policy, _tensor_parallel, _training,
)
"""The cross-key rules, in the order they run; each may fill in defaults the next ones read."""


# ----------------------------------------------------------------------------- entry point


def check(parsed: Parsed | None, overrides: Mapping[str, Any] | None = None, *, base_dir: str = ".") -> Spec:
    """Resolve a parsed file (or None) and flag overrides (:class:`Flags`, or
    key -> value text or typed value) into a :class:`Spec` and its compile request."""
    flags = read_flags(overrides or {})
    anchor = parsed.source if parsed is not None else flags.source
    st = _State(anchor, base_dir)
    _convert(_collect(parsed, flags, st), st)
    for rule in RULES:
        rule(st)
    assert set(st.values) == set(KEYS), set(KEYS) ^ set(st.values)
    values = {k: st.values[k] for k in KEYS}
    origins = {k: st.origins[k] for k in KEYS}
    own = st.form == "named" and not st.given("placement")  # the named schedule places its own stages
    request = request_of(values, origins, policy=st.policy, placement=None if own else placement_ranks(
                             values["placement"], values["pp"], values["stages"]), base_dir=base_dir)
    return Spec(values=values, origins=origins, warnings=tuple(st.warnings), anchor=anchor, request=request)


def base_dir_of(filename: str) -> str:
    """The folder a schedule file's relative paths are relative to."""
    if filename.startswith("<"):
        return "."
    return os.path.dirname(os.path.abspath(filename))
