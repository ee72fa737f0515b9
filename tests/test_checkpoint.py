"""Checkpoints: resume, reshard, restarts, corruption, retention, export, goodput.

- In-process (one gloo rank holding every stage, fast): a save/restore round
  trip with both copies of a tied weight on one rank; corrupt and uncommitted
  checkpoints rejected with clear errors, the previous one used; retention;
  refusing to mix two runs in one checkpoint_dir; export into the model; the
  goodput arithmetic.
- torchrun (gloo, CPU): a reference run of the example GPT (pp=2 interleaved,
  a checkpoint every step); N steps, stop, resume to 2N: parameters and
  optimizer state bit-identical to the uninterrupted run; a --fail-at run under
  --max-restarts 1 finishes bit-identical, resuming from its last checkpoint,
  with goodput in its report; a corrupted newest checkpoint is passed over for
  the previous one; the reference's checkpoint resumed under pp=2 1f1b and
  under dp=2 x pp=2 (reshard). The runs that only need their outcome share
  launches (tests/launches.py): the reference and the first half of the
  stopped run in one, the resumes in later ones.
"""

from __future__ import annotations

import datetime
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import LAUNCHES, PYTHON, compiled, run_job

from pipec.compiler.config import TrainingConfig
from pipec.compiler.ir.plan_json import write_plan
from pipec.runtime.stages import build_reference, build_stages, run_stages
from pipec.runtime.checkpoint import CheckpointError, Checkpointer, list_checkpoints, read_manifest, validate
from pipec.runtime.checkpoint_export import export_checkpoint, load_model_state
from pipec.runtime.goodput import summarize
from pipec.runtime.training import make_data, make_loss, make_optimizer

MODEL_ARGS = {"layers": 4, "dim": 16, "heads": 2, "vocab": 32, "seq": 8}


def tiny_gpt(schedule: str, virtual: int, pp: int, dp: int = 1):
    return compiled({
        "model": "pipec.examples.gpt:build", "model_args": MODEL_ARGS, "input": "tokens: int64[8, 8]",
        "schedule": schedule, "pp": pp, "dp": dp, "virtual": virtual, "microbatches": 4, "costs": "unit",
        "partition": "balanced(by=params)",
    })


def with_checkpoints(plan_path: Path, out: Path, folder: Path | None, every: int) -> str:
    """A copy of a plan whose spec writes checkpoints into ``folder`` every ``every`` steps."""
    data = json.loads(plan_path.read_text())
    data["spec"]["checkpoint_dir"] = str(folder) if folder else None
    data["spec"]["checkpoint_every"] = every
    out.write_text(json.dumps(data))
    return str(out)


