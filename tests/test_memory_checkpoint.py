"""Memory figures in messages: a figure below 0.01 GiB prints in MiB or KiB, never as ``0.00 GiB``."""

from __future__ import annotations

import pytest

from pipec.compiler.passes.memory import format_memory


def test_gib_at_and_above_a_hundredth():
    assert format_memory(80 * 2**30) == "80.00 GiB"
    assert format_memory(1.25 * 2**30) == "1.25 GiB"
    assert format_memory(0.01 * 2**30) == "0.01 GiB"


def test_mib_below_a_hundredth_of_a_gib():
    assert format_memory(3.5 * 2**20) == "3.50 MiB"
    assert format_memory(0.0099 * 2**30) == "10.14 MiB"


def test_kib_below_a_mib():
    assert format_memory(12 * 2**10) == "12.00 KiB"
    assert format_memory(2**20 - 2**10) == "1023.00 KiB"
    assert format_memory(100) == "0.10 KiB"
    assert format_memory(0) == "0.00 KiB"


def test_a_small_plans_refusal_prints_mib_not_zero_gib():
    from pipec.compiler.driver import compile_request
    from pipec.compiler.frontend import TensorSpec
    from pipec.compiler.ir.plan import Mesh
    from pipec.compiler.passes.memory import MemoryBudgetError, check_memory
    from pipec.compiler.request import CompileRequest, ModelSpec, Partition

    model = ModelSpec(target="pipec.examples.gpt:build", kwargs=dict(layers=4, dim=32, heads=2, vocab=64, seq=16),
                      inputs=(TensorSpec("tokens", "int64", (4, 16)),),
                      partition=Partition("split", split_before=("blocks.1", "blocks.2", "blocks.3")),
                      costs="unit", trace="auto")
    plan = compile_request(CompileRequest(schedule="zbv", mesh=Mesh(pp=2), num_chunks=2, num_microbatches=2,
                                          model=model)).plan
    peak = plan.prediction.per_rank[0].peak_memory_bytes
    assert peak < 0.01 * 2**30  # a few MiB: the case that printed "needs 0.00 GiB"
    with pytest.raises(MemoryBudgetError) as err:
        check_memory(plan, peak - 1)
    message = str(err.value)
    assert "0.00 GiB" not in message and "GiB" not in message
    assert f"needs {format_memory(peak)} at its peak but device_memory is {format_memory(peak - 1)}" in message
    assert format_memory(peak).endswith(("MiB", "KiB"))


def test_checkpoint_save_and_load_without_tp_are_the_local_shards_and_pipec_show_prints_them(cli, tmp_path):
    from pipec.compiler.ir.plan_json import read_plan
    from pipec.compiler.passes.memory import checkpoint_memory

    out = cli("compile", "--model", "pipec.examples.gpt:build", "--model-arg", "layers=2", "--model-arg", "dim=16",
              "--input", "tokens: int64[4, 16]", "--ranks", "2", "--dp", "2", "--shard", "full", "--costs", "unit",
              "-o", "p.json")
    assert out.returncode == 0, out.stderr
    plan = read_plan(tmp_path / "p.json")
    rows = checkpoint_memory(plan)
    for rank, row in enumerate(rows):
        # by hand: shard full over dp 2 holds half of each (dim-0 padded) parameter; float32 params 4 B, grads 4 B,
        # AdamW's two moments 8 B per held copy; a save stages params + moments, a load reads params + moments
        stages = [s for s in plan.stages if s.rank == rank]
        from pipec.compiler.passes.memory import padded_params
        copies = sum(padded_params(s, 2, 1) for s in stages) // 2
        assert row.save_device == 16 * copies
        assert row.save_staging == row.load_device == 12 * copies
    shown = cli("show", "p.json")
    assert shown.returncode == 0, shown.stderr
    peak = plan.prediction.per_rank[0].peak_memory_bytes
    assert (f"rank 0 checkpoint: save {format_memory(rows[0].save_device)} on the device + staging copy "
            f"{format_memory(rows[0].save_staging)} on the host; load {format_memory(rows[0].load_device)}; "
            f"training peak {format_memory(peak)}") in " ".join(shown.stdout.split())


def test_under_tp_a_checkpoint_holds_each_tp_parameter_and_its_moments_whole(cli, tmp_path):
    """As runtime/checkpoint.py's _tp_whole does today: every tp rank builds each sharded parameter and both AdamW
    moments whole (float32) to save them, and allocates them whole to load into."""
    import math

    from pipec.compiler.ir.plan_json import read_plan
    from pipec.compiler.passes.memory import breakdown, checkpoint_memory

    out = cli("compile", "--model", "pipec.examples.gpt:build", "--model-arg", "layers=2", "--model-arg", "dim=16",
              "--input", "tokens: int64[4, 16]", "--ranks", "1", "--tp", "2", "--costs", "unit", "-o", "t.json")
    assert out.returncode == 0, out.stderr
    plan = read_plan(tmp_path / "t.json")
    (row,), (m,) = checkpoint_memory(plan), breakdown(plan)
    sharded = {sp.name for st in plan.stages for sp in st.tp.params}
    assert sharded
    wholes = [math.prod(shape) for st in plan.stages for name, shape in zip(st.params, st.param_shapes)
              if name in sharded]
    assert row.tp_whole == 12 * sum(w - w // 2 for w in wholes)  # param 4 B + two moments 8 B, beyond its half
    assert row.load_device == m.params + m.optimizer + row.tp_whole
    assert row.save_device == m.state + row.tp_whole + 4 * max(wholes)  # and the largest one's gathered pieces
    shown = cli("show", "t.json")
    assert "tensor-parallel parameters and moments made whole on every tp rank" in " ".join(shown.stdout.split())
