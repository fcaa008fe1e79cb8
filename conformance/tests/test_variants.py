"""Conforming backends pass, whatever they declare; the matrix says what they support."""

from __future__ import annotations


def test_restricted_backend_passes_and_its_refusals_are_reported(run_suite) -> None:
    run = run_suite("--attnhub-backend", "restricted")
    assert run.returncode == 0, run.output[-4000:]
    for row in (
        "batch: chunked_prefill",
        "batch: multi_token_decode",
        "dtype: bf16",
        "dtype: fp32",
        "feature: softcap",
        "kv cache: fp8_e4m3",
        "attention: encoder",
        "cascade",
        "head size: 48",
        "block size: 24",
        "graph capture",
        "mla: lse",
        "mla: refusals",
    ):
        assert run.state(row, "restricted") == "not supported", row
    for row in (
        "batch: decode",
        "dtype: fp16",
        "head size: 128",
        "feature: sliding_window",
        "invalid inputs",
        "kv cache writes",
        "random batches (hypothesis)",
        "mla: batch shapes",
        "mla: invalid inputs",
    ):
        assert run.state(row, "restricted") == "pass", row


def test_declared_cascade_is_tested(run_suite) -> None:
    run = run_suite(
        "--attnhub-backend", "declares_cascade", "-k", "cascade-bf16 or common_prefix_too_long"
    )
    assert run.returncode == 0, run.output[-4000:]
    assert run.state("cascade", "declares_cascade") == "pass"
    assert run.state("invalid inputs", "declares_cascade") == "pass"


def test_emulated_backend_runs_and_is_reported_as_emulated(run_suite) -> None:
    run = run_suite(
        "--attnhub-backend",
        "fake_vendor",
        "--attnhub-emulate",
        "-k",
        "test_matches_reference and mixed-bf16-h64-gqa4-bs16]",
    )
    assert run.returncode == 0, run.output[-4000:]
    assert run.state("batch: mixed", "fake_vendor") == "emulated"


def test_unknown_backend_is_a_usage_error(run_suite) -> None:
    run = run_suite("--attnhub-backend", "no_such_backend")
    assert run.returncode == 4, run.output[-2000:]
    assert "no attnhub backend named 'no_such_backend'" in run.output


def test_a_backend_refusing_strided_rows_with_a_reason_is_not_supported(run_suite) -> None:
    run = run_suite(
        "--attnhub-backend",
        "dense_rows_only",
        "-k",
        "test_fused_qkv_views_and_strided_output or (test_matches_reference and mixed-bf16)",
    )
    assert run.returncode == 0, run.output[-4000:]
    assert run.state("non-contiguous q/k/v and output", "dense_rows_only") == "not supported"
    assert run.state("batch: mixed", "dense_rows_only") == "pass"
