"""What vendor op emulators share: their ops' entry wrapper (call counts and records, the
vendor binding's strict argument check), a null-kernel mode and the time spent inside ops.

Every emulated op is registered with :meth:`OpLog.op`: each call is counted by name, appended
to every open :meth:`OpLog.record` list (tests read what a backend passed), bound to the op's
signature as the vendor binding binds it (an unknown or missing argument raises TypeError
naming the op), and timed in null-kernel mode (below).

An emulated op is two parts: its **checks** (everything the vendor op rejects: shapes, dtypes,
layouts, length lists, limits) and its **math** (the attention, the KV write). A benchmark of a
backend's host overhead wants the backend's own Python, not the emulator's float32 math, so an
emulator marks its math with :func:`kernel`; inside :func:`null_kernels` every op still runs
its checks exactly as always, then the marked math is skipped and preallocated outputs of the
right shapes and dtypes come back instead (their values are meaningless: null mode is for
timing, never for results).

Inside :func:`null_kernels` the time spent inside emulated ops (checks included) is also summed
(an op registers its entry with :func:`timed`), so a benchmark can subtract the emulator's own
checking, which on hardware is the vendor library's C++ binding, from a backend's call::

    with emulation.null_kernels() as ops:
        impl.forward(q, k, v, cache, meta)   # the backend's Python + the ops' checks
    print(ops.seconds, ops.calls)            # of which inside emulated ops

Outside :func:`null_kernels` the markers cost one attribute read per op call.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class OpTime:
    """Time spent inside emulated ops (outermost calls) since :func:`null_kernels` began."""

    seconds: float = 0.0
    calls: int = 0


class _State:
    null: bool = False
    depth: int = 0  # nesting of timed op calls (an op calling another counts once)
    timer: OpTime | None = None


_STATE = _State()
_BUFFERS: dict[tuple[tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = {}


@contextmanager
def null_kernels() -> Iterator[OpTime]:
    """Run emulated ops without their math (checks only, preallocated outputs) and sum the time
    spent inside them. Not reentrant; not for results: outputs hold arbitrary values and KV
    writes write nothing."""
    if _STATE.null:
        raise RuntimeError("null_kernels() is already active")
    timer = OpTime()
    _STATE.null, _STATE.timer = True, timer
    try:
        yield timer
    finally:
        _STATE.null, _STATE.timer, _STATE.depth = False, None, 0


def kernel(null: Callable[P, R]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Mark ``math`` as an emulated op's math: in null-kernel mode ``null`` (same arguments)
    answers instead, typically with :func:`preallocated` outputs, or None for an in-place op.
    Put every argument check before the call to ``math``."""

    def mark(math: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(math)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            if _STATE.null:
                return null(*args, **kwargs)
            return math(*args, **kwargs)

        return run

    return mark


def skip(*args: Any, **kwargs: Any) -> None:
    """The null of an in-place op (a KV write, a copy into ``out``): nothing happens."""
    return None


def preallocated(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A tensor of ``shape`` made once per (shape, dtype, device) and handed out again: a null
    kernel's output, as cheap as the real op's preallocated one."""
    key = (tuple(shape), dtype, torch.device(device))
    buf = _BUFFERS.get(key)
    if buf is None:
        buf = _BUFFERS[key] = torch.zeros(key[0], dtype=dtype, device=key[2])
    return buf


def timed(fn: Callable[P, R]) -> Callable[P, R]:
    """Wrap an emulated op's entry so that, inside :func:`null_kernels`, the time spent in it
    is summed (outermost calls only)."""

    @functools.wraps(fn)
    def op(*args: P.args, **kwargs: P.kwargs) -> R:
        timer = _STATE.timer
        if timer is None or _STATE.depth:
            return fn(*args, **kwargs)
        _STATE.depth = 1
        t0 = time.thread_time()  # CPU time of this thread, as attnhub bench --host counts
        try:
            return fn(*args, **kwargs)
        finally:
            timer.seconds += time.thread_time() - t0
            timer.calls += 1
            _STATE.depth = 0

    return op


# --- how to ask for an emulator, in each tool's terms -----------------------------------------

#: How each audience asks for a vendor backend's CPU emulator: Python callers (``api``), the
#: ``attnhub`` commands (``cli``) and pytest runs of the conformance suite (``pytest``).
EMULATE_HOW = {
    "api": "pass emulate=True (or set ATTNHUB_EMULATE=1)",
    "cli": "pass --emulate (or set ATTNHUB_EMULATE=1)",
    "pytest": "pass --attnhub-emulate",
}


def emulate_hint(audience: str = "api") -> str:
    """The hint a backend's availability reason ends with when its emulator would run: in the
    API's terms by default (what ``availability`` returns); :func:`in_terms_of` rewrites it for
    the tool that shows the reason."""
    return f"{EMULATE_HOW[audience]} to run through the CPU emulator"


def in_terms_of(text: str, audience: str) -> str:
    """``text`` (a reason, an error message) with any audience's :func:`emulate_hint` replaced
    by ``audience``'s: ``attnhub select`` says ``--emulate``, pytest ``--attnhub-emulate``."""
    wanted = emulate_hint(audience)
    for other in EMULATE_HOW:
        if other != audience:
            text = text.replace(emulate_hint(other), wanted)
    return text


# --- the ops' entry: counted, recorded, bound -----------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One emulated op call, as the caller made it (``name``: the name its emulator gives it)."""

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


#: Runs an op instead of calling it directly: ``route(name, fn, args, kwargs)`` (an emulator's
#: graph capture, which records or replays the call).
Route = Callable[[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]


class OpLog:
    """One emulator's ops: how often each was called (``counts``) and what was passed
    (:meth:`record`)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._recorders: list[list[Call]] = []

    def reset_counts(self) -> None:
        self.counts.clear()

    @contextmanager
    def record(self) -> Iterator[list[Call]]:
        """Collect every call of this emulator's ops made inside the block."""
        calls: list[Call] = []
        self._recorders.append(calls)
        try:
            yield calls
        finally:
            self._recorders.remove(calls)

    def op(
        self, name: str, fn: Callable[..., Any], *, binding: str, route: Route | None = None
    ) -> Callable[..., Any]:
        """``fn`` as the emulated op ``name``: counted, recorded, bound to ``fn``'s signature
        (a TypeError reads ``"{binding}(): ..."``), timed (:func:`timed`), then run (through
        ``route`` when given)."""
        sig = inspect.signature(fn)
        counts, recorders = self.counts, self._recorders

        @timed  # in null-kernel mode, the time spent inside the op is summed
        @functools.wraps(fn)
        def op(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            for calls in recorders:
                calls.append(Call(name, args, dict(kwargs)))
            try:
                sig.bind(*args, **kwargs)  # the vendor binding rejects unknown / missing arguments
            except TypeError as exc:
                raise TypeError(f"{binding}(): {exc}") from None
            if route is not None:
                return route(name, fn, args, kwargs)
            return fn(*args, **kwargs)

        return op
