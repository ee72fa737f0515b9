"""Reference equality: pipec's named schedules against torch.distributed.pipelining (2.13).

For every (P, M, v) with P in 1..8, M in 1..4P (v in 2..3 for the multi-chunk
families, v = 2 for zbv), the per-rank compute order of a pipec family equals
what the torch schedule named in DESIGN's table executes, and pipec's rules
accept exactly the configurations torch accepts.

How the reference is captured:

- ``ScheduleGPipe`` and ``Schedule1F1B`` execute hand-written loops
  (``_step_microbatches``), not their ``pipeline_order`` (1F1B's is wrong on
  the last rank). We run the real ``step()`` of the real schedule class, once
  per pp rank, with a duck-typed stage object in place of ``PipelineStage``:
  its ``get_*_recv_ops``/``get_*_send_ops`` return no P2P ops, so torch's own
  ``_batch_p2p``/``_sorted_batch_p2p`` issue nothing and no process group is
  needed (nothing is patched), and its ``forward_one_chunk`` /
  ``backward_one_chunk`` record each call. The loop of one rank does not
  depend on the other ranks except through those (here empty) waits, so
  the recorded calls are exactly the compute order that rank executes.
- The multi-stage schedules (``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``,
  ``ScheduleLoopedBFS``, ``ScheduleZBVZeroBubble``) run ``_PipelineScheduleRuntime``, which executes
  ``pipeline_order_with_comms``: the ``pipeline_order`` lowered by
  ``_prepare_schedule_with_comms`` (the constructor calls it; for interleaved
  zero bubble, after its ``_add_bubbles_to_actions`` put idle slots in). We construct
  each schedule once per config with duck-typed stages and take the compute
  actions (F, B, I, W) of ``pipeline_order_with_comms`` for every rank; they
  also equal ``pipeline_order`` with its idle slots (None) dropped.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from pipec.schedules import Kind, ScheduleError, build_order, check_rules, validate_order
from pipec.schedules.timing import peak_in_flight

RANKS = range(1, 9)


def configs(chunks):
    return [(P, M, v) for P in RANKS for M in range(1, 4 * P + 1) for v in chunks]


class RecordingStage:
    """Stands in for ``PipelineStage`` in a single-stage schedule: no P2P, records compute."""

    device = "cpu"
    submod = None

    def __init__(self, stage_index: int, num_stages: int):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.has_backward = False
        self.output_chunks: list = []
        self.calls: list[str] = []

    # set-up and bookkeeping the schedule calls
    def clear_runtime_states(self):
        self.calls.clear()

    def _get_init_p2p_neighbors_ops(self):
        return []

    def _prepare_forward_infra(self, num_microbatches, args, kwargs, has_backward=False):
        return None

    def _prepare_backward_infra(self, num_microbatches, **kwargs):
        return None

    def perform_reduce_grad(self, grad_scale_factor):
        self.calls.append("REDUCE")

    # communication: nothing to send or receive
    def get_fwd_recv_ops(self, mb):
        return []

    def get_fwd_send_ops(self, mb):
        return []

    def get_bwd_recv_ops(self, mb):
        return []

    def get_bwd_send_ops(self, mb):
        return []

    # compute: recorded
    def forward_one_chunk(self, mb, args, kwargs=None, save_forward_output=True):
        self.calls.append(f"F{self.stage_index}.{mb}")
        return torch.zeros(1)

    def backward_one_chunk(self, mb, loss=None, full_backward=True, last_backward=False):
        assert full_backward
        self.calls.append(f"B{self.stage_index}.{mb}")


def runtime_loop_order(schedule_class, P: int, M: int) -> list[list[str]]:
    """Per rank, the compute calls of one real ``step()`` of ``schedule_class``."""
    ranks = []
    for r in range(P):
        stage = RecordingStage(r, P)
        schedule = schedule_class(stage, M, loss_fn=lambda out, target: out.sum())
        schedule.step(target=torch.zeros(M), return_outputs=False)
        assert stage.calls[-1] == "REDUCE"
        ranks.append(stage.calls[:-1])
    return ranks


class FakeStage:
    """Stands in for ``PipelineStage`` when a multi-stage schedule builds its order."""

    submod = None

    def __init__(self, num_stages: int, group_size: int):
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = 0
        self.stage_index_to_group_rank: dict[int, int] = {}


def runtime_ir_order(schedule_class, P: int, M: int, v: int) -> list[list[str]]:
    """Per rank, the compute actions ``_PipelineScheduleRuntime`` executes for the config."""
    stages = [FakeStage(v * P, P) for _ in range(v)]
    schedule = schedule_class(stages, M)
    ranks = []
    for r in range(P):
        executed = [
            a for a in schedule.pipeline_order_with_comms[r] if a.computation_type.value in "FBIW"
        ]
        drawn = [a for a in schedule.pipeline_order[r] if a is not None]
        assert executed == drawn
        ranks.append([f"{a.computation_type.value}{a.stage_index}.{a.microbatch_index}" for a in executed])
    return ranks


def pipec_order(name: str, P: int, M: int, v: int) -> list[list[str]]:
    order = build_order(name, num_ranks=P, num_microbatches=M, num_chunks=v)
    validate_order(order)
    return [[str(a) for a in actions] for actions in order.ranks]


def torch_accepts(make) -> bool:
    try:
        make()
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("P", RANKS)
def test_gpipe_equals_torch_runtime_loop(P):
    for M in range(1, 4 * P + 1):
        assert pipec_order("gpipe", P, M, 1) == runtime_loop_order(ScheduleGPipe, P, M), (P, M)


@pytest.mark.parametrize("P", RANKS)
def test_1f1b_equals_torch_runtime_loop(P):
    for M in range(P, 4 * P + 1):
        assert pipec_order("1f1b", P, M, 1) == runtime_loop_order(Schedule1F1B, P, M), (P, M)


@pytest.mark.parametrize("P", RANKS)
def test_1f1b_below_p_is_the_natural_extension(P):
    """torch refuses M < P; pipec runs the same loop with the warm-up capped at M."""
    for M in range(1, P):
        with pytest.raises(ValueError):
            Schedule1F1B(RecordingStage(0, P), M)
        assert check_rules("1f1b", num_ranks=P, num_microbatches=M), "M < P must warn"
        order = build_order("1f1b", num_ranks=P, num_microbatches=M)
        validate_order(order)
        assert peak_in_flight(order) == tuple(min(P - r, M) for r in range(P))
        for r, actions in enumerate(order.ranks):
            kinds = [a.kind for a in actions]
            warmup = min(P - r, M)
            assert kinds[:warmup] == [Kind.F] * warmup
            assert kinds[warmup] is Kind.B
            # microbatches go in order, forwards and backwards alike
            assert [a.microbatch for a in actions if a.kind is Kind.F] == list(range(M))
            assert [a.microbatch for a in actions if a.kind is Kind.B] == list(range(M))


def test_torch_1f1b_pipeline_order_is_wrong_on_the_last_rank():
    """Why the runtime loop, not pipeline_order, is the 1f1b reference (notes §0.3)."""
    P, M = 4, 8
    drawn = Schedule1F1B(RecordingStage(0, P), M).pipeline_order[P - 1]
    forwards = [a.microbatch_index for a in drawn if a is not None and a.computation_type.value == "F"]
    assert 0 not in forwards
    assert runtime_loop_order(Schedule1F1B, P, M)[P - 1][:2] == [f"F{P - 1}.0", f"B{P - 1}.0"]


@functools.cache
def _multi(name: str, P: int, M: int, v: int):
    classes = {
        "interleaved_1f1b": ScheduleInterleaved1F1B,
        "interleaved_zb": ScheduleInterleavedZeroBubble,
        "looped_bfs": ScheduleLoopedBFS,
        "zbv": ScheduleZBVZeroBubble,
    }
    try:
        return runtime_ir_order(classes[name], P, M, v)
    except ValueError:
        return None


@pytest.mark.parametrize(
    "name,chunks",
    [("interleaved_1f1b", (2, 3)), ("interleaved_zb", (2, 3)), ("looped_bfs", (2, 3)), ("zbv", (2,))],
)
@pytest.mark.parametrize("P", RANKS)
def test_multi_chunk_equals_torch_runtime(name, chunks, P):
    for _, M, v in [c for c in configs(chunks) if c[0] == P]:
        reference = _multi(name, P, M, v)
        try:
            check_rules(name, num_ranks=P, num_microbatches=M, num_chunks=v)
        except ScheduleError as error:
            assert reference is None, f"torch accepts {name} P={P} M={M} v={v}, pipec refused: {error}"
            assert error.rule == f"{name}.microbatches"
            continue
        assert reference is not None, f"pipec accepts {name} P={P} M={M} v={v}, torch refuses"
        assert pipec_order(name, P, M, v) == reference, (name, P, M, v)


def test_interleaved_rule_matches_torch_where_it_bites():
    """M = 2P+1 fails torch's M % max(1, M//P) rule; M = P+1 passes (notes §3.12)."""
    P = 4
    assert _multi("interleaved_1f1b", P, 2 * P + 1, 2) is None
    with pytest.raises(ScheduleError) as info:
        build_order("interleaved_1f1b", num_ranks=P, num_microbatches=2 * P + 1)
    assert info.value.rule == "interleaved_1f1b.microbatches"
    assert _multi("interleaved_1f1b", P, P + 1, 2) == pipec_order("interleaved_1f1b", P, P + 1, 2)


