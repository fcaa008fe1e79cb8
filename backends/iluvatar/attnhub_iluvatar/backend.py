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

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from attnhub.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
)
from attnhub.batch import BatchMetadata
from attnhub.capabilities import Capabilities, GraphSupport, Refusal, Tolerance
from attnhub.errors import InvalidInputError
from attnhub.kv_cache import PagedKVCache
from attnhub.spec import AttentionSpec, AttentionType
from attnhub_iluvatar import ops

#: Head sizes ixformer's attention kernels are built for [inferred: what Iluvatar's vLLM
#: backend reports as supported].
HEAD_SIZES = frozenset({32, 64, 80, 96, 128, 160, 192, 224, 256})
BLOCK_ALIGN = 16  # the HND cache's block_size must be a multiple of 16 [callers]


def _int32(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor as an int32 device tensor (one host-to-device copy, in plan)."""
    return values.to(torch.int32).to(device)


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
class IluvatarAttentionMetadata(AttentionMetadata):
    """One step, planned: every argument of the kernels, ready to pass."""

    num_actual_tokens: int = 0
    causal: bool = True
    slot_mapping: torch.Tensor | None = None  # [num_actual_tokens] int64, device
    decode: DecodePlan | None = None
    prefill: PrefillPlan | None = None
    cascade: CascadePlan | None = None


class IluvatarBackend(AttentionBackend):
    name = "iluvatar"
    capabilities = Capabilities(
        devices=frozenset({"cuda", "cpu"}),  # cuda: a CoreX GPU; cpu: the emulator only
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_sizes=HEAD_SIZES,
        block_size_multiple=BLOCK_ALIGN,
        kv_cache_dtypes=frozenset({"auto"}),
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
    )

    @classmethod
    def availability(cls, device: torch.device | str, emulate: bool = False) -> str | None:
        return ops.unavailable_reason(device, emulate)

    @classmethod
    def is_emulated(cls, device: torch.device | str) -> bool:
        return ops.is_emulated(device)

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec) -> list[Refusal]:
        return [
            r.because(_WHY[r.field]) if r.field in _WHY else r
            for r in super().unsupported_reasons(spec)
        ]

    def __init__(
        self, spec: AttentionSpec, device: torch.device | str = "cpu", *, emulate: bool = False
    ) -> None:
        super().__init__(spec, device, emulate=emulate)
        #: ixformer or the emulator, resolved once for this instance.
        self.ops: Any = ops.namespace(self.device, emulate)

    def metadata_builder(self) -> IluvatarMetadataBuilder:
        return IluvatarMetadataBuilder(self)

    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> IluvatarAttentionImpl:
        return IluvatarAttentionImpl(self, alibi_slopes=alibi_slopes, sinks=sinks)


#: Why the kernels refuse what Capabilities refuses, per refused field.
_WHY = {
    "sinks": "neither flash_attn_varlen_func nor flash_attn_with_kvcache takes sink logits",
    "head_size": "ixformer's attention kernels are built for these head sizes",
    "block_size": "the HND paged cache needs block_size a multiple of 16",
    "dtype": "the kernels take float16 and bfloat16",
    "kv_cache_dtype": "the int8 cache modes are not implemented by this backend yet",
}


class IluvatarMetadataBuilder(AttentionMetadataBuilder[IluvatarAttentionMetadata]):
    """Plans a step once for every layer: decode / prefill split, lengths, sub-tables."""

    backend: IluvatarBackend
    #: Leading requests with query_len <= this go to the decode kernel (multi-token decode up
    #: to this many tokens, through cu_query_lens).
    reorder_batch_threshold: ClassVar[int] = 16

    def plan(self, batch: BatchMetadata, common_prefix_len: int) -> IluvatarAttentionMetadata:
        n = batch.num_actual_tokens
        causal = self.spec.causal and batch.causal
        common: dict[str, Any] = dict(
            batch=batch,
            common_prefix_len=common_prefix_len,
            num_actual_tokens=n,
            causal=causal,
            # Padding rows past num_actual_tokens are never handed to the write; the op itself
            # skips any slot < 0 among the rest.
            slot_mapping=batch.slot_mapping[:n],
        )
        if batch.num_reqs == 0:
            return IluvatarAttentionMetadata(**common)
        prefix = self._cascade_prefix(common_prefix_len, causal)
        if prefix:
            return IluvatarAttentionMetadata(**common, cascade=self._cascade(batch, prefix))
        num_decodes = self._leading_decodes(batch) if causal else 0
        return IluvatarAttentionMetadata(
            **common,
            decode=self._decode(batch, num_decodes) if num_decodes else None,
            prefill=self._prefill(batch, num_decodes) if num_decodes < batch.num_reqs else None,
        )

    def _leading_decodes(self, batch: BatchMetadata) -> int:
        """How many requests at the front have query_len <= the threshold (host data).

        Engines send decodes first (``reorder_batch_threshold``); a decode after a prefill is
        served by the prefill call, which computes any request correctly."""
        small = (batch.query_lens_cpu <= self.reorder_batch_threshold).to(torch.int64)
        return int(torch.cumprod(small, 0).sum())

    def _decode(self, batch: BatchMetadata, nd: int) -> DecodePlan:
        dev = self.backend.device
        q_lens = batch.query_lens_cpu[:nd]
        max_q = int(q_lens.max())
        return DecodePlan(
            num_reqs=nd,
            num_tokens=int(batch.query_start_loc_cpu[nd]),
            max_query_len=max_q,
            max_seq_len=int(batch.seq_lens_cpu[:nd].max()),
            seq_lens=_int32(batch.seq_lens_cpu[:nd], dev),
            block_table=batch.block_table[:nd].to(torch.int32).contiguous(),
            cu_query_lens=None if max_q == 1 else _int32(batch.query_start_loc_cpu[: nd + 1], dev),
        )

    def _prefill(self, batch: BatchMetadata, nd: int) -> PrefillPlan:
        dev = self.backend.device
        qsl = batch.query_start_loc_cpu[nd:].to(torch.int64)
        seq_lens = batch.seq_lens_cpu[nd:]
        start = int(qsl[0])
        return PrefillPlan(
            num_reqs=batch.num_reqs - nd,
            token_start=start,
            num_tokens=int(qsl[-1]) - start,
            max_query_len=int(batch.query_lens_cpu[nd:].max()),
            max_seq_len=int(seq_lens.max()),
            cu_seqlens_q=_int32(qsl - start, dev),
            cu_seqlens_k=_int32(_cumulative(seq_lens), dev),
            block_table=batch.block_table[nd:].to(torch.int32).contiguous(),
        )

    def _cascade_prefix(self, common_prefix_len: int, causal: bool) -> int:
        """The keys the cascade path shares: common_prefix_len rounded down to whole blocks
        (the prefix call reads whole blocks of the first request's table). 0 (the regular
        path, same result) for non-causal steps and where the prefix call cannot reproduce the
        per-request math: a sliding window or ALiBi depend on each query's own position."""
        spec = self.spec
        if not causal or spec.has_window or spec.use_alibi:
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
            cu_prefix_q=_int32(torch.tensor([0, n]), dev),
            cu_prefix_k=_int32(torch.tensor([0, prefix]), dev),
            prefix_block_table=batch.block_table[:1, :prefix_blocks].to(torch.int32).contiguous(),
            max_query_len=batch.max_query_len,
            cu_seqlens_q=_int32(batch.query_start_loc_cpu, dev),
            cu_suffix_k=_int32(_cumulative(suffix), dev),
            max_suffix_len=int(suffix.max()),
            suffix_block_table=batch.block_table[:, prefix_blocks:].to(torch.int32).contiguous(),
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

    def check_step(self, cache: PagedKVCache, meta: AttentionMetadata) -> None:
        if not isinstance(meta, IluvatarAttentionMetadata):
            raise InvalidInputError(
                f"meta must come from the iluvatar backend's metadata_builder().build(batch), "
                f"got {type(meta).__name__}"
            )

    # --- KV write ---------------------------------------------------------------------------
    def store_kv(
        self,
        key: torch.Tensor,  # [>= n, num_kv_heads, head_size]
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,  # [n] int32/int64, -1 = padding
    ) -> None:
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
            self._write(key[:n], value[:n], cache, meta.slot_mapping)

    def _write(
        self, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache, slots: torch.Tensor
    ) -> None:
        # Writes slot_mapping.size(0) tokens into the HND cache, skipping slots < 0 [callers].
        self.backend.ops.inference.functions.reshape_and_cache_flash(
            key, value, cache.key, cache.value, slots, "auto"
        )

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
        if plan.cu_query_lens is None:  # one token each: (B, 1, H, D)
            q, o = query[:t].unsqueeze(1), out[:t].unsqueeze(1)
            multi: dict[str, Any] = {}
        else:  # multi-token decode: packed (T, H, D) with cumulative query ends [callers]
            q, o = query[:t], out[:t]
            multi = dict(max_query_len=plan.max_query_len, cu_query_lens=plan.cu_query_lens)
        self.backend.ops.contrib.vllm_flash_attn.flash_attn_with_kvcache(
            q,
            cache.key,
            cache.value,
            cache_seqlens=plan.seq_lens,
            block_table=plan.block_table,
            causal=True,
            window_size=self.causal_window,
            max_context_len=plan.max_seq_len,
            use_sqrt_alibi=False,
            out=o,
            **multi,
            **self._shared(),
        )

    def _attend_prefill(
        self,
        query: torch.Tensor,
        cache: PagedKVCache,
        plan: PrefillPlan,
        causal: bool,
        out: torch.Tensor,
    ) -> None:
        rows = slice(plan.token_start, plan.token_start + plan.num_tokens)
        self.backend.ops.contrib.vllm_flash_attn.flash_attn_varlen_func(
            query[rows],
            cache.key,
            cache.value,
            cu_seqlens_q=plan.cu_seqlens_q,
            cu_seqlens_k=plan.cu_seqlens_k,  # cumulative, also with the paged cache [callers]
            max_seqlen_q=plan.max_query_len,
            max_seqlen_k=plan.max_seq_len,
            causal=causal,
            window_size=self.causal_window if causal else self.full_window,
            block_table=plan.block_table,
            sqrt_alibi=False,
            out=out[rows],
            **self._shared(),
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
