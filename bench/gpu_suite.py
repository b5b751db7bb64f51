"""The one-shot GPU suite (issue 34): every number memplan needs from a lent GPU, in one command.

On the device machine (the `run` tool of the workplace; a bash command in the repo root, the
machine's own ``python3`` with its own CUDA torch; our .venv is not used there)::

    run(command="PYTHONUNBUFFERED=1 PYTHONPATH=src python3 bench/gpu_suite.py --out $OUT",
        carry=[".whl"], timeout_s=470)

then copy ``gpu_suite.json`` and ``gpu_suite.md`` from the reply's files into ``bench/results/``.
``--budget-s`` (default 400) bounds the suite's own wall time, setup included; the 470 s timeout
leaves room for Python's start and the last write. Setup, in this order:

- Dependencies: the GPU image has torch, transformers, numpy, typer, rich and matplotlib, but not
  OR-Tools (with its ``immutabledict``) or ``highspy``, and nothing can be fetched there. So the
  wheels travel in ``.whl/`` (ignored by git, named in ``carry``), made here once with::

      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \\
          --platform manylinux2014_x86_64 -d .whl ortools==9.15.6755 immutabledict==4.3.1 highspy==1.15.1 \\
          protobuf==6.33.6 absl-py==2.5.1

  (about 35 MB; the image's Python is 3.12). At start the suite installs, timed, each wheel whose
  distribution is missing or of another version (``pip install --no-index --no-deps --target
  /tmp/memplan-site``) and puts that folder first on the path of every job; without a wheel for a
  missing module it stops with one line saying the command above.
- Jobs: every measurement runs in a process of its own with a timeout (a crash or a hang costs
  that job only; what it printed before is kept). A job is a new interpreter (spawned): on the
  H100 of 2026-11-27 (torch 2.11.0+cu130, cuDNN 9.19) every cuDNN convolution in a job forked
  from the suite died with SIGSEGV, eager PyTorch included, while the same jobs spawned passed
  (bench/diag/conv_segv.py isolates it: a conv in a fresh interpreter passes with every import
  the suite makes). ``--fork`` forks the suite instead, after torch, transformers and memplan are
  imported and the planned allocators compiled, none of which starts CUDA
  (``PYTORCH_NVML_BASED_CUDA_CHECK=1``): about 10 s less per job, for images where it works.
- Numerics: ``torch.use_deterministic_algorithms(True)`` (a job stopped by an op without a
  deterministic kernel runs again with ``warn_only=True`` and its row says so; with warn_only
  from the start, memory-efficient attention keeps a non-deterministic backward, which made
  vit-base differ from itself on the H100), ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, cuDNN's
  deterministic mode, benchmark off; both sides from the same seed, batch and per-step seeds.

Parts, quick ones first, results written after every model (a run cut short keeps its rows);
each part ends by a share of ``--budget-s`` (what one leaves goes to the next) and a job whose
estimate (scaled by how long the jobs so far took against theirs) would not finish is skipped
and listed:

a) crash check: ``compile_step`` with ``memory_budget="70%"`` on a conv/BN model, then an eager
   forward and three steps of each in the same process (an H100 once died there); exit status,
   the stage it reached and its stderr tail (faulthandler's Python stack for a fatal error); if
   it dies, again with ``CUDA_LAUNCH_BLOCKING=1``. A refused budget is recorded, not a crash.
   Then the same with the planned CUDA allocator installed (``allocator="replay"``: six steps,
   recorded, verified and replayed, an eager forward after them) and its counters (a pointer
   freed twice: ``unknown_frees``).
b) the zoo at batch 1 and 32: eager (PyTorch's caching allocator: ``max_memory_reserved``,
   ``max_memory_allocated``) against memplan with the planned CUDA allocator installed (its own
   counters: bytes taken from cudaMalloc, bytes handed out), device memory used (``mem_get_info``:
   total less free, the job's CUDA context included), the median of ``--steps`` (10) timed steps
   after 6 warm-up steps (the recordings, placement and the verified first replay), and the max
   abs difference of every parameter and buffer after the last step. Where a time ratio goes:
   the host time (until the call returns, before synchronising; near the step time = bound by
   Python's per-op dispatch), device calls per timed step (cudaMalloc/cudaFree synchronise), the
   last replayed step's served/fallback/blocked allocations.
c) ``memory_budget=0.5`` (of the checkpoint-all peak) on four models at batch 32: held when
   memplan's reserved peak is within the budget; a refusal is listed with its one line.
d) fit: a model (GPT-2, 12 layers) and batch eager cannot fit on the card. The batch is sized
   from the card's free memory (``mem_get_info``) and the step's live bytes, measured at doubling
   batches until the slope per sample settles, so that eager needs about 1.3x the free memory;
   eager is run there (out of memory, confirmed; if it fits, once more at 1.5x the batch), then
   memplan with ``memory_budget`` = the free memory less 6% (arena views on PyTorch's
   allocator, ``expandable_segments`` for both sides), 2 warm-up and 3 timed steps.
e) ``torch.compile`` (inductor) with ``torch._functorch.config.activation_memory_budget = 0.5``
   on two of the budget models, beside memplan's rows at 0.5 (PyTorch's budget is a fraction of
   the saved activations, memplan's of the whole step's peak: not the same knob).
Then the zoo models part b) had no time for, with what is left. What was skipped is listed
(``skipped``): a second call measures it, e.g. ``--parts zoo,compile --models bert-base,vit-base``.

The JSON (``gpu_suite.json``) has the shape issue 34 asks for: ``{"device", "torch", "rows":
[{"model", "batch", "eager_reserved_bytes", "eager_allocated_bytes", "memplan_reserved_bytes",
"memplan_allocated_bytes", "time_ratio", "max_abs_diff", "budget_bytes", "held"}, ...]}``, each
row with more keys (``part``, ``bit_identical``, step times, device used, allocator, errors),
and beside ``rows``: ``suite`` (command, setup, timings), ``crash_check``, ``fit``,
``torch_compile`` and ``skipped``.

``--dry-run`` runs the same code on tiny models on the CPU (no CUDA call at all; about 20 s of
CPU time):
its memory columns are CPU equivalents (*reserved*: the job's peak RSS over the timed steps, the
suite's inherited pages included; *allocated*: null; a budget is held when the placed plan is
within it), its fit card is simulated (0.8x eager's live bytes), and torch.compile uses the
``aot_eager_decomp_partition`` backend (the same partitioner and budget, no code generation).
``tests/torch/test_gpu_suite.py`` runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import faulthandler
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

REQUIRED_KEYS = (
    "model",
    "batch",
    "eager_reserved_bytes",
    "eager_allocated_bytes",
    "memplan_reserved_bytes",
    "memplan_allocated_bytes",
    "time_ratio",
    "max_abs_diff",
    "budget_bytes",
    "held",
)
ZOO_ORDER = (  # cheapest first (a guess for an H100: seconds for both sides at batch 1 and 32)
    ("mlp", 12),
    ("lstm", 18),
    ("vgg16", 16),
    ("gpt2-2l", 22),
    ("mobilenet-v2", 28),
    ("resnet50", 30),
    ("unet", 26),
    ("efficientnet-b0", 32),
    ("bert-base", 36),
    ("vit-base", 36),
    ("gpt2", 45),
    ("xlm-roberta-base", 42),
)
BUDGET_MODELS = ("mobilenet-v2", "resnet50", "unet", "efficientnet-b0")
COMPILE_MODELS = ("mobilenet-v2", "resnet50")
FIT_MODEL = "gpt2"
DRY = {
    "zoo": ("tiny-mlp", "tiny-cnn"),
    "budget": ("tiny-cnn", "tiny-gpt2"),
    "compile": ("tiny-mlp",),
    "fit": "tiny-gpt2",
}
PARTS = ("crash", "zoo", "budget", "fit", "compile")
# each part ends by this fraction of the time after setup (what one leaves goes to the next);
# the crash check runs whatever is left
SHARE_END = {"crash": 1.0, "zoo": 0.42, "budget": 0.64, "fit": 0.90, "compile": 1.0, "zoo-rest": 1.0}
ESTIMATE_S = {"crash": 30.0, "budget": 25.0, "fit": 75.0, "compile": 60.0, "tiny": 3.0}
WARMUP_STEPS = 6  # memplan: two recordings, placement, the verified first replay, then replays
BUDGET_BATCH = 32
DETERMINISM_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONFAULTHANDLER": "1"}
FIT_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
FIT_OVERSHOOT = 1.3  # eager's estimated peak at the fit batch, over the card's free memory
FIT_MARGIN = 0.06  # memplan's budget: the free memory less this fraction (workspace, fragmentation)
SITE = "/tmp/memplan-site"
WARN_ONLY_ENV = "GPU_SUITE_DETERMINISM_WARN_ONLY"
NO_DETERMINISTIC_KERNEL = "does not have a deterministic implementation"
NO_CUDA = "no CUDA device here (torch.cuda.is_available() is false): nothing measured; --dry-run runs on the CPU"
WHEEL_HINT = (
    "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
    "--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 "
    "--platform manylinux2014_x86_64 -d .whl ortools==9.15.6755 immutabledict==4.3.1 highspy==1.15.1 "
    "protobuf==6.33.6 absl-py==2.5.1"
)
CARRIED_MODULES = ("ortools", "immutabledict", "highspy", "google.protobuf", "absl")  # wheels in .whl
NEEDED_MODULES = ("numpy", "ortools", "immutabledict", "typer", "rich", "matplotlib", "transformers", "torch")
MIB = 1 << 20


# ----------------------------------------------------------------------------- setup


def wheel_distribution(path: Path) -> tuple[str, str]:
    """``(normalised name, version)`` of a wheel file: ``ortools-9.15.6755-cp312-...whl``."""
    name, version = path.name.split("-")[:2]
    return name.replace("_", "-").lower(), version


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def ensure_dependencies(wheelhouse: Path, site: str) -> dict[str, Any]:
    """Install each wheel of ``wheelhouse`` whose distribution is missing or of another version
    into ``site`` (first on the path of this process and its jobs); then check every module the
    jobs import. Returns what was done; raises SystemExit with one line if a module is missing."""
    start = time.monotonic()
    if Path(site).is_dir():  # installed by an earlier run on this machine
        sys.path.insert(0, site)
    wheels = sorted(wheelhouse.glob("*.whl")) if wheelhouse.is_dir() else []
    wanted = [w for w in wheels if installed_version(wheel_distribution(w)[0]) != wheel_distribution(w)[1]]
    report: dict[str, Any] = {"wheelhouse": str(wheelhouse), "installed": [], "install_s": 0.0}
    if wanted:
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        command += ["--no-cache-dir", "--upgrade", "--target", site, *map(str, wanted)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise SystemExit(f"gpu_suite: installing {len(wanted)} wheels from {wheelhouse} failed: {last}")
        report["installed"] = [w.name for w in wanted]
    if Path(site).is_dir():
        if site not in sys.path:
            sys.path.insert(0, site)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)
        importlib.invalidate_caches()
    missing = [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None]
    carried = [m for m in missing if m in CARRIED_MODULES]
    if carried:
        raise SystemExit(
            f"gpu_suite: missing Python modules {', '.join(carried)} and no wheel for them in {wheelhouse}: "
            f"where pip works, run `{WHEEL_HINT}` in the repo root and carry .whl"
        )
    if missing:
        raise SystemExit(
            f"gpu_suite: missing Python modules {', '.join(missing)}: run the suite with the Python that has "
            "torch (on the GPU image: python3)"
        )
    report["install_s"] = round(time.monotonic() - start, 2)
    report["versions"] = {m: installed_version(m) for m in ("torch", "transformers", "ortools", "highspy", "numpy")}
    return report


# ----------------------------------------------------------------------------- models (jobs)


def _tiny_mlp(batch: int):
    import torch
    from memplan.torch.zoo import Workload
    from torch import nn

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.Tanh())
    model.append(nn.Linear(128, 10))
    return Workload(model, torch.randn(batch, 64), torch.randint(0, 10, (batch,)), nn.functional.cross_entropy)


def _tiny_cnn(batch: int):
    import torch
    from memplan.torch.zoo import Workload
    from torch import nn

    model = nn.Sequential(  # tests/torch/test_budget.py's conv/BN model, on its 24x24 images
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )
    images = torch.randn(batch, 3, 24, 24)
    return Workload(model, images, torch.randint(0, 10, (batch,)), nn.functional.cross_entropy)


def _tiny_gpt2(batch: int):
    from memplan.torch.zoo import _hf_text

    small = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 256, "n_positions": 32}
    return _hf_text("GPT2LMHeadModel", "GPT2Config", seq=16, lm=True, **small)(batch)


TINY: dict[str, Callable[[int], Any]] = {"tiny-mlp": _tiny_mlp, "tiny-cnn": _tiny_cnn, "tiny-gpt2": _tiny_gpt2}


def _workload(name: str, batch: int, device: str):
    """A zoo model (or a tiny one of the dry run) and its batch, from seed 0, on ``device``."""
    from torch.utils import _pytree as pytree

    import torch
    from memplan.torch.zoo import Workload, build_workload

    if name in TINY:
        torch.manual_seed(0)
        w = TINY[name](batch)
    else:
        w = build_workload(name, batch, seed=0)
    model = w.model.to(device).train()
    inputs, target = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, (w.inputs, w.target))
    return Workload(model, inputs, target, w.loss_fn)


# ----------------------------------------------------------------------------- jobs (in their own process)


def _torch_for(spec: dict[str, Any]):
    """torch, with the job's environment, deterministic algorithms and cuDNN's settings."""
    os.environ.update(spec.get("env", {}))
    os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)  # the suite's own check; a job asks CUDA itself
    import torch

    # strict by default: with warn_only=True memory-efficient attention keeps its non-deterministic
    # backward (vit-base on the H100 differed from itself); a job that hits an op without a
    # deterministic kernel is run again with warn_only=True and its row says so
    torch.use_deterministic_algorithms(True, warn_only=os.environ.get(WARN_ONLY_ENV) == "1")
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    if spec["device"] == "cpu":  # the dry run's tiny steps: threads only wait for each other
        torch.set_num_threads(1)
    return torch


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _device_used(device: str) -> int | None:
    import torch

    if device != "cuda":
        return None
    free, total = torch.cuda.mem_get_info()
    return total - free


def _reset_peaks(device: str, native: Any) -> None:
    import torch

    if device == "cuda":
        native.reset_peaks() if native is not None else torch.cuda.reset_peak_memory_stats()
        return
    from memplan.torch.rss import RssUnavailable, reset_peak_rss

    with contextlib.suppress(RssUnavailable):
        reset_peak_rss()


def _peaks(device: str, native: Any) -> dict[str, Any]:
    """Reserved and allocated peaks since the last reset: the planned CUDA allocator's counters
    when it is installed, else PyTorch's; on the CPU the peak RSS (reserved) and null."""
    import torch

    if device == "cuda" and native is not None:
        stats = native.memory_stats()
        return {"reserved_bytes": stats.peak_held, "allocated_bytes": stats.peak_in_use, "counters": "planned"}
    if device == "cuda":
        reserved, allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
        return {"reserved_bytes": reserved, "allocated_bytes": allocated, "counters": "torch.cuda"}
    from memplan.torch.rss import RssUnavailable, peak_rss_bytes

    try:
        return {"reserved_bytes": peak_rss_bytes(), "allocated_bytes": None, "counters": "cpu peak RSS"}
    except RssUnavailable:
        return {"reserved_bytes": None, "allocated_bytes": None, "counters": "none"}


