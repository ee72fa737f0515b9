"""The tensor-parallel sharding pass: which modules it shards, the sharded stages run by tp threads against the
unsharded ones (outputs and every gradient), and its located refusals."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.nn.functional as F

from pipec.compiler.frontend import Partition, TensorSpec, build_stage_graph, trace_request
from pipec.compiler.request import CompileRequest
from pipec.tp import plan_stage, plan_stages, shard_param, shard_stage, unshard
from pipec.model.tensors import FrontendError
from pipec.tp.comm import ProcessGroupTP, ThreadGroupTP, TPComm, vocab_parallel_cross_entropy
from pipec.compiler.ir.tensor_parallel import ShardedParam
from pipec.runtime.stages import build_stages, run_stages
from test_frontend import plan_of
from model_requests import model_request

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GPT = "pipec.examples.gpt:build"
GPT_ARGS = dict(layers=2, dim=32, heads=4, vocab=64, seq=16)


def _request(target, kwargs=None, name="tokens", stages=2, partition=Partition("auto")) -> CompileRequest:
    return model_request(target=target, kwargs=kwargs or {}, inputs=(TensorSpec(name, "int64", (2, 16)),),
                         num_microbatches=1, num_stages=stages, costs="unit", partition=partition)


def _stages(req: CompileRequest):
    plan = plan_of(build_stage_graph(req))
    return build_stages(plan, range(plan.num_stages), seed=3)


def _xent(logits: torch.Tensor) -> torch.Tensor:
    targets = torch.arange(logits.shape[0] * logits.shape[1]).remainder(logits.shape[-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    tol = 1e-6 + 1e-4 * want.abs().max().item()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert (got - want).abs().max().item() <= tol, (what, (got - want).abs().max().item(), tol)


def _xent_parallel(group, r: int, tp: int):
    """:func:`_xent` on tp rank ``r``'s part of the logits (a loss-parallel last stage)."""
    def loss(logits: torch.Tensor) -> torch.Tensor:
        targets = torch.arange(logits.shape[0] * logits.shape[1]).remainder(logits.shape[-1] * tp)
        return vocab_parallel_cross_entropy(logits, targets, group, rank=r, size=tp)
    return loss


def _threads(tp, work, group=None):
    """``work(r)`` for every tp rank on a thread; the first error raised (``group``'s barrier aborted so that
    the other ranks do not wait for the one that failed)."""
    errors: list = []

    def run(r):
        try:
            work(r)
        except BaseException as e:  # noqa: BLE001 - reported by the test's thread
            errors.append(e)
            if group is not None:
                group._barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def run_tp(stages, plans, tp: int, inputs: dict, loss=_xent):
    """Each tp rank's sharded stages run on a thread: its outputs, and its stages. A loss-parallel last stage
    takes :func:`_xent` on its part of the logits."""
    group = ThreadGroupTP(tp)
    ranks = [{s: shard_stage(st, plans[s], r, tp=tp, group=group.rank(r)) for s, st in stages.items()}
             for r in range(tp)]
    outs: list = [None] * tp
    parallel = plans[max(stages)].loss_parallel
    assert loss is _xent or not parallel, "a loss-parallel plan runs _xent on the parts"

    def work(r: int) -> None:
        out = run_stages(ranks[r], inputs)
        (_xent_parallel(group.rank(r), r, tp) if parallel else loss)(out[0]).backward()
        outs[r] = out

    _threads(tp, work, group)
    return outs, ranks


def assert_tp_matches(stages, plans, tp: int, name: str, *, x: torch.Tensor | None = None, loss=None) -> None:
    """The stages sharded for ``tp`` ranks, run as threads, give the unsharded stages' outputs and gradients."""
    gen = torch.Generator().manual_seed(0)
    inputs = {name: torch.randint(0, 64, (2, 16), generator=gen) if x is None else x}
    _loss = loss or _xent
    outs, ranks = run_tp(stages, plans, tp, inputs, _loss)
    for st in stages.values():
        st.zero_grad(set_to_none=True)
    want = run_stages(stages, inputs)
    _loss(want[0]).backward()
    parallel = plans[max(stages)].loss_parallel
    for r in range(tp):
        for g, w in zip(outs[r], want):
            _close(g.detach(), w.detach().chunk(tp, dim=-1)[r] if parallel else w.detach(), f"rank {r} output")
    for s, st in stages.items():
        full = st.canonical_params()
        local = [ranks[r][s].canonical_params() for r in range(tp)]
        for cname, p in full.items():
            sp = plans[s].sharded(cname)
            if sp is not None:
                assert local[0][cname].shape[sp.dim] == p.shape[sp.dim] // tp, cname
                _close(unshard([local[r][cname].grad for r in range(tp)], sp), p.grad, f"stage {s} {cname}")
            else:
                for r in range(tp):
                    assert local[r][cname] is not p and local[r][cname].grad is not None, cname
                    _close(local[r][cname].grad, p.grad, f"stage {s} {cname} rank {r}")


