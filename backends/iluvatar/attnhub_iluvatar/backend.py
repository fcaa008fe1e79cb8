"""The ``iluvatar`` backend: attnhub's protocol translated into ``ixformer``'s calling conventions.

Per step, the builder does every host-side thing once (FlashInfer's ``plan``): it splits the
leading decodes (query_len <= ``reorder_batch_threshold``) from the prefills that follow and
gives each part the arguments its kernel takes: sub-block tables, cumulative offsets re-based
to 0, maximum lengths, all from the batch's host copies. Per layer, the impl makes one KV write
and at most two attention calls, with no loop over requests and no host read of a device tensor:

  KV write       inference.functions.reshape_and_cache_flash   HND cache, int64 slots, -1 skipped
  decodes        contrib.vllm_flash_attn.flash_attn_with_kvcache
                   one token each: q (B, 1, H, D), cache_seqlens, block_table
                   multi-token:    q (T, H, D) packed, cu_query_lens, max_query_len [callers]
  prefills       contrib.vllm_flash_attn.flash_attn_varlen_func
                   paged (block_table), cu_seqlens_q / cu_seqlens_k cumulative from 0
  non-causal     the whole step through flash_attn_varlen_func with causal=False
  shared prefix  (cascade) flash_attn_varlen_func twice (prefix, non-causal, all queries as one
                   sequence; suffix, causal) with base-2 LSEs, then
                   inference.functions.merge_attn_states

Every ``[inferred]`` vendor semantic relied on is marked where it is used and listed in
docs/backends/iluvatar.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from attnhub.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
)
from attnhub.batch import BatchMetadata, as_contiguous
from attnhub.capabilities import AccuracyBound, Capabilities, GraphSupport, Refusal, Tolerance
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.kv_cache import PagedKVCache
from attnhub.quant import QueryQuantization
from attnhub.spec import AttentionSpec, AttentionType
from attnhub_iluvatar import ops

#: Head sizes ixformer's attention kernels are built for [inferred: what Iluvatar's vLLM
#: backend reports as supported].
HEAD_SIZES = frozenset({32, 64, 80, 96, 128, 160, 192, 224, 256})
BLOCK_ALIGN = 16  # the HND cache's block_size must be a multiple of 16 [callers]
#: The declared accuracy of modes 1 and 2 against attention over the unquantized inputs (max abs
#: error, min per-token cosine similarity). Measured through the emulator on the conformance
#: suite's accuracy cases, full scope (every batch shape, bf16 and fp16, N(0, 1) inputs):
#: int8 0.0430 / 0.99983, int8_k 0.0359 / 0.99989 (docs/backends/iluvatar.md); declared with
#: about 40% headroom on the error and 1.5-3x on 1 - cosine.
INT8_MAX_ABS, INT8_MIN_COS = 0.06, 0.9995
INT8_K_MAX_ABS, INT8_K_MIN_COS = 0.05, 0.9997


_MAX = np.maximum.reduce  # ufunc.reduce directly: ndarray.max() adds a Python wrapper


def _device_int32(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host lengths (numpy, or a host tensor) as an int32 device tensor of their own (a copy:
    never a view of an engine's host buffer)."""
    return torch.from_numpy(np.asarray(values).astype(np.int32)).to(device)


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:  # [n + 1] int64, host
    ends = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths.to(torch.int64), 0, out=ends[1:])
    return ends


@dataclass(frozen=True)
class DecodePlan:
    """The leading decodes of a step: one ``flash_attn_with_kvcache`` call."""

    num_reqs: int
    num_tokens: int  # their query tokens: rows 0..num_tokens-1
    max_query_len: int
    max_seq_len: int  # max_context_len
    seq_lens: torch.Tensor  # [num_reqs] int32, device: cache_seqlens (keys incl. the new ones)
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, device
    #: Multi-token decode: [num_reqs + 1] int32 cumulative query ends, q passed packed. None:
    #: every decode has one token and q goes as (B, 1, H, D).
    cu_query_lens: torch.Tensor | None
    #: The call's keyword arguments that are the same for every layer of a backend, made by
    #: the first layer and reused by the others (keyed by the backend; see ``step_kwargs``).
    kwargs: dict[Any, dict[str, Any]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )


@dataclass(frozen=True)
class PrefillPlan:
    """The requests after the decodes (the whole step when it is non-causal): one
    ``flash_attn_varlen_func`` call over the paged cache."""

    num_reqs: int
    token_start: int  # their first query row
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] int32, device, re-based to 0
    cu_seqlens_k: torch.Tensor  # [num_reqs + 1] int32, device: cumulative seq_lens
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, device
    #: As ``DecodePlan.kwargs``.
    kwargs: dict[Any, dict[str, Any]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )


