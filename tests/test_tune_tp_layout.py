"""``pipec tune`` prices and writes tp plans by the compile's own tensor-parallel analysis (tune/tp_layout.py).

For every cut a search prices at tp > 1, tune's stage records (modules and their styles, sharded parameters,
collectives: the whole :class:`~pipec.compiler.ir.tensor_parallel.StageTP`) equal those ``pipec compile`` gives
the same candidate: for the example GPT (fused qkv, tied head, with and without sequence parallelism) and for
Hugging Face GPT-2 (Conv1D's ``[in, out]`` weights, fused c_attn), Llama (separate q/k/v with grouped-query
attention, SwiGLU's gate and up) and BERT (separate query/key/value, an encoder with a classifier), built from
transformers' config classes (no download; one process: transformers' import is slow). A cut the analysis
refuses at a tp is not built, as a compile refuses it; the plan ``pipec tune`` writes carries the records a
compile of its schedule file writes.
"""

from __future__ import annotations

import json

import pytest

from pipec.compiler.driver import compile_request
from pipec.dsl import load_spec
from pipec.errors import PipecError
from pipec.tune.search import _Graphs, tune
from pipec.tune.space import TuneError, TuneRequest, candidate_request, candidates, total_batch

SMALL_GPT = 'model "pipec.examples.gpt:build" (layers=4, dim=32, heads=2, vocab=64, seq=8)\ninput tokens: int64[4, 8]'
GPT2 = 'model "byom_models:gpt2" (layers=2, dim=32, heads=2, vocab=96, seq=16)\ninput input_ids: int64[4, 16]'
LLAMA = 'model "byom_models:llama" (layers=2, dim=32, heads=4, vocab=96, seq=16)\ninput input_ids: int64[4, 16]'
BERT = ('model "byom_models:bert_classifier" (layers=2, dim=32, heads=2, vocab=96, seq=16)\n'
        'input input_ids: int64[4, 16], attention_mask: int64[4, 16]')


def _treq(tmp_path, model: str, *, node: int = 2, devices: int = 4, extra: str = "",
          keep: frozenset[str] = frozenset()) -> TuneRequest:
    """A tune of ``model`` on ``devices`` in nodes of ``node`` (tp over the divisors of ``node``), FLOP costs."""
    path = tmp_path / "model.pipe"
    path.write_text(f"{model}\nschedule 1f1b\npp 2  dp 1  microbatches 2\ncosts flops  peak_flops 1TFLOP/s\n"
                    f"devices_per_node {node}\n{extra}\n")
    return TuneRequest(base=load_spec(str(path), {}).request, num_devices=devices, keep=keep)


def _tuned_and_compiled(treq: TuneRequest, *, most: int | None = None):
    """For each cut and tp > 1 the search prices (its first candidate): the candidate, tune's graph and the plan
    ``pipec compile`` makes of the candidate's request; at most ``most`` of them, the fewest stages first."""
    batch = total_batch(treq)
    graphs = _Graphs(treq, batch)
    firsts = {}
    for c in candidates(treq):
        if c.tp > 1:
            firsts.setdefault((graphs._keys(c)[1], c.tp), c)
    out = []
    for c in sorted(firsts.values(), key=lambda c: (c.num_stages, c.tp, c.sort_key()))[:most]:
        tuned = graphs.graph(c)
        if tuned is None:   # more stages than places to cut, or refused: the compile refuses it too
            with pytest.raises(PipecError):
                compile_request(candidate_request(treq, c, global_batch=batch))
            continue
        out.append((c, tuned, compile_request(candidate_request(treq, c, global_batch=batch)).plan))
    return graphs, out


def _assert_same_layouts(pairs) -> None:
    assert pairs, "no cut at tp > 1 was compared"
    for c, tuned, plan in pairs:
        assert [st.tp for st in tuned.stages] == [st.tp for st in plan.stages], c
        assert all(st.tp is not None for st in tuned.stages) and any(st.tp.modules for st in tuned.stages), c


