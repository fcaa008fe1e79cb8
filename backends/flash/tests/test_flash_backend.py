"""Discovery, provider choice, availability and refusals of the flash backend."""

from __future__ import annotations

import ast
import inspect

import flash_helpers as h
import pytest
import torch
from attnhub_flash import (
    CAPABILITIES,
    FlashBackend,
    FlashFA2Backend,
    FlashFA4Backend,
    FlashVllmBackend,
    backend_class,
    emulator,
    ops,
    providers,
)

import attnhub
from attnhub.errors import (
    BackendUnavailableError,
    InvalidInputError,
    UnsupportedConfigurationError,
)
from attnhub.registry import Registry
from attnhub.spec import AttentionType


def test_the_plugin_registers_one_backend_named_flash() -> None:
    info = {i.name: i for i in attnhub.list_backends()}["flash"]
    assert info.error is None and info.distribution == "attnhub-flash"
    assert issubclass(info.backend, FlashBackend)  # type: ignore[arg-type]


@pytest.mark.parametrize("provider", h.PROVIDERS)
def test_the_environment_variable_picks_the_provider(
    provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ops.ENV, provider)
    cls = backend_class()
    assert cls.provider == provider and cls.name == "flash"
    assert cls.capabilities is CAPABILITIES[provider]


def test_an_unknown_provider_is_refused_with_the_known_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ops.ENV, "fa5")
    with pytest.raises(InvalidInputError, match="vllm, vllm-fa3, vllm-flashmla, fa2, fa3, fa4"):
        backend_class()
    with pytest.raises(InvalidInputError, match="fa5"):
        backend_class("fa5")


def test_discovery_registers_the_class_of_the_provider_the_environment_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ops.ENV, "fa4")
    assert Registry().get("flash") is FlashFA4Backend


def test_a_bad_provider_name_fails_the_plugin_with_its_reason_and_spares_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ops.ENV, "fa5")
    infos = {i.name: i for i in Registry().infos()}
    assert infos["flash"].backend is None
    assert (
        infos["flash"].error is not None and "ATTNHUB_FLASH_PROVIDER='fa5'" in infos["flash"].error
    )
    assert infos["torch"].error is None


def test_without_any_provider_installed_the_default_is_vllms_fork() -> None:
    if any(ops.module_exists(p.source.attention) for p in providers.PROVIDERS.values()):
        pytest.skip("a FlashAttention provider is installed here")
    assert backend_class() is FlashVllmBackend


def test_cpu_needs_emulation_and_says_how() -> None:
    why = FlashVllmBackend.availability("cpu")
    assert why is not None and "emulate=True" in why
    assert FlashVllmBackend.availability("cpu", emulate=True) is None
    assert FlashVllmBackend.is_emulated("cpu") and not FlashVllmBackend.is_emulated("cuda:0")


@pytest.mark.parametrize("provider", h.PROVIDERS)
def test_cuda_without_the_provider_is_unavailable_with_the_import_error(provider: str) -> None:
    module = providers.PROVIDERS[provider].source.attention
    if ops.import_once(module)[0] is not None:
        pytest.skip(f"{module} imports here")
    why = h.BACKENDS[provider].availability("cuda:0", emulate=True)
    assert why is not None and f"{module} is not importable" in why and ops.ENV in why


def test_other_devices_are_refused_with_the_supported_ones() -> None:
    why = FlashVllmBackend.availability("npu:0", emulate=True)
    assert why is not None and "'cuda'" in why and "'npu'" in why


@pytest.mark.parametrize("provider", h.PROVIDERS)
def test_the_emulator_is_the_namespace_on_cpu(provider: str) -> None:
    b = h.backend(provider)
    assert b.ops.emulated and b.ops.provider == provider
    vllm = provider.startswith("vllm")
    expected = {"fa2": emulator.FA2, "fa3": emulator.FA3, "fa4": emulator.FA4}
    assert b.ops.attention is (emulator.VLLM if vllm else expected[provider])
    assert (b.ops.cache_ops is emulator.VLLM_CACHE_OPS) == vllm


def test_selection_prefers_native_backends_and_serves_flash_when_named() -> None:
    spec = h.spec()
    assert attnhub.select_backend(spec, "cpu", emulate=True).name == "torch"
    chosen = attnhub.select_backend(spec, "cpu", prefer="flash", emulate=True)
    assert isinstance(chosen, FlashBackend) and chosen.emulated
    with pytest.raises(BackendUnavailableError, match="emulate"):
        attnhub.select_backend(spec, "cpu", prefer="flash")


def test_the_cache_is_nhd_as_the_paged_kernels_take_it() -> None:
    cache = h.backend().allocate_kv_cache(4)
    assert cache.layout == "NHD" and tuple(cache.key.shape) == (4, 16, 2, 64)