@dataclass(frozen=True)
class CascadePlan:
    """A shared prefix of ``prefix_len`` keys (whole blocks) attended once for all queries."""

    prefix_len: int
    num_tokens: int
    cu_prefix_q: torch.Tensor  # [2] int32 (0, num_tokens): every query as one sequence
    cu_prefix_k: torch.Tensor  # [2] int32 (0, prefix_len)
    prefix_block_table: torch.Tensor  # [1, prefix_len / block_size] int32
    max_query_len: int
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] int32: query_start_loc
    cu_suffix_k: torch.Tensor  # [num_reqs + 1] int32: cumulative seq_len - prefix_len
    max_suffix_len: int
    suffix_block_table: torch.Tensor  # [num_reqs, max_blocks - prefix blocks] int32


@dataclass(frozen=True)
class PagedPlan:
    """Rows of the step served by the int8 caches' single-query paged kernels
    (``vllm_paged_attention_int8`` / ``_mix``): one query per kernel sequence.

    Mode 1 sends its one-token decodes here. Mode 2 has no varlen kernel [callers list none],
    so every query token is its own kernel sequence over its request's block table row, with
    ``context_lens`` = its position + 1 (causal: the query sits at the last key, which is
    bottom-right alignment) or the request's seq_len (non-causal, no window).
    """

    token_start: int
    num_tokens: int
    causal: bool
    context_lens: torch.Tensor  # [num_tokens] int32, device
    block_table: torch.Tensor  # [num_tokens, max_blocks] int32, device
    max_context_len: int


@dataclass(frozen=True)
class IluvatarAttentionMetadata(AttentionMetadata):
    """One step, planned: every argument of the kernels, ready to pass."""

    num_actual_tokens: int = 0
    causal: bool = True
    slot_mapping: torch.Tensor | None = None  # [num_actual_tokens] int64, device
    decode: DecodePlan | None = None
    prefill: PrefillPlan | None = None
    cascade: CascadePlan | None = None
    paged: PagedPlan | None = None  # int8 caches
    #: int8 caches, decode-only step: the KV write rides on the paged kernel (save_*), which
    #: writes each sequence's new token at position context_len - 1.
    fused_write: bool = False


class IluvatarBackend(AttentionBackend):
    name = "iluvatar"
    capabilities = Capabilities(
        devices=frozenset({"cuda", "cpu"}),  # cuda: a CoreX GPU; cpu: the emulator only
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_sizes=HEAD_SIZES,
        block_size_multiple=BLOCK_ALIGN,
        # auto: ixformer's mode 0 (model-dtype cache); int8: mode 1 (int8 Q, K, V); int8_k:
        # mode 2 (int8 Q and K, V in the model dtype, one packed int8 storage).
        kv_cache_dtypes=frozenset({"auto", "int8", "int8_k"}),
        kv_cache_layout="HND",
        # The kernels index each plane as a contiguous HND tensor [inferred]; an engine lays
        # K and V out as two planes.
        strided_kv_cache=False,
        attn_types=frozenset(AttentionType),
        sliding_window=True,
        softcap=True,
        alibi=True,
        sinks=False,
        multi_token_decode=True,
        chunked_prefill=True,
        cascade=True,
        # Not implemented: capture needs the decode kernel's use_cuda_graph path and fixed
        # buffers for the per-step tensors, which attnhub's graph runner does not drive yet.
        graph_capture=GraphSupport.NEVER,
        # The kernels accumulate in float32 with float16/bfloat16 operands (the probabilities
        # rounded to the input dtype before P @ V, as flash-attention does); the emulator
        # computes in float32 and rounds once.
        tolerances={
            torch.float16: Tolerance(atol=3e-3, rtol=3e-3),
            torch.bfloat16: Tolerance(atol=1.6e-2, rtol=1.6e-2),
        },
        priority={"cuda": 100},
        # Modes 1 and 2 quantize the query inside forward, per (token, head), as their kernels
        # take int8 queries [callers].
        query_quantization={
            "int8": QueryQuantization.INT8_PER_TOKEN_HEAD.value,
            "int8_k": QueryQuantization.INT8_PER_TOKEN_HEAD.value,
        },
        # Measured on the conformance suite's standard cases (docs/backends/iluvatar.md) and
        # rounded up: the largest error seen and the smallest per-token cosine similarity.
        quantization_accuracy={
            "int8": AccuracyBound(max_abs_error=INT8_MAX_ABS, min_cosine=INT8_MIN_COS),
            "int8_k": AccuracyBound(max_abs_error=INT8_K_MAX_ABS, min_cosine=INT8_K_MIN_COS),
        },
    )

    @classmethod
    def availability(cls, device: torch.device | str, emulate: bool = False) -> str | None:
        return ops.unavailable_reason(device, emulate)

    @classmethod
    def is_emulated(cls, device: torch.device | str) -> bool:
        return ops.is_emulated(device)

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec) -> list[Refusal]:
        reasons = [
            r.because(_WHY[r.field]) if r.field in _WHY else r
            for r in super().unsupported_reasons(spec)
        ]
        if spec.kv_cache_dtype == "int8_k" and not spec.causal:
            for feature, used, value in (
                ("sliding_window", spec.has_window, spec.window),
                ("alibi", spec.use_alibi, True),
            ):
                if used:
                    reasons.append(
                        Refusal(
                            f"{feature.replace('_', ' ')} on a non-causal layer is not supported "
                            "with kv_cache_dtype 'int8_k' (its single-query paged kernel aligns "
                            "each query with its last key, so position-dependent terms would "
                            "use the wrong query position)",
                            field=feature,
                            value=value,
                        )
                    )
        return reasons

    def __init__(
        self, spec: AttentionSpec, device: torch.device | str = "cpu", *, emulate: bool = False
    ) -> None:
        super().__init__(spec, device, emulate=emulate)
        #: ixformer or the emulator, resolved once for this instance.
        self.ops: Any = ops.namespace(self.device, emulate)

    def allocate_kv_cache(self, num_blocks: int) -> PagedKVCache:
        """A zeroed HND cache; for ``int8_k`` (ixformer's mode 2) one packed int8 storage
        ``(3, num_blocks, Hkv, block_size, D)`` whose plane 0 is the key and whose planes 1-2,
        their bytes read as 16-bit values, are the value ``(num_blocks, Hkv, block_size, D)``
        [callers]; the per-slot key scales are a float32 ``(num_blocks, Hkv, block_size)``."""
        spec = self.spec
        if spec.kv_cache_dtype != "int8_k":
            return super().allocate_kv_cache(num_blocks)
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise InvalidInputError(f"num_blocks = {num_blocks!r} must be a positive int")
        shape = (num_blocks, spec.num_kv_heads, spec.block_size, spec.head_size)
        storage = torch.zeros((3, *shape), dtype=torch.int8, device=self.device)
        # planes 1-2 flattened, then read as 16-bit: a plain .view(dtype) of storage[1:] would
        # halve the last dim instead
        value = storage[1:].view(-1).view(spec.dtype).view(shape)
        return PagedKVCache(
            key=storage[0],
            value=value,
            block_size=spec.block_size,
            layout="HND",
            kv_cache_dtype="int8_k",
            key_scale=torch.zeros(shape[:3], dtype=torch.float32, device=self.device),
        )

    def metadata_builder(self) -> IluvatarMetadataBuilder:
        return IluvatarMetadataBuilder(self)

    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> IluvatarAttentionImpl:
        # int8 caches: the KV write of a decode-only step rides on the paged kernel
        quantized = self.spec.kv_cache_format.is_quantized
        cls = IluvatarInt8AttentionImpl if quantized else IluvatarAttentionImpl
        return cls(self, alibi_slopes=alibi_slopes, sinks=sinks)


