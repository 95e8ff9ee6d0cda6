"""The alternatives a user would pick instead of planner, applied to the ``planner.zoo`` models.

* :func:`per_block` -- Hugging Face style: every transformer layer / residual block / U-Net level
  runs under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``; for the Hugging
  Face models (names ``hf-*``) it is their own ``gradient_checkpointing_enable``.
* :func:`checkpoint_sequential` -- ``torch.utils.checkpoint.checkpoint_sequential`` with
  ``round(sqrt(n))`` segments over the model's ``n`` blocks (the last segment is not checkpointed,
  as in torch). Models that are not one ``nn.Sequential`` get an adapter with the same chunking;
  the Hugging Face models get none (:func:`has_checkpoint_sequential`).
* :func:`compiled` -- ``torch.compile`` (``aot_eager`` or ``inductor``) under a given
  ``torch._functorch.config.activation_memory_budget``.

Every function returns a new module; the model passed in is never modified. ``per_block`` and
``checkpoint_sequential`` work on a deep copy (same values, same sizes), ``compiled`` shares the
model's parameters.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.checkpoint import checkpoint_sequential as torch_checkpoint_sequential

# Module paths of the blocks of each zoo model ("x.*" means every child of x). The MLP chain is a
# flat Sequential of Linear/ReLU; its blocks are the (Linear, ReLU) pairs, see _mlp_blocks.
BLOCKS = {
    "resnet": ["blocks.*"],
    "gpt": ["blocks.*"],
    "bert": ["layers.*"],
    "unet": ["down.*", "bottleneck", "dec.*"],
}


class Checkpointed(nn.Module):
    """Runs ``inner`` under non-reentrant ``torch.utils.checkpoint``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


class SequentialCheckpointed(nn.Module):
    """``torch.utils.checkpoint.checkpoint_sequential(blocks, segments, x)``."""

    def __init__(self, blocks: nn.Sequential, segments: int):
        super().__init__()
        self.blocks = blocks
        self.segments = segments

    def forward(self, x):
        return torch_checkpoint_sequential(self.blocks, self.segments, x, use_reentrant=False)


class _Chunk(nn.Module):
    """Consecutive layers called as ``layer(x, *extra)``, checkpointed as one piece or not."""

    def __init__(self, layers, checkpointed: bool):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.checkpointed = checkpointed

    def _run(self, x, *extra):
        for layer in self.layers:
            x = layer(x, *extra)
        return x

    def forward(self, x, *extra):
        if self.checkpointed:
            return checkpoint(self._run, x, *extra, use_reentrant=False)
        return self._run(x, *extra)


def sqrt_segments(n: int) -> int:
    return max(1, round(math.sqrt(n)))


