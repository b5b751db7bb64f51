"""A budget that holds from the first call (issue 33): train under a hard memory limit.

``memplan run MODEL -b N --optimizer adamw --budget fit --steps K --json F`` runs in a child
process under a real memory limit (a cgroup made for it by :mod:`memplan.torch.memlimit`;
the RSS watcher where no cgroup can be made, and the table says which). Inside, eager
PyTorch tries K steps in a fresh process under that limit, then memplan trains K steps in
the CLI's own process with ``memory_budget="fit"`` (every step from the first, capture,
planning and recording included, measured). Eager's math is then computed once more without
the limit, and memplan's loss bits and parameter digests after every step are compared with
it: the steps must be bit-identical.

    python bench/fit_first_call.py                       # GPT-2 (2 layers), batch 16, 2600 MiB
    python bench/fit_first_call.py --model gpt2-2l --batch 16 --limit-mib 2600 --steps 5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from memplan.torch.memlimit import run_limited

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-2l")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--limit-mib", type=int, default=2600)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    parser.add_argument("--json", type=Path, default=None, help="also write every number here")
    parser.add_argument("--render", type=Path, default=None, help="print the table of a saved --json run, run nothing")
    args = parser.parse_args()
    if args.render is not None:
        print(markdown(json.loads(args.render.read_text())))
        return
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "run.json"
        command = [
            *(sys.executable, "-m", "memplan.cli", "run", args.model, "-b", str(args.batch)),
            *("--optimizer", args.optimizer, "--budget", "fit", "--steps", str(args.steps)),
            *("--json", str(report_path), "--quiet"),
        ]
        limited = run_limited(command, args.limit_mib * MIB, timeout=args.timeout)
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        reference = eager_reference(args, Path(tmp) / "eager.json")
    results = summarize(args, command, limited, report, reference)
    table = markdown(results)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


def eager_reference(args: argparse.Namespace, out: Path) -> dict[str, Any] | None:
    """Eager's steps without the limit (same seeds): the math memplan must equal bit for bit."""
    side = [sys.executable, "-m", "memplan.torch.run.limited", "eager", args.model, str(args.batch)]
    side += [str(args.steps), args.optimizer, "fit", "10", "0", str(out)]
    done = subprocess.run(side, capture_output=True, text=True, timeout=args.timeout)
    return json.loads(out.read_text()) if done.returncode == 0 and out.exists() else None


def summarize(
    args: argparse.Namespace, command: list[str], limited: Any, report: dict[str, Any] | None, ref: dict | None
) -> dict[str, Any]:
    memplan_steps = (report or {}).get("memplan", {}).get("per_step") or []
    keys = ("loss_bits", "state_digest")
    ref_steps = (ref or {}).get("steps", [])
    identical = (
        bool(memplan_steps)
        and ref is not None
        and len(memplan_steps) == len(ref["steps"])
        and all(a[k] == b[k] for a, b in zip(memplan_steps, ref["steps"], strict=True) for k in keys)
    )
    return {
        "command": " ".join(["memplan", *command[3:]]).replace(" --quiet", ""),
        "limit_bytes": args.limit_mib * MIB,
        "mechanism": limited.mechanism,
        "enforced": limited.enforced,
        "note": limited.note,
        "outcome": limited.outcome,
        "group_peak_bytes": limited.peak_bytes,
        "oom_killed_in_group": limited.oom_killed,
        "report": report,
        "identical_to_unlimited_eager": identical,
        "unlimited_eager_peak_rss_bytes": max((x["peak_rss_bytes"] for x in ref_steps), default=None),
        "stderr_tail": limited.stderr[-1500:],
    }


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.0f} MiB"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(r: dict[str, Any]) -> str:
    rep = r["report"] or {}
    m, e = rep.get("memplan", {}), rep.get("eager", {})
    lines = [
        f"`{r['command']}` under a {r['limit_bytes'] // MIB} MiB limit ({r['mechanism']}"
        + ("" if r["enforced"] else f": {r['note']}")
        + f"): `python bench/fit_first_call.py --limit-mib {r['limit_bytes'] // MIB}`",
        "",
        "| | memplan (`--budget fit`) | eager PyTorch |",
        "|---|---|---|",
        f"| outcome | {m.get('outcome', r['outcome'])} | {e.get('outcome', '-')} |",
        f"| peak RSS, first step | {_mib(m.get('first_step_peak_rss_bytes'))} | "
        f"{_mib(e.get('first_step_peak_rss_bytes'))} |",
        f"| peak RSS, every step | {_mib(m.get('peak_rss_bytes'))} | {_mib(e.get('peak_rss_bytes'))} |",
        f"| step seconds (median, steady) | {_seconds(m.get('step_seconds'))} | {_seconds(e.get('step_seconds'))} |",
        "",
        f"limit seen by memplan {_mib(rep.get('limit_bytes'))} ({rep.get('limit_source')}), margin "
        f"{_mib(rep.get('margin_bytes'))}, budget {_mib(rep.get('budget_bytes'))}; planned peak "
        f"{_mib(rep.get('planned_peak_bytes'))}, compute overhead +{100 * (rep.get('overhead') or 0):.1f}%, "
        f"{rep.get('recomputed_ops')} recomputed ops; held: {rep.get('held')}.",
        f"the cgroup's peak charge over the whole run (eager's child, memplan's process, page cache; "
        f"eager's child reaches the limit when it is killed): {_mib(r['group_peak_bytes'])}.",
        f"every step's loss bits and parameter digest equal to eager's without the limit: "
        f"{r['identical_to_unlimited_eager']} (eager's peak RSS there: {_mib(r['unlimited_eager_peak_rss_bytes'])}).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