#: Why the kernels refuse what Capabilities refuses, per refused field.
_WHY = {
    "sinks": "neither flash_attn_varlen_func nor flash_attn_with_kvcache takes sink logits",
    "head_size": "ixformer's attention kernels are built for these head sizes",
    "block_size": "the HND paged cache needs block_size a multiple of 16",
    "dtype": "the kernels take float16 and bfloat16",
    "kv_cache_dtype": "ixformer's caches hold the model dtype or int8",
}


class IluvatarMetadataBuilder(AttentionMetadataBuilder[IluvatarAttentionMetadata]):
    """Plans a step once for every layer: decode / prefill split, lengths, sub-tables."""

    backend: IluvatarBackend
    #: Leading requests with query_len <= this go to the decode kernel (multi-token decode up
    #: to this many tokens, through cu_query_lens).
    reorder_batch_threshold: ClassVar[int] = 16
    #: The step being planned: query lengths, sequence lengths, query starts (host, numpy).
    _lengths: tuple[np.ndarray, np.ndarray, np.ndarray]

    def plan(self, batch: BatchMetadata, common_prefix_len: int) -> IluvatarAttentionMetadata:
        self._lengths = self._host_lengths(batch)
        n = batch.num_actual_tokens
        causal = self.spec.causal and batch.causal
        common: dict[str, Any] = dict(
            batch=batch,
            common_prefix_len=common_prefix_len,
            num_actual_tokens=n,
            causal=causal,
            # Padding rows past num_actual_tokens are never handed to the write; the op itself
            # skips any slot < 0 among the rest.
            slot_mapping=batch.slot_mapping if batch.num_tokens == n else batch.slot_mapping[:n],
        )
        if batch.num_reqs == 0:
            return IluvatarAttentionMetadata(**common)
        kv = self.spec.kv_cache_dtype
        if kv == "int8_k":
            return IluvatarAttentionMetadata(
                **common,
                paged=self._per_token(batch, causal),
                fused_write=self._fusable(batch, causal),
            )
        if kv == "int8":
            nd = self._leading_decodes(batch, 1) if causal else 0
            return IluvatarAttentionMetadata(
                **common,
                paged=self._paged_decodes(batch, nd) if nd else None,
                prefill=self._prefill(batch, nd) if nd < batch.num_reqs else None,
                fused_write=self._fusable(batch, causal),
            )
        prefix = self._cascade_prefix(common_prefix_len, causal)
        if prefix:
            return IluvatarAttentionMetadata(**common, cascade=self._cascade(batch, prefix))
        num_decodes = self._leading_decodes(batch, self.reorder_batch_threshold) if causal else 0
        return IluvatarAttentionMetadata(
            **common,
            decode=self._decode(batch, num_decodes) if num_decodes else None,
            prefill=self._prefill(batch, num_decodes) if num_decodes < batch.num_reqs else None,
        )

    def _host_lengths(self, batch: BatchMetadata) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The step's query lengths [B], sequence lengths [B] and query start offsets [B + 1]
        on the host (numpy): as build's checks read them (``self.step``, taken once so that a
        later plan never reads another step's), else from the batch's host copies."""
        step, self.step = self.step, None
        if step is not None:
            q, seq, qsl = step.query_lens, step.seq_lens, step.query_start_locs
            if q is not None and seq is not None and qsl is not None:
                return q, seq, qsl
        qsl = batch.query_start_loc_cpu.numpy()
        return qsl[1:] - qsl[:-1], batch.seq_lens_cpu.numpy(), qsl

    def _leading_decodes(self, batch: BatchMetadata, threshold: int) -> int:
        """How many requests at the front have query_len <= ``threshold`` (host data).

        Engines send decodes first (``reorder_batch_threshold``); a decode after a prefill is
        served by the prefill call, which computes any request correctly."""
        if batch.max_query_len <= threshold:  # checked against the lengths by check_step
            return batch.num_reqs
        small = self._lengths[0] <= threshold
        return int(small.argmin())  # the first request over it (there is one)

    def _paged_decodes(self, batch: BatchMetadata, nd: int) -> PagedPlan:
        """Mode 1: the leading one-token decodes, one kernel sequence each."""
        return PagedPlan(
            token_start=0,
            num_tokens=nd,
            causal=True,
            context_lens=_device_int32(batch.seq_lens_cpu[:nd], self.backend.device),
            block_table=as_contiguous(batch.block_table[:nd]),
            max_context_len=int(batch.seq_lens_cpu[:nd].max()),
        )

    def _per_token(self, batch: BatchMetadata, causal: bool) -> PagedPlan:
        """Mode 2: every query token its own kernel sequence (see PagedPlan)."""
        dev = self.backend.device
        q_lens = batch.query_lens_cpu.to(torch.int64)
        seq_lens = batch.seq_lens_cpu.to(torch.int64)
        req = torch.repeat_interleave(torch.arange(batch.num_reqs), q_lens)  # [n] host
        if causal:
            offset = torch.arange(batch.num_actual_tokens) - batch.query_start_loc_cpu[req]
            lens = seq_lens[req] - q_lens[req] + offset + 1  # position + 1
        else:
            if self.spec.has_window or self.spec.use_alibi:
                raise UnsupportedConfigurationError(
                    self.backend.name,
                    [
                        "a non-causal step with a sliding window or ALiBi is not supported with "
                        "kv_cache_dtype 'int8_k' (the single-query kernel aligns each query with "
                        "its last key)"
                    ],
                )
            lens = seq_lens[req]
        return PagedPlan(
            token_start=0,
            num_tokens=batch.num_actual_tokens,
            causal=causal,
            context_lens=_device_int32(lens, dev),
            block_table=batch.block_table.index_select(0, req.to(dev)).to(torch.int32),
            max_context_len=int(lens.max()),
        )

    def _fusable(self, batch: BatchMetadata, causal: bool) -> bool:
        """int8 caches: whether the paged kernel can make the step's KV write (save_*): a
        causal decode-only step whose slots are the positions the kernel derives (seq_len - 1
        through the block table), checked on host copies."""
        if not causal or bool((batch.query_lens_cpu != 1).any()):
            return False
        bs = batch.block_size
        pos = batch.seq_lens_cpu.to(torch.int64) - 1
        table = batch.host_block_table().to(torch.int64)
        rows = torch.arange(batch.num_reqs)
        derived = table[rows, pos // bs] * bs + pos % bs
        slots = batch.host_slot_mapping()[: batch.num_actual_tokens].to(torch.int64)
        return bool(torch.equal(derived, slots))

    def _decode(self, batch: BatchMetadata, nd: int) -> DecodePlan:
        """The leading ``nd`` decodes: their rows of the batch's device lengths and table (no
        host copy), maxima from the host lengths build's checks read."""
        if nd == batch.num_reqs:  # the whole step: lengths and maxima as the batch holds them
            max_q = batch.max_query_len
            return DecodePlan(
                num_reqs=nd,
                num_tokens=batch.num_actual_tokens,
                max_query_len=max_q,
                max_seq_len=batch.max_seq_len,
                seq_lens=as_contiguous(batch.seq_lens),
                block_table=as_contiguous(batch.block_table),
                cu_query_lens=None if max_q == 1 else as_contiguous(batch.query_start_loc),
            )
        q_lens, seq_lens, qsl = self._lengths
        num_tokens = int(qsl[nd])
        # as many tokens as decodes: every one has one token (none has 0: a request has one)
        max_q = 1 if num_tokens == nd else int(_MAX(q_lens[:nd]))
        return DecodePlan(
            num_reqs=nd,
            num_tokens=num_tokens,
            max_query_len=max_q,
            max_seq_len=int(_MAX(seq_lens[:nd])),
            seq_lens=as_contiguous(batch.seq_lens[:nd]),
            block_table=as_contiguous(batch.block_table[:nd]),
            # the decodes lead: their query ends are the batch's first nd + 1, from 0
            cu_query_lens=None if max_q == 1 else as_contiguous(batch.query_start_loc[: nd + 1]),
        )

    def _prefill(self, batch: BatchMetadata, nd: int) -> PrefillPlan:
        """The requests from ``nd`` on: their query ends re-based to 0 and their cumulative KV
        lengths, from the host lengths build's checks read; their rows of the batch's device
        table. The whole step (no decodes before them): the batch's query ends as they are."""
        dev = self.backend.device
        _, all_seq_lens, all_qsl = self._lengths
        seq_lens = all_seq_lens[nd:]
        cu_k = np.zeros(seq_lens.size + 1, dtype=np.int32)
        np.add.accumulate(seq_lens, out=cu_k[1:])  # int32: check_step bounds every length
        if nd:
            start = int(all_qsl[nd])
            cu_q = _device_int32(all_qsl[nd:] - start, dev)
            table = batch.block_table[nd:]
        else:
            start, cu_q, table = 0, as_contiguous(batch.query_start_loc), batch.block_table
        return PrefillPlan(
            num_reqs=batch.num_reqs - nd,
            token_start=start,
            num_tokens=int(all_qsl[-1]) - start,
            # the longest query is a prefill's: every decode before them is <= the threshold,
            # and the first prefill is over it (checked against the lengths by check_step)
            max_query_len=batch.max_query_len,
            max_seq_len=int(_MAX(seq_lens)),
            cu_seqlens_q=cu_q,
            cu_seqlens_k=torch.from_numpy(cu_k).to(dev),
            block_table=as_contiguous(table),
        )

    def _cascade_prefix(self, common_prefix_len: int, causal: bool) -> int:
        """The keys the cascade path shares: common_prefix_len rounded down to whole blocks
        (the prefix call reads whole blocks of the first request's table). 0 (the regular
        path, same result) for non-causal steps, for the int8 caches (no int8 kernel returns an
        LSE), and where the prefix call cannot reproduce the per-request math: a sliding window
        or ALiBi depend on each query's own position."""
        if not common_prefix_len:  # the usual step: no shared prefix
            return 0
        spec = self.spec
        if not causal or spec.has_window or spec.use_alibi or spec.kv_cache_format.is_quantized:
            return 0
        return common_prefix_len // spec.block_size * spec.block_size

    def _cascade(self, batch: BatchMetadata, prefix: int) -> CascadePlan:
        dev = self.backend.device
        n = batch.num_actual_tokens
        prefix_blocks = prefix // self.spec.block_size
        suffix = batch.seq_lens_cpu - prefix
        return CascadePlan(
            prefix_len=prefix,
            num_tokens=n,
            cu_prefix_q=_device_int32(np.array([0, n]), dev),
            cu_prefix_k=_device_int32(np.array([0, prefix]), dev),
            prefix_block_table=as_contiguous(batch.block_table[:1, :prefix_blocks]),
            max_query_len=batch.max_query_len,
            cu_seqlens_q=_device_int32(batch.query_start_loc_cpu, dev),
            cu_suffix_k=_device_int32(_cumulative(suffix), dev),
            max_suffix_len=int(suffix.max()),
            suffix_block_table=as_contiguous(batch.block_table[:, prefix_blocks:]),
        )