def _styles(graph) -> dict[str, str]:
    return {m: style for st in graph.stages for m, style in st.tp.modules}


def _sharded(graph, name: str):
    return next(sp for st in graph.stages if (sp := st.tp.sharded(name)) is not None)


def test_example_gpt_every_cut_at_tp_2_is_the_compiles(tmp_path):
    graphs, pairs = _tuned_and_compiled(_treq(tmp_path, SMALL_GPT))
    _assert_same_layouts(pairs)
    assert {c.num_stages for c, _, _ in pairs} >= {1, 2}
    _, two, _ = next(p for p in pairs if p[0].num_stages == 2)
    styles = _styles(two)
    assert styles["blocks.0.attn.qkv"] == styles["blocks.0.mlp.fc"] == "colwise"
    assert styles["blocks.0.attn.proj"] == styles["blocks.0.mlp.proj"] == "rowwise"
    assert _sharded(two, "blocks.0.attn.qkv.weight").segments == 3
    first, last = (dict(st.tp.modules) for st in two.stages)   # the tied embedding and head: split on the vocabulary
    assert first["wte"] == "vocab" and last["lm_head"] == "colwise" and two.stages[1].tp.loss_parallel
    assert two.stages[0].tp.sharded("wte.weight") == two.stages[1].tp.sharded("wte.weight")   # tied: alike
    assert graphs.layouts.num_splits == len({key for key, _ in graphs.layouts.layouts})   # each cut split once


def test_example_gpt_with_sequence_parallelism_is_the_compiles(tmp_path):
    _, pairs = _tuned_and_compiled(_treq(tmp_path, SMALL_GPT, extra="sequence_parallel on"))
    _assert_same_layouts(pairs)
    two = next(tuned for c, tuned, _ in pairs if c.num_stages == 2)
    assert all(st.tp.sequence_parallel for st in two.stages)
    assert two.stages[0].tp.seq_outputs and two.stages[1].tp.seq_inputs   # the parts travel between the stages


def test_a_cut_the_analysis_refuses_is_not_built_and_the_reason_kept(tmp_path):
    treq = _treq(tmp_path, SMALL_GPT, node=4, keep=frozenset({"dp", "microbatches"}))   # tp 4 over 2 heads
    graphs, pairs = _tuned_and_compiled(treq)
    _assert_same_layouts([p for p in pairs if p[0].tp == 2])
    assert not any(c.tp == 4 for c, _, _ in pairs)
    assert 2 not in graphs.layouts.refusals and graphs.layouts.refusals[4].key == "tensor_parallel"
    assert "tp 4" in str(graphs.layouts.refusals[4])
    result = tune(treq)
    assert result.num_unbuildable > 0 and result.best.candidate.tp in (1, 2)
    with pytest.raises(TuneError, match="at tp 4: tensor parallelism") as err:   # only tp 4: why nothing is left
        tune(_treq(tmp_path, SMALL_GPT, node=4, extra="tp 4", keep=frozenset({"tp", "dp", "microbatches"})))
    assert "not divisible by tp 4" in str(err.value)


def test_tunes_written_plan_carries_the_records_a_compile_of_its_file_writes(cli, tmp_path):
    (tmp_path / "model.pipe").write_text(f"{SMALL_GPT}\nschedule 1f1b\npp 2  dp 1  tp 2  microbatches 2\n"
                                         "costs flops  peak_flops 1TFLOP/s\ndevices_per_node 2\n")
    tuned = cli("tune", "model.pipe", "--devices", "4", "--keep", "tp", "--pipe", "tuned.pipe", "-o", "tuned.json")
    assert tuned.returncode == 0, tuned.stderr
    compiled = cli("compile", "tuned.pipe", "-o", "compiled.json")
    assert compiled.returncode == 0, compiled.stderr
    written, again = (json.loads((tmp_path / f).read_text()) for f in ("tuned.json", "compiled.json"))
    assert written["mesh"]["tp"] == 2
    records = [st["tp"] for st in written["stages"]]
    assert all(r and r["modules"] for r in records)
    assert records == [st["tp"] for st in again["stages"]]