def full_state(path: Path) -> dict:
    """Every entry of a checkpoint (model, optimizer, step, RNG) by its flat key, read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(path, f"{d}/all.pt")
        nested = torch.load(f"{d}/all.pt", weights_only=False)
    flat = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = value

    walk("", nested)
    return flat


def assert_same_state(a: dict, b: dict, *, rng: bool = True) -> None:
    keys = {k for k in a if rng or not k.startswith("rng")}
    assert keys == {k for k in b if rng or not k.startswith("rng")}
    for k in sorted(keys):
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


# ----------------------------------------------------------------------------- in-process, one rank


@pytest.fixture
def one_rank():
    """A gloo world of one process (DCP needs a process group); torn down afterwards."""
    with tempfile.NamedTemporaryFile() as f:
        store = dist.FileStore(f.name, 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def plan_x():
    """pp=2 interleaved_1f1b, 4 stages: the tied embedding / head lives in stages 0 and 3."""
    plan = tiny_gpt("interleaved_1f1b", 2, 2)
    assert [(t.name, t.stages) for t in plan.ties] == [("wte.weight", (0, 3))]
    return plan


class Local:
    """Every stage of a plan in this process, trained on its data, tied copies kept equal as the runtime does."""

    def __init__(self, plan) -> None:
        self.plan = plan
        self.config = TrainingConfig.from_spec(plan.spec)
        self.modules = build_stages(plan, range(plan.num_stages), seed=0)
        self.optimizer = make_optimizer([p for m in self.modules.values() for p in m.parameters()], self.config)
        self.data, self.loss = make_data(self.config, plan), make_loss("cross_entropy")

    def step(self, k: int) -> None:
        x, y = self.data(k, 0, 1)
        self.loss(run_stages(self.modules, x)[0], y).backward()
        for tie in self.plan.ties:
            copies = [getattr_path(self.modules[s], name) for s, name in zip(tie.stages, tie.params)]
            total = sum(p.grad for p in copies)
            for p in copies:
                p.grad = total.clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def checkpointer(self, **kw) -> Checkpointer:
        opts = {"rank": 0, "world_size": 1, "total_steps": 10, "save_dir": None, "every": 0, "keep": None,
                "resume": None, **kw}
        return Checkpointer(self.plan, self.config, self.modules, self.optimizer, **opts)

    def params(self) -> dict[str, torch.Tensor]:
        return {f"{s}:{n}": p.detach().clone() for s, m in self.modules.items() for n, p in m.named_parameters()}


def getattr_path(mod, name: str):
    for part in name.split("."):
        mod = getattr(mod, part)
    return mod


def test_round_trip_loads_every_tied_copy_and_continues_bit_exact(one_rank, plan_x, tmp_path):
    a = Local(plan_x)
    ck = a.checkpointer(save_dir=str(tmp_path / "ck"), every=2, keep=None)
    assert ck.restore() == 0
    for k in range(4):
        a.step(k)
        ck.after_step(k + 1)
    ck.finish(4)
    assert [s for s, _ in list_checkpoints(tmp_path / "ck")] == [4, 2]
    manifest = validate(tmp_path / "ck" / "step_00000004")
    assert manifest.step == 4 and manifest.aliases == {"wte.weight": ["lm_head.weight"]}

    b = Local(plan_x)
    with torch.no_grad():  # make both tied copies wrong: a resume must overwrite each of them
        b.modules[0].wte.weight.add_(1.0)
        b.modules[3].lm_head.weight.sub_(1.0)
    assert b.checkpointer(resume=str(tmp_path / "ck")).restore() == 4
    assert b.params().keys() == a.params().keys()
    for k, v in a.params().items():
        assert torch.equal(b.params()[k], v), k
    # the optimizer state continues exactly (each tied copy has its own, not aliased, state)
    a.step(4)
    b.step(4)
    for k, v in a.params().items():
        assert torch.equal(b.params()[k], v), k


def test_corrupt_checkpoints_are_rejected_and_the_previous_one_used(one_rank, plan_x, tmp_path, capsys):
    a = Local(plan_x)
    root = tmp_path / "ck"
    ck = a.checkpointer(save_dir=str(root), every=1)
    ck.restore()
    for k in range(3):
        a.step(k)
        ck.after_step(k + 1)
    ck.finish(3)
    s3, s2 = root / "step_00000003", root / "step_00000002"
    data = sorted(p for p in s3.iterdir() if p.suffix == ".distcp")[0]
    data.write_bytes(data.read_bytes()[:-100])  # truncated
    blob = bytearray((s2 / ".metadata").read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # one flipped byte
    (s2 / ".metadata").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=r"step_00000003 is corrupt: file __0_0.distcp has \d+ bytes, the manifest says"):
        validate(s3)
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        validate(s2)
    # an interrupted write: DCP files without a manifest under a step name, and a .tmp folder
    (root / "step_00000009.tmp-a0").mkdir()
    broken = root / "step_00000008"
    shutil.copytree(s3, broken)
    (broken / "pipec.json").unlink()
    with pytest.raises(CheckpointError, match="no pipec.json manifest, so it was never committed"):
        read_manifest(broken)

    capsys.readouterr()
    b = Local(plan_x)
    assert b.checkpointer(resume=str(root)).restore() == 1
    err = capsys.readouterr().err
    for name in ("step_00000008", "step_00000003", "step_00000002"):
        assert name in err
    assert "resuming from" in err and "step_00000001 instead" in err
    # naming a corrupt checkpoint itself is an error that says where the valid ones are
    with pytest.raises(CheckpointError, match="step_00000003 is corrupt.*resume from its parent folder"):
        Local(plan_x).checkpointer(resume=str(s3)).restore()
    # a run that saves into this folder again cleans up the interrupted write and replaces the corrupt ones
    c = Local(plan_x)
    ck = c.checkpointer(resume=str(root), save_dir=str(root), every=1)
    assert ck.restore() == 1
    assert not (root / "step_00000009.tmp-a0").exists()
    for k in range(1, 3):
        c.step(k)
        ck.after_step(k + 1)
    ck.finish(3)
    assert validate(s3).step == 3 and validate(s2).step == 2


def test_a_save_cut_short_before_its_commit_never_loads(one_rank, plan_x, tmp_path, monkeypatch, capsys):
    import pipec.runtime.checkpoint as checkpoint

    a = Local(plan_x)
    root = tmp_path / "ck"
    ck = a.checkpointer(save_dir=str(root), every=1)
    ck.restore()
    a.step(0)
    ck.after_step(1)
    ck.wait()

    def crash(tmp, name):
        raise OSError("simulated crash before the commit")

    monkeypatch.setattr(checkpoint, "_publish", crash)
    a.step(1)
    ck.after_step(2)  # every file written, the manifest too, but never renamed into place
    ck.wait()
    assert "the checkpoint of step 2 failed (OSError: simulated crash" in capsys.readouterr().err
    assert (root / "step_00000002.tmp-a0" / "pipec.json").exists()
    assert [s for s, _ in list_checkpoints(root)] == [1]
    monkeypatch.undo()
    b = Local(plan_x)
    assert b.checkpointer(resume=str(root), save_dir=str(root), every=1).restore() == 1
    assert not (root / "step_00000002.tmp-a0").exists()  # removed by the next run


@pytest.mark.slow
def test_retention_and_a_fresh_run_never_mixes_with_old_checkpoints(one_rank, plan_x, tmp_path):
    a = Local(plan_x)
    root = tmp_path / "ck"
    ck = a.checkpointer(save_dir=str(root), every=1, keep=2, asynchronous=False)
    ck.restore()
    for k in range(4):
        a.step(k)
        ck.after_step(k + 1)
    ck.finish(4)
    assert [s for s, _ in list_checkpoints(root)] == [4, 3]
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(newest step_00000004\).*--resume"):
        Local(plan_x).checkpointer(save_dir=str(root), every=1).restore()
    with pytest.raises(CheckpointError, match="must be at least 1"):
        Local(plan_x).checkpointer(save_dir=str(root), every=1, keep=0)


def test_export_loads_into_the_unpartitioned_model(one_rank, plan_x, tmp_path):
    from safetensors.torch import load_file

    from pipec.examples.gpt import build

    a = Local(plan_x)
    ck = a.checkpointer(save_dir=str(tmp_path / "ck"), every=1)
    ck.restore()
    a.step(0)
    ck.finish(1)
    for name, load in (("m.pt", torch.load), ("m.safetensors", load_file)):
        res = export_checkpoint(tmp_path / "ck", tmp_path / name)
        assert res.num_aliases == 1
        model = build(**MODEL_ARGS)
        model.load_state_dict(load(str(tmp_path / name)))  # strict: every key, the tied alias included
        assert model.lm_head.weight is model.wte.weight
        for s, mod in a.modules.items():
            for canon, p in mod.canonical_params().items():
                assert torch.equal(model.get_parameter(canon), p), canon
    with pytest.raises(CheckpointError, match="must end in .pt"):
        export_checkpoint(tmp_path / "ck", tmp_path / "m.bin")


def test_goodput_splits_wall_time_across_attempts():
    # attempt 0: starts at 0, steps from 2, checkpoint at step 4 (t=6, 0.5 s blocked before it), dies after step 5
    # attempt 1: starts at 10, resumes from 4, runs steps 4..7, finishes
    records = [
        {"attempt": 0, "process_start": 0.0, "train_start": 2.0, "resumed_from": 0, "step": 5, "last_step_end": 7.5,
         "blocked_at_last_step": 0.5, "blocked_s": 0.5, "checkpoints": {"4": [6.0, 0.5]}, "updated": 7.5},
        {"attempt": 1, "process_start": 10.0, "train_start": 12.0, "resumed_from": 4, "step": 8, "last_step_end": 16.0,
         "blocked_at_last_step": 1.0, "blocked_s": 1.5, "checkpoints": {"8": [15.0, 1.0]}, "updated": 16.5,
         "finished": True},
    ]
    g = summarize(records, now=17.0)
    assert g["wall_s"] == 17.0 and g["restarts"] == 1 and g["steps_recomputed"] == 1
    # kept: attempt 0's steps 0-3 (6.0 - 2.0 - 0.5) and all of attempt 1's stepping (16 - 12 - 1)
    assert g["productive_s"] == pytest.approx(3.5 + 3.0)
    lost = g["lost_s"]
    assert lost["startup"] == pytest.approx(4.0) and lost["restart"] == pytest.approx(2.5)
    assert lost["recompute"] == pytest.approx((7.5 - 2.0 - 0.5) - 3.5) and lost["checkpoint"] == pytest.approx(2.0)
    assert g["productive_s"] + sum(lost.values()) == pytest.approx(g["wall_s"])
    assert g["fraction"] == pytest.approx(6.5 / 17.0)


# ----------------------------------------------------------------------------- torchrun


def losses(record: dict) -> dict[int, float]:
    """A run's loss by step (tests/runtime_worker.py's record of it)."""
    return {s["step"]: s["loss"] for s in record["report"]["steps"]}


def assert_ran(record: dict) -> None:
    assert record["rc"] == 0, record["stderr"][-4000:]


def _runs(folder: Path) -> dict[str, dict]:
    """The plans; the reference run (6 steps of plan X, a checkpoint after every step); and the first half of a
    run stopped after 3 steps (a checkpoint every 2: saves steps 2, and 3 as it ends)."""
    x = folder / "x.json"
    write_plan(tiny_gpt("interleaved_1f1b", 2, 2), str(x))
    for name, plan in (("y", tiny_gpt("1f1b", 1, 2)), ("z", tiny_gpt("1f1b", 1, 2, dp=2))):
        write_plan(plan, str(folder / f"{name}.json"))
    ref = with_checkpoints(x, folder / "x_ref.json", folder / "ref", every=1)
    stopped = with_checkpoints(x, folder / "x_b.json", folder / "b", every=2)
    return {"ref": run_job(ref, "--steps", "6"), "stopped": run_job(stopped, "--steps", "3")}


def _resumed(folder: Path) -> dict[str, dict]:
    """Every 2-rank resume from the reference's or the stopped run's checkpoints: the stopped run to 6 steps; a
    copy of the reference's checkpoints whose newest is corrupt, to 6 steps; the reference's step 3 under plan
    Y (pp=2 1f1b, 2 stages: resharded), to 4 steps."""
    runs = LAUNCHES.folder("checkpoint_runs")
    shutil.copytree(runs / "ref", folder / "c")
    victim = sorted((folder / "c" / "step_00000006").glob("*.distcp"))[-1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    (folder / "victim").write_text(victim.name)
    corrupt = with_checkpoints(runs / "x.json", folder / "x_c.json", folder / "c", every=1)
    y = with_checkpoints(runs / "y.json", folder / "y_ck.json", folder / "y_out", every=1)
    return {"stopped": run_job(runs / "x_b.json", "--steps", "6", "--resume", str(runs / "b")),
            "corrupt": run_job(corrupt, "--steps", "6", "--resume", str(folder / "c")),
            "y": run_job(y, "--steps", "4", "--resume", str(runs / "ref" / "step_00000003"))}


def _resumed_4(folder: Path) -> dict[str, dict]:
    """The reference's step 3 under plan Z (dp=2 x pp=2 1f1b), to 4 steps."""
    runs = LAUNCHES.folder("checkpoint_runs")
    return {"z": run_job(runs / "z.json", "--steps", "4", "--resume", str(runs / "ref" / "step_00000003"))}


