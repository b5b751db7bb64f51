"""Which setting makes a CUDA convolution die with SIGSEGV on a lent GPU? Each case in its own interpreter.

    PYTHONPATH=src python3 bench/diag/conv_segv.py

On the H100 of 2026-11-27 (torch 2.11.0+cu130) every case here passed, while every cuDNN convolution in a
job *forked* from bench/gpu_suite.py died; the suite spawns its jobs since. The last case forks as the
suite did, to check an image before using ``gpu_suite.py --fork``.
"""

import os
import subprocess
import sys
import textwrap
import time

STEP = """
m = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Conv2d(16, 8, 3)).cuda()
x = torch.randn(4, 3, 32, 32, device="cuda")
m(x).sum().backward(); torch.cuda.synchronize(); print("ok")
"""
BASE = "import faulthandler, os, sys; faulthandler.enable()\nimport torch\n{pre}\n" + STEP
DETERMINISTIC = (
    "torch.use_deterministic_algorithms(True, warn_only=True); os.environ['CUBLAS_WORKSPACE_CONFIG'] = ':4096:8'; "
    "torch.backends.cudnn.deterministic = True; torch.backends.cudnn.benchmark = False"
)
FORKED = (
    "import transformers, memplan.torch.run.budget\npid = os.fork()\n"
    "if pid: os._exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))"
)
CASES = {
    "plain": "",
    "cudnn_off": "torch.backends.cudnn.enabled = False",
    "deterministic": DETERMINISTIC,
    "ortools_first": "import ortools.sat.python.cp_model",
    "memplan_import": "import memplan, memplan.torch",
    "highspy_first": "import highspy",
    "pandas_pyarrow": "import pandas, pyarrow",
    "transformers": "import transformers",
    "forked": FORKED,
}


def main() -> None:
    env = dict(os.environ, PYTHONPATH=os.environ.get("SITE", "/tmp/memplan-site") + ":src")
    for name, pre in CASES.items():
        start = time.time()
        command = [sys.executable, "-c", BASE.format(pre=pre)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:])[:300]
        print(f"{name:16s} rc {done.returncode:4d} {time.time() - start:5.1f}s  {tail}", flush=True)
        if done.returncode < 0:
            print(textwrap.indent(done.stderr[-1500:], "    "), flush=True)


if __name__ == "__main__":
    main()
