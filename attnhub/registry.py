"""Plugin discovery (pluggy + entry points) and backend selection.

One plugin manager, one loader, one fault isolation: every distribution with an entry point in
group ``attnhub`` is loaded in isolation, and its hooks (``attnhub.hookspecs``: backends, CLI
commands, bench comparisons, host comparisons) are called once, all or none. A plugin that fails
to import, implements a hook attnhub does not have, or whose hook raises or returns something
else than the hook's list, is recorded with its error (``list_backends()``, ``attnhub list``,
``attnhub --help``, a :class:`~attnhub.errors.PluginLoadWarning` at selection) and never breaks
the others. The core's own entry point (the built-in ``torch`` backend) loads first, so a plugin
may call ``attnhub.get_backend("torch")`` at import, e.g. to subclass it.

The tools (``attnhub`` commands, ``attnhub bench``) also load the deprecated entry-point groups
``attnhub.cli`` and ``attnhub.bench`` (``LEGACY_GROUPS``), each entry point wrapped as a plugin
with the matching hook and loaded by the same loader; the runtime (``select_backend``) never
loads them.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import sys
import threading
import traceback
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pluggy
import torch

from attnhub import hookspecs
from attnhub.backend import AttentionBackend, device_type
from attnhub.capabilities import Capabilities
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
from attnhub.hookspecs import BenchComparison, Command, HostComparison
from attnhub.mla import MLASpec
from attnhub.spec import AttentionSpec

ENTRY_POINT_GROUP = "attnhub"
#: Deprecated entry-point groups of the first releases, loaded for the tools only: the value
#: of an ``attnhub.cli`` entry point returns ``(help, main)`` (a :class:`Command` named as the
#: entry point), of an ``attnhub.bench`` one is a :class:`BenchComparison`'s ``run``.
LEGACY_GROUPS = ("attnhub.cli", "attnhub.bench")
#: What each tool hook returns a list of.
TOOL_HOOKS: dict[str, type] = {
    "attnhub_commands": Command,
    "attnhub_bench_comparisons": BenchComparison,
    "attnhub_host_comparisons": HostComparison,
}
_HOOK_NAMES = ("attnhub_backends", *TOOL_HOOKS)
ENV_BACKEND = "ATTNHUB_BACKEND"
ENV_EMULATE = "ATTNHUB_EMULATE"


_ENV_YES = ("1", "true", "yes", "on")
_ENV_NO = ("", "0", "false", "no", "off")


def emulate_from_env() -> bool:
    """Whether ``ATTNHUB_EMULATE`` asks for emulation ("1", "true", "yes" or "on"; unset,
    empty, "0", "false", "no" or "off": not). Any other value is refused (InvalidInputError
    naming it) rather than read as "off": a misspelt switch must not silently pick another
    backend."""
    value = os.environ.get(ENV_EMULATE, "")
    word = value.strip().lower()
    if word in _ENV_YES:
        return True
    if word in _ENV_NO:
        return False
    raise InvalidInputError(
        f"{ENV_EMULATE}={value!r}: use 1, true, yes or on to let vendor backends run through "
        "their CPU emulators, or 0, false, no, off (or unset) for not"
    )


IN_PROCESS = "<in-process>"  # BackendInfo.plugin of a backend given to register_backend()
CORE_PACKAGE = __name__.partition(".")[0]  # entry points into this package are the built-ins

# Files whose frames say nothing about where a plugin went wrong (see _origin).
_MACHINERY = (
    os.path.dirname(importlib.__file__),
    os.path.dirname(pluggy.__file__),
    __file__,
)


@dataclass(frozen=True)
class PluginTool:
    """A command or comparison a plugin provides (``item``: a :class:`Command`,
    :class:`BenchComparison` or :class:`HostComparison`), and where it comes from."""

    plugin: str  # entry-point name ("attnhub.cli:NAME" for a deprecated-group entry point)
    distribution: str | None
    version: str | None
    item: Any

    @property
    def name(self) -> str:
        return str(self.item.name)

    @property
    def source(self) -> str:
        """``distribution version``, or the plugin's name where no distribution is known."""
        if self.distribution is None:
            return self.plugin
        return f"{self.distribution} {self.version or ''}".strip()


