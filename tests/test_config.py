"""The typed training config (compiler/config.py) and the run options (runtime/launch.py RunOptions).

The key table takes the training keys' defaults from the config; plan.json's
spec, as the language writes it, reads back into the same config; an older
plan lacking fields loads with the defaults; a malformed field is refused
with its name. Run options parse once, check their combinations, and write
themselves back as the ranks' flags.
"""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from pipec.compiler.config import DEFAULTS, LRSchedule, Optimizer, TrainingConfig
from pipec.compiler.ir.schema import SchemaError
from pipec.dsl import load_spec
from pipec.dsl.keys import KEYS
from pipec.runtime.launch import LaunchError, RunOptions, run_parser

TRAINING_KEYS = [f.name for f in fields(TrainingConfig)]

GIVEN = {
    "steps": "7", "seed": "11", "optimizer": "sgd(momentum=0.9, nesterov=on)", "lr": "1e-3",
    "lr_schedule": "cosine(warmup=2, min_lr=1e-5)", "grad_clip": "0.5", "dtype": "bfloat16", "recompute": "stages 0, 1",
    "data": "mypkg.data:batches", "loss": "mse", "checkpoint_dir": "ckpt/run1", "checkpoint_every": "3", "init": "exact",
    "peak_flops": "312TFLOP/s", "schedule": "1f1b", "pp": "2", "microbatches": "4",
}
"""Every training key set away from its default (a schedule-only spec: nothing is traced)."""


def test_the_languages_training_defaults_are_the_configs():
    assert all(name in KEYS for name in TRAINING_KEYS)  # every field of the config is a key
    assert load_spec(None, {}).request.training == DEFAULTS  # nothing given: the config's defaults, resolved
    for name in TRAINING_KEYS:  # the reference page's default, read back by the language, is the config's
        shown = KEYS[name].default_doc.split(" (")[0]  # "0 (off)": the value, without its note
        assert load_spec(None, {name: shown})[name] == getattr(DEFAULTS, name), (name, shown)


