"""Running the suite in a subprocess (``python -m pytest --pyargs attnhub_conformance``, or
``attnhub conformance``), with this directory on PYTHONPATH so ``-p mutants`` registers the
mutant and variant backends; and installed-looking distributions written by hand.

A module of its own (not conftest.py) so tests can import it by a name no other test directory
uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping
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


def run_cli(
    args: list[str], cwd: Path, *, extra_path: tuple[Path, ...] = (), mutants: bool = True
) -> subprocess.CompletedProcess[str]:
    """``attnhub conformance ARGS`` (``runner.main``) in a subprocess, the mutants registered."""
    code = (
        "import sys\nfrom attnhub_conformance.runner import main\n"
        f"raise SystemExit(main({args!r}))\n"
    )
    env = suite_env(extra_path)
    if mutants:
        env["PYTEST_PLUGINS"] = "mutants"  # registers the mutant backends in the runner's session
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def write_distribution(
    root: Path,
    name: str,
    version: str,
    files: Mapping[str, str],
    entry_points: Mapping[str, Mapping[str, str]],
) -> Path:
    """An installed distribution, as importlib.metadata sees one, in ``root``: ``files``
    (relative path -> text, dedented) plus ``<name>-<version>.dist-info`` with METADATA and
    entry_points.txt (group -> {entry name: value}). Put ``root`` on PYTHONPATH to install it
    (``extra_path=``), as pip would have."""
    for path, text in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(textwrap.dedent(text))
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n"
            for group, entries in entry_points.items()
        )
    )
    return root
