"""Megatron's sequence parallelism (key ``sequence_parallel``): the regions between a rowwise module and the next
colwise one cut on the sequence dim. Pass level on tp threads (outputs and every gradient against the unsharded
stages, the sequence-parallel weights' partial gradients summed over the tp ranks), its record and refusals."""

from __future__ import annotations

import math
import os
import threading

import pytest
import torch
from torch import nn

from pipec.compiler.frontend import Partition
from pipec.tp import plan_stage, plan_stages, shard_stage, unshard
from pipec.model.tensors import FrontendError
from pipec.tp.comm import ThreadGroupTP, TPComm
from pipec.compiler.ir.tensor_parallel import StageTP
from pipec.runtime.stages import run_stages
from test_tensor_parallel import GPT, GPT_ARGS, _close, _request, _stages, _xent, _xent_parallel
from test_tensor_parallel import run_tp as run_sp
from model_requests import changed, model_request

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def assert_sp_matches(stages, plans, tp: int, inputs: dict, loss=_xent) -> None:
    """Outputs and every gradient equal the unsharded stages' (within 1e-6 + 1e-4 x max): sharded parameters'
    parts put together, sequence-parallel ones' partial gradients summed over the tp ranks (what the runtime
    all-reduces before the optimizer step), the other replicated ones equal on every rank."""
    outs, ranks = run_sp(stages, plans, tp, inputs, loss)
    for st in stages.values():
        st.zero_grad(set_to_none=True)
    want = run_stages(stages, inputs)
    loss(want[0]).backward()
    parallel = plans[max(stages)].loss_parallel  # each rank's part of the logits
    for r in range(tp):
        for g, w in zip(outs[r], want):
            _close(g.detach(), w.detach().chunk(tp, dim=-1)[r] if parallel else w.detach(), f"rank {r} output")
    checked = 0
    for s, st in stages.items():
        local = [ranks[r][s].canonical_params() for r in range(tp)]
        for name, p in st.canonical_params().items():
            grads = [local[r][name].grad for r in range(tp)]
            assert all(g is not None for g in grads), (s, name)
            if (sp := plans[s].sharded(name)) is not None:
                _close(unshard(grads, sp), p.grad, f"stage {s} {name}")
            elif name in plans[s].partial_params:
                _close(torch.stack(grads).sum(0), p.grad, f"stage {s} {name} (summed)")
                assert not torch.allclose(grads[0], p.grad), f"stage {s} {name}: not a partial sum"
            else:
                for r in range(tp):
                    _close(grads[r], p.grad, f"stage {s} {name} rank {r}")
            checked += 1
    assert checked == sum(len(st.canonical_params()) for st in stages.values())


def _tokens(batch: int = 2, seq: int = 16) -> dict:
    return {"tokens": torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(0))}


@pytest.fixture(scope="module")
def gpt():
    return _stages(_request(GPT, GPT_ARGS, partition=Partition("split", split_before=("blocks.1",))))


# ----------------------------------------------------------------------------- the example GPT


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_sequence_parallel_matches_the_unsharded_stages(gpt, tp):
    plans = plan_stages([gpt[0], gpt[1]], tp, sequence_parallel=True)
    assert all(p.sequence_parallel and p.seq_len == 16 for p in plans)
    # stage 0's last residual travels as each tp rank's part; the last stage's logits are split on the vocabulary
    (out_name,) = gpt[0].output_names
    assert plans[0].seq_outputs == ((out_name, 1),) and plans[1].seq_inputs == ((out_name, 1),)
    assert plans[1].seq_outputs == () and plans[1].loss_parallel
    # the norms and the rowwise biases in the sequence-parallel region (from the vocab-parallel embedding's
    # reduce-scatter on): partial gradients; the positions' embedding is cut to each rank's positions, whole
    assert set(plans[0].partial_params) == {"blocks.0.ln1.weight", "blocks.0.ln1.bias", "blocks.0.attn.proj.bias",
                                            "blocks.0.ln2.weight", "blocks.0.ln2.bias", "blocks.0.mlp.proj.bias"}
    assert ("reduce_scatter", "forward", "wte") in {(c.kind, c.phase, c.node) for c in plans[0].collectives}
    assert {"ln_f.weight", "blocks.1.ln1.weight", "blocks.1.attn.proj.bias"} <= set(plans[1].partial_params)
    assert "wte.weight" not in plans[1].partial_params  # the tied head runs on the gathered sequence
    kinds = {(c.kind, c.phase) for p in plans for c in p.collectives if c.node != "loss"}
    assert ("reduce_scatter", "forward") in kinds and ("all_gather", "forward") in kinds
    # the colwise modules after the first residual get an all-gather in place of f
    assert ("all_reduce", "forward") not in kinds
    assert_sp_matches(gpt, plans, tp, _tokens())


