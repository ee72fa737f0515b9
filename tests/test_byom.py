"""Bring your own model: models no one on pipec wrote, with default settings, compiled and checked under torchrun.

- Hugging Face models built from small configs (random weights, no download; tests/byom_models.py): GPT-2
  wrapped to return logits (once with its own dropout: ``--check``'s step runs without it), a Llama-style decoder (RMSNorm, rotary embeddings), a BERT-style encoder
  classifier with an attention mask; a nanoGPT-style model with a raw ``nn.Parameter`` on its root (init
  auto resolves it to exact); a float regressor with ``loss mse``; a float classifier with cross_entropy
  over class logits. No ``init`` and no ``data`` key: what pipec does by default must fit them. All are
  compiled in this process (transformers imported once), then run on 2 ranks with ``--check`` in one launch
  shared with other tests (tests/launches.py; tests/runtime_worker.py: loss and every gradient against
  the unpartitioned reference, and two steps of losses against single-process training). The Hugging Face
  models are compiled with FLOP costs (the partition is all the costs decide here); ``--slow`` compiles
  and runs them with every default, their stages profiled too.
- A user's model file beside its schedule file, no PYTHONPATH: compiled from another folder into a third
  with ``pipec compile``, run with ``--check`` by ranks with none of them on their path.
- A model plan with ``costs unit`` says units everywhere: compile's summary, ``pipec show``'s tables,
  its Perfetto trace, ``--emulate`` and report.json's ``predicted``.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import LAUNCHES, PYTHON, run_cli, run_job

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
TOKENS = "int64[8, 16]"
STEPS = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One model as a user would bring it: the keys of its schedule file."""

    name: str
    keys: dict = field(default_factory=dict)
    hf: bool = False
    """Needs transformers."""
    init: str = "module"
    """What init auto must resolve to."""
    dropout: bool = False
    """The model keeps its dropout: ``--check``'s step runs without it (said in the check's record); the later
    steps train with it, so their losses are not single-process training's."""


CASES = (
    Case(name="gpt2", hf=True, keys={"model": "byom_models:gpt2", "input": f"input_ids: {TOKENS}",
                                     "schedule": "zb_h1"}),
    Case(name="gpt2_dropout", hf=True, dropout=True,
         keys={"model": "byom_models:gpt2", "model_args": {"dropout": True}, "input": f"input_ids: {TOKENS}"}),
    Case(name="llama", hf=True, keys={"model": "byom_models:llama", "input": f"input_ids: {TOKENS}",
                                      "schedule": "interleaved_1f1b"}),
    Case(name="bert", hf=True, keys={"model": "byom_models:bert_classifier", "schedule": "gpipe",
                                     "input": f"input_ids: {TOKENS}, attention_mask: {TOKENS}"}),
    Case(name="nanogpt", init="exact", keys={"model": "byom_models:nanogpt", "input": f"input_ids: {TOKENS}",
                                             "schedule": "zbv"}),
    Case(name="regressor", keys={"model": "byom_models:regressor", "input": "input: float32[32, 16]",
                                 "loss": "mse"}),
    Case(name="classifier", keys={"model": "byom_models:classifier", "input": "input: float32[32, 16]"}),
)


FLOPS = {"costs": "flops", "peak_flops": 1e12}
"""What the default run compiles the Hugging Face models with (--slow: their default, costs profile)."""


def byom_runs(hf_defaults: bool):
    """A set of runs for tests/launches.py: every case compiled here, in one process, then STEPS steps with
    --check. ``hf_defaults``: only the Hugging Face cases, with every default; else every case, the Hugging Face
    ones with FLOP costs."""

    def make(folder: Path) -> dict[str, dict]:
        from pipec.compiler.driver import compile_spec
        from pipec.compiler.ir.plan_json import write_plan
        from pipec.dsl import load_spec

        jobs = {}
        for case in CASES:
            if (case.hf and not HAS_TRANSFORMERS) or (hf_defaults and not case.hf):
                continue
            keys = {"pp": 2, "microbatches": 4, **case.keys, **(FLOPS if case.hf and not hf_defaults else {})}
            plan = compile_spec(load_spec(None, keys)).plan
            assert plan.spec["init"] == case.init, case.name  # init auto, resolved at compile time
            # the first stage reads the model's inputs by their own names (fx renames a placeholder `input`)
            assert {sig.name for sig in plan.stages[0].inputs} == {i["name"] for i in plan.model["inputs"]}, case.name
            path = folder / f"{case.name}.json"
            write_plan(plan, str(path))
            jobs[case.name] = run_job(path, "--steps", str(STEPS), "--check", reference=True)
        return jobs

    return make


byom_plans = LAUNCHES.runs("byom_plans", world=2, make=byom_runs(hf_defaults=False))
byom_hf_defaults = LAUNCHES.runs("byom_hf_defaults", world=2, make=byom_runs(hf_defaults=True))


