"""bench/fit.py's models: each Llama's description states the size its config builds (on fake
tensors: no memory, seconds)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_fit_models", ROOT / "bench" / "fit.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_fit_models"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


fit = _bench()


@pytest.mark.parametrize("name", sorted(fit.LLAMAS))
def test_llama_description_states_what_the_config_builds(name: str) -> None:
    """The parameter count and the layers a row's heading names are the built model's."""
    from memplan.torch.capture.fake import new_fake_mode

    spec = fit.MODELS[name]
    layers, hidden, mlp = fit.LLAMAS[name]
    with new_fake_mode():
        w = fit.build(name, 1)
    billions = sum(p.numel() for p in w.model.parameters()) / 1e9
    stated = re.search(r"\((\d+\.\d+)B params\)", spec.description)
    assert stated is not None and float(stated.group(1)) == round(billions, 2)
    assert f"{layers} layers, hidden {hidden}" in spec.description and f"MLP {mlp}" in spec.description
    assert tuple(w.inputs.shape) == (1, 512)


def test_render_names_its_json_and_each_tables_command(tmp_path: Path) -> None:
    """``--render X.json`` rewrites X.md whose header names X.json (not another page's JSON) and
    whose table names the command that made it; a killed checkpoint try still says what it ran."""
    command = "python bench/fit.py --models gpt2 --batch 8 --limits 0.6 --out X.md"
    killed = {"contender": "checkpoint", "batch": 8, "limit_bytes": 2994 * 2**20, "outcome": "killed (OOM)"}
    killed["setting"] = fit.describe({"contender": "checkpoint"})
    run = {
        "command": command,
        "mechanism": "cgroup-v1",
        "where": "/sys/fs/cgroup/memory/x",
        "steps": 3,
        "models": [
            {
                "model": "gpt2",
                "batch": 8,
                "description": fit.MODELS["gpt2"].description,
                "reference": {"outcome": "fits", "step_seconds": [3.0, 2.0, 2.0]},
                "rows": [killed],
            }
        ],
    }
    path = tmp_path / "fit.x.json"
    path.write_text(json.dumps(run))
    fit.render(path, [])
    text = path.with_suffix(".md").read_text()
    assert f"--render {path}`" in text and "--render bench/results/fit.json" not in text
    assert f"`{command}`: 3 steps per try." in text
    assert "| checkpoint around every block | **killed (OOM)** |" in text


def test_memplan_rows_name_the_peak_of_each_phase() -> None:
    """A fitting memplan try says which phase (setup: capture and planning; step 1: recording ...)
    peaked; a killed one names the phase it ended in instead."""
    mib = 2**20
    phases = {"build": 900 * mib, "setup": 2500 * mib, "step 1": 3205 * mib, "step 2": 2872 * mib}
    row = {"contender": "memplan-fit", "batch": 8, "limit_bytes": 2994 * mib, "outcome": "fits"}
    line = fit._row({**row, "phase_peak_rss_bytes": phases}, None)
    assert "VmHWM by phase MiB: build 900, setup 2500, step 1 3205, step 2 2872" in line
    killed = fit._row({**row, "outcome": "killed (OOM)", "last_phase": "step 1", "phase_peak_rss_bytes": phases}, None)
    assert "ended during: step 1" in killed and "VmHWM by phase" not in killed
