"""Transformers: a pre-LN GPT decoder (explicit attention, dropout, tied weights) and a post-LN
BERT encoder (a mask input and a dict output)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from planner.zoo.common import Example, make


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention written out, so the (T, T) score matrix is a graph node."""

    causal_mask: torch.Tensor  # a buffer

    def __init__(self, d_model: int, heads: int, seq: int, dropout: float) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} is not divisible by heads={heads}")
        self.heads = heads
        self.head_dim = d_model // heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        # True above the diagonal: the future positions a token may not attend to.
        future = torch.ones(seq, seq, dtype=torch.bool).triu(diagonal=1)
        self.register_buffer("causal_mask", future, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)  # (b, h, t, hd)
        k = k.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * self.scale  # (b, h, t, t)
        # narrow, not self.causal_mask[:t, :t]: under symbolic_trace t is a Proxy, and a plain
        # tensor indexed with a Proxy inside a slice raises TypeError; narrow() is traced.
        future = self.causal_mask.narrow(0, 0, t).narrow(1, 0, t)
        att = att.masked_fill(future, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.proj(y))


class _GPTBlock(nn.Module):
    def __init__(self, d_model: int, heads: int, seq: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, seq, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """nanoGPT-style decoder: ``forward(idx)`` returns logits ``(batch, seq, vocab)``."""

    def __init__(
        self, layers: int, d_model: int, heads: int, seq: int, vocab: int, dropout: float
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(
            *[_GPTBlock(d_model, heads, seq, dropout) for _ in range(layers)]
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.apply(_init_gpt_weights)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, used twice

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        x = self.ln_f(self.blocks(x))
        return self.lm_head(x)


class GPTWithLoss(GPT):
    """The same decoder; ``forward(idx, targets)`` returns the scalar cross-entropy loss.

    A subclass rather than ``forward(idx, targets=None)``: symbolic_trace turns every argument,
    defaulted or not, into a placeholder, so an ``if targets is None`` branch would be traced
    as the loss branch and the traced module called as ``gm(idx)`` would fail.
    """

    def forward(  # type: ignore[override]
        self, idx: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        logits = super().forward(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _init_gpt_weights(module: nn.Module) -> None:
    # GPT-2's init (std 0.02); PyTorch's default N(0, 1) embedding would give huge tied logits.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def gpt(
    layers: int = 4,
    d_model: int = 128,
    heads: int = 4,
    seq: int = 64,
    vocab: int = 512,
    batch: int = 4,
    dropout: float = 0.1,
    with_loss: bool = True,
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> Example:
    """A nanoGPT-style decoder-only transformer (pre-LN, GELU MLP, tied lm_head).

    Attention is written out (``q @ k^T * scale``, ``masked_fill`` with a registered causal-mask
    buffer, softmax, dropout, ``@ v``) rather than ``scaled_dot_product_attention``, so the
    ``(batch, heads, seq, seq)`` attention matrices are visible, memory-heavy graph nodes, and
    dropout makes recompute depend on the RNG state. The model is ``torch.fx.symbolic_trace``-able.

    With ``with_loss=True`` the inputs are ``(idx, targets)`` and forward returns the scalar
    cross-entropy loss; otherwise the inputs are ``(idx,)`` and forward returns logits
    ``(batch, seq, vocab)``.

    A 7B-parameter-class configuration (about 6.6e9 parameters, 26 GB in float32) for planning
    only: ``gpt(**gpt_config_7b(), device="meta")``, i.e. ``layers=32, d_model=4096, heads=32,
    vocab=32000, seq=2048, batch=1``.
    """

    def build() -> Example:
        model = (GPTWithLoss if with_loss else GPT)(layers, d_model, heads, seq, vocab, dropout)
        idx = torch.randint(0, vocab, (batch, seq))
        if not with_loss:
            return model, (idx,)
        targets = torch.randint(0, vocab, (batch, seq))
        return model, (idx, targets)

    return make(build, seed, device)


def gpt_config_7b() -> dict[str, Any]:
    """Keyword arguments for :func:`gpt` giving a LLaMA-7B-sized decoder (about 6.6e9 parameters).

    Build it with ``device="meta"``: planning needs shapes, not values.
    """
    return dict(layers=32, d_model=4096, heads=32, seq=2048, vocab=32000, batch=1)


class _BertLayer(nn.Module):
    """Post-LN encoder layer: x = LN(x + attn(x)); x = LN(x + mlp(x))."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} is not divisible by heads={heads}")
        self.heads = heads
        self.head_dim = d_model // heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_dropout = nn.Dropout(dropout)
        self.dropout1 = nn.Dropout(dropout)
        self.ln1 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )
        self.dropout2 = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor, additive_mask: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * self.scale + additive_mask
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = self.ln1(x + self.dropout1(self.proj(y)))
        return self.ln2(x + self.dropout2(self.mlp(x)))


class Bert(nn.Module):
    """Encoder-only transformer; ``forward(input_ids, attention_mask)`` returns a dict."""

    def __init__(
        self, layers: int, d_model: int, heads: int, seq: int, vocab: int, dropout: float
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.ln_emb = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList([_BertLayer(d_model, heads, dropout) for _ in range(layers)])
        self.mlm_head = nn.Linear(d_model, vocab)
        self.pooler = nn.Linear(d_model, d_model)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.drop(self.ln_emb(self.tok(input_ids) + self.pos(pos)))
        # attention_mask is 1 for real tokens and 0 for padding; padding keys get -1e4.
        additive_mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -1e4
        for layer in self.layers:
            x = layer(x, additive_mask)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return {"logits": self.mlm_head(x), "pooled": pooled}


def bert(
    layers: int = 4,
    d_model: int = 128,
    heads: int = 4,
    seq: int = 64,
    vocab: int = 512,
    batch: int = 4,
    dropout: float = 0.1,
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> Example:
    """A BERT-style encoder: post-LN, bidirectional attention with a padding mask.

    Exercises a second graph input that every layer reads (the additive mask stays live across
    every cut), and a dict output ``{"logits": (batch, seq, vocab), "pooled": (batch, d_model)}``
    that capture and rewrite must keep. Inputs ``(input_ids, attention_mask)``; the mask pads
    the tail of every other sequence. ``symbolic_trace``-able.
    """

    def build() -> Example:
        model = Bert(layers, d_model, heads, seq, vocab, dropout)
        input_ids = torch.randint(0, vocab, (batch, seq))
        lengths = torch.tensor([seq if i % 2 == 0 else max(1, seq // 2) for i in range(batch)])
        attention_mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        return model, (input_ids, attention_mask)

    return make(build, seed, device)
