"""Targets: the backends a conformance session runs against, resolved from the registry.

A target is one backend class on one device, with how it runs there (natively, emulated, or not
at all, and why). Backends whose plugin failed to load are targets too: the suite reports them
as failures instead of silently leaving them out.

A run must test something. A backend named with ``--attnhub-backend`` that cannot run here is a
failure of the run, not a skip (a CI job on a host whose vendor library is broken must not go
green having tested nothing); so is every backend of a default run (no names) in which none can
run. ``allow_unavailable`` (``--attnhub-allow-unavailable``) reports them as unavailable instead.
A plugin that failed to load is always a failure: it is installed, and broken.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

import attnhub
from attnhub import AttentionBackend, AttentionSpec, Capabilities
from attnhub.emulation import in_terms_of


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
    #: Which implementation serves the name, where a backend class has several and says which
    #: (a ``provider`` class attribute: flash's FA2, FA3, vLLM's fork...); None otherwise.
    provider: str | None = None
    #: Why the run fails if this backend cannot run (None: it is then reported as unavailable).
    required: str | None = None

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
    def cannot_run(self) -> str | None:
        """Why this target fails the run without being tested (None: it runs, or may be
        reported as unavailable): its plugin failed to load, or it was required and is
        unavailable here. One sentence, naming the pytest plugin's options."""
        if self.load_error is not None:
            return f"backend {self.name!r}: its plugin failed to load: {self.load_error}"
        if self.unavailable is None or self.required is None:
            return None
        hints = []
        if not self.emulate and self._emulation_would_run():
            hints.append("--attnhub-emulate would run it through its CPU emulator")
        hints.append("--attnhub-allow-unavailable reports it as unavailable instead of failing")
        return (
            f"backend {self.name!r} cannot run on device {self.device!r} and {self.required}: "
            f"{self.unavailable.rstrip('.')} ({'; '.join(hints)})"
        )

    def _emulation_would_run(self) -> bool:
        try:
            return self.backend is not None and self.backend.availability(self.device, True) is None
        except Exception:  # a probe that raises says nothing about emulation
            return False

    @property
    def status(self) -> str:
        if self.load_error is not None:
            return "failed to load"
        if self.unavailable is not None:
            return "unavailable"
        return "emulated" if self.emulated else "native"


def resolve_targets(
    names: Sequence[str], device: str, emulate: bool, *, allow_unavailable: bool = False
) -> list[Target]:
    """The named backends (every discovered one when ``names`` is empty), in name order.

    Unless ``allow_unavailable``, a named backend that cannot run here is ``required`` (its
    availability test fails), and so is every backend of a default run in which none can run.
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
            provider=_provider(info.backend),
        )
        if info.backend is None:
            targets.append(replace(common, load_error=info.error or "unknown error"))
            continue
        why = info.availability(device, emulate) or device_problem
        why = None if why is None else in_terms_of(why, "pytest")  # the hint in pytest's terms
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
    if allow_unavailable:
        return targets
    if names:
        return [replace(t, required=f"was asked for (--attnhub-backend {t.name})") for t in targets]
    if not any(t.runnable for t in targets):
        nothing = "no discovered backend can run there, so the run would test nothing"
        return [replace(t, required=nothing) for t in targets]
    return targets


def _provider(backend: type[AttentionBackend] | None) -> str | None:
    provider = getattr(backend, "provider", None)
    return provider if isinstance(provider, str) else None


def _device_problem(device: str) -> str | None:
    """Why this process cannot allocate tensors on ``device`` (None: it can). The suite builds
    its inputs there, whatever a backend's ``availability`` says."""
    try:
        torch.empty(1, device=device)
    except Exception as exc:
        return f"torch cannot allocate on {device!r} here: {type(exc).__name__}: {exc}"
    return None
