"""Where the backend's ops come from: the real ``ixformer`` on an Iluvatar CoreX GPU, the CPU
emulator when emulation is asked for, nothing otherwise (with the reason).

Iluvatar GPUs present themselves to torch as CUDA devices (CoreX ships its own torch build), so
the native device type is ``cuda``: the backend is available there only where ``ixformer``
imports, i.e. on a CoreX machine. ``ixformer`` is not on PyPI and never a dependency.

Resolved once per backend instance (``IluvatarBackend.__init__``), never per call. Both
namespaces expose the same attribute paths: ``contrib.vllm_flash_attn.{flash_attn_varlen_func,
flash_attn_with_kvcache, flash_attn_varlen_int8_func, merge_attn_states}`` and
``inference.functions.{reshape_and_cache_flash, scaled_int8_quant_for_attn,
reshape_and_cache_flash_int8, reshape_and_cache_flash_mix, vllm_paged_attention_int8,
vllm_paged_attention_mix}`` (which module holds which op: docs/backends/iluvatar.md). The
device dispatch and its sentences are the kit's (``attnhub.kit.VendorLibrary``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from attnhub.kit import EMULATE_HINT, VendorLibrary, import_once

#: The ixformer modules the backend calls into.
MODULES = ("ixformer.contrib.vllm_flash_attn", "ixformer.inference.functions")


def _import_ixformer() -> tuple[Any, str | None]:
    """ixformer's modules, each imported once per process: (the ``ixformer`` package, None) or
    (None, why not)."""
    for name in (*MODULES, "ixformer"):
        module, error = import_once(name)
        if module is None:
            return None, error
    return module, None


def _probe(device: torch.device | str) -> str | None:
    """On a CoreX GPU (a CUDA device): None when ixformer imports and torch sees the GPU."""
    module, error = _import_ixformer()
    if module is None:
        return (
            f"ixformer is not importable (it ships with Iluvatar's CoreX SDK, not on PyPI): "
            f"{error}; on a machine without a CoreX GPU, use device 'cpu' and {EMULATE_HINT}"
        )
    if not torch.cuda.is_available():
        return "ixformer imported but no GPU is visible (torch.cuda.is_available() is False)"
    return None


def _emulator() -> Any:
    from attnhub_iluvatar import emulator

    return emulator


LIBRARY = VendorLibrary(
    backend="iluvatar",
    native_device="cuda",
    kernels="Iluvatar kernels run on device 'cuda' (a CoreX GPU)",
    native="'cuda' with ixformer",
    probe=_probe,
    load=lambda: _import_ixformer()[0],
    emulator=_emulator,
)


def unavailable_reason(device: torch.device | str, emulate: bool) -> str | None:
    """None when the ops can run on ``device``; otherwise why not (a sentence)."""
    return LIBRARY.unavailable_reason(device, emulate)


def namespace(device: torch.device | str, emulate: bool) -> Any:
    """The object whose attribute paths are the ops: ``ixformer`` natively, else the emulator."""
    return LIBRARY.namespace(device, emulate)


def is_emulated(device: torch.device | str) -> bool:
    return LIBRARY.is_emulated(device)


#: The attention entry points that take ``sinks=`` in Iluvatar's vLLM fork [callers].
SINK_OPS = ("flash_attn_varlen_func", "flash_attn_with_kvcache")


def missing_sinks_keyword(namespace: Any) -> str | None:
    """The first of ``SINK_OPS`` (under ``contrib.vllm_flash_attn``) whose signature shows no
    ``sinks`` parameter (nor ``**kwargs``), or None. The fork passes ``sinks=`` to both and
    gates non-None sinks behind ``flash_attn_supports_sinks()``; this is attnhub's version of
    that gate for an installed ixformer. A signature Python cannot read passes (the call
    itself then says)."""
    fa = namespace.contrib.vllm_flash_attn
    for name in SINK_OPS:
        try:
            params = inspect.signature(getattr(fa, name)).parameters
        except (TypeError, ValueError):
            continue
        kinds = {p.kind for p in params.values()}
        if "sinks" not in params and inspect.Parameter.VAR_KEYWORD not in kinds:
            return name
    return None
