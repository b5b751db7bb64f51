"""The step-function form: write the whole training step as you would for torch.compile, and
memplan captures, plans and runs exactly that.

    python examples/step_function.py

A small GPT-2 (HF config, random weights) trained with gradient accumulation over two
micro-batches, float16 autocast with a GradScaler, gradient clipping and an LR schedule,
checked step by step against the same function run eagerly.
"""

from __future__ import annotations

import copy

import transformers

import memplan
import torch
from memplan.torch.equivalence import differences, snapshot


def make_objects(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    return optimizer, scheduler, scaler


def make_step(model, optimizer, scheduler, scaler):
    def train_step(batch):
        total = 0.0
        for micro in (
            dict(zip(batch, v, strict=True)) for v in zip(*(t.chunk(2) for t in batch.values()), strict=True)
        ):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**micro).loss / 2
            scaler.scale(loss).backward()
            total = total + loss.detach()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad()
        return total

    return train_step


def main() -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=2, n_positions=64)
    eager_model = transformers.GPT2LMHeadModel(config)
    model = copy.deepcopy(eager_model)
    optimizer, scheduler, scaler = make_objects(model)
    eager_objects = make_objects(eager_model)

    train_step = memplan.compile(
        make_step(model, optimizer, scheduler, scaler),
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
    )
    eager_step = make_step(eager_model, *eager_objects)

    for k in range(4):
        ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(k))
        batch = {"input_ids": ids, "labels": ids}
        torch.manual_seed(k)
        loss = train_step(batch)
        torch.manual_seed(k)
        eager_loss = eager_step(batch)
        differ = differences(snapshot(eager_model, eager_objects[0]), snapshot(model, optimizer))
        print(
            f"step {k}: loss {loss.item():.6f} (eager {eager_loss.item():.6f}), scale {scaler.get_scale():g}, "
            f"{'bit-identical to eager' if not differ else 'DIFFERS: ' + differ[0]}"
        )
        assert not differ and torch.equal(loss, eager_loss)
    print(
        f"planned peak {train_step.report['planned_peak_bytes'] / 2**20:.1f} MiB "
        f"(program order {train_step.report['program_order_peak_bytes'] / 2**20:.1f} MiB)"
    )


if __name__ == "__main__":
    main()
