"""Cuts priced from timed pieces (costs/pieces.py), and ``pipec tune`` under ``costs profile`` on them:
the grid, which pieces are alike, the sum's algebra against a timer whose stage times are known, the winner timed on
its own stages."""

from __future__ import annotations

import json

import pytest
from torch import nn

from conftest import spec_file

from pipec.cli import main
from pipec.compiler.frontend import Partition, TensorSpec, cut_stage_graph, trace_request
from pipec.costs import costs as costs_pass
from pipec.costs import pieces as pieces_mod
from pipec.model.partition import split_graph
from pipec.costs.pieces import Pieces, _stage_of, cut_positions, grid_of
from pipec.costs.timings import stage_digest
from pipec.costs.profile import Profiling
from pipec.compiler.ir.plan import Cost
from model_requests import changed, model_request

GPT = dict(layers=4, dim=32, heads=2, vocab=64, seq=8)


def _gpt(mb: int = 2, **kw):
    req = model_request(target="pipec.examples.gpt:build", kwargs={**GPT, **kw}, num_microbatches=1, num_stages=1,
                        inputs=(TensorSpec("tokens", "int64", (mb, 8)),), costs="unit")
    return req, trace_request(req)


class Widths(nn.Module):
    """Four layers in a ModuleList, the last wider: the second and third are alike; the first is not (it takes the
    model's input, no gradient to send), nor is the last."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)]
                                    + [nn.Sequential(nn.Linear(8, 16), nn.ReLU())])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build_widths():
    return Widths()


def test_the_grid_is_where_layers_start_and_end():
    _, tm = _gpt()
    names = [tm.cuts.nodes[i].name for i in grid_of(tm)]
    assert names[:4] == ["blocks_0_ln1", "blocks_1_ln1", "blocks_2_ln1", "blocks_3_ln1"]
    assert len(names) == 5 and not names[4].startswith("blocks")   # the head's nodes: one piece


def test_layers_alike_are_one_kind_and_a_wider_one_is_not():
    _, tm = _gpt()
    grid = grid_of(tm)
    split = split_graph(tm.traced, _stage_of(tm, grid), len(grid) + 1)
    kinds = [stage_digest(split, s) for s in range(split.num_stages)]
    assert len(set(kinds[1:5])) == 1 and len(set(kinds)) == 3        # embedding, the blocks, the head
    req = model_request(target=f"{__name__}:build_widths", num_microbatches=1, num_stages=1,
                        inputs=(TensorSpec("x", "float32", (4, 8)),), costs="unit", loss="mse")
    tm = trace_request(req)
    grid = grid_of(tm)
    split = split_graph(tm.traced, _stage_of(tm, grid), len(grid) + 1)
    kinds = [stage_digest(split, s) for s in range(split.num_stages)]
    assert len(kinds) == 4 and kinds[1] == kinds[2] and len(set(kinds)) == 3


# a timer whose stages cost what their FLOPs say plus a fixed cost per stage: the sum of pieces, less the overhead the
# whole model calibrates, must give every cut's stages exactly what timing them would
K, C = 1e-9, 1e-4


def _known(split, stages=None, **_):
    out = []
    for s in (range(split.num_stages) if stages is None else stages):
        f, i, w = costs_pass.stage_flops(split, s)
        out.append(Cost(fwd=f * K + C, bwd=(i + w) * K + 2 * C, bwd_i=i * K + C, bwd_w=w * K + C,
                        optim=split.parts[s].num_params * K + C, spread=0.05))
    return out, {"concurrent_ranks": 1}


def test_a_cut_is_priced_as_its_stages_would_time(monkeypatch):
    timed: list[int] = []

    def known(split, profile, *, stages=None, **kw):
        timed.append(split.num_stages)
        return _known(split, stages)

    monkeypatch.setattr(pieces_mod, "profile_stages", known)
    # a piece off the grid is priced by its nodes' share of the forward: FLOPs here, as the timer's
    monkeypatch.setattr(costs_pass, "time_nodes", lambda traced, *a, **kw: {
        n.name: float(n.meta.get("pipec_flops", 0)) for n in traced.gm.graph.nodes})
    req, tm = _gpt(mb=2)
    priced = Pieces(Profiling(), kwargs=req.model.kwargs, calibration=lambda: tm)
    for stages in (1, 2, 3, 5, 9):   # 3, 5 and 9 stages cut inside the blocks, 9 among the head's nodes too
        r = changed(req, num_stages=stages, partition=Partition("balanced", "flops"))
        cut = cut_stage_graph(tm, r, runnable=False)
        got = priced.price(tm, cut)
        full = cut_stage_graph(tm, r)        # the same cut, its stages built: what timing them gives
        want, _ = _known(_split_of(tm, full))
        for st, w in zip(got.stages, want):
            if st.stage == 0:
                w = costs_pass._no_input_grad(w)
            # off the grid a piece's backward splits into its halves as its forward's share says (the timer's
            # halves follow the backward FLOPs): its halves only add up
            on_grid = set(cut_positions(tm, cut)) <= set(grid_of(tm))
            for part in ("fwd", "bwd", "optim", *(("bwd_i", "bwd_w") if on_grid else ())):
                assert abs(getattr(st.cost, part) - getattr(w, part)) <= 1e-12 + 1e-9 * getattr(w, part), \
                    (stages, st.stage, part)
            assert abs(st.cost.bwd_i + st.cost.bwd_w - st.cost.bwd) <= 1e-12 + 1e-9 * st.cost.bwd
        assert got.model["profile"]["summed"]["overhead_s"]["fwd"] == round(C, 9)
    assert priced.num_timed == 4     # the embedding, a block, the head, and the whole model once


def _split_of(tm, graph):
    pos = cut_positions(tm, graph)
    return split_graph(tm.traced, _stage_of(tm, pos), len(pos) + 1)


TINY = '''model "pipec.examples.gpt:build" (layers=2, dim=32, heads=2, vocab=64, seq=8)
input tokens: int64[4, 8]
schedule 1f1b
pp 2  microbatches 2
costs profile
'''
"""A small GPT's schedule file under costs profile, for the tunes here."""