@dataclass(frozen=True)
class BackendInfo:
    """One discovered backend, or one plugin that failed (``error`` set, ``backend`` None)."""

    name: str
    plugin: str  # entry-point name, or "<in-process>"
    distribution: str | None
    version: str | None
    backend: type[AttentionBackend] | None
    error: str | None = None

    @property
    def capabilities(self) -> Capabilities | None:
        return None if self.backend is None else self.backend.capabilities

    def availability(self, device: torch.device | str, emulate: bool = False) -> str | None:
        if self.backend is None:
            return f"plugin failed to load: {self.error}"
        try:
            return self.backend.availability(device, emulate)
        except Exception as exc:  # a backend's probe must not break listing
            return f"availability check raised {type(exc).__name__}: {exc}"


class Registry:
    """The backends known to this process. Module-level functions use one shared instance.

    Thread-safe: discovery runs once, under a lock; a thread that asks while another discovers
    waits for the complete set.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entrant: a plugin's import may call back in
        self._discovered = False
        self._discovering = False
        self._loading: str | None = None  # the plugin being loaded, while discovering
        self._infos: dict[str, BackendInfo] = {}
        self._failures: list[BackendInfo] = []
        self._causes: dict[str, BaseException] = {}  # failed plugin -> its original exception
        self._builtin_plugins: set[str] = set()
        self._tools: dict[str, list[PluginTool]] = {hook: [] for hook in TOOL_HOOKS}
        self._legacy_loaded = False
        self.plugin_manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.plugin_manager.add_hookspecs(hookspecs)

    # --- discovery -------------------------------------------------------------------------
    def discover(self, *, force: bool = False) -> None:
        """Load every entry point of group ``attnhub``, once (again with ``force=True``).

        Built-in entry points (modules of the core package) load first, then the others by
        name. A call made from a plugin's import while discovery runs sees the backends
        registered so far (the built-ins at least); other threads wait until discovery is done.
        """
        with self._lock:
            if self._discovering:  # re-entered by a plugin being loaded: serve what is known
                return
            if self._discovered and not force:
                return
            if force:
                self._forget_plugins()
            self._discovering = True
            try:
                for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=_load_order):
                    self._load(ep)
            finally:
                self._discovering = False
                self._loading = None
                self._discovered = True

    def _forget_plugins(self) -> None:
        """Drop everything discovery found; in-process registrations stay."""
        self._infos = {k: v for k, v in self._infos.items() if v.plugin == IN_PROCESS}
        self._failures = []
        self._causes = {}
        self._builtin_plugins = set()
        self._tools = {hook: [] for hook in TOOL_HOOKS}
        self._legacy_loaded = False
        for _, plugin in list(self.plugin_manager.list_name_plugin()):
            self.plugin_manager.unregister(plugin)

    def discover_tools(self) -> None:
        """:meth:`discover`, then the deprecated groups ``LEGACY_GROUPS`` once (the tools'
        discovery: commands and comparisons of plugins not yet on the hooks)."""
        self.discover()
        with self._lock:
            if self._legacy_loaded:
                return
            self._legacy_loaded = True
            for group in LEGACY_GROUPS:
                for ep in sorted(md.entry_points(group=group), key=lambda e: e.name):
                    self._load(ep, legacy=group)

    def _load(self, ep: Any, legacy: str | None = None) -> None:
        """Import one entry point and register its hooks, or record why not. ``legacy``: the
        deprecated group it comes from, its value wrapped as a plugin (``_legacy_plugin``)."""
        dist = getattr(ep, "dist", None)
        dist_name = dist.metadata["Name"] if dist is not None else None
        version = dist.version if dist is not None else None
        plugin = ep.name if legacy is None else f"{legacy}:{ep.name}"
        self._loading = plugin
        try:
            module = ep.load() if legacy is None else _legacy_plugin(ep, legacy)
            self._register_plugin(module, plugin, dist_name, version, builtin=_is_builtin(ep))
        except Exception as exc:
            self._fail(plugin, dist_name, version, exc)

    def _register_plugin(
        self,
        module: ModuleType,
        plugin: str,
        dist: str | None,
        version: str | None,
        *,
        builtin: bool,
    ) -> None:
        """Register ``module`` with pluggy, call its hooks and add their results: all or none."""
        self.plugin_manager.register(module, name=plugin)
        try:
            self._check_hooks(module, plugin)
            classes = self._hook_result(plugin)
            tools = {hook: self._tool_results(hook, plugin) for hook in TOOL_HOOKS}
            names: dict[str, type[AttentionBackend]] = {}
            for result in classes:
                cls = _checked_backend_class(result, f"plugin {plugin!r}")
                name = cls.name
                if names.get(name, cls) is not cls:
                    raise DuplicateBackendError(
                        f"plugin {plugin!r} returns two backends named {name!r}: "
                        f"{_qualname(names[name])} and {_qualname(cls)}",
                        name,
                    )
                self._check_name_is_free(name, cls, replace=False)
                names[name] = cls
        except Exception:
            if self.plugin_manager.is_registered(module):
                self.plugin_manager.unregister(module)
            raise
        for name, cls in names.items():
            self._infos[name] = BackendInfo(name, plugin, dist, version, cls)
        for hook, items in tools.items():
            self._tools[hook] += [PluginTool(plugin, dist, version, item) for item in items]
        if builtin:
            self._builtin_plugins.add(plugin)

    def _impls(self, hook: str, plugin: str) -> list[Any]:
        return [
            impl
            for impl in getattr(self.plugin_manager.hook, hook).get_hookimpls()
            if impl.plugin_name == plugin
        ]

    def _check_hooks(self, module: ModuleType, plugin: str) -> None:
        """Raise unless the plugin implements attnhub's hooks only, and one at least."""
        hooks = ", ".join(f"{h}()" for h in _HOOK_NAMES)
        try:
            self.plugin_manager.check_pending()
        except pluggy.PluginValidationError as exc:  # a misspelled hook name, most likely
            raise BackendRegistrationError(f"{exc}: attnhub's hooks are {hooks}") from exc
        if not any(self._impls(hook, plugin) for hook in _HOOK_NAMES):
            raise BackendRegistrationError(
                f"plugin {plugin!r} (module {module.__name__}) has no @attnhub.hookimpl "
                f"function named one of {hooks}"
            )

    def _tool_results(self, hook: str, plugin: str) -> list[Any]:
        """What the plugin's implementations of tool hook ``hook`` return, checked."""
        kind = TOOL_HOOKS[hook]
        found: list[Any] = []
        for impl in self._impls(hook, plugin):
            result = impl.function()
            if not isinstance(result, list) or not all(isinstance(r, kind) for r in result):
                raise BackendRegistrationError(
                    f"plugin {plugin!r}: {hook}() returned {result!r}, not a list of "
                    f"attnhub.hookspecs.{kind.__name__}"
                )
            for r in result:
                if not isinstance(r.name, str) or not r.name or r.name.startswith("-"):
                    raise BackendRegistrationError(
                        f"plugin {plugin!r}: {hook}() returned a {kind.__name__} named "
                        f"{r.name!r}, not a non-empty string"
                    )
            found += result
        return found

    def _hook_result(self, plugin: str) -> list[object]:
        """What the plugin's own ``attnhub_backends()`` implementations return, concatenated
        (none: the plugin adds tools only)."""
        impls = self._impls("attnhub_backends", plugin)
        classes: list[object] = []
        for impl in impls:
            result = impl.function()
            if not isinstance(result, list):
                raise InvalidBackendError(
                    f"plugin {plugin!r}: attnhub_backends() returned {result!r}, "
                    "not a list of backend classes"
                )
            classes += result
        if impls and not classes:
            raise BackendRegistrationError(
                f"plugin {plugin!r}: attnhub_backends() returned no backend classes"
            )
        return classes

    def _fail(self, plugin: str, dist: str | None, version: str | None, exc: BaseException) -> None:
        self._failures.append(
            BackendInfo(
                name=plugin,
                plugin=plugin,
                distribution=dist,
                version=version,
                backend=None,
                error=f"{type(exc).__name__}: {exc}{_origin(exc)}",
            )
        )
        self._causes[plugin] = exc

    def _check_name_is_free(self, name: str, cls: type, *, replace: bool) -> None:
        """Raise if ``name`` belongs to another class (a built-in's, even with ``replace``)."""
        other = self._infos.get(name)
        if other is None or other.backend is cls:
            return
        owner = "in-process" if other.plugin == IN_PROCESS else f"by plugin {other.plugin!r}"
        module = other.backend.__module__ if other.backend is not None else "?"
        if other.plugin in self._builtin_plugins:
            raise ReservedBackendNameError(
                f"backend name {name!r} of {_qualname(cls)} belongs to the built-in backend "
                f"(registered {owner}, module {module}); choose another name",
                name,
            )
        if not replace:
            raise DuplicateBackendError(
                f"backend name {name!r} of {_qualname(cls)} is already registered {owner} "
                f"(module {module})",
                name,
            )

    def register(self, cls: type[AttentionBackend], *, replace: bool = False) -> None:
        """Register a backend class in this process (no entry point needed).

        Raises InvalidBackendError (a TypeError) for what is not a backend class,
        DuplicateBackendError (a ValueError) for a name another class holds (unless
        ``replace``), ReservedBackendNameError for a built-in's name.
        """
        self.discover()
        with self._lock:
            name = _checked_backend_class(cls, "register_backend()").name
            if name in self._infos and self._infos[name].backend is cls:
                return  # the same class again is harmless
            self._check_name_is_free(name, cls, replace=replace)
            module = getattr(sys.modules.get(cls.__module__), "__name__", None)
            self._infos[name] = BackendInfo(name, IN_PROCESS, module, None, cls)

    def unregister(self, name: str) -> None:
        with self._lock:
            self._infos.pop(name, None)

    # --- queries ---------------------------------------------------------------------------
    def tools(self, hook: str) -> list[PluginTool]:
        """What every plugin's tool hook ``hook`` (a key of ``TOOL_HOOKS``) returned, in load
        order, the deprecated groups included (:meth:`discover_tools`)."""
        self.discover_tools()
        with self._lock:
            return list(self._tools[hook])

    def failures(self) -> list[BackendInfo]:
        """Every plugin that failed to load, the deprecated groups' included, in load order."""
        self.discover_tools()
        with self._lock:
            return list(self._failures)

    def infos(self) -> list[BackendInfo]:
        """Every backend by name, then every plugin that failed to load, in load order."""
        self.discover()
        with self._lock:
            return sorted(self._infos.values(), key=lambda i: i.name) + list(self._failures)

    def get(self, name: str) -> type[AttentionBackend]:
        """The class registered as ``name``.

        PluginLoadError if ``name`` is a plugin that failed to load, else NoBackendError.
        """
        self.discover()
        with self._lock:
            info = self._infos.get(name)
            if info is not None and info.backend is not None:
                return info.backend
            for failed in self._failures:
                if failed.name == name:
                    raise PluginLoadError(name, failed.error or "?") from self._causes.get(name)
            known = ", ".join(sorted(self._infos)) or "none"
            message = f"no backend named {name!r} (known: {known})"
            if self._discovering:
                message += (
                    f"; asked while discovery is loading plugin {self._loading!r}, "
                    "so backends of plugins loaded after it are not known yet"
                )
            raise NoBackendError(message)

    def select(
        self,
        spec: AttentionSpec | MLASpec,
        device: torch.device | str = "cpu",
        *,
        prefer: str | None = None,
        emulate: bool = False,
    ) -> AttentionBackend:
        """See :func:`select_backend`. Warns (PluginLoadWarning) about each failed plugin."""
        prefer = prefer or os.environ.get(ENV_BACKEND) or None
        emulate = emulate or emulate_from_env()
        self.discover()
        failures = [f for f in self._failures if f.plugin != prefer]  # prefer raises instead
        for failed in failures:
            warnings.warn(
                f"attnhub plugin {failed.plugin!r} failed to load, so its backends are not "
                f"considered: {failed.error}",
                PluginLoadWarning,
                stacklevel=2,
            )
        if prefer is not None:
            cls = self.get(prefer)
            why = cls.availability(device, emulate)
            if why is not None:
                raise BackendUnavailableError(prefer, str(device), why)
            refusals = cls.unsupported_reasons(spec)  # type: ignore[arg-type]  # MLA: dispatched
            if refusals:
                raise UnsupportedConfigurationError(prefer, refusals)
            return cls(spec, device, emulate=emulate)
        ranked = self.rank(spec, device, emulate=emulate)
        for cls, reasons in ranked:
            if not reasons:
                return cls(spec, device, emulate=emulate)
        raise NoBackendError(
            f"no attnhub backend can serve this spec on {device!r}",
            {cls.name: reasons for cls, reasons in ranked}
            | {f.name: [f"plugin failed to load: {f.error}"] for f in self._failures},
        )

    def rank(
        self, spec: AttentionSpec | MLASpec, device: torch.device | str, *, emulate: bool = False
    ) -> list[tuple[type[AttentionBackend], list[str]]]:
        """Every backend in selection order with its reasons for refusing (empty = usable).

        Order: native before emulated, then higher ``capabilities.priority[device type]``,
        then name.
        """
        self.discover()
        with self._lock:
            infos = list(self._infos.values())
        dt = device_type(device)
        rows = []
        for info in infos:
            cls = info.backend
            assert cls is not None
            why = info.availability(device, emulate)
            reasons: list[str] = [why] if why else []
            reasons += cls.unsupported_reasons(spec)  # type: ignore[arg-type]  # MLA: dispatched
            emulated = why is None and cls.is_emulated(device)
            rows.append((emulated, -cls.capabilities.priority.get(dt, 0), cls.name, cls, reasons))
        rows.sort(key=lambda r: r[:3])
        return [(r[3], r[4]) for r in rows]


