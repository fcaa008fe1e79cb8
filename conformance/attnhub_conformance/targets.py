"""Targets: the backends a conformance session runs against, resolved from the registry.

A target is one backend class on one device, with how it runs there (natively, emulated, or not
at all, and why). Backends whose plugin failed to load are targets too: the suite reports them
as failures instead of silently leaving them out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

import attnhub
from attnhub import AttentionBackend, AttentionSpec, Capabilities


@dataclass(frozen=True)
class Target:
    """One backend on one device, as this session runs it."""

    name: str
    device: str
    emulate: bool  # what the session passes as ``emulate`` to availability and construction
    backend: type[AttentionBackend] | None = field(default=None, compare=False)
    unavailable: str | None = None  # why the backend cannot run here (None: it can)
    load_error: str | None = None  # the plugin failed to import or register
    emulated: bool = False  # runs through a CPU emulator of the vendor library
    distribution: str | None = None
    version: str | None = None

    @property
    def runnable(self) -> bool:
        return self.backend is not None and self.unavailable is None and self.load_error is None

    @property
    def capabilities(self) -> Capabilities:
        assert self.backend is not None, f"backend {self.name!r} did not load"
        return self.backend.capabilities

    def create(self, spec: AttentionSpec) -> AttentionBackend:
        """An instance bound to ``spec`` on this target's device."""
        assert self.backend is not None
        return self.backend(spec, self.device, emulate=self.emulate)

    def refusal(self, spec: AttentionSpec) -> list[str]:
        """Why this backend refuses ``spec`` (empty: supported)."""
        assert self.backend is not None
        return list(self.backend.unsupported_reasons(spec))

    @property
    def status(self) -> str:
        if self.load_error is not None:
            return "failed to load"
        if self.unavailable is not None:
            return "unavailable"
        return "emulated" if self.emulated else "native"


def resolve_targets(names: Sequence[str], device: str, emulate: bool) -> list[Target]:
    """The named backends (every discovered one when ``names`` is empty), in name order.

    Raises ``LookupError`` naming the known backends when a name is unknown.
    """
    infos = {info.name: info for info in attnhub.list_backends()}
    if names:
        unknown = [n for n in names if n not in infos]
        if unknown:
            known = ", ".join(sorted(infos)) or "none"
            raise LookupError(
                f"no attnhub backend named {', '.join(map(repr, unknown))} (known: {known})"
            )
        chosen = list(dict.fromkeys(names))
    else:
        chosen = sorted(infos)
    device_problem = _device_problem(device)
    targets = []
    for name in chosen:
        info = infos[name]
        common = Target(
            name=name,
            device=device,
            emulate=emulate,
            backend=info.backend,
            distribution=info.distribution,
            version=info.version,
        )
        if info.backend is None:
            targets.append(replace(common, load_error=info.error or "unknown error"))
            continue
        why = info.availability(device, emulate) or device_problem
        if why is not None:
            targets.append(replace(common, unavailable=why))
            continue
        try:
            emulated = bool(info.backend.is_emulated(device))
        except Exception as exc:  # a probe that raises is a broken backend, not a crash
            targets.append(
                replace(common, load_error=f"is_emulated() raised {type(exc).__name__}: {exc}")
            )
            continue
        targets.append(replace(common, emulated=emulated))
    return targets


def _device_problem(device: str) -> str | None:
    """Why this process cannot allocate tensors on ``device`` (None: it can). The suite builds
    its inputs there, whatever a backend's ``availability`` says."""
    try:
        torch.empty(1, device=device)
    except Exception as exc:
        return f"torch cannot allocate on {device!r} here: {type(exc).__name__}: {exc}"
    return None
