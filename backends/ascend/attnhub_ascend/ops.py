"""Where the backend's ops come from: the real ``torch_npu`` on an NPU, the CPU emulator when
emulation is asked for, nothing otherwise (with the reason).

Resolved once per backend instance (``AscendBackend.__init__``), never per call. Both namespaces
expose the same names: ``npu_fused_infer_attention_score`` (with ``.out``),
``npu_fused_infer_attention_score_v2`` (with ``.out``), ``npu_fusion_attention`` and
``_npu_reshape_and_cache`` (an ATB op that ``torch_npu`` attaches lazily to its module). The
device dispatch and its sentences are the kit's (``attnhub.kit.VendorLibrary``); this module
says how to probe and load ``torch_npu`` and the emulator.
"""

from __future__ import annotations

from typing import Any

import torch

from attnhub.kit import EMULATE_HINT, VendorLibrary, device_type, import_once


def _probe(device: torch.device | str) -> str | None:
    """On an NPU: None when ``torch_npu`` imports and sees a device. Without the CANN toolkit
    the import fails (libhccl.so / libascendcl.so are not in the wheel)."""
    module, error = import_once("torch_npu")
    if module is None:
        return (
            f"torch_npu is not importable (needs the CANN toolkit): {error}; on a machine "
            f"without an NPU, use device 'cpu' and {EMULATE_HINT}"
        )
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        return "torch_npu imported but no NPU is visible (torch.npu.is_available() is False)"
    return None


def _emulator() -> Any:
    from attnhub_ascend import emulator

    return emulator


LIBRARY = VendorLibrary(
    backend="ascend",
    native_device="npu",
    kernels="Ascend kernels run on device 'npu'",
    native="'npu'",
    probe=_probe,
    load=lambda: import_once("torch_npu")[0],
    emulator=_emulator,
)


def unavailable_reason(device: torch.device | str, emulate: bool) -> str | None:
    """None when the ops can run on ``device``; otherwise why not (a sentence)."""
    return LIBRARY.unavailable_reason(device, emulate)


def namespace(device: torch.device | str, emulate: bool) -> Any:
    """The module whose attributes are the ops: ``torch_npu`` natively, else the emulator."""
    return LIBRARY.namespace(device, emulate)


def graph_namespace(device: torch.device | str, emulate: bool) -> Any:
    """The graph API (NPUGraph, graph, task groups, streams, events): ``torch.npu`` natively
    (``import torch_npu`` patches it in), else the emulation in ``attnhub_ascend.npu_graph``.

    Call only after ``unavailable_reason`` returned None."""
    if device_type(device) == LIBRARY.native_device:
        namespace(device, emulate)  # imports torch_npu (or raises why not)
        return torch.npu  # type: ignore[attr-defined]
    from attnhub_ascend import npu_graph

    return npu_graph


def is_emulated(device: torch.device | str) -> bool:
    return LIBRARY.is_emulated(device)
