"""Remat proofs: memplan's remat solve against a CP peer of Moccasin's formulation (issue 36).

Graphs (each solved at 0.9 and 0.8 of its checkpoint-all peak):

* the captured zoo (memplan's capture, SGD, marks kept, as ``memory_budget=`` sees it) at batch
  sizes where activations dominate the peak;
* segmentation networks built here in PyTorch and captured the same way: an FCN-8s-like
  encoder-decoder (VGG-style encoder, transposed-convolution decoder, skip additions from
  pool3 and pool4) and a SegNet-like one (encoder conv-BN-ReLU blocks with max-pool indices,
  decoder max-unpool blocks);
* random layered DAGs (``bench/remat_graphs.py``'s generator, after Moccasin's benchmark).

Per graph and budget, each with the same time limit and 2 workers, one after the other:

* memplan: :func:`memplan.remat.solve_remat` (the portfolio ``memory_budget=`` runs) with the
  gap limit below;
* peer: :func:`memplan.remat.peer.solve_peer` (Moccasin's two phases, CP-SAT defaults, no cuts,
  floors or warm starts; see there), with the same gap limit.

Columns: status, compute overhead over one plain step (cost = FLOPs; layered DAGs: their
durations), bound (as overhead), gap (relative to the plan's compute), time to proof (seconds
from the call's start until the plan is proven optimal or within the gap limit; '-' without a
proof). Each status speaks for its own scope: the peer's for plans with at most 2 runs per node
in program order, memplan's for the scope its bound names (plans whose first runs keep
program order, or at most 2 runs per node).

Regenerate: ``python bench/remat_proofs.py`` (writes bench/results/remat_proofs.md and .json;
about 15 minutes on 2 cores); ``--quick`` runs a subset (vgg16, fcn, layered-n100) in a few
minutes. Options: ``--only NAMES --fractions 0.9,0.8 --time-limit 30 --gap-limit 1e-4``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from memplan.graph.ir import Graph
from memplan.remat import solve_remat
from memplan.remat.baselines import checkpoint_all
from memplan.remat.coarsen import coarsen
from memplan.remat.peer import solve_peer
from memplan.remat.problem import RematProblem, RematSchedule, memory_floor
from remat_graphs import layered_dag

ROOT = Path(__file__).resolve().parent.parent
FRACTIONS = (0.9, 0.8)
ZOO = (("vgg16", 32), ("unet", 8), ("mobilenet-v2", 8), ("resnet50", 8))
"""(zoo model, batch size): batches where the activations dominate the step's peak."""
SEGMENTATION = (("fcn", 8), ("segnet", 8))
LAYERED = ((100, 0), (250, 1), (500, 2))
QUICK = ("vgg16", "fcn", "layered-n100")
COMPARED = {
    "remat_proofs_before.json": "before the exact covers: bounds.py as at commit c3b1565",
    "remat_proofs_before_stages.json": "before the exact stage cuts of memplan.remat.stage_bounds: the "
    "remat_proofs.json of commit 3fe3665",
}
"""What each earlier run's JSON that ``--compare`` takes was run with."""
GAP_LIMIT = 1e-4
"""Issue 36's target: optimal, or proven within 0.01% of the step's compute."""


