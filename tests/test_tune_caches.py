"""The caches ``pipec tune``'s speed rests on give what building afresh gives: the front end's graphs
(:class:`_Graphs`), the named compute orders, the shard groups, and the compiled plans that reuse them
under other costs (other links, another microbatch shape, recompute)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import small_gpt_pipe, spec_file

from pipec.compiler import driver
from pipec.compiler.sim import simulate
from pipec.compiler.driver import compile_request
from pipec.compiler.frontend import build_stage_graph
from pipec.compiler.ir.plan import Link
from pipec.tune.search import _Graphs
from pipec.tune.space import Candidate, TuneRequest, candidate_request
from pipec.dsl import load_spec
from pipec.schedules import SCHEDULES

PIPE = small_gpt_pipe(batch=8, dp=2)


@pytest.fixture(scope="module")
def treq(tmp_path_factory) -> TuneRequest:
    return TuneRequest(base=load_spec(spec_file(tmp_path_factory, PIPE), {}).request, num_devices=4)


def _candidate(**kw) -> Candidate:
    base = dict(pp=2, dp=2, shard="grads", shard_size=None, schedule="zbv", num_chunks=2, num_microbatches=2,
                partition_by="flops")
    return Candidate(**{**base, **kw})


def _fresh_graph(treq: TuneRequest, c: Candidate):
    return build_stage_graph(candidate_request(treq, c, global_batch=8))


@pytest.mark.parametrize("change", [{}, {"recompute": frozenset({0})}, {"num_microbatches": 4},
                                    {"schedule": "1f1b", "num_chunks": 1}])
def test_cached_graphs_and_plans_equal_fresh_ones(treq, change):
    """A second candidate on the cached graphs (the cache hit with other costs: recompute, another microbatch
    shape, another cut) compiles to the plan its own fresh front end gives."""
    graphs = _Graphs(treq, 8)
    first = _candidate()
    graphs.graph(first)
    c = replace(first, **change)
    cached = graphs.graph(c)
    assert cached is graphs.graph(c)                  # built once
    fresh = _fresh_graph(treq, c)
    assert [st.cost for st in cached.stages] == [st.cost for st in fresh.stages]
    assert [st.activation_bytes for st in cached.stages] == [st.activation_bytes for st in fresh.stages]
    req = candidate_request(treq, c, global_batch=8)
    got = compile_request(req, graph=cached, verify=False).plan
    want = compile_request(req, graph=fresh).plan
    assert got.program == want.program
    assert got.prediction == want.prediction


def test_named_orders_are_built_once_and_equal_a_fresh_build(treq):
    req = candidate_request(treq, _candidate(), global_batch=8)
    order, _ = driver.schedule_order(req)
    assert driver.schedule_order(req)[0] is order
    assert order == SCHEDULES["zbv"].build(num_ranks=2, num_microbatches=2, num_chunks=2)


def test_shard_groups_cached_per_mesh_price_other_links_as_uncached(treq):
    """The shard groups are cached per (mesh, group, pp rank); two plans on one mesh with different links
    are priced as building the groups afresh prices them."""
    c = _candidate(pp=1, dp=4, shard="full", shard_size=2, schedule="1f1b", num_chunks=1)
    plan = compile_request(candidate_request(treq, c, global_batch=8), verify=False).plan
    mesh = plan.mesh
    for g in ("dp.shard", "dp.replicate"):
        assert simulate._dp_groups(mesh, g, 0) == tuple(dict.fromkeys(
            mesh.group_ranks(g, x) for x in mesh.replicas(0)))
    slow = replace(plan, links={**plan.links, "dp": Link(latency_s=1e-3, bandwidth_Bps=1e8)})
    fast, slower = simulate.plan_costs(plan).shard, simulate.plan_costs(slow).shard
    assert fast != slower
    simulate._dp_groups.cache_clear()
    assert simulate.plan_costs(slow).shard == slower