def test_sequence_parallel_off_is_todays_record(gpt):
    off = plan_stages([gpt[0], gpt[1]], 2)
    assert not any(p.sequence_parallel or p.partial_params or p.seq_outputs for p in off)
    assert "sequence_parallel" not in off[0].to_json()


def test_the_record_round_trips_and_old_records_read_as_off(gpt):
    plans = plan_stages([gpt[0], gpt[1]], 2, sequence_parallel=True)
    for p in plans:
        assert StageTP.from_json(p.to_json()) == p
    old = {k: v for k, v in plans[0].to_json().items() if k != "sequence_parallel"}
    assert not StageTP.from_json(old).sequence_parallel


def test_the_sharded_stage_holds_the_sequence_part(gpt):
    """Stage 0's output on each rank is its contiguous part of the positions (run alone: no group)."""
    plans = plan_stages([gpt[0], gpt[1]], 2, sequence_parallel=True)
    x = _tokens()
    full = gpt[0](x["tokens"])[0]
    group = ThreadGroupTP(2)
    got: list = [None, None]

    def work(r):
        mod = shard_stage(gpt[0], plans[0], r, tp=2, group=group.rank(r))
        got[r] = mod(x["tokens"])[0].detach()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(2):
        assert got[r].shape == (2, 8, 32)
        _close(got[r], full.detach().chunk(2, dim=1)[r], f"rank {r}")


def _saved_shapes(stages, plans, tp: int, inputs: dict) -> list[tuple[int, ...]]:
    """The shapes of every tensor tp rank 0's stages save for their backward (not the parameters, nor views of
    them)."""
    group = ThreadGroupTP(tp)
    ranks = [{s: shard_stage(st, plans[s], r, tp=tp, group=group.rank(r)) for s, st in stages.items()}
             for r in range(tp)]
    params = {p.untyped_storage().data_ptr() for r in ranks for st in r.values() for p in st.parameters()}
    shapes: list = []

    def work(r):
        def pack(t):
            if r == 0 and t.untyped_storage().data_ptr() not in params and t.is_floating_point():
                shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run_stages(ranks[r], inputs)
        (_xent_parallel(group.rank(r), r, tp) if plans[max(stages)].loss_parallel else _xent)(out[0]).backward()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return shapes


def test_the_sequence_parallel_region_saves_its_part(gpt):
    """Stage 1 (block 1, ln_f, the loss-parallel head) saves no whole [B, T, C] activation: the norms' inputs and
    the colwise Linears' inputs (the head's too) are saved as this rank's part of the sequence (the Linears
    gather it again in the backward)."""
    whole, part = {(2, 16, 32), (32, 32)}, (2, 8, 32)  # [B, T, C], or flattened [B T, C] by a Linear
    off = _saved_shapes({1: gpt[1]}, {1: plan_stages([gpt[0], gpt[1]], 2)[1]}, 2, _sp_input(gpt))
    on = _saved_shapes({1: gpt[1]}, {1: plan_stages([gpt[0], gpt[1]], 2, sequence_parallel=True)[1]}, 2,
                       _sp_input(gpt, part=True))
    assert sum(s in whole for s in off) == 6 and off.count(part) == 0, off  # 3 norms' inputs, 3 Linears'
    assert sum(s in whole for s in on) == 0 and on.count(part) == 6, on
    saved = {name: sum(math.prod(s) * 4 for s in shapes) for name, shapes in (("off", off), ("on", on))}
    print(f"stage 1, tp rank 0, saved bytes per microbatch: sequence_parallel off {saved['off']}, on {saved['on']}")


def _sp_input(gpt, part: bool = False) -> dict:
    """Stage 1's input (stage 0's output on the example tokens): whole, or rank 0's part of the sequence
    (the same for both ranks: shapes are what is measured)."""
    x = gpt[0](_tokens()["tokens"])[0].detach()
    (name,) = gpt[1].input_names
    return {name: x.chunk(2, dim=1)[0].contiguous() if part else x}


# ----------------------------------------------------------------------------- refusals


