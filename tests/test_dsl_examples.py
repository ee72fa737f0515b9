"""Every example schedule file checks; its order is a valid compute order; the
reference page is generated from the key table and documents every key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipec.dsl import KEYS, load_spec, parse_spec
from pipec.dsl.reference import reference
from pipec.compiler.driver import schedule_order
from pipec.schedules import SCHEDULES
from pipec.schedules.order import validate_order

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.pipe"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_checks_and_orders(path: Path) -> None:
    spec = load_spec(str(path))
    assert spec.warnings == ()
    order, warnings = schedule_order(spec.request)  # the driver's rules and order: valid, or it raises
    assert warnings == []
    validate_order(order)
    assert (order.num_ranks, order.num_microbatches, order.placement) == (
        spec.pp, spec.microbatches, spec.placement_ranks())


def test_examples_cover_what_the_issue_asks() -> None:
    specs = [load_spec(str(p)) for p in EXAMPLES]
    assert len(specs) >= 6
    assert set(SCHEDULES) <= {s.schedule for s in specs}
    assert any(s.dp > 1 for s in specs)
    assert any(s.custom == "policy" for s in specs)
    assert {"inline", "csv"} <= {s.order.form for s in specs if s.custom == "order"}
    assert any(s.model == "pipec.examples.gpt:build" for s in specs)
    assert any(s.model is None and s.custom is None for s in specs)  # compiles without a model
    assert all(p.read_text().startswith("#") for p in EXAMPLES)  # each says what it shows


def test_reference_page_is_generated_from_the_key_table() -> None:
    committed = (REPO / "docs" / "reference.md").read_text()
    assert committed == reference(), "regenerate it: python -m pipec.dsl.reference > docs/reference.md"


def test_reference_documents_every_key_and_schedule() -> None:
    page = reference()
    for key in KEYS.values():
        assert f"### `{key.name}`" in page
        assert key.example in page and key.flag in page
    for name, info in SCHEDULES.items():  # each row's rules from the registry's (test_schedules checks them)
        assert f"| `{name}` |" in page and f"| {info.placement} | {info.microbatches_doc} |" in page
    assert "| `zbv` | 2 | v | M >= 1 (M < 2 pp - 1 warns) |" in page
    assert ("| `interleaved_1f1b` | >= 2 (default 2) | loop | M a multiple of max(1, M // pp), torch's rule "
            "(M < pp warns) |") in page


@pytest.mark.parametrize("name", list(KEYS))
def test_each_keys_example_and_default_are_legal(name: str) -> None:
    key = KEYS[name]
    assert key.meaning and key.default_doc and key.group
    spec = parse_spec("", overrides={})
    default = spec[name]
    # the kind prints the default back as text it accepts, and reads it the same
    if name not in ("order", "policy", "schedule", "model_args") and default is not None:
        again = parse_spec("", overrides={name: key.kind.show(default)})
        assert again[name] == default


def test_reference_module_runs(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "pipec.dsl.reference"], capture_output=True, text=True,
                         check=True, cwd=tmp_path)
    assert out.stdout == reference()
