"""Fixtures of the flash backend's tests (builders live in flash_helpers.py)."""

from __future__ import annotations

import pytest
import torch
from attnhub_flash import emulator


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "contract: compares the emulator with the published FlashAttention interfaces (downloads "
        "the flash-attn sdist and the flash-attn-4 wheel once; nox -s contracts)",
    )


@pytest.fixture(autouse=True)
def _clean_state(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    monkeypatch.delenv("ATTNHUB_BACKEND", raising=False)
    monkeypatch.delenv("ATTNHUB_EMULATE", raising=False)
    monkeypatch.delenv("ATTNHUB_FLASH_PROVIDER", raising=False)
    emulator.reset_call_counts()