class _AfterFirstBlock(nn.Module):
    """The small GPT with something of the subclass's own (:meth:`after`) on the residual stream after its first
    block."""

    def __init__(self) -> None:
        super().__init__()
        from pipec.examples.gpt import build

        self.gpt = build(**GPT_ARGS)

    def after(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        x = g.wte(tokens) + g.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        x = self.after(g.blocks[0](x))
        return g.lm_head(g.ln_f(x) * g.scale)


class _Mixer(_AfterFirstBlock):
    """A running mean over the positions, then the second block: an op that mixes positions outside attention."""

    def after(self, x: torch.Tensor) -> torch.Tensor:
        x = x.cumsum(dim=1) / 16.0
        return self.gpt.blocks[1](x)


def mixer() -> nn.Module:
    return _Mixer()


def test_an_op_mixing_positions_is_refused_located():
    from pipec.compiler.frontend import build_stage_graph

    req = changed(_request("test_sequence_parallel:mixer", stages=1), tp=2, sequence_parallel=True)
    with pytest.raises(FrontendError) as e:
        build_stage_graph(req)
    said = str(e.value)
    assert "cannot follow the sequence shard" in said and "cumsum runs along the sharded dimension" in said, said
    assert "test_sequence_parallel.py" in said and "x = x.cumsum(dim=1)" in said, said  # the user's line
    assert "sequence_parallel off" in " ".join(e.value.hints) and e.value.key == "sequence_parallel"
    assert build_stage_graph(changed(req, sequence_parallel=False))  # without it the pairs shard


class _Reuse(_AfterFirstBlock):
    """The first block's ln1 runs on the sequence parts in the block, and after it on the positions' embedding,
    whole on every rank (its gradient then whole: all-gathered where it meets the parts)."""

    def after(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gpt.blocks[0].ln1(self.gpt.wpe(torch.arange(x.shape[1], device=x.device)))


def reuse() -> nn.Module:
    return _Reuse()


def test_a_weight_used_whole_and_on_the_parts_is_refused():
    stages = _stages(_request("test_sequence_parallel:reuse", stages=1))
    with pytest.raises(FrontendError, match=r"parameter gpt\.blocks\.0\.ln1\.weight is used on the sequence shards and "
                                            r"replicated") as e:
        plan_stages([stages[0]], 2, sequence_parallel=True)
    assert "sequence_parallel off" in " ".join(e.value.hints)


def test_a_sequence_length_not_divisible_by_tp_is_refused():
    from pipec.compiler.frontend import TensorSpec

    req = model_request(target=GPT, kwargs=GPT_ARGS, inputs=(TensorSpec("tokens", "int64", (2, 10)),),
                        num_microbatches=1, num_stages=1, costs="unit")
    stages = _stages(req)
    with pytest.raises(FrontendError, match=r"sequence length 10 is not divisible by tp 4") as e:
        plan_stages([stages[0]], 4, sequence_parallel=True)
    assert "sequence_parallel off" in " ".join(e.value.hints)


# ----------------------------------------------------------------------------- the collectives


def test_split_and_gather_whole_are_each_others_gradients():
    """split: this rank's part forward, all-gather backward; gather_whole: all-gather forward, the part back."""
    full = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(3))
    group = ThreadGroupTP(2)
    got: list = [None, None]

    def work(r):
        split = TPComm("split", dim=1, size=2, rank=r)
        whole = TPComm("gather_whole", dim=1, size=2, rank=r)
        split.group = whole.group = group.rank(r)
        x = full.clone().requires_grad_()
        part = split(x)
        y = whole(part * 2.0)  # every rank: the whole 2x, its gradient whole on each rank
        (y * torch.arange(8.0).view(1, 8, 1)).sum().backward()
        got[r] = (part.detach(), y.detach(), x.grad)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want_grad = (2.0 * torch.arange(8.0)).view(1, 8, 1).expand(2, 8, 4)
    for r in range(2):
        assert torch.equal(got[r][0], full.chunk(2, dim=1)[r]) and torch.allclose(got[r][1], 2 * full)
        assert torch.allclose(got[r][2], want_grad)
    # alone (no group): one rank's shapes
    assert TPComm("gather", dim=1, size=2)(torch.zeros(2, 4, 3)).shape == (2, 8, 3)
    assert TPComm("scatter", dim=1, size=2, rank=1)(torch.arange(8.0).view(1, 8)).tolist() == [[4, 5, 6, 7]]


# ----------------------------------------------------------------------------- Hugging Face Llama


@pytest.fixture(scope="module")
def llama():
    pytest.importorskip("transformers")
    return _stages(_request("test_hf:llama", name="input_ids", partition=Partition("split", split_before=("model.model.layers.1",))))


def test_hf_llama_sequence_parallel_matches(llama):
    plans = plan_stages([llama[0], llama[1]], 2, sequence_parallel=True)
    assert plans[0].seq_outputs and plans[1].seq_inputs == plans[0].seq_outputs
    assert any("post_attention_layernorm" in n for n in plans[0].partial_params)
    assert any(n.endswith("model.model.norm.weight") for n in plans[1].partial_params)
    ids = {"input_ids": torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))}
    assert_sp_matches(llama, plans, 2, ids)


