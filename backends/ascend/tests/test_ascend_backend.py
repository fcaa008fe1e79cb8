"""Discovery, availability, selection and refusals of the ascend backend."""

from __future__ import annotations

import ascend_helpers as h
import pytest
import torch
from attnhub_ascend import AscendBackend, emulator, ops
from attnhub_ascend.backend import HEAD_SIZE_SOURCES

import attnhub
from attnhub import emulation, reference, testing
from attnhub.capabilities import Refusal
from attnhub.errors import BackendUnavailableError, UnsupportedConfigurationError
from attnhub.spec import AttentionSpec, AttentionType


def test_the_plugin_registers_the_backend_through_its_entry_point() -> None:
    info = {i.name: i for i in attnhub.list_backends()}["ascend"]
    assert info.backend is AscendBackend and info.error is None
    assert info.distribution == "attnhub-ascend"


def test_cpu_needs_emulation_and_says_how() -> None:
    why = AscendBackend.availability("cpu")
    assert why is not None and emulation.emulate_hint() in why  # each tool shows it in its terms
    assert "--attnhub-" not in why
    assert AscendBackend.availability("cpu", emulate=True) is None
    assert AscendBackend.is_emulated("cpu") and not AscendBackend.is_emulated("npu:0")


def test_npu_without_torch_npu_is_unavailable_with_the_import_error() -> None:
    if ops.import_once("torch_npu")[0] is not None:
        pytest.skip("torch_npu imports here")
    why = AscendBackend.availability("npu:0", emulate=True)
    assert why is not None and why.startswith("torch_npu is not importable (needs the CANN")
    with pytest.raises(BackendUnavailableError, match="torch_npu"):
        AscendBackend(h.spec(), "npu")


def test_other_devices_are_refused_with_the_supported_ones() -> None:
    why = AscendBackend.availability("cuda:0", emulate=True)
    assert why is not None and "'npu'" in why and "'cuda'" in why


def test_the_emulator_is_the_namespace_on_cpu() -> None:
    assert h.backend().ops is emulator


def test_selection_prefers_native_backends_and_serves_ascend_when_named() -> None:
    spec = h.spec()
    assert attnhub.select_backend(spec, "cpu", emulate=True).name == "torch"
    chosen = attnhub.select_backend(spec, "cpu", prefer="ascend", emulate=True)
    assert isinstance(chosen, AscendBackend) and chosen.emulated
    with pytest.raises(BackendUnavailableError, match="emulate"):
        attnhub.select_backend(spec, "cpu", prefer="ascend")


def test_the_nhd_cache_is_what_fia_views_as_three_dimensional() -> None:
    cache = h.backend().allocate_kv_cache(4)
    assert cache.layout == "NHD" and tuple(cache.key.shape) == (4, 128, 2, 64)
    assert cache.key.view(4, 128, -1).shape == (4, 128, 128)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        (dict(dtype=torch.float32), "float16 and bfloat16"),
        (dict(block_size=16), "multiple of 128"),
        (dict(head_size=72), "not one of [64, 128, 192, 256]"),
        (dict(head_size=96), "not one of [64, 128, 192, 256]"),
        (dict(head_size=512), "D 512 needs query_rope/key_rope"),
        (dict(logits_soft_cap=30.0), "soft-capping"),
        (dict(use_alibi=True), "pse_shift"),
        (dict(kv_cache_dtype="fp8_e4m3"), "kv_cache_dtype"),
        (dict(num_heads=130, num_kv_heads=2), "GQA ratio"),
        (dict(num_heads=512, num_kv_heads=512), "256"),
        (dict(num_heads=8, num_kv_heads=8, head_size=256, block_size=128), None),
        (dict(num_heads=8, num_kv_heads=8, head_size=192, block_size=128), None),
        # learnable_sink is bfloat16 only: sinks of fp16 models would bias the output
        (dict(use_sinks=True, dtype=torch.float16), "sinks need a bfloat16 model"),
        (dict(use_sinks=True, dtype=torch.bfloat16), None),
        (dict(use_sinks=True, head_size=256), "head_size <= 128"),
        # non-causal types take float32 sinks through npu_fusion_attention's `sink`
        (dict(use_sinks=True, attn_type=AttentionType.ENCODER_ONLY), None),
    ],
)
def test_undeclared_configurations_are_refused_with_reasons(
    changes: dict[str, object], reason: str | None
) -> None:
    spec = h.spec(**changes)
    reasons = AscendBackend.unsupported_reasons(spec)
    if reason is None:
        assert reasons == []
        return
    assert any(reason in r for r in reasons), reasons
    with pytest.raises(UnsupportedConfigurationError):
        AscendBackend(spec, "cpu", emulate=True)


def test_kv_hidden_size_limit_of_the_three_dimensional_cache_view() -> None:
    spec = h.spec(num_heads=256, num_kv_heads=256, head_size=256)
    assert any("65535" in r for r in AscendBackend.unsupported_reasons(spec))


