"""Every check before any timing: a mistake in the model, the data or the memory budget of a ``costs profile``
compile is reported before the first stage is profiled or link probed.

The profile and the link probe are replaced by functions that raise :class:`Timed`: a test passes only if
pipec's own error comes first. A well-formed request reaches them (so the replacement is where timing
starts), and the memory the pre-check counts at unit costs is the memory of the timed plan.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipec.compiler.driver import compile_spec
from pipec.costs import costs as costs_pass
from pipec.costs import links
from pipec.dsl import load_spec
from pipec.errors import PipecError

GPT = {"model": "pipec.examples.gpt:build", "model_args": "layers=2, dim=16, heads=2, vocab=64, seq=16",
       "input": "tokens: int64[8, 16]", "pp": "2", "microbatches": "2", "costs": "profile"}
MLP = {"model": "pipec.examples.mlp:build", "model_args": "layers=4, dim=8", "input": "x: float32[8, 8]",
       "loss": "mse", "pp": "2", "microbatches": "2", "costs": "profile"}


class Timed(AssertionError):
    """Something was timed."""


@pytest.fixture()
def no_timing(monkeypatch):
    """Profiling a stage, timing a node or probing the links raises :class:`Timed`."""
    real = costs_pass.stage_costs

    def stage_costs(split, source, **kw):
        if source == "profile":
            raise Timed("the stages were profiled")
        return real(split, source, **kw)

    def timed(*args, **kw):
        raise Timed("timed")

    monkeypatch.setattr(costs_pass, "stage_costs", stage_costs)
    monkeypatch.setattr(costs_pass, "time_nodes", timed)
    monkeypatch.setattr(links, "measure_links", timed)


def compile_flags(flags):
    return compile_spec(load_spec(None, {k: v for k, v in flags.items() if v is not None}))


def test_a_well_formed_profile_compile_reaches_the_timing(no_timing):
    with pytest.raises(Timed):
        compile_flags(GPT)
    with pytest.raises(Timed):
        compile_flags({**MLP, "costs": "flops", "peak_flops": "1e12", "partition": "balanced(by=time)"})


def test_a_missing_token_file_is_reported_before_timing(no_timing, tmp_path):
    with pytest.raises(PipecError, match=r"data tokens: cannot read '.*nope\.bin'") as err:
        compile_flags({**GPT, "data": f'tokens("{tmp_path}/nope.bin")'})
    assert err.value.located and err.value.exit_code == 2


def test_the_data_checks_that_need_no_model_run_before_it_is_built(no_timing, monkeypatch, tmp_path):
    """A token file, a data function and a custom loss are checked before the model is found, built or traced
    (the time to such an error is about torch's import)."""
    import pipec.compiler.frontend as frontend

    def built(*args, **kw):
        raise AssertionError("the model was built")

    monkeypatch.setattr(frontend, "locate_model", built)
    with pytest.raises(PipecError, match=r"data tokens: cannot read"):
        compile_flags({**GPT, "data": f'tokens("{tmp_path}/nope.bin")'})
    with pytest.raises(PipecError, match=r"cannot find module 'nowhere_mod'"):
        compile_flags({**GPT, "data": "nowhere_mod:batches"})
    with pytest.raises(PipecError, match=r"cannot find module 'nowhere_mod'"):
        compile_flags({**GPT, "loss": "nowhere_mod:loss"})
    with pytest.raises(AssertionError, match="the model was built"):
        compile_flags(GPT)


def test_a_short_token_file_and_a_model_it_cannot_feed_are_reported_before_timing(no_timing, tmp_path):
    path = tmp_path / "short.bin"
    np.arange(40, dtype=np.uint16).tofile(path)
    with pytest.raises(PipecError, match=r"holds 40 tokens, 2 windows of seq \+ 1 = 17; one step reads 8"):
        compile_flags({**GPT, "data": f'tokens("{path}", dtype=uint16)'})
    with pytest.raises(PipecError, match=r"this model's inputs are x: float32\[8, 8\]"):
        compile_flags({**MLP, "data": f'tokens("{path}", dtype=uint16)'})


def test_a_loss_its_targets_do_not_fit_is_reported_before_timing(no_timing):
    with pytest.raises(PipecError, match=r"loss mse cannot take the model's output float32\[4, 8\] with the declared "
                                         r"targets float32\[4, 3\]") as err:
        compile_flags({**MLP, "targets": "y: float32[8, 3]"})
    assert err.value.located


def test_a_model_mistake_is_reported_before_timing(no_timing):
    with pytest.raises(PipecError, match="GPT needs dim divisible by heads"):
        compile_flags({**GPT, "model_args": "layers=2, dim=16, heads=3, vocab=64, seq=16"})
    with pytest.raises(PipecError, match="split before 'blocks.7'"):
        compile_flags({**GPT, "partition": "split before blocks.7"})
    with pytest.raises(PipecError, match="cannot cut the model into 40 stages"):
        compile_flags({**MLP, "costs": "flops", "peak_flops": "1e12", "partition": "balanced(by=time)", "pp": "40"})


def test_memory_over_device_memory_is_reported_before_timing(no_timing):
    with pytest.raises(PipecError, match=r"pp rank 0 needs .* at its peak but device_memory is") as err:
        compile_flags({**GPT, "device_memory": "64KiB"})
    assert err.value.located and "device_memory" in str(err.value)


def test_the_untimed_memory_check_counts_what_the_timed_plan_holds():
    """The peak memory a plan is refused on does not depend on its costs (its instruction order decides it):
    unit and flops costs of one cut, on several schedules and a sharded mesh, predict the same peaks."""
    for extra in ({"schedule": "1f1b", "microbatches": "4"}, {"schedule": "interleaved_1f1b", "virtual": "2",
                  "microbatches": "4"}, {"schedule": "zb_h1", "microbatches": "8"},
                  {"dp": "2", "shard": "full", "microbatches": "4"}):
        peaks = []
        for costs in ({"costs": "unit"}, {"costs": "flops", "peak_flops": "1e9"}):
            plan = compile_flags({**GPT, **extra, **costs, "partition": None}).plan
            peaks.append([r.peak_memory_bytes for r in plan.prediction.per_rank])
        assert peaks[0] == peaks[1] and all(peaks[0]), (extra, peaks)
