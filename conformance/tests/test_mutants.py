"""Each mutant backend carries one realistic bug; the suite must fail on it, naming the case."""

from __future__ import annotations

import pytest

# (mutant, -k selection, a failing case id, words of the failure, the matrix row that fails)
MUTANT_RUNS = [
    pytest.param(
        "top_left_causal",
        "test_matches_reference and chunked_prefill",
        "test_matches_reference[top_left_causal-chunked_prefill-bf16-h64-gqa4-bs16]",
        "differs from attnhub.reference",
        "batch: chunked_prefill",
        id="top_left_causal",
    ),
    pytest.param(
        "writes_padding",
        "test_writes_exactly_the_new_slots",
        "test_writes_exactly_the_new_slots[writes_padding-forward-mixed-bf16-h64-gqa4-bs16]",
        "a padding slot -1 used as an index wraps to it",
        "kv cache writes",
        id="writes_padding",
    ),
    pytest.param(
        "ignores_window",
        "test_matches_reference and sliding_window",
        "test_matches_reference[ignores_window-chunked_prefill-bf16-h64-gqa4-bs16-sliding_window]",
        "differs from attnhub.reference",
        "feature: sliding_window",
        id="ignores_window",
    ),
    pytest.param(
        "syncs_in_forward",
        "test_forward_does_not_sync_with_the_host",
        "test_forward_does_not_sync_with_the_host[syncs_in_forward-decode-bf16-h64-gqa4-bs16]",
        "device-to-host sync",
        "no host sync per layer",
        id="syncs_in_forward",
    ),
    pytest.param(
        "bakes_host_plan",
        "test_graph_replays_match_eager_and_the_reference",
        "test_graph_replays_match_eager_and_the_reference[bakes_host_plan-graphs-bf16-h64-gqa4-bs16]",
        "vs reference",
        "graph capture",
        id="bakes_host_plan",
    ),
    pytest.param(
        "corrupts_on_bad_slot",
        "test_rejects_invalid_input",
        "test_rejects_invalid_input[corrupts_on_bad_slot-slot_outside_cache]",
        "the KV cache changed",
        "invalid inputs",
        id="corrupts_on_bad_slot",
    ),
    pytest.param(
        "scale_1pct_off",
        "test_matches_reference and mixed",
        "test_matches_reference[scale_1pct_off-mixed-bf16-h64-gqa4-bs16]",
        "more than rounding explains",
        "batch: mixed",
        id="scale_1pct_off",
    ),
    pytest.param(
        "loose_tolerance",
        "test_matches_reference and mixed",
        "test_matches_reference[loose_tolerance-mixed-bf16-h64-gqa4-bs16]",
        "looser than the suite accepts",
        "batch: mixed",
        id="loose_tolerance",
    ),
    pytest.param(
        "overclaims_accuracy",
        "test_quantized_cache_accuracy",
        "test_quantized_cache_accuracy[overclaims_accuracy-mixed-bf16-h64-gqa4-bs16-kv_fp8_e4m3]",
        "further from attention over the unquantized inputs than declared",
        "quantized cache accuracy: fp8_e4m3",
        id="overclaims_accuracy",
    ),
    pytest.param(
        "value_scale_off",
        "test_matches_reference and fp8_e4m3",
        "test_matches_reference[value_scale_off-mixed-bf16-h64-gqa4-bs16-kv_fp8_e4m3]",
        "rounding its probabilities as declared (fp8_e4m3) errs by",
        "kv cache: fp8_e4m3",
        id="value_scale_off",
    ),
    pytest.param(
        "ignores_row_stride",
        "test_fused_qkv_views_and_strided_output",
        "test_fused_qkv_views_and_strided_output[ignores_row_stride-mixed-bf16-h64-gqa4-bs16]",
        "forward through fused-QKV views left the cache wrong",
        "non-contiguous q/k/v and output",
        id="ignores_row_stride",
    ),
    pytest.param(
        "no_max_subtraction",
        "test_extreme_logits_match_reference and large_scores",
        "test_extreme_logits_match_reference[no_max_subtraction-large_scores-mixed-bf16-h64-gqa4-bs16]",
        "NaN or inf where the math has none",
        "extreme logits: scores ~1e4",
        id="no_max_subtraction",
    ),
    pytest.param(
        "refuses_after_write",
        "test_fused_qkv_views_and_strided_output",
        "test_fused_qkv_views_and_strided_output[refuses_after_write-mixed-bf16-h64-gqa4-bs16]",
        "after changing the KV cache",
        "non-contiguous q/k/v and output",
        id="refuses_after_write",
    ),
    pytest.param(
        "memoizes_per_layer",
        "test_the_plan_is_complete_when_build_returns",
        "test_the_plan_is_complete_when_build_returns[memoizes_per_layer-mixed-bf16-h64-gqa4-bs16]",
        "meta.kernel_kwargs (a dict) gained keys",
        "metadata reuse",
        id="memoizes_per_layer",
    ),
    pytest.param(
        "lse_base2",
        "test_lse and value",
        "test_lse[lse_base2-value-mixed-bf16-h64-gqa4-bs16]",
        "the LSE differs from attnhub.reference's (the natural log",
        "lse",
        id="lse_base2",
    ),
    pytest.param(
        "mla_ignores_rope",
        "test_mla and mixed",
        "test_mla[mla_ignores_rope-mixed-bf16-r64+16-h8-bs16-joint]",
        "differs from attnhub.reference's absorbed MLA",
        "mla: batch shapes",
        id="mla_ignores_rope",
    ),
    pytest.param(
        "mla_latent_scale",
        "test_mla and mixed",
        "test_mla[mla_latent_scale-mixed-bf16-r64+16-h8-bs16-joint]",
        "differs from attnhub.reference's absorbed MLA",
        "mla: batch shapes",
        id="mla_latent_scale",
    ),
    pytest.param(
        "mla_drops_fp8_scale",
        "test_mla and kv_fp8",
        "test_mla[mla_drops_fp8_scale-mixed-bf16-r64+16-h8-bs16-joint-kv_fp8_e4m3]",
        "differs from attnhub.reference's absorbed MLA",
        "mla: fp8 latent",
        id="mla_drops_fp8_scale",
    ),
    pytest.param(
        "mla_fp8_query_unquantized",
        "test_mla and kv_fp8",
        "test_mla[mla_fp8_query_unquantized-mixed-bf16-r64+16-h8-bs16-joint-kv_fp8_e4m3]",
        "differs from attnhub.reference's absorbed MLA",
        "mla: fp8 latent",
        id="mla_fp8_query_unquantized",
    ),
    pytest.param(
        "mla_fp8_unsaturated",
        "test_mla and kv_write",
        "test_mla[mla_fp8_unsaturated-kv_write-bf16-r64+16-h8-bs16-joint-kv_fp8_e4m3]",
        "differ from vLLM's fp8 write",
        "mla: fp8 kv writes",
        id="mla_fp8_unsaturated",
    ),
    pytest.param(
        "mla_fp8_rope_unscaled",
        "test_mla and kv_fp8",
        "test_mla[mla_fp8_rope_unscaled-mixed-bf16-r64+16-h8-bs16-joint-kv_fp8_e4m3]",
        "differs from attnhub.reference.write_latent_kv's",
        "mla: fp8 latent",
        id="mla_fp8_rope_unscaled",
    ),
    pytest.param(
        "batch_dependent_splits",
        "test_a_request_gives_the_same_output_wherever_it_sits",
        "test_a_request_gives_the_same_output_wherever_it_sits[batch_dependent_splits-bitwise-fp32-h64-gqa4-bs16-batch_invariant]",
        "elements of its output (largest difference",
        "batch invariance: bitwise",
        id="batch_dependent_splits",
    ),
    pytest.param(
        "truncates_values",
        "test_matches_reference and h64v128",
        "test_matches_reference[truncates_values-prefill-bf16-h64v128-gqa4-bs16]",
        "differs from attnhub.reference",
        "value head size: 64/128",
        id="truncates_values",
    ),
    pytest.param(
        "ignores_output_buffer",
        "test_compiled",
        "test_compiled_decoder_layer_matches_eager[ignores_output_buffer-compiled-bf16-h64-gqa4-bs16]",
        "the compiled layer's attention output differs from eager",
        "torch.compile",
        id="ignores_output_buffer",
    ),
]


