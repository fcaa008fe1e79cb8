"""Tests of the suite itself: it must fail on broken backends, pass on conforming ones, adapt to
what a backend declares, and find third-party backends through their entry points."""

from __future__ import annotations

from pathlib import Path

import pytest
from suite_runs import make_runner


@pytest.fixture
def run_suite(tmp_path: Path):
    """``run_suite("--attnhub-backend", "x", "-k", "...")`` -> SuiteRun (see suite_runs)."""
    return make_runner(tmp_path)