checkpoint_runs = LAUNCHES.runs("checkpoint_runs", world=2, make=_runs)
checkpoint_resumed = LAUNCHES.runs("checkpoint_resumed", world=2, round=2, after=("checkpoint_runs",), make=_resumed)
checkpoint_resumed_4 = LAUNCHES.runs("checkpoint_resumed_4", world=4, round=2, after=("checkpoint_runs",),
                                    make=_resumed_4)


@pytest.mark.timeout(900)
def test_stop_and_resume_is_bit_identical_to_an_uninterrupted_run(checkpoint_runs, checkpoint_resumed):
    runs = LAUNCHES.folder("checkpoint_runs")
    first, second = checkpoint_runs["stopped"], checkpoint_resumed["stopped"]
    assert_ran(first)
    assert_ran(second)
    assert "resumed from" in second["stderr"] and "step_00000003 at step 3" in second["stderr"]
    assert [s for s, _ in list_checkpoints(runs / "b")] == [6, 4, 3, 2]
    # the same token stream: steps 4..6 (counted from 1) have the uninterrupted run's losses, exactly
    assert losses(second) == {k: v for k, v in losses(checkpoint_runs["ref"]).items() if k >= 4}
    assert_same_state(full_state(runs / "b" / "step_00000006"), full_state(runs / "ref" / "step_00000006"))


