"""``attnhub conformance`` (runner.main): runs the suite in-process, prints the matrix, and
returns non-zero on any failure."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from attnhub_conformance.runner import in_cli_terms
from attnhub_conformance.runner import main as runner_main
from suite_runs import run_cli

from attnhub.cli import main as attnhub_main


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
    assert re.search(r"\| batch: decode \| pass \d+/\d+ \|", md_path.read_text())
    assert "<table>" in html_path.read_text()


def test_runner_fails_and_names_the_failing_case(tmp_path: Path) -> None:
    proc = run_cli(["--backend", "corrupts_on_bad_slot", "-k", "slot_outside_cache"], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "test_rejects_invalid_input[corrupts_on_bad_slot-slot_outside_cache]" in proc.stdout
    assert "corrupts_on_bad_slot-slot_outside_cache:" in proc.stdout
    assert "fail" in proc.stdout


def test_runner_runs_vendor_backends_through_their_emulators_by_default(tmp_path: Path) -> None:
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
    assert "--allow-unavailable" in out
    assert "Exit status:" in out and "6 nothing failed, but a backend" in " ".join(out.split())


def test_a_bad_report_name_is_an_error_naming_the_commands_option(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        runner_main(["--report", "matrix.txt"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --report: matrix.txt: use a .json, .md or .html file name" in err
    assert "--attnhub-report" not in err


def test_reasons_and_errors_name_the_commands_options_not_the_plugins() -> None:
    text = "pass emulate=True (--attnhub-emulate); --attnhub-report m.txt; --attnhub-scope"
    assert in_cli_terms(text) == "pass emulate=True (--emulate); --report m.txt; --quick/--full"
    assert in_cli_terms("--attnhub-unknown stays") == "--attnhub-unknown stays"


def test_progress_outside_a_terminal_is_a_line_per_case_group(tmp_path: Path) -> None:
    proc = run_cli(["--backend", "torch", "-k", "usable or test_output_buffer"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("conformance [")]
    assert "tests; backends: torch (native)" in lines[0]
    assert re.search(
        r"test_availability\.py::test_backend_is_usable on torch: 1 test; so far 0 passed, "
        r"0 failed, 0 skipped \(\d+ s\)$",
        lines[1],
    ), lines
    group = next(ln for ln in lines if "test_outputs.py::test_output_buffer" in ln)
    assert re.search(r" on torch: \d+ tests; so far 1 passed", group), group
    assert re.search(r"done: \d+ passed, 0 failed, 0 skipped \(\d+ s\)$", lines[-1]), lines
    assert "conformance [" not in proc.stdout  # the matrix alone on stdout


def test_the_suite_runs_on_the_threads_asked_for_and_leaves_no_hypothesis_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from attnhub_conformance import runner

    seen: list[tuple[int, str | None]] = []

    def fake_main(args: list[str], plugins: list[object]) -> int:
        seen.append((torch.get_num_threads(), os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY")))
        return 0

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYPOTHESIS_STORAGE_DIRECTORY", raising=False)
    monkeypatch.setattr(runner.pytest, "main", fake_main)
    before = torch.get_num_threads()
    runner_main(["--threads", "3"])
    runner_main([])
    assert [threads for threads, _ in seen] == [3, runner.DEFAULT_THREADS]
    assert all(storage and not storage.startswith(str(tmp_path)) for _, storage in seen)
    assert not any(Path(storage).exists() for _, storage in seen if storage)
    assert torch.get_num_threads() == before
    assert "HYPOTHESIS_STORAGE_DIRECTORY" not in os.environ
    assert not (tmp_path / ".hypothesis").exists()


def test_the_commands_hypothesis_seed_reaches_the_plugin() -> None:
    from attnhub_conformance.runner import build_parser, pytest_args

    args = pytest_args(build_parser().parse_args(["--hypothesis-seed", "random"]))
    assert args[args.index("--attnhub-hypothesis-seed") + 1] == "random"
    assert "--attnhub-hypothesis-seed" not in pytest_args(build_parser().parse_args([]))
    assert in_cli_terms("--attnhub-hypothesis-seed 7") == "--hypothesis-seed 7"


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--hypothesis-examples", "-3"], "argument --hypothesis-examples: -3: use a positive"),
        (["--hypothesis-examples", "0"], "argument --hypothesis-examples: 0: use a positive"),
        (["--hypothesis-seed", "foo"], "argument --hypothesis-seed: foo: use a non-negative"),
        (["--hypothesis-seed", "-1"], "argument --hypothesis-seed: -1: use a non-negative"),
    ],
)
def test_a_bad_hypothesis_option_is_a_usage_error_before_the_run(capsys, flags, said) -> None:
    """Not a run whose property tests all fail (-3 examples), nor the plugin's option name."""
    with pytest.raises(SystemExit) as exit_:
        runner_main(flags)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "--attnhub-" not in err


def test_a_keyword_that_matches_no_case_says_so(tmp_path: Path) -> None:
    proc = run_cli(["--backend", "torch", "-k", "zzz_matches_nothing"], tmp_path)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "no conformance case matches -k 'zzz_matches_nothing'" in proc.stderr
    assert "warnings summary" not in proc.stdout + proc.stderr  # not pytest's own report
