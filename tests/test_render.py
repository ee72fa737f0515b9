"""Timeline views: terminal, summary table, picture, Perfetto trace.

Timelines are built by hand here (a tiny unit-cost 1F1B event loop), so the
views are tested apart from the simulator and the runtime.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from rich.console import Console

from pipec.compiler.ir.plan import Mesh
from pipec.compiler.ir.program import IRError, Op, parse_instruction
from pipec.compiler.ir.schema import SchemaError
from pipec.compiler.ir.timeline import Event, Timeline
from pipec.views.common import KINDS, RenderError, format_time, kind_of, lanes
from pipec.views.perfetto import trace_events, write_perfetto
from pipec.views.picture import render_image
from pipec.views.summary import render_summary, show
from pipec.views.timeline import render_terminal

COST = {"F": 1.0, "B": 2.0}


def one_f_one_b(P: int, M: int) -> Timeline:
    """Unit-cost 1F1B on P ranks (stage r on rank r): compute events plus zero-length sends."""
    orders = []
    for r in range(P):
        warm = min(P - 1 - r, M)
        seq, f = [("F", m) for m in range(warm)], warm
        for b in range(M):
            if f < M:
                seq.append(("F", f))
                f += 1
            seq.append(("B", b))
        orders.append(seq)
    done: dict[tuple[str, int, int], float] = {}
    free, pos, events = [0.0] * P, [0] * P, []
    while any(pos[r] < len(orders[r]) for r in range(P)):
        for r in range(P):
            while pos[r] < len(orders[r]):
                kind, m = orders[r][pos[r]]
                dep = ("F", r - 1, m) if kind == "F" and r > 0 else ("B", r + 1, m) if kind == "B" and r < P - 1 else None
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done[dep] if dep else 0.0)
                free[r] = done[(kind, r, m)] = start + COST[kind]
                events.append(Event.parse(r, f"{kind}{r}.{m}", start, free[r]))
                if kind == "F" and r < P - 1:
                    events.append(Event.parse(r, f"SA{r}.{m}>{r + 1}@{r + 1}", free[r], free[r]))
                pos[r] += 1
    return Timeline.build(
        step_time=max(free),
        busy={r: (3.0 * M, 0.0) for r in range(P)},
        events=events,
        peak_activations={r: min(P - r, M) for r in range(P)},
        time_unit="unit",
    )


def measured_from(pred: Timeline, dp: int, sec_per_unit: float = 0.01) -> Timeline:
    """A 'measured' timeline over P x dp global ranks, in seconds, each replica slightly late."""
    events = [
        e._replace(rank=e.rank * dp + d, start=e.start * sec_per_unit + 1e-3 * d, end=e.end * sec_per_unit + 1e-3 * d)
        for e in pred.events
        for d in range(dp)
    ]
    step = pred.step_time * sec_per_unit + 1e-3 * dp
    busy = {r.rank * dp + d: (r.compute * sec_per_unit, 0.002) for r in pred.per_rank for d in range(dp)}
    return Timeline.build(step_time=step, busy=busy, events=events, peak_memory_bytes={g: 3 << 20 for g in busy})


def text_of(renderable, width: int) -> list[str]:
    console = Console(width=width, record=True, file=io.StringIO(), color_system="truecolor")
    console.print(renderable)
    return console.export_text().splitlines()


# ----------------------------------------------------------------------------- typed events


@pytest.mark.parametrize(
    "text, kind, op, stage, microbatch, peer, group, wait",
    [
        ("F0.3", "F", Op.FWD, 0, 3, None, None, False),
        ("B12.15", "B", Op.BWD, 12, 15, None, None, False),
        ("I1.2", "I", Op.BWD_I, 1, 2, None, None, False),
        ("W1.2", "W", Op.BWD_W, 1, 2, None, None, False),
        ("SA0.3>1@1", "comm", Op.SEND_ACT, 0, 3, 1, None, False),
        ("RG0.3<1@2", "comm", Op.RECV_GRAD, 0, 3, 2, None, False),
        ("AR0:dp", "AR", Op.ALLREDUCE, 0, None, None, "dp", False),
        ("AR2:tie.wte", "AR", Op.ALLREDUCE, 2, None, None, "tie.wte", False),
        ("UN1:dp.shard", "UN", Op.UNSHARD, 1, None, None, "dp.shard", False),
        ("OPT", "OPT", Op.OPTIM_STEP, None, None, None, None, False),
        ("~OPT", "comm", Op.OPTIM_STEP, None, None, None, None, True),
        ("~AR0:dp", "comm", Op.ALLREDUCE, 0, None, None, "dp", True),
    ],
)
def test_an_event_read_from_its_text_carries_its_fields_and_writes_the_same_text(
        text, kind, op, stage, microbatch, peer, group, wait):
    ev = Event.parse(3, text, 1.0, 2.0)
    assert (ev.rank, ev.op, ev.stage, ev.microbatch, ev.peer, ev.group, ev.wait) == (
        3, op, stage, microbatch, peer, group, wait)
    assert kind_of(ev) == kind and ev.text == text
    tl = Timeline.build(step_time=2.0, busy={3: (1.0, 0.0)}, events=[ev])
    assert tl.to_json()["events"] == [[3, text, 1.0, 2.0]]  # the JSON contract: [rank, op_text, start, end]
    assert Timeline.from_json(tl.to_json()).events == (ev,)


def test_an_events_text_is_read_as_the_programs_parser_reads_it():
    """The reader's shortcut for compute text (``F0.3``) agrees with the IR's parser, edge cases included."""
    texts = [f"{k}{s}.{m}" for k in "FBIW" for s in (0, 7, 12) for m in (0, 3, 15)]
    odd = ["F0.3\n", "F.3", "F0.", "F0.3.4", "F00.03", "B1.2x", "F\u0661.2", "Fx.2", "F-1.2", "W1,2"]
    for text in texts + odd:
        try:
            want = parse_instruction(text)
        except IRError:
            with pytest.raises(IRError):
                Event.parse(0, text, 0.0, 0.0)
            continue
        assert Event.parse(0, text, 0.0, 0.0).ins == want and Event.parse(0, "~" + text, 0.0, 0.0).ins == want


@pytest.mark.parametrize("text", ["~F0.3x", "barrier", "F0.3x", "~~OPT", ""])
def test_an_event_whose_text_is_no_instruction_is_refused_where_it_is_read(text):
    obj = Timeline.build(step_time=1.0, busy={0: (1.0, 0.0)}).to_json()
    obj["events"] = [[0, "F0.0", 0.0, 1.0], [0, text, 0.0, 1.0]]
    with pytest.raises(SchemaError, match=r"^plan\.prediction\.events\[1\]\[1\]: expected an instruction's text"):
        Timeline.from_json(obj, "plan.prediction")


def test_format_time_picks_a_readable_unit():
    assert format_time(69, "unit") == "69 units"
    assert format_time(0.712, "s") == "712 ms"
    assert format_time(1.5, "s") == "1.5 s"
    assert format_time(4.5e-5, "s") == "45 µs"


# ----------------------------------------------------------------------------- terminal


@pytest.mark.parametrize("width", [60, 100, 160])
def test_terminal_p8_m16_fits_the_width_with_one_row_per_rank(width):
    tl = one_f_one_b(8, 16)
    lines = text_of(render_terminal(tl, width=width, title="1f1b P=8 M=16"), width)
    assert all(len(line) <= width for line in lines), max(lines, key=len)
    rows = [line for line in lines if line.startswith("rank ")]
    assert [row.split()[1] for row in rows] == [str(r) for r in range(8)]
    bar = len(rows[0]) - len("rank 0 ")
    assert bar >= width - len("rank 0 ") - 1  # time is scaled to the whole width
    assert "1f1b P=8 M=16" in lines[0]
    assert any("forward" in line for line in lines) and any("idle" in line for line in lines)
    assert any(line.lstrip().startswith("units 0 ") for line in lines)  # the time axis


def test_terminal_axis_of_a_measured_timeline_is_in_readable_seconds():
    meas = measured_from(one_f_one_b(2, 4), dp=1, sec_per_unit=0.02)  # step 0.301 s
    lines = text_of(render_terminal(meas, width=80), 80)
    axis = next(line for line in lines if line.lstrip().startswith("ms 0 "))
    assert "300" in axis


def test_terminal_blocks_sit_where_the_events_are_and_idle_is_dotted():
    tl = one_f_one_b(8, 16)  # step 69 units
    width = 7 + 138  # 2 columns per unit
    rows = [line[7:] for line in text_of(render_terminal(tl, width=width), width) if line.startswith("rank ")]
    # rank 7 waits 7 units for its first forward: 14 dots, then F0 (2 columns: kind and microbatch
    # just fit) and B0 (4 columns, with a gap); F10 in 2 columns keeps its kind, not its number
    assert rows[7].startswith("·" * 14 + "F0" + "B0  " + "F1" + "B1  ")
    assert "F B10 " in rows[7]
    # rank 0 starts at once and ends with B15 at 65..69 units: no idle tail
    assert rows[0].startswith("F0F1")
    assert rows[0].endswith("B15 ")
    # microbatch labels are on the blocks wide enough for them
    for m in range(16):
        assert f"B{m}" in rows[3]


def test_terminal_colours_by_kind_with_odd_microbatches_shaded():
    tl = Timeline.build(
        step_time=10,
        busy={0: (10, 0)},
        events=[
            Event.parse(0, "F0.0", 0, 2),
            Event.parse(0, "F0.1", 2, 4),
            Event.parse(0, "I0.0", 4, 6),
            Event.parse(0, "W0.0", 6, 8),
            Event.parse(0, "AR0:dp", 8, 9),
            Event.parse(0, "OPT", 9, 10),
        ],
        time_unit="unit",
    )
    view = render_terminal(tl, width=7 + 40)
    row = next(line for line in view.lines(47) if line.plain.startswith("rank 0"))
    styles = {row.plain[span.start : span.end].strip(): str(span.style) for span in row.spans if span.end - span.start > 1}
    assert KINDS["F"].colour in styles["F0"]
    assert KINDS["F"].colour not in styles["F1"]  # odd microbatch: a darker shade
    assert KINDS["I"].colour in styles["I0"]
    assert KINDS["W"].colour in styles["W0"]
    assert KINDS["AR"].colour in styles["AR"]
    assert KINDS["OPT"].colour in styles["OPT"]
    assert len({styles[k] for k in ("F0", "I0", "W0", "AR", "OPT")}) == 5


def test_terminal_zero_length_posts_are_not_drawn():
    tl = Timeline.build(
        step_time=2,
        busy={0: (1, 0)},
        events=[Event.parse(0, "F0.0", 0, 1), Event.parse(0, "SA0.0>1@1", 1, 1)],
        time_unit="unit",
    )
    row = next(line for line in text_of(render_terminal(tl, width=27), 27) if line.startswith("rank 0"))
    assert "~" not in row and row.rstrip().endswith("·" * 10)


def _collectives() -> Timeline:
    """Two ranks: rank 0 reaches OPT at 2, rank 1 at 6; both end at 8 (rank 0 waits 4 units for rank 1)."""
    return Timeline.build(
        step_time=8,
        busy={0: (3, 4), 1: (7, 0)},
        events=[Event.parse(0, "F0.0", 0, 2), Event.parse(0, "OPT", 2, 8), Event.parse(1, "F1.0", 0, 6), Event.parse(1, "OPT", 6, 8)],
        time_unit="unit",
    )


def test_a_predicted_collective_is_waiting_until_its_last_member_arrives():
    all_lanes, span = lanes(_collectives())
    assert span == 8
    assert [(e.text, e.start, e.end) for e in all_lanes[0].events] == [("F0.0", 0, 2), ("~OPT", 2, 6), ("OPT", 6, 8)]
    assert [(e.text, e.start, e.end) for e in all_lanes[1].events] == [("F1.0", 0, 6), ("OPT", 6, 8)]
    rows = [line[7:] for line in text_of(render_terminal(_collectives(), width=7 + 16), 23) if line.startswith("rank ")]
    assert rows[0] == "F0  " + "~" * 8 + "OPT "
    assert rows[1].endswith("OPT ")


def test_a_measured_wait_is_drawn_as_waiting_and_a_dp_all_reduce_stays_whole():
    meas = Timeline.build(
        step_time=0.01,
        busy={0: (0.004, 0.005), 1: (0.009, 0.0)},
        events=[Event.parse(0, "F0.0", 0, 0.004), Event.parse(0, "AR0:dp", 0.004, 0.0041), Event.parse(0, "~OPT", 0.0041, 0.009),
                Event.parse(0, "OPT", 0.009, 0.01), Event.parse(1, "F0.0", 0, 0.009), Event.parse(1, "AR0:dp", 0.009, 0.0091),
                Event.parse(1, "OPT", 0.0091, 0.01)],
    )
    all_lanes, _ = lanes(meas)
    assert [e.text for e in all_lanes[0].events] == ["F0.0", "AR0:dp", "~OPT", "OPT"]  # nothing split twice
    row = next(line for line in text_of(render_terminal(meas, width=7 + 20), 27) if line.startswith("rank 0"))
    assert row[7:].rstrip() == "F0      " + "~" * 10 + "O"  # OPT in 2 columns: its first letter
    cats = {e["name"]: e["cat"] for e in trace_events(meas)["traceEvents"] if e.get("ph") == "X"}
    assert cats["~OPT"] == "comm" and cats["OPT"] == "OPT"


def test_nothing_is_cut_off_at_the_right_edge():
    tl = Timeline.build(step_time=4, busy={0: (5, 0)},
                        events=[Event.parse(0, "F0.0", 0, 4), Event.parse(0, "OPT", 4, 6)], time_unit="unit")
    all_lanes, span = lanes(tl)
    assert span == 6
    row = next(line for line in text_of(render_terminal(tl, width=7 + 12), 19) if line.startswith("rank 0"))
    assert row[7:].rstrip().endswith("OPT")


def test_terminal_measured_rows_follow_their_pp_rank_and_line_up():
    pred = one_f_one_b(4, 8)
    meas = measured_from(pred, dp=2)
    width = 120
    lines = text_of(render_terminal(pred, measured=meas, width=width), width)
    assert all(len(line) <= width for line in lines)
    labels = [line[:10].strip() for line in lines if re.match(r"\d+ (pred|meas)", line)]
    assert labels == [
        "0 pred", "0 meas g0", "0 meas g1", "1 pred", "1 meas g2", "1 meas g3",
        "2 pred", "2 meas g4", "2 meas g5", "3 pred", "3 meas g6", "3 meas g7",
    ]
    by_label = {line[:10].strip(): line[10:] for line in lines if line[:10].strip() in labels}
    # seconds vs units: each scaled to its own step, so rank 3's first forward lines up
    first = {k: len(v) - len(v.lstrip("·")) for k, v in by_label.items()}
    assert abs(first["3 pred"] - first["3 meas g6"]) <= 1
    assert any("measured:" in line for line in lines)


def test_measured_rank_count_must_be_pp_times_dp():
    pred = one_f_one_b(4, 4)
    meas = measured_from(one_f_one_b(3, 4), dp=1)
    with pytest.raises(RenderError, match="pp x dp"):
        render_terminal(pred, measured=meas)
    with pytest.raises(RenderError, match="expected pp x dp = 4 x 3 = 12"):
        render_summary(pred, measured=measured_from(pred, dp=2), mesh=Mesh(pp=4, dp=3))


def test_later_chunks_are_marked_and_legend_says_so():
    events = [Event.parse(0, "F0.0", 0, 1), Event.parse(0, "F2.0", 1, 2), Event.parse(1, "F1.0", 0.5, 1.5), Event.parse(1, "F3.0", 2, 3)]
    tl = Timeline.build(step_time=3, busy={0: (2, 0), 1: (2, 0)}, events=events, time_unit="unit")
    all_lanes, span = lanes(tl)
    assert [lane.chunks for lane in all_lanes] == [{0: 0, 2: 1}, {1: 0, 3: 1}]
    view = render_terminal(tl, width=40)
    lines = view.lines(40)
    row0 = next(line for line in lines if line.plain.startswith("rank 0"))
    underlined = [row0.plain[s.start : s.end] for s in row0.spans if "underline" in str(s.style)]
    assert underlined and all(u.strip().startswith(("F0", "0", "F")) for u in underlined)
    assert any("later chunk" in line.plain for line in lines)


# ----------------------------------------------------------------------------- summary table


def test_summary_table_per_rank_and_totals():
    tl = one_f_one_b(4, 8)  # step 33 units, 24 compute, 9 idle per rank
    lines = text_of(render_summary(tl, title="1f1b"), 100)
    body = "\n".join(lines)
    for header in ("rank", "compute", "comm wait", "idle", "bubble", "peak act."):
        assert header in body
    assert "peak mem" not in body  # absent, never faked
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == 4 + 1
    assert "24 units" in rows[0] and "9 units" in rows[0] and "27.3%" in rows[0]
    total = rows[-1]
    assert "all" in total and "96 units" in total and "36 units" in total and "max 4" in total
    assert "step 33 units" in body


def test_summary_table_predicted_beside_measured():
    pred = one_f_one_b(2, 4)
    meas = measured_from(pred, dp=1)
    lines = text_of(render_summary(pred, measured=meas), 110)
    rows = [line for line in lines if line.startswith("│")]
    assert [r.split("│")[1].strip() for r in rows] == ["0 pred", "0 meas", "1 pred", "1 meas", "all pred", "all meas"]
    assert "MiB" in rows[1] and "ms" in rows[1]
    assert any("predicted step" in line and "measured step" in line for line in lines)


def test_show_prints_view_and_table():
    console = Console(width=90, record=True, file=io.StringIO())
    show(one_f_one_b(3, 6), console=console, title="demo")
    out = console.export_text()
    assert "demo" in out and "rank 2" in out and "bubble" in out and "all" in out


# ----------------------------------------------------------------------------- picture


def test_png_is_written(tmp_path):
    path = tmp_path / "t.png"
    render_image(one_f_one_b(8, 16), path, title="1f1b")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _lane_ids(svg_path) -> list[str]:
    root = ET.parse(svg_path).getroot()
    return [g.get("id") for g in root.iter("{http://www.w3.org/2000/svg}g") if (g.get("id") or "").startswith("lane-")]


def test_svg_has_one_lane_per_rank(tmp_path):
    path = tmp_path / "t.svg"
    render_image(one_f_one_b(8, 16), path)
    assert _lane_ids(path) == [f"lane-predicted-{r}" for r in range(8)]
    text = path.read_text()
    assert "time (units)" in text and "forward" in text and "backward" in text


def test_svg_pairs_predicted_and_measured_lanes(tmp_path):
    pred = one_f_one_b(2, 4)
    path = tmp_path / "t.svg"
    render_image(pred, path, measured=measured_from(pred, dp=2))
    assert _lane_ids(path) == [
        "lane-predicted-0", "lane-measured-0", "lane-measured-1",
        "lane-predicted-1", "lane-measured-2", "lane-measured-3",
    ]
    assert "measured time (ms)" in path.read_text()


def test_picture_format_comes_from_the_extension(tmp_path):
    with pytest.raises(RenderError, match=r"\.svg or \.png"):
        render_image(one_f_one_b(2, 2), tmp_path / "t.jpg")


def test_views_do_not_import_matplotlib_or_torch_until_a_picture_is_drawn():
    code = (
        "import sys, io\n"
        "from rich.console import Console\n"
        "from pipec.compiler.ir.timeline import Timeline, Event\n"
        "from pipec.views.summary import show\n"
        "from pipec.views.perfetto import trace_events\n"
        "tl = Timeline.build(step_time=1, busy={0: (1, 0)}, events=[Event.parse(0, 'F0.0', 0, 1)])\n"
        "show(tl, console=Console(file=io.StringIO()))\n"
        "trace_events(tl)\n"
        "bad = [m for m in ('matplotlib', 'torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ----------------------------------------------------------------------------- Perfetto


def test_trace_has_one_complete_event_per_timeline_event(tmp_path):
    tl = one_f_one_b(4, 4)
    path = tmp_path / "t.json"
    write_perfetto(tl, path)
    obj = json.loads(path.read_text())
    xs = [e for e in obj["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(tl.events)
    for ev, x in zip(tl.events, xs):
        assert (x["pid"], x["tid"], x["name"]) == (1, ev.rank, ev.text)
        assert x["ts"] == pytest.approx(ev.start * 1000)  # 1 unit = 1 ms = 1000 µs
        assert x["dur"] == pytest.approx((ev.end - ev.start) * 1000)
        assert x["cat"] == kind_of(ev)
    assert xs[0]["args"] == {"stage": 0, "microbatch": 0}
    threads = {e["tid"]: e["args"]["name"] for e in obj["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {r: f"rank {r}" for r in range(4)}
    assert "1 unit = 1 ms" in obj["otherData"]["note"]


def test_trace_puts_measured_in_its_own_process_with_global_ranks():
    pred = one_f_one_b(2, 2)
    meas = measured_from(pred, dp=2)
    obj = trace_events(pred, measured=meas)
    procs = {e["pid"]: e["args"]["name"] for e in obj["traceEvents"] if e["name"] == "process_name"}
    assert procs == {1: "predicted", 2: "measured"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in obj["traceEvents"] if e["name"] == "thread_name"}
    assert threads[(2, 3)] == "rank 3 (pp 1, dp 1)"
    xs = [e for e in obj["traceEvents"] if e["ph"] == "X" and e["pid"] == 2]
    assert len(xs) == len(meas.events)
    first = next(x for x in xs if x["tid"] == 1 and x["name"] == "F0.0")
    assert first["ts"] == pytest.approx(1e-3 * 1e6)  # seconds -> µs
    assert obj["otherData"]["time_unit"] == {"predicted": "unit", "measured": "s"}


def test_trace_of_a_measured_run_alone():
    meas = measured_from(one_f_one_b(2, 2), dp=2)
    obj = trace_events(meas, kind="measured", mesh=Mesh(pp=2, dp=2))
    assert {e["args"]["name"] for e in obj["traceEvents"] if e["name"] == "process_name"} == {"measured"}
    threads = {e["tid"]: e["args"]["name"] for e in obj["traceEvents"] if e["name"] == "thread_name"}
    assert threads[2] == "rank 2 (pp 1, dp 0)"                 # named by the run's mesh
    assert "note" not in obj["otherData"]
    with pytest.raises(RenderError, match="kind"):
        trace_events(meas, kind="simulated")


def test_views_accept_a_timeline_read_back_from_json():
    tl = Timeline.from_json(json.loads(json.dumps(one_f_one_b(3, 3).to_json())))
    assert len(text_of(render_terminal(tl, width=80), 80)) > 3
    assert len([e for e in trace_events(tl)["traceEvents"] if e["ph"] == "X"]) == len(tl.events)
