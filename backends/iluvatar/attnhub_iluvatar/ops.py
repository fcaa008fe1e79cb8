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
vllm_paged_attention_mix}`` (which module holds which op: docs/backends/iluvatar.md).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from types import ModuleType
from typing import Any

import torch

from attnhub.backend import device_type
from attnhub.emulation import emulate_hint
from attnhub.errors import BackendUnavailableError

NATIVE_DEVICE = "cuda"
EMULATED_DEVICE = "cpu"
#: How to ask for the emulator, in the API's terms: ``attnhub`` commands and the conformance
#: suite show it in theirs (attnhub.emulation.in_terms_of).
EMULATE_HINT = emulate_hint()
#: The ixformer modules the backend calls into.
MODULES = ("ixformer.contrib.vllm_flash_attn", "ixformer.inference.functions")


@functools.cache
def _import_ixformer() -> tuple[ModuleType | None, str | None]:
    """Import ixformer's modules once per process: (the ``ixformer`` package, None) or
    (None, why not). Any exception counts as "not importable", never as a crash of discovery."""
    try:
        for name in MODULES:
            importlib.import_module(name)
        import ixformer  # type: ignore[import-not-found]
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return ixformer, None


def unavailable_reason(device: torch.device | str, emulate: bool) -> str | None:
    """None when the ops can run on ``device``; otherwise why not (a sentence)."""
    dt = device_type(device)
    if dt == NATIVE_DEVICE:
        module, error = _import_ixformer()
        if module is None:
            return (
                f"ixformer is not importable (it ships with Iluvatar's CoreX SDK, not on PyPI): "
                f"{error}; on a machine without a CoreX GPU, use device 'cpu' and {EMULATE_HINT}"
            )
        if not torch.cuda.is_available():
            return "ixformer imported but no GPU is visible (torch.cuda.is_available() is False)"
        return None
    if dt == EMULATED_DEVICE:
        if emulate:
            return None
        return (
            "Iluvatar kernels run on device 'cuda' (a CoreX GPU); on 'cpu' the backend runs "
            f"only through its emulator: {EMULATE_HINT}"
        )
    return (
        f"device type {dt!r} is not supported (native: 'cuda' with ixformer; 'cpu' with "
        "emulate=True, through the CPU emulator)"
    )


def namespace(device: torch.device | str, emulate: bool) -> Any:
    """The object whose attribute paths are the ops: ``ixformer`` natively, else the emulator.

    Call only after ``unavailable_reason`` returned None.
    """
    why = unavailable_reason(device, emulate)
    if why is not None:
        raise BackendUnavailableError("iluvatar", str(device), why)
    if device_type(device) == NATIVE_DEVICE:
        module, _ = _import_ixformer()
        return module
    from attnhub_iluvatar import emulator

    return emulator


def is_emulated(device: torch.device | str) -> bool:
    return device_type(device) == EMULATED_DEVICE


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