def _styles(plan) -> dict[str, str]:
    return dict(plan.modules)


def _auto(stages, tp: int = 2):
    """Each stage's plan under tensor_parallel auto, and every module's style across them."""
    plans = plan_stages([stages[s] for s in range(len(stages))], tp)
    return plans, {m: style for p in plans for m, style in p.modules}


# ----------------------------------------------------------------------------- the models


@pytest.fixture(scope="module")
def gpt():
    return _stages(_request(GPT, GPT_ARGS, partition=Partition("split", split_before=("blocks.1",))))


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_auto_finds_megatron_pairs_and_matches(gpt, tp):
    plans, styles = _auto(gpt, tp)
    for b in range(2):
        assert styles[f"blocks.{b}.attn.qkv"] == "colwise" and styles[f"blocks.{b}.attn.proj"] == "rowwise"
        assert styles[f"blocks.{b}.mlp.fc"] == "colwise" and styles[f"blocks.{b}.mlp.proj"] == "rowwise"
    # Megatron's vocab parallelism: the token embedding's rows split, the LM head (tied to it) colwise and the
    # loss computed on the logits' parts; the positions' embedding (an arange) stays whole
    assert styles["wte"] == "vocab" and styles["lm_head"] == "colwise" and styles["wpe"] == "replicated"
    assert plans[1].loss_parallel and not plans[0].loss_parallel
    assert plans[0].sharded("blocks.0.attn.qkv.weight") == ShardedParam(name="blocks.0.attn.qkv.weight", dim=0, segments=3)
    assert plans[0].sharded("blocks.0.attn.proj.weight").dim == 1 and plans[0].sharded("blocks.0.attn.proj.bias") is None
    assert plans[0].sharded("wte.weight") == plans[1].sharded("wte.weight") == ShardedParam(name="wte.weight", dim=0)
    assert [(c.kind, c.phase, c.node) for c in plans[0].collectives] == [
        ("all_reduce", "forward", "wte"), ("all_reduce", "backward", "blocks_0_ln1"),
        ("all_reduce", "forward", "blocks_0_attn_proj"), ("all_reduce", "backward", "blocks_0_ln2"),
        ("all_reduce", "forward", "blocks_0_mlp_proj")]
    assert plans[0].collectives[0].num_bytes == 2 * 16 * 32 * 4
    loss = [(c.kind, c.num_bytes) for c in plans[1].collectives if c.node == "loss"]
    assert loss == [("all_gather", 2 * 16 * 4 * tp), ("all_reduce", 2 * 16 * 4), ("all_reduce", 2 * 16 * 4)]
    assert plans[0].sharded_flops == 1.0 and plans[1].sharded_flops == 1.0
    assert_tp_matches(gpt, plans, tp, "tokens")


def test_gpt_head_with_a_custom_loss_stays_whole(gpt):
    plans, styles = _auto(gpt, 2)
    custom = plan_stages([gpt[0], gpt[1]], 2, loss="mypkg.losses:focal")
    assert not custom[1].loss_parallel and dict(custom[1].modules)["lm_head"] == "replicated"
    # its weight is tied to wte, so wte stays whole too (the copies are sharded alike)
    assert dict(custom[0].modules)["wte"] == "replicated" and custom[0].sharded("wte.weight") is None
    assert custom[0].collectives == plans[0].collectives[1:]


def test_gpt_rewrite_uses_local_sizes(gpt):
    plan = plan_stage(gpt[0], 2)
    local = shard_stage(gpt[0], plan, 1, tp=2)  # no group: one rank's shapes alone
    code = local.code
    assert ".split(16, dim = 2)" in code and ".view(2, 16, 2, 8)" in code and ".reshape(2, 16, 16)" in code
    assert "tp_reduce" in code and "tp_copy" in code
    assert local.canonical_params()["blocks.0.attn.qkv.weight"].shape == (48, 32)
    out = local(torch.zeros(2, 16, dtype=torch.int64))
    assert out[0].shape == (2, 16, 32)