def _legacy_plugin(ep: Any, group: str) -> ModuleType:
    """An entry point of deprecated group ``group`` as a plugin module with the hook that
    replaces the group (``attnhub.cli``: ``attnhub_commands``; ``attnhub.bench``:
    ``attnhub_bench_comparisons``)."""
    target = ep.load()
    module = ModuleType(f"{ep.value} (entry-point group {group!r}, deprecated)")
    if group == "attnhub.cli":
        made = target()
        if not (
            isinstance(made, tuple)
            and len(made) == 2
            and isinstance(made[0], str)
            and callable(made[1])
        ):
            raise BackendRegistrationError(
                f"{ep.value} returned {made!r}, expected (help: str, main: callable)"
            )
        command = Command(ep.name, made[0], made[1])

        def attnhub_commands() -> list[Command]:
            return [command]

        module.attnhub_commands = hookspecs.hookimpl(attnhub_commands)  # type: ignore[attr-defined]
    else:
        comparison = BenchComparison(ep.name, target)

        def attnhub_bench_comparisons() -> list[BenchComparison]:
            return [comparison]

        module.attnhub_bench_comparisons = hookspecs.hookimpl(  # type: ignore[attr-defined]
            attnhub_bench_comparisons
        )
    return module


def _load_order(ep: Any) -> tuple[bool, str]:
    """Built-ins first (so plugins can use them at import), then by entry-point name."""
    return (not _is_builtin(ep), ep.name)


