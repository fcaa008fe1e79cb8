"""Backend discovery (entry points + pluggy), registration and selection."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import attnhub
from attnhub import AttentionSpec, hookimpl, registry
from attnhub.errors import (
    BackendUnavailableError,
    NoBackendError,
    UnsupportedConfigurationError,
)
from attnhub.torch_backend import TorchBackend

SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float16)
INT8_SPEC = dataclasses.replace(SPEC, kv_cache_dtype="int8")


def caps(**changes: Any) -> attnhub.Capabilities:
    return dataclasses.replace(TorchBackend.capabilities, **changes)


class NarrowBackend(TorchBackend):
    """fp16 only, head size 64 only, no sliding window; outranks torch on CPU."""

    name = "narrow-test"
    capabilities = caps(
        dtypes=frozenset({torch.float16}),
        head_sizes=frozenset({64}),
        sliding_window=False,
        priority={"cpu": 100},
    )


class Int8Backend(TorchBackend):
    """Claims int8 caches (selection only: never asked to compute); ranks below torch."""

    name = "int8-test"
    capabilities = caps(kv_cache_dtypes=frozenset({"auto", "int8"}), priority={"cpu": 10})


class CudaOnlyBackend(TorchBackend):
    name = "cuda-only-test"
    capabilities = caps(devices=frozenset({"cuda"}), priority={"cuda": 100})


class EmulatedBackend(TorchBackend):
    """A "vendor" backend that runs on CPU only through its emulator; it would outrank torch."""

    name = "emulated-test"
    capabilities = caps(kv_cache_dtypes=frozenset({"auto", "int8"}), priority={"cpu": 1000})

    @classmethod
    def availability(cls, device: torch.device | str, emulate: bool = False) -> str | None:
        return None if emulate else "no vendor device; pass emulate=True to use the emulator"

    @classmethod
    def is_emulated(cls, device: torch.device | str) -> bool:
        return True


class FakeEntryPoint:
    def __init__(self, name: str, load: Callable[[], object]) -> None:
        self.name = name
        self.value = f"fake_{name}.plugin"
        self.dist = None
        self._load = load

    def load(self) -> object:
        return self._load()


def plugin_module(name: str, hook: Callable[[], object]) -> types.ModuleType:
    module = types.ModuleType(name)
    module.attnhub_backends = hookimpl(hook)  # type: ignore[attr-defined]
    return module


@pytest.fixture
def fake_entry_points(monkeypatch: pytest.MonkeyPatch) -> Callable[[list[Any]], None]:
    """Replace the entry points attnhub.registry sees (it calls md.entry_points(group=...))."""

    def install(eps: list[Any]) -> None:
        def entry_points(*, group: str) -> list[Any]:
            assert group == registry.ENTRY_POINT_GROUP
            return list(eps)

        monkeypatch.setattr(registry, "md", types.SimpleNamespace(entry_points=entry_points))

    return install


@pytest.fixture
def fresh(fake_entry_points: Callable[[list[Any]], None]) -> registry.Registry:
    """An isolated registry with no plugins; tests register what they need."""
    fake_entry_points([])
    return registry.Registry()


def infos(reg: registry.Registry) -> list[registry.BackendInfo]:
    lister = getattr(reg, "infos", None) or reg.list  # type: ignore[attr-defined]
    return lister()


# --- the built-in backend --------------------------------------------------------------------


def test_torch_backend_is_declared_as_an_entry_point_of_attnhub() -> None:
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="attnhub")}
    assert eps["torch"].value == "attnhub.torch_backend.plugin"


def test_torch_backend_is_discovered_through_its_entry_point() -> None:
    info = {i.name: i for i in attnhub.list_backends()}["torch"]
    assert info.backend is TorchBackend
    assert info.plugin == "torch"  # the entry-point name, not "<in-process>"
    assert info.distribution == "attnhub"
    assert info.error is None
    assert info.capabilities is TorchBackend.capabilities


def test_get_backend_returns_the_class() -> None:
    assert attnhub.get_backend("torch") is TorchBackend


def test_get_backend_of_an_unknown_name_lists_known_names() -> None:
    with pytest.raises(NoBackendError, match=r"'no-such-backend'.*known: .*torch"):
        attnhub.get_backend("no-such-backend")


def test_select_backend_picks_torch_on_cpu() -> None:
    backend = attnhub.select_backend(SPEC, "cpu")
    assert isinstance(backend, TorchBackend)
    assert backend.spec == SPEC
    assert backend.device == torch.device("cpu")
    assert not backend.emulated


def test_select_backend_prefer_unknown_raises_listing_known_names() -> None:
    with pytest.raises(NoBackendError) as info:
        attnhub.select_backend(SPEC, "cpu", prefer="no-such-backend")
    assert "'no-such-backend'" in str(info.value) and "torch" in str(info.value)


def test_env_attnhub_backend_unknown_raises_listing_known_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ATTNHUB_BACKEND", "from-the-env")
    with pytest.raises(NoBackendError) as info:
        attnhub.select_backend(SPEC, "cpu")
    assert "'from-the-env'" in str(info.value) and "torch" in str(info.value)


def test_env_attnhub_backend_names_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNHUB_BACKEND", "torch")
    assert isinstance(attnhub.select_backend(SPEC, "cpu"), TorchBackend)


def test_preferred_backend_that_cannot_serve_raises_with_its_reasons() -> None:
    with pytest.raises(UnsupportedConfigurationError) as info:
        attnhub.select_backend(INT8_SPEC, "cpu", prefer="torch")
    assert info.value.backend == "torch"
    assert any("'int8'" in r for r in info.value.reasons)
    assert "'int8'" in str(info.value)


def test_preferred_backend_never_falls_back(fresh: registry.Registry) -> None:
    fresh.register(TorchBackend)
    fresh.register(Int8Backend)
    assert isinstance(fresh.select(INT8_SPEC, "cpu"), Int8Backend)  # it could serve...
    with pytest.raises(UnsupportedConfigurationError, match="int8"):
        fresh.select(INT8_SPEC, "cpu", prefer="torch")  # ...but torch was asked for


def test_preferred_backend_unavailable_on_device_raises(fresh: registry.Registry) -> None:
    fresh.register(TorchBackend)
    fresh.register(CudaOnlyBackend)
    with pytest.raises(BackendUnavailableError) as info:
        fresh.select(SPEC, "cpu", prefer="cuda-only-test")
    assert info.value.backend == "cuda-only-test"
    assert "'cpu'" in info.value.reason


# --- selection order -------------------------------------------------------------------------


def test_higher_priority_backend_wins_when_it_supports_the_spec(fresh: registry.Registry) -> None:
    fresh.register(TorchBackend)
    fresh.register(NarrowBackend)
    assert type(fresh.select(SPEC, "cpu")) is NarrowBackend


def test_lower_priority_backend_serves_what_the_higher_one_refuses(
    fresh: registry.Registry,
) -> None:
    fresh.register(TorchBackend)
    fresh.register(NarrowBackend)
    windowed = dataclasses.replace(SPEC, sliding_window=128, window=None)
    assert type(fresh.select(windowed, "cpu")) is TorchBackend


def test_backend_for_another_device_type_is_not_chosen(fresh: registry.Registry) -> None:
    fresh.register(TorchBackend)
    fresh.register(CudaOnlyBackend)
    assert type(fresh.select(SPEC, "cpu")) is TorchBackend


def test_emulated_backend_is_never_chosen_unless_asked(fresh: registry.Registry) -> None:
    fresh.register(TorchBackend)
    fresh.register(EmulatedBackend)
    assert type(fresh.select(SPEC, "cpu")) is TorchBackend
    with pytest.raises(NoBackendError, match="emulate=True"):
        fresh.select(INT8_SPEC, "cpu")


def test_emulate_lets_an_emulated_backend_serve(fresh: registry.Registry) -> None:
    fresh.register(TorchBackend)
    fresh.register(EmulatedBackend)
    backend = fresh.select(INT8_SPEC, "cpu", emulate=True)
    assert type(backend) is EmulatedBackend and backend.emulated


def test_env_attnhub_emulate_means_emulate_true(
    fresh: registry.Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh.register(EmulatedBackend)
    monkeypatch.setenv("ATTNHUB_EMULATE", "1")
    assert type(fresh.select(INT8_SPEC, "cpu")) is EmulatedBackend


def test_native_backend_ranks_before_an_emulated_one(fresh: registry.Registry) -> None:
    fresh.register(TorchBackend)
    fresh.register(EmulatedBackend)  # priority 1000 on cpu, but emulated
    assert type(fresh.select(SPEC, "cpu", emulate=True)) is TorchBackend


def test_no_backend_error_lists_every_candidates_reasons(fresh: registry.Registry) -> None:
    fresh.register(TorchBackend)
    fresh.register(NarrowBackend)
    fresh.register(CudaOnlyBackend)
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=4, head_size=80, dtype=torch.bfloat16, kv_cache_dtype="int8"
    )
    with pytest.raises(NoBackendError) as info:
        fresh.select(spec, "cpu")
    c = info.value.candidates
    assert set(c) == {"torch", "narrow-test", "cuda-only-test"}
    assert any("'int8'" in r for r in c["torch"])
    assert any("bfloat16" in r for r in c["narrow-test"])
    assert any("head_size 80" in r for r in c["narrow-test"])
    assert any("'int8'" in r for r in c["narrow-test"])
    assert any("'cpu'" in r for r in c["cuda-only-test"])
    message = str(info.value)
    for reasons in c.values():
        for r in reasons:
            assert r in message


def test_backend_constructor_refuses_with_every_reason_at_once() -> None:
    spec = AttentionSpec(
        num_heads=4,
        num_kv_heads=4,
        head_size=80,
        dtype=torch.bfloat16,
        kv_cache_dtype="int8",
        sliding_window=8,
    )
    with pytest.raises(UnsupportedConfigurationError) as info:
        NarrowBackend(spec, "cpu")
    assert len(info.value.reasons) == 4  # dtype, head size, kv cache dtype, sliding window


def test_unsupported_reasons_is_empty_for_a_supported_spec() -> None:
    assert TorchBackend.unsupported_reasons(SPEC) == []
    assert TorchBackend.availability("cpu") is None


# --- in-process registration ------------------------------------------------------------------


@pytest.fixture
def cleanup_global() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        registry.default_registry().unregister(name)


def test_register_backend_makes_it_selectable(cleanup_global: list[str]) -> None:
    class InProcess(TorchBackend):
        name = "in-process-test"
        capabilities = caps(priority={"cpu": 1})

    cleanup_global.append(InProcess.name)
    assert attnhub.register_backend(InProcess) is InProcess
    assert attnhub.get_backend("in-process-test") is InProcess
    info = {i.name: i for i in attnhub.list_backends()}["in-process-test"]
    assert info.plugin == "<in-process>"
    backend = attnhub.select_backend(SPEC, "cpu", prefer="in-process-test")
    assert type(backend) is InProcess


def test_register_backend_rejects_a_duplicate_name(cleanup_global: list[str]) -> None:
    class First(TorchBackend):
        name = "dup-test"

    class Second(TorchBackend):
        name = "dup-test"

    cleanup_global.append("dup-test")
    attnhub.register_backend(First)
    attnhub.register_backend(First)  # the same class again is harmless
    with pytest.raises(ValueError, match="'dup-test'"):
        attnhub.register_backend(Second)
    assert attnhub.get_backend("dup-test") is First


def test_register_backend_replace_swaps_the_class(cleanup_global: list[str]) -> None:
    class First(TorchBackend):
        name = "replace-test"

    class Second(TorchBackend):
        name = "replace-test"

    cleanup_global.append("replace-test")
    attnhub.register_backend(First)
    attnhub.register_backend(Second, replace=True)
    assert attnhub.get_backend("replace-test") is Second


def test_register_backend_cannot_shadow_torch() -> None:
    class Shadow(TorchBackend):
        name = "torch"

    with pytest.raises(ValueError, match="'torch'"):
        attnhub.register_backend(Shadow)
    assert attnhub.get_backend("torch") is TorchBackend


@pytest.mark.parametrize(
    "cls",
    [object, "torch", TorchBackend.capabilities],
    ids=["plain_class", "string", "capabilities"],
)
def test_register_rejects_what_is_not_a_backend_class(
    fresh: registry.Registry, cls: object
) -> None:
    with pytest.raises(TypeError):
        fresh.register(cls)  # type: ignore[arg-type]


def test_register_rejects_a_backend_without_capabilities(fresh: registry.Registry) -> None:
    class NoCaps(TorchBackend):
        name = "no-caps-test"
        capabilities = ("not", "capabilities")  # type: ignore[assignment]

    with pytest.raises(TypeError, match="capabilities"):
        fresh.register(NoCaps)


# --- plugin isolation ---------------------------------------------------------------------------


def _raise_import_error() -> object:
    raise ImportError("No module named 'vendor_lib'")


def _hook_raises() -> list[type]:
    raise RuntimeError("hook exploded")


def _not_a_backend() -> list[object]:
    return [dict]


def test_failing_plugins_are_recorded_and_never_break_the_others(
    fake_entry_points: Callable[[list[Any]], None],
) -> None:
    fake_entry_points(
        [
            FakeEntryPoint("broken-import", _raise_import_error),
            FakeEntryPoint("hook-raises", lambda: plugin_module("m1", _hook_raises)),
            FakeEntryPoint("not-a-backend", lambda: plugin_module("m2", _not_a_backend)),
            FakeEntryPoint("good", lambda: plugin_module("m3", lambda: [NarrowBackend])),
        ]
    )
    reg = registry.Registry()
    listed = {i.name: i for i in infos(reg)}  # must not raise
    assert listed["narrow-test"].backend is NarrowBackend
    assert listed["narrow-test"].plugin == "good"
    assert listed["narrow-test"].error is None
    errors = {
        name: listed[name].error or "" for name in ("broken-import", "hook-raises", "not-a-backend")
    }
    assert "ImportError" in errors["broken-import"] and "vendor_lib" in errors["broken-import"]
    assert "RuntimeError" in errors["hook-raises"] and "hook exploded" in errors["hook-raises"]
    assert "dict" in errors["not-a-backend"]
    for name in errors:
        assert listed[name].backend is None
        assert listed[name].availability("cpu") is not None


def test_good_plugin_still_selectable_next_to_failing_ones(
    fake_entry_points: Callable[[list[Any]], None],
) -> None:
    fake_entry_points(
        [
            FakeEntryPoint("broken-import", _raise_import_error),
            FakeEntryPoint("good", lambda: plugin_module("m4", lambda: [NarrowBackend])),
        ]
    )
    reg = registry.Registry()
    assert type(reg.select(SPEC, "cpu")) is NarrowBackend


def test_get_of_a_failed_plugin_reports_its_error(
    fake_entry_points: Callable[[list[Any]], None],
) -> None:
    fake_entry_points([FakeEntryPoint("broken-import", _raise_import_error)])
    with pytest.raises(NoBackendError, match="vendor_lib"):
        registry.Registry().get("broken-import")


def test_no_backend_error_includes_failed_plugins(
    fake_entry_points: Callable[[list[Any]], None],
) -> None:
    fake_entry_points(
        [
            FakeEntryPoint("broken-import", _raise_import_error),
            FakeEntryPoint("good", lambda: plugin_module("m5", lambda: [NarrowBackend])),
        ]
    )
    with pytest.raises(NoBackendError) as info:
        registry.Registry().select(dataclasses.replace(SPEC, head_size=128), "cpu")
    assert "head_size 128" in " ".join(info.value.candidates["narrow-test"])
    assert "vendor_lib" in " ".join(info.value.candidates["broken-import"])


def test_plugin_hooks_run_once_at_discovery(
    fake_entry_points: Callable[[list[Any]], None],
) -> None:
    calls = []

    def hook() -> list[type]:
        calls.append(1)
        return [NarrowBackend]

    fake_entry_points([FakeEntryPoint("good", lambda: plugin_module("m6", hook))])
    reg = registry.Registry()
    for _ in range(3):
        reg.select(SPEC, "cpu")
        infos(reg)
    assert calls == [1]


def test_two_plugins_registering_the_same_name_keep_the_first(
    fake_entry_points: Callable[[list[Any]], None],
) -> None:
    class Impostor(TorchBackend):
        name = "narrow-test"

    fake_entry_points(
        [
            FakeEntryPoint("a-first", lambda: plugin_module("m7", lambda: [NarrowBackend])),
            FakeEntryPoint("b-second", lambda: plugin_module("m8", lambda: [Impostor])),
        ]
    )
    listed = {i.name: i for i in infos(registry.Registry())}
    assert listed["narrow-test"].backend is NarrowBackend
    assert "narrow-test" in (listed["b-second"].error or "")