@pytest.mark.parametrize(("mutant", "select", "failing", "words", "row"), MUTANT_RUNS)
def test_suite_fails_on_mutant_naming_the_case(
    run_suite, mutant: str, select: str, failing: str, words: str, row: str
) -> None:
    run = run_suite("--attnhub-backend", mutant, "-k", select)
    assert run.returncode == 1, run.output[-4000:]
    assert "FAILED " in run.output and failing in run.output, run.output[-4000:]
    case_id = failing.split("[", 1)[1].rstrip("]")
    assert f"{case_id}:" in run.output, f"the message does not name {case_id}"
    assert words in run.output, run.output[-4000:]
    assert run.state(row, mutant) == "fail"


def test_a_declared_query_quantization_is_what_the_same_inputs_reference_uses(run_suite) -> None:
    """The overclaiming mutant quantizes its query as it declares: the reference on the same
    (quantized) inputs agrees with it, so only the accuracy bound fails."""
    run = run_suite(
        "--attnhub-backend", "overclaims_accuracy", "-k", "test_matches_reference and fp8_e4m3"
    )
    assert run.returncode == 0, run.output[-4000:]
    assert " passed" in run.output


def test_a_declared_mla_query_quantization_is_what_the_mla_reference_uses(run_suite) -> None:
    """An MLA backend whose fp8 kernel quantizes the query as it declares passes the fp8 latent
    cases (the mutant that declares it and does not fails them, above)."""
    run = run_suite("--attnhub-backend", "mla_fp8_query", "-k", "test_mla and kv_fp8")
    assert run.returncode == 0, run.output[-4000:]
    assert run.state("mla: fp8 latent", "mla_fp8_query") == "pass"


def test_suite_catches_precision_lost_past_16k_keys_in_the_full_scope(run_suite) -> None:
    """Exact up to 16k keys: the quick scope's long case (just past the split threshold) passes;
    the full scope's decode over 32k keys fails, naming the case."""
    select = ("-k", "test_long_context")
    quick = run_suite("--attnhub-backend", "loses_precision_past_16k", *select)
    assert quick.returncode == 0, quick.output[-4000:]
    run = run_suite(
        "--attnhub-backend",
        "loses_precision_past_16k",
        "--attnhub-scope",
        "full",
        "-k",
        "test_long_context and long_decode_32k",
    )
    assert run.returncode == 1, run.output[-4000:]
    failing = "test_long_context_matches_reference[loses_precision_past_16k-long_decode_32k-fp32"
    assert failing in run.output, run.output[-4000:]
    assert "differs from attnhub.reference" in run.output, run.output[-4000:]
    assert run.state("long context: decode 32k", "loses_precision_past_16k") == "fail"
