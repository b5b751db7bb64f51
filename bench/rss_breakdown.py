"""Where memplan's resident set goes beyond its plan (issue 15), on one zoo model.

Two fresh processes (spawned), one per side, each after the warm-up (memplan: planned,
generated and replaying, then one step more), with the C library's free pages handed back
(``memplan.torch.rss.release_free_memory``) before every reading:

- eager: RSS after the warm-up with torch only; then after ``import memplan.api`` (OR-Tools,
  and pandas, which OR-Tools' CP-SAT module imports): the libraries' share. The run benchmark's
  eager process (``memplan.torch.compare.steady_state_rss``) has them loaded too.
- memplan: RSS at steady state, the arena, the Python heap (pymalloc's bytes in allocated
  blocks, ``sys._debugmallocstats``), then the same with the whole compiled step dropped
  (captures, graphs, plans, instructions, generated code, arena): what memplan's objects hold,
  and what stays resident without them (heap pages pinned by objects planning left scattered,
  modules only capture imports).

    python bench/rss_breakdown.py mobilenet-v2 --batch 1
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import re
import sys
from typing import Any

MIB = 2**20


def python_heap_bytes() -> int:
    """Bytes in pymalloc's allocated blocks (the small-object heap), parsed from
    ``sys._debugmallocstats`` (written to stderr, so read through a pipe)."""
    read, write = os.pipe()
    saved = os.dup(2)
    os.dup2(write, 2)
    try:
        sys._debugmallocstats()
    finally:
        os.dup2(saved, 2)
        os.close(write)
        os.close(saved)
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    found = re.search(r"bytes in allocated blocks\s+=\s+([\d,]+)", b"".join(chunks).decode())
    return int(found.group(1).replace(",", "")) if found else 0


def _resident() -> int:
    from memplan.torch.rss import release_free_memory, rss_bytes

    release_free_memory()
    return rss_bytes()


def _eager(model: str, batch: int) -> dict[str, Any]:
    from memplan.torch.zoo import build_workload, make_optimizer

    w = build_workload(model, batch, seed=0)
    w.model.train()
    optimizer = make_optimizer("adam", w.model.parameters())
    for _ in range(3):
        optimizer.zero_grad()
        w.loss_fn(w.model(w.inputs), w.target).backward()
        optimizer.step()
    torch_only = _resident()
    import memplan.api  # noqa: F401

    return {"rss": torch_only, "rss_with_memplan_imported": _resident(), "python_heap": python_heap_bytes()}


def _memplan(model: str, batch: int) -> dict[str, Any]:
    import memplan.api
    from memplan.torch.zoo import build_workload, make_optimizer

    w = build_workload(model, batch, seed=0)
    w.model.train()
    optimizer = make_optimizer("adam", w.model.parameters())
    step = memplan.api.CompiledStep.of_loss(w.model, optimizer, w.loss_fn, allocator="auto")
    batch_ = (w.inputs, w.target)
    runner = step.runner_for(batch_)
    for _ in range(8):
        step(batch_)
        if getattr(runner, "replaying", True):
            break
    step(batch_)
    arena = step.arena.tensor.numel()
    report = {"rss": _resident(), "arena": arena, "python_heap": python_heap_bytes()}
    del runner
    step._kept = None
    step.arena.release()
    del step
    gc.collect()
    report.update(rss_without_step=_resident(), python_heap_without_step=python_heap_bytes())
    return report


def _in_fresh_process(fn: Any, *args: Any) -> dict[str, Any]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    e = _in_fresh_process(_eager, args.model, args.batch)
    m = _in_fresh_process(_memplan, args.model, args.batch)
    lines = [
        f"{args.model}, batch {args.batch} (MiB; RSS after the warm-up, free heap pages released)",
        f"eager RSS, torch only:                          {e['rss'] / MIB:8.1f}",
        f"eager RSS, memplan.api imported (OR-Tools, pandas): {e['rss_with_memplan_imported'] / MIB:8.1f}"
        f"  (+{(e['rss_with_memplan_imported'] - e['rss']) / MIB:.1f})",
        f"memplan RSS at steady state:                    {m['rss'] / MIB:8.1f}",
        f"  of which the arena:                           {m['arena'] / MIB:8.1f}",
        f"  beyond eager (memplan imported) and arena:    "
        f"{(m['rss'] - m['arena'] - e['rss_with_memplan_imported']) / MIB:8.1f}",
        f"Python heap, eager / memplan:                   {e['python_heap'] / MIB:8.1f} / {m['python_heap'] / MIB:.1f}",
        f"memplan's objects (heap freed by dropping the step): "
        f"{(m['python_heap'] - m['python_heap_without_step']) / MIB:8.1f}",
        f"memplan RSS with the step and arena dropped:    {m['rss_without_step'] / MIB:8.1f}"
        f"  (RSS given back beyond the arena: {(m['rss'] - m['arena'] - m['rss_without_step']) / MIB:.1f})",
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
