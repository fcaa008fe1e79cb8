"""The suite's spoilers spoil what a builder checks: a batch's host copies too."""

from __future__ import annotations

from pathlib import Path

from suite_runs import make_runner


def test_the_catalogue_and_the_fuzz_spoil_a_batchs_host_copies_too(tmp_path: Path) -> None:
    """Regression (found on an H100, 2026-11-26): the invalid-input catalogue's slot and block
    table entries, and the fuzz's, spoiled the device tensor alone. On an accelerator the batch's
    host copy (what ``build`` checks) stayed valid, so the step was built and its write indexed
    the cache with the spoiled slot: a CUDA device-side assert, after which every later test of
    the process failed. Here the batches carry host copies on the CPU (``-p host_copies``): before
    the fix the same entries raised torch's IndexError from the write instead of a typed error."""
    run = make_runner(tmp_path)
    result = run(
        "-p",
        "host_copies",
        "--attnhub-backend",
        "torch",
        "-k",
        "rejects_invalid_input or api_fuzz",
        mutants=False,
    )
    assert result.returncode == 0, result.output[-4000:]
    assert result.state("invalid inputs", "torch") == "pass", result.output[-2000:]


def test_the_suite_passes_every_emulated_backend_with_batches_carrying_host_copies(
    tmp_path: Path,
) -> None:
    """The whole suite (quick scope) with the batches an accelerator's engine makes: device
    tensors and separate host copies. Builders check and plan from the host copies and kernels
    read the device tensors, a split the CPU runs of the suite never take otherwise."""
    run = make_runner(tmp_path)
    result = run("-p", "host_copies", "--attnhub-emulate", mutants=False)
    assert result.returncode == 0, result.output[-4000:]
