"""Where the backend's functions come from: one of four FlashAttention providers, natively on an
NVIDIA GPU, or its CPU emulator when emulation is asked for.

  provider  module                  functions the backend calls
  vllm      vllm.vllm_flash_attn    flash_attn_varlen_func (fa_version=2); KV write:
            vllm._custom_ops        reshape_and_cache_flash
  vllm-fa3  the same modules        the same, fa_version=3 (s_aux sinks; Hopper)
  fa2       flash_attn              flash_attn_varlen_func, flash_attn_with_kvcache
  fa3       flash_attn_interface    flash_attn_with_kvcache (page_table, varlen q)
  fa4       flash_attn.cute         flash_attn_varlen_func (page_table + seqused_k)

Which provider the ``flash`` backend uses is decided once, at discovery: ``ATTNHUB_FLASH_PROVIDER``
(``vllm``, ``vllm-fa3``, ``fa2``, ``fa3``, ``fa4``) when set, else the first importable of
``PREFERENCE``
(probed with ``importlib.util.find_spec``: nothing is imported), else ``vllm`` (what engines ship;
on a machine without any, the emulated default).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from attnhub.backend import device_type
from attnhub.emulation import emulate_hint
from attnhub.errors import BackendUnavailableError, InvalidInputError

PROVIDERS = ("vllm", "vllm-fa3", "fa2", "fa3", "fa4")
#: Best first when several are importable: FA4 and FA3 are the newer kernels; vLLM's fork ships
#: with engines; upstream FA2 last. ``vllm-fa3`` only when named: whether vLLM's build holds
#: its FA3 kernels is known only by importing it.
PREFERENCE = ("fa4", "fa3", "vllm", "fa2")
ENV = "ATTNHUB_FLASH_PROVIDER"
DEFAULT = "vllm"

NATIVE_DEVICE = "cuda"
EMULATED_DEVICE = "cpu"
#: How to ask for the emulator, in the API's terms: ``attnhub`` commands and the conformance
#: suite show it in theirs (attnhub.emulation.in_terms_of).
EMULATE_HINT = emulate_hint()


@dataclass(frozen=True)
class Source:
    """Where one provider's functions live."""

    attention: str  # module holding the attention functions
    cache_ops: str | None  # module holding reshape_and_cache_flash (vLLM only)
    distribution: str  # what to pip install
    #: the lowest compute capability (major) the provider runs on, and the highest (None: any)
    min_major: int
    max_major: int | None


SOURCES: dict[str, Source] = {
    "vllm": Source("vllm.vllm_flash_attn", "vllm._custom_ops", "vllm", 8, None),
    "vllm-fa3": Source("vllm.vllm_flash_attn", "vllm._custom_ops", "vllm", 9, 9),
    "fa2": Source("flash_attn", None, "flash-attn", 8, None),
    # hopper/ builds as the top-level module flash_attn_interface [doc: hopper/README]
    "fa3": Source("flash_attn_interface", None, "flash-attn (hopper/ build)", 9, 9),
    "fa4": Source("flash_attn.cute", None, "flash-attn-4", 9, None),
}


def _spec_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def chosen_provider() -> str:
    """The provider the ``flash`` backend serves with (env, else best importable, else vllm)."""
    name = os.environ.get(ENV, "").strip().lower()
    if name:
        if name not in PROVIDERS:
            raise InvalidInputError(
                f"{ENV}={name!r} is not a FlashAttention provider (one of {', '.join(PROVIDERS)})"
            )
        return name
    for candidate in PREFERENCE:
        if _spec_exists(SOURCES[candidate].attention):
            return candidate
    return DEFAULT


@functools.cache
def _import(module: str) -> tuple[ModuleType | None, str | None]:
    """Import once per process: (module, None) or (None, why it failed); any exception counts
    as "not importable" (a CUDA build that does not load), never as a crash."""
    try:
        return importlib.import_module(module), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def unavailable_reason(provider: str, device: torch.device | str, emulate: bool) -> str | None:
    """None when ``provider`` can run on ``device``; otherwise why not (a sentence)."""
    src = SOURCES[provider]
    dt = device_type(device)
    if dt == NATIVE_DEVICE:
        for module in (src.attention, src.cache_ops):
            if module is None:
                continue
            found, error = _import(module)
            if found is None:
                return (
                    f"provider {provider!r}: {module} is not importable (pip install "
                    f"{src.distribution}): {error}; set {ENV} to another provider, or on a "
                    f"machine without an NVIDIA GPU use device 'cpu' and {EMULATE_HINT}"
                )
        if not torch.cuda.is_available():
            return "no CUDA device is visible (torch.cuda.is_available() is False)"
        major, minor = torch.cuda.get_device_capability(torch.device(device))
        if major < src.min_major or (src.max_major is not None and major > src.max_major):
            top = "" if src.max_major is None else f" to {src.max_major}.x"
            return (
                f"provider {provider!r} runs on compute capability {src.min_major}.x{top}; "
                f"this GPU is {major}.{minor}"
            )
        if provider == "vllm-fa3":
            fork, _ = _import(src.attention)
            why = fork.fa_version_unsupported_reason(3, torch.device(device))  # type: ignore[union-attr]
            if why:
                return f"provider 'vllm-fa3': vLLM's fork says {why}"
        return None
    if dt == EMULATED_DEVICE:
        if emulate:
            return None
        return (
            "FlashAttention kernels run on device 'cuda'; on 'cpu' the backend runs only "
            f"through its emulator: {EMULATE_HINT}"
        )
    return (
        f"device type {dt!r} is not supported (native: 'cuda'; 'cpu' with emulate=True, "
        "through the CPU emulator)"
    )


@dataclass(frozen=True)
class ProviderOps:
    """The two namespaces the backend calls into: attention functions and (vLLM) cache ops."""

    provider: str
    attention: Any
    cache_ops: Any | None
    emulated: bool


def resolve(provider: str, device: torch.device | str, emulate: bool) -> ProviderOps:
    """The real modules natively, else the emulator's namespaces. Call after
    ``unavailable_reason`` returned None; resolved once per backend instance."""
    why = unavailable_reason(provider, device, emulate)
    if why is not None:
        raise BackendUnavailableError("flash", str(device), why)
    src = SOURCES[provider]
    if device_type(device) == NATIVE_DEVICE:
        attention, _ = _import(src.attention)
        cache_ops = None if src.cache_ops is None else _import(src.cache_ops)[0]
        return ProviderOps(provider, attention, cache_ops, emulated=False)
    from attnhub_flash import emulator

    namespaces = {
        "vllm": (emulator.VLLM, emulator.VLLM_CACHE_OPS),
        "vllm-fa3": (emulator.VLLM, emulator.VLLM_CACHE_OPS),
        "fa2": (emulator.FA2, None),
        "fa3": (emulator.FA3, None),
        "fa4": (emulator.FA4, None),
    }
    emulated_attention, emulated_cache_ops = namespaces[provider]
    return ProviderOps(provider, emulated_attention, emulated_cache_ops, emulated=True)


def is_emulated(device: torch.device | str) -> bool:
    return device_type(device) == EMULATED_DEVICE
