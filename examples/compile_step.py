"""The short form: the classic loop ``loss_fn(model(x), y); backward; step; zero_grad``.

python examples/compile_step.py
"""

from __future__ import annotations

import copy

import memplan
import torch


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(256, 10)
    )
    eager = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9, foreach=True)
    loss_fn = torch.nn.functional.cross_entropy
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    step = memplan.compile_step(model, optimizer, loss_fn, (x, y))
    for k in range(3):
        torch.manual_seed(k)
        loss = step((x, y))
        torch.manual_seed(k)
        eager_loss = loss_fn(eager(x), y)
        eager_loss.backward()
        eager_optimizer.step()
        eager_optimizer.zero_grad()
        print(f"step {k}: loss {loss.item():.6f}, eager {eager_loss.item():.6f}")
        assert torch.equal(loss, eager_loss.detach())
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters(), strict=True))
    print(f"parameters bit-identical to eager: {same}; plan: {step.report['planned_peak_bytes'] / 2**20:.2f} MiB")
    assert same


if __name__ == "__main__":
    main()
