"""``attnhub conformance`` (runner.main): runs the suite in-process, prints the matrix, and
returns non-zero on any failure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from suite_runs import suite_env

from attnhub.cli import main as attnhub_main


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\nfrom attnhub_conformance.runner import main\n"
        f"raise SystemExit(main({args!r}))\n"
    )
    env = suite_env()
    env["PYTEST_PLUGINS"] = "mutants"  # registers the mutant backends in the runner's session
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_runner_prints_the_matrix_and_writes_reports(tmp_path: Path) -> None:
    json_path, md_path, html_path = (tmp_path / f"m.{s}" for s in ("json", "md", "html"))
    proc = run_cli(
        [
            "--backend",
            "torch",
            "-k",
            "test_matches_reference and decode",
            "--report",
            str(json_path),
            "--report",
            str(md_path),
            "--report",
            str(html_path),
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "attnhub conformance (quick scope, device cpu)" in proc.stdout
    assert "batch: decode" in proc.stdout and "pass" in proc.stdout
    data = json.loads(json_path.read_text())
    assert data["matrix"]["batch: decode"]["torch"]["state"] == "pass"
    assert "| batch: decode | pass |" in md_path.read_text()
    assert "<table>" in html_path.read_text()


def test_runner_fails_and_names_the_failing_case(tmp_path: Path) -> None:
    proc = run_cli(["--backend", "corrupts_on_bad_slot", "-k", "slot_outside_cache"], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "test_rejects_invalid_input[corrupts_on_bad_slot-slot_outside_cache]" in proc.stdout
    assert "corrupts_on_bad_slot-slot_outside_cache:" in proc.stdout
    assert "fail" in proc.stdout


def test_runner_without_emulation_reports_vendor_backends_unavailable(tmp_path: Path) -> None:
    proc = run_cli(["--backend", "fake_vendor", "--no-emulate", "-k", "availability"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "unavailable" in proc.stdout
    proc = run_cli(["--backend", "fake_vendor", "-k", "availability"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "emulated" in proc.stdout


def test_runner_unknown_backend_is_an_error(tmp_path: Path) -> None:
    proc = run_cli(["--backend", "no_such_backend"], tmp_path)
    assert proc.returncode == 4
    assert "no_such_backend" in proc.stdout + proc.stderr


def test_attnhub_lists_the_conformance_command_from_the_suites_entry_point(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        attnhub_main(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "conformance run the conformance suite" in out
    assert "[attnhub-conformance " in out


def test_attnhub_conformance_help_shows_the_suites_own_options(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        attnhub_main(["conformance", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: attnhub conformance")
    assert "--report PATH" in out and "--no-emulate" in out and "--full" in out
