"""Running the suite in a subprocess (``python -m pytest --pyargs attnhub_conformance``), with
this directory on PYTHONPATH so ``-p mutants`` registers the mutant and variant backends.

A module of its own (not conftest.py) so tests can import it by a name no other test directory
uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


@dataclass
class SuiteRun:
    returncode: int
    output: str
    report: dict[str, Any] | None

    def state(self, row: str, backend: str) -> str:
        assert self.report is not None, self.output[-3000:]
        return self.report["matrix"][row][backend]["state"]


def suite_env(extra_path: tuple[Path, ...] = ()) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), *map(str, extra_path), *filter(None, [env.get("PYTHONPATH")])]
    )
    for name in ("ATTNHUB_BACKEND", "ATTNHUB_EMULATE", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    # One intra-op thread: on a shared 2-core machine torch's spinning OpenMP threads make these
    # small-tensor runs 10-20x slower under load (results are the same either way).
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def make_runner(tmp_path: Path) -> Callable[..., SuiteRun]:
    """``run("--attnhub-backend", "x", "-k", "...")``: the suite in a subprocess (cwd
    ``tmp_path``), with the mutants registered; returns the exit code, the output and the JSON
    matrix."""

    def run(*args: str, extra_path: tuple[Path, ...] = (), mutants: bool = True) -> SuiteRun:
        report = tmp_path / "matrix.json"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            *(["-p", "mutants"] if mutants else []),
            "--pyargs",
            "attnhub_conformance",
            "-q",
            "-rfs",
            "-p",
            "no:cacheprovider",
            "--attnhub-report",
            str(report),
            *args,
        ]
        proc = subprocess.run(
            cmd,
            cwd=tmp_path,
            env=suite_env(extra_path),
            capture_output=True,
            text=True,
            timeout=600,
        )
        data = json.loads(report.read_text()) if report.exists() else None
        report.unlink(missing_ok=True)
        return SuiteRun(proc.returncode, proc.stdout + proc.stderr, data)

    return run
