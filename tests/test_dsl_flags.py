"""Flags, driven by the key table: one flag per key, the same value as the
file's syntax, flags win over the file, a file is optional."""

from __future__ import annotations

import argparse
import shlex

import pytest

from pipec.compiler.driver import compile_spec
from pipec.dsl import KEYS, DSLError, load_spec, parse_spec
from pipec.dsl.cli import add_flags, dest_of, overrides_from_args

FIXED = {"pp": "--ranks", "model_args": "--model-arg"}
"""DESIGN's flag names that do not follow ``foo_bar`` -> ``--foo-bar``."""

# Context some examples need to be legal on their own (a key's example, set alone, may break a rule).
CONTEXT = {
    "stages": "schedule interleaved_1f1b\npp 4\n",
    "virtual": "schedule interleaved_1f1b\npp 4\n",
    "placement": "order rank 0: F0.0 F3.0 B3.0 B0.0 rank 1: F1.0 F2.0 B2.0 B1.0\n",
    "schedule": "pp 4\n",
    "policy": "pp 4 microbatches 8\n",
    "model": "input tokens: int64[16, 128]\n",
    "model_args": 'model "pipec.examples.gpt:build"\ninput tokens: int64[16, 128]\n',
    "partition": "pp 4\n",
    "costs": 'model "pipec.examples.gpt:build"\ninput tokens: int64[16, 128]\n',
    "checkpoint_every": 'checkpoint_dir "ckpt"\n',
    "recompute": "pp 2\n",
    "order": "",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipec compile")
    p.add_argument("file", nargs="?")
    add_flags(p)
    return p


def overrides(argv: list[str]) -> dict:
    return overrides_from_args(parser().parse_args(argv))


def test_each_key_has_exactly_one_flag_with_designs_names() -> None:
    flags = [f for key in KEYS.values() for f in key.flags]
    assert len(flags) == len(set(flags))
    for key in KEYS.values():
        assert key.flag == FIXED.get(key.name, "--" + key.name.replace("_", "-"))
    assert KEYS["pp"].aliases == ("--pp",)
    assert [k for k in KEYS.values() if k.aliases] == [KEYS["pp"]]
    assert [k.name for k in KEYS.values() if k.repeatable] == ["model_args"]


def test_add_flags_registers_every_flag_and_nothing_is_given_by_default() -> None:
    p = parser()
    options = {o for action in p._actions for o in action.option_strings}
    assert {f for key in KEYS.values() for f in key.flags} <= options
    assert overrides([]) == {}
    assert overrides(["some.pipe"]) == {}


def _example_value(key) -> str:
    assert key.example.startswith(key.name + " ")
    return key.example[len(key.name) + 1:]


@pytest.mark.parametrize("name", list(KEYS))
def test_flag_gives_the_same_value_as_the_file(name: str, tmp_path, monkeypatch) -> None:
    key = KEYS[name]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "schedule.csv").write_text("0F0,0B0\n")
    context = CONTEXT.get(name, "")
    from_file = parse_spec(context + key.example + "\n", filename=str(tmp_path / "job.pipe"))
    value = _example_value(key)
    if name == "model":  # the example carries the arguments: give them as --model-arg
        target, _, args = value.partition(" ")
        argv = ["--model", target.strip('"')] + [
            a for kv in args.strip("()").split(", ") for a in ("--model-arg", kv)]
    elif name == "model_args":
        argv = [a for kv in value.strip("()").split(", ") for a in ("--model-arg", kv)]
    elif name == "order":
        argv = ["--order", value.strip('"')]
    else:
        argv = [key.flag, value]
    from_flags = parse_spec(context, filename=str(tmp_path / "job.pipe"), overrides=overrides(argv))
    assert from_flags[name] == from_file[name]
    if name == "order":
        assert from_flags.order.ranks == from_file.order.ranks
    assert from_flags.request.origin(name).flag == key.flag
    assert from_flags.source(name) == f"flag {key.flag}"
    assert from_file.source(name).startswith(str(tmp_path / "job.pipe") + ":")


@pytest.mark.parametrize(("argv", "key", "value"), [
    (["--ranks", "8"], "pp", 8),
    (["--pp", "8"], "pp", 8),
    (["--schedule", "gpipe"], "schedule", "gpipe"),
    (["--microbatches", "16"], "microbatches", 16),
    (["--dp", "4"], "dp", 4),
    (["--seed", "3"], "seed", 3),
    (["--lr", "0.1"], "lr", 0.1),
    (["--device-memory", "16GB"], "device_memory", 16 * 10**9),
    (["--placement", "loop"], "placement", "loop"),
])
def test_flags_win_over_the_file(argv, key, value) -> None:
    text = "schedule 1f1b\npp 4\nmicrobatches 8\ndp 2\nseed 1\nlr 1e-3\ndevice_memory 80GB\nplacement loop\n"
    spec = parse_spec(text, filename="f.pipe", overrides=overrides(argv))
    assert spec[key] == value
    assert spec.source(key) == f"flag {KEYS[key].flag}"