def _is_builtin(ep: Any) -> bool:
    """Whether an entry point names a module of the core package (``attnhub.…``)."""
    module = str(getattr(ep, "value", "")).partition(":")[0]
    return module.partition(".")[0] == CORE_PACKAGE


def _checked_backend_class(cls: object, source: str) -> type[AttentionBackend]:
    """``cls`` if it is a registrable backend class (named, with Capabilities), else raise
    InvalidBackendError naming it and ``source`` (who offered it)."""
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise InvalidBackendError(
            f"{source} got {cls!r}, which is not a subclass of attnhub.AttentionBackend"
        )
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise InvalidBackendError(
            f"{source} got {_qualname(cls)}, whose class attribute 'name' is {name!r}, "
            "not a non-empty string"
        )
    capabilities = getattr(cls, "capabilities", None)
    if not isinstance(capabilities, Capabilities):
        raise InvalidBackendError(
            f"{source} got {_qualname(cls)}, whose capabilities is {capabilities!r}, "
            "not an attnhub.Capabilities"
        )
    return cls


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _origin(exc: BaseException) -> str:
    """`` (at file:line)`` of the innermost frame outside import/pluggy/registry machinery."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if not frame.filename.startswith(("<", *_MACHINERY)):
            return f" (at {frame.filename}:{frame.lineno})"
    return ""


_REGISTRY = Registry()


def default_registry() -> Registry:
    return _REGISTRY


def list_backends() -> list[BackendInfo]:
    """Every discovered backend (and every plugin that failed to load, with its error)."""
    return _REGISTRY.infos()


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered under ``name``.

    NoBackendError if none; PluginLoadError (a NoBackendError) if ``name`` is a plugin that
    failed to load. Safe to call from a plugin's import: the built-in backends are there.
    """
    return _REGISTRY.get(name)