def test_the_language_builds_the_configs_own_values():
    spec = load_spec(None, {"optimizer": "sgd(momentum=0.9)", "lr_schedule": "linear(warmup=3)"})
    assert spec.optimizer == Optimizer.of("sgd", momentum=0.9)
    assert spec.optimizer.kwargs == {"momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False}
    assert spec.lr_schedule == LRSchedule("linear", 3)


def test_a_plans_spec_round_trips_into_the_config():
    spec = load_spec(None, GIVEN)
    config = TrainingConfig.from_spec(json.loads(json.dumps(spec.to_json())))  # plan.json's spec, as written
    assert config == TrainingConfig(**{name: spec[name] for name in TRAINING_KEYS})
    assert config != DEFAULTS and all(getattr(config, n) != getattr(DEFAULTS, n) for n in TRAINING_KEYS)
    assert TrainingConfig.from_spec(json.loads(json.dumps(config.to_json()))) == config
    assert config.to_json() == {k: v for k, v in spec.to_json().items() if k in TRAINING_KEYS}


def test_an_older_plan_without_training_fields_loads_with_the_defaults():
    older = {"steps": 5, "optimizer": {"name": "adam"}, "lr_schedule": {"name": "linear"}, "grad_clip": None}
    config = TrainingConfig.from_spec(older)
    assert config.steps == 5 and config.optimizer == Optimizer.of("adam") and config.lr_schedule == LRSchedule("linear")
    assert config.optimizer.kwargs["weight_decay"] == 0.0  # adam's own default, not adamw's
    assert (config.lr, config.dtype, config.grad_clip, config.init) == (DEFAULTS.lr, "float32", None, "auto")
    assert TrainingConfig.from_spec({}) == DEFAULTS


@pytest.mark.parametrize("field, value, match", [
    ("lr", "fast", r"plan\.spec\.lr: expected a number, got 'fast'"),
    ("lr", 0, r"plan\.spec\.lr: expected a number > 0"),
    ("steps", 0, r"plan\.spec\.steps: expected an integer >= 1, got 0"),
    ("seed", 1.5, r"plan\.spec\.seed: expected an integer"),
    ("optimizer", "adamw", r"plan\.spec\.optimizer: expected an object"),
    ("optimizer", {"name": "lamb"}, r"plan\.spec\.optimizer\.name: expected one of 'adamw', 'adam', 'sgd'"),
    ("optimizer", {"name": "adamw", "momentum": 0.9}, r"plan\.spec\.optimizer\.momentum: adamw takes no setting"),
    ("optimizer", {"name": "adamw", "betas": [0.9]}, r"plan\.spec\.optimizer\.betas: expected two numbers"),
    ("optimizer", {"name": "sgd", "nesterov": "yes"}, r"plan\.spec\.optimizer\.nesterov: expected true or false"),
    ("lr_schedule", {"name": "step"}, r"plan\.spec\.lr_schedule\.name: expected one of"),
    ("lr_schedule", {"name": "cosine", "warmup": -1}, r"plan\.spec\.lr_schedule\.warmup"),
    ("grad_clip", -1.0, r"plan\.spec\.grad_clip: expected a number"),
    ("dtype", "float8", r"plan\.spec\.dtype: expected one of 'float32', 'bfloat16', 'float16'"),
    ("recompute", [0, -1], r"plan\.spec\.recompute\[1\]"),
    ("checkpoint_every", -1, r"plan\.spec\.checkpoint_every"),
    ("checkpoint_dir", 3, r"plan\.spec\.checkpoint_dir: expected a string"),
    ("init", "zeros", r"plan\.spec\.init: expected one of 'auto', 'module', 'exact'"),
])
def test_a_malformed_field_is_refused_naming_it(field, value, match):
    with pytest.raises(SchemaError, match=match) as err:
        TrainingConfig.from_spec({**DEFAULTS.to_json(), field: value})
    assert err.value.exit_code == 2


def test_the_lr_schedule_warms_up_then_decays_to_min_lr():
    config = TrainingConfig(lr=1.0, lr_schedule=LRSchedule("cosine", warmup=2, min_lr=0.1))
    lrs = [config.lr_at(step, 6) for step in range(6)]
    assert lrs[:3] == [0.5, 1.0, 1.0] and lrs[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:]))
    linear = TrainingConfig(lr=2.0, lr_schedule=LRSchedule("linear"))
    assert [linear.lr_at(s, 3) for s in range(3)] == [2.0, 1.0, 0.0]
    assert {DEFAULTS.lr_at(s, 4) for s in range(4)} == {DEFAULTS.lr}


# ----------------------------------------------------------------------------- run options


def options(*argv: str) -> RunOptions:
    return RunOptions.from_args(run_parser().parse_args(["p.json", *argv]))


def test_run_options_parse_once_and_write_back_as_the_ranks_flags():
    opts = options("--steps", "4", "--check", "--fail-at", "2:1", "--timeout", "60", "--keep-checkpoints", "2",
                   "--sync-checkpoints", "--quiet")
    assert opts.fail_at == (2, 1) and opts.steps == 4 and opts.timeout == 60.0 and opts.check and not opts.emulate
    assert options(*opts.flags()) == opts
    assert options().flags() == []  # every option at its default: nothing to pass on
    assert options().num_steps(DEFAULTS) == DEFAULTS.steps and opts.num_steps(DEFAULTS) == 4


@pytest.mark.parametrize("argv, match", [
    (("--fail-at", "2"), r"--fail-at '2': expected STEP:RANK"),
    (("--steps", "0"), "--steps must be at least 1, got 0"),
    (("--timeout", "0"), "--timeout must be positive"),
    (("--check", "--emulate"), "cannot be combined with --emulate"),
    (("--resume", "ckpt", "--emulate"), "--emulate trains nothing"),
])
def test_run_options_that_cannot_hold_are_refused(argv, match):
    with pytest.raises(LaunchError, match=match):
        options(*argv)
