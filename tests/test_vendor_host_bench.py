"""benchmarks/vendor_host.py: the no-op op namespace gives back what the real ops returned, and
the timed calls run no emulator code (its timings are printed, never asserted)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "vendor_host.py"


@pytest.fixture(scope="module")
def vh() -> Any:
    spec = importlib.util.spec_from_file_location("vendor_host", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vendor_host"] = module
    spec.loader.exec_module(module)
    return module


def _toy() -> Any:
    made = torch.zeros(2)

    def into(x: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(x)

    def pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, made

    def write(x: torch.Tensor) -> None:
        x.add_(1)

    return SimpleNamespace(
        flag=None,
        name="toy",
        inner=SimpleNamespace(into=into, pair=pair),
        write=write,
    )


def test_the_no_ops_give_back_what_the_ops_returned_and_do_nothing(vh: Any) -> None:
    log: dict[tuple[str, ...], Any] = {}
    rec = vh._Recording(_toy(), (), log)
    x, out = torch.ones(2), torch.empty(2)
    assert rec.flag is None and rec.name == "toy"  # plain values as they are
    assert rec.inner.into(x, out=out) is out
    first, made = rec.inner.pair(x)
    assert first is x
    rec.write(x)
    assert x.tolist() == [2.0, 2.0]  # recorded for real
    ns = vh.noop_namespace(log)
    assert ns.flag is None and ns.name == "toy"
    y, other = torch.full((2,), 5.0), torch.empty(2)
    assert ns.inner.into(y, out=other) is other  # the out= argument of this call
    a, b = ns.inner.pair(y)
    assert a is y and b is made  # the argument, and the very object the op made
    assert ns.write(y) is None and y.tolist() == [5.0, 5.0]  # nothing happens
    assert other.data_ptr() != out.data_ptr()
    assert isinstance(ns.inner, SimpleNamespace)  # plain objects: no proxy in timed calls


def test_an_op_returning_different_kinds_in_one_step_is_refused(vh: Any) -> None:
    def either(x: torch.Tensor, lse: bool) -> Any:
        return (x, x) if lse else x

    rec = vh._Recording(SimpleNamespace(either=either), (), {})
    rec.either(torch.ones(1), False)
    with pytest.raises(RuntimeError, match="either returned different kinds"):
        rec.either(torch.ones(1), True)


@pytest.mark.parametrize(
    ("backend", "emulator"),
    [("flash", "attnhub_flash.emulator"), ("iluvatar", "attnhub_iluvatar.emulator")],
)
def test_timed_calls_run_no_emulated_op(vh: Any, backend: str, emulator: str) -> None:
    pytest.importorskip(emulator)
    counts = importlib.import_module(emulator)._log.counts
    before = sum(counts.values())
    result = vh.time_backend(backend, "mixed x16", runs=1, calls=2)
    assert set(result) == {"build", "forward", "write_kv", "ops"}
    assert result["ops"]  # the ops it replaced
    # one recorded forward (KV write + attention calls) and one write_kv: nothing timed
    assert sum(counts.values()) - before == len(result["ops"]) + 1