def test_zbv_chunk_rule_matches_torch():
    P = 2
    with pytest.raises(ValueError):
        ScheduleZBVZeroBubble([FakeStage(3 * P, P) for _ in range(3)], 4)
    with pytest.raises(ScheduleError) as info:
        build_order("zbv", num_ranks=P, num_microbatches=4, num_chunks=3)
    assert info.value.rule == "zbv.chunks"
    assert "use virtual 2" in str(info.value)


def test_interleaved_zb_rules_match_torch_where_they_bite():
    """torch's ScheduleInterleavedZeroBubble refuses M = 2P+1 (M % max(1, M//P)); pipec refuses it at the
    microbatches key with the counts that fit; one chunk per rank is refused for zb_h1."""
    P = 4
    assert _multi("interleaved_zb", P, 2 * P + 1, 2) is None
    with pytest.raises(ScheduleError) as info:
        build_order("interleaved_zb", num_ranks=P, num_microbatches=2 * P + 1)
    assert info.value.rule == "interleaved_zb.microbatches" and info.value.key == "microbatches"
    assert "use microbatches 8 or 10" in str(info.value)
    assert "ScheduleInterleavedZeroBubble" in str(info.value)
    with pytest.raises(ScheduleError) as info:
        build_order("interleaved_zb", num_ranks=P, num_microbatches=8, num_chunks=1)
    assert info.value.rule == "interleaved_zb.chunks" and info.value.key == "virtual"
    assert "use virtual 2, or schedule zb_h1" in str(info.value)


def test_interleaved_zb_weight_grads_trail_by_rank():
    """ZB1P's shape, which the torch equality above holds for every config: rank r runs one warm-up forward
    per hop to the last rank past (v-1) rounds, and its k-th W right after its (k+r)-th I."""
    P, M, v = 4, 8, 2
    order = build_order("interleaved_zb", num_ranks=P, num_microbatches=M, num_chunks=v)
    for r, actions in enumerate(order.ranks):
        kinds = [a.kind for a in actions]
        assert kinds.index(Kind.I) == (v - 1) * P + (P - 1 - r) + 1
        inputs = [i for i, a in enumerate(actions) if a.kind is Kind.I]
        weights = [i for i, a in enumerate(actions) if a.kind is Kind.W]
        for k in range(v * M - r):
            assert inputs[k + r] < weights[k] and actions[weights[k]][1:] == actions[inputs[k]][1:]