def chunks(n: int, segments: int) -> list[range]:
    """The chunking of ``checkpoint_sequential``: ``segments`` pieces of ``n // segments``, the
    last one taking the rest."""
    size = n // segments
    bounds = [k * size for k in range(segments)] + [n]
    return [range(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _mlp_blocks(model: nn.Sequential) -> list[nn.Sequential]:
    mods = list(model)
    blocks, i = [], 0
    while i < len(mods):
        if i + 1 < len(mods) and isinstance(mods[i + 1], nn.ReLU):
            blocks.append(nn.Sequential(mods[i], mods[i + 1]))
            i += 2
        else:
            blocks.append(nn.Sequential(mods[i]))
            i += 1
    return blocks


def _paths(model: nn.Module, patterns) -> list[str]:
    out = []
    for pattern in patterns:
        if pattern.endswith(".*"):
            parent = model.get_submodule(pattern[:-2])
            out += [f"{pattern[:-2]}.{name}" for name, _ in parent.named_children()]
        else:
            out.append(pattern)
    return out


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    if isinstance(parent, (nn.Sequential, nn.ModuleList)) and name.isdigit():
        parent[int(name)] = new
    else:
        setattr(parent, name, new)


def _is_hf(name: str) -> bool:
    return name.startswith("hf-")


def has_checkpoint_sequential(name: str) -> bool:
    """Whether :func:`checkpoint_sequential` has an adapter for the model (not the ``hf-*``
    ones: their layers take masks and position embeddings computed outside them)."""
    return not _is_hf(name)


def block_count(name: str, model: nn.Module) -> int:
    if _is_hf(name):
        return int(model.config.num_hidden_layers)
    if name == "mlp":
        return len(_mlp_blocks(model))
    if name == "unet":
        return len(model.down) + 1 + len(model.dec)
    return len(_paths(model, BLOCKS[name]))


def per_block(name: str, model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every block under ``checkpoint``."""
    model = copy.deepcopy(model)
    if _is_hf(name):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    if name == "mlp":
        return nn.Sequential(*[Checkpointed(b) for b in _mlp_blocks(model)]).train(model.training)
    for path in _paths(model, BLOCKS[name]):
        _replace(model, path, Checkpointed(model.get_submodule(path)))
    return model


def checkpoint_sequential(name: str, model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose blocks run through ``checkpoint_sequential(sqrt(n))``.

    * mlp: the (Linear, ReLU) pairs form the Sequential;
    * resnet, gpt: ``model.blocks`` is already a Sequential; stem/embeddings and head stay
      outside;
    * bert: layers take ``(x, mask)``, which ``checkpoint_sequential`` cannot pass; the layer
      list is replaced by the same chunks, each under ``checkpoint`` (last chunk not);
    * unet: the levels (encoder double-convs, bottleneck, decoder up-conv + double-conv) are
      chunked the same way; a chunk takes and returns the pending skip tensors.
    """
    model = copy.deepcopy(model)
    n = block_count(name, model)
    segments = sqrt_segments(n)
    if name == "mlp":
        blocks = nn.Sequential(*_mlp_blocks(model))
        return SequentialCheckpointed(blocks, segments).train(model.training)
    if name in ("resnet", "gpt"):
        model.blocks = SequentialCheckpointed(model.blocks, segments)
        return model
    if name == "bert":
        layers = list(model.layers)
        pieces = chunks(len(layers), segments)
        model.layers = nn.ModuleList(
            [_Chunk([layers[i] for i in r], k < len(pieces) - 1) for k, r in enumerate(pieces)]
        )
        return model
    if name == "unet":
        return _UNetSequential(model, segments)
    raise ValueError(f"no checkpoint_sequential adapter for {name!r}")


class _UNetSequential(nn.Module):
    """U-Net forward with its 2*depth+1 levels chunked as checkpoint_sequential would."""

    def __init__(self, unet: nn.Module, segments: int):
        super().__init__()
        self.unet = unet
        self.depth = len(unet.down)
        n = 2 * self.depth + 1
        self.pieces = chunks(n, segments)

    def _level(self, i, x, skips):
        u, d = self.unet, self.depth
        if i < d:
            x = u.down[i](x)
            return F.max_pool2d(x, 2), skips + [x]
        if i == d:
            return u.bottleneck(x), skips
        j = i - d - 1
        return u.dec[j](torch.cat([u.up[j](x), skips[-1]], dim=1)), skips[:-1]

    def _run(self, piece, x, *skips):
        skips = list(skips)
        for i in piece:
            x, skips = self._level(i, x, skips)
        return (x, *skips)

    def forward(self, x):
        skips: list = []
        for k, piece in enumerate(self.pieces):
            if k < len(self.pieces) - 1:
                x, *skips = checkpoint(self._run, piece, x, *skips, use_reentrant=False)
            else:
                x, *skips = self._run(piece, x, *skips)
        return self.unet.head(x)


def compiled(model: nn.Module, budget: float, tag: str, backend: str = "aot_eager") -> nn.Module:
    """``torch.compile(backend=backend)`` of ``model`` for one ``activation_memory_budget``.

    The budget is read when the graph is partitioned, i.e. on the first call, which must happen
    inside ``torch._functorch.config.patch(activation_memory_budget=budget)`` (see
    :func:`compile_now`). Dynamo caches compiled code per code object: two ``torch.compile`` of
    the same model class would share one graph, compiled under whichever budget came first. So
    each budget gets a thin wrapper whose ``forward`` is a fresh code object; ``fullgraph=True``
    ensures no inner frame is compiled (and cached) on its own.
    """
    namespace: dict = {}
    exec("def forward(self, *args, **kwargs):\n    return self.inner(*args, **kwargs)\n", namespace)
    forward = namespace["forward"]
    forward.__code__ = forward.__code__.replace(co_name=f"forward_{tag}")
    wrapper = type(f"Compiled_{tag}", (nn.Module,), {"forward": forward})()
    wrapper.inner = model
    return torch.compile(wrapper, backend=backend, fullgraph=True)


def compile_now(module, budget: float, step) -> None:
    """Run the first (compiling) call of ``module`` with ``budget`` in force."""
    import torch._functorch.config as functorch_config

    with functorch_config.patch(activation_memory_budget=budget):
        step(module)
