"""Fixtures of the ascend backend's tests (builders live in ascend_helpers.py)."""

from __future__ import annotations

import pytest
import torch
from attnhub_ascend import emulator


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "contract: compares the emulator with torch_npu's published schema (downloads the "
        "torch-npu wheel once; nox -s contracts)",
    )


@pytest.fixture(autouse=True)
def _clean_state(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    monkeypatch.delenv("ATTNHUB_BACKEND", raising=False)
    monkeypatch.delenv("ATTNHUB_EMULATE", raising=False)
    emulator.reset_call_counts()