def _install_planned(spec: dict[str, Any]) -> tuple[Any, str | None]:
    """The planned CUDA allocator for a memplan job on CUDA (before its first CUDA tensor)."""
    if spec["side"] != "memplan" or spec["device"] != "cuda" or spec.get("allocator") == "views":
        return None, None
    from memplan.errors import MemplanError
    from memplan.torch.run import cuda_allocator

    try:
        return cuda_allocator.install(), None
    except MemplanError as error:
        return None, str(error).splitlines()[0]


def _make_step(spec: dict[str, Any], w: Any, optimizer: Any) -> tuple[Callable[[], Any], Callable[[], dict]]:
    """The step to time and a function of what to report about it."""
    import torch
    from memplan.torch.capture import call_model

    model = w.model
    if spec["side"] == "compile":
        torch._functorch.config.activation_memory_budget = spec["activation_memory_budget"]
        model = torch.compile(w.model, backend=spec["backend"])
    if spec["side"] in ("eager", "compile"):

        def eager() -> Any:
            loss = w.loss_fn(call_model(model, w.inputs), w.target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        return eager, dict
    from memplan.api import CompiledStep

    if spec.get("simulated_card"):
        # a simulated card holds the step's tensors only: the host's own pages are not the card's
        # memory, as on CUDA, where memplan counts none of them (outside_step_bytes is None there)
        import memplan.torch.run.budget as budget_module

        budget_module.outside_step_bytes = lambda *args: None
    compiled = CompiledStep.of_loss(
        w.model,
        optimizer,
        w.loss_fn,
        time_limit_seconds=spec["time_limit"],
        allocator=spec.get("allocator", "auto"),
        memory_budget=spec.get("memory_budget"),
    )
    batch = (w.inputs, w.target)

    def report() -> dict[str, Any]:
        runner = next(iter(compiled.runners.values()), None)
        stats = getattr(runner, "last_stats", None)
        budget = compiled.report.get("budget") or {}
        keep = ("budget_bytes", "method", "overhead", "recomputed_ops", "status", "planned_peak_bytes")
        return {
            "allocator": compiled.allocator,
            "allocator_reason": compiled.allocator_reason,
            "planning_s": round(compiled.planning_seconds, 2),
            "replayed_steps": getattr(runner, "replays", None),
            "diverged": None if stats is None else stats.diverged_at is not None,
            "last_step": None
            if stats is None
            else {k: getattr(stats, k) for k in ("served", "fallback", "fallback_bytes", "blocked")},
            "budget": {k: budget.get(k) for k in (*keep, "placed_peak_bytes")} if budget else None,
        }

    return (lambda: compiled(batch)), report


def _timed(step: Callable[[], Any], device: str, steps: int) -> tuple[list[float], list[float]]:
    """Each step's wall time (synchronised) and its host time (until the call returns, before the
    synchronisation): a host time close to the wall time means the step waits on Python, not on
    the device (CUDA's launches no longer hide the per-op overhead)."""
    times, host = [], []
    for k in range(steps):
        _seed(100 + k)
        start = time.perf_counter()
        step()
        host.append(time.perf_counter() - start)
        _sync(device)
        times.append(time.perf_counter() - start)
    return times, host


def _device_calls(device: str, native: Any) -> dict[str, Any] | None:
    """What the allocator asked the device for so far (cudaMalloc and cudaFree synchronise: a
    steady step should make none): the planned CUDA allocator's counters, else PyTorch's."""
    import torch

    if device != "cuda":
        return None
    if native is not None:
        s = native.memory_stats()
        counts = {"mallocs": s.raw_allocations, "frees": s.raw_frees, "near_hits": s.near_hits}
        # growth/regrets: the cache bound growing by blocks it gave back and was then asked for
        counts |= {"growth": s.growth, "regrets": s.regrets}
        return counts | {"evicted": s.evicted, "unknown_frees": s.unknown_frees}
    stats = torch.cuda.memory_stats()
    return {"mallocs": stats.get("num_device_alloc"), "frees": stats.get("num_device_free")}


def _per_step(before: dict[str, Any] | None, after: dict[str, Any] | None, steps: int) -> dict[str, Any] | None:
    if before is None or after is None:
        return None
    return {k: None if v is None or before.get(k) is None else (v - before[k]) / steps for k, v in after.items()}


def _seed(k: int) -> None:
    import torch

    torch.manual_seed(k)


def _side_batch(spec: dict[str, Any], batch: int, native: Any) -> dict[str, Any]:
    """One side at one batch: warm-up, peaks reset, timed steps, peaks, parameters compared."""
    import torch
    from memplan.torch.zoo import make_optimizer

    device = spec["device"]
    w = _workload(spec["model"], batch, device)
    optimizer = make_optimizer(spec.get("optimizer", "adam"), w.model.parameters())
    step, report = _make_step(spec, w, optimizer)
    first = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(spec["warmup"]):
            _seed(k)
            start = time.perf_counter()
            step()
            _sync(device)
            first = time.perf_counter() - start if first is None else first
        warm = _peaks(device, native)
        used_before = _device_used(device)
        _reset_peaks(device, native)
        calls_before = _device_calls(device, native)
        times, host = _timed(step, device, spec["steps"])
        peaks = _peaks(device, native)
        calls = _per_step(calls_before, _device_calls(device, native), spec["steps"])
    used = [u for u in (used_before, _device_used(device)) if u is not None]
    result = {"batch": batch, "side": spec["side"], "step_s": statistics.median(times), "steps": len(times)}
    result |= {"host_s": statistics.median(host), "device_calls_per_step": calls}
    result |= {
        "first_step_s": None if first is None else round(first, 3),
        "warmup_reserved_bytes": warm["reserved_bytes"],
        "warmup_allocated_bytes": warm["allocated_bytes"],
        **peaks,
    }
    result |= {"device_used_bytes": max(used, default=None), "warnings": _warning_lines(caught), **report()}
    if spec.get("measure_live"):  # the dry run's card: live bytes of one more step, measured
        from memplan.torch.measure import measure_train_step

        result["live_peak_bytes"] = measure_train_step(w.model, optimizer, w.loss_fn, (w.inputs, w.target))
    state = {k: v.detach().cpu().clone() for k, v in w.model.state_dict().items()}
    if spec.get("save"):
        path = Path(spec["work"]) / f"{spec['side']}-{spec['model']}-b{batch}.pt"
        torch.save(state, path)
        result["params"] = str(path)
    reference = spec.get("reference", {}).get(str(batch))
    if reference:
        result |= compare_states(torch.load(reference), state)
    return result


def compare_states(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Max abs difference over every floating tensor of two state dicts, and whether all are equal."""
    import torch

    diff = 0.0
    for k, x in a.items():
        y = b[k]
        if x.dtype.is_floating_point and x.numel():
            diff = max(diff, float((x.double() - y.double()).abs().max()))
        elif not torch.equal(x, y):
            diff = math.inf
    return {"max_abs_diff": diff, "bit_identical": all(torch.equal(a[k], b[k]) for k in a)}


def _warning_lines(caught: list[Any]) -> list[str]:
    lines = {str(w.message).splitlines()[0][:200] for w in caught}
    return sorted(line for line in lines if "deterministic" in line or "memory_budget" in line)


def _failure(error: BaseException) -> dict[str, Any]:
    """One line for an error a job met; out of memory and memplan's refusals said apart."""
    from memplan.errors import MemplanError

    line = (str(error).strip().splitlines() or [type(error).__name__])[0][:400]
    if type(error).__name__ == "OutOfMemoryError" or "out of memory" in line.lower():
        return {"oom": True, "error": line}
    if isinstance(error, MemplanError):
        return {"refused": f"{type(error).__name__}: {line}"}
    return {"error": f"{type(error).__name__}: {line}"}


def _release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        from memplan.torch.run import cuda_allocator

        cuda_allocator.release_free_memory()
    else:
        from memplan.torch.rss import release_free_memory

        release_free_memory()


def job_side(spec: dict[str, Any], emit: Callable[[dict], None]) -> None:
    """eager, memplan or torch.compile on one model at each of ``spec["batches"]``."""
    torch = _torch_for(spec)
    native, not_installed = _install_planned(spec)
    for batch in spec["batches"]:
        try:
            result = _side_batch(spec, batch, native)
        except Exception as error:
            result = {"batch": batch, "side": spec["side"], **_failure(error)}
            if spec["device"] == "cuda" and result.get("oom"):
                result["reserved_at_oom_bytes"] = torch.cuda.max_memory_reserved()
        if not_installed:
            result["allocator_note"] = not_installed
        if spec["side"] == "compile":
            torch._dynamo.reset()
        emit(result)
        _release(spec["device"])


def job_probe(spec: dict[str, Any], emit: Callable[[dict], None]) -> None:
    """What the suite runs on: torch, CUDA, the device and its memory."""
    torch = _torch_for(spec)
    import memplan

    found: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    found["memplan"] = str(Path(memplan.__file__).parent)
    found["cuda"] = spec["device"] == "cuda" and torch.cuda.is_available()
    if found["cuda"]:
        free, total = torch.cuda.mem_get_info()
        found |= {"device": torch.cuda.get_device_name(), "free_bytes": free, "total_bytes": total}
        found["cuda_version"] = torch.version.cuda
    else:
        found["device"] = "cpu (dry run)" if spec["device"] == "cpu" else None
    emit(found)


def job_crash(spec: dict[str, Any], emit: Callable[[dict], None]) -> None:
    """A budgeted ``compile_step`` on a conv/BN model, then eager in the same process (stages
    emitted as they start: a job that dies says where). ``spec["allocator"]``: ``"views"`` (arena
    views on PyTorch's allocator, where an H100 died) or ``"replay"`` (the planned CUDA allocator
    installed first: recorded, verified and replayed steps, then its counters, a pointer freed
    twice among them; on the CPU the planned CPU allocator)."""
    torch = _torch_for(spec)
    import memplan
    from memplan.errors import MemplanError
    from memplan.torch.capture import call_model
    from memplan.torch.run.replay import ReplayedStep

    device, allocator = spec["device"], spec.get("allocator", "views")
    native, not_installed = _install_planned({"side": "memplan", "device": device, "allocator": allocator})
    if not_installed:
        emit({"stage": "the planned CUDA allocator was not installed", "refused": not_installed})
        return
    emit({"stage": "build"})
    # on a GPU the device holds ~65 MiB of cuBLAS workspace besides the step (an H100, 2026-11-27):
    # the CPU's 8 images at 70% (752 KiB) leave no room for it, and were refused there
    batch_size, budget = (4096, "80%") if device == "cuda" else (8, "70%")
    w = _workload("tiny-cnn", batch_size, device)
    eager = copy.deepcopy(w.model)
    opt = torch.optim.SGD(w.model.parameters(), lr=0.1, momentum=0.9)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    batch = (w.inputs, w.target)
    emit({"stage": f"compile_step with memory_budget={budget} at batch {batch_size}"})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step = memplan.compile_step(
                w.model, opt, w.loss_fn, batch, memory_budget=budget, allocator=allocator, time_limit_seconds=5
            )
    except MemplanError as error:
        emit({"stage": "compile_step refused", **_failure(error)})
        return
    runner = step.runners[next(iter(step.runners))]
    reruns = _recomputed_kinds(runner.run if isinstance(runner, ReplayedStep) else runner)
    emit({"stage": "eager forward after compile_step"})
    bystander = copy.deepcopy(eager)  # a forward in train mode moves batch norm's statistics
    with torch.no_grad():
        call_model(bystander, w.inputs)
    _sync(device)
    same = True
    for k in range(3 if allocator == "views" else 6):  # replay: two recordings, the verified replay, three more
        emit({"stage": f"step {k}: eager, then memplan"})
        _seed(100 + k)
        loss = w.loss_fn(call_model(eager, w.inputs), w.target)
        loss.backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
        _seed(100 + k)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                planned = step(batch)
        except MemplanError as error:  # a budget refused once the device's own bytes are seen
            emit({"stage": f"step {k} refused", **_failure(error)})
            return
        _sync(device)
        same = same and torch.equal(loss.detach(), planned)
        same = same and all(
            torch.equal(a, b) for a, b in zip(eager.state_dict().values(), w.model.state_dict().values(), strict=True)
        )
    emit({"stage": "eager forward after the planned steps"})
    with torch.no_grad():
        call_model(bystander, w.inputs)
    _sync(device)
    replays = getattr(runner, "replays", None)
    done = {"stage": "done", "ok": True, "bit_identical": same, "recomputed_kinds": reruns, "replayed_steps": replays}
    emit(done | {"allocator": step.allocator, "device_calls": _device_calls(device, native)})


def _recomputed_kinds(runner: Any) -> list[str]:
    """The op kinds a remat plan runs more than once (none for a plan without recomputation)."""
    from collections import Counter

    from memplan.torch.run.remat import RematRunner

    if not isinstance(runner, RematRunner):
        return []
    runs = Counter(i for kind, i in runner.steps if kind == "run")
    return sorted({runner.graph.ops[i].kind for i, count in runs.items() if count > 1})


def job_fit_size(spec: dict[str, Any], emit: Callable[[dict], None]) -> None:
    """The batch at which eager needs about ``FIT_OVERSHOOT`` x the card's free memory. The step's
    live bytes are measured at doubling batches (slices of one batch, one model) until the last
    two slopes agree within 15%: at small batches the optimizer's update, not the activations,
    makes the peak. The dry run's card is simulated (0.8x eager's bytes at ``dry_batch``)."""
    torch = _torch_for(spec)
    from torch.utils import _pytree as pytree

    from memplan.torch.measure import measure_train_step
    from memplan.torch.zoo import make_optimizer

    device, largest = spec["device"], spec["max_probe_batch"]
    free, total = torch.cuda.mem_get_info() if device == "cuda" else (None, None)
    w = _workload(spec["model"], largest, device)
    optimizer = make_optimizer("adam", w.model.parameters())
    probes: list[tuple[int, int]] = []
    slopes: list[float] = []
    batch = spec["probe_batch"]
    while batch <= largest:
        part = pytree.tree_map(lambda t, b=batch: t[:b] if isinstance(t, torch.Tensor) else t, (w.inputs, w.target))
        probes.append((batch, measure_train_step(w.model, optimizer, w.loss_fn, part)))
        if len(probes) > 1:
            (b0, p0), (b1, p1) = probes[-2:]
            slopes.append(max(1.0, (p1 - p0) / (b1 - b0)))
        if len(slopes) > 1 and abs(slopes[-1] - slopes[-2]) <= 0.15 * slopes[-1]:
            break
        batch *= 2
    per_sample = int(slopes[-1])
    fixed = probes[-1][1] - per_sample * probes[-1][0]
    if device == "cuda":
        batch = max(probes[-1][0], math.ceil((FIT_OVERSHOOT * free - fixed) / per_sample))
        capacity, simulated = free, False
    else:
        batch = spec["dry_batch"]
        capacity, simulated = int(0.8 * (fixed + per_sample * batch)), True
    found = {"fixed_bytes": fixed, "per_sample_bytes": per_sample, "probe_live_bytes": probes, "batch": batch}
    found |= {"free_bytes": free, "total_bytes": total, "capacity_bytes": capacity, "simulated_card": simulated}
    emit({**found, "estimated_eager_bytes": fixed + per_sample * batch})


JOBS: dict[str, Callable[[dict[str, Any], Callable[[dict], None]], None]] = {
    "side": job_side,
    "probe": job_probe,
    "crash": job_crash,
    "fit_size": job_fit_size,
}


def run_job_here(spec: dict[str, Any], results: str) -> None:
    """Run one job in this process, each result a JSON line of ``results`` as soon as it is known."""
    with open(results, "a") as sink:

        def emit(record: dict[str, Any]) -> None:
            sink.write(json.dumps(record) + "\n")
            sink.flush()

        JOBS[spec["kind"]](spec, emit)


# ----------------------------------------------------------------------------- the suite (parent)


@dataclass
class Outcome:
    """What a job left: its exit status (negative: the signal), its results, its output's tail."""

    rc: int
    results: list[dict[str, Any]]
    tail: str
    seconds: float
    timed_out: bool


class Tee:
    """Writes to the terminal and the suite's log."""

    def __init__(self, stream: Any, path: Path) -> None:
        self.stream, self.file = stream, open(path, "a")  # noqa: SIM115 (open while the suite runs)

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.file.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.file.flush()


def _wait(pid: int, deadline: float) -> tuple[int, bool]:
    """Exit status of a job (negative: killed by that signal), killing its group at the deadline."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if time.monotonic() > deadline:
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(OSError):
                    kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status), True
        time.sleep(0.05)


def _fork_job(spec: dict[str, Any], log: Path, results: Path) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the job: its own process group, output to its log
        os.setpgid(0, 0)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        faulthandler.enable(file=sys.stderr)  # a fatal error's Python stack goes to the job's log
        run_job_here(spec, str(results))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        os._exit(code)


def _spawn_job(spec: dict[str, Any], log: Path, results: Path) -> int:
    command = [sys.executable, str(Path(__file__).resolve()), "--job", json.dumps(spec), "--job-results", str(results)]
    with open(log, "w") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return child.pid


class Suite:
    """Runs the parts within ``--budget-s`` and writes the JSON and markdown after every model."""

    def __init__(self, args: argparse.Namespace, setup: dict[str, Any]) -> None:
        self.args, self.t0 = args, time.monotonic()
        self.end = self.t0 + args.budget_s - args.setup_s
        self.out, self.work = Path(args.out), Path(args.work or tempfile.mkdtemp(prefix="gpu_suite-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.device = "cpu" if args.dry_run else "cuda"
        self.spawn, self.jobs = args.spawn, 0
        self.eager: dict[tuple[str, int], dict[str, Any]] = {}
        self.spent: dict[str, list[float]] = {}  # by part: seconds taken, seconds estimated
        self.doc: dict[str, Any] = {"device": None, "torch": None, "rows": []}
        self.doc["suite"] = {
            "command": "python bench/gpu_suite.py " + " ".join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "dry_run": args.dry_run,
            "budget_s": args.budget_s,
            "steps": args.steps,
            "warmup_steps": WARMUP_STEPS,
            "jobs": "spawn" if args.spawn else "fork",
            "setup": setup,
            "memory": _memory_note(args.dry_run),
            "determinism": "torch.use_deterministic_algorithms(True) (a job stopped by an op without a "
            "deterministic kernel runs again with warn_only=True, its row says so), "
            "CUBLAS_WORKSPACE_CONFIG=:4096:8, cudnn.deterministic, cudnn.benchmark off",
        }
        self.doc |= {"crash_check": None, "fit": None, "torch_compile": [], "skipped": [], "job_log": []}

    # --- jobs

    def run_job(self, spec: dict[str, Any], timeout: float, label: str) -> Outcome:
        """``spec`` in a process of its own, killed after ``timeout`` s or at the suite's end."""
        self.jobs += 1
        base = {"device": self.device, "work": str(self.work), "env": {}, "steps": self.args.steps}
        spec = {**base, "warmup": WARMUP_STEPS, **spec}
        log, results = self.work / f"job{self.jobs}.log", self.work / f"job{self.jobs}.jsonl"
        start = time.monotonic()
        deadline = min(start + timeout, self.end + 10)
        pid = (_spawn_job if self.spawn else _fork_job)(spec, log, results)
        rc, timed_out = _wait(pid, deadline)
        seconds = time.monotonic() - start
        lines = results.read_text().splitlines() if results.exists() else []
        text = log.read_text(errors="replace") if log.exists() else ""
        outcome = Outcome(rc, [json.loads(line) for line in lines if line.strip()], _excerpt(text), seconds, timed_out)
        state = "timed out" if timed_out else f"rc {rc}"
        self.doc["job_log"].append({"job": label, "rc": rc, "timed_out": timed_out, "seconds": round(seconds, 1)})
        print(f"[{self.elapsed():6.1f} s] {label}: {state}, {seconds:.1f} s", flush=True)
        if _needs_warn_only(outcome, text) and spec["env"].get(WARN_ONLY_ENV) != "1":
            note = "an op has no deterministic kernel; again with warn_only"
            print(f"[{self.elapsed():6.1f} s] {label}: {note}", flush=True)
            relaxed = {**spec, "env": {**spec["env"], WARN_ONLY_ENV: "1"}}
            outcome = self.run_job(relaxed, max(1.0, deadline - time.monotonic()), f"{label} (warn_only)")
            for result in outcome.results:
                result["determinism"] = "warn_only"
        return outcome

    def elapsed(self) -> float:
        return time.monotonic() - self.t0 + self.args.setup_s

    def admit(self, label: str, estimate: float, part: str) -> bool:
        """Whether a job estimated at ``estimate`` s (scaled by the jobs so far) ends before the
        part's share of the budget is spent; a job that would not is listed as skipped."""
        scaled = estimate * self.calibration(part)
        share_end = self.t0 + (self.end - self.t0) * SHARE_END[part]  # shares of the time after setup
        if time.monotonic() + scaled <= min(share_end, self.end):
            self.doc["skipped"] = [s for s in self.doc["skipped"] if s["what"] != label]
            return True
        left = max(0.0, min(share_end, self.end) - time.monotonic())
        self.doc["skipped"].append(
            {"part": part, "what": label, "estimate_s": round(scaled, 1), "left_s": round(left, 1)}
        )
        print(f"[{self.elapsed():6.1f} s] skipped {label}: needs ~{scaled:.0f} s, {left:.0f} s left", flush=True)
        return False

    def calibration(self, part: str) -> float:
        """How long this part's jobs took against their estimates so far (0.5 to 3)."""
        taken, estimated = self.spent.get(part.removesuffix("-rest"), (0.0, 0.0))
        return min(3.0, max(0.5, taken / estimated)) if estimated else 1.0

    def account(self, part: str, estimate: float, seconds: float) -> None:
        spent = self.spent.setdefault(part.removesuffix("-rest"), [0.0, 0.0])
        spent[0] += seconds
        spent[1] += estimate

    def estimate(self, model: str, default: float) -> float:
        return ESTIMATE_S["tiny"] if model in TINY else default

    # --- parts

    def probe(self) -> bool:
        """Device, torch and memory; falls back to spawned jobs if a forked one cannot start CUDA."""
        outcome = self.run_job({"kind": "probe"}, 120, "probe")
        if outcome.rc != 0 and not self.spawn:
            print("forked job failed; jobs are spawned from now on", flush=True)
            self.spawn = True
            self.doc["suite"]["jobs"] = "spawn (the forked probe failed: " + _last_line(outcome.tail) + ")"
            outcome = self.run_job({"kind": "probe"}, 120, "probe (spawned)")
        found = outcome.results[0] if outcome.results else {"error": _last_line(outcome.tail)}
        self.doc["probe"] = found
        self.doc["device"], self.doc["torch"] = found.get("device"), found.get("torch")
        return bool(found.get("cuda")) or self.args.dry_run

    def part_crash(self) -> None:
        if not self.admit("crash check", ESTIMATE_S["crash"], "crash"):
            return
        outcome = self.run_job({"kind": "crash"}, 180, "crash check")
        self.doc["crash_check"] = record = _crash_record(outcome)
        if record["rc"] != 0 and self.device == "cuda":
            again = self.run_job({"kind": "crash", "env": {"CUDA_LAUNCH_BLOCKING": "1"}}, 180, "crash check, blocking")
            record["with_cuda_launch_blocking"] = _crash_record(again)
        self.write()
        planned = self.run_job({"kind": "crash", "allocator": "replay"}, 180, "crash check, planned allocator")
        record["planned_allocator"] = _crash_record(planned)
        self.write()

    def part_zoo(self, models: list[str], part: str) -> None:
        for model, default in models:
            if any(r["model"] == model and r["part"] == "zoo" for r in self.doc["rows"]):
                continue
            estimate = self.estimate(model, default)
            if not self.admit(f"zoo {model}", estimate, part):
                continue
            start = time.monotonic()
            batches = self.args.batches
            limit = max(60.0, 4 * estimate * self.calibration(part))  # one model never eats the part
            eager = self.side("eager", model, batches, save=True, timeout=limit)
            refs = {str(b): e["params"] for b, e in eager.items() if "params" in e}
            ours = self.side("memplan", model, batches, reference=refs, allocator=self.args.allocator, timeout=limit)
            for b in batches:
                self.doc["rows"].append(make_row("zoo", model, b, eager.get(b), ours.get(b)))
            self.account(part, estimate, time.monotonic() - start)
            self.forget_params(model)
            self.write()

    def part_budget(self, models: list[str]) -> None:
        for model in models:
            estimate = self.estimate(model, ESTIMATE_S["budget"])
            if not self.admit(f"budget {model}", estimate, "budget"):
                continue
            start = time.monotonic()
            eager = self.eager_reference(model, self.args.budget_batch)
            refs = {str(self.args.budget_batch): eager["params"]} if eager and "params" in eager else {}
            ours = self.side(
                "memplan",
                model,
                [self.args.budget_batch],
                reference=refs,
                allocator=self.args.allocator,
                memory_budget=self.args.memory_budget,
            )
            row = make_row("budget", model, self.args.budget_batch, eager, ours.get(self.args.budget_batch))
            self.doc["rows"].append(row)
            self.account("budget", estimate, time.monotonic() - start)
            self.write()

    def part_fit(self, model: str) -> None:
        estimate = self.estimate(model, ESTIMATE_S["fit"])
        if not self.admit(f"fit {model}", estimate, "fit"):
            return
        start = time.monotonic()
        probe_batch, largest = (1, 4) if self.device == "cpu" else (self.args.fit_probe_batch, 128)
        size_spec = {"kind": "fit_size", "model": model, "probe_batch": probe_batch, "max_probe_batch": largest}
        size_spec["dry_batch"] = 8
        sized = self.run_job(size_spec, 240, f"fit {model}: size")
        if not sized.results:
            self.doc["fit"] = {"model": model, "error": _last_line(sized.tail)}
            self.write()
            return
        size = sized.results[0]
        fit: dict[str, Any] = {"model": model, "size": size, "tries": []}
        batch = size["batch"]
        eager = self.fit_eager(model, batch, size, fit)
        if eager.get("fits") and self.device == "cuda":  # the estimate was low: once more, larger
            batch = math.ceil(1.5 * batch)
            eager = self.fit_eager(model, batch, size, fit)
        margin = 0 if self.device == "cpu" else int(FIT_MARGIN * size["capacity_bytes"])
        budget = size["capacity_bytes"] - margin
        fit |= {"batch": batch, "budget_bytes": budget, "margin_bytes": margin, "allocator": self.args.fit_allocator}
        ours = self.side(
            "memplan",
            model,
            [batch],
            allocator=self.args.fit_allocator,
            memory_budget=budget,
            simulated_card=size["simulated_card"],
            warmup=2,
            steps=3,
            env=FIT_ENV,
            timeout=300,
        )
        row = make_row("fit", model, batch, eager if eager.get("fits") else None, ours.get(batch))
        row |= {"eager_fits": eager.get("fits"), "eager_error": eager.get("error"), "capacity": size["capacity_bytes"]}
        self.doc["rows"].append(row)
        self.doc["fit"] = fit
        self.account("fit", estimate, time.monotonic() - start)
        self.write()

    def fit_eager(self, model: str, batch: int, size: dict[str, Any], fit: dict[str, Any]) -> dict[str, Any]:
        """Eager at the fit batch: out of memory on the card (on the CPU: live bytes over the
        simulated card)."""
        got = self.side(
            "eager", model, [batch], warmup=1, steps=2, env=FIT_ENV, measure_live=self.device == "cpu", timeout=240
        ).get(batch, {"error": "no result"})
        live = got.get("live_peak_bytes")
        fits: bool | None = live is None or live <= size["capacity_bytes"]
        if got.get("oom"):
            fits = False
        elif "error" in got:  # neither ran nor ran out of memory: unknown
            fits = None
        got["fits"] = fits
        fit["tries"].append({"batch": batch, "eager_fits": fits, "oom": got.get("oom", False), "live_peak_bytes": live})
        return got

    def part_compile(self, models: list[str]) -> None:
        for model in models:
            estimate = self.estimate(model, ESTIMATE_S["compile"])
            if not self.admit(f"torch.compile {model}", estimate, "compile"):
                continue
            start = time.monotonic()
            batch = self.args.budget_batch
            eager = self.eager_reference(model, batch)
            refs = {str(batch): eager["params"]} if eager and "params" in eager else {}
            backend = "aot_eager_decomp_partition" if self.args.dry_run else "inductor"
            got = self.side(
                "compile", model, [batch], reference=refs, backend=backend, activation_memory_budget=0.5, timeout=400
            ).get(batch, {"error": "no result"})
            self.doc["torch_compile"].append(_compile_entry(model, batch, backend, eager, got, self.doc["rows"]))
            self.account("compile", estimate, time.monotonic() - start)
            self.write()

    # --- helpers

    def side(self, side: str, model: str, batches: list[int], timeout: float = 300, **extra: Any) -> dict[int, Any]:
        """One side of a model at ``batches`` in its own job: results by batch (a job that died
        leaves its error on each batch it did not report)."""
        spec = {"kind": "side", "side": side, "model": model, "batches": batches, "time_limit": self.args.time_limit}
        spec |= extra
        outcome = self.run_job(spec, timeout, f"{side} {model} b{','.join(map(str, batches))}")
        got = {r["batch"]: r for r in outcome.results}
        why = "timed out" if outcome.timed_out else f"job ended with rc {outcome.rc}: {_last_line(outcome.tail)}"
        for b in batches:
            got.setdefault(b, {"batch": b, "side": side, "error": why, "rc": outcome.rc, "tail": outcome.tail})
        if side == "eager" and extra.get("save"):
            for b, r in got.items():
                self.eager[(model, b)] = r
        return got

    def eager_reference(self, model: str, batch: int) -> dict[str, Any] | None:
        """Eager's results (and saved parameters) at ``batch``, from the zoo part or run now."""
        if (model, batch) not in self.eager or "params" not in self.eager[(model, batch)]:
            self.side("eager", model, [batch], save=True)
        return self.eager.get((model, batch))

    def forget_params(self, model: str) -> None:
        """Delete the saved parameters no later part compares with."""
        wanted = {m for m in (*self.budget_models(), *self.compile_models())}
        for (name, batch), result in self.eager.items():
            keep = name in wanted and batch == self.args.budget_batch
            if name == model and not keep and "params" in result:
                Path(result.pop("params")).unlink(missing_ok=True)

    def budget_models(self) -> list[str]:
        return self.args.budget_models or list(DRY["budget"] if self.args.dry_run else BUDGET_MODELS)

    def compile_models(self) -> list[str]:
        return self.args.compile_models or list(DRY["compile"] if self.args.dry_run else COMPILE_MODELS)

    def zoo_models(self) -> list[tuple[str, float]]:
        if self.args.models:
            known = dict(ZOO_ORDER)
            return [(m, known.get(m, 30.0)) for m in self.args.models]
        return [(m, ESTIMATE_S["tiny"]) for m in DRY["zoo"]] if self.args.dry_run else list(ZOO_ORDER)

    def run(self) -> int:
        """All parts in order; returns the exit status (1 without CUDA outside a dry run)."""
        self.write()
        if not self.probe():
            print(NO_CUDA, flush=True)
            self.doc["error"] = NO_CUDA
            self.write()
            return 1
        parts = self.args.parts
        zoo = self.zoo_models()
        steps: list[tuple[str, Callable[[], None]]] = [
            ("crash", self.part_crash),
            ("zoo", lambda: self.part_zoo(zoo, "zoo")),
            ("budget", lambda: self.part_budget(self.budget_models())),
            ("fit", lambda: self.part_fit(self.args.fit_model or (DRY["fit"] if self.args.dry_run else FIT_MODEL))),
            ("compile", lambda: self.part_compile(self.compile_models())),
            ("zoo", lambda: self.part_zoo(zoo, "zoo-rest")),
        ]
        for name, step in steps:
            if name not in parts:
                continue
            try:
                step()
            except Exception as error:  # a fault of the suite itself: the other parts still run
                traceback.print_exc()
                self.doc.setdefault("errors", []).append(f"{name}: {type(error).__name__}: {error}")
                self.write()
        self.doc["suite"]["elapsed_s"] = round(self.elapsed(), 1)
        self.write()
        print(f"[{self.elapsed():6.1f} s] done: {self.out / 'gpu_suite.json'}", flush=True)
        if not self.args.keep_work:
            shutil.rmtree(self.work, ignore_errors=True)
        return 0

    def write(self) -> None:
        self.doc["suite"]["elapsed_s"] = round(self.elapsed(), 1)
        _atomic_write(self.out / "gpu_suite.json", json.dumps(self.doc, indent=1, default=str) + "\n")
        _atomic_write(self.out / "gpu_suite.md", markdown(self.doc))


def _memory_note(dry_run: bool) -> str:
    if dry_run:
        return (
            "CPU dry run: *reserved* = the job's peak RSS over the timed steps (VmHWM after a reset; the suite's "
            "pages the forked job inherits included), *allocated* = null, device used = null; a budget is held "
            "when memplan's placed plan is within it; the fit card is simulated"
        )
    return (
        "eager: torch.cuda.max_memory_reserved / max_memory_allocated over the timed steps; memplan with the "
        "planned CUDA allocator: its own counters (bytes from cudaMalloc / handed out, the arena whole), with "
        "arena views: PyTorch's; device used: mem_get_info total less free, the job's CUDA context included"
    )


def _excerpt(text: str, size: int = 3000) -> str:
    """A job's output to keep: from a fatal error's report (faulthandler's, innermost frame first),
    else the end."""
    fatal = text.find("Fatal Python error")
    return text[fatal : fatal + size] if fatal >= 0 else text[-size:]


def _last_line(text: str) -> str:
    """The line saying why a job ended: a fatal error's first, else the last (an exception's)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "(no output)"
    return (lines[0] if lines[0].startswith("Fatal Python error") else lines[-1])[:300]


def _crash_record(outcome: Outcome) -> dict[str, Any]:
    stages = [r["stage"] for r in outcome.results if "stage" in r]
    final = outcome.results[-1] if outcome.results else {}
    record = {"rc": outcome.rc, "timed_out": outcome.timed_out, "seconds": round(outcome.seconds, 1)}
    record |= {"ok": bool(final.get("ok")) and outcome.rc == 0, "last_stage": stages[-1] if stages else None}
    record |= {"bit_identical": final.get("bit_identical"), "recomputed_kinds": final.get("recomputed_kinds")}
    record["refused"] = final.get("refused")
    record |= {k: final.get(k) for k in ("allocator", "replayed_steps", "device_calls")}
    record["stderr_tail"] = "" if record["ok"] else outcome.tail
    return record


def _needs_warn_only(outcome: Outcome, log_text: str) -> bool:
    """A job stopped by ``use_deterministic_algorithms(True)``: an op without a deterministic kernel."""
    told = [r.get("error") or "" for r in outcome.results] + [log_text]
    return any(NO_DETERMINISTIC_KERNEL in t for t in told)


def make_row(part: str, model: str, batch: int, eager: dict | None, ours: dict | None) -> dict[str, Any]:
    """The issue's row (and more) from the two sides' results at one batch."""
    e, m = eager or {}, ours or {}
    budget = m.get("budget") or {}
    row: dict[str, Any] = {"part": part, "model": model, "batch": batch}
    row |= {"eager_reserved_bytes": e.get("reserved_bytes"), "eager_allocated_bytes": e.get("allocated_bytes")}
    row |= {"memplan_reserved_bytes": m.get("reserved_bytes"), "memplan_allocated_bytes": m.get("allocated_bytes")}
    both = e.get("step_s") and m.get("step_s")
    row["time_ratio"] = round(m["step_s"] / e["step_s"], 4) if both else None
    row["max_abs_diff"] = m.get("max_abs_diff")
    row["budget_bytes"] = budget.get("budget_bytes")
    row["held"] = _held(row, budget, m.get("counters"))
    row |= {"bit_identical": m.get("bit_identical"), "eager_step_s": e.get("step_s"), "memplan_step_s": m.get("step_s")}
    row |= {
        "eager_device_used_bytes": e.get("device_used_bytes"),
        "memplan_device_used_bytes": m.get("device_used_bytes"),
    }
    row |= {k: m.get(k) for k in ("allocator", "allocator_reason", "planning_s", "replayed_steps", "diverged")}
    row |= {"memplan_warmup_reserved_bytes": m.get("warmup_reserved_bytes"), "counters": m.get("counters")}
    row["memplan_warmup_allocated_bytes"] = m.get("warmup_allocated_bytes")
    # where a time ratio above 1 goes: host time near the step time = Python-bound; device calls
    # per steady step (each synchronises); the replayed step's fallbacks to the cache
    row |= {"eager_host_s": e.get("host_s"), "memplan_host_s": m.get("host_s")}
    row |= {"eager_device_calls_per_step": e.get("device_calls_per_step")}
    row |= {"memplan_device_calls_per_step": m.get("device_calls_per_step"), "memplan_last_step": m.get("last_step")}
    if budget:
        row["budget"] = budget
    reserved, allocated = row["memplan_reserved_bytes"], row["eager_allocated_bytes"]
    row["reserved_below_eager_allocated"] = None if None in (reserved, allocated) else reserved < allocated
    notes = [f"{side}: {r[k]}" for side, r in (("eager", e), ("memplan", m)) for k in ("error", "refused") if r.get(k)]
    notes += [f"{side}: out of memory" for side, r in (("eager", e), ("memplan", m)) if r.get("oom")]
    notes += [f"{side}: warn_only determinism (an op has no deterministic kernel)" for side, r in
              (("eager", e), ("memplan", m)) if r.get("determinism") == "warn_only"]
    row["note"] = "; ".join(notes) or None
    row["warnings"] = sorted({*e.get("warnings", []), *m.get("warnings", [])}) or None
    return row


def _held(row: dict[str, Any], budget: dict[str, Any], counters: str | None) -> bool | None:
    """Within the budget: the reserved peak on CUDA; on the CPU (dry run) the placed plan."""
    limit = row["budget_bytes"]
    if limit is None:
        return None
    if counters in ("planned", "torch.cuda"):
        return None if row["memplan_reserved_bytes"] is None else row["memplan_reserved_bytes"] <= limit
    planned = budget.get("placed_peak_bytes") or budget.get("planned_peak_bytes")
    return None if planned is None else planned <= limit


def _compile_entry(model: str, batch: int, backend: str, eager: dict | None, got: dict, rows: list) -> dict[str, Any]:
    e = eager or {}
    ours = next((r for r in rows if r["part"] == "budget" and r["model"] == model and r["batch"] == batch), {})
    entry = {"model": model, "batch": batch, "backend": backend, "activation_memory_budget": 0.5}
    entry |= {"reserved_bytes": got.get("reserved_bytes"), "allocated_bytes": got.get("allocated_bytes")}
    entry |= {"step_s": got.get("step_s"), "compile_first_step_s": got.get("first_step_s")}
    both = e.get("step_s") and got.get("step_s")
    entry["time_ratio"] = round(got["step_s"] / e["step_s"], 4) if both else None
    entry |= {"max_abs_diff": got.get("max_abs_diff"), "bit_identical": got.get("bit_identical")}
    entry |= {"eager_reserved_bytes": e.get("reserved_bytes"), "eager_allocated_bytes": e.get("allocated_bytes")}
    entry |= {"memplan_budget_reserved_bytes": ours.get("memplan_reserved_bytes"), "error": got.get("error")}
    return entry


def _atomic_write(path: Path, text: str) -> None:
    partial = path.with_suffix(path.suffix + ".tmp")
    partial.write_text(text)
    partial.replace(path)


# ----------------------------------------------------------------------------- markdown


def _mib(value: Any) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def _num(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(doc: dict[str, Any]) -> str:
    """The JSON as tables (MiB), with the command and the settings."""
    suite = doc["suite"]
    lines = [
        "# memplan on a GPU: the one-shot suite (bench/gpu_suite.py)",
        "",
        f"Command: `{suite['command']}`, {suite['date']}; device: {doc['device']}; torch {doc['torch']}; "
        f"{suite['elapsed_s']} s of a {suite['budget_s']} s budget; jobs: {suite['jobs']}; "
        f"{suite['steps']} timed steps after {suite['warmup_steps']} warm-up steps (medians); {suite['determinism']}.",
        f"Memory: {suite['memory']}. One run; the machine's load was not controlled.",
        "",
    ]
    lines += _crash_lines(doc.get("crash_check"))
    header = (
        "| model | batch | eager reserved | eager allocated | memplan reserved | memplan allocated "
        "| memplan reserved / eager allocated | device used eager / memplan | time ratio | max abs diff "
        "| bit-identical | allocator | note |"
    )
    zoo = [r for r in doc["rows"] if r["part"] in ("zoo",)]
    lines += ["## The zoo, eager vs memplan (MiB)", "", header, "|---|---:|" + "---:|" * 8 + "---|---|---|"]
    lines += [_zoo_line(r) for r in zoo] + [""]
    lines += ["## memory_budget (MiB)", ""]
    lines += ["| part | model | batch | budget | memplan reserved | held | eager allocated | time ratio "]
    lines[-1] += "| max abs diff | bit-identical | plan | note |"
    lines += ["|---|---|---:|---:|---:|---|---:|---:|---:|---|---|---|"]
    lines += [_budget_line(r) for r in doc["rows"] if r["part"] in ("budget", "fit")] + [""]
    lines += _fit_lines(doc.get("fit")) + _compile_lines(doc.get("torch_compile") or [])
    if doc.get("skipped"):
        lines += ["## Skipped (would not finish within --budget-s)", ""]
        lines += [f"- {s['what']}: ~{s['estimate_s']} s needed, {s['left_s']} s left" for s in doc["skipped"]] + [""]
    return "\n".join(lines) + "\n"


def _crash_state(record: dict[str, Any]) -> str:
    if record["ok"]:
        return "passed"
    if record.get("refused") and record["rc"] == 0:
        return f"refused, at: {record['last_stage']} ({record['refused']})"
    return f"FAILED (exit status {record['rc']}, at: {record['last_stage']})"


def _crash_lines(record: dict[str, Any] | None) -> list[str]:
    if record is None:
        return ["## Crash check: not run", ""]
    state = _crash_state(record)
    lines = ["## Crash check", "", f"a budgeted compile_step then eager in one process: {state}; "]
    if "run" in record:
        lines[-1] = f"(call {record['run']}) " + lines[-1]
    lines[-1] += f"bit-identical: {record['bit_identical']}; recomputed: {record['recomputed_kinds']}."
    if record["stderr_tail"]:
        lines += ["", "```", record["stderr_tail"][-1500:], "```"]
    blocking = record.get("with_cuda_launch_blocking")
    if blocking:
        lines += ["", f"Again with CUDA_LAUNCH_BLOCKING=1: rc {blocking['rc']}, at: {blocking['last_stage']}"]
        lines += ["", "```", blocking["stderr_tail"][-1500:], "```"] if blocking["stderr_tail"] else []
    planned = record.get("planned_allocator")
    if planned:
        state = _crash_state(planned)
        lines += ["", f"The same with the planned allocator (allocator='replay'): {state}; "]
        lines[-1] += f"replayed steps: {planned['replayed_steps']}; bit-identical: {planned['bit_identical']}; "
        lines[-1] += f"device calls (a pointer freed twice: unknown_frees): {planned['device_calls']}."
        lines += ["", "```", planned["stderr_tail"][-1500:], "```"] if planned["stderr_tail"] else []
    return [*lines, ""]


def _zoo_line(r: dict[str, Any]) -> str:
    ratio = None
    if r["memplan_reserved_bytes"] is not None and r["eager_allocated_bytes"]:
        ratio = r["memplan_reserved_bytes"] / r["eager_allocated_bytes"]
    used = f"{_mib(r['eager_device_used_bytes'])} / {_mib(r['memplan_device_used_bytes'])}"
    cells = [r["model"], str(r["batch"]), _mib(r["eager_reserved_bytes"]), _mib(r["eager_allocated_bytes"])]
    cells += [_mib(r["memplan_reserved_bytes"]), _mib(r["memplan_allocated_bytes"]), _num(ratio), used]
    cells += [_num(r["time_ratio"]), _num(r["max_abs_diff"], ".3g"), str(r["bit_identical"]), str(r["allocator"])]
    return "| " + " | ".join([*cells, _run_note(r)]) + " |"


def _run_note(r: dict[str, Any]) -> str:
    """The row's note, with the call that measured it when calls were merged."""
    note = r["note"] or ""
    return note if "run" not in r else f"call {r['run']}" + (f"; {note}" if note else "")


def _budget_line(r: dict[str, Any]) -> str:
    plan = r.get("budget") or {}
    overhead = plan.get("overhead")
    how = f"{plan.get('method')}, +{100 * overhead:.2f}% compute" if overhead is not None else str(plan.get("method"))
    cells = [r["part"], r["model"], str(r["batch"]), _mib(r["budget_bytes"]), _mib(r["memplan_reserved_bytes"])]
    cells += [str(r["held"]), _mib(r["eager_allocated_bytes"]), _num(r["time_ratio"]), _num(r["max_abs_diff"], ".3g")]
    cells += [str(r["bit_identical"]), how if plan else "-", _run_note(r)]
    return "| " + " | ".join(cells) + " |"


def _fit_lines(fit: dict[str, Any] | None) -> list[str]:
    if not fit:
        return ["## Fit: not run", ""]
    if "error" in fit and "size" not in fit:
        return ["## Fit", "", f"{fit['model']}: sizing failed: {fit['error']}", ""]
    size = fit["size"]
    card = "simulated card" if size["simulated_card"] else "free on the card"
    text = (
        f"{fit['model']}: live bytes {_mib(size['fixed_bytes'])} MiB + {_mib(size['per_sample_bytes'])} MiB per sample "
        f"(measured, [batch, bytes]: {size['probe_live_bytes']}); {card}: {_mib(size['capacity_bytes'])} MiB; "
        f"tries: {fit['tries']}; memplan at batch {fit.get('batch')} with memory_budget "
        f"{_mib(fit.get('budget_bytes'))} MiB (margin {_mib(fit.get('margin_bytes'))} MiB, allocator "
        f"{fit.get('allocator')}); its row is in the table above (part fit)."
    )
    return ["## Fit: a batch eager cannot fit", "", text, ""]


def _compile_lines(entries: list[dict[str, Any]]) -> list[str]:
    if not entries:
        return ["## torch.compile with activation_memory_budget: not run", ""]
    lines = ["## torch.compile with activation_memory_budget=0.5 beside memplan's memory_budget=0.5 (MiB)", ""]
    lines += ["| model | batch | backend | reserved | allocated | memplan (budget 0.5) reserved | eager allocated "]
    lines[-1] += "| time ratio | first step s | max abs diff | note |"
    lines += ["|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in entries:
        cells = [c["model"], str(c["batch"]), c["backend"], _mib(c["reserved_bytes"]), _mib(c["allocated_bytes"])]
        cells += [_mib(c["memplan_budget_reserved_bytes"]), _mib(c["eager_allocated_bytes"]), _num(c["time_ratio"])]
        cells += [_num(c["compile_first_step_s"], ".1f"), _num(c["max_abs_diff"], ".3g"), c["error"] or ""]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


# ----------------------------------------------------------------------------- merging calls


def _measured(row: dict[str, Any]) -> bool:
    """A row whose memplan side ran (a crashed or skipped side leaves its bytes null)."""
    return row.get("memplan_reserved_bytes") is not None


def merge_runs(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One document from several calls of the suite on the same device, in the order given.

    A row (part, model, batch) or a check a later call measured replaces an earlier one that
    failed; a measured row is never replaced by a failed one. Each row names its call
    (``run``, 1-based) and the page lists every call's command, so nothing is attributed to a
    call that did not make it.
    """
    devices = {d["device"] for d in docs}
    if len(devices) != 1:
        raise SystemExit(f"gpu_suite --merge: the calls ran on different devices ({sorted(devices)}); merge per device")
    merged: dict[str, Any] = {"device": docs[0]["device"], "torch": docs[0]["torch"], "rows": []}
    merged |= {"crash_check": None, "fit": None, "torch_compile": [], "skipped": [], "runs": []}
    keyed: dict[tuple[str, str, int], dict[str, Any]] = {}
    for number, doc in enumerate(docs, start=1):
        merged["runs"].append({"run": number, **{k: doc["suite"][k] for k in ("command", "date", "jobs")}})
        for row in doc["rows"]:
            key = (row["part"], row["model"], row["batch"])
            if key not in keyed or _measured(row) or not _measured(keyed[key]):
                keyed[key] = {**row, "run": number}
        crash = doc.get("crash_check")
        if crash is not None and (merged["crash_check"] is None or crash["ok"] or not merged["crash_check"]["ok"]):
            merged["crash_check"] = {**crash, "run": number}
        if doc.get("fit"):
            merged["fit"] = {**doc["fit"], "run": number}
        for entry in doc.get("torch_compile") or []:
            merged["torch_compile"] = [c for c in merged["torch_compile"] if c["model"] != entry["model"]
                                       or (c["reserved_bytes"] is not None and entry["reserved_bytes"] is None)]
            if not any(c["model"] == entry["model"] for c in merged["torch_compile"]):
                merged["torch_compile"].append({**entry, "run": number})
    merged["rows"] = list(keyed.values())
    measured = {(r["part"], r["model"]) for r in merged["rows"] if _measured(r)}
    for number, doc in enumerate(docs, start=1):
        for skip in doc.get("skipped") or []:
            part, _, model = skip["what"].partition(" ")
            if (part, model) not in measured and skip["what"] not in {s["what"] for s in merged["skipped"]}:
                merged["skipped"].append({**skip, "run": number})
    first = docs[0]["suite"]
    merged["suite"] = {**first, "command": "; ".join(f"({r['run']}) {r['command']}" for r in merged["runs"]),
                       "jobs": ", ".join(f"({r['run']}) {r['jobs']}" for r in merged["runs"]),
                       "elapsed_s": round(sum(d["suite"]["elapsed_s"] for d in docs), 1),
                       "budget_s": round(sum(d["suite"]["budget_s"] for d in docs), 1)}
    return merged


def write_merged(paths: list[str], out: Path) -> int:
    """``--merge A.json B.json ... --out DIR``: DIR/gpu_suite.json and gpu_suite.md from the calls given."""
    docs = [json.loads(Path(path).read_text()) for path in paths]
    merged = merge_runs(docs)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / "gpu_suite.json", json.dumps(merged, indent=1, default=str) + "\n")
    _atomic_write(out / "gpu_suite.md", markdown(merged))
    print(f"gpu_suite: merged {len(docs)} calls into {out / 'gpu_suite.md'}")
    return 0


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", help="folder for gpu_suite.json, gpu_suite.md and gpu_suite.log")
    parser.add_argument("--dry-run", action="store_true", help="the same code on tiny models on the CPU")
    parser.add_argument("--budget-s", type=float, default=400.0, help="the suite's wall time, setup included")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"a subset of {','.join(PARTS)}")
    parser.add_argument("--models", default=None, help="zoo models (default: the whole zoo, cheapest first)")
    # batch 32 only: spawned jobs cost ~10 s each, and batch 1 is host-bound on a GPU anyway
    parser.add_argument("--batches", default="32", help="the zoo's batch sizes (the dry run: 1,4)")
    parser.add_argument("--budget-models", default=None, help=f"default: {','.join(BUDGET_MODELS)}")
    parser.add_argument("--compile-models", default=None, help=f"default: {','.join(COMPILE_MODELS)}")
    parser.add_argument("--fit-model", default=None, help=f"default: {FIT_MODEL}")
    parser.add_argument(
        "--fit-probe-batch", type=int, default=4, help="fit: live bytes measured from this batch, doubling"
    )
    parser.add_argument("--fit-allocator", choices=("views", "replay"), default="views")
    parser.add_argument(
        "--allocator", choices=("auto", "replay", "views"), default="auto", help="memplan's, zoo/budget"
    )
    parser.add_argument("--memory-budget", type=float, default=0.5, help="the budget part's memory_budget")
    parser.add_argument("--budget-batch", type=int, default=BUDGET_BATCH)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side (after 6 warm-up steps)")
    parser.add_argument("--time-limit", type=float, default=None, help="memplan's solver time limit, s (10; dry: 2)")
    parser.add_argument("--wheelhouse", default=str(ROOT / ".whl"), help="wheels installed if missing (--target)")
    parser.add_argument("--site", default=SITE, help="where the wheels are installed")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="merge these calls' gpu_suite.json into --out")
    parser.add_argument("--fork", action="store_true", help="fork jobs from the suite instead of spawning them")
    parser.add_argument("--spawn", action="store_true", help=argparse.SUPPRESS)  # the default; kept for old commands
    parser.add_argument("--work", default=None, help="folder for the jobs' logs and parameters (default: a temp dir)")
    parser.add_argument("--keep-work", action="store_true")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--job-results", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # the dry run (CPU only, no cuDNN) forks unless told to spawn: its rehearsal stays quick
    args.spawn = args.spawn or not (args.fork or args.dry_run)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    args.batches = [int(b) for b in args.batches.split(",")]
    for name in ("models", "budget_models", "compile_models"):
        value = getattr(args, name)
        setattr(args, name, [m.strip() for m in value.split(",") if m.strip()] if value else None)
    if args.dry_run and args.batches == [32]:
        args.batches = [1, 4]
    if args.dry_run and args.memory_budget == 0.5:
        # the tiny CNN cannot go below 0.68 of its checkpoint-all peak (proven), and at 0.5 the tiny
        # GPT-2's plan depended on the 2 s solve getting enough of a loaded machine
        args.memory_budget = 0.75
    if args.dry_run and args.budget_batch == BUDGET_BATCH:
        args.budget_batch = 16
    if args.dry_run and args.time_limit is None:
        args.time_limit = 2.0
    args.time_limit = 10.0 if args.time_limit is None else args.time_limit
    if args.job is None and not args.out:
        parser.error("--out FOLDER is required")
    return args


def _prepare_parent() -> dict[str, Any]:
    """Imports and builds the forked jobs share, none of which starts CUDA (timed)."""
    start = time.monotonic()
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() without starting CUDA
    import memplan.api  # noqa: F401
    import torch
    from memplan.torch import zoo  # noqa: F401
    from memplan.torch.run import allocator, cuda_allocator

    for module in ("transformers", "torch._dynamo", "torch._functorch.aot_autograd", "memplan.torch.run.budget"):
        importlib.import_module(module)
    built = {"cpu_allocator": allocator.available()}
    try:
        cuda_allocator.build()
        built["cuda_allocator"] = True
    except Exception as error:
        built["cuda_allocator"] = _failure(error)
    if torch.cuda.is_initialized():  # a fork would then not start CUDA in the jobs
        raise SystemExit("gpu_suite: CUDA was started by an import; run with --spawn")
    gc.freeze()  # the jobs' collections skip (and do not copy) what they inherit
    return {"prepare_s": round(time.monotonic() - start, 2), "built": built}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update(DETERMINISM_ENV)
    if args.job is not None:  # a spawned job
        run_job_here(json.loads(args.job), args.job_results)
        return 0
    if args.merge:
        return write_merged(args.merge, Path(args.out))
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.stdout = Tee(sys.stdout, out / "gpu_suite.log")
    print(f"gpu_suite: {' '.join(sys.argv)}", flush=True)
    setup = ensure_dependencies(Path(args.wheelhouse), args.site)
    print(f"setup: installed {setup['installed'] or 'nothing'} in {setup['install_s']} s", flush=True)
    if not args.spawn:
        setup |= _prepare_parent()
    args.setup_s = time.monotonic() - started
    return Suite(args, setup).run()


if __name__ == "__main__":
    raise SystemExit(main())
