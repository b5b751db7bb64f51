"""A planned step checks, on its first run, that it changed what eager's step would have.

A planned step must train exactly as eager does or refuse to run; a step that runs and trains
differently is the worst outcome there is. Tests compare against eager, but a user's model is
not in the tests, so the runtime holds its first step to an account written apart from the
code that runs it. Capture knows, independently of how the runtime groups and orders work:

* which parameters received a gradient (autograd's accumulate hooks): each one the optimizer
  owns must be written by the step, and no other parameter may be;
* how eager's optimizer state looks after a step (the fake optimizer after the traced step):
  each updated parameter's state has those keys, shapes and dtypes, and its ``step`` count
  advanced by one; the state of every other parameter is unchanged;
* which buffers the step writes (BatchNorm's running statistics and ``num_batches_tracked``),
  and that no other buffer is written;
* which random ops run, in which order and at which sizes: the generator advances by what
  they draw, so the same sequence leaves it where eager leaves it;
* that ``zero_grad(set_to_none=True)`` leaves no ``.grad`` behind.

Writes and random draws are observed around the step (only while checking), by a dispatch mode
(every op's written storages, the random ops and their output shapes). A dispatch mode changes
the step's allocations, though (it wraps scalars into tensors and changes which kernels
allocate), so the first step the planned CPU allocator records would not stand for the later
ones. There the first step is checked without one (issue 37: :class:`UnobservedCheck`): the
runtime calls the ops that draw random numbers or write an argument their schema does not mark
(BatchNorm's running statistics) through ``StepRunner._watched``, which notes each random op
with its output shapes and the generator's state around it, and each unmarked write's storage;
every other write shows in the parameters' and buffers' version counters (every op that writes
an argument its schema marks bumps its counter, which views share) or bytes (a write through
``.data``, whose counter is its own); and the generator's states, read before and after the step
outside the recording, must chain through the random ops' with no draw between them. None of it
allocates a tensor. A violation raises :class:`memplan.errors.SelfCheckFailed` naming what
differs.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

import torch
from memplan.errors import SelfCheckFailed
from memplan.torch.capture import Capture
from memplan.torch.tensors import is_random, storage_key, tensor_leaves, written_arguments


@dataclass(frozen=True)
class StepExpectations:
    """What eager's step changes, as capture saw it."""

    updated_params: frozenset[str]  # owned by the optimizer and given a gradient
    written_buffers: frozenset[str]
    random_ops: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...]  # (op, output shapes), in program order
    state_meta: dict[str, dict[str, tuple]]
    grads_cleared: bool = True