def test_llamas_q_k_v_and_gate_up_gather_once_and_save_the_part(llama):
    """Llama's q, k, v (and its MLP's gate and up) read one sequence shard: one GatheredLinear each group, one
    all-gather, only this rank's part saved (no flattened whole [B T, C] input of theirs, as a gather shared by
    plain Linears would save once per Linear)."""
    plans = plan_stages([llama[0], llama[1]], 2, sequence_parallel=True)
    sharded = shard_stage(llama[0], plans[0], 0, tp=2)
    fused = [n for n in sharded.graph.nodes if n.op == "call_module"
             and getattr(sharded.get_submodule(str(n.target)), "kind", None) == "gather_linear"]
    assert sorted(len(n.args) - 1 for n in fused) == [4, 6], fused  # (gate, up), (q, k, v): weight and bias each
    assert not any(n.op == "call_module" and getattr(sharded.get_submodule(str(n.target)), "kind", None) == "gather"
                   for n in sharded.graph.nodes)
    ids = {"input_ids": torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))}
    saved = _saved_shapes({0: llama[0]}, {0: plans[0]}, 2, ids)
    # [B T, 32] once: the down projection's input (this rank's half of the intermediate 64), not the hidden 32's
    assert saved.count((2 * 16, 32)) == 1 and saved.count((2, 8, 32)) >= 4, saved


# ----------------------------------------------------------------------------- the key, plan.json, a run


def tiny_gpt_sp(schedule: str, *, pp: int = 2, dp: int = 1, tp: int = 2, sp: bool = True, **extra):
    """The example GPT, small (2 layers, dim 32, 4 heads, vocab 64, seq 16), unit costs, sequence parallel."""
    from conftest import compiled

    return compiled({
        "model": "pipec.examples.gpt:build", "model_args": {"layers": 2, "dim": 32, "heads": 4, "vocab": 64, "seq": 16},
        "input": "tokens: int64[8, 16]", "schedule": schedule, "pp": pp, "dp": dp, "tp": tp, "microbatches": 4,
        "costs": "unit", "partition": "balanced(by=params)", "sequence_parallel": sp, **extra,
    })


def test_the_key_reaches_the_plan_and_plan_json_round_trips(tmp_path):
    from pipec.compiler.ir.plan_json import plan_to_json, read_plan, write_plan

    plan = tiny_gpt_sp("1f1b")
    assert plan.mesh.sequence_parallel and all(st.tp.sequence_parallel for st in plan.stages)
    assert plan.stages[0].tp.seq_outputs and plan.stages[1].tp.seq_inputs == plan.stages[0].tp.seq_outputs
    obj = plan_to_json(plan)
    assert obj["mesh"]["sequence_parallel"] is True and "sequence_parallel" not in obj["spec"]
    path = tmp_path / "plan.json"
    write_plan(plan, str(path))
    again = read_plan(str(path))
    assert again.mesh.sequence_parallel and again.stages == plan.stages
    off = plan_to_json(tiny_gpt_sp("1f1b", sp=False))
    assert "sequence_parallel" not in off["mesh"] and "sequence_parallel" not in off["stages"][0]["tp"]


def test_the_key_parses_and_warns_at_tp_1():
    from pipec.dsl import DSLError, parse_spec

    base = 'schedule 1f1b\npp 2\nmicrobatches 4\n'
    spec = parse_spec(base + "tp 2\nsequence_parallel on\n")
    assert spec.values["sequence_parallel"] is True
    assert parse_spec(base).values["sequence_parallel"] is False
    warned = parse_spec(base + "sequence_parallel on\n")
    assert any("sequence_parallel is used only with tp > 1" in str(w) for w in warned.warnings)
    with pytest.raises(DSLError, match="sequence_parallel needs on or off"):
        parse_spec(base + "sequence_parallel 2\n")


