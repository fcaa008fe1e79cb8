"""Where the backend's ops come from: the real ``torch_npu`` on an NPU, the CPU emulator when
emulation is asked for, nothing otherwise (with the reason).

Resolved once per backend instance (``AscendBackend.__init__``), never per call. Both namespaces
expose the same names: ``npu_fused_infer_attention_score`` (with ``.out``),
``npu_fused_infer_attention_score_v2`` (with ``.out``), ``npu_fusion_attention`` and
``_npu_reshape_and_cache`` (an ATB op that ``torch_npu`` attaches lazily to its module).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch

from attnhub.backend import device_type
from attnhub.emulation import emulate_hint
from attnhub.errors import BackendUnavailableError

NATIVE_DEVICE = "npu"
EMULATED_DEVICE = "cpu"
#: How to ask for the emulator, in the API's terms: ``attnhub`` commands and the conformance
#: suite show it in theirs (attnhub.emulation.in_terms_of).
EMULATE_HINT = emulate_hint()


@functools.cache
def _import_torch_npu() -> tuple[ModuleType | None, str | None]:
    """``import torch_npu`` once per process: (module, None) or (None, why it failed).

    Without the CANN toolkit the import fails (libhccl.so / libascendcl.so are not in the
    wheel); any exception counts as "not importable", never as a crash of discovery.
    """
    try:
        import torch_npu  # type: ignore[import-not-found]
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return torch_npu, None


def unavailable_reason(device: torch.device | str, emulate: bool) -> str | None:
    """None when the ops can run on ``device``; otherwise why not (a sentence)."""
    dt = device_type(device)
    if dt == NATIVE_DEVICE:
        module, error = _import_torch_npu()
        if module is None:
            return (
                f"torch_npu is not importable (needs the CANN toolkit): {error}; on a machine "
                f"without an NPU, use device 'cpu' and {EMULATE_HINT}"
            )
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            return "torch_npu imported but no NPU is visible (torch.npu.is_available() is False)"
        return None
    if dt == EMULATED_DEVICE:
        if emulate:
            return None
        return (
            "Ascend kernels run on device 'npu'; on 'cpu' the backend runs only through its "
            f"emulator: {EMULATE_HINT}"
        )
    return (
        f"device type {dt!r} is not supported (native: 'npu'; 'cpu' with emulate=True, "
        "through the CPU emulator)"
    )


def namespace(device: torch.device | str, emulate: bool) -> Any:
    """The module whose attributes are the ops: ``torch_npu`` natively, else the emulator.

    Call only after ``unavailable_reason`` returned None.
    """
    why = unavailable_reason(device, emulate)
    if why is not None:
        raise BackendUnavailableError("ascend", str(device), why)
    if device_type(device) == NATIVE_DEVICE:
        module, _ = _import_torch_npu()
        return module
    from attnhub_ascend import emulator

    return emulator


def graph_namespace(device: torch.device | str, emulate: bool) -> Any:
    """The graph API (NPUGraph, graph, task groups, streams, events): ``torch.npu`` natively
    (``import torch_npu`` patches it in), else the emulation in ``attnhub_ascend.npu_graph``.

    Call only after ``unavailable_reason`` returned None."""
    if device_type(device) == NATIVE_DEVICE:
        namespace(device, emulate)  # imports torch_npu (or raises why not)
        return torch.npu  # type: ignore[attr-defined]
    from attnhub_ascend import npu_graph

    return npu_graph


def is_emulated(device: torch.device | str) -> bool:
    return device_type(device) == EMULATED_DEVICE