def expectations(
    capture: Capture, optimizers: Sequence[torch.optim.Optimizer], model: torch.nn.Module
) -> StepExpectations:
    graph = capture.graph
    written = set()
    for op_id, op in enumerate(graph.ops):
        if capture.op_phase[op_id] in ("forward", "backward"):
            for t in op.mutates:
                kind, _, name = graph.tensors[t].name.partition(":")
                if kind == "buffer":
                    written.add(name)
    random_ops = tuple(
        (node.target._schema.name, _shapes(node.meta.get("val")))
        for node in capture.gm.graph.nodes
        if node.op == "call_function" and is_random(node.target)
    )
    ids = {id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
    owned = {name for name, p in model.named_parameters() if id(p) in ids}
    updated = frozenset(name for name in capture.grad_storage_by_param if name in owned)
    training = capture.mode == "train"
    return StepExpectations(updated, frozenset(written), random_ops, dict(capture.optimizer_state_meta), training)


class _Witness(TorchDispatchMode):
    """Records the storages every op writes and the random ops, as they run."""

    def __init__(self, random_names: set[str]) -> None:
        super().__init__()
        self.random_names = random_names
        self.written: set[int] = set()
        self.random_ops: list[tuple[str, tuple[tuple[int, ...], ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if hasattr(func, "_schema"):
            for value in written_arguments(func, args, kwargs):
                self.written.update(storage_key(t) for t in tensor_leaves(value))
            name = func._schema.name
            if is_random(func) or name in self.random_names:
                self.random_ops.append((name, _shapes(result)))
        return result


class _VersionWitness:
    """The parameters and buffers a step wrote, without a dispatch mode: their version counters
    moved or their bytes changed (:func:`_digest`). Allocates no tensor."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self.written: set[int] = set()

    def __enter__(self) -> _VersionWitness:
        self._versions = [t._version for t in self.tensors]
        self._digests = [_digest(t) for t in self.tensors]
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None:
            return
        moved = [t for t, v in zip(self.tensors, self._versions, strict=True) if t._version != v]
        moved += [t for t, d in zip(self.tensors, self._digests, strict=True) if _digest(t) != d]
        self.written = {storage_key(t) for t in moved}


DIGEST_CHUNKS = 256  # a tensor above DIGEST_CHUNKS * DIGEST_CHUNK_BYTES is hashed by evenly spaced chunks
DIGEST_CHUNK_BYTES = 256


def _digest(t: torch.Tensor) -> bytes | None:
    """A hash of a CPU tensor's bytes (of evenly spaced chunks of them when it is large: an
    update writes every element), read without PyTorch allocating; None off the CPU or for a
    tensor numpy cannot view (its version counter decides alone)."""
    if t.device.type != "cpu" or t.layout != torch.strided:
        return None
    data = t.detach()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(data.element_size())
    try:
        if as_int is not None and not data.is_complex():
            data = data.view(as_int)
        array = data.numpy()
    except (TypeError, RuntimeError):
        return None
    digest = hashlib.blake2b(digest_size=16)
    if not array.flags.c_contiguous or array.nbytes <= DIGEST_CHUNKS * DIGEST_CHUNK_BYTES:
        digest.update(array.tobytes())
        return digest.digest()
    raw = memoryview(array.reshape(-1)).cast("B")
    stride = (len(raw) - DIGEST_CHUNK_BYTES) // (DIGEST_CHUNKS - 1)
    for k in range(DIGEST_CHUNKS):
        digest.update(raw[k * stride : k * stride + DIGEST_CHUNK_BYTES])
    return digest.digest()


class UnobservedCheck:
    """The full check of one step without a dispatch mode (see the module docstring).
    :meth:`before` and :meth:`after` run outside the planned allocator's recording (reading the
    generator's state allocates a tensor), the step inside :meth:`SelfCheck.watch` with
    ``unobserved=self``, its random ops and unmarked writes through :meth:`call`."""

    def __init__(self) -> None:
        self.random_ops: list[tuple[str, tuple[tuple[int, ...], ...]]] = []
        self.unmarked: set[int] = set()  # storages written by ops that do not mark the write
        self._states: list[Any] = []  # the generator around each random op: (before, after) clones
        self._first: torch.Tensor | None = None

    def before(self) -> None:
        self._first = torch.random.get_rng_state()

    def call(self, fn: Any, op: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)``, the call of ``op``, noted."""
        if not is_random(op):
            result = fn(*args, **kwargs)
            for value in written_arguments(op, args, kwargs):
                self.unmarked.update(storage_key(t) for t in tensor_leaves(value))
            return result
        generator = torch.default_generator
        before = generator.clone_state()  # a generator object: no tensor allocated
        result = fn(*args, **kwargs)
        self._states.append((before, generator.clone_state()))
        self.random_ops.append((op._schema.name, _shapes(result)))
        return result

    def after(self) -> None:
        """The generator's states chain: from the step's start through each random op's to the
        step's end, with no draw between (raises :class:`SelfCheckFailed`)."""
        first, self._first = self._first, None
        if first is None:
            return
        chain = [first]
        for before, after in self._states:
            chain += [before.get_state(), after.get_state()]
        chain.append(torch.random.get_rng_state())
        for k in range(0, len(chain), 2):
            if not torch.equal(chain[k], chain[k + 1]):
                where = "before its first random op" if k == 0 else f"after random op #{k // 2 - 1}"
                where = "" if len(chain) == 2 else f" {where}"
                _fail(f"the step drew random numbers{where} outside the ops eager draws with")


class SelfCheck:
    """``with check.watch(): step(...)`` raises :class:`SelfCheckFailed` if the step did not
    change exactly what eager's step changes (see the module docstring)."""

    def __init__(
        self,
        capture: Capture,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        scaler: Any = None,
    ) -> None:
        self.optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        self.expected = expectations(capture, self.optimizers, model)
        self.model = model
        self.scaler = scaler

    @contextlib.contextmanager
    def watch(self, *, observe_ops: bool = True, unobserved: UnobservedCheck | None = None) -> Iterator[None]:
        """Check the step run inside. ``observe_ops=False`` checks only what needs no dispatch
        mode (optimizer state, gradients): a Python dispatch mode wraps scalars into tensors,
        which changes the allocation sequence the planned allocator replays. ``unobserved``:
        the full check without one (:class:`UnobservedCheck`: the caller runs its ``before``
        and ``after`` around this, and the step's watched ops through its ``call``), only where
        :meth:`unobserved_possible` holds."""
        before = self._state_before()
        scale_before = self._scale()
        if unobserved is not None:
            tensors = [*(p for _, p in self.model.named_parameters()), *(b for _, b in self.model.named_buffers())]
            witness: Any = _VersionWitness(tensors)
        else:
            witness = _Witness({name for name, _ in self.expected.random_ops})
        with witness if observe_ops else contextlib.nullcontext():
            yield
        skipped = self._scaler_skipped(before, scale_before)
        if observe_ops:
            written = witness.written if unobserved is None else witness.written | unobserved.unmarked
            self._check_writes(written, skipped)
            self._check_random(witness.random_ops if unobserved is None else unobserved.random_ops)
        if not skipped:
            self._check_state(before)
        self._check_grads()

    def unobserved_possible(self) -> bool:
        """Whether a full check of this step can do without a dispatch mode: no optimizer is
        fused (``fused=True``: its kernels write the parameters without moving their version
        counters, and an update may leave them byte for byte, at a warm-up's lr of 0)."""
        return not any(group.get("fused") for opt in self.optimizers for group in opt.param_groups)

    def _scale(self) -> float | None:
        scale = getattr(self.scaler, "_scale", None) if self.scaler is not None else None
        return float(scale.item()) if isinstance(scale, torch.Tensor) else None

    def _scaler_skipped(self, before: dict[str, dict[str, Any]], scale_before: float | None) -> bool:
        """A GradScaler skips the whole update when a gradient is not finite, and backs its
        scale off: then no parameter may be written and no state may change."""
        if scale_before is None or (self._scale() or 0.0) >= scale_before:
            return False
        after = {name: _summary(state) for name, state in self._states().items()}
        if after != before:
            _fail("the scaler backed off (a gradient was not finite) but the optimizer state changed")
        return True

    def _check_writes(self, written: set[int], skipped: bool) -> None:
        updated = frozenset() if skipped else self.expected.updated_params
        _check_written("parameter", self.model.named_parameters(), updated, written)
        _check_written("buffer", self.model.named_buffers(), self.expected.written_buffers, written)

    def _state_before(self) -> dict[str, dict[str, Any]]:
        return {name: _summary(state) for name, state in self._states().items()}

    def _states(self) -> dict[str, dict[str, Any]]:
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {names[id(p)]: state for opt in self.optimizers for p, state in opt.state.items() if id(p) in names}

    def _check_state(self, before: dict[str, dict[str, Any]]) -> None:
        after = self._states()
        for name in sorted(set(before) | set(after) | self.expected.updated_params):
            if name not in self.expected.updated_params:
                if name in after and _summary(after[name]) != before.get(name):
                    _fail(f"the optimizer state of parameter {name!r} changed, which eager's step would not do")
                continue
            expected = self.expected.state_meta.get(name)
            meta = {key: _meta(v) for key, v in after[name].items()} if name in after else None
            if meta != expected:
                _fail(f"the optimizer state of parameter {name!r} is {meta}, eager's step would leave {expected}")
            if meta is not None and "step" in after[name]:
                previous = before.get(name, {}).get("step", 0.0)
                if _number(after[name]["step"]) != previous + 1:
                    _fail(f"the step count of {name!r} went from {previous} to {_number(after[name]['step'])}, not +1")

    def _check_random(self, ran: list[tuple[str, tuple]]) -> None:
        expected = list(self.expected.random_ops)
        if ran != expected:
            _fail(
                f"the step ran {len(ran)} random op(s) where eager runs {len(expected)} "
                f"(first difference: {_first_difference(ran, expected)}), so the random generator would differ"
            )

    def _check_grads(self) -> None:
        if not self.expected.grads_cleared:
            return
        for name, param in self.model.named_parameters():
            if param.grad is not None:
                _fail(f"parameter {name!r} kept a .grad after the step, which zero_grad(set_to_none=True) clears")


def _check_written(
    kind: str, named: Iterator[tuple[str, torch.Tensor]], expected: frozenset[str], written: set[int]
) -> None:
    """Exactly the ``expected`` tensors were written (for a parameter: given a gradient)."""
    for name, tensor in named:
        wrote = storage_key(tensor) in written
        if name in expected and not wrote:
            what = "received a gradient but the step did not update it" if kind == "parameter" else "was not updated"
            _fail(f"{kind} {name!r} {what}" + ("" if kind == "parameter" else ", which eager's step would do"))
        if name not in expected and wrote:
            _fail(f"{kind} {name!r} was written by the step, which eager's step would not do")


def _fail(message: str) -> None:
    raise SelfCheckFailed(f"self-check after a planned step: {message}; memplan refuses to go on (please report it)")


def _shapes(value: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t.shape) for t in tensor_leaves(value))


def _meta(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    return ("value", type(value).__name__)


def _number(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _summary(state: dict[str, Any]) -> dict[str, Any]:
    """What must not change in a state that the step does not update: its keys with their
    metadata, and its step count."""
    return {"meta": {key: _meta(v) for key, v in state.items()}, "step": _number(state.get("step", 0.0))}


def _first_difference(ran: list, expected: list) -> str:
    for i, (a, b) in enumerate(zip(ran, expected, strict=False)):
        if a != b:
            return f"#{i}: {a[0]} {a[1]} vs eager's {b[0]} {b[1]}"
    i = min(len(ran), len(expected))
    extra = ran[i] if len(ran) > i else expected[i]
    return f"#{i}: {extra[0]} {extra[1]} {'extra' if len(ran) > i else 'missing'}"
