"""attnhub.emulation: the null-kernel switch emulators share."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from attnhub import emulation


def _null_double(x: torch.Tensor) -> torch.Tensor:
    return emulation.preallocated(x.shape, x.dtype, x.device)


@emulation.kernel(null=_null_double)
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@emulation.timed
def _op(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 1:  # the op's check runs in both modes
        raise ValueError("x must be 1-D")
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.001:  # 1 ms of this thread's CPU time (what is summed)
        pass
    return _double(x)


def test_outside_null_mode_the_math_runs():
    assert torch.equal(_op(torch.ones(3)), torch.full((3,), 2.0))


def test_inside_null_mode_checks_run_and_math_is_skipped():
    with emulation.null_kernels():
        out = _op(torch.ones(3))
        assert out.shape == (3,) and out.dtype == torch.float32
        assert out is _op(torch.ones(3))  # preallocated once, handed out again
        with pytest.raises(ValueError, match="1-D"):
            _op(torch.ones(2, 2))
    assert torch.equal(_op(torch.ones(3)), torch.full((3,), 2.0))  # the math is back after it


def test_null_mode_sums_the_time_inside_ops():
    with emulation.null_kernels() as ops:
        for _ in range(3):
            _op(torch.ones(3))
    assert ops.calls == 3
    assert ops.seconds >= 0.003


def test_nested_timed_ops_count_once():
    @emulation.timed
    def outer(x: torch.Tensor) -> torch.Tensor:
        return _op(x)

    with emulation.null_kernels() as ops:
        outer(torch.ones(3))
    assert ops.calls == 1


def test_null_mode_is_not_reentrant():
    outer = emulation.null_kernels()
    with outer, pytest.raises(RuntimeError, match="already active"), emulation.null_kernels():
        pass


def test_skip_is_the_null_of_an_in_place_op():
    target = torch.zeros(3)

    @emulation.kernel(null=emulation.skip)
    def fill(t: torch.Tensor) -> None:
        t.fill_(1)

    with emulation.null_kernels():
        fill(target)
    assert not target.any()
    fill(target)
    assert target.all()


def test_an_op_log_counts_records_and_binds_its_ops():
    log = emulation.OpLog()

    def add(x: int, *, y: int = 1) -> int:
        return x + y

    op = log.op("math.add", add, binding="vendor.math.add")
    with log.record() as calls:
        assert op(2, y=3) == 5
    assert op(1) == 2  # no recorder open: counted only
    assert calls == [emulation.Call("math.add", (2,), {"y": 3})]
    assert log.counts == {"math.add": 2}
    with pytest.raises(TypeError, match=r"vendor\.math\.add\(\): .*z"):
        op(1, z=2)  # the binding rejects what the vendor's would, naming the op
    log.reset_counts()
    assert not log.counts
    assert op.__name__ == "add"  # the op keeps its function's name and signature


def test_an_op_log_routes_calls_and_times_them_in_null_mode():
    log = emulation.OpLog()
    routed: list[str] = []

    def route(name: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        routed.append(name)
        return fn(*args, **kwargs) * 10

    op = log.op("one", lambda: 1, binding="one", route=route)
    with emulation.null_kernels() as ops:
        assert op() == 10
    assert routed == ["one"] and ops.calls == 1
