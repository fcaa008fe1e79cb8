"""A run that tests nothing does not pass.

A backend the run was asked to test (``--attnhub-backend`` / ``--backend``) that cannot run on
the device fails the run with its reason, exit status 6 when nothing else failed, through the
pytest plugin and through ``attnhub conformance`` alike; so does every backend of a default run
in which none can run, and a plugin that failed to load. ``--attnhub-allow-unavailable`` /
``--allow-unavailable`` reports unavailable backends as unavailable instead. A default run keeps
reporting unavailable backends as unavailable while another one runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from attnhub_conformance import plugin, runner
from suite_runs import run_cli, write_distribution

CANNOT_RUN = plugin.EXIT_BACKEND_CANNOT_RUN
ABSENT = "the fake vendor's accelerator is not present"  # fake_vendor's reason (mutants.py)
NO_DEVICE = "nodevice"  # a device type no torch knows: no backend can run on it
#: A device type torch parses but no backend here runs on (the command refuses NO_DEVICE as a
#: usage error before any backend is asked).
UNSERVED_DEVICE = "hpu"


@pytest.fixture(scope="module")
def broken_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A distribution whose ``attnhub`` entry point fails to import."""
    return write_distribution(
        tmp_path_factory.mktemp("site"),
        "broken-attn",
        "0.1",
        {"broken_attn.py": 'raise ImportError("libvendor.so: cannot open shared object file")\n'},
        {"attnhub": {"broken": "broken_attn"}},
    )


# --- the pytest plugin ----------------------------------------------------------------------


def test_a_named_backend_that_cannot_run_fails_the_run_with_its_reason(run_suite) -> None:
    run = run_suite("--attnhub-backend", "fake_vendor")
    assert run.returncode == CANNOT_RUN, run.output[-4000:]
    assert "FAILED" in run.output and "test_backend_is_usable[fake_vendor-availability]" in (
        run.output
    )
    assert (
        "backend 'fake_vendor' cannot run on device 'cpu' and was asked for "
        f"(--attnhub-backend fake_vendor): {ABSENT} (--attnhub-emulate would run it through its "
        "CPU emulator; --attnhub-allow-unavailable reports it as unavailable instead of failing)"
    ) in " ".join(run.output.split())
    assert run.state("availability", "fake_vendor") == "fail"
    assert run.report is not None
    assert run.report["backends"]["fake_vendor"]["status"] == "unavailable"


def test_allow_unavailable_reports_a_named_backend_as_unavailable(run_suite) -> None:
    run = run_suite("--attnhub-backend", "fake_vendor", "--attnhub-allow-unavailable")
    assert run.returncode == 0, run.output[-4000:]
    assert ABSENT in run.output
    assert run.state("availability", "fake_vendor") == "unavailable"


def test_deselecting_the_availability_test_does_not_make_the_run_pass(run_suite) -> None:
    run = run_suite("--attnhub-backend", "fake_vendor", "-k", "test_matches_reference")
    assert run.returncode == CANNOT_RUN, run.output[-4000:]
    assert "attnhub: backends this run had to test cannot run" in run.output
    assert "backend 'fake_vendor' cannot run on device 'cpu'" in run.output


def test_a_wrong_result_beside_it_keeps_the_failed_tests_status(run_suite) -> None:
    run = run_suite(
        "--attnhub-backend",
        "fake_vendor",
        "--attnhub-backend",
        "corrupts_on_bad_slot",
        "-k",
        "availability or slot_outside_cache",
    )
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, run.output[-4000:]
    assert run.state("availability", "fake_vendor") == "fail"
    assert run.state("invalid inputs", "corrupts_on_bad_slot") == "fail"


def test_a_default_run_reports_unavailable_backends_while_another_runs(run_suite) -> None:
    run = run_suite("-k", "availability")  # every discovered backend, torch among them
    assert run.returncode == 0, run.output[-4000:]
    assert run.state("availability", "torch") == "pass"
    assert run.state("availability", "fake_vendor") == "unavailable"


def test_a_default_run_in_which_no_backend_can_run_fails(run_suite) -> None:
    run = run_suite("--attnhub-device", NO_DEVICE, "-k", "availability")
    assert run.returncode == CANNOT_RUN, run.output[-4000:]
    assert (
        f"backend 'torch' cannot run on device '{NO_DEVICE}' and no discovered backend can run "
        "there, so the run would test nothing: "
    ) in " ".join(run.output.split())
    assert run.state("availability", "torch") == "fail"
    allowed = run_suite(
        "--attnhub-device", NO_DEVICE, "-k", "availability", "--attnhub-allow-unavailable"
    )
    assert allowed.returncode == 0, allowed.output[-4000:]
    assert allowed.state("availability", "torch") == "unavailable"


def test_a_plugin_that_failed_to_load_fails_even_with_allow_unavailable(
    run_suite, broken_plugin: Path
) -> None:
    run = run_suite(
        "--attnhub-backend",
        "broken",
        "--attnhub-allow-unavailable",
        extra_path=(broken_plugin,),
        mutants=False,
    )
    assert run.returncode == CANNOT_RUN, run.output[-4000:]
    assert "backend 'broken': its plugin failed to load: ImportError: libvendor.so" in run.output
    assert run.state("availability", "broken") == "fail"


# --- attnhub conformance --------------------------------------------------------------------


def test_the_command_fails_for_a_named_backend_that_cannot_run(tmp_path: Path) -> None:
    proc = run_cli(["--backend", "fake_vendor", "--no-emulate", "-k", "availability"], tmp_path)
    assert proc.returncode == CANNOT_RUN, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    assert "FAILED test_availability.py::test_backend_is_usable[fake_vendor-availability]" in out
    assert (
        f"was asked for (--backend fake_vendor): {ABSENT} (--emulate would run it through its CPU "
        "emulator; --allow-unavailable reports it as unavailable instead of failing)"
    ) in out
    assert "--attnhub-" not in proc.stdout  # the command's own option names
    assert "0 passed, 1 failed" in out


def test_the_command_with_allow_unavailable_reports_it_as_unavailable(tmp_path: Path) -> None:
    proc = run_cli(
        ["--backend", "fake_vendor", "--no-emulate", "--allow-unavailable", "-k", "availability"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "unavailable" in proc.stdout and ABSENT in " ".join(proc.stdout.split())


def test_the_command_says_why_when_the_availability_test_was_deselected(tmp_path: Path) -> None:
    proc = run_cli(["--backend", "fake_vendor", "--no-emulate", "-k", "decode"], tmp_path)
    assert proc.returncode == CANNOT_RUN, proc.stdout + proc.stderr
    assert "not tested: backend 'fake_vendor' cannot run on device 'cpu'" in " ".join(
        proc.stdout.split()
    )


def test_the_command_fails_a_default_run_in_which_no_backend_can_run(tmp_path: Path) -> None:
    proc = run_cli(["--device", UNSERVED_DEVICE, "-k", "availability"], tmp_path)
    assert proc.returncode == CANNOT_RUN, proc.stdout + proc.stderr
    assert "no discovered backend can run there" in " ".join(proc.stdout.split())
    args = ["--device", UNSERVED_DEVICE, "-k", "availability", "--allow-unavailable"]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_command_and_the_plugin_agree_on_the_exit_status() -> None:
    assert runner.EXIT_BACKEND_CANNOT_RUN == plugin.EXIT_BACKEND_CANNOT_RUN == 6
    assert runner.in_cli_terms("--attnhub-allow-unavailable") == "--allow-unavailable"