def test_tune_under_costs_profile_writes_its_winner_timed_on_its_own_stages(tmp_path_factory, tmp_path):
    pipe = spec_file(tmp_path_factory, TINY)
    out, tuned = tmp_path / "plan.json", tmp_path / "tuned.pipe"
    assert main(["tune", pipe, "--devices", "2", "--keep", "schedule,virtual", "-o", str(out),
                 "--pipe", str(tuned), "--json"]) == 0
    plan = json.loads(out.read_text())
    assert "summed" not in plan["model"]["profile"]           # the winner's own stages were timed
    assert len(plan["prediction"]["step_time_interval"]) == 2   # and the plan written has its interval
    again = tmp_path / "again.json"
    assert main(["compile", str(tuned), "-o", str(again)]) == 0
    compiled = json.loads(again.read_text())
    assert [st["cost"] for st in compiled["stages"]] == [st["cost"] for st in plan["stages"]]   # read, not timed again
    assert compiled["prediction"]["step_time_interval"] == plan["prediction"]["step_time_interval"]


def test_a_tune_measures_one_crowd_and_a_compile_of_its_pick_reads_it(tmp_path_factory, tmp_path, monkeypatch,
                                                                     capsys):
    """Under costs profile a search measures the crowd once, at the file's own microbatch shape, and prices every
    other shape at its slowdown: kept under that shape's key as measured at the file's, which a compile of the
    tuned file reads (and so predicts what tune reported); a compile at a shape the cache has no crowd of measures
    its own."""
    from pipec.costs import cache
    from pipec.costs import profile as prof

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(cache, "_memory", {})
    monkeypatch.setattr(cache, "_not_before", 0.0)
    crowds = []
    real = prof._at_once
    monkeypatch.setattr(prof, "_at_once", lambda *a, **kw: crowds.append(1) or real(*a, **kw))
    pipe = spec_file(tmp_path_factory, TINY)
    out, tuned = tmp_path / "plan.json", tmp_path / "tuned.pipe"
    # the partition kept (balanced by FLOPs): a cut balanced by time is cut by node times a new process measures
    # again, which may cut it elsewhere
    assert main(["tune", pipe, "--devices", "2", "--keep", "schedule,virtual,pp,partition", "-o", str(out),
                 "--pipe", str(tuned), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    level = result["search"]["level"]
    assert level > 0 and "summed_step_time" not in result["best"]   # the pick is timed on its own stages
    for row in result["top"]:                                  # summed rows are shown at the level
        if "summed_step_time" in row:
            assert row["step_time"] == pytest.approx(row["summed_step_time"] * level)
            assert row["step_time"] >= result["best"]["step_time"]
    entries = [json.loads(p.read_text()) for p in sorted((tmp_path / "xdg" / "pipec" / "crowd").glob("*.json"))]
    measured = [e for e in entries if "measured_at" not in e["value"]]
    borrowed = [e for e in entries if "measured_at" in e["value"]]
    assert len(crowds) == 1 and len(measured) == 1           # one crowd for the search
    assert measured[0]["key"]["inputs"] == [["tokens", [2, 8], "int64"]]   # the file's own shape: 4 / M 2
    assert len(borrowed) >= 2                                 # M 1 and 4 at least: shapes 4 and 1
    for e in borrowed:
        assert e["value"]["measured_at"] == {"inputs": measured[0]["key"]["inputs"], "at": measured[0]["at"]}
        assert e["value"]["slowdown"] == measured[0]["value"]["slowdown"]
    plan = json.loads(out.read_text())
    crowd = plan["model"]["profile"]["crowd"]
    shape = 4 // plan["num_microbatches"]
    if shape != 2:
        assert crowd["measured_at"]["inputs"] == [["tokens", [2, 8], "int64"]], crowd
    else:
        assert "measured_at" not in crowd
    cache._memory.clear()                                     # what a new process reads: the folder
    again = tmp_path / "again.json"
    assert main(["compile", str(tuned), "-o", str(again)]) == 0
    compiled = json.loads(again.read_text())
    assert compiled["model"]["profile"]["crowd"].get("measured_at") == crowd.get("measured_at")
    assert compiled["prediction"]["step_time"] == plan["prediction"]["step_time"]
    assert main(["compile", pipe, "--microbatches", "1", "-o", str(tmp_path / "m1.json")]) == 0   # shape 4
    m1 = json.loads((tmp_path / "m1.json").read_text())["model"]["profile"]["crowd"]
    assert m1["reused"] and m1["measured_at"]["inputs"] == [["tokens", [2, 8], "int64"]]
    assert len(crowds) == 1                                   # read, not measured again
    other = spec_file(tmp_path_factory, '''model "pipec.examples.gpt:build" (layers=2, dim=32, heads=2, vocab=64, seq=8)
input tokens: int64[12, 8]
schedule 1f1b
pp 2  microbatches 2
costs profile
''')
    assert main(["compile", other, "-o", str(tmp_path / "other.json")]) == 0
    assert len(crowds) == 2                                   # a plain compile at a new shape: its own crowd
    assert "measured_at" not in json.loads((tmp_path / "other.json").read_text())["model"]["profile"]["crowd"]