def assert_trained_exactly(records: dict[str, dict], names: list[str]) -> None:
    assert sorted(records) == sorted(names)
    for name, rec in records.items():
        assert rec["rc"] == 0 and rec["check"]["passed"], (name, rec["check"])
        assert rec["check"]["max_grad_diff"] < 1e-4, name
        dropout = next(c for c in CASES if c.name == name).dropout
        assert rec["check"]["dropout_off"] == dropout, name
        # STEPS steps pipelined equal STEPS steps of single-process training on the same data
        assert len(rec["losses"]) == STEPS, name
        if not dropout:
            assert rec["losses"] == pytest.approx(rec["reference_losses"], rel=1e-4, abs=1e-5), name


@pytest.mark.parametrize("factory", ["gpt2", "llama", "bert_classifier"])
def test_init_module_starts_a_hugging_face_model_from_its_own_scheme(factory):
    """Each parameter's mean and spread under init module (what init auto picks) are the factory's own: GPT-2's
    std-0.02 embeddings (not nn.Embedding's N(0, 1)) and its residual projections scaled by 1/sqrt(2 x layers)
    from the enclosing blocks' _init_weights, zero biases, unit norms."""
    if not HAS_TRANSFORMERS:
        pytest.skip("transformers is not installed")
    import torch

    import byom_models
    from pipec.model.weights import initial_values

    target = f"byom_models:{factory}"
    names = [n for n, _ in getattr(byom_models, factory)().named_parameters()]
    module, _ = initial_values(target, {}, names, seed=0, init="module")
    exact, _ = initial_values(target, {}, names, seed=0, init="exact")
    for name in names:
        m, e = module[name].double(), exact[name].double()
        assert not torch.equal(m, e) or m.std() == 0, name  # drawn by pipec (per module), not copied
        assert abs(m.std() - e.std()) <= 0.25 * e.std() + 1e-6 and abs(m.mean() - e.mean()) <= 0.25 * e.std() + 1e-6, (
            name, float(m.std()), float(e.std()))


@pytest.mark.timeout(900)
def test_models_no_one_here_wrote_train_exactly_with_default_settings(byom_plans):
    assert_trained_exactly(byom_plans, [c.name for c in CASES if HAS_TRANSFORMERS or not c.hf])
    if not HAS_TRANSFORMERS:
        pytest.skip("transformers is not installed (pip install 'transformers>=5,<6'): the Hugging Face cases")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hugging_face_models_train_exactly_with_every_default(byom_hf_defaults):
    if not HAS_TRANSFORMERS:
        pytest.skip("transformers is not installed (pip install 'transformers>=5,<6'): the Hugging Face cases")
    assert_trained_exactly(byom_hf_defaults, [c.name for c in CASES if c.hf])


MODEL_FILE = '''
"""A user's own model, in a file beside the schedule file."""
import torch
from torch import nn


class Tagger(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim), nn.Tanh())
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.mix(self.embed(tokens)))


def build(vocab: int = 40, dim: int = 16) -> nn.Module:
    return Tagger(vocab, dim)
'''

SCHEDULE_FILE = '''
# my own model, found beside this file
model "mymodel:build" (dim=24)
input tokens: int64[8, 8]
pp 2
microbatches 4
'''


def _user_file(root: Path) -> dict:
    """A user's model file beside its schedule file, compiled with ``pipec compile`` from another folder into a
    third, no PYTHONPATH."""
    project, elsewhere, later = root / "project", root / "elsewhere", root / "later"
    for folder in (project, elsewhere, later):
        folder.mkdir()
    (project / "mymodel.py").write_text(textwrap.dedent(MODEL_FILE).lstrip())
    (project / "my.pipe").write_text(textwrap.dedent(SCHEDULE_FILE).lstrip())
    return {"argv": [PYTHON, "-m", "pipec", "compile", "../project/my.pipe", "-o", str(later / "plan.json")],
            "cwd": elsewhere, "env": {"PYTHONPATH": ""}}


def _user_file_run(folder: Path) -> dict[str, dict]:
    """The user's plan, one step with --check, by ranks with none of its folders on their path."""
    assert LAUNCHES.get("byom_user_file").returncode == 0, LAUNCHES.get("byom_user_file").stderr
    return {"run": run_job(LAUNCHES.folder("byom_user_file") / "later" / "plan.json", "--steps", "1", "--check")}


def _unit_costs(root: Path) -> list[str]:
    """The example GPT compiled with ``costs unit`` by ``pipec compile``."""
    return [PYTHON, "-m", "pipec", "compile", "--model", "pipec.examples.gpt:build", "--model-arg", "layers=2",
            "--model-arg", "dim=16", "--model-arg", "vocab=32", "--model-arg", "seq=8", "--input",
            "tokens: int64[8, 8]", "--costs", "unit", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "4",
            "-o", str(root / "plan.json")]


