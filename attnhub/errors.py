"""The exception types attnhub raises. Every one derives from :class:`AttnhubError`.

Messages name the bad value, e.g. ``slot_mapping[7] = 4096 is outside the cache (1024 blocks x 4
slots)``. Input errors also derive from ``ValueError`` so generic callers can catch them as such.
"""

from __future__ import annotations

from collections.abc import Sequence


class AttnhubError(Exception):
    """Base class of every error attnhub raises on purpose."""


class InvalidSpecError(AttnhubError, ValueError):
    """An :class:`~attnhub.AttentionSpec` that describes no valid attention layer."""


class InvalidInputError(AttnhubError, ValueError):
    """A batch, tensor or argument that breaks the protocol (shape, dtype, device, range)."""


class UnsupportedConfigurationError(AttnhubError):
    """A backend cannot serve a spec (or a feature): ``reasons`` lists every refusal."""

    def __init__(self, backend: str, reasons: Sequence[str]):
        self.backend = backend
        self.reasons = list(reasons)
        lines = "\n".join(f"  - {r}" for r in self.reasons)
        super().__init__(f"backend {backend!r} cannot serve this configuration:\n{lines}")


class BackendUnavailableError(AttnhubError):
    """A backend exists but cannot run on the requested device (library or hardware missing)."""

    def __init__(self, backend: str, device: str, reason: str):
        self.backend = backend
        self.device = device
        self.reason = reason
        super().__init__(f"backend {backend!r} is not available on {device!r}: {reason}")


class NoBackendError(AttnhubError):
    """No backend (or no backend of the requested name) can serve a spec on a device.

    ``candidates`` maps each backend considered to the reasons it was rejected.
    """

    def __init__(self, message: str, candidates: dict[str, list[str]] | None = None):
        self.candidates = dict(candidates or {})
        lines = [message]
        for name, reasons in self.candidates.items():
            lines.append(f"  {name}:")
            lines.extend(f"    - {r}" for r in reasons)
        super().__init__("\n".join(lines))


class PluginLoadError(AttnhubError):
    """A backend plugin failed to import or register. Recorded, never fatal to the others."""

    def __init__(self, plugin: str, error: str):
        self.plugin = plugin
        self.error = error
        super().__init__(f"attnhub plugin {plugin!r} failed to load: {error}")
