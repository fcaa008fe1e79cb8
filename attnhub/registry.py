"""Backend discovery (pluggy + entry points) and selection.

Every distribution with an entry point in group ``attnhub`` is loaded in isolation: a plugin that
fails to import, or whose hook raises or returns something that is not a backend class, is
recorded with its error (``list_backends()``, ``attnhub list``) and never breaks the others.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
import traceback
from dataclasses import dataclass
from types import ModuleType

import pluggy
import torch

from attnhub import hookspecs
from attnhub.backend import AttentionBackend, device_type
from attnhub.capabilities import Capabilities
from attnhub.errors import (
    BackendUnavailableError,
    NoBackendError,
    UnsupportedConfigurationError,
)
from attnhub.spec import AttentionSpec

ENTRY_POINT_GROUP = "attnhub"
ENV_BACKEND = "ATTNHUB_BACKEND"
ENV_EMULATE = "ATTNHUB_EMULATE"


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
    """The backends known to this process. Module-level functions use one shared instance."""

    def __init__(self) -> None:
        self._discovered = False
        self._infos: dict[str, BackendInfo] = {}
        self._failures: list[BackendInfo] = []
        self.plugin_manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.plugin_manager.add_hookspecs(hookspecs)

    # --- discovery -------------------------------------------------------------------------
    def discover(self, *, force: bool = False) -> None:
        if self._discovered and not force:
            return
        if force:
            self._infos = {k: v for k, v in self._infos.items() if v.plugin == "<in-process>"}
            self._failures = []
            for _, plugin in list(self.plugin_manager.list_name_plugin()):
                self.plugin_manager.unregister(plugin)
        self._discovered = True
        for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else None
            version = dist.version if dist is not None else None
            try:
                module = ep.load()
                self._register_plugin(module, ep.name, dist_name, version)
            except Exception as exc:
                self._fail(ep.name, dist_name, version, exc)

    def _register_plugin(
        self, module: ModuleType, plugin: str, dist: str | None, version: str | None
    ) -> None:
        self.plugin_manager.register(module, name=plugin)
        impls = self.plugin_manager.subset_hook_caller(
            "attnhub_backends",
            remove_plugins=[p for n, p in self.plugin_manager.list_name_plugin() if n != plugin],
        )
        found = impls()  # pluggy: a list of each hookimpl's result; one plugin, one impl
        classes = [cls for result in found for cls in (result or [])]
        if not classes:
            raise TypeError("its attnhub_backends() hook returned no backend classes")
        for cls in classes:
            self._add(cls, plugin, dist, version)

    def _fail(self, plugin: str, dist: str | None, version: str | None, exc: BaseException) -> None:
        last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
        self._failures.append(
            BackendInfo(
                name=plugin,
                plugin=plugin,
                distribution=dist,
                version=version,
                backend=None,
                error=f"{type(exc).__name__}: {exc}{where}",
            )
        )

    def _add(
        self,
        cls: object,
        plugin: str,
        dist: str | None,
        version: str | None,
        *,
        replace: bool = False,
    ) -> None:
        if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
            raise TypeError(f"{cls!r} is not an AttentionBackend subclass")
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls.__name__} has no string class attribute 'name'")
        if not isinstance(getattr(cls, "capabilities", None), Capabilities):
            raise TypeError(f"{cls.__name__}.capabilities is not an attnhub.Capabilities")
        if name in self._infos and not replace and self._infos[name].backend is not cls:
            other = self._infos[name]
            raise ValueError(
                f"backend name {name!r} is already registered by {other.plugin!r} "
                f"({other.backend.__module__ if other.backend else '?'})"
            )
        self._infos[name] = BackendInfo(name, plugin, dist, version, cls)

    def register(self, cls: type[AttentionBackend], *, replace: bool = False) -> None:
        """Register a backend class in this process (no entry point needed)."""
        self.discover()
        module = getattr(sys.modules.get(getattr(cls, "__module__", "")), "__name__", None)
        self._add(cls, "<in-process>", module, None, replace=replace)

    def unregister(self, name: str) -> None:
        self._infos.pop(name, None)

    # --- queries ---------------------------------------------------------------------------
    def infos(self) -> list[BackendInfo]:
        self.discover()
        return sorted(self._infos.values(), key=lambda i: i.name) + list(self._failures)

    def get(self, name: str) -> type[AttentionBackend]:
        self.discover()
        info = self._infos.get(name)
        if info is None or info.backend is None:
            failed = [f for f in self._failures if f.name == name]
            if failed:
                raise NoBackendError(f"backend plugin {name!r} failed to load: {failed[0].error}")
            known = ", ".join(sorted(self._infos)) or "none"
            raise NoBackendError(f"no backend named {name!r} (known: {known})")
        return info.backend

    def select(
        self,
        spec: AttentionSpec,
        device: torch.device | str = "cpu",
        *,
        prefer: str | None = None,
        emulate: bool = False,
    ) -> AttentionBackend:
        prefer = prefer or os.environ.get(ENV_BACKEND) or None
        emulate = emulate or os.environ.get(ENV_EMULATE, "").lower() in ("1", "true", "yes")
        if prefer is not None:
            cls = self.get(prefer)
            why = cls.availability(device, emulate)
            if why is not None:
                raise BackendUnavailableError(prefer, str(device), why)
            refusals = cls.unsupported_reasons(spec)
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
        self, spec: AttentionSpec, device: torch.device | str, *, emulate: bool = False
    ) -> list[tuple[type[AttentionBackend], list[str]]]:
        """Every backend in selection order with its reasons for refusing (empty = usable).

        Order: native before emulated, then higher ``capabilities.priority[device type]``,
        then name.
        """
        self.discover()
        dt = device_type(device)
        rows = []
        for info in self._infos.values():
            cls = info.backend
            assert cls is not None
            why = info.availability(device, emulate)
            reasons: list[str] = [why] if why else []
            reasons += cls.unsupported_reasons(spec)
            emulated = why is None and cls.is_emulated(device)
            rows.append((emulated, -cls.capabilities.priority.get(dt, 0), cls.name, cls, reasons))
        rows.sort(key=lambda r: r[:3])
        return [(r[3], r[4]) for r in rows]


_REGISTRY = Registry()


def default_registry() -> Registry:
    return _REGISTRY


def list_backends() -> list[BackendInfo]:
    """Every discovered backend (and every plugin that failed to load, with its error)."""
    return _REGISTRY.infos()


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered under ``name``; NoBackendError if none."""
    return _REGISTRY.get(name)


def register_backend(
    cls: type[AttentionBackend], *, replace: bool = False
) -> type[AttentionBackend]:
    """Register a backend class in-process. Returns it, so it can decorate the class."""
    _REGISTRY.register(cls, replace=replace)
    return cls


def select_backend(
    spec: AttentionSpec,
    device: torch.device | str = "cpu",
    *,
    prefer: str | None = None,
    emulate: bool = False,
) -> AttentionBackend:
    """The highest-priority available backend that supports ``spec`` on ``device``.

    ``prefer`` (or env ATTNHUB_BACKEND) names one: if it cannot serve, this raises with its
    reasons, never falling back. ``emulate`` (or env ATTNHUB_EMULATE=1) lets vendor backends run
    through their CPU emulators; native backends still rank first.
    """
    return _REGISTRY.select(spec, device, prefer=prefer, emulate=emulate)
