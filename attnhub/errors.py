"""The exception types attnhub raises. Every one derives from :class:`AttnhubError`.

Messages name the bad value, e.g. ``slot_mapping[7] = 4096 is outside the cache (1024 blocks x 4
slots)``. Input errors also derive from ``ValueError`` (or ``TypeError``, for what is not a
backend class) so generic callers can catch them as such. The one warning,
:class:`PluginLoadWarning`, is a ``UserWarning``.
"""

from __future__ import annotations

from collections.abc import Sequence


class AttnhubError(Exception):
    """Base class of every error attnhub raises on purpose."""


class InvalidSpecError(AttnhubError, ValueError):
    """An :class:`~attnhub.AttentionSpec` that describes no valid attention layer."""


class InvalidInputError(AttnhubError, ValueError):
    """A batch, tensor or argument that breaks the protocol (shape, dtype, device, range)."""


class UnknownNameError(AttnhubError, KeyError):
    """A name attnhub does not know (a feature, a KV-cache format), or a declaration a backend
    lacks (a tolerance for a dtype): a lookup that failed, so also a ``KeyError``."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


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

    ``message`` is the one-line headline; ``candidates`` maps each backend considered to the
    reasons it was rejected.
    """

    def __init__(self, message: str, candidates: dict[str, list[str]] | None = None):
        self.message = message
        self.candidates = dict(candidates or {})
        lines = [message]
        for name, reasons in self.candidates.items():
            lines.append(f"  {name}:")
            lines.extend(f"    - {r}" for r in reasons)
        super().__init__("\n".join(lines))


class PluginLoadError(NoBackendError):
    """A backend plugin failed to import or register. Recorded, never fatal to the others.

    Raised by ``get_backend(name)`` / ``select_backend(prefer=name)`` when ``name`` is a plugin
    that failed; the original exception is its ``__cause__``. A :class:`NoBackendError`, since
    the plugin provides no backend, so callers that catch that keep working.
    """

    def __init__(self, plugin: str, error: str):
        self.plugin = plugin
        self.error = error
        super().__init__(f"attnhub plugin {plugin!r} failed to load: {error}")


class BackendRegistrationError(AttnhubError):
    """A backend class, or a plugin's ``attnhub_backends()`` result, that cannot be registered.

    From a plugin it is recorded as the plugin's error; from ``register_backend`` it is raised.
    """


class InvalidBackendError(BackendRegistrationError, TypeError):
    """Not a backend: not an ``AttentionBackend`` subclass, no string ``name``, ``capabilities``
    not an :class:`~attnhub.Capabilities`, or a hook result that is not a list of classes."""


class DuplicateBackendError(BackendRegistrationError, ValueError):
    """A backend name already registered by another class (pass ``replace=True`` to swap an
    in-process registration)."""

    def __init__(self, message: str, name: str):
        self.name = name
        super().__init__(message)


class ReservedBackendNameError(DuplicateBackendError):
    """A backend name that belongs to a built-in backend (``torch``): nothing may take it, not
    even with ``replace=True``."""


class ToolError(AttnhubError):
    """An attnhub tool (``attnhub bench``, a command or comparison a plugin adds) cannot do
    what was asked; the message says why. Runtime calls never raise it."""


class BenchUnavailableError(ToolError):
    """A bench comparison cannot run here (its vendor library absent, ...); the message says
    why. ``attnhub bench`` reports it as skipped, with that reason."""


class PluginLoadWarning(UserWarning):
    """Selection ran while a backend plugin had failed to load (the plugin and its error are in
    the message): the backend it would have provided was not considered."""
