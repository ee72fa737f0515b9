"""The pipec command: exit codes, messages, files written. Run as a real process (``python -m pipec``)."""

from __future__ import annotations

import json

import pytest

from pipec.compiler.ir.plan_json import read_plan


def test_compile_check_show(cli, tmp_path):
    out = cli("compile", "--schedule", "interleaved_1f1b", "--ranks", "4", "--virtual", "2", "--microbatches", "8",
              "-o", "plan.json")
    assert out.returncode == 0, out.stderr
    assert "verified" in out.stdout and "15.8%" in out.stdout
    plan = read_plan(str(tmp_path / "plan.json"))
    assert plan.mesh.pp == 4 and plan.num_stages == 8 and plan.prediction is not None
    out = cli("check", "plan.json")
    assert out.returncode == 0 and "verified" in out.stdout
    out = cli("show", "plan.json", "--svg", "t.svg", "--png", "t.png", "--trace", "t.json")
    assert out.returncode == 0, out.stderr
    assert "rank 3" in out.stdout and "bubble" in out.stdout
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "t.svg").read_text().lstrip().startswith("<?xml")
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    out = cli("show", "plan.json", "--text")
    assert out.stdout.splitlines()[0].startswith("0: F0.0")


def test_user_mistakes_exit_2_without_traceback(cli_process, tmp_path):
    cases = [
        (("compile", "--schedule", "zbv", "--ranks", "4", "--virtual", "3", "--microbatches", "8"), "zbv needs exactly 2"),
        (("compile", "--schedule", "1f1c", "--ranks", "4", "--microbatches", "8"), "did you mean '1f1b'"),
        (("check", "missing.json"), "cannot read plan"),
        (("show", "missing.json"), "cannot read plan"),
        (("compile", "--ranks", "5000", "--schedule", "gpipe", "--microbatches", "1"), "limit of 4096"),
        (("import", "missing.csv"), "missing.csv"),
        (("show", "plan.json", "--png", "x.gif"), None),
    ]
    (tmp_path / "plan.json").write_text("{}")
    for args, message in cases:
        out = cli_process(*args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr, out.stderr
        # once, in compiler style: a located error as it renders, anything else after pipec's prefix
        first = out.stderr.splitlines()[0] if out.stderr else ""
        assert first.startswith("pipec: error: ") or ": error: " in first or "usage:" in out.stderr, out.stderr
        assert out.stderr.count("error:") == 1, out.stderr
        if message:
            assert message in out.stderr, (args, out.stderr)


def test_warnings_do_not_fail(cli_process):
    out = cli_process("compile", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "2", "-o", "p.json")
    assert out.returncode == 0
    assert ": warning: " in out.stderr  # located at the flag that set it


def test_torch_csv_round_trip_through_the_cli(cli, tmp_path):
    assert cli("compile", "--schedule", "zbv", "--ranks", "2", "--virtual", "2", "--microbatches", "4", "-o",
               "p.json").returncode == 0
    for form in ("compute_only", "compute_comms"):
        out = cli("export", "p.json", "--torch-csv", f"{form}.csv", "--form", form)
        assert out.returncode == 0, out.stderr
        out = cli("import", f"{form}.csv", "-o", f"{form}.json")
        assert out.returncode == 0, out.stderr
        assert "verified" in out.stdout
        a, b = read_plan(str(tmp_path / "p.json")), read_plan(str(tmp_path / f"{form}.json"))
        assert a.placement == b.placement and a.prediction.bubble_fraction == b.prediction.bubble_fraction
    (tmp_path / "bad.csv").write_text("0F0,0B0,0OVERLAP_F_B\n")
    out = cli("import", "bad.csv")
    assert out.returncode == 2 and "OVERLAP_F_B" in out.stderr


@pytest.mark.slow  # the whole demo: profiles, then three schedules under torchrun (~50 s on 2 cores)
@pytest.mark.timeout(600)
def test_demo_shows_three_schedules(cli_process):
    out = cli_process("demo", timeout=300)
    assert out.returncode == 0, out.stderr
    for name in ("1f1b", "interleaved_1f1b", "zb_h1"):
        assert name in out.stdout
    assert "27.3%" in out.stdout and "11.1%" in out.stdout


def test_show_graph_with_a_bad_extension_is_a_user_error(tmp_path, capsys):
    from pipec.cli import main

    plan = tmp_path / "p.json"
    assert main(["compile", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "4", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["show", str(plan), "--graph", str(tmp_path / "x.jpg")]) == 2
    err = capsys.readouterr().err
    assert "graph file must end in .svg, .png, .pdf or .dot" in err and "Traceback" not in err


def test_a_located_error_prints_once_in_compiler_style(cli, tmp_path):
    (tmp_path / "f.pipe").write_text("pp 2\nmicrobatches 4\nschedule 1f1b\nmicrobatchs 8\n")
    out = cli("compile", "f.pipe")
    assert out.returncode == 2
    lines = out.stderr.splitlines()
    assert lines[0] == "f.pipe:4:1: error: unknown key 'microbatchs'", out.stderr  # no "pipec: error:" before it
    assert lines[1:3] == ["    microbatchs 8", "    ^~~~~~~~~~~"] and "did you mean 'microbatches'?" in lines[3]


def test_show_draws_a_sharded_model_plan(cli, tmp_path):
    out = cli("compile", "--model", "pipec.examples.gpt:build", "--model-arg", "layers=2", "--model-arg", "dim=16",
              "--input", "tokens: int64[4, 16]", "--ranks", "2", "--dp", "2", "--shard", "full", "--costs", "unit",
              "-o", "p.json")
    assert out.returncode == 0, out.stderr
    shown = cli("show", "p.json", "--trace", "t.json")
    assert shown.returncode == 0, shown.stderr
    assert "unsharded" in shown.stdout and "Traceback" not in shown.stderr
    text = cli("show", "p.json", "--text")
    assert "UN0:dp" in text.stdout and "RS1:dp" in text.stdout


def test_import_a_sharded_torch_schedule(cli, tmp_path):
    assert cli("compile", "--schedule", "1f1b", "--ranks", "2", "--dp", "2", "--shard", "full", "--microbatches", "4",
               "-o", "p.json").returncode == 0
    assert cli("export", "p.json", "--torch-csv", "s.csv", "--form", "compute_comms").returncode == 0
    assert "0UNSHARD" in (tmp_path / "s.csv").read_text()
    assert cli("import", "s.csv", "--dp", "2", "--shard", "full", "-o", "back.json").returncode == 0
    def unbatched(path):  # torch's CSV has no batches: each post is its own cell
        return [[i._replace(batch=None) for i in r] for r in read_plan(path).program.ranks]

    assert unbatched(tmp_path / "back.json") == unbatched(tmp_path / "p.json")
    bad = cli("import", "s.csv", "--dp", "3", "--shard", "full", "--shard-size", "2", "-o", "x.json")
    assert bad.returncode == 2 and "--shard-size: shard_size 2 does not divide dp 3" in bad.stderr
