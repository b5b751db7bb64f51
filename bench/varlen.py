"""Variable-length batches: GPT-2 (2 layers, HF config), AdamW, batch 2, sequence lengths drawn
at random from LENGTHS, eager PyTorch vs one ``memplan.compile_step`` (Sekiyama et al. 4.3: one
arena for every length, plans kept up to ``max_plans``, least recently used evicted).

Each side trains in a fresh process of its own from the same initial weights and the same
batches and seeds; after every step it reads the process's peak resident set during that step
(``VmHWM``, reset through ``/proc/self/clear_refs`` before the step). Numerics: every step's
loss and the final parameters are compared between the two processes (bitwise).

    python bench/varlen.py                   # writes bench/results/varlen.md
    python bench/varlen.py --steps 20 --max-plans 4

Issue 37 (one plan for a range of lengths): ``--lengths 40:128:12 --per-length 3`` runs every one
of 12 lengths from 40 to 128 three times in random order; ``--dynamic 128`` declares
``dynamic={1: 128}`` (the largest length planned first, every length reuses that plan);
``--model llama`` is a small Llama-style decoder built from an HF ``LlamaConfig``. Besides wall
seconds, each step's CPU seconds (this process and its children: the solvers run in one) are
kept, as the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LENGTHS = (40, 51, 62, 73, 84, 95, 106, 117, 128)  # nine lengths between 40 and 128 tokens
MODEL = "gpt2-2l"
BATCH = 2


def length_order(steps: int, seed: int, lengths: tuple[int, ...] = LENGTHS, per_length: int = 0) -> list[int]:
    """Every length once in random order, then random lengths: the shapes a loader without
    fixed padding gives. ``per_length``: every length exactly that many times, shuffled."""
    rng = random.Random(seed)
    if per_length:
        order = [n for n in lengths for _ in range(per_length)]
        rng.shuffle(order)
        return order
    order = rng.sample(lengths, len(lengths))
    return (order + [rng.choice(lengths) for _ in range(max(0, steps - len(order)))])[:steps]


def parse_lengths(text: str | None) -> tuple[int, ...]:
    """``"40:128:12"``: 12 lengths evenly from 40 to 128; ``"40,64,128"``: those; None: LENGTHS."""
    if not text:
        return LENGTHS
    if ":" in text:
        lo, hi, n = (int(x) for x in text.split(":"))
        return tuple(sorted({round(lo + (hi - lo) * k / (n - 1)) for k in range(n)}))
    return tuple(int(x) for x in text.split(","))


def cpu_seconds() -> float:
    """CPU seconds of this process and of its waited-for children (the solvers' child)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def build_model(name: str, batch: int, seed: int) -> Any:
    """The zoo's GPT-2 (2 layers), or ``"llama"``: a 2-layer Llama-style decoder (RMSNorm, RoPE,
    SwiGLU, grouped-query attention) from an HF ``LlamaConfig``, hidden 256, vocab 32000."""
    from memplan.torch.zoo import Workload, build_workload

    if name != "llama":
        return build_workload(name, batch, seed=seed)
    import transformers

    import torch
    from memplan.torch.zoo import Logits, _token_loss

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        attn_implementation="eager",
    )
    model = Logits(transformers.LlamaForCausalLM(config))
    ids = torch.randint(0, 32000, (batch, 16))
    return Workload(model, ids, ids, _token_loss)