def _restarted(folder: Path) -> list[str]:
    """Plan X run 6 steps with a checkpoint every 2, rank 1 killed in step 5 (after 4 done), one restart allowed."""
    plan = with_checkpoints(LAUNCHES.folder("checkpoint_runs") / "x.json", folder / "x_f.json", folder / "f", every=2)
    return [PYTHON, "-m", "pipec", "run", plan, "--nproc", "2", "--steps", "6", "--fail-at", "5:1", "--max-restarts",
            "1", "--sync-checkpoints", "--keep-checkpoints", "1", "--report", str(folder / "f.json"), "--timeout", "60",
            "--quiet"]


restarted = LAUNCHES.command("restarted", make=_restarted, timeout=240, round=1, after=("checkpoint_runs",))


@pytest.mark.timeout(900)
def test_a_failure_under_max_restarts_resumes_and_ends_bit_identical(checkpoint_runs, restarted):
    runs, tmp_path = LAUNCHES.folder("checkpoint_runs"), LAUNCHES.folder("restarted")
    run = restarted
    assert run.returncode == 0, run.stderr[-4000:]
    assert "injected failure: global rank 1 (pp 1, dp 0) killed at step 5" in run.stderr
    assert "step_00000004 at step 4" in run.stderr  # the restarted attempt resumed from the last checkpoint
    assert [s for s, _ in list_checkpoints(tmp_path / "f")] == [6]  # --keep-checkpoints 1
    assert_same_state(full_state(tmp_path / "f" / "step_00000006"), full_state(runs / "ref" / "step_00000006"))
    g = json.loads((tmp_path / "f.json").read_text())["goodput"]
    assert g["restarts"] == 1 and [a["resumed_from"] for a in g["attempts"]] == [0, 4]
    assert [a["steps_done"] for a in g["attempts"]] == [4, 6] and g["steps_recomputed"] == 0
    assert g["checkpoints"]["mode"] == "sync" and g["checkpoints"]["committed"] == [6]
    assert 0 < g["fraction"] < 1 and g["lost_s"]["restart"] > 0 and g["lost_s"]["startup"] > 0
    assert g["productive_s"] + sum(g["lost_s"].values()) == pytest.approx(g["wall_s"])


