"""``pipec fmt``: the canonical form parses to the same tree (spans aside), is
idempotent, and keeps every comment; on every example and on generated files."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipec.dsl import format_file
from pipec.dsl.parse import parse_source

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.pipe"))


def comments(text: str) -> list[str]:
    return [c.text for c in parse_source(text).comments]


def assert_round_trip(text: str) -> str:
    out = format_file(text)
    assert parse_source(out).file == parse_source(text).file
    assert format_file(out) == out
    assert " ".join(comments(out)).split() == " ".join(comments(text)).split()
    return out


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_round_trip_and_are_canonical(path: Path) -> None:
    text = path.read_text()
    assert assert_round_trip(text) == text


def test_canonical_form() -> None:
    messy = ('# head\n\n\nmodel "m.n:f"(layers=8,dim = 256)   # the model\ninput tokens:int64[16,128]\n'
             "pp 4 dp 2\n\n\n\nschedule 1f1b\npolicy (warmup=min((V-1)*(M//max(1,M//P))+2*(P-1-rank),V*M))\n"
             "order\n rank 0:F0.0..3 (B0.m F0.(m+4) for m in 0..3)\n   # between\n rank r in 1..3: F(r).0 B(r).0\n"
             "recompute stages 0,1 partition split before a.b,c\n")
    assert assert_round_trip(messy) == (
        "# head\n"
        "\n"
        'model "m.n:f" (layers=8, dim=256)  # the model\n'
        "input tokens: int64[16, 128]\n"
        "pp 4  dp 2\n"
        "\n"
        "schedule 1f1b\n"
        "policy   (warmup=min((V - 1) * (M // max(1, M // P)) + 2 * (P - 1 - rank), V * M))\n"
        "order\n"
        "  rank 0: F0.0..3 (B0.m F0.m+4 for m in 0..3)\n"
        "  # between\n"
        "  rank r in 1..3: F(r).0 B(r).0\n"
        "recompute stages 0, 1  partition split before a.b, c\n"
    )


def test_trailing_comments_of_a_joined_value_are_kept() -> None:
    text = "links pp(latency=1us,  # fast\n  bandwidth=1GB/s)  # link\npp 2\n"
    out = assert_round_trip(text)
    assert out == "links pp(latency=1us, bandwidth=1GB/s)  # fast  # link\npp    2\n"


# ----------------------------------------------------------------------------- generated files

_WORDS = ["loop", "v", "1f1b", "zb_h1", "on", "off", "none", "all", "adamw", "gelu", "x1", "_a", "P", "M", "chunks"]
# (not "rank": at the start of a value it begins an order block)
_SPACES = ["", " ", "  ", "\n", "\t", " \n  "]
_NUMBERS = ["0", "7", "65536", "123456789", "0.5", "3e-4", "1E9", ".25", "2.0"]
_QUANTITIES = ["80GB", "10us", "25GB/s", "1.5TiB", "312TFLOP/s", "2ms"]
_PATHS = ["a.b", "blocks.4", "x.y.z"]
_TEXT = st.characters(blacklist_categories=["Cs", "Cc"])

# Composite strategies throughout: their reprs stay short (hypothesis prints them).


@st.composite
def atoms(draw) -> str:
    kind = draw(st.integers(0, 4))
    if kind == 4:
        raw = draw(st.text(_TEXT, max_size=8))
        return '"' + raw.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return draw(st.sampled_from([_NUMBERS, _QUANTITIES, _WORDS, _PATHS][kind]))


@st.composite
def exprs(draw, depth: int = 3) -> str:
    if depth == 0 or draw(st.integers(0, 2)) == 0:
        return draw(atoms())
    sub = exprs(depth - 1)
    sep = draw(st.sampled_from([",", ", ", " ,", ",\n  "]))
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(sub) + draw(st.sampled_from(["+", " - ", "*", " // ", "/"])) + draw(sub)
    if kind == 1:
        return "-" + draw(sub)
    if kind == 2:
        args = draw(st.lists(sub, max_size=3))
        return draw(st.sampled_from(["min", "balanced", "f"])) + "(" + sep.join(args) + ")"
    if kind == 3:
        names = draw(st.lists(st.sampled_from(["a", "by", "warmup", "k2"]), max_size=3, unique=True))
        eq = draw(st.sampled_from(["=", " = "]))
        return draw(st.sampled_from(["adamw", "pp", "g"])) + "(" + sep.join(n + eq + draw(sub) for n in names) + ")"
    if kind == 4:
        return "(" + sep.join(draw(st.lists(sub, min_size=1, max_size=3))) + ")"
    return "[" + sep.join(draw(st.lists(sub, max_size=3))) + "]"


@st.composite
def actions(draw) -> str:
    return (draw(st.sampled_from("FBIW")) + draw(st.sampled_from(["0", "12", "(r)", "(r + 1)"])) + "."
            + draw(st.sampled_from(["0", "m", "m+4", "(2*m)", "m-1"]))
            + draw(st.sampled_from(["", "..3", "..M-1", "..(m*2)"])))


@st.composite
def order_blocks(draw) -> str:
    clauses = []
    for _ in range(draw(st.integers(1, 3))):
        body = []
        for _ in range(draw(st.integers(1, 4))):
            if draw(st.booleans()):
                body.append(draw(actions()))
            else:
                inner = " ".join(draw(st.lists(actions(), min_size=1, max_size=3)))
                body.append(f"({inner} for m in 0..3)")
        head = draw(st.sampled_from(["0", "1", "r in 0..P-1", "r in 1..(P - 1)"]))
        clauses.append(f"rank {head}: " + " ".join(body))
    return "\n  " + "\n  ".join(clauses)


@st.composite
def values(draw) -> str:
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(exprs())
    if kind == 1:
        return ", ".join(draw(st.lists(exprs(), min_size=2, max_size=3)))
    if kind == 2:
        return "split before " + ",".join(draw(st.lists(st.sampled_from(["a.b", "c", "d.1"]), min_size=1, max_size=3)))
    if kind == 3:
        return "stages " + ", ".join(draw(st.lists(st.sampled_from(["0", "1", "12"]), min_size=1, max_size=3)))
    if kind == 4:
        return draw(st.sampled_from(["tokens", "x"])) + ": " + draw(st.sampled_from(["int64", "f"])) + "[16, 128]"
    return draw(order_blocks())


@st.composite
def files(draw) -> str:
    parts = []
    for _ in range(draw(st.integers(0, 6))):
        key = draw(st.sampled_from(["pp", "schedule", "model", "x", "policy", "order", "links"]))
        parts.append(f"{key} {draw(st.sampled_from(_SPACES))}{draw(values())}")
        if draw(st.booleans()):
            comment = "# " + draw(st.text(_TEXT, max_size=10))
            parts.append(("  " if draw(st.booleans()) else "\n") + comment + "\n")
        parts.append(draw(st.sampled_from([" ", "  ", "\n", "\n\n", "\n\n\n"])))
    return "".join(parts)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files())
def test_generated_files_round_trip(text: str) -> None:
    assert_round_trip(text)


def test_the_grammar_cache_is_the_users_own_and_keeps_comments(tmp_path: Path) -> None:
    """lark's cached grammar lives in the user's cache folder (0700), and a parser loaded from it still
    collects comments (a lexer callback the cache cannot hold)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    code = ("from pipec.dsl import format_file; "
            "print(format_file('schedule 1f1b  # why\\n# alone\\npp 2\\n'), end='')")
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    cached = list((tmp_path / "pipec").glob("grammar-*.lark"))
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert len(cached) == 1 and (tmp_path / "pipec").stat().st_mode & 0o777 == 0o700
    assert "# why" in first.stdout and "# alone" in first.stdout
    assert second.stdout == first.stdout and not second.stderr


def test_no_grammar_cache_where_the_cache_folder_cannot_be_made(monkeypatch) -> None:
    from pipec.dsl.parse import _cache_file

    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/pipec-cannot-make-this")
    assert _cache_file("start: NAME") is False