def test_cascade_and_graph_capture_of_a_mixed_batch_are_refused_at_build() -> None:
    st = h.step([(1, 300), (4, 290)])
    builder = st.backend.metadata_builder()
    with pytest.raises(UnsupportedConfigurationError, match="cascade"):
        builder.build(st.batch, common_prefix_len=128)
    with pytest.raises(UnsupportedConfigurationError, match="graph capture"):
        builder.build_for_graph_capture(st.batch)  # uniform batches only


def test_refusals_are_explained_per_field_not_by_their_wording() -> None:
    """The backend attaches its kernels' reason to the refused field: a core sentence reworded
    keeps its explanation."""
    spec = attnhub.AttentionSpec(
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.float32,
        block_size=16,
        logits_soft_cap=30.0,
    )
    by_field = {r.field: r for r in AscendBackend.unsupported_reasons(spec)}
    assert by_field["dtype"].endswith("(the kernels take float16 and bfloat16)")
    assert by_field["softcap"].endswith("(FIA has no logit soft-capping)")
    assert "multiple of 128" in by_field["block_size"]


def test_every_declared_head_size_names_its_source() -> None:
    """Only head sizes the FIA doc names for TND without rope ([doc]) or that vllm-ascend runs
    through the same call on hardware ([callers]) are declared, each with its source."""
    declared = AscendBackend.capabilities.head_sizes
    assert declared == frozenset(HEAD_SIZE_SOURCES)
    for size, source in HEAD_SIZE_SOURCES.items():
        assert source.startswith(("[doc]", "[callers]")), (size, source)
    assert 512 not in declared  # TND D = 512 is the MLA form: query_rope / key_rope [doc]


class _SinksOfAnyDtype(AscendBackend):
    """The backend as it was: float16 models took sinks, passed as a bfloat16 learnable_sink."""

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec) -> list[Refusal]:
        return [
            r
            for r in super().unsupported_reasons(spec)
            if not (r.field == "sinks" and r.value == spec.dtype)
        ]


def test_fp16_models_with_sinks_are_refused_with_the_reason() -> None:
    spec = h.spec(dtype=torch.float16, use_sinks=True)
    with pytest.raises(UnsupportedConfigurationError, match=r"learnable_sink .* bfloat16 only"):
        AscendBackend(spec, "cpu", emulate=True)
    assert attnhub.select_backend(spec, "cpu", emulate=True).name != "ascend"


@pytest.mark.parametrize("window", [None, 4])
def test_a_bfloat16_sink_tensor_biases_fp16_output_beyond_fp16_rounding(
    monkeypatch: pytest.MonkeyPatch, window: int | None
) -> None:
    """Why fp16 models with sinks are refused (a conformance run once failed on this, fp16,
    sinks, window): each head's sink rounded to bfloat16 moves that head's softmax
    denominator, the same way for every token, so the output's magnitude is biased beyond what
    float16 rounding explains. The bias is the sink's rounding alone: against a reference whose
    sinks are the bfloat16 ones, the same output is within float16 rounding."""
    monkeypatch.setattr(h, "backend", lambda s=None: _SinksOfAnyDtype(s, "cpu", emulate=True))
    spec = h.spec(dtype=torch.float16, use_sinks=True, sliding_window=window)
    st = h.step([(1, 2)] * 4, spec, seed=4)  # short contexts: the sinks weigh much
    out = h.forward(st)
    n = st.batch.num_actual_tokens
    assert st.sinks is not None

    def rounding_mismatch(sinks: torch.Tensor) -> str | None:
        def ref(dtype: torch.dtype) -> torch.Tensor:
            q = st.query[:n]
            return reference.paged_attention(
                q, st.cache, st.batch, spec, sinks=sinks, compute_dtype=dtype
            )[0]

        return testing.rounding_mismatch(
            out[:n], ref(torch.float64), ref(torch.float16), torch.float16
        )

    why = rounding_mismatch(st.sinks)
    assert why is not None and why.startswith("magnitude bias"), why
    assert rounding_mismatch(st.sinks.to(torch.bfloat16).float()) is None


def test_bf16_models_with_sinks_run_with_their_own_rounding() -> None:
    st = h.step([(1, 2)] * 4, h.spec(use_sinks=True), seed=4)
    with emulator.record_calls() as calls:
        out = h.forward(st)
    (fia,) = [c for c in calls if c.name.startswith("npu_fused_infer_attention_score")]
    assert fia.name == "npu_fused_infer_attention_score_v2.out"
    assert fia.kwargs["learnable_sink"].dtype == torch.bfloat16
    n, spec = st.batch.num_actual_tokens, st.backend.spec
    exact, rounded = (
        reference.paged_attention(
            st.query[:n], st.cache, st.batch, spec, sinks=st.sinks, compute_dtype=dtype
        )[0]
        for dtype in (torch.float64, torch.bfloat16)
    )
    assert testing.rounding_mismatch(out[:n], exact, rounded, torch.bfloat16) is None
    h.assert_matches_reference(st, out)
