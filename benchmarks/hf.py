"""Small Hugging Face ``transformers`` models for the benchmark: GPT-2, Llama and BERT.

Built from configurations with random weights (nothing is downloaded), ``use_cache=False`` (a
cache in the output stops ``torch.export``), eager attention (CPU ``scaled_dot_product_attention``
has no FLOP formula, so its recompute would count as free) and the library's default dropout.
Inputs are token ids of shape ``(batch, seq)``; the models are returned in train mode.
"""

from __future__ import annotations

import torch
from torch import nn

NAMES = ("hf-gpt2", "hf-llama", "hf-bert")


def _config(name: str, layers: int, d_model: int, heads: int, seq: int, vocab: int):
    import transformers

    common = dict(
        vocab_size=vocab,
        use_cache=False,
        attn_implementation="eager",
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    if name == "hf-gpt2":
        return transformers.GPT2LMHeadModel, transformers.GPT2Config(
            n_layer=layers, n_embd=d_model, n_head=heads, n_positions=seq, **common
        )
    if name == "hf-llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(
            num_hidden_layers=layers,
            hidden_size=d_model,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            intermediate_size=4 * d_model,
            max_position_embeddings=seq,
            **common,
        )
    if name == "hf-bert":
        return transformers.BertModel, transformers.BertConfig(
            num_hidden_layers=layers,
            hidden_size=d_model,
            num_attention_heads=heads,
            intermediate_size=4 * d_model,
            max_position_embeddings=seq,
            **common,
        )
    raise ValueError(f"unknown Hugging Face benchmark model {name!r}; known: {', '.join(NAMES)}")


def build(
    name: str,
    *,
    layers: int = 4,
    d_model: int = 256,
    heads: int = 4,
    seq: int = 128,
    batch: int = 4,
    vocab: int = 1024,
    device=None,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """``(model, (ids,))`` for one of ``NAMES``, in train mode, on ``device`` (default CPU)."""
    cls, config = _config(name, layers, d_model, heads, seq, vocab)
    torch.manual_seed(seed)
    model = cls(config).train()
    ids = torch.randint(0, vocab, (batch, seq))
    if device is not None:
        model, ids = model.to(device), ids.to(device)
    return model, (ids,)
