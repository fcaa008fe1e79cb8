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
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import ModuleType

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


@dataclass
class HostOverhead:
    """Host time of the per-step and per-layer calls on a tiny shape, where kernels are cheap
    and the Python around them dominates (docs/backends/torch.md compares it with an engine's
    own attention backend)."""

    backend: str
    num_reqs: int
    build_us: float
    forward_us: float
    write_kv_us: float  # write_kv(..., meta=) of the step


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(10):
        fn()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls)
    return statistics.median(runs) * 1e6


def host_overhead(
    num_reqs: int, *, backend: str | None = None, device: str = "cpu", emulate: bool = False
) -> HostOverhead:
    """bf16, 8 query heads / 2 kv heads / head 64, block 128, decode of 300-token sequences: a
    tiny shape every in-repo backend serves, where kernels are cheap and host work shows."""
    spec = AttentionSpec(
        num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, block_size=128
    )
    be = select_backend(spec, device, prefer=backend, emulate=emulate)
    blocks = 3  # 300 tokens in blocks of 128
    cache = be.allocate_kv_cache(num_reqs * blocks + 1)
    table = (torch.randperm(num_reqs * blocks) + 1).view(num_reqs, blocks)
    batch = BatchMetadata.from_lengths([1] * num_reqs, [300] * num_reqs, table, 128, device)
    q = torch.randn(num_reqs, spec.num_heads, spec.head_size).to(device, torch.bfloat16)
    k = torch.randn(num_reqs, spec.num_kv_heads, spec.head_size).to(device, torch.bfloat16)
    builder, impl = be.metadata_builder(), be.impl()
    meta = builder.build(batch)
    return HostOverhead(
        backend=be.name,
        num_reqs=num_reqs,
        build_us=_per_call_us(lambda: builder.build(batch), 200),
        forward_us=_per_call_us(lambda: impl.forward(q, k, k, cache, meta), 50),
        # the engine path: the step's planned write (slots checked once per step)
        write_kv_us=_per_call_us(lambda: impl.write_kv(k, k, cache, meta=meta), 200),
    )
