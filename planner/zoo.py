"""Small built-in models for the demo, the tests and the benchmarks.

Each factory returns ``(model, example_inputs)``: the model in train mode and a tuple of
positional arguments for it. Every factory takes keyword-only ``seed`` (weights and inputs are
drawn after ``torch.manual_seed(seed)``, so two calls give identical models) and ``device``:

- ``device=None`` builds on the CPU;
- ``device="meta"`` builds parameters, buffers and inputs on the meta device, allocating no
  memory, so that a 7B-parameter-class decoder can be built for planning only
  (``gpt(**gpt_config_7b(), device="meta")``);
- any other device builds on the CPU, then moves there (same values as on the CPU).

Defaults are small: one CPU training step of any of them takes well under a second.

Each model exists to exercise one structure a checkpoint planner meets:

=========== ================================================================================
name        structure
=========== ================================================================================
mlp         a plain chain: every layer is an articulation point (Chen's setting)
resnet      residual blocks with BatchNorm: one articulation point per block, running stats
gpt         pre-LN decoder with explicit attention: big attention matrices, dropout, tied weights
bert        post-LN encoder with a mask input and a dict output
unet        long skip connections: few articulation points, cuts crossed by several tensors
untraceable a Python loop over a tensor size: ``symbolic_trace`` fails, ``torch.export`` works
=========== ================================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MODELS",
    "bert",
    "build",
    "gpt",
    "gpt_config_7b",
    "mlp_chain",
    "resnet",
    "unet",
    "untraceable_mlp",
]

Example = tuple[nn.Module, tuple[torch.Tensor, ...]]


def _make(build: Callable[[], Example], seed: int, device: str | torch.device | None) -> Example:
    """Run ``build`` under ``seed`` on ``device``; return the model in train mode."""
    torch.manual_seed(seed)
    device = None if device is None else torch.device(device)
    if device is not None and device.type == "meta":
        # Factory functions (parameter init, torch.randint, ...) allocate nothing on meta.
        with device:
            model, inputs = build()
    else:
        # Build on the CPU so that the values do not depend on the target device's RNG.
        model, inputs = build()
        if device is not None:
            model = model.to(device)
            inputs = tuple(t.to(device) for t in inputs)
    return model.train(), tuple(inputs)


# --------------------------------------------------------------------------------------------
# mlp


def mlp_chain(
    depth: int = 32,
    width: int = 256,
    batch: int = 64,
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> Example:
    """A plain chain of ``depth`` Linear layers with ReLU between them.

    The simplest checkpointing problem: every layer's output is an articulation point and all
    layers cost the same, so sqrt(n) segmentation is optimal-ish. ``depth=128`` (or more) gives
    a long chain for solver scaling tests. Input ``(x,)`` of shape ``(batch, width)``; output a
    tensor of the same shape.
    """

    def build() -> Example:
        layers: list[nn.Module] = []
        for i in range(depth):
            layers.append(nn.Linear(width, width))
            if i < depth - 1:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers), (torch.randn(batch, width),)

    return _make(build, seed, device)


# --------------------------------------------------------------------------------------------
# resnet


class _BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn plus a shortcut (a 1x1 projection when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        if stride != 1 or c_in != c_out:
            self.shortcut: nn.Module = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Stem, ``blocks`` residual blocks (the middle one halves the resolution), pool, linear."""

    def __init__(self, blocks: int, channels: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
        )
        layers = []
        c = channels
        for i in range(blocks):
            down = i == blocks // 2 and blocks > 1
            layers.append(_BasicBlock(c, 2 * c if down else c, stride=2 if down else 1))
            c = 2 * c if down else c
        self.blocks = nn.Sequential(*layers)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)


def resnet(
    blocks: int = 4,
    channels: int = 32,
    batch: int = 8,
    image: int = 32,
    num_classes: int = 10,
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> Example:
    """A small CIFAR-style ResNet with BatchNorm2d.

    Each residual block has one articulation point (its output), and inside a block the cut is
    crossed by two tensors (the branch and the shortcut). BatchNorm in train mode updates its
    running statistics in forward, so a plan that recomputes it must not update them twice.
    Input ``(images,)`` of shape ``(batch, 3, image, image)``; output logits
    ``(batch, num_classes)``.
    """

    def build() -> Example:
        model = ResNet(blocks, channels, num_classes)
        return model, (torch.randn(batch, 3, image, image),)

    return _make(build, seed, device)


# --------------------------------------------------------------------------------------------
# gpt


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

    return _make(build, seed, device)


def gpt_config_7b() -> dict[str, Any]:
    """Keyword arguments for :func:`gpt` giving a LLaMA-7B-sized decoder (about 6.6e9 parameters).

    Build it with ``device="meta"``: planning needs shapes, not values.
    """
    return dict(layers=32, d_model=4096, heads=32, seq=2048, vocab=32000, batch=1)


# --------------------------------------------------------------------------------------------
# bert


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

    return _make(build, seed, device)


# --------------------------------------------------------------------------------------------
# unet


def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(c_out, c_out, 3, padding=1),
        nn.ReLU(),
    )