def test_sequence_parallel_on_the_fake_transport_matches_the_reference():
    """pp 2 x tp 2 on threads through the executor: the pp message is each tp rank's half of the sequence, and
    every gradient (parts put together, partial ones summed as the trainer sums them) equals the reference's."""
    from conftest import on_threads

    from pipec.runtime.executor import Executor
    from pipec.runtime.stages import build_reference
    from pipec.runtime.training import split_microbatches

    from test_tp_mesh import fake_tp_world

    plan = tiny_gpt_sp("1f1b")
    mesh = plan.mesh
    world, data, loss_fn, keys, transports, modules, losses = fake_tp_world(plan)
    executors = {}

    def rank(p: int, d: int, t: int):
        ex = executors[(p, d, t)] = Executor(plan, pp_rank=p, dp_rank=d, tp_rank=t, transport=transports[(p, d, t)],
                                             modules=modules[(p, d, t)], loss_fn=losses[(p, d, t)])
        x, y = data(0, d, mesh.dp)
        return ex.run_step(split_microbatches(x, plan.num_microbatches, "x", ["tokens"]),
                           split_microbatches(y, plan.num_microbatches, "y"))

    results = on_threads(rank, keys)
    (edge,) = executors[(0, 0, 0)].edge_tensors.values()
    assert [t.shape for t in edge] == [(2, 8, 32)]  # a microbatch [2, 16, 32] cut in two on the sequence
    ref = build_reference(plan, seed=0)
    x, y = data(0, 0, 1)
    loss = loss_fn(ref(x["tokens"])[0], y)
    loss.backward()
    ref_grads = {n: p.grad for n, p in ref.canonical_params().items()}
    losses = [r.loss for r in results.values() if r.loss is not None]
    assert len(losses) == 2 and all(v == pytest.approx(loss.item(), rel=1e-5) for v in losses)
    for (p, d, t), mods in modules.items():
        for s, mod in mods.items():
            record = plan.stages[s].tp
            for name, param in mod.canonical_params().items():
                parts = [modules[(p, d, u)][s].canonical_params()[name].grad for u in range(mesh.tp)]
                if (split := record.sharded(name)) is not None:
                    grad = unshard(parts, split)
                elif name in record.partial_params:
                    grad = sum(parts)
                else:
                    grad = param.grad
                _close(grad, ref_grads[name], name)


def _sp_runs(names):
    """pp 2 x tp 2 (4 ranks) of the small GPT with sequence parallelism, with --check: ``1f1b``, ``zb_h1``,
    ``recompute`` (1f1b with every stage recomputed: it replays its collectives in the backward) and ``off`` (1f1b
    at sequence_parallel off: the activations it saves, for comparison)."""

    def make(folder):
        from conftest import run_job

        from pipec.compiler.ir.plan_json import write_plan

        plans = {"1f1b": lambda: tiny_gpt_sp("1f1b"), "zb_h1": lambda: tiny_gpt_sp("zb_h1"),
                 "recompute": lambda: tiny_gpt_sp("1f1b", recompute="all"), "off": lambda: tiny_gpt_sp("1f1b", sp=False)}
        jobs = {}
        for name in names:
            path = folder / f"{name}.json"
            write_plan(plans[name](), str(path))
            jobs[name] = run_job(path, "--steps", "3", "--check", reference=True)
        return jobs

    return make


from conftest import LAUNCHES  # noqa: E402 - the launches queue, declared at import

sp_runs = LAUNCHES.runs("sp_runs", world=4, make=_sp_runs(("1f1b", "off")))
sp_runs_slow = LAUNCHES.runs("sp_runs_slow", world=4, make=_sp_runs(("zb_h1", "recompute")))


