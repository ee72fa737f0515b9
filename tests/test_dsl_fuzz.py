"""Fuzzing: whatever text arrives, the language answers with a Spec or a
located DSLError, never another exception and never a hang.

Random text, and random mutations of the examples (deleted, duplicated or
swapped tokens, huge or negative numbers, non-ASCII, truncation). DESIGN's
limits bound every size, so even "order rank 0: F0.0..99999999999" is
refused at once.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipec.compiler.driver import compile_spec
from pipec.dsl import DSLError, Spec, format_file, parse_spec

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.pipe"))
TEXTS = {p: p.read_text() for p in EXAMPLES}

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def answer(text: str, filename: str = "fuzz.pipe") -> Spec | DSLError:
    """parse_spec's answer; any exception but a located DSLError fails the test."""
    try:
        spec = parse_spec(text, filename=filename)
    except DSLError as err:
        assert err.line >= 1 and err.col >= 1, err
        assert str(err).startswith(f"{err.file}:{err.line}:{err.col}: error: ")
        return err
    assert isinstance(spec, Spec)
    spec.to_json()
    return spec


_ALPHABET = st.sampled_from(list("pdmsvx0123456789 \n\t()[],.:=+-*/#\"'_FBIWr") + [
    "pp ", "schedule ", "order ", "rank ", "policy ", " for m in ", "..", "//", "split before ", "stages ",
    "microbatches ", "virtual ", "1f1b", "zbv", "80GB", "é", "\u00b5", "\x00", "\ufeff", "😀", "\r\n",
])


@FUZZ
@given(st.lists(_ALPHABET, max_size=40).map("".join))
def test_random_text(text: str) -> None:
    answer(text)


@FUZZ
@given(st.text(max_size=120))
def test_random_unicode(text: str) -> None:
    answer(text)


_TOKEN = re.compile(r"\s+|[^\s]+")
_NUMBER = re.compile(r"\d+")
_REPLACEMENTS = ["9" * 60, "-1", "0", "4097", "65537", "99999999999", "1e999", "1e99999999", "1e-99999999", "-0", "2.5", "é", "\x00", "😀",
                 "\ufeff", "(", ")", "\"", "#", "..", ","]


@st.composite
def mutations(draw) -> tuple[Path, str]:
    path = draw(st.sampled_from(EXAMPLES))
    tokens = _TOKEN.findall(TEXTS[path])
    for _ in range(draw(st.integers(1, 3))):
        if not tokens:
            break
        i = draw(st.integers(0, len(tokens) - 1))
        op = draw(st.sampled_from(["delete", "duplicate", "swap", "number", "insert", "truncate"]))
        if op == "delete":
            del tokens[i]
        elif op == "duplicate":
            tokens.insert(i, tokens[i])
        elif op == "swap":
            j = draw(st.integers(0, len(tokens) - 1))
            tokens[i], tokens[j] = tokens[j], tokens[i]
        elif op == "number":
            numbers = [k for k, t in enumerate(tokens) if _NUMBER.search(t)]
            if numbers:
                k = draw(st.sampled_from(numbers))
                tokens[k] = _NUMBER.sub(draw(st.sampled_from(_REPLACEMENTS)), tokens[k], count=1)
        elif op == "insert":
            tokens.insert(i, draw(st.sampled_from(_REPLACEMENTS)))
        else:
            cut = draw(st.integers(0, len(tokens[i])))
            tokens = tokens[:i] + [tokens[i][:cut]]
    return path, "".join(tokens)


@FUZZ
@given(mutations())
def test_mutated_examples(case: tuple[Path, str]) -> None:
    path, text = case
    result = answer(text, filename=str(path))
    if isinstance(result, Spec):  # a mutation that stays valid must still format and round-trip
        again = parse_spec(format_file(text), filename=str(path)).request
        assert replace(again, origins={}) == replace(result.request, origins={})  # every value, not where it was


@pytest.mark.parametrize("text", [
    "order rank 0: F0.0..99999999999",
    "order rank 0: (F0.m for m in 0..99999999999)",
    "order rank 0: ((F0.m for m in 0..2000) for k in 0..3000)",
    "order rank r in 0..99999999: F0.0",
    "order rank 0: F(99999999999999999999).0",
    "pp 99999999999999999999999999999999999999",
    "microbatches 65537",
    "stages 65537",
    "pp 4096 virtual 17",
    "policy (warmup=P*P*P*P*P*P*P*P*P*P*P*P*P*P*P*P*P*P*P*P*P*P*P*P*P*P*P*P*P*P*P*P)",
    "x " + "(" * 5000 + ")" * 5000,
    "x " + "-" * 5000 + "1",
    "x " + "1+" * 5000 + "1",
    "device_memory 1e999GB",
    "device_memory 1e99999999GB",
    "links pp(latency=1e99999999us)",
    "lr 1e999",
])
def test_sizes_beyond_the_limits_are_refused_quickly(text: str) -> None:
    result = answer(text)
    if isinstance(result, Spec):  # a bound the compiler's driver owns (a policy's warm-up): refused there, located
        with pytest.raises(DSLError) as info:
            compile_spec(result, trace=False)
        result = info.value
        assert result.file == "fuzz.pipe"
    assert isinstance(result, DSLError)
