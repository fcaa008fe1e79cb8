"""What vendor op emulators share: a null-kernel mode and the time spent inside emulated ops.

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
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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


def null_kernels_active() -> bool:
    """Whether emulated ops skip their math now (inside :func:`null_kernels`)."""
    return _STATE.null


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