def _unit_costs_run(folder: Path) -> dict[str, dict]:
    """Two steps of the unit-cost plan under --emulate, at 0.01 s per unit."""
    assert LAUNCHES.get("byom_unit_costs").returncode == 0, LAUNCHES.get("byom_unit_costs").stderr
    return {"emulated": run_job(LAUNCHES.folder("byom_unit_costs") / "plan.json", "--steps", "2", "--emulate",
                                "--unit-time", "0.01")}


# the compiles first, in the queue; their plans run in round 2's 2-rank launch
byom_user_file = LAUNCHES.command("byom_user_file", make=_user_file, timeout=240)
byom_user_file_run = LAUNCHES.runs("byom_user_file_run", world=2, round=2, after=("byom_user_file",),
                                   make=_user_file_run)
byom_unit_costs = LAUNCHES.command("byom_unit_costs", make=_unit_costs, timeout=240)
byom_unit_costs_run = LAUNCHES.runs("byom_unit_costs_run", world=2, round=2, after=("byom_unit_costs",),
                                    make=_unit_costs_run)


@pytest.mark.timeout(900)
def test_a_model_file_beside_its_schedule_file_needs_no_pythonpath(byom_user_file, byom_user_file_run):
    assert byom_user_file.returncode == 0, byom_user_file.stderr
    root = LAUNCHES.folder("byom_user_file")
    plan = json.loads((root / "later" / "plan.json").read_text())
    assert plan["model"]["search_path"][0] == str(root / "project")  # the schedule file's folder, recorded absolute
    run = byom_user_file_run["run"]
    assert run["rc"] == 0, run["stderr"][-3000:]
    assert "--check passed" in run["stderr"] and run["check"]["passed"]
    # its profiled plan has an interval: the run kept its step for the next compile's (compiler/sim/history.py)
    from pipec.compiler.ir.plan_json import read_plan
    from pipec.compiler.sim import history

    compiled = read_plan(str(root / "later" / "plan.json"))
    kept = history._runs(history.history_key(compiled))
    assert compiled.prediction.interval is not None and kept, "the run kept no steps"
    assert kept[-1]["point"] == compiled.prediction.step_time and len(kept[-1]["ratios"]) == 1


@pytest.mark.timeout(900)
def test_a_model_plan_with_unit_costs_says_units_everywhere(byom_unit_costs, byom_unit_costs_run):
    from pipec.compiler.driver import compile_plan
    from pipec.compiler.ir.plan_json import read_plan

    root = LAUNCHES.folder("byom_unit_costs")
    assert byom_unit_costs.returncode == 0, byom_unit_costs.stderr
    # 1f1b at P=2, M=4 in units: (M + P - 1) x (F + B) = 15, communication free, as for the schedule alone
    assert "predicted step 15 units, bubble 20.0%" in byom_unit_costs.stdout, byom_unit_costs.stdout
    plan = read_plan(str(root / "plan.json"))
    alone = compile_plan(num_ranks=2, num_microbatches=4, schedule="1f1b").plan.prediction
    assert plan.unit_costs and plan.prediction.time_unit == "unit"
    assert plan.prediction.step_time == alone.step_time == 15
    compute = sorted((e.rank, e.text, e.start, e.end) for e in plan.prediction.events if e.text[0] in "FB")
    assert compute == sorted((e.rank, e.text, e.start, e.end) for e in alone.events if e.text[0] in "FB")

    show = run_cli("show", "plan.json", "--trace", "trace.json", cwd=root, env={"COLUMNS": "160"})
    assert show.returncode == 0, show.stderr
    assert "step 15 units" in show.stdout and "cost per microbatch (units;" in show.stdout
    assert " ms " not in show.stdout and " s " not in show.stdout.replace("units", "")
    trace = json.loads((root / "trace.json").read_text())
    assert trace["otherData"]["time_unit"] == {"predicted": "unit"}

    # --emulate sleeps --unit-time seconds per unit (not a second per unit); report.json keeps the plan's own
    # prediction in units as planned, and its predicted is the re-simulation under what was measured, in seconds
    run = byom_unit_costs_run["emulated"]
    assert run["rc"] == 0, run["stderr"][-3000:]
    report = run["report"]
    assert report["planned"]["time_unit"] == "unit" and report["planned"]["step_time"] == 15
    assert report["predicted"]["time_unit"] == "s" and report["predicted"]["step_time"] >= 15 * 0.01
    # measured: 15 units of sleep at 0.01 s (a second per unit would be 15 s; 1.5 s leaves a shared host room)
    assert report["measured"]["time_unit"] == "s" and report["measured"]["step_time"] < 0.1 * 15
