"""Solve in a child process, so the solvers' memory never stays in the training process.

The solvers (OR-Tools' CP-SAT, the placement search, the reordering heuristics) allocate tens of
MiB of short-lived objects. Freed, that memory mostly stays resident: the C library keeps pages
its threads' heaps touched, Python keeps every pymalloc arena that one surviving object pins. A
training process then carries it through every later step, on top of the plan (issue 15: on
MobileNet-v2 at batch 1, 18 MiB of RSS after one plan, more than the plan saved).

``in_child`` runs a pure function in a forked copy of this process and returns its result by
pickle; the parent's heap never sees the solver's allocations. The child shares the parent's
memory copy-on-write and touches only what the solver reads, and it never runs torch: what is
solved here is the pure-Python core (graphs, placement problems), which never imports it.
Forking is Linux-only here (where RSS is what the user sees and ``fork`` is cheap and safe for
code that does not touch torch), and never once the process has started CUDA; elsewhere, or with
``MEMPLAN_SOLVE_IN_PROCESS=1``, the function runs in this process.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from memplan.errors import MemplanError

T = TypeVar("T")
IN_PROCESS_ENV = "MEMPLAN_SOLVE_IN_PROCESS"


def forking_enabled() -> bool:
    """Whether :func:`in_child` forks (Linux, unless ``MEMPLAN_SOLVE_IN_PROCESS=1``, and not
    once this process has started CUDA: :func:`cuda_started`)."""
    if sys.platform != "linux" or not hasattr(os, "fork") or cuda_started():
        return False
    return os.environ.get(IN_PROCESS_ENV, "") in ("", "0")


def cuda_started() -> bool:
    """Whether this process holds a CUDA context (torch loaded by the caller, CUDA initialised).

    The CUDA runtime does not support ``fork`` once it is initialised (PyTorch's
    multiprocessing notes), and on an H100 a process that planned a budget on CUDA died in its
    next CUDA call (a fatal error in a convolution's forward, cause not found): with CUDA
    started the solvers run in this process. torch is never imported here."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    started = getattr(cuda, "is_initialized", None)
    return bool(started()) if callable(started) else False


def in_child(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, computed in a forked child when :func:`forking_enabled`; the
    child's exception, if it raised one, is raised here. A child that dies without an answer
    (killed, out of memory) is a one-line :class:`MemplanError`."""
    if not forking_enabled():
        return fn(*args, **kwargs)
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: answer through the pipe, then leave without the parent's exit handlers
        os.close(read_fd)
        _answer(write_fd, fn, args, kwargs)
    os.close(write_fd)
    try:
        with os.fdopen(read_fd, "rb") as pipe:
            payload = pipe.read()
    except BaseException:  # interrupted: the child must not outlive the question
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    _, wait_status = os.waitpid(pid, 0)
    if not payload:
        raise MemplanError(
            f"the solver's process ended without an answer ({_describe(wait_status)}); "
            f"set {IN_PROCESS_ENV}=1 to solve in this process and see the error"
        )
    try:
        ok, value = pickle.loads(payload)
    except Exception as err:
        raise MemplanError(f"the solver's answer could not be read back ({err}); set {IN_PROCESS_ENV}=1") from err
    if ok:
        return value
    raise value


def _answer(write_fd: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    code = 0
    try:
        try:
            message = (True, fn(*args, **kwargs))
        except BaseException as err:
            message = (False, err)
        try:
            payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:
            payload = pickle.dumps((False, MemplanError(f"the solver's answer could not be sent back: {err}")))
        with os.fdopen(write_fd, "wb") as pipe:
            pipe.write(payload)
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _describe(wait_status: int) -> str:
    if os.WIFSIGNALED(wait_status):
        return f"killed by signal {os.WTERMSIG(wait_status)}"
    return f"exit status {os.waitstatus_to_exitcode(wait_status)}"
