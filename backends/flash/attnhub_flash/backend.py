"""The ``flash`` backend: attnhub's protocol translated into FlashAttention's calling conventions.

One backend name, four providers (see ``ops.py``); the provider is fixed per class, and each
class declares what its provider's kernels can do, because the conformance suite and selection
read ``capabilities`` from the class. The plugin registers the class of the chosen provider
under the name ``flash`` (``ATTNHUB_FLASH_PROVIDER`` picks it); ``backend_class(provider)`` gives
any of them for direct use or ``attnhub.register_backend(..., replace=True)``.

Per step, the builder does every host-side thing once: int32 lengths and block table, the
cumulative KV lengths FA2 wants, the decode-only decision, the rows and slots of the KV write.
Per layer, the impl makes one KV write and **one** attention call for the whole batch, with no
loop over requests and no host read of a device tensor:

  provider  attention (every attention type: the keys are in the paged NHD cache)
  vllm      flash_attn_varlen_func(block_table=, seqused_k=, out=, fa_version=2), keywords only
  fa2       flash_attn_varlen_func(block_table=, cu_seqlens_k=cumulative KV lengths);
            decode-only steps: flash_attn_with_kvcache(q (B, 1, H, D), cache_seqlens=)
  fa3       flash_attn_with_kvcache(page_table=, cache_seqlens=, cu_seqlens_q=, max_seqlen_q=);
            decode-only steps: the same without cu_seqlens_q, q (B, 1, H, D)
  fa4       flash_attn_varlen_func(page_table=, seqused_k=, window_size=(None, None) when off,
            learnable_sink=)
  KV write  vllm: reshape_and_cache_flash (slot < 0 skipped by the op); others: one
            index_copy_ of the rows with a slot, planned once per step

Every ``[inferred]`` vendor semantic relied on is marked where it is used and listed in
docs/backends/flash.md.
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
from attnhub_flash import ops

TOLERANCES = {
    # The kernels accumulate in float32 over fp16/bf16 operands and round once (as the
    # emulator does); the suite's caps.
    torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
    torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2),
}
HALF = frozenset({torch.float16, torch.bfloat16})
ALL_TYPES = frozenset(AttentionType)


def _caps(**fields: Any) -> Capabilities:
    base: dict[str, Any] = dict(
        devices=frozenset({"cuda", "cpu"}),  # cpu: through the emulator only (emulate=True)
        dtypes=HALF,
        kv_cache_dtypes=frozenset({"auto"}),
        kv_cache_layout="NHD",
        # Each plane must be contiguous: the paged kernels index blocks by the plane's own
        # strides, but reshape_and_cache_flash and the scatter view a plane as slots.
        strided_kv_cache=False,
        attn_types=ALL_TYPES,
        sliding_window=True,
        softcap=True,
        multi_token_decode=True,
        chunked_prefill=True,
        cascade=False,
        # max_seqlen_q / max_seqlen_k are host ints of the step: a captured graph would bake
        # them in; graph support is left for a later increment.
        graph_capture=GraphSupport.NEVER,
        tolerances=TOLERANCES,
    )
    base.update(fields)
    return Capabilities(**base)


#: What each provider's kernels take. [callers]/[doc]/[schema] per line; see flash.md.
CAPABILITIES: dict[str, Capabilities] = {
    # vLLM: get_supported_head_sizes "multiple of 8 up to 256", MultipleOf(16) block sizes
    # [callers]; ALiBi on FA2 only [schema: the wrapper asserts it away on FA3]; s_aux sinks
    # need fa_version=3, not used by this increment.
    "vllm": _caps(
        max_head_size=256,
        head_size_multiple=8,
        block_size_multiple=16,
        alibi=True,
        sinks=False,
        priority={"cuda": 80},
    ),
    # Upstream FA2: "page_block_size must be a multiple of 256" [doc]; head sizes up to 256,
    # multiples of 8 (others are padded by the Python wrapper, which would copy the cache).
    "fa2": _caps(
        max_head_size=256,
        head_size_multiple=8,
        block_sizes=frozenset({256, 512}),
        block_size_multiple=256,
        alibi=True,
        sinks=False,
        priority={"cuda": 70},
    ),
    # FA3 (hopper): "page_block_size can be arbitrary" [doc]; no ALiBi; no sinks in 2.8.3.
    "fa3": _caps(
        max_head_size=256,
        head_size_multiple=8,
        alibi=False,
        sinks=False,
        priority={"cuda": 90},
    ),
    # FA4: _validate_head_dims on SM100: 8..128 (multiples of 8 for 16-bit dtypes) or 256
    # [schema]; any page size, 128 the TMA fast path [schema]; learnable_sink [schema].
    "fa4": _caps(
        head_sizes=frozenset([*range(8, 129, 8), 256]),
        alibi=False,
        sinks=True,
        priority={"cuda": 95},
    ),
}

#: Why each provider's kernels refuse what Capabilities refuses, per refused field.
_WHY: dict[str, dict[str, str]] = {
    "vllm": {
        "block_size": "vLLM's flash-attention fork takes paged blocks in multiples of 16",
        "head_size": "vLLM's flash-attention fork takes head sizes in multiples of 8 up to 256",
        "sinks": "vLLM's fork takes s_aux sinks only with fa_version=3, not used here yet",
        "kv_cache_dtype": "fp8 descales need fa_version=3 and a query scale, not done yet",
    },
    "fa2": {
        "block_size": "upstream FA2's paged KV needs page_block_size a multiple of 256",
        "head_size": "FA2 takes head sizes up to 256 (multiples of 8 without copying the cache)",
        "sinks": "FA2 has no attention sinks",
        "kv_cache_dtype": "FA2 has no fp8 or int8 KV cache",
    },
    "fa3": {
        "alibi": "FA3 has no ALiBi",
        "sinks": "FA3 2.8.3 has no attention sinks",
        "head_size": "FA3 takes head sizes in multiples of 8 up to 256",
        "kv_cache_dtype": "FA3's fp8 path needs an fp8 query too (descales), not done yet",
    },
    "fa4": {
        "alibi": "FA4 has no ALiBi (score_mod could express it; not done)",
        "head_size": "FA4 on SM100 takes 8..128 in multiples of 8, or 256",
        "kv_cache_dtype": "FA4's fp8 path is not used yet",
    },
}
_COMMON_WHY = {"dtype": "FlashAttention kernels take float16 and bfloat16"}


@dataclass(frozen=True)
class FlashAttentionMetadata(AttentionMetadata):
    """One step, planned: every argument of the kernels, ready to pass."""

    provider: str = "vllm"
    num_actual_tokens: int = 0
    max_query_len: int = 0
    max_seq_len: int = 0
    causal: bool = True
    #: Every request has one query token and the tokens are exactly the requests: FA2 and FA3
    #: take their padded-batch decode path (q viewed as (B, 1, H, D)).
    decode_only: bool = False
    query_start_loc: torch.Tensor | None = None  # [B + 1] int32, device
    seq_lens: torch.Tensor | None = None  # [B] int32, device
    cu_seqlens_k: torch.Tensor | None = None  # [B + 1] int32, device (FA2: cumulative KV)
    block_table: torch.Tensor | None = None  # [B, max_blocks] int32, contiguous, device
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int64, device (vLLM's write)
    write_rows: torch.Tensor | None = None  # [m] int64: tokens that have a slot (scatter)
    write_slots: torch.Tensor | None = None  # [m] int64: their slots


class FlashBackend(AttentionBackend):
    """The FlashAttention backend; a subclass per provider fixes ``provider`` and
    ``capabilities`` (see ``backend_class``)."""

    name = "flash"
    provider: ClassVar[str] = ops.DEFAULT
    capabilities = CAPABILITIES[ops.DEFAULT]

    @classmethod
    def availability(cls, device: torch.device | str, emulate: bool = False) -> str | None:
        return ops.unavailable_reason(cls.provider, device, emulate)

    @classmethod
    def is_emulated(cls, device: torch.device | str) -> bool:
        return ops.is_emulated(device)

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec) -> list[Refusal]:
        why = {**_COMMON_WHY, **_WHY[cls.provider]}
        return [
            r.because(f"provider {cls.provider}: {why[r.field]}") if r.field in why else r
            for r in super().unsupported_reasons(spec)
        ]

    def __init__(
        self, spec: AttentionSpec, device: torch.device | str = "cpu", *, emulate: bool = False
    ) -> None:
        super().__init__(spec, device, emulate=emulate)
        #: The provider's modules (or the emulator's namespaces), resolved once per instance.
        self.ops = ops.resolve(self.provider, self.device, emulate)

    def __repr__(self) -> str:
        mode = ", emulated" if self.emulated else ""
        return f"<{type(self).__name__} 'flash' ({self.provider}) on {self.device}{mode}>"

    def metadata_builder(self) -> FlashMetadataBuilder:
        return FlashMetadataBuilder(self)

    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> FlashAttentionImpl:
        return FlashAttentionImpl(self, alibi_slopes=alibi_slopes, sinks=sinks)


class FlashVllmBackend(FlashBackend):
    provider = "vllm"
    capabilities = CAPABILITIES["vllm"]


class FlashFA2Backend(FlashBackend):
    provider = "fa2"
    capabilities = CAPABILITIES["fa2"]


class FlashFA3Backend(FlashBackend):
    provider = "fa3"
    capabilities = CAPABILITIES["fa3"]


class FlashFA4Backend(FlashBackend):
    provider = "fa4"
    capabilities = CAPABILITIES["fa4"]


BACKENDS: dict[str, type[FlashBackend]] = {
    "vllm": FlashVllmBackend,
    "fa2": FlashFA2Backend,
    "fa3": FlashFA3Backend,
    "fa4": FlashFA4Backend,
}


def backend_class(provider: str | None = None) -> type[FlashBackend]:
    """The backend class of ``provider`` (None: ``ops.chosen_provider()``, i.e. the
    ``ATTNHUB_FLASH_PROVIDER`` environment variable, else the best importable one)."""
    name = ops.chosen_provider() if provider is None else provider
    try:
        return BACKENDS[name]
    except KeyError:
        raise InvalidInputError(
            f"{name!r} is not a FlashAttention provider (one of {', '.join(BACKENDS)})"
        ) from None


class FlashMetadataBuilder(AttentionMetadataBuilder[FlashAttentionMetadata]):
    """Plans a step once for every layer."""

    backend: FlashBackend

    def plan(self, batch: BatchMetadata, common_prefix_len: int) -> FlashAttentionMetadata:
        provider = self.backend.provider
        dev = self.backend.device
        n = batch.num_actual_tokens
        q_lens = batch.query_lens_cpu  # host
        fields: dict[str, Any] = dict(
            batch=batch,
            common_prefix_len=common_prefix_len,
            provider=provider,
            num_actual_tokens=n,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
            causal=self.spec.causal and batch.causal,
            decode_only=batch.num_reqs > 0 and n == batch.num_reqs and bool((q_lens == 1).all()),
            # int32 and contiguous once per step, not per layer (no-ops when already so)
            query_start_loc=batch.query_start_loc.to(torch.int32).contiguous(),
            seq_lens=batch.seq_lens.to(torch.int32).contiguous(),
            block_table=batch.block_table.to(torch.int32).contiguous(),
        )
        if provider == "fa2":
            # FA2's paged varlen reads the KV lengths from cu_seqlens_k [inferred]
            cu = torch.zeros(batch.num_reqs + 1, dtype=torch.int32)
            torch.cumsum(batch.seq_lens_cpu.to(torch.int32), 0, out=cu[1:])
            fields["cu_seqlens_k"] = cu.to(dev)
        if provider == "vllm":
            # reshape_and_cache_flash skips slot < 0 itself [schema]; int64 as vLLM passes it
            fields["slot_mapping"] = batch.slot_mapping.to(torch.int64)
        else:
            host = batch.host_slot_mapping()[:n].long()
            rows = torch.nonzero(host >= 0).flatten()
            fields["write_rows"] = rows.to(dev)
            fields["write_slots"] = host[rows].to(dev)
        return FlashAttentionMetadata(**fields)


class FlashAttentionImpl(AttentionImpl):
    """One layer: one KV write, then one attention call for the whole batch."""

    backend: FlashBackend

    def __init__(
        self,
        backend: FlashBackend,
        *,
        alibi_slopes: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        super().__init__(backend, alibi_slopes=alibi_slopes, sinks=sinks)
        spec = self.spec
        self.softcap = spec.logits_soft_cap or 0.0  # 0.0 = off, the kernels' spelling
        left, right = spec.window  # -1 = unbounded on that side
        self.window = (left, right)
        # FA4 spells "no bound" None, and (None, None) when there is no window [schema]
        self.window_fa4 = (None if left < 0 else left, None if right < 0 else right)
        # reshape_and_cache_flash takes per-tensor scales even for an unquantized cache
        ones = torch.ones(1, dtype=torch.float32, device=backend.device)
        self._k_scale, self._v_scale = ones, ones.clone()

    def check_step(self, cache: PagedKVCache, meta: AttentionMetadata) -> None:
        if not isinstance(meta, FlashAttentionMetadata) or meta.provider != self.backend.provider:
            raise InvalidInputError(
                f"meta must come from this flash backend's metadata_builder().build(batch) "
                f"(provider {self.backend.provider}), got {type(meta).__name__}"
            )

    # --- KV write ---------------------------------------------------------------------------
    def store_kv(
        self,
        key: torch.Tensor,  # [>= n, num_kv_heads, head_size]
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,  # [n] int32/int64, -1 = padding
    ) -> None:
        if slot_mapping.shape[0] == 0:
            return
        if self.backend.ops.cache_ops is not None:
            self._reshape_and_cache(key, value, cache, slot_mapping.to(torch.int64))
            return
        # write_kv without a step: the base class has checked these slots on the host already
        host = slot_mapping.cpu().long()
        rows = torch.nonzero(host >= 0).flatten()
        dev = self.backend.device
        self._scatter(key, value, cache, rows.to(dev), host[rows].to(dev))

    def store_step_kv(
        self, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata
    ) -> None:
        assert isinstance(meta, FlashAttentionMetadata)
        if meta.num_actual_tokens == 0:
            return
        if meta.slot_mapping is not None:
            self._reshape_and_cache(key, value, cache, meta.slot_mapping)
            return
        assert meta.write_rows is not None and meta.write_slots is not None
        self._scatter(key, value, cache, meta.write_rows, meta.write_slots)

    def _reshape_and_cache(
        self, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache, slots: torch.Tensor
    ) -> None:
        # writes slots.size(0) tokens (key may be longer: padding), slot < 0 skipped [schema]
        cache_ops = self.backend.ops.cache_ops
        assert cache_ops is not None
        cache_ops.reshape_and_cache_flash(
            key,
            value,
            cache.key,
            cache.value,
            slots,
            "auto",
            self._k_scale,
            self._v_scale,
        )

    @staticmethod
    def _scatter(
        key: torch.Tensor,
        value: torch.Tensor,
        cache: PagedKVCache,
        rows: torch.Tensor,  # [m] int64
        slots: torch.Tensor,  # [m] int64
    ) -> None:
        if rows.numel() == 0:
            return
        for plane, src in ((cache.key, key), (cache.value, value)):
            flat = plane.view(-1, *plane.shape[2:])  # [num_slots, num_kv_heads, head_size]
            flat.index_copy_(0, slots, src.index_select(0, rows).to(plane.dtype))

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
        assert isinstance(meta, FlashAttentionMetadata)
        n = meta.num_actual_tokens
        if n == 0:
            return
        q, target = query[:n], out[:n]
        provider = meta.provider
        if provider == "vllm":
            self._vllm(q, cache, meta, target)
        elif provider == "fa2":
            target.copy_(self._fa2(q, cache, meta))
        elif provider == "fa3":
            target.copy_(self._fa3(q, cache, meta))
        else:
            target.copy_(self._fa4(q, cache, meta))

    def _vllm(
        self, q: torch.Tensor, cache: PagedKVCache, meta: FlashAttentionMetadata, out: torch.Tensor
    ) -> None:
        # vLLM's fork: positional order differs from upstream, so keywords only [schema];
        # block_table needs seqused_k [schema]; out= written in place.
        self.backend.ops.attention.flash_attn_varlen_func(
            q=q,
            k=cache.key,
            v=cache.value,
            out=out,
            cu_seqlens_q=meta.query_start_loc,
            max_seqlen_q=meta.max_query_len,
            seqused_k=meta.seq_lens,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=self.spec.scale,
            causal=meta.causal,
            alibi_slopes=self.alibi_slopes,
            window_size=self.window,
            block_table=meta.block_table,
            softcap=self.softcap,
            fa_version=2,
        )

    def _fa2(
        self, q: torch.Tensor, cache: PagedKVCache, meta: FlashAttentionMetadata
    ) -> torch.Tensor:
        fa = self.backend.ops.attention
        if meta.decode_only:  # the decode kernel (split-KV): q as (B, 1, H, D)
            result = fa.flash_attn_with_kvcache(
                q.unsqueeze(1),
                cache.key,
                cache.value,
                cache_seqlens=meta.seq_lens,
                block_table=meta.block_table,
                softmax_scale=self.spec.scale,
                causal=meta.causal,
                window_size=self.window,
                softcap=self.softcap,
                alibi_slopes=self.alibi_slopes,
            )
            return result.squeeze(1)
        return fa.flash_attn_varlen_func(
            q,
            cache.key,
            cache.value,
            meta.query_start_loc,
            meta.cu_seqlens_k,
            meta.max_query_len,
            meta.max_seq_len,
            softmax_scale=self.spec.scale,
            causal=meta.causal,
            window_size=self.window,
            softcap=self.softcap,
            alibi_slopes=self.alibi_slopes,
            block_table=meta.block_table,
        )

    def _fa3(
        self, q: torch.Tensor, cache: PagedKVCache, meta: FlashAttentionMetadata
    ) -> torch.Tensor:
        shared: dict[str, Any] = dict(
            cache_seqlens=meta.seq_lens,
            page_table=meta.block_table,
            softmax_scale=self.spec.scale,
            causal=meta.causal,
            window_size=self.window,
            softcap=self.softcap,
        )
        fa = self.backend.ops.attention
        if meta.decode_only:
            result = fa.flash_attn_with_kvcache(q.unsqueeze(1), cache.key, cache.value, **shared)
            return result.squeeze(1)
        # varlen q through cu_seqlens_q / max_seqlen_q [schema; shapes inferred]
        return fa.flash_attn_with_kvcache(
            q,
            cache.key,
            cache.value,
            cu_seqlens_q=meta.query_start_loc,
            max_seqlen_q=meta.max_query_len,
            **shared,
        )

    def _fa4(
        self, q: torch.Tensor, cache: PagedKVCache, meta: FlashAttentionMetadata
    ) -> torch.Tensor:
        # every argument after v by keyword [schema]; returns (out, lse) [schema]
        out, _ = self.backend.ops.attention.flash_attn_varlen_func(
            q,
            cache.key,
            cache.value,
            cu_seqlens_q=meta.query_start_loc,
            max_seqlen_q=meta.max_query_len,
            seqused_k=meta.seq_lens,
            max_seqlen_k=meta.max_seq_len,
            page_table=meta.block_table,
            softmax_scale=self.spec.scale,
            causal=meta.causal,
            window_size=self.window_fa4,
            learnable_sink=self.sinks,
            softcap=self.softcap,
        )
        return out