def _assert_runs_check(runs: dict) -> None:
    for name, rec in runs.items():
        assert rec["rc"] == 0, (name, rec["stderr"][-4000:])
        check = rec["check"]
        assert check["passed"] and check["max_grad_diff"] < 1e-4 and check["loss_diff"] < 1e-5, (name, check)
        assert rec["losses"] == pytest.approx(rec["reference_losses"], rel=1e-4, abs=1e-5), name
        assert rec["report"]["mesh"]["tp"] == 2
        print(f"sequence_parallel {'off' if name == 'off' else 'on'} {name}: loss diff {check['loss_diff']:.2e}, "
              f"max grad diff {check['max_grad_diff']:.2e}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pp2_tp2_sequence_parallel_zero_bubble_and_recompute_check(sp_runs_slow):
    _assert_runs_check(sp_runs_slow)


@pytest.mark.timeout(600)
def test_pp2_tp2_sequence_parallel_runs_check_against_the_unpartitioned_model(sp_runs):
    _assert_runs_check(sp_runs)
    # the saved activations (measured in the first step): the sequence-parallel region's are held at 1/tp
    def saved(name):
        return {r["rank"]: r["peak_activation_bytes"] for r in sp_runs[name]["report"]["measured"]["per_rank"]}

    on, off = saved("1f1b"), saved("off")
    print("saved activations at their peak, per global rank, sequence_parallel on / off: "
          + ", ".join(f"rank {r} {on[r]} / {off[r]} B ({on[r] / off[r]:.2f})" for r in sorted(on)))
    assert all(on[r] < off[r] for r in on), (on, off)


def _sp_8_ranks(folder):
    """pp 2 x dp 2 x tp 2 (8 ranks) with sequence parallelism under shard full (FSDP2), with --check."""
    from conftest import run_job

    from pipec.compiler.ir.plan_json import write_plan

    path = folder / "full.json"
    write_plan(tiny_gpt_sp("1f1b", dp=2, shard="full"), str(path))
    return {"full": run_job(path, "--steps", "3", "--check", reference=True)}


sp_8_ranks = LAUNCHES.runs("sp_8_ranks", world=8, make=_sp_8_ranks)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pp2_dp2_tp2_shard_full_with_sequence_parallelism(sp_8_ranks):
    rec = sp_8_ranks["full"]
    assert rec["rc"] == 0, rec["stderr"][-4000:]
    check = rec["check"]
    assert check["passed"] and check["max_grad_diff"] < 1e-4, check
    assert {k: rec["report"]["mesh"][k] for k in ("pp", "dp", "tp")} == {"pp": 2, "dp": 2, "tp": 2}
    print(f"sequence_parallel on, pp 2 x dp 2 x tp 2 shard full: max grad diff {check['max_grad_diff']:.2e}")


# ----------------------------------------------------------------------------- Hugging Face GPT-2


def test_hf_gpt2_conv1d_on_the_flattened_batch_matches():
    """HF's Conv1D runs on ``x.view(-1, features)``: the rowwise output ``[B T, C]`` is B blocks of the
    positions, each cut into the tp parts; its reduce-scatter and the colwise inputs' all-gathers act per block."""
    pytest.importorskip("transformers")
    stages = _stages(_request("test_hf:wrapped_gpt2", name="input_ids", partition=Partition("split", split_before=("model.transformer.h.1",))))
    plans = plan_stages([stages[0], stages[1]], 2, sequence_parallel=True)
    assert plans[0].seq_outputs and plans[1].seq_inputs == plans[0].seq_outputs
    assert "model.transformer.h.0.ln_2.weight" in plans[0].partial_params
    code = shard_stage(stages[0], plans[0], 0, tp=2).code
    assert "tp_scatter_0_2" in code and "tp_gather_0_2" in code, code  # [2 x 16, 32]: 2 blocks on dim 0
    ids = {"input_ids": torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))}
    assert_sp_matches(stages, plans, 2, ids)


def test_a_collective_on_blocks_acts_on_each():
    full = torch.arange(2 * 8 * 3.0).view(16, 3)  # [B T, C] with B 2, T 8
    r1 = TPComm("scatter", dim=0, size=2, rank=1, segments=2)(full)  # alone: rank 1's positions of each block
    assert torch.equal(r1, torch.cat([full[4:8], full[12:16]]))
    assert TPComm("gather", dim=0, size=2, segments=2)(r1).shape == (16, 3)


def test_the_pp_message_is_each_tp_ranks_part_of_the_sequence_as_the_simulator_prices_it():
    """local_specs (compiler/ir/plan.py) gives what the executor sends and the simulator prices: at
    sequence_parallel on, half the sequence at tp 2; off, the whole."""
    from pipec.compiler.ir.plan import local_specs

    on, off = tiny_gpt_sp("1f1b"), tiny_gpt_sp("1f1b", sp=False)
    (edge,) = on.edges
    assert [t.shape for t in local_specs(on, 0, edge.tensors)] == [(2, 8, 32)]
    assert sum(t.num_bytes for t in local_specs(on, 0, edge.tensors)) * 2 == edge.num_bytes
    assert local_specs(off, 0, off.edges[0].tensors) == tuple(off.edges[0].tensors)
