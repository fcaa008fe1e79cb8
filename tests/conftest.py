"""Fixtures shared by the unit tests (builders live in attnhub.testing)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    """Tests use explicit generators; this pins anything that draws from the global RNG too."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Selection must not depend on the environment the suite happens to run in."""
    monkeypatch.delenv("ATTNHUB_BACKEND", raising=False)
    monkeypatch.delenv("ATTNHUB_EMULATE", raising=False)