def test_plans_from_the_split_graph_on_meta_equal_the_built_stages(gpt):
    from torch.fx import GraphModule

    from pipec.model.partition import split_graph
    from pipec.model.trace import compute_nodes, is_pipe_split

    traced = trace_request(_request(GPT, GPT_ARGS)).traced
    nodes = [n for n in compute_nodes(traced.gm) if not is_pipe_split(n)]
    first = next(i for i, n in enumerate(nodes) if n.name.startswith("blocks_1"))
    split = split_graph(traced, {n.name: int(i >= first) for i, n in enumerate(nodes)}, 2)
    metas = [GraphModule(traced.gm, split.stage_graph(s)) for s in range(2)]
    assert plan_stages(metas, 2, canonical=traced.canonical, traced=traced) == _auto(gpt, 2)[0]


def test_gpt_explicit_patterns(gpt):
    patterns = {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise"}
    plans = plan_stages([gpt[0], gpt[1]], 2, patterns=patterns)
    assert _styles(plans[0])["blocks.0.mlp.fc"] == "replicated" and _styles(plans[1])["blocks.1.attn.qkv"] == "colwise"
    assert_tp_matches(gpt, plans, 2, "tokens")


def hf_stages(target: str, before: str):
    """A Hugging Face model's two stages (split before module ``before``), skipped without transformers."""
    pytest.importorskip("transformers")
    return _stages(_request(target, name="input_ids", partition=Partition("split", split_before=(before,))))


@pytest.fixture(scope="module")
def gpt2():
    return hf_stages("test_hf:wrapped_gpt2", "model.transformer.h.1")


def test_hf_gpt2_conv1d_fused_c_attn(gpt2):
    plans, styles = _auto(gpt2)
    for b in range(2):
        assert styles[f"model.transformer.h.{b}.attn.c_attn"] == "colwise"
        assert styles[f"model.transformer.h.{b}.attn.c_proj"] == "rowwise"
        assert styles[f"model.transformer.h.{b}.mlp.c_fc"] == "colwise"
        assert styles[f"model.transformer.h.{b}.mlp.c_proj"] == "rowwise"
    # the LM head is tied to wte: both split on the vocabulary, the loss computed on the parts
    assert styles["model.lm_head"] == "colwise" and styles["model.transformer.wte"] == "vocab" and plans[1].loss_parallel
    # Conv1D's weight is [in, out]: colwise cuts dim 1 (three segments: q|k|v), rowwise dim 0
    assert plans[0].sharded("model.transformer.h.0.attn.c_attn.weight").dim == 1
    assert plans[0].sharded("model.transformer.h.0.attn.c_attn.weight").segments == 3
    assert plans[0].sharded("model.transformer.h.0.mlp.c_proj.weight").dim == 0
    assert_tp_matches(gpt2, plans, 2, "input_ids")


@pytest.fixture(scope="module")
def llama():
    return hf_stages("test_hf:llama", "model.model.layers.1")


def test_hf_llama_gqa_rotary_rmsnorm(llama):
    plans, styles = _auto(llama)  # 4 heads, 2 kv heads: one kv head per rank
    for b in range(2):
        at = f"model.model.layers.{b}"
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert styles[f"{at}.{m}"] == "colwise", m
        assert styles[f"{at}.self_attn.o_proj"] == "rowwise" and styles[f"{at}.mlp.down_proj"] == "rowwise"
    assert styles["model.lm_head"] == "colwise" and styles["model.model.embed_tokens"] == "vocab"
    assert_tp_matches(llama, plans, 2, "input_ids")


def test_hf_llama_fewer_kv_heads_than_tp_is_refused(llama):
    with pytest.raises(FrontendError, match="grouped-query attention has 2 kv heads, fewer than tp 4") as e:
        plan_stage(llama[0], 4)
    assert e.value.key == "tensor_parallel" and "modeling_llama.py" in str(e.value)  # the user's source line


def test_torch_transformer_encoder_layer_fused_in_proj():
    req = model_request(target="test_frontend_real:encoder", kwargs=dict(layers=2), num_microbatches=1, num_stages=2,
                        inputs=(TensorSpec("x", "float32", (2, 6, 32)),), costs="unit",
                        partition=Partition("split", split_before=("enc.layers.1",)))
    stages = _stages(req)
    plans = [plan_stage(stages[s], 2) for s in range(2)]
    styles = _styles(plans[0]) | _styles(plans[1])
    for b in range(2):  # nn.MultiheadAttention's in_proj_weight is q|k|v, viewed as [..., 3, dim] and selected from
        assert styles[f"enc.layers.{b}.self_attn.in_proj"] == "colwise"
        assert styles[f"enc.layers.{b}.self_attn.out_proj"] == "rowwise"
        assert styles[f"enc.layers.{b}.linear1"] == "colwise" and styles[f"enc.layers.{b}.linear2"] == "rowwise"
    assert plans[0].sharded("enc.layers.0.self_attn.in_proj_weight").segments == 3
    assert styles["inp"] == "replicated" and styles["out"] == "replicated"
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    assert_tp_matches(stages, plans, 2, "x", x=x, loss=lambda y: F.mse_loss(y, torch.ones_like(y)))


# ----------------------------------------------------------------------------- refusals


def test_pattern_matching_nothing_is_refused(gpt):
    with pytest.raises(FrontendError, match="'blocks.*.attn.qkvz' matches no module of any stage"):
        plan_stages([gpt[0], gpt[1]], 2, patterns={"blocks.*.attn.qkvz": "colwise"})


def test_pattern_naming_a_module_that_cannot_be_sharded_is_refused(gpt):
    with pytest.raises(FrontendError, match=r"matches blocks.0.ln1 \(LayerNorm\), which is not a Linear") as e:
        plan_stage(gpt[0], 2, patterns={"blocks.*.ln1": "colwise"})
    assert e.value.key == "tensor_parallel" and e.value.hints


def test_colwise_without_its_rowwise_partner_is_refused_located(gpt):
    req = _request(GPT, GPT_ARGS, partition=Partition("split", split_before=("blocks.1",)))
    traced = trace_request(req).traced
    with pytest.raises(FrontendError, match=r"cannot shard node 'blocks_0_mlp_proj' at \S*gpt.py:\d+ \(in forward: "
                                            r"return self.proj\(F.gelu\(self.fc\(x\)\)\)\): blocks.0.mlp.proj is "
                                            r"replicated in the patterns, but its input is sharded") as e:
        plan_stage(gpt[0], 2, patterns={"blocks.*.mlp.fc": "colwise"}, traced=traced)
    assert e.value.hints == ("make blocks.0.mlp.proj rowwise",)


def test_tied_copies_sharded_differently_across_stages_are_refused(gpt, monkeypatch):
    import pipec.tp.analysis as tpm
    from pipec.compiler.ir.tensor_parallel import StageTP

    def sharding_the_head(st, tp, **kw):  # stage 1 as if it sharded the LM head's weight, tied to stage 0's wte,
        plan = plan_stage(st, tp, **kw)   # on another dim than a vocab-parallel wte: auto cannot make them agree
        if st is not gpt[1]:
            return plan
        params = tuple(p for p in plan.params if p.name != "wte.weight")
        return StageTP(modules=plan.modules, params=(*params, ShardedParam(name="wte.weight", dim=1)))

    monkeypatch.setattr(tpm, "plan_stage", sharding_the_head)
    with pytest.raises(FrontendError, match=r"tied parameter wte.weight is sharded differently .*stage 0: "
                                            r"replicated, stage 1: dim 1"):
        plan_stages([gpt[0], gpt[1]], 2)


def test_tied_lm_head_made_colwise_is_refused(gpt):
    with pytest.raises(FrontendError, match="'lm_head' leaves the stage sharded"):
        plan_stage(gpt[1], 2, patterns={"lm_head": "colwise"})


def test_heads_not_divisible_by_tp_is_refused_located():
    req = _request(GPT, dict(layers=1, dim=24, heads=3, vocab=64, seq=16), stages=1)
    stages = _stages(req)
    with pytest.raises(FrontendError, match="not divisible by tp 2") as e:
        plan_stage(stages[0], 2, traced=trace_request(req).traced)
    assert "gpt.py:" in str(e.value) and "q.view" in str(e.value) and "use a tp that divides 3" in e.value.hints[0]


# ----------------------------------------------------------------------------- parameters and collectives


@pytest.mark.parametrize("segments,dim", [(1, 0), (3, 0), (3, 1), (2, 1)])
def test_shard_param_and_unshard_are_inverse(segments, dim):
    full = torch.arange(12 * 24, dtype=torch.float32).reshape(12, 24)
    sp = ShardedParam(name="w", dim=dim, segments=segments)
    parts = [shard_param(full, sp, 2, r) for r in range(2)]
    assert parts[0].shape[dim] == full.shape[dim] // 2
    assert torch.equal(unshard(parts, sp), full)
    if segments == 3 and dim == 0:  # rank 1 holds the second half of each of q, k, v
        assert torch.equal(parts[1][:2], full[2:4]) and torch.equal(parts[1][2:4], full[6:8])


def test_thread_group_sums_in_rank_order():
    group = ThreadGroupTP(3)
    got: list = [None] * 3

    def work(r):
        got[r] = group.rank(r).all_reduce(torch.full((2,), float(r + 1)))

    threads = [threading.Thread(target=work, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(g, torch.full((2,), 6.0)) for g in got)


@pytest.mark.parametrize("shape", [(3, 4), (12,)])
def test_vocab_parallel_cross_entropy_is_cross_entropy_on_the_parts(shape):
    """The loss on each rank's part of the logits (and an ignored target) equals F.cross_entropy on the whole;
    the parts' gradients put together are the whole's."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(*shape, 20, generator=gen) * 3
    target = torch.randint(0, 20, shape, generator=gen)
    target.view(-1)[1] = -100
    whole = logits.clone().requires_grad_()
    want = F.cross_entropy(whole.reshape(-1, 20), target.reshape(-1))
    want.backward()
    group, got = ThreadGroupTP(4), {}

    def work(r):
        part = logits.chunk(4, dim=-1)[r].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(part, target, group.rank(r), rank=r, size=4)
        loss.backward()
        got[r] = (loss.detach(), part.grad)

    _threads(4, work, group)
    for r in range(4):
        _close(got[r][0], want.detach(), f"rank {r} loss")
    _close(torch.cat([got[r][1] for r in range(4)], dim=-1), whole.grad, "the logits' gradient")
    with pytest.raises(IndexError, match="Target 20 is out of bounds: the logits have 20 classes"):
        vocab_parallel_cross_entropy(logits.chunk(4, dim=-1)[0], torch.full(shape, 20), group.rank(0), rank=0, size=4)


def test_explicit_vocab_style_and_its_refusals(gpt):
    plans = plan_stages([gpt[0], gpt[1]], 2, patterns={"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise",
                                                       "wte": "vocab", "lm_head": "colwise"})
    assert _styles(plans[0])["wte"] == "vocab" and plans[1].loss_parallel
    assert_tp_matches(gpt, plans, 2, "tokens")
    with pytest.raises(FrontendError, match="makes embedding wte colwise; an embedding is vocab") as e:
        plan_stage(gpt[0], 2, patterns={"wte": "colwise"})
    assert e.value.hints == ("make wte vocab, or leave it out of the patterns",)
    with pytest.raises(FrontendError, match="makes blocks.0.mlp.fc vocab"):
        plan_stage(gpt[0], 2, patterns={"blocks.*.mlp.fc": "vocab"})


def test_a_head_whose_vocabulary_tp_does_not_divide_stays_whole():
    stages = _stages(_request(GPT, {**GPT_ARGS, "vocab": 66}, partition=Partition("split", split_before=("blocks.1",))))
    plans, styles = _auto(stages, 4)
    assert styles["lm_head"] == styles["wte"] == "replicated" and not plans[1].loss_parallel


def test_sequence_parallel_gather_and_scatter_are_each_others_gradients():
    full = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(2))
    group = ThreadGroupTP(2)
    got: list = [None] * 2

    def work(r):
        gather, scatter = TPComm("gather", dim=1), TPComm("scatter", dim=1)
        gather.group = scatter.group = group.rank(r)
        x = full.chunk(2, dim=1)[r].clone().requires_grad_()
        y = gather(x)  # every rank sees the whole sequence
        assert torch.equal(y, full)
        z = scatter(y * (r + 1))  # the sum over ranks (3 x full), this rank's part
        z.sum().backward()
        got[r] = (z.detach(), x.grad)

    _threads(2, work)
    for r in range(2):
        assert torch.allclose(got[r][0], 3 * full.chunk(2, dim=1)[r])
        assert torch.allclose(got[r][1], torch.full((2, 4, 4), 3.0))  # d/dx of sum(3 x gathered x) per rank


def test_process_group_tp_with_one_rank(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        g = ProcessGroupTP()
        t = torch.arange(6.0).reshape(2, 3)
        assert torch.equal(g.all_reduce(t), t) and g.all_reduce(t) is not t
        assert torch.equal(g.all_gather(t, 1), t) and torch.equal(g.reduce_scatter(t, 0), t)
    finally:
        dist.destroy_process_group()


def test_view_rule_agrees_with_torch_on_random_reshapes():
    """Where map_view says a reshape keeps the shard on dim j (with its segments), reshaping each rank's part to
    the local shape gives that rank's part of the reshaped full tensor."""
    from pipec.tp.rules import map_view

    gen = torch.Generator().manual_seed(5)
    factors = [1, 2, 2, 3, 4]
    checked = 0
    for _ in range(400):
        dims = [factors[int(i)] for i in torch.randint(0, len(factors), (int(torch.randint(2, 5, (1,), generator=gen)),),
                                                          generator=gen)]
        flat = [f for d in dims for f in ([d] if d < 4 else [2, 2])]
        perm = torch.randperm(len(flat), generator=gen).tolist()
        cut = sorted(torch.randperm(len(flat), generator=gen)[: int(torch.randint(0, len(flat), (1,), generator=gen))].tolist())
        shuffled = [flat[p] for p in perm]
        out, start = [], 0
        for c in [*cut, len(shuffled)]:
            if c > start:
                out.append(int(torch.tensor(shuffled[start:c]).prod()))
                start = c
        shape = dims
        if int(torch.tensor(shape).prod()) != int(torch.tensor(out).prod()):
            continue
        for dim in range(len(shape)):
            for segs in (1, 2):
                if shape[dim] % (2 * segs):
                    continue
                full = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
                sp = ShardedParam(name="x", dim=dim, segments=segs)
                parts = [shard_param(full, sp, 2, r) for r in range(2)]
                mapped = map_view(shape, dim, segs, out)
                if mapped is None or mapped[2] % 2:
                    continue
                j, s2, _ = mapped
                local = list(out)
                local[j] //= 2
                want = [shard_param(full.reshape(out), ShardedParam(name="y", dim=j, segments=s2), 2, r) for r in range(2)]
                for r in range(2):
                    assert torch.equal(parts[r].reshape(local), want[r]), (shape, dim, segs, out)
                checked += 1
    assert checked > 50


class _Adapted(torch.nn.Linear):
    """A subclass of nn.Linear, as adapters and quantised layers are."""


def test_a_linear_subclass_is_sharded_as_a_linear():
    """A subclass of nn.Linear that the trace keeps whole (a call_module) is a Linear-like of the rules' table: made
    colwise and rowwise, and the ranks' sharded copies give the whole model's output."""
    from torch.fx.passes.shape_prop import ShapeProp

    class Leaves(torch.fx.Tracer):
        def is_leaf_module(self, m, name):
            return isinstance(m, torch.nn.Linear) or super().is_leaf_module(m, name)

    torch.manual_seed(0)
    model = torch.nn.Sequential(_Adapted(16, 64), torch.nn.GELU(), _Adapted(64, 16))
    gm = torch.fx.GraphModule(model, Leaves().trace(model))
    x = torch.randn(2, 6, 16)
    ShapeProp(gm).propagate(x)
    assert [type(gm.get_submodule(str(n.target))) for n in gm.graph.nodes if n.op == "call_module"][::2] == [_Adapted] * 2
    plan = plan_stage(gm, 2)
    assert _styles(plan) == {"0": "colwise", "2": "rowwise"}
    group = ThreadGroupTP(2)
    ranks = [shard_stage(gm, plan, r, tp=2, group=group.rank(r)) for r in range(2)]
    outs: list = [None, None]

    def work(r: int) -> None:
        outs[r] = ranks[r](x)

    _threads(2, work, group)
    for r in range(2):
        _close(outs[r].detach(), model(x).detach(), f"rank {r} output")


# ----------------------------------------------------------------------------- partial gradients


QWEN3 = {"model": "partial_models:qwen3", "input": "input_ids: int64[8, 16]", "model_args": {"layers": 2}}
"""Hugging Face Qwen3 (tests/partial_models.py): per-head q/k RMSNorms whose weight every head shares."""


def _tp_plan(model: dict, pp: int, **extra):
    from conftest import compiled

    return compiled({**model, "schedule": "1f1b", "microbatches": 2, "costs": "unit", "pp": pp, "tp": 2,
                     "tensor_parallel": "auto", **extra})


def test_qwen3_per_head_norm_weights_have_partial_gradients_at_tp_2():
    pytest.importorskip("transformers")
    (stage,) = _tp_plan(QWEN3, 1).stages
    norms = [f"model.model.layers.{b}.self_attn.{n}_norm.weight" for b in range(2) for n in ("q", "k")]
    assert stage.tp.sharded("model.model.layers.0.self_attn.q_proj.weight") is not None  # the heads are split
    assert stage.tp.partial_params == tuple(norms)  # broadcast over the split heads: this rank's heads' sum
    # the layer norms before q/k/v and the MLP run on whole activations: their gradients arrive whole
    assert not any("layernorm" in p or p.endswith("model.norm.weight") for p in stage.tp.partial_params)
    again = type(stage.tp).from_json(stage.tp.to_json())  # in plan.json without sequence parallelism
    assert again.partial_params == tuple(norms) and not again.sequence_parallel


def test_example_gpt_has_no_partial_gradients_without_sequence_parallelism():
    gpt = {"model": "pipec.examples.gpt:build", "input": "tokens: int64[8, 16]",
           "model_args": {"layers": 4, "dim": 32, "heads": 4, "vocab": 64, "seq": 16}}
    plan = _tp_plan(gpt, 2)
    assert all(st.tp.params for st in plan.stages) and not any(st.tp.partial_params for st in plan.stages)
    assert "partial_params" not in plan.stages[0].tp.to_json()


def test_hf_llama_rotary_stage_inputs_have_no_gradient_to_keep_whole():
    """At pp 2 rotary's cos / sin (from a buffer) cross the cut and are broadcast over the split heads: their
    gradient is partial on each rank, but it goes nowhere, so the compile is not refused."""
    pytest.importorskip("transformers")
    llama = {"model": "byom_models:llama", "input": "input_ids: int64[8, 16]", "model_args": {"layers": 4}}
    plan = _tp_plan(llama, 2, partition="balanced(by=params)")
    assert [st.tp.partial_params for st in plan.stages] == [(), ()]
    assert all(st.tp.sharded(f"model.model.layers.{b}.self_attn.q_proj.weight") is not None
               for st, b in zip(plan.stages, (0, 3)))


SCALED = {"model": "partial_models:scaled_heads", "input": "tokens: int64[4, 8]"}


def test_a_replicated_linear_broadcast_over_the_heads_has_partial_gradients():
    (stage,) = _tp_plan(SCALED, 1).stages
    assert dict(stage.tp.modules)["q"] == "colwise" and dict(stage.tp.modules)["o"] == "rowwise"
    assert stage.tp.partial_params == ("gain",)


def test_a_partial_gradient_into_a_stage_input_is_refused_located():
    from pipec.errors import PipecError

    with pytest.raises(PipecError, match=r"tensor parallelism \(tp 2\) in stage 1: the gradient of stage input 'tanh' "
                                         r"\(used at .*\) would be a partial sum on each tp rank"):
        _tp_plan(SCALED, 2, partition="split before q")


# ----------------------------------------------------------------------------- what auto leaves replicated, said


def _diagnostics(model: dict, **extra) -> list[str]:
    from pipec.compiler.driver import compile_spec
    from pipec.dsl import load_spec

    spec = {**model, "schedule": "1f1b", "microbatches": 2, "costs": "unit", "pp": 1, "tp": 2,
            "tensor_parallel": "auto", **extra}
    return [str(d) for d in compile_spec(load_spec(None, spec)).diagnostics]


def test_what_auto_leaves_replicated_is_a_compile_warning_naming_the_module_node_and_line():
    import partial_models

    said = [d for d in _diagnostics({"model": "partial_models:rolled", "input": "tokens: int64[4, 8]"})
            if "tensor_parallel auto" in d]
    line = next(i for i, t in enumerate(open(partial_models.__file__).read().splitlines(), 1) if "torch.roll(" in t)
    assert len(said) == 1, said  # q alone: o only ever follows it, the MLP is split
    assert "warning: tensor_parallel auto (tp 2) in stage 0 leaves q replicated: stopped at node 'roll' at " in said[0]
    assert f"partial_models.py:{line} (in forward: h = h + self.o(torch.roll(" in said[0]
    assert "q replicated: stopped at" in said[0] and "roll is not known to act shard by shard on 'q', which is sharded" in said[0]
    gpt = {"model": GPT, "input": "tokens: int64[4, 16]", "model_args": GPT_ARGS}
    assert not [d for d in _diagnostics(gpt) if "tensor_parallel" in d]  # every block split: nothing to say


# ----------------------------------------------------------------------------- grouped-query attention, by hand


@pytest.mark.parametrize("expand", [False, True], ids=["repeat_interleave", "expand_reshape"])
def test_hand_written_llama_gqa_repeat_interleave_or_expand_is_split_and_matches(expand):
    """GQA whose kv heads are expanded by ``k.repeat_interleave(rep, dim=1)`` (or torchtitan's ``repeat_kv``,
    expand + reshape): rank t's kv heads, repeated, are exactly its q heads, so q, k, v split and o rowwise."""
    stages = _stages(_request("family_models:hand_llama", {"expand": expand},
                              partition=Partition("split", split_before=("blocks.1",))))
    plans, styles = _auto(stages)
    for b in range(2):
        assert [styles[f"blocks.{b}.attn.w{m}"] for m in "qkvo"] == ["colwise"] * 3 + ["rowwise"]
    assert plans[0].sharded("blocks.0.attn.wk.weight").dim == 0
    assert_tp_matches(stages, plans, 2, "tokens")


# ----------------------------------------------------------------------------- cuts between the tp pairs


def _llama_at_pp2(layers: int, **extra):
    from pipec.compiler.driver import compile_spec
    from pipec.dsl import load_spec

    spec = {"model": "family_models:hand_llama", "input": "tokens: int64[4, 16]", "model_args": {"layers": layers},
            "schedule": "1f1b", "microbatches": 2, "costs": "unit", "partition": "balanced(by=flops)", "pp": 2,
            "tp": 2, "tensor_parallel": "auto", **extra}
    return compile_spec(load_spec(None, spec))


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_at_tp_2_the_balanced_partition_cuts_between_the_pairs_and_says_where_it_moved(layers):
    """By FLOPs alone the hand-written Llama's cut falls between w1 and w2 (1 and 3 layers) or inside an
    attention (2 layers), where each side would keep its half of the pair whole; at tp 2 it moves to the
    nearest place no shard crosses, and the compile says so."""
    compiled = _llama_at_pp2(layers)
    for st in compiled.plan.stages:
        styles = dict(st.tp.modules)
        assert "replicated" not in styles.values(), styles
        for b in range(layers):   # a block's pairs, each wholly in one stage or the other
            for pair in (("attn.wq", "attn.wo"), ("w1", "w2")):
                assert (f"blocks.{b}.{pair[0]}" in styles) == (f"blocks.{b}.{pair[1]}" in styles), (b, pair, styles)
    notes = [str(d) for d in compiled.diagnostics if "tensor-parallel pair" in str(d)]
    assert len(notes) == 1 and "note: the balanced cut before node" in notes[0], notes
    assert "crosses it); the stages are cut between the pairs instead, before blocks." in notes[0]
    assert not [d for d in compiled.diagnostics if "tensor_parallel auto" in str(d)]   # nothing left replicated


def test_a_split_point_the_user_names_inside_a_tp_pair_is_refused_with_the_layers_either_side():
    from pipec.errors import PipecError

    with pytest.raises(PipecError, match=r"split before 'blocks.1.attn.wo' cuts inside a tensor-parallel pair: node "
                                         r"'\w+' \(a shard of blocks.1.attn.w[qkv]'s output\) crosses it") as err:
        _llama_at_pp2(3, partition="split before blocks.1.attn.wo")
    assert "split before 'blocks.1' or 'blocks.2' instead (between the layers)" in str(err.value)
    assert [st.stage for st in _llama_at_pp2(3, partition="split before blocks.2").plan.stages] == [0, 1]
    at_tp1 = _llama_at_pp2(3, partition="split before blocks.1.attn.wo", tp=1)   # no pair at tp 1: cut as asked
    assert len(at_tp1.plan.stages) == 2
