"""Predicted against measured peak of a real training step: cross-entropy over the vocabulary,
in float32, under bf16 autocast around the call, and under bf16 autocast inside forward.

Small Hugging Face GPT-2, Llama and BERT (masked LM) configs on the CPU, budget halfway from
the lowest peak to the baseline; peaks measured by the CPU live-storage tracker. A second table
plans the same models built on the meta device under autocast around the call, against the
CPU-built model's measured peak. Prints two markdown tables (about two minutes)::

    .venv/bin/python benchmarks/training_step.py
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
import transformers
from torch import nn

import planner
from planner.errors import PlanningError
from planner.pipeline import prepare
from planner.simulate import simulate
from planner.solvers.auto import lowest_peak
from planner.step import peak_memory

VOCAB, BATCH, LENGTH, HIDDEN = 2048, 4, 48, 64


def _model(name: str, device: str = "cpu") -> nn.Module:
    with torch.device(device):
        return _build(name)


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "GPT-2":
        config = transformers.GPT2Config(n_layer=2, n_embd=HIDDEN, n_head=4, **common)
        return transformers.GPT2LMHeadModel(config).train()
    sizes = dict(
        num_hidden_layers=2, hidden_size=HIDDEN, num_attention_heads=4, intermediate_size=128
    )
    if name == "Llama":
        config = transformers.LlamaConfig(**sizes, num_key_value_heads=4, **common)
        return transformers.LlamaForCausalLM(config).train()
    return transformers.BertForMaskedLM(transformers.BertConfig(**sizes, **common)).train()


class AutocastInForward(nn.Module):
    """The common way to put mixed precision in a model: forward runs it under autocast."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(input_ids)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _compare(predicted: int, measured: int) -> str:
    return f"{_mib(predicted)} vs {_mib(measured)} ({(predicted - measured) / measured:+.1%})"


def row(name: str, precision: str) -> str:
    """One table row: the model under ``precision`` ("float32", "around", "inside")."""
    model = _model(name)
    if name != "BERT":
        model.config.use_cache = False
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)

    def loss_fn(output):
        return F.cross_entropy(output.logits.flatten(0, 1).float(), labels.flatten())

    if precision == "inside":
        model = AutocastInForward(model)
    region = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if precision == "around"
        else contextlib.nullcontext()
    )
    with region:
        try:
            _, problem = prepare(model, (ids,), loss_fn=loss_fn)
        except PlanningError as error:
            return f"| {name} | {precision} | not planned: {str(error)[:90]}... | |"
        baseline = simulate(problem, ()).peak_bytes
        budget = (lowest_peak(problem).peak_bytes + baseline) // 2
        p = planner.plan(model, (ids,), budget_bytes=budget, loss_fn=loss_fn)
        measured_baseline = peak_memory(model, (ids,), loss_fn=loss_fn).peak_bytes
    with region:  # a region of its own, as each step of a training loop enters one
        measured = peak_memory(p.module, (ids,), loss_fn=loss_fn).peak_bytes
    fits = "fits" if measured <= budget + 8 else f"over by {_mib(measured - budget)}"
    return (
        f"| {name} | {precision} | {_compare(baseline, measured_baseline)} | "
        f"{len(p.segments)} segments: {_compare(p.predicted_peak_bytes, measured)}, {fits} |"
    )


def meta_row(name: str) -> str:
    """One row: the model built on the meta device, planned under bf16 autocast around the
    call, against the same model built on the CPU (no checkpointing; budget as in ``row``)."""
    cells = []
    for device in ("meta", "cpu"):
        model = _model(name, device)
        if name != "BERT":
            model.config.use_cache = False
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=generator).to(device)
        labels = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator).to(device)

        def loss_fn(output, labels=labels):
            return F.cross_entropy(output.logits.flatten(0, 1).float(), labels.flatten())

        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, problem = prepare(model, (ids,), loss_fn=loss_fn)
            cells.append(simulate(problem, ()).peak_bytes)
            if device == "cpu":
                measured = peak_memory(model, (ids,), loss_fn=loss_fn).peak_bytes
    meta, cpu = cells
    return f"| {name} | {_compare(meta, measured)} | {_compare(cpu, measured)} |"


def main() -> None:
    warnings.simplefilter("ignore")
    print("| model | precision | no checkpointing: predicted vs measured | plan at half way |")
    print("|---|---|---|---|")
    for name in ("GPT-2", "Llama", "BERT"):
        for precision in ("float32", "around", "inside"):
            print(row(name, precision), flush=True)
    print()
    print("| model | built on meta: predicted vs measured (CPU-built) | built on the CPU |")
    print("|---|---|---|")
    for name in ("GPT-2", "Llama", "BERT"):
        print(meta_row(name), flush=True)


if __name__ == "__main__":
    main()