def train(
    side: str, lengths: list[int], seed: int, max_plans: int, state_path: str, options: dict[str, Any]
) -> dict[str, Any]:
    """Train one side in this process; per step: length, peak RSS during the step, RSS after,
    seconds, loss (as bytes, for a bitwise comparison) and memplan's plan counters."""
    import memplan  # noqa: F401  (solvers before the allocator)
    import torch
    from memplan.api import compile_step
    from memplan.torch.rss import peak_rss_bytes, reset_peak_rss, rss_bytes
    from memplan.torch.zoo import make_optimizer

    batch_size = options.get("batch", BATCH)
    w = build_model(options.get("model", MODEL), batch_size, seed)
    model = w.model.train()
    vocab = model.model.config.vocab_size
    optimizer = make_optimizer("adamw", model.parameters())

    def batch_of(step: int, length: int) -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(seed * 100_003 + step)
        return torch.randint(0, vocab, (batch_size, length), generator=g), torch.randint(
            0, vocab, (batch_size, length), generator=g
        )

    compiled = None
    dynamic = {1: options["dynamic"]} if options.get("dynamic") else None
    if side != "eager":
        cpu_start, wall_start = cpu_seconds(), time.perf_counter()
        compiled = compile_step(
            model,
            optimizer,
            w.loss_fn,
            batch_of(0, lengths[0]),
            allocator=side,
            max_plans=max_plans,
            dynamic=dynamic,
        )
        compile_cpu, compile_wall = cpu_seconds() - cpu_start, time.perf_counter() - wall_start

    def eager_step(batch: tuple[Any, Any]) -> Any:
        loss = w.loss_fn(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    rows = []
    for step, length in enumerate(lengths):
        batch = batch_of(step, length)
        reset_peak_rss()
        torch.manual_seed(seed + step)  # dropout
        start, cpu_start = time.perf_counter(), cpu_seconds()
        # replayed: served at planned offsets in the arena (else the ordinary allocator: first visit, recording)
        replayed = compiled is not None and getattr(compiled.runner_for(batch), "replaying", True)
        loss = eager_step(batch) if compiled is None else compiled(batch)
        seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
        if compiled is not None and step == 0:  # compile_step planned the first shape: count it in step 0
            seconds, cpu = seconds + compile_wall, cpu + compile_cpu
        row = {
            "step": step,
            "length": length,
            "peak_rss_bytes": peak_rss_bytes(),
            "rss_after_bytes": rss_bytes(),
            "seconds": seconds,
            "cpu_seconds": cpu,
            "loss": float(loss),
            "replayed": replayed,
            "loss_hex": loss.float().numpy().tobytes().hex(),
        }
        if compiled is not None:
            row |= {
                "plans_made": compiled.plans_made,
                "plans_reused": compiled.plans_reused,
                "plans_kept": len(compiled.runners),
                "evictions": compiled.evictions,
                "planning_seconds": compiled.planning_seconds,
                "arena_bytes": compiled.arena.nbytes,
                "arena_allocations": compiled.arena.allocations,
            }
        rows.append(row)
        print(side, json.dumps({k: v for k, v in row.items() if k != "loss_hex"}), file=sys.stderr, flush=True)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, state_path)
    return {"side": side, "rows": rows, "shape_log": compiled.shape_log if compiled is not None else []}


def run_side(
    side: str, lengths: list[int], seed: int, max_plans: int, state_path: str, options: dict[str, Any]
) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    before = os.getloadavg()[0]
    with context.Pool(1) as pool:
        result = pool.apply(train, (side, lengths, seed, max_plans, state_path, options))
    result["load_average"] = [before, os.getloadavg()[0]]  # 1-minute load at the start and the end
    return result


