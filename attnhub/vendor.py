"""Where a vendor backend's ops come from: the vendor's library on its native device, the
backend package's CPU emulator when emulation is asked for, nothing otherwise (with the reason).

A backend's ``ops.py`` declares one :class:`VendorLibrary` (its native device, how to probe and
load the vendor's library, how to load its emulator); the device dispatch, the sentences for
the other devices and the error are written here once. Resolved once per backend instance,
never per call. Reached through :mod:`attnhub.kit`.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from attnhub.backend import device_type
from attnhub.emulation import emulate_hint
from attnhub.errors import BackendUnavailableError

#: The device an emulated backend runs on.
EMULATED_DEVICE = "cpu"
#: How to ask for the emulator, in the API's terms: ``attnhub`` commands and the conformance
#: suite show it in theirs (attnhub.emulation.in_terms_of).
EMULATE_HINT = emulate_hint()


@functools.cache
def import_once(module: str) -> tuple[ModuleType | None, str | None]:
    """``import module`` once per process: (module, None) or (None, why it failed). Any
    exception counts as "not importable" (a vendor build whose native libraries do not load),
    never as a crash of discovery."""
    try:
        return importlib.import_module(module), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class VendorLibrary:
    """One backend's source of ops: the vendor's library natively, else its emulator."""

    backend: str  # the backend's name, as BackendUnavailableError reports it
    native_device: str  # the device type the vendor's library runs on ("npu", "cuda")
    #: the sentence's subject for a CPU without emulation: "X kernels run on device 'cuda'"
    kernels: str
    #: the native case in the sentence for another device: "'cuda'", "'cuda' with <library>"
    native: str
    #: on the native device: None when the library is importable and the device visible, else
    #: why not (a sentence); imports nothing twice (``import_once``)
    probe: Callable[[torch.device | str], str | None]
    load: Callable[[], Any]  # the native namespace, once ``probe`` said None
    emulator: Callable[[], Any]  # the emulated namespace (imports the emulator module)

    def unavailable_reason(self, device: torch.device | str, emulate: bool) -> str | None:
        """None when the ops can run on ``device``; otherwise why not (a sentence)."""
        dt = device_type(device)
        if dt == self.native_device:
            return self.probe(device)
        if dt == EMULATED_DEVICE:
            if emulate:
                return None
            return (
                f"{self.kernels}; on 'cpu' the backend runs only through its emulator: "
                f"{EMULATE_HINT}"
            )
        return (
            f"device type {dt!r} is not supported (native: {self.native}; 'cpu' with "
            "emulate=True, through the CPU emulator)"
        )

    def is_emulated(self, device: torch.device | str) -> bool:
        return device_type(device) == EMULATED_DEVICE

    def namespace(self, device: torch.device | str, emulate: bool) -> Any:
        """The object whose attributes are the ops: the vendor's natively, else the emulator's.
        Raises BackendUnavailableError with the reason where neither can run."""
        why = self.unavailable_reason(device, emulate)
        if why is not None:
            raise BackendUnavailableError(self.backend, str(device), why)
        return self.load() if device_type(device) == self.native_device else self.emulator()
