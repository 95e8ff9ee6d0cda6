"""Choose micro-batch size, accumulation steps and checkpointing for a global batch, then train.

Run: python examples/plan_batch.py   (CPU: under a minute on a 2-core machine; 12.5 s, 32 s)

The budget is set between what micro-batches of 4 and of 8 need without checkpointing, so the
table shows the trade-off: small micro-batches fit as they are but take more steps; the whole
batch in one step needs recompute (or does not fit at all).
"""

import torch

import planner
from planner.batch import plan_batch
from planner.training import micro_batches

CONFIG = dict(layers=4, d_model=64, heads=4, seq=64, vocab=256, dropout=0.0)
GLOBAL_BATCH = 16


def make_inputs(batch_size):
    """Example (idx, targets) for ``batch_size`` sequences: only their shapes matter."""
    return planner.zoo.gpt(**CONFIG, batch=batch_size)[1]


def main():
    model, _ = planner.zoo.gpt(**CONFIG, batch=1)
    budget_bytes = 9 * 2**20
    choice = plan_batch(model, make_inputs, budget_bytes=budget_bytes, global_batch=GLOBAL_BATCH)
    print(choice)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = make_inputs(GLOBAL_BATCH)
    for step in range(3):
        for micro in micro_batches(batch, choice.micro_batch):
            with micro:
                micro.backward(choice.module(*micro.data))  # the model returns its mean loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            print(f"step {step}: loss {model(*batch).item():.4f}")


if __name__ == "__main__":
    main()