def fcn_model(classes: int = 8, width: int = 16) -> Any:
    """An FCN-8s-like network (Long et al. 2015) at a small width: a VGG-style encoder of five
    conv blocks with pooling, a 1x1 score layer, and a decoder of transposed convolutions that
    adds the scores of pool4 and pool3 (the skip connections) before upsampling to the input."""
    import torch
    from torch import nn

    def block(cin: int, cout: int, convs: int) -> nn.Sequential:
        layers: list[nn.Module] = []
        for i in range(convs):
            layers += [nn.Conv2d(cin if i == 0 else cout, cout, 3, padding=1), nn.ReLU(inplace=True)]
        return nn.Sequential(*layers, nn.MaxPool2d(2))

    class FCN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            w = width
            self.b1, self.b2, self.b3 = block(3, w, 2), block(w, 2 * w, 2), block(2 * w, 4 * w, 3)
            self.b4, self.b5 = block(4 * w, 8 * w, 3), block(8 * w, 8 * w, 3)
            self.score5 = nn.Conv2d(8 * w, classes, 1)
            self.score4, self.score3 = nn.Conv2d(8 * w, classes, 1), nn.Conv2d(4 * w, classes, 1)
            self.up5 = nn.ConvTranspose2d(classes, classes, 4, stride=2, padding=1)
            self.up4 = nn.ConvTranspose2d(classes, classes, 4, stride=2, padding=1)
            self.up3 = nn.ConvTranspose2d(classes, classes, 16, stride=8, padding=4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            p3 = self.b3(self.b2(self.b1(x)))
            p4 = self.b4(p3)
            s = self.up5(self.score5(self.b5(p4))) + self.score4(p4)
            s = self.up4(s) + self.score3(p3)
            return self.up3(s)

    return FCN()


def segnet_model(classes: int = 8, width: int = 16) -> Any:
    """A SegNet-like network (Badrinarayanan et al. 2017) at a small width: four encoder blocks
    (conv-BN-ReLU twice, max-pool keeping its indices) and four decoder blocks (max-unpool with
    the encoder's indices, conv-BN-ReLU twice), then a 1x1 classifier."""
    import torch
    from torch import nn

    def cbr(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    class SegNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            chans = [3, width, 2 * width, 4 * width, 8 * width]
            self.enc = nn.ModuleList(nn.Sequential(*cbr(a, b), *cbr(b, b)) for a, b in itertools.pairwise(chans))
            outs = [*chans[1:-1][::-1], width]
            self.dec = nn.ModuleList(
                nn.Sequential(*cbr(a, a), *cbr(a, b)) for a, b in zip(chans[1:][::-1], outs, strict=True)
            )
            self.pool = nn.MaxPool2d(2, return_indices=True)
            self.unpool = nn.MaxUnpool2d(2)
            self.head = nn.Conv2d(width, classes, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            indices = []
            for enc in self.enc:
                x, idx = self.pool(enc(x))
                indices.append(idx)
            for dec, idx in zip(self.dec, reversed(indices), strict=True):
                x = dec(self.unpool(x, idx))
            return self.head(x)

    return SegNet()


def capture_segmentation(name: str, batch_size: int, image: int = 64, classes: int = 8) -> Graph:
    """Capture one training step (SGD with momentum, per-pixel cross entropy) of the FCN or
    SegNet above on FakeTensors, as the zoo's steps are captured."""
    import torch
    from memplan.torch.capture import capture_train_step
    from memplan.torch.capture.fake import new_fake_mode
    from memplan.torch.zoo import make_optimizer

    fake_mode = new_fake_mode()
    torch.manual_seed(0)
    with fake_mode:
        model = fcn_model(classes) if name == "fcn" else segnet_model(classes)
        inputs = torch.randn(batch_size, 3, image, image)
        target = torch.randint(0, classes, (batch_size, image, image))
        opt = make_optimizer("sgd", model.parameters())
    model.train()
    loss_fn = torch.nn.functional.cross_entropy
    return capture_train_step(model, opt, loss_fn, (inputs, target), name=f"{name}-b{batch_size}-train-sgd").graph


def graphs(only: set[str]) -> list[tuple[str, str, Graph]]:
    """(name, kind, graph) of every benchmark graph named in ``only`` (all when empty)."""
    from memplan.torch.zoo import capture_graph

    out: list[tuple[str, str, Graph]] = []
    for name, batch in ZOO:
        if not only or name in only:
            out.append((f"{name}-b{batch}", "zoo", capture_graph(name, batch_size=batch, optimizer="sgd")))
    for name, batch in SEGMENTATION:
        if not only or name in only:
            out.append((f"{name}-b{batch}", "segmentation", capture_segmentation(name, batch)))
    for nodes, seed in LAYERED:
        if not only or f"layered-n{nodes}" in only:
            out.append((f"layered-n{nodes}-s{seed}", "random layered DAG", layered_dag(seed, nodes)))
    return out


def mine(plan: RematSchedule, gap_limit: float) -> dict[str, Any]:
    """memplan's result as a row's cell."""
    feasible = plan.feasible
    plain = plan.plain_cost
    bound = plan.details.get("bound")
    gap = 0.0 if plan.status == "optimal" else plan.gap
    proven = plan.status == "infeasible" or (
        feasible and (plan.status == "optimal" or (gap is not None and gap <= gap_limit))
    )
    return {
        "status": plan.status,
        "overhead": plan.overhead if feasible else None,
        "cost": plan.compute_cost if feasible else None,
        "bound": (float(bound) - plain) / plain if isinstance(bound, float | int) and plain else None,
        "gap": gap if feasible else None,
        "seconds": round(plan.seconds, 2),
        "proof_seconds": round(plan.seconds, 2) if proven else None,
        "from": plan.details.get("from"),
        "scope": plan.details.get("scope"),
    }


def peer_cell(
    problem: RematProblem, seconds: float, workers: int, gap_limit: float, presolve: bool = True
) -> dict[str, Any]:
    """The peer's result as a row's cell (its plan lowered and measured as memplan's)."""
    result = solve_peer(problem, seconds, workers=workers, gap_limit=gap_limit, presolve=presolve)
    plain = problem.plain_cost
    plan = result.plan
    feasible = plan is not None and plan.feasible
    return {
        "status": result.status if plan is None or feasible else plan.status,
        "overhead": plan.overhead if feasible and plan is not None else None,
        "cost": plan.compute_cost if feasible and plan is not None else None,
        "bound": (result.bound - plain) / plain if result.bound is not None and plain else None,
        "gap": result.gap,
        "seconds": round(result.seconds, 2),
        "proof_seconds": round(result.seconds if result.status == "infeasible" else result.proof_seconds, 2)
        if result.status == "infeasible" or result.proof_seconds is not None
        else None,
        "phase1_seconds": round(result.phase1_seconds, 2),
    }


def run_graph(
    name: str,
    kind: str,
    graph: Graph,
    fractions: list[float],
    seconds: float,
    gap_limit: float,
    workers: int,
    presolve: bool = True,
) -> dict[str, Any]:
    """Both solvers at each fraction of ``graph``'s checkpoint-all peak."""
    base = RematProblem(graph, 10**18, max_solver_nodes=10**9, workers=workers)
    top = checkpoint_all(base).peak_bytes
    rows = []
    for fraction in fractions:
        budget = int(top * fraction)
        problem = base.with_budget(budget).with_time_limit(seconds)
        began = time.perf_counter()
        plan = solve_remat(graph, budget, seconds, workers=workers, gap_limit=gap_limit)
        row: dict[str, Any] = {"fraction": fraction, "budget_bytes": budget, "memplan": mine(plan, gap_limit)}
        row["memplan"]["wall"] = round(time.perf_counter() - began, 2)
        row["peer"] = peer_cell(problem, seconds, workers, gap_limit, presolve)
        print(f"  {name} {fraction}: memplan {cell(row['memplan'])} | peer {cell(row['peer'])}", flush=True)
        rows.append(row)
    return {
        "name": name,
        "kind": kind,
        "ops": graph.num_ops,
        "nodes": coarsen(base, 10**9).size,
        "top_bytes": top,
        "floor_bytes": memory_floor(base).bytes,
        "rows": rows,
    }


def pct(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def cell(c: dict[str, Any]) -> str:
    proof = "-" if c["proof_seconds"] is None else f"{c['proof_seconds']:.1f} s"
    return f"{c['status']} · {pct(c['overhead'])} · bound {pct(c['bound'])} · gap {pct(c['gap'])} · proof {proof}"


def table(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| graph | ops / nodes | budget | memplan: status | overhead | bound | gap | proof s | peer: status "
        "| overhead | bound | gap | proof s | proof time memplan / peer |",
        "|---" * 15 + "|",
    ]
    for result in results:
        for row in result["rows"]:
            m, p = row["memplan"], row["peer"]
            ratio = "-"
            if m["proof_seconds"] is not None and p["proof_seconds"] is not None:
                ratio = f"{m['proof_seconds'] / max(p['proof_seconds'], 0.01):.2f}x"
            elif m["proof_seconds"] is not None:
                ratio = "peer: no proof"
            elif p["proof_seconds"] is not None:
                ratio = "memplan: no proof"
            lines.append(
                f"| {result['name']} | {result['ops']} / {result['nodes']} | {row['fraction']:.1f} "
                f"({row['budget_bytes'] / 2**20:.1f} MiB) | {m['status']} | {pct(m['overhead'])} | "
                f"{pct(m['bound'])} | {pct(m['gap'])} | {_secs(m['proof_seconds'])} | {p['status']} | "
                f"{pct(p['overhead'])} | {pct(p['bound'])} | {pct(p['gap'])} | {_secs(p['proof_seconds'])} | {ratio} |"
            )
    return lines


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def targets(results: list[dict[str, Any]], seconds: float, gap_limit: float) -> list[str]:
    rows = [row for r in results for row in r["rows"]]
    proven = [row for row in rows if row["memplan"]["proof_seconds"] is not None]
    peer = [row for row in rows if row["peer"]["proof_seconds"] is not None]
    both = [row for row in proven if row["peer"]["proof_seconds"] is not None]
    ratios = [row["memplan"]["proof_seconds"] / max(row["peer"]["proof_seconds"], 0.01) for row in both]
    within = sum(r <= 2 for r in ratios)
    costs = [(row["memplan"]["cost"], row["peer"]["cost"]) for row in rows]
    cheaper = sum(m is not None and (p is None or m < p * (1 - 1e-9)) for m, p in costs)
    dearer = sum(p is not None and (m is None or m > p * (1 + 1e-9)) for m, p in costs)
    share = len(proven) / len(rows) if rows else 0.0
    return [
        f"- memplan proven (optimal, or within {100 * gap_limit:g}% of compute) within {seconds:g} s: "
        f"{len(proven)}/{len(rows)} ({100 * share:.0f}%; target >= 90%); the peer: {len(peer)}/{len(rows)}",
        f"- time to proof where both proved: memplan / peer median "
        f"{statistics.median(ratios):.2f}x, max {max(ratios):.2f}x, within 2x at {within}/{len(ratios)}"
        if ratios
        else "- time to proof: no budget where both proved",
        f"- plans: memplan cheaper than the peer's at {cheaper}, costlier at {dearer}, equal at "
        f"{len(rows) - cheaper - dearer} of {len(rows)} budgets",
    ]


def against(results: list[dict[str, Any]], path: Path) -> list[str]:
    """memplan's plans against those of an earlier run's JSON (the same graphs, budgets and limit):
    where they cost more than the gap limit allows, they are worse than before."""
    before = {(r["name"], row["fraction"]): row["memplan"] for r in json.loads(path.read_text()) for row in r["rows"]}
    pairs = [
        (row["memplan"], before[r["name"], row["fraction"]])
        for r in results
        for row in r["rows"]
        if (r["name"], row["fraction"]) in before
    ]
    worse = [(now, then) for now, then in pairs if _costlier(now, then)]
    better = [(now, then) for now, then in pairs if _costlier(then, now)]
    proofs = sum(_proven(now) for now, _ in pairs)
    proofs_then = sum(_proven(then) for _, then in pairs)
    return [
        f"- against `{path.name}` (memplan before this change, same graphs, budgets and limit): plans costlier by "
        f"more than the gap limit at {len(worse)}, cheaper at {len(better)} of {len(pairs)} budgets; proven "
        f"{proofs} (before: {proofs_then})"
    ]


def _proven(c: dict[str, Any]) -> bool:
    return c["proof_seconds"] is not None or c["status"] == "infeasible"


def _costlier(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """``a``'s plan costs more than ``b``'s beyond the gap limit's tolerance (or ``a`` has none and ``b`` has)."""
    if b["cost"] is None:
        return False
    return a["cost"] is None or a["cost"] > b["cost"] * (1 + GAP_LIMIT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated graphs: vgg16,unet,fcn,layered-n100,...")
    parser.add_argument("--quick", action="store_true", help=f"only {','.join(QUICK)}")
    parser.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--gap-limit", type=float, default=GAP_LIMIT)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "remat_proofs.md"))
    parser.add_argument("--no-peer-presolve", action="store_true", help="the peer without CP-SAT's presolve")
    parser.add_argument("--compare", default="", help="an earlier run's JSON: are memplan's plans worse than then?")
    args = parser.parse_args()
    only = set(QUICK) if args.quick else {s for s in args.only.split(",") if s}
    fractions = [float(f) for f in args.fractions.split(",")]
    out = Path(args.out)
    results = []
    for name, kind, graph in graphs(only):
        print(f"{name} ({graph.num_ops} ops) ...", flush=True)
        presolve = not args.no_peer_presolve
        results.append(run_graph(name, kind, graph, fractions, args.time_limit, args.gap_limit, args.workers, presolve))
        out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    command = ("python bench/remat_proofs.py " + " ".join(sys.argv[1:])).strip()
    lines = [
        "# Remat proofs: memplan against a CP peer of Moccasin's formulation",
        "",
        f"Command: `{command}` (2-core CPU machine shared with other jobs: timings are noisy, compare within "
        f"a row). Each solve: {args.time_limit:g} s limit, {args.workers} workers, gap limit "
        f"{100 * args.gap_limit:g}% of the step's compute, one after the other. memplan = `solve_remat` (the "
        "portfolio `memory_budget=` runs); peer = Moccasin's CP model as the paper solves it (phase 1: least "
        "excess from checkpoint-all; phase 2: least compute hinted with it; CP-SAT defaults"
        + (" but presolve off" if args.no_peer_presolve else "")
        + ", no stage cuts, no "
        "floor, no warm start; `memplan.remat.peer`). Overhead and bound: compute over one plain step (FLOPs; "
        "layered DAGs: their durations); gap relative to the plan's compute; proof s: seconds from the "
        "call's start to 'optimal' or the gap limit ('-': no proof in the limit). Each status speaks for its "
        "own scope (peer: at most 2 runs per node, program order; memplan: the scope of its bound). Budgets "
        "are fractions of the checkpoint-all peak. A bound above the plan's overhead is no error: the lowering "
        "drops a first run nobody reads before the re-run, so the plan runs that op first later than program "
        "order, outside the scope the bound speaks for (it beats every plan of the scope; memplan says so in "
        "its message and counts its gap as 0). 'infeasible' is a proof too (memplan: the memory floor is above "
        "the budget). "
        + (
            f"`{Path(args.compare).name}`: the same graphs, budgets and limit run by this script before this "
            f"change ({COMPARED.get(Path(args.compare).name, 'an earlier run')})."
            if args.compare
            else ""
        ),
        "",
        "## Targets",
        "",
        *targets(results, args.time_limit, args.gap_limit),
        *(against(results, Path(args.compare)) if args.compare else []),
        "",
        *table(results),
    ]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(targets(results, args.time_limit, args.gap_limit)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