class IluvatarAttentionImpl(AttentionImpl):
    """One layer: one KV write, then the decode and prefill calls the builder planned."""

    backend: IluvatarBackend

    def __init__(
        self,
        backend: IluvatarBackend,
        *,
        alibi_slopes: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        super().__init__(backend, alibi_slopes=alibi_slopes, sinks=sinks)
        spec = self.spec
        self.softcap = spec.logits_soft_cap or 0.0
        # window_size follows flash-attn: (left, right) keys around the query's aligned
        # position, -1 unbounded; attnhub's normalized pair is exactly that [callers].
        self.causal_window = (spec.window[0], 0) if spec.has_window else (-1, -1)
        self.full_window = spec.window
        #: The static V scale whose values were last found finite: (data_ptr, version).
        self._checked_value_scale: tuple[int, int] | None = None
        self._int8 = spec.kv_cache_dtype == "int8"

    def check_step(self, cache: PagedKVCache, meta: AttentionMetadata) -> None:
        if not isinstance(meta, IluvatarAttentionMetadata):
            raise InvalidInputError(
                f"meta must come from the iluvatar backend's metadata_builder().build(batch), "
                f"got {type(meta).__name__}"
            )
        self._check_scales(cache)

    def _check_scales(self, cache: PagedKVCache) -> None:
        """The int8 caches' scale planes as the kernels read them: the per-slot key scales
        float32 ``(num_blocks, Hkv, block_size)``, mode 1's static value scale float32
        ``(Hkv, head_size)`` and finite (a NaN or infinite scale would be written into every
        value quantized with it), each contiguous on the backend's device. The value scale's
        values are read on the host once per change of that tensor (its torch version
        counter and storage): an engine sets it with the weights, so steps read nothing."""
        kv = self.spec.kv_cache_dtype
        if kv == "auto":
            return
        spec, dev = self.spec, self.backend.device
        planes: list[tuple[str, torch.Tensor | None, tuple[int, ...]]] = [
            ("key_scale", cache.key_scale, (cache.num_blocks, spec.num_kv_heads, spec.block_size))
        ]
        if kv == "int8":
            planes.append(("value_scale", cache.value_scale, (spec.num_kv_heads, spec.head_size)))
        for name, plane, shape in planes:
            if not isinstance(plane, torch.Tensor):
                raise InvalidInputError(
                    f"kv_cache_dtype {kv!r} needs cache.{name}, a float32 tensor {shape}; got "
                    f"{type(plane).__name__}"
                )
            if plane.dtype != torch.float32 or tuple(plane.shape) != shape:
                raise InvalidInputError(
                    f"cache.{name} must be float32 {shape} for kv_cache_dtype {kv!r}, got "
                    f"{plane.dtype} {tuple(plane.shape)}"
                )
            if not plane.is_contiguous() or plane.device != dev:
                raise InvalidInputError(
                    f"cache.{name} must be contiguous on {dev}, got strides {plane.stride()} "
                    f"on {plane.device}"
                )
        if kv != "int8":
            return
        scale = cache.value_scale
        assert scale is not None
        seen = (scale.data_ptr(), scale._version)
        if seen == self._checked_value_scale:
            return
        bad = ~torch.isfinite(scale)
        if bool(bad.any()):
            h, d = (int(i) for i in bad.nonzero()[0])
            raise InvalidInputError(
                f"cache.value_scale[{h}, {d}] = {float(scale[h, d])} is not finite: the static "
                f"value scale of kv_cache_dtype 'int8' must be finite ({int(bad.sum())} entries "
                "are not)"
            )
        self._checked_value_scale = seen

    # --- KV write ---------------------------------------------------------------------------
    def store_kv(
        self,
        key: torch.Tensor,  # [>= n, num_kv_heads, head_size]
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,  # [n] int32/int64, -1 = padding
    ) -> None:
        self._check_scales(cache)  # write_kv without meta= (check_step is not called)
        n = slot_mapping.shape[0]
        if n:
            self._write(key[:n], value[:n], cache, slot_mapping)

    def store_step_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> None:
        assert isinstance(meta, IluvatarAttentionMetadata) and meta.slot_mapping is not None
        n = meta.num_actual_tokens
        if n:
            if key.shape[0] != n:  # padding rows past the step's tokens
                key, value = key[:n], value[:n]
            self._write(key, value, cache, meta.slot_mapping)

    def _write(
        self, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache, slots: torch.Tensor
    ) -> None:
        # Each op writes slot_mapping.size(0) tokens into the HND cache, skipping slots < 0
        # [callers]; the int8 ones take keys already quantized per (token, kv head) with their
        # scales, and mode 1's values quantized with the static per-channel scale [inferred].
        fn = self.backend.ops.inference.functions
        kv = self.spec.kv_cache_dtype
        if kv == "auto":
            fn.reshape_and_cache_flash(key, value, cache.key, cache.value, slots, "auto")
            return
        qk, k_scale, v = self._quantize_kv(key, value, cache)
        write = fn.reshape_and_cache_flash_int8 if kv == "int8" else fn.reshape_and_cache_flash_mix
        write(qk, v, k_scale, cache.key, cache.value, cache.key_scale, slots, "int8")

    def _quantize_kv(
        self, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int8 keys and their [T, Hkv] scales; values as the cache stores them (mode 1: int8
        with the cache's static value_scale; mode 2: unchanged)."""
        fn = self.backend.ops.inference.functions
        qk, k_scale = fn.scaled_int8_quant_for_attn(key, 2)
        if self.spec.kv_cache_dtype == "int8":
            value, _ = fn.scaled_int8_quant_for_attn(value, 0, scale=cache.value_scale)
        return qk, k_scale, value

    # --- attention ----------------------------------------------------------------------------
    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,  # [num_tokens, num_heads, head_size]
    ) -> None:
        assert isinstance(meta, IluvatarAttentionMetadata)
        if meta.paged is not None:
            self._attend_paged(query, cache, meta.paged, out)
        if self._int8 and meta.prefill is not None:
            self._attend_prefill_int8(query, cache, meta.prefill, meta.causal, out)
            return
        if meta.cascade is not None:
            self._attend_cascade(query, cache, meta.cascade, out)
            return
        if meta.decode is not None:
            self._attend_decode(query, cache, meta.decode, out)
        if meta.prefill is not None:
            self._attend_prefill(query, cache, meta.prefill, meta.causal, out)

    def _shared(self) -> dict[str, Any]:
        return dict(
            softmax_scale=self.spec.scale,
            softcap=self.softcap,
            alibi_slopes=self.alibi_slopes,
        )

    def _attend_decode(
        self, query: torch.Tensor, cache: PagedKVCache, plan: DecodePlan, out: torch.Tensor
    ) -> None:
        t = plan.num_tokens
        if query.shape[0] != t:  # prefills or padding follow (out is like query)
            query, out = query[:t], out[:t]
        if plan.cu_query_lens is None:  # one token each: (B, 1, H, D)
            query, out = query.unsqueeze(1), out.unsqueeze(1)
        # else multi-token decode: packed (T, H, D) with cumulative query ends [callers]
        step = plan.kwargs.get(self.backend)
        if step is None:
            step = plan.kwargs[self.backend] = self._decode_kwargs(plan)
        self.backend.ops.contrib.vllm_flash_attn.flash_attn_with_kvcache(
            query, cache.key, cache.value, out=out, alibi_slopes=self.alibi_slopes, **step
        )

    def _decode_kwargs(self, plan: DecodePlan) -> dict[str, Any]:
        """flash_attn_with_kvcache's keyword arguments but the layer's (out, ALiBi slopes)."""
        kwargs: dict[str, Any] = dict(
            cache_seqlens=plan.seq_lens,
            block_table=plan.block_table,
            causal=True,
            window_size=self.causal_window,
            max_context_len=plan.max_seq_len,
            use_sqrt_alibi=False,
            softmax_scale=self.spec.scale,
            softcap=self.softcap,
        )
        if plan.cu_query_lens is not None:
            kwargs.update(max_query_len=plan.max_query_len, cu_query_lens=plan.cu_query_lens)
        return kwargs

    def _attend_prefill(
        self,
        query: torch.Tensor,
        cache: PagedKVCache,
        plan: PrefillPlan,
        causal: bool,
        out: torch.Tensor,
    ) -> None:
        start, t = plan.token_start, plan.num_tokens
        if start or query.shape[0] != t:  # decodes before them, or padding after
            query, out = query[start : start + t], out[start : start + t]
        step = plan.kwargs.get(self.backend)
        if step is None:
            step = plan.kwargs[self.backend] = self._prefill_kwargs(plan, causal)
        self.backend.ops.contrib.vllm_flash_attn.flash_attn_varlen_func(
            query, cache.key, cache.value, out=out, alibi_slopes=self.alibi_slopes, **step
        )

    def _prefill_kwargs(self, plan: PrefillPlan, causal: bool) -> dict[str, Any]:
        """flash_attn_varlen_func's keyword arguments but the layer's (out, ALiBi slopes)."""
        return dict(
            cu_seqlens_q=plan.cu_seqlens_q,
            cu_seqlens_k=plan.cu_seqlens_k,  # cumulative, also with the paged cache [callers]
            max_seqlen_q=plan.max_query_len,
            max_seqlen_k=plan.max_seq_len,
            causal=causal,
            window_size=self.causal_window if causal else self.full_window,
            block_table=plan.block_table,
            sqrt_alibi=False,
            softmax_scale=self.spec.scale,
            softcap=self.softcap,
        )

    def _attend_cascade(
        self, query: torch.Tensor, cache: PagedKVCache, plan: CascadePlan, out: torch.Tensor
    ) -> None:
        fa = self.backend.ops.contrib.vllm_flash_attn
        q = query[: plan.num_tokens]
        shared = dict(sqrt_alibi=False, return_softmax_lse=True, **self._shared())
        # The prefix: every query token of the step, as one sequence, over the shared keys;
        # every key of the prefix precedes every query, so non-causal is exact.
        prefix_out, prefix_lse = fa.flash_attn_varlen_func(
            q,
            cache.key,
            cache.value,
            cu_seqlens_q=plan.cu_prefix_q,
            cu_seqlens_k=plan.cu_prefix_k,
            max_seqlen_q=plan.num_tokens,
            max_seqlen_k=plan.prefix_len,
            causal=False,
            block_table=plan.prefix_block_table,
            **shared,
        )
        # The suffix: each request over its own keys after the prefix, causal (bottom-right).
        suffix_out, suffix_lse = fa.flash_attn_varlen_func(
            q,
            cache.key,
            cache.value,
            cu_seqlens_q=plan.cu_seqlens_q,
            cu_seqlens_k=plan.cu_suffix_k,
            max_seqlen_q=plan.max_query_len,
            max_seqlen_k=plan.max_suffix_len,
            causal=True,
            block_table=plan.suffix_block_table,
            **shared,
        )
        # Both LSEs are base 2, which ixformer's merge takes as they are [callers].
        self.backend.ops.inference.functions.merge_attn_states(
            prefix_out, prefix_lse, suffix_out, suffix_lse, output=out[: plan.num_tokens]
        )

    # --- the int8 caches ----------------------------------------------------------------------
    def _attend_paged(
        self,
        query: torch.Tensor,
        cache: PagedKVCache,
        plan: PagedPlan,
        out: torch.Tensor,
        save: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``vllm_paged_attention_int8`` (mode 1) / ``_mix`` (mode 2): Q quantized per (token,
        head), scales (T, H) [inferred: not transposed for the paged kernel]."""
        fn = self.backend.ops.inference.functions
        spec = self.spec
        rows = slice(plan.token_start, plan.token_start + plan.num_tokens)
        q, q_scale = fn.scaled_int8_quant_for_attn(query[rows], 2)
        left, right = self.causal_window if plan.causal else self.full_window
        saves: dict[str, Any] = {}
        if save is not None:
            qk, k_scale, v = self._quantize_kv(save[0], save[1], cache)
            saves = dict(save_key=qk, save_value=v, save_key_scale=k_scale)
        common: dict[str, Any] = dict(
            num_kv_heads=spec.num_kv_heads,
            scale=spec.scale,
            block_tables=plan.block_table,
            context_lens=plan.context_lens,
            block_size=spec.block_size,
            max_context_len=plan.max_context_len,
            alibi_slopes=self.alibi_slopes,
            causal=plan.causal,
            window_left=left,
            window_right=right,
            softcap=self.softcap,
            enable_cuda_graph=False,
            use_sqrt_alibi=False,
            **saves,
        )
        o = out[rows]
        if spec.kv_cache_dtype == "int8":
            fn.vllm_paged_attention_int8(
                o, q, cache.key, cache.value, q_scale, cache.key_scale, cache.value_scale, **common
            )
        else:
            fn.vllm_paged_attention_mix(
                o, q, cache.key, cache.value, q_scale, cache.key_scale, **common
            )

    def _attend_prefill_int8(
        self,
        query: torch.Tensor,
        cache: PagedKVCache,
        plan: PrefillPlan,
        causal: bool,
        out: torch.Tensor,
    ) -> None:
        """Mode 1's prefills: ``flash_attn_varlen_int8_func`` with Q quantized per (token,
        head), its scales passed transposed (H, T) [callers]."""
        fn = self.backend.ops.inference.functions
        rows = slice(plan.token_start, plan.token_start + plan.num_tokens)
        q, q_scale = fn.scaled_int8_quant_for_attn(query[rows], 2, transpose_scale=True)
        self.backend.ops.contrib.vllm_flash_attn.flash_attn_varlen_int8_func(
            q,
            cache.key,
            cache.value,
            q_scale,
            cache.key_scale,
            cache.value_scale,
            cu_seqlens_q=plan.cu_seqlens_q,
            cu_seqlens_k=plan.cu_seqlens_k,
            max_seqlen_q=plan.max_query_len,
            max_seqlen_k=plan.max_seq_len,
            softmax_scale=self.spec.scale,
            causal=causal,
            window_size=self.causal_window if causal else self.full_window,
            alibi_slopes=self.alibi_slopes,
            softcap=self.softcap,
            sqrt_alibi=False,
            out=out[rows],
            block_table=plan.block_table,
            output_dtype=self.spec.dtype,
        )


class IluvatarInt8AttentionImpl(IluvatarAttentionImpl):
    """A layer over an int8 cache (modes 1 and 2): on decode-only steps the KV write rides on
    the paged kernel. A class of its own so that a model-dtype cache's ``forward`` is the base
    class's, with no test of a fused write that cannot happen there."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As the base class; on the int8 caches' decode-only steps the KV write rides on the
        paged kernel (its ``save_*`` arguments) instead of a separate call."""
        fused = isinstance(meta, IluvatarAttentionMetadata) and meta.fused_write
        if not fused or key is None:
            return super().forward(query, key, value, cache, meta, output=output)
        out = self.check_forward(query, key, value, cache, meta, output)
        assert isinstance(meta, IluvatarAttentionMetadata) and meta.paged is not None
        assert value is not None
        n = meta.num_actual_tokens
        if self.clip_counter is not None:  # as the base class's forward counts its writes
            self.count_clipped(key, value, meta.batch.slot_mapping, cache)
        if out.shape[0] > n:
            out[n:].zero_()
        self._attend_paged(query, cache, meta.paged, out, save=(key[:n], value[:n]))
        return out