# ----------------------------------------------------------------------------- Hugging Face models


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'transformers>=5,<6')")


def test_hf_gpt2_conv1d_layout_is_the_compiles(hf, tmp_path):
    _, pairs = _tuned_and_compiled(_treq(tmp_path, GPT2, keep=frozenset({"dp", "microbatches"})), most=2)
    _assert_same_layouts(pairs)
    graph = pairs[0][1]
    styles = _styles(graph)
    for b in range(2):
        at = f"model.transformer.h.{b}"
        assert styles[f"{at}.attn.c_attn"] == styles[f"{at}.mlp.c_fc"] == "colwise"
        assert styles[f"{at}.attn.c_proj"] == styles[f"{at}.mlp.c_proj"] == "rowwise"
    qkv = _sharded(graph, "model.transformer.h.0.attn.c_attn.weight")
    assert (qkv.dim, qkv.segments) == (1, 3)   # Conv1D's weight is [in, out]: colwise cuts dim 1, in q|k|v
    assert _sharded(graph, "model.transformer.h.0.mlp.c_proj.weight").dim == 0


def test_hf_llama_gqa_and_swiglu_layout_is_the_compiles(hf, tmp_path):
    graphs, pairs = _tuned_and_compiled(_treq(tmp_path, LLAMA, node=4, keep=frozenset({"dp", "microbatches"})),
                                        most=3)
    _assert_same_layouts(pairs)
    graph = next(tuned for c, tuned, _ in pairs if c.tp == 2)
    styles = _styles(graph)   # layer 0 is whole in stage 0 (the cut may fall inside layer 1: it stays whole there)
    at = "model.model.layers.0"
    for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert styles[f"{at}.{m}"] == "colwise", m
    assert styles[f"{at}.self_attn.o_proj"] == styles[f"{at}.mlp.down_proj"] == "rowwise"
    # 4 heads, 2 kv heads: tp 4 would split a kv head, which the compile refuses and tune does not build
    assert "grouped-query attention has 2 kv heads, fewer than tp 4" in str(graphs.layouts.refusals[4])
    assert not any(c.tp == 4 for c, _, _ in pairs)


def test_hf_bert_encoder_layout_is_the_compiles(hf, tmp_path):
    _, pairs = _tuned_and_compiled(_treq(tmp_path, BERT, keep=frozenset({"dp", "microbatches"})), most=2)
    _assert_same_layouts(pairs)
    styles = _styles(pairs[0][1])
    at = "model.bert.encoder.layer.0"
    for m in ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"):
        assert styles[f"{at}.{m}"] == "colwise", m
    assert styles[f"{at}.attention.output.dense"] == styles[f"{at}.output.dense"] == "rowwise"


HAND_LLAMA = 'model "family_models:hand_llama" (layers=2)\ninput tokens: int64[4, 16]'


def test_a_cut_kept_out_of_a_tp_pair_is_the_compiles_and_not_the_tp_1_cut(tmp_path):
    """The hand-written Llama's balanced cut at tp 1 falls inside an attention; tune prices its tp 2
    candidates on the cut a compile makes at tp 2 (between the pairs), every layer split, not on the tp 1 cut."""
    graphs, pairs = _tuned_and_compiled(_treq(tmp_path, HAND_LLAMA))
    _assert_same_layouts(pairs)
    c, two, plan = next(p for p in pairs if p[0].num_stages == 2)
    assert [st.nodes for st in two.stages] == [st.nodes for st in plan.stages]
    assert "replicated" not in _styles(two).values()
    at_tp1 = graphs.graph(next(x for x in candidates(graphs.treq) if x.tp == 1 and x.num_stages == 2))
    assert [st.nodes for st in at_tp1.stages] != [st.nodes for st in two.stages]
