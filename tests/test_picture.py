"""The picture (views/picture.py): what it draws for a sharded prediction, its row labels, its legend."""

from __future__ import annotations

import re

from matplotlib.colors import to_hex

from pipec.compiler.driver import compile_plan
from pipec.views.common import KINDS
from pipec.views.picture import figure
from pipec.views.timeline import render_terminal
from test_render import measured_from, one_f_one_b, text_of


def _rgb(colour: str) -> tuple[int, ...]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


def test_reshard_and_a_collectives_wait_differ_in_colour():
    re_, wait = _rgb(KINDS["RE"].colour), _rgb(KINDS["comm"].colour)
    assert sum(abs(a - b) for a, b in zip(re_, wait)) > 150, (KINDS["RE"].colour, KINDS["comm"].colour)
    colours = [k.colour for k in KINDS.values()]
    assert len(set(colours)) == len(colours)


def _drawn(fig) -> dict[str, set[str]]:
    """gid of each bar collection -> the colours of its bars."""
    ax = fig.axes[0]
    return {c.get_gid(): {to_hex(f) for f in c.get_facecolors()} for c in ax.collections if c.get_gid()}


def test_a_prediction_draws_unshard_reshard_and_reduce_scatter_and_the_legend_names_every_kind_drawn():
    plan = compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b", dp=2, shard="full").plan
    assert any(e.op.name == "UNSHARD" and e.end == e.start for e in plan.prediction.events)  # instants in a prediction
    fig = figure(plan.prediction)
    drawn = _drawn(fig)
    for rank in (0, 1):
        assert {KINDS[k].colour for k in ("UN", "RS", "RE")} <= drawn[f"instants-predicted-{rank}"], drawn
    colours = set().union(*drawn.values())
    legend = {t.get_text() for t in fig.legends[0].get_texts()}
    shown = {k.name for k in KINDS.values() if k.colour in colours}
    assert shown <= legend and {"unshard (all-gather)", "reduce-scatter", "reshard"} <= legend, (shown, legend)


def test_picture_rows_say_which_rank_and_replica_they_are_and_the_terminal_says_what_gN_is():
    pred = one_f_one_b(2, 4)
    meas = measured_from(pred, dp=2)
    fig = figure(pred, measured=meas)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["pp 0 predicted", "pp 0 dp 0 measured (global rank 0)", "pp 0 dp 1 measured (global rank 1)",
                      "pp 1 predicted", "pp 1 dp 0 measured (global rank 2)", "pp 1 dp 1 measured (global rank 3)"]
    lines = text_of(render_terminal(pred, measured=meas, width=100), 100)
    assert any(re.search(r"meas gN: measured on global rank N", line) for line in lines), lines
    alone = text_of(render_terminal(pred, measured=measured_from(pred, dp=1), width=100), 100)
    assert not any("gN" in line for line in alone)
