"""Two optimizers under a memory budget: Muon for the hidden matrices, AdamW for the rest (the
split LLM training uses), on GPT-2 with 2 layers (batch 16 x 128 tokens), side by side with eager.

python examples/muon_adamw_budget.py
"""

from __future__ import annotations

import copy

import memplan
import torch
from memplan.torch.zoo import build_workload

BUDGET = "1.3GiB"  # the step's whole peak; checkpoint-all needs 1.51 GiB, the floor is 1.12 GiB


def optimizers(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """Muon for the 2-D weights of the blocks, AdamW for embeddings, norms and biases."""
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "wte" not in n and "wpe" not in n]
    rest = [p for p in model.parameters() if not any(p is m for m in matrices)]
    return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.1)]


def main() -> None:
    work = build_workload("gpt2-2l", 16, seed=0)
    model, eager = work.model, copy.deepcopy(work.model)
    mine, theirs = optimizers(model), optimizers(eager)

    def train_step(net: torch.nn.Module, opts: list[torch.optim.Optimizer]):
        def step(batch):
            for opt in opts:
                opt.zero_grad()
            loss = work.loss_fn(net(batch[0]), batch[1])
            loss.backward()
            for opt in opts:
                opt.step()
            return loss.detach()

        return step

    planned = memplan.compile(train_step(model, mine), model=model, optimizer=mine, memory_budget=BUDGET)
    reference = train_step(eager, theirs)
    batch = (work.inputs, work.target)
    for k in range(3):
        # eager first: the budget holds for the whole process, so memory eager's first step takes
        # after memplan's first call would count against it
        torch.manual_seed(k)  # GPT-2's dropout: the same draws on both sides
        eager_loss = reference(batch)
        torch.manual_seed(k)
        loss = planned(batch)
        print(f"step {k}: loss {loss.item():.6f}, eager {eager_loss.item():.6f}")
        assert torch.equal(loss, eager_loss)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters(), strict=True))
    budget = planned.report["budget"]
    print(
        f"parameters bit-identical to eager: {same}; {budget['method']}: planned peak "
        f"{budget['planned_peak_bytes'] / 2**30:.2f} GiB within {BUDGET}, {budget['recomputed_ops']} ops recomputed "
        f"(+{100 * budget['overhead']:.3f}% compute)"
    )
    assert same


if __name__ == "__main__":
    main()