@pytest.mark.timeout(900)
def test_a_corrupt_newest_checkpoint_is_passed_over_for_the_previous_one(checkpoint_runs, checkpoint_resumed):
    runs, folder = LAUNCHES.folder("checkpoint_runs"), LAUNCHES.folder("checkpoint_resumed")
    run = checkpoint_resumed["corrupt"]
    assert_ran(run)
    c = folder / "c"
    assert f"checkpoint {c / 'step_00000006'} is corrupt: file {(folder / 'victim').read_text()} has" in run["stderr"]
    assert f"resuming from {c / 'step_00000005'} instead" in run["stderr"]
    # the corrupt checkpoint was replaced by a good one, equal to the reference's
    assert_same_state(full_state(c / "step_00000006"), full_state(runs / "ref" / "step_00000006"))


@pytest.mark.timeout(900)
def test_a_checkpoint_loads_under_another_partition(checkpoint_runs, checkpoint_resumed):
    """Written under pp=2 interleaved (4 stages), resumed under pp=2 1f1b (2 stages)."""
    runs, folder = LAUNCHES.folder("checkpoint_runs"), LAUNCHES.folder("checkpoint_resumed")
    run = checkpoint_resumed["y"]
    assert_ran(run)
    assert "resharded" in run["stderr"]
    assert losses(run)[4] == pytest.approx(losses(checkpoint_runs["ref"])[4], rel=1e-6)  # the 4th, after 3 done
    # one more step under the other partition lands where the reference's did (optimizer state resharded too)
    got, _, _ = load_model_state(folder / "y_out")
    want, _, _ = load_model_state(runs / "ref" / "step_00000004")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(900)
def test_a_checkpoint_loads_under_data_parallelism(checkpoint_resumed_4):
    """Written under pp=2 interleaved, resumed under dp=2 x pp=2 1f1b: the loss of step 3 is that of the
    checkpoint's weights on both replicas' batches."""
    runs = LAUNCHES.folder("checkpoint_runs")
    run = checkpoint_resumed_4["z"]
    assert_ran(run)
    assert "resharded" in run["stderr"]
    src = runs / "ref" / "step_00000003"
    plan = tiny_gpt("1f1b", 1, 2, dp=2)
    model = build_reference(plan, seed=0)
    state, _, _ = load_model_state(src)
    model.model.load_state_dict({**state, "lm_head.weight": state["wte.weight"]})
    data, loss_fn = make_data(TrainingConfig.from_spec(plan.spec), plan), make_loss("cross_entropy")
    with torch.no_grad():
        expected = sum(loss_fn(model(data(3, d, 2)[0]["tokens"])[0], data(3, d, 2)[1]).item() for d in range(2)) / 2
    assert losses(run)[4] == pytest.approx(expected, rel=1e-5)  # step 4 (from 1) reads batch index 3
