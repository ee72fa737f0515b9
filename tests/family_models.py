"""Model families for the tensor-parallel runs (tests/test_tp_families.py): tiny default-config Hugging Face models
and a hand-written Llama whose grouped-query attention expands its kv heads with ``repeat_interleave``.

Every norm's weight is drawn around its init (``nudged``), in the norm's own ``_init_weights`` so that ``init
module`` (and the reference) give every rank the same values: a norm's weight left at its init hides a partial
gradient only where the gradient is the same whatever the weight (it is not, but ones make per-head sums equal
across the heads more often than random weights do). Dropout is off (``--check`` compares runs without it).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from byom_models import Logits
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_NUDGED: dict[type, type] = {}


def _nudge(mod: nn.Module) -> None:
    with torch.no_grad():
        mod.weight.add_(0.5 * torch.randn(mod.weight.shape))


def nudged(model: nn.Module) -> nn.Module:
    """``model`` with each norm's weight (a module whose class name ends in ``Norm``, or is ``LayerNorm``) moved
    around its init, by a subclass of the same name whose ``_init_weights`` (after its ``reset_parameters``) adds
    N(0, 0.25)."""
    for mod in model.modules():
        cls = type(mod)
        if not (cls.__name__.endswith("Norm") or cls.__name__.endswith("LayerNorm")):
            continue
        if not isinstance(getattr(mod, "weight", None), nn.Parameter):
            continue
        if cls not in _NUDGED:
            def _init_weights(self, module: nn.Module, _base=cls) -> None:
                if module is self:
                    _nudge(self)
            _NUDGED[cls] = type(cls.__name__, (cls,), {"_init_weights": _init_weights})
        mod.__class__ = _NUDGED[cls]
        _nudge(mod)
    return model


SMALL = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, vocab_size=96, max_position_embeddings=16,
             use_cache=False)


def llama(layers: int = 2, heads: int = 4, kv_heads: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return nudged(Logits(LlamaForCausalLM(LlamaConfig(
        **{**SMALL, "num_hidden_layers": layers}, num_attention_heads=heads, num_key_value_heads=kv_heads))))


def qwen3(layers: int = 2) -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return nudged(Logits(Qwen3ForCausalLM(Qwen3Config(
        **{**SMALL, "num_hidden_layers": layers}, num_attention_heads=4, num_key_value_heads=2, head_dim=8))))


def gemma(layers: int = 2) -> nn.Module:
    """Gemma: one kv head (multi-query attention), head_dim 8."""
    from transformers import GemmaConfig, GemmaForCausalLM

    return nudged(Logits(GemmaForCausalLM(GemmaConfig(
        **{**SMALL, "num_hidden_layers": layers}, num_attention_heads=4, num_key_value_heads=1, head_dim=8))))


def falcon(layers: int = 2) -> nn.Module:
    """Falcon (7B's layout): multi-query attention (one kv head) in a fused query_key_value, parallel attention."""
    from transformers import FalconConfig, FalconForCausalLM

    return nudged(Logits(FalconForCausalLM(FalconConfig(
        num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, vocab_size=96, multi_query=True,
        new_decoder_architecture=False, parallel_attn=True, bias=False, use_cache=False, max_position_embeddings=16,
        hidden_dropout=0.0, attention_dropout=0.0))))


def phi3(layers: int = 2) -> nn.Module:
    """Phi-3: q|k|v fused in qkv_proj and sliced by offsets, gate|up fused in gate_up_proj."""
    from transformers import Phi3Config, Phi3ForCausalLM

    return nudged(Logits(Phi3ForCausalLM(Phi3Config(
        **{**SMALL, "num_hidden_layers": layers}, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0))))


def gpt_neox(layers: int = 2) -> nn.Module:
    """GPT-NeoX: q|k|v fused per head (viewed [.., heads, 3 head_dim]), partial rotary, parallel residual."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return nudged(Logits(GPTNeoXForCausalLM(GPTNeoXConfig(
        **{**SMALL, "num_hidden_layers": layers}, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0))))


def gpt2(layers: int = 2) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return nudged(Logits(GPT2LMHeadModel(GPT2Config(
        n_layer=layers, n_embd=32, n_head=4, vocab_size=96, n_positions=16, use_cache=False, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))))


def bert(layers: int = 2) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return nudged(Logits(BertForMaskedLM(BertConfig(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=96,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))))


class Seq2Seq(nn.Module):
    """``forward(input_ids) -> logits`` of an encoder-decoder run on the ids as both its source and its target."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, decoder_input_ids=input_ids).logits


def t5(layers: int = 2) -> nn.Module:
    """T5: a relative position bias [1, heads, T, S] added to every layer's scores."""
    from transformers import T5Config, T5ForConditionalGeneration

    return nudged(Seq2Seq(T5ForConditionalGeneration(T5Config(
        num_layers=layers, num_decoder_layers=layers, d_model=32, d_kv=8, d_ff=64, num_heads=4, vocab_size=96,
        dropout_rate=0.0, use_cache=False, decoder_start_token_id=0, pad_token_id=0))))


# ----------------------------------------------------------------------------- a hand-written Llama


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0).add_(0.5 * torch.randn(self.weight.shape))  # nudged (see the module doc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Grouped-query attention: ``kv_heads`` kv heads, each repeated for ``heads // kv_heads`` q heads by
    ``repeat_interleave`` (``expand``: torchtitan's ``repeat_kv``, expand + reshape)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, expand: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.expand = heads, kv_heads, dim // heads, expand
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        rep = self.heads // self.kv_heads
        if not self.expand:
            return x.repeat_interleave(rep, dim=1)
        b, k, t, d = x.shape
        return x[:, :, None, :, :].expand(b, k, rep, t, d).reshape(b, k * rep, t, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = self._repeat(k), self._repeat(v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, expand: bool) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads, expand)
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w3 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class HandLlama(nn.Module):
    """A Llama written by hand: RMSNorm, rotary, SwiGLU, GQA with ``repeat_interleave`` (or expand + reshape)."""

    def __init__(self, layers: int = 2, dim: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 96,
                 seq: int = 16, expand: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, expand) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        hd = dim // heads
        freqs = torch.outer(torch.arange(seq).float(), 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        t = tokens.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def hand_llama(layers: int = 2, kv_heads: int = 2, expand: bool = False) -> nn.Module:
    return HandLlama(layers=layers, kv_heads=kv_heads, expand=expand)
