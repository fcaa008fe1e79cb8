"""Fixtures of the iluvatar backend's tests (builders live in iluvatar_helpers.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _clean_state(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    monkeypatch.delenv("ATTNHUB_BACKEND", raising=False)
    monkeypatch.delenv("ATTNHUB_EMULATE", raising=False)
