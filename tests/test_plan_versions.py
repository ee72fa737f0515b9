"""plan.json's versions: plans written by earlier pipecs (tests/data/plan_v1, tests/data/plans) read, through one
adapter per version, into what the reader of their own version made of them; a ``pipec.plan/3`` plan written and
read back; a format this pipec does not read refused."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from pipec.compiler.ir.plan import PlanError
from pipec.compiler.ir.plan_json import (ELSEWHERE, FORMAT, READS, UPGRADES, load_plan, plan_to_json, read_plan,
                                         upgrade, write_plan)

DATA = Path(__file__).parent / "data"
OLDER = sorted([*DATA.glob("plan_v1/*.json"), *DATA.glob("plans/*.json")])
"""Every plan kept from an older format (how each was made: the README beside it)."""


def _raw(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _as_file(plan) -> dict:
    """The plan as plan.json holds it (tuples as lists)."""
    return json.loads(json.dumps(plan_to_json(plan)))


def test_each_older_format_has_an_adapter_to_the_next_and_a_kept_plan():
    assert FORMAT == "pipec.plan/3" and READS == ("pipec.plan/1", "pipec.plan/2", FORMAT)
    assert {old: new for old, (new, _) in UPGRADES.items()} == {"pipec.plan/1": "pipec.plan/2",
                                                               "pipec.plan/2": "pipec.plan/3"}
    assert {_raw(p)["format"] for p in OLDER} == set(UPGRADES)


@pytest.mark.parametrize("path", OLDER, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_an_older_plan_proves_and_reads_as_its_own_version_wrote_it(path, cli):
    out = cli("check", str(path))
    assert out.returncode == 0 and "verified" in out.stdout, out.stderr
    raw = _raw(path)
    now = _as_file(read_plan(str(path)))
    assert now["format"] == FORMAT
    # the program and the prediction as the file holds them, and every other field the same but for what the
    # adapters change: a v2 stage's tp record loses its degree (mesh.tp holds it), a v1 spec its repeats
    assert now["ranks"] == raw["ranks"] and now["prediction"] == raw["prediction"]
    same = set(raw) - {"format", "spec", "stages"}
    assert set(now) == set(raw) and {k: now[k] for k in same} == {k: raw[k] for k in same}
    assert now["stages"] == [st | ({"tp": {k: v for k, v in st["tp"].items() if k != "tp"}} if "tp" in st else {})
                             for st in raw["stages"]]
    if raw["format"] == "pipec.plan/2":
        assert now["spec"] == raw["spec"]
    else:  # kept as it was, or dropped: a repeat, a null that did not apply, a schedule-only plan's partition
        assert not set(now["spec"]) & set(ELSEWHERE) and all(raw["spec"][k] == v for k, v in now["spec"].items())
        assert all(k in ELSEWHERE or raw["spec"][k] is None or k in ("partition", "trace") and "model" not in raw
                   for k in set(raw["spec"]) - set(now["spec"]))


def test_a_v2_stage_record_loses_its_degree_which_must_be_the_mesh_s():
    raw = _raw(DATA / "plans" / "v2_gpt_tp2.json")
    assert raw["mesh"]["tp"] == 2 and [st["tp"]["tp"] for st in raw["stages"]] == [2, 2]
    v3 = upgrade(raw)
    assert v3["format"] == FORMAT and all("tp" not in st["tp"] for st in v3["stages"])
    assert raw["format"] == "pipec.plan/2" and raw["stages"][0]["tp"]["tp"] == 2  # the input left as it was
    assert upgrade(v3) is v3  # a pipec.plan/3 plan is read as it is
    bad = copy.deepcopy(raw)
    bad["stages"][1]["tp"]["tp"] = 4
    with pytest.raises(PlanError, match=r"^plan\.stages\[1\]\.tp\.tp: the stage's tensor-parallel record is for "
                                        r"tp 4, but mesh\.tp is 2; recompile the plan for tp 2$"):
        load_plan(bad)
    del bad["stages"][1]["tp"]["tp"]
    with pytest.raises(PlanError, match=r"plan\.stages\[1\]\.tp\.tp: .* record is for tp None, but mesh\.tp is 2"):
        load_plan(bad)


def test_a_v1_cost_without_optim_reads_as_0_and_a_v3_one_must_have_it():
    raw = _raw(DATA / "plan_v1" / "sharded.json")
    for st in raw["stages"]:  # a v1 plan from before the optimizer step was costed
        del st["cost"]["optim"]
    assert [st.cost.optim for st in load_plan(raw).stages] == [0.0, 0.0]
    v3 = _as_file(read_plan(str(DATA / "plans" / "v2_schedule_zbv.json")))
    del v3["stages"][2]["cost"]["optim"]
    with pytest.raises(PlanError, match=r"^plan\.stages\[2\]\.cost\.optim: required field is missing$"):
        load_plan(v3)


@pytest.mark.parametrize("path", [DATA / "plans" / "v2_gpt_tp2.json", DATA / "plans" / "v2_gpt_dp2_shard.json"],
                         ids=lambda p: p.stem)
def test_a_v3_plan_round_trips(path, tmp_path):
    plan = read_plan(str(path))
    out = tmp_path / "v3.json"
    write_plan(plan, str(out))
    written = _raw(out)
    assert written["format"] == FORMAT and all("tp" not in st.get("tp", {}) for st in written["stages"])
    assert written == _as_file(plan)
    back = read_plan(str(out))
    assert back == plan and back.program == plan.program and back.prediction == plan.prediction


def test_a_freshly_compiled_plan_is_a_v3_plan_that_round_trips(tmp_path):
    from pipec.compiler.driver import compile_plan

    plan = compile_plan(schedule="zbv", num_ranks=2, num_microbatches=4, dp=2, shard="full").plan
    write_plan(plan, str(tmp_path / "plan.json"))
    assert _raw(tmp_path / "plan.json")["format"] == FORMAT
    assert read_plan(str(tmp_path / "plan.json")) == plan


@pytest.mark.parametrize("fmt, message", [
    ("pipec.plan/4", "plan.format: 'pipec.plan/4' is newer than this pipec reads (pipec.plan/1, pipec.plan/2, "
                     "pipec.plan/3); the plan was written by pipec 0.1.0; compile it again with this pipec (pipec "
                     "compile), or read it with the pipec that wrote it"),
    ("pipec.plan/0", "plan.format: expected a plan.json format this pipec reads (pipec.plan/1, pipec.plan/2, "
                     "pipec.plan/3), got 'pipec.plan/0'; compile the plan again with this pipec (pipec compile)"),
    ("pipec.tune/1", "plan.format: expected a plan.json format this pipec reads (pipec.plan/1, pipec.plan/2, "
                     "pipec.plan/3), got 'pipec.tune/1'; compile the plan again with this pipec (pipec compile)"),
])
def test_a_format_this_pipec_does_not_read_is_refused(fmt, message, cli_process, tmp_path):
    raw = _raw(DATA / "plans" / "v2_schedule_zbv.json")
    raw["format"] = fmt
    (tmp_path / "plan.json").write_text(json.dumps(raw), encoding="utf-8")
    out = cli_process("check", "plan.json")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"plan.json: {message}" in out.stderr, out.stderr
