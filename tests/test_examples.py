"""Every example schedule file compiles into a verified plan (model files through the real front end)."""

from __future__ import annotations

from importlib import resources

import pytest

from pipec.compiler.driver import compile_spec
from pipec.compiler.ir.plan_json import read_plan, write_plan
from pipec.compiler.passes.verify import verify
from pipec.dsl import load_spec

EXAMPLES = sorted(p.name for p in resources.files("pipec.examples").iterdir() if p.name.endswith(".pipe"))

# model files profile their stage costs by default; the test uses FLOP costs (same plan shape, seconds faster)
FAST = {"costs": "flops", "peak_flops": 1e12}


def test_there_is_an_example_for_every_schedule():
    text = "\n".join((resources.files("pipec.examples") / name).read_text() for name in EXAMPLES)
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zbv"):
        assert f"schedule {schedule}" in " ".join(text.split()), schedule
    assert "policy" in text and "order" in text and "dp 2" in text


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_compiles_and_verifies(name, tmp_path):
    path = str(resources.files("pipec.examples") / name)
    spec = load_spec(path)
    if spec["model"] and spec["costs"] == "profile":
        spec = load_spec(path, FAST)
    plan = compile_spec(spec).plan
    # the compile proved the plan in memory; the proofs hold on it as written to plan.json and read back
    write_plan(plan, str(tmp_path / "plan.json"))
    back = read_plan(str(tmp_path / "plan.json"))
    assert back.program == plan.program and back.placement == plan.placement
    verify(back)
    assert plan.program.num_instructions > 0
    assert plan.prediction.step_time > 0 and 0 <= plan.prediction.bubble_fraction < 1
    assert plan.mesh.pp == spec["pp"] and plan.num_microbatches == spec["microbatches"]
    if spec["model"]:
        assert plan.model["target"] == spec["model"] and plan.stages[0].inputs and plan.edges[0].tensors
        assert all(st.num_params for st in plan.stages)
        assert plan.ties, "the example GPT ties its embedding and LM head"