def max_param_diff(a_path: str, b_path: str) -> float:
    import torch

    a, b = torch.load(a_path), torch.load(b_path)
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def report(args: argparse.Namespace, lengths: list[int], eager: dict, planned: dict, param_diff: float) -> str:
    e_rows, m_rows = eager["rows"], planned["rows"]
    longest = max(lengths)
    eager_longest = max(r["peak_rss_bytes"] for r in e_rows if r["length"] == longest)
    eager_peak = max(r["peak_rss_bytes"] for r in e_rows)
    memplan_peak = max(r["peak_rss_bytes"] for r in m_rows)
    last = m_rows[-1]
    loss_diffs = [abs(e["loss"] - m["loss"]) for e, m in zip(e_rows, m_rows, strict=True)]
    bitwise = sum(e["loss_hex"] == m["loss_hex"] for e, m in zip(e_rows, m_rows, strict=True))
    eager_seconds = sum(r["seconds"] for r in e_rows)
    memplan_seconds = sum(r["seconds"] for r in m_rows)
    command = " ".join(["python bench/varlen.py", *sys.argv[1:]])
    model = "a Llama-style decoder (2 layers, hidden 256)" if args.model == "llama" else "GPT-2 (2 layers)"
    dynamic = f", `dynamic={{1: {args.dynamic}}}`" if args.dynamic else ""
    lines = [
        f"# Variable-length batches: {model}, AdamW, batch {args.batch} (CPU)",
        "",
        f"Regenerate: `{command}`",
        "",
        f"{len(lengths)} steps over {len(set(lengths))} lengths ({', '.join(map(str, sorted(set(lengths))))} tokens) "
        f"in random order (seed {args.seed}); memplan: one `compile_step`, allocator `{planned['allocator']}`, "
        f"`max_plans={args.max_plans}`{dynamic}. Each side in a fresh process of its own.",
        "",
        "| | eager | memplan |",
        "|---|---|---|",
        f"| peak RSS of any step | {mib(eager_peak)} | {mib(memplan_peak)} |",
        f"| peak RSS of any step after the first (which creates AdamW's state) | "
        f"{mib(max(r['peak_rss_bytes'] for r in e_rows[1:]))} | {mib(max(r['peak_rss_bytes'] for r in m_rows[1:]))} |",
        f"| peak RSS of a step at the longest length ({longest}) | {mib(eager_longest)} | "
        f"{mib(max(r['peak_rss_bytes'] for r in m_rows if r['length'] == longest))} |",
        f"| peak RSS of a step replayed in the arena / of one on the ordinary allocator | - | "
        f"{mib(max((r['peak_rss_bytes'] for r in m_rows if r['replayed']), default=0))} / "
        f"{mib(max((r['peak_rss_bytes'] for r in m_rows if not r['replayed']), default=0))} |",
        f"| RSS after the last step | {mib(e_rows[-1]['rss_after_bytes'])} | {mib(last['rss_after_bytes'])} |",
        f"| seconds, all steps (planning and recording included) | {eager_seconds:.1f} | {memplan_seconds:.1f} |",
        *_cpu_rows(e_rows, m_rows),
        *_load_row(eager, planned),
        f"| plans made / kept at the end / evicted | - | {last['plans_made']} / {last['plans_kept']} / "
        f"{last['evictions']} |",
        f"| shapes that reused a plan made for another (issue 37) | - | {last.get('plans_reused', 0)} |",
        f"| seconds spent planning (capture, order, placement) | - | {last['planning_seconds']:.1f} |",
        f"| largest shared arena held / times (re)allocated | - | {mib(max(r['arena_bytes'] for r in m_rows))} / "
        f"{last['arena_allocations']} |",
        f"| steps replayed in the arena / run on the ordinary allocator (first visit, recording) | - | "
        f"{sum(r['replayed'] for r in m_rows)} / {sum(not r['replayed'] for r in m_rows)} |",
        f"| steps whose loss is bitwise eager's | {len(lengths)} | {bitwise} |",
        f"| max abs diff of the loss over all steps | - | {max(loss_diffs)} |",
        f"| max abs diff of the parameters after the last step | - | {param_diff} |",
        "",
        f"memplan's peak RSS is {'at or below' if memplan_peak <= eager_longest else 'ABOVE'} eager's peak at the "
        f"longest length ({memplan_peak / eager_longest:.3f}x).",
        "",
        "Step by step (peak RSS during the step, `VmHWM` reset before it):",
        "",
        "| step | length | eager peak RSS | memplan peak RSS | memplan replayed | loss diff | memplan plans made "
        "| memplan s | eager s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e, m, d in zip(e_rows, m_rows, loss_diffs, strict=True):
        lines.append(
            f"| {e['step']} | {e['length']} | {mib(e['peak_rss_bytes'])} | {mib(m['peak_rss_bytes'])} "
            f"| {'yes' if m['replayed'] else 'no'} | {d} "
            f"| {m['plans_made']} | {m['seconds']:.2f} | {e['seconds']:.2f} |"
        )
    lines += _shape_rows(planned.get("shape_log", []))
    if m_rows[-1].get("plans_reused"):
        return "\n".join([*lines, "", REUSE_NOTE]) + "\n"
    lines += [
        "",
        "RSS is the whole process: interpreter, torch's libraries, model, AdamW state, and for memplan its kept "
        "captures and plans (Python objects no plan counts) and the one shared arena. A step of a new length first "
        "runs on the ordinary allocator (its first visit runs under the self-check, the next two are recorded until "
        "two agree; the arena is released meanwhile, and the heap trimmed after each), so the first three visits of "
        "a length cost what eager's step costs plus planning, and its later visits replay in the arena. Timings on a "
        "shared 2-core machine are noisy: rerun on a quiet machine.",
    ]
    return "\n".join(lines) + "\n"


REUSE_NOTE = (
    "RSS is the whole process: interpreter, torch's libraries, model, AdamW state, and for memplan its kept "
    "captures and plans and the one shared arena. Issue 37: with `dynamic=`, the step is captured once more at the "
    "declared largest length with that length a symbol (`memplan.torch.capture.symbolic`: a FakeTensorMode with a "
    "ShapeEnv), related node by node to the concrete capture there; a new length whose guards hold (the checked "
    "column: `guards`) gets its program from it, every size and length-dependent argument evaluated at that length, "
    "without tracing (fake runs 0), and reuses the largest plan's order and placement, validated for it "
    "(`memplan.torch.run.shapes`). Where a guard fails (a Python branch on the length) or the symbolic capture "
    "could not be made, the length is traced as before (`traced` and why): once a kept capture shows the steady "
    "state (AdamW's state exists) it stands for the untraced run, one fake run instead of two. Its first step runs "
    "under the light self-check when that program passed the full one. The step that creates AdamW's state gives "
    "the arena's dead pages back before the optimizer's call (`memplan.torch.run.first_state`). With arena views a "
    "reused length runs planned from its first visit; with the planned allocator its first visit (or two) runs on "
    "the ordinary allocator and is recorded, then served at the kept plan's offsets. Seconds include "
    "compile_step's first plan and the symbolic capture (in step 0). Timings on a shared 2-core machine are noisy "
    "(the load average row): the CPU seconds are the steadier ratio; rerun on a quiet machine."
)


def _cpu_rows(e_rows: list[dict], m_rows: list[dict]) -> list[str]:
    """CPU seconds (process and children) and the ratio of both clocks: on a shared machine the
    CPU seconds are the steadier measure of the work done."""
    if "cpu_seconds" not in e_rows[0]:
        return []
    e_cpu, m_cpu = sum(r["cpu_seconds"] for r in e_rows), sum(r["cpu_seconds"] for r in m_rows)
    e_wall, m_wall = sum(r["seconds"] for r in e_rows), sum(r["seconds"] for r in m_rows)
    return [
        f"| CPU seconds, all steps (process and its children: solvers included) | {e_cpu:.1f} | {m_cpu:.1f} |",
        f"| memplan / eager: wall seconds, CPU seconds | - | {m_wall / e_wall:.2f}x, {m_cpu / e_cpu:.2f}x |",
    ]


def _load_row(eager: dict, planned: dict) -> list[str]:
    """The machine's 1-minute load average at the start and the end of each side's run."""
    if "load_average" not in eager or "load_average" not in planned:
        return []
    e, m = eager["load_average"], planned["load_average"]
    row = f"| load average (1 min) at the start / end of the run | {e[0]:.1f} / {e[1]:.1f} | {m[0]:.1f} / {m[1]:.1f} |"
    return [row]


def _shape_rows(log: list[dict]) -> list[str]:
    """Which plan each new shape used and what capture and planning cost it."""
    if not log:
        return []
    if not any("fake_runs" in r for r in log):
        lines = ["", "Which plan each new shape used (capture and planning seconds):", "", "| shape | plan | s |"]
        lines.append("|---|---|---|")
        lines += [f"| {r['shape']} | {r['plan']} | {r['seconds']:.2f} |" for r in log]
        return lines
    if not any("checked" in r for r in log):
        lines = ["", "Which plan each new shape used (capture and planning seconds; fake runs of the step in its "]
        lines[-1] += "capture):"
        lines += ["", "| shape | plan | fake runs | s |", "|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['plan']} | {r.get('fake_runs', '-')} | {r['seconds']:.2f} |" for r in log]
        return lines
    lines = ["", "Which plan each new shape used, how its program was checked (issue 37: `guards`: the symbolic "]
    lines[-1] += "capture's guards evaluated at its length, no trace; `traced` and why), capture and planning "
    lines[-1] += "seconds, fake runs of the step:"
    lines += ["", "| shape | plan | checked | fake runs | s |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['shape']} | {r['plan']} | {r.get('checked', '-')} | {r.get('fake_runs', '-')} | {r['seconds']:.2f} |"
        for r in log
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-plans", type=int, default=8)
    parser.add_argument("--allocator", default="auto", choices=["auto", "replay", "views"])
    parser.add_argument("--model", default=MODEL, choices=[MODEL, "llama"])
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--lengths", default=None, help='"lo:hi:n" (n lengths from lo to hi) or "a,b,c"')
    parser.add_argument("--per-length", type=int, default=0, help="run every length this many times (--steps unused)")
    parser.add_argument("--dynamic", type=int, default=0, help="declare dynamic={1: N}: plan length N first")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "varlen.md"))
    parser.add_argument("--from-json", default=None, help="rebuild the table from a previous run's JSON")
    args = parser.parse_args()
    out = Path(args.out)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        lengths = [r["length"] for r in saved["eager"]["rows"]]
        if not args.lengths:  # a run of the default form: name its number of steps
            sys.argv = [sys.argv[0], *(["--steps", str(len(lengths))] if len(lengths) != 50 else [])]
        else:  # the flags given again with --from-json name the run (--from-json itself dropped)
            at = sys.argv.index("--from-json")
            sys.argv = sys.argv[:at] + sys.argv[at + 2 :]
        saved["memplan"].setdefault("allocator", args.allocator)
        out.write_text(report(args, lengths, saved["eager"], saved["memplan"], saved["param_diff"]))
        return
    lengths = length_order(args.steps, args.seed, parse_lengths(args.lengths), args.per_length)
    from memplan.api import resolve_allocator

    allocator = resolve_allocator(args.allocator)
    options = {"model": args.model, "batch": args.batch, "dynamic": args.dynamic}
    with tempfile.TemporaryDirectory() as tmp:
        eager = run_side("eager", lengths, args.seed, args.max_plans, f"{tmp}/eager.pt", options)
        planned = run_side(allocator, lengths, args.seed, args.max_plans, f"{tmp}/memplan.pt", options)
        planned["allocator"] = allocator
        param_diff = max_param_diff(f"{tmp}/eager.pt", f"{tmp}/memplan.pt")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report(args, lengths, eager, planned, param_diff))
    out.with_suffix(".json").write_text(json.dumps({"eager": eager, "memplan": planned, "param_diff": param_diff}))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