@pytest.mark.parametrize(
    ("provider", "changes", "reason"),
    [
        ("vllm", dict(dtype=torch.float32), "float16 and bfloat16"),
        ("vllm", dict(block_size=8), "multiples of 16"),
        ("vllm", dict(head_size=72 + 4), "multiples of 8 up to 256"),
        ("vllm", dict(use_sinks=True), "fa_version=3"),
        ("vllm", dict(kv_cache_dtype="fp8_e4m3"), "provider vllm-fa3"),
        ("fa2", dict(kv_cache_dtype="fp8_e4m3"), "no fp8"),
        ("fa3", dict(kv_cache_dtype="fp8_e5m2"), "fp8 e4m3 caches only"),
        ("fa3", dict(kv_cache_dtype="fp8_e4m3", dtype=torch.float16), "bfloat16 outputs"),
        ("vllm-fa3", dict(kv_cache_dtype="fp8_e4m3", dtype=torch.float16), "bfloat16 outputs"),
        ("fa3", dict(kv_cache_dtype="fp8_e4m3", head_size=72), "fp8 head sizes to 16"),
        ("vllm-fa3", dict(use_alibi=True), "no ALiBi with fa_version=3"),
        ("vllm-fa3", dict(block_size=8), "multiples of 16"),
        ("fa2", dict(block_size=16), "multiple of 256"),
        ("fa2", dict(use_sinks=True), "no attention sinks"),
        ("fa3", dict(use_alibi=True), "FA3 has no ALiBi"),
        ("fa3", dict(use_sinks=True), "no attention sinks"),
        ("fa4", dict(use_alibi=True), "FA4 has no ALiBi"),
        ("fa4", dict(head_size=192), "8..128"),
        ("vllm", dict(use_alibi=True, sliding_window=8, logits_soft_cap=30.0), None),
        ("fa2", dict(use_alibi=True, attn_type=AttentionType.ENCODER_ONLY), None),
        ("fa3", dict(block_size=1, head_size=256), None),
        ("fa4", dict(use_sinks=True, head_size=256, block_size=128), None),
        ("vllm-fa3", dict(use_sinks=True, sliding_window=8, logits_soft_cap=5.0), None),
        ("fa3", dict(kv_cache_dtype="fp8_e4m3", head_size=80, sliding_window=8), None),
        ("vllm-fa3", dict(kv_cache_dtype="fp8_e4m3", use_sinks=True), None),
    ],
)
def test_each_provider_refuses_what_its_kernels_lack_and_says_which_provider(
    provider: str, changes: dict[str, object], reason: str | None
) -> None:
    spec = h.spec(provider, **changes)
    cls = h.BACKENDS[provider]
    reasons = cls.unsupported_reasons(spec)
    if reason is None:
        assert reasons == []
        return
    assert any(reason in r and f"provider {provider}" in r for r in reasons), reasons
    with pytest.raises(UnsupportedConfigurationError):
        cls(spec, "cpu", emulate=True)


@pytest.mark.parametrize("provider", h.PROVIDERS)
def test_each_backend_class_is_its_provider_object(provider: str) -> None:
    cls = h.BACKENDS[provider]
    assert cls.kernels is providers.PROVIDERS[provider] and cls.kernels.name == provider
    assert cls.capabilities is cls.kernels.capabilities is CAPABILITIES[provider]


@pytest.mark.parametrize("module", ["attnhub_flash.backend", "attnhub_flash.ops"])
def test_the_backend_and_the_resolution_name_no_provider(module: str) -> None:
    """What differs per provider lives in its object (providers.py): no code here compares,
    looks up or passes a provider's name (docstrings aside)."""
    tree = ast.parse(inspect.getsource(__import__(module, fromlist=["_"])))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    named = [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and node.value in providers.PROVIDERS
        and id(node) not in docstrings
    ]
    assert named == []


def test_capabilities_differ_per_provider_where_the_kernels_do() -> None:
    assert CAPABILITIES["vllm"].alibi and CAPABILITIES["fa2"].alibi
    assert not CAPABILITIES["fa3"].alibi and not CAPABILITIES["fa4"].alibi
    assert CAPABILITIES["fa4"].sinks and not CAPABILITIES["vllm"].sinks
    assert FlashFA2Backend.capabilities.block_size_multiple == 256
    # FA4: the union of SM90's 8..256 and SM100's 8..128 or 256, each GPU's rule per class
    assert FlashFA4Backend.capabilities.max_head_size == 256
    assert FlashFA4Backend.capabilities.head_size_multiple == 8


def test_a_mixed_batch_is_refused_at_build_for_graph_capture_below_always() -> None:
    """vllm (FA2 kernels) captures uniform batches only: a mixed one is refused, naming the
    level (graph capture itself: test_flash_graphs.py)."""
    st = h.step([(1, 40), (3, 37)])
    builder = st.backend.metadata_builder()
    with pytest.raises(UnsupportedConfigurationError, match="uniform_batch"):
        builder.build_for_graph_capture(st.batch)