class UNet(nn.Module):
    """Encoder (double conv + max-pool) x depth, bottleneck, decoder (up-conv, cat, double conv)."""

    def __init__(self, depth: int, channels: int, in_channels: int = 3, out_channels: int = 2):
        super().__init__()
        widths = [channels * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList()
        c = in_channels
        for w in widths[:-1]:
            self.down.append(_double_conv(c, w))
            c = w
        self.bottleneck = _double_conv(c, widths[-1])
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        for w_skip, w_low in zip(reversed(widths[:-1]), reversed(widths[1:])):
            self.up.append(nn.ConvTranspose2d(w_low, w_skip, 2, stride=2))
            self.dec.append(_double_conv(2 * w_skip, w_skip))
        self.head = nn.Conv2d(channels, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)  # stays live until the matching decoder level
            x = F.max_pool2d(x, 2)
        x = self.bottleneck(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.head(x)


def unet(
    depth: int = 3,
    channels: int = 16,
    batch: int = 4,
    image: int = 64,
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> Example:
    """A small U-Net (no normalisation) with long skip connections.

    Every encoder level's features are concatenated into the matching decoder level, so most
    cuts are crossed by several tensors and only the nodes before the first skip and after
    the last ``cat`` are articulation points. Input ``(images,)`` of shape
    ``(batch, 3, image, image)`` (``image`` divisible by ``2**depth``); output per-pixel logits
    ``(batch, 2, image, image)``.
    """
    if image % 2**depth:
        raise ValueError(f"image={image} must be divisible by 2**depth={2**depth}")

    def build() -> Example:
        return UNet(depth, channels), (torch.randn(batch, 3, image, image),)

    return _make(build, seed, device)


# --------------------------------------------------------------------------------------------
# untraceable


class UnrolledMLP(nn.Module):
    """A shared Linear+tanh cell applied once per time step, looping over ``x.size(1)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.cell = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(x[:, 0])
        # range() needs a Python int. Under symbolic_trace x.size(1) is a Proxy, and
        # range(Proxy) raises TypeError. torch.export(strict=False) sees a static int and
        # unrolls the loop.
        for t in range(x.size(1)):
            h = torch.tanh(self.inp(x[:, t]) + self.cell(h))
        return self.out(h)


def untraceable_mlp(
    steps: int = 8,
    width: int = 64,
    batch: int = 16,
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> Example:
    """A recurrent MLP that ``torch.fx.symbolic_trace`` cannot capture but ``torch.export`` can.

    Its forward loops ``for t in range(x.size(1))``: under fx, ``x.size(1)`` is a Proxy and
    ``range`` rejects it (``TypeError: 'Proxy' object cannot be interpreted as an integer``);
    ``torch.export.export(model, args, strict=False)`` runs the Python with a concrete size and
    unrolls the loop into ``steps`` copies of the cell sharing one weight. It exercises the
    export fallback of capture and parameters used at many places in the graph.
    Input ``(x,)`` of shape ``(batch, steps, width)``; output ``(batch, width)``.
    """

    def build() -> Example:
        return UnrolledMLP(width), (torch.randn(batch, steps, width),)

    return _make(build, seed, device)


# --------------------------------------------------------------------------------------------
# registry

MODELS: dict[str, Callable[..., Example]] = {
    "mlp": mlp_chain,
    "resnet": resnet,
    "gpt": gpt,
    "bert": bert,
    "unet": unet,
    "untraceable": untraceable_mlp,
}


def build(name: str, **overrides: Any) -> Example:
    """Build the model registered as ``name``, passing ``overrides`` to its factory.

    >>> model, inputs = build("mlp", depth=4)
    """
    try:
        factory = MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise ValueError(f"unknown model {name!r}; known models: {known}") from None
    return factory(**overrides)
