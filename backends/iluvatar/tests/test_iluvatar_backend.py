"""Discovery, availability, selection, the HND cache and refusals of the iluvatar backend."""

from __future__ import annotations

import iluvatar_helpers as h
import pytest
import torch
from attnhub_iluvatar import IluvatarBackend, emulator, ops

import attnhub
from attnhub.errors import BackendUnavailableError, UnsupportedConfigurationError


def test_the_plugin_registers_the_backend_through_its_entry_point() -> None:
    info = {i.name: i for i in attnhub.list_backends()}["iluvatar"]
    assert info.backend is IluvatarBackend and info.error is None
    assert info.distribution == "attnhub-iluvatar"


def test_cpu_needs_emulation_and_says_how() -> None:
    why = IluvatarBackend.availability("cpu")
    assert why is not None and "emulate=True" in why
    assert IluvatarBackend.availability("cpu", emulate=True) is None
    assert IluvatarBackend.is_emulated("cpu") and not IluvatarBackend.is_emulated("cuda:0")


def test_cuda_without_ixformer_is_unavailable_with_the_import_error() -> None:
    if ops._import_ixformer()[0] is not None:
        pytest.skip("ixformer imports here")
    why = IluvatarBackend.availability("cuda:0", emulate=True)
    assert why is not None and why.startswith("ixformer is not importable")
    assert "ModuleNotFoundError" in why
    with pytest.raises(BackendUnavailableError, match="ixformer"):
        IluvatarBackend(h.spec(), "cuda")


def test_other_devices_are_refused_with_the_supported_ones() -> None:
    why = IluvatarBackend.availability("npu:0", emulate=True)
    assert why is not None and "'npu'" in why and "'cuda'" in why


def test_the_emulator_is_the_namespace_on_cpu() -> None:
    assert h.backend().ops is emulator


def test_selection_never_picks_the_emulator_unless_named() -> None:
    spec = h.spec()
    assert attnhub.select_backend(spec, "cpu", emulate=True).name == "torch"
    chosen = attnhub.select_backend(spec, "cpu", prefer="iluvatar", emulate=True)
    assert isinstance(chosen, IluvatarBackend) and chosen.emulated
    with pytest.raises(BackendUnavailableError, match="emulate"):
        attnhub.select_backend(spec, "cpu", prefer="iluvatar")


def test_the_cache_is_hnd_with_contiguous_planes() -> None:
    cache = h.backend().allocate_kv_cache(4)
    assert cache.layout == "HND" and tuple(cache.key.shape) == (4, 2, 16, 64)
    assert cache.key.is_contiguous() and cache.value.is_contiguous()


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        (dict(dtype=torch.float32), "float16 and bfloat16"),
        (dict(block_size=24), "kernel block sizes"),
        (dict(block_size=128), "kernel block sizes"),
        (dict(head_size=36), "head_size % 8 == 0"),
        (dict(head_size=264), "head_size % 8 == 0"),
        (dict(use_sinks=True, kv_cache_dtype="int8"), "take no sinks"),
        (dict(use_sinks=True, kv_cache_dtype="int8_k"), "take no sinks"),
        (dict(kv_cache_dtype="fp8_e4m3"), "model dtype or int8"),
        (dict(head_size=80, block_size=32, sliding_window=5, logits_soft_cap=5.0), None),
        (dict(head_size=40, block_size=64), None),
        (dict(use_alibi=True), None),
        (dict(use_sinks=True), None),
    ],
)
def test_undeclared_configurations_are_refused_with_reasons(
    changes: dict[str, object], reason: str | None
) -> None:
    spec = h.spec(**changes)
    reasons = IluvatarBackend.unsupported_reasons(spec)
    if reason is None:
        assert reasons == []
        return
    assert any(reason in r for r in reasons), reasons
    with pytest.raises(UnsupportedConfigurationError):
        IluvatarBackend(spec, "cpu", emulate=True)


def test_refusals_are_explained_per_field() -> None:
    spec = h.spec(head_size=36, block_size=128)
    by_field = {r.field: r for r in IluvatarBackend.unsupported_reasons(spec)}
    assert by_field["head_size"].endswith(
        "(Iluvatar's vLLM backend takes head_size % 8 == 0 and head_size <= 256)"
    )
    assert by_field["block_size"].endswith(
        "(the kernel block sizes Iluvatar's vLLM backend declares)"
    )


def test_sinks_need_an_ixformer_whose_attention_takes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork gates sinks behind flash_attn_supports_sinks(); attnhub's gate is the installed
    ixformer's signatures: an entry point without ``sinks`` refuses the spec at construction."""
    from types import SimpleNamespace

    from attnhub_iluvatar import ops

    def no_sinks(q, k, v, *, out=None):  # type: ignore[no-untyped-def]
        raise AssertionError("never called")

    fake = SimpleNamespace(
        contrib=SimpleNamespace(
            vllm_flash_attn=SimpleNamespace(
                flash_attn_varlen_func=h.emulator.contrib.vllm_flash_attn.flash_attn_varlen_func,
                flash_attn_with_kvcache=no_sinks,
            )
        )
    )
    assert ops.missing_sinks_keyword(h.emulator) is None
    assert ops.missing_sinks_keyword(fake) == "flash_attn_with_kvcache"
    monkeypatch.setattr(ops, "namespace", lambda device, emulate: fake)
    with pytest.raises(UnsupportedConfigurationError, match="flash_attn_with_kvcache takes no"):
        IluvatarBackend(h.spec(use_sinks=True), "cpu", emulate=True)
    IluvatarBackend(h.spec(), "cpu", emulate=True)  # no sinks: nothing to check


def test_graph_capture_of_more_than_one_token_decodes_is_refused_at_build() -> None:
    """UNIFORM_SINGLE_TOKEN_DECODE: a two-token uniform batch runs the varlen call, which the
    fork never captures (capture itself: test_iluvatar_graphs.py)."""
    st = h.step([(2, 30), (2, 29)])
    with pytest.raises(UnsupportedConfigurationError, match="uniform_single_token_decode"):
        st.backend.metadata_builder().build_for_graph_capture(st.batch)


def test_decodes_are_asked_for_first_with_the_forks_threshold() -> None:
    builder = IluvatarBackend(h.spec(), "cpu", emulate=True).metadata_builder()
    assert builder.reorder_batch_threshold == 1  # the fork's, without speculative tokens