def register_backend(
    cls: type[AttentionBackend], *, replace: bool = False
) -> type[AttentionBackend]:
    """Register a backend class in-process. Returns it, so it can decorate the class.

    InvalidBackendError (a TypeError) if ``cls`` is not a backend class with a name and
    Capabilities; DuplicateBackendError (a ValueError) if another class holds its name and
    ``replace`` is false; ReservedBackendNameError if the name is a built-in's (``torch``).
    """
    _REGISTRY.register(cls, replace=replace)
    return cls


def select_backend(
    spec: AttentionSpec | MLASpec,
    device: torch.device | str = "cpu",
    *,
    prefer: str | None = None,
    emulate: bool = False,
) -> AttentionBackend:
    """The highest-priority available backend that supports ``spec`` on ``device``.

    ``prefer`` (or env ATTNHUB_BACKEND) names one: if it cannot serve, this raises with its
    reasons, never falling back. ``emulate`` (or env ATTNHUB_EMULATE=1) lets vendor backends run
    through their CPU emulators; native backends still rank first. A plugin that failed to load
    is never silent: each call warns (PluginLoadWarning) naming it and its error, which Python's
    default warning filter shows once per plugin.
    """
    return _REGISTRY.select(spec, device, prefer=prefer, emulate=emulate)