def test_schedule_only_compile_flags_keep_their_meaning() -> None:
    spec = load_spec(None, overrides(shlex.split("--schedule interleaved_1f1b --ranks 4 --microbatches 8 "
                                                 "--virtual 2 --dp 2")))
    assert (spec.schedule, spec.pp, spec.microbatches, spec.virtual, spec.dp, spec.stages) == (
        "interleaved_1f1b", 4, 8, 2, 2, 8)
    assert spec.model is None and spec.costs == "unit"


def test_a_flag_for_the_schedule_replaces_the_files_custom_schedule() -> None:
    text = "pp 4 microbatches 8\npolicy (warmup=P - rank)\n"
    spec = parse_spec(text, overrides=overrides(["--schedule", "gpipe"]))
    assert spec.schedule == "gpipe" and spec.policy is None
    spec = parse_spec("schedule gpipe pp 4", overrides=overrides(["--policy", "warmup=P - rank, priority=backward"]))
    assert spec.schedule == "policy" and spec.policy.get("priority") == "backward"


def test_model_args_flags_merge_into_the_files() -> None:
    text = 'model "pipec.examples.gpt:build" (layers=8, dim=256)\ninput tokens: int64[16, 128]\n'
    spec = parse_spec(text, overrides=overrides(["--model-arg", "layers=2", "--model-arg", 'act="gelu"']))
    assert dict(spec.model_args) == {"dim": 256, "layers": 2, "act": "gelu"}


def test_structured_flags() -> None:
    got = overrides(["--input", "tokens:int64[16,128]", "--partition", "split before blocks.4",
                     "--links", "pp(latency=1us)", "--model", "pipec.examples.gpt:build",
                     "--checkpoint-dir", "ckpt/run 1", "--recompute", "stages 0"])
    spec = load_spec(None, got)
    assert spec.input[0].shape == (16, 128)
    assert spec.partition.split_before == ("blocks.4",)
    assert spec.links.pp.latency_s == 1e-6
    assert spec.checkpoint_dir == "ckpt/run 1"
    assert spec.recompute == (0,)


@pytest.mark.parametrize(("argv", "expected"), [
    (["--virtual", "0"], "<command line>:1:11: error: --virtual: virtual must be at least 1, got 0\n"
                         "    --virtual 0\n              ^"),
    (["--schedule", "1f1c"], "<command line>:1:12: error: --schedule: unknown schedule '1f1c'\n"
                             "    --schedule 1f1c\n               ^~~~\ndid you mean '1f1b'?"),
    (["--ranks", "4", "--microbatches", "x8"], "<command line>:1:26: error: --microbatches: microbatches "
                                              "needs a whole number >= 1 and <= 65536, got 'x8'\n"
                                              "    --ranks 4 --microbatches x8\n                             ^~"),
])
def test_a_bad_flag_value_is_located_in_the_command_line(argv, expected) -> None:
    with pytest.raises(DSLError) as info:
        overrides(argv)
    assert str(info.value) == expected
    assert info.value.file == "<command line>"


def test_cross_key_errors_on_flags_name_the_flags() -> None:
    spec = load_spec(None, overrides(["--schedule", "zbv", "--ranks", "4", "--virtual", "3"]))
    with pytest.raises(DSLError) as info:
        compile_spec(spec)  # the schedule's rule is the driver's; the boundary words it as the flags
    assert str(info.value) == (
        "<command line>:1:36: error: zbv needs exactly 2 chunks per rank, got --virtual 3; use --virtual 2\n"
        "    --schedule zbv --ranks 4 --virtual 3\n"
        "                                       ^")


def test_flags_are_converted_once_not_printed_and_parsed_again(monkeypatch) -> None:
    from pipec.dsl import flags

    given = overrides(["--ranks", "4", "--schedule", "1f1b", "--microbatches", "8"])
    monkeypatch.setattr(flags, "flag_node", lambda *a: pytest.fail("a converted flag was parsed again"))
    spec = load_spec(None, given)
    assert (spec.pp, spec.schedule, spec.microbatches) == (4, "1f1b", 8)
    assert spec.source("pp") == "flag --ranks"


def test_overrides_may_be_plain_values_or_text() -> None:
    spec = parse_spec("pp 2", overrides={"pp": 4, "schedule": "zb_h1", "partition": "balanced(by=params)"})
    assert (spec.pp, spec.schedule, spec.partition.by) == (4, "zb_h1", "params")
    with pytest.raises(DSLError, match="unknown key 'ppp'"):
        parse_spec("", overrides={"ppp": 4})


def test_dest_names_do_not_collide_with_a_callers_options() -> None:
    assert all(dest_of(k).startswith("dsl_") for k in KEYS)
