"""Discovery, availability, selection and refusals of the ascend backend."""

from __future__ import annotations

import ascend_helpers as h
import pytest
import torch
from attnhub_ascend import AscendBackend, emulator, ops
from attnhub_ascend.backend import HEAD_SIZE_SOURCES

import attnhub
from attnhub.errors import BackendUnavailableError, UnsupportedConfigurationError
from attnhub.spec import AttentionType


def test_the_plugin_registers_the_backend_through_its_entry_point() -> None:
    info = {i.name: i for i in attnhub.list_backends()}["ascend"]
    assert info.backend is AscendBackend and info.error is None
    assert info.distribution == "attnhub-ascend"


def test_cpu_needs_emulation_and_says_how() -> None:
    why = AscendBackend.availability("cpu")
    assert why is not None and "emulate=True, ATTNHUB_EMULATE=1 or --emulate" in why
    assert "--attnhub-" not in why  # no one tool's option: list, select and the suite show it
    assert AscendBackend.availability("cpu", emulate=True) is None
    assert AscendBackend.is_emulated("cpu") and not AscendBackend.is_emulated("npu:0")


def test_npu_without_torch_npu_is_unavailable_with_the_import_error() -> None:
    if ops._import_torch_npu()[0] is not None:
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
        # learnable_sink is bfloat16 whatever the model's dtype: fp16 models take sinks
        (dict(use_sinks=True, dtype=torch.float16), None),
        (dict(use_sinks=True, head_size=256), "head_size <= 128"),
        (dict(use_sinks=True, attn_type=AttentionType.ENCODER_ONLY), "decoder attention only"),
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


def test_fp16_models_with_sinks_run_with_a_bfloat16_sink_tensor() -> None:
    st = h.step([(1, 300), (5, 5)], h.spec(dtype=torch.float16, use_sinks=True))
    with emulator.record_calls() as calls:
        out = h.forward(st)
    (fia,) = [c for c in calls if c.name.startswith("npu_fused_infer_attention_score")]
    assert fia.name == "npu_fused_infer_attention_score_v2.out"
    assert fia.args[0].dtype == torch.float16
    assert fia.kwargs["learnable_sink"].dtype == torch.bfloat16
    h.assert_matches_reference(st, out)
