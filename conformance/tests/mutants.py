"""Mutant backends: the torch backend with one realistic bug each. The suite must catch every one.
Variants: conforming backends that declare other things; the suite must adapt and pass.

Load as a pytest plugin (``-p mutants``, or ``PYTEST_PLUGINS=mutants``, with this directory on
PYTHONPATH): it registers them in-process, so ``--attnhub-backend <name>`` selects them.

The bugs are written against the backend protocol only (``store_kv`` / ``attend`` / ``plan`` /
``checks_values``), not the torch backend's internals, so they stay bugs while those
internals change.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

import attnhub
from attnhub import (
    BatchMetadata,
    GraphSupport,
    LatentKVCache,
    LseSupport,
    PagedKVCache,
    Step,
    reference,
)
from attnhub.backend import AttentionMetadata
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.quant import simulate_query_quantization
from attnhub.spec import AttentionType
from attnhub.torch_backend import TorchAttentionImpl, TorchBackend, TorchMetadataBuilder
from attnhub.torch_backend.backend import TorchAttentionMetadata
from attnhub.torch_backend.mla import TorchMLAImpl


# --- a plain per-request attention with one convention swappable --------------------------------
class PerRequestImpl(TorchAttentionImpl):
    """Attention request by request in float32 over keys read back from the cache; subclasses
    get the visibility rule wrong in one way each."""

    def visible(self, q_len: int, seq_len: int) -> torch.Tensor:  # [q_len, seq_len] bool
        ctx = seq_len - q_len
        pos_q = torch.arange(q_len)[:, None] + self.query_offset(ctx)
        pos_k = torch.arange(seq_len)[None, :]
        left, right = self.window()
        if self.spec.causal:
            right = 0
        ok = torch.ones(q_len, seq_len, dtype=torch.bool)
        if left >= 0:
            ok &= pos_k >= pos_q - left
        if right >= 0:
            ok &= pos_k <= pos_q + right
        return ok

    def query_offset(self, context_len: int) -> int:
        return context_len  # bottom-right: new tokens sit after the context

    def window(self) -> tuple[int, int]:
        return self.spec.window

    def normalize(self, scores: torch.Tensor) -> torch.Tensor:  # softmax over the last dim
        return torch.softmax(scores, -1).nan_to_num(0.0)

    def values(self, v: torch.Tensor) -> torch.Tensor:  # [s, H, head_size_v] as multiplied
        return v

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        spec, batch = self.spec, meta.batch
        group = spec.num_heads // spec.num_kv_heads
        qsl = batch.query_start_loc_cpu.tolist()
        for r in range(batch.num_reqs):
            s = int(batch.seq_lens_cpu[r])
            k, v = reference.read_sequence(cache, batch.block_table[r], s)
            k = k.float().repeat_interleave(group, 1)  # [s, H, D]
            v = v.float().repeat_interleave(group, 1)
            q = query[qsl[r] : qsl[r + 1]].float()  # [q, H, D]
            scores = torch.einsum("ihd,jhd->hij", q, k) * spec.scale
            if spec.logits_soft_cap:
                scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
            if self.alibi_slopes is not None:
                pos_q = torch.arange(q.shape[0])[:, None] + s - q.shape[0]
                dist = (pos_q - torch.arange(s)[None, :]).abs()
                scores = scores - self.alibi_slopes[:, None, None] * dist
            scores = scores.masked_fill(~self.visible(q.shape[0], s), -math.inf)
            if self.sinks is not None:
                sink = self.sinks[:, None, None].expand(-1, q.shape[0], 1)
                p = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
            else:
                p = self.normalize(scores)
            v = self.values(v)
            out[qsl[r] : qsl[r + 1]] = torch.einsum("hij,jhd->ihd", p, v).to(out.dtype)


# --- 1. top-left causal alignment (SDPA's is_causal where q_len != kv_len) ---------------------
class TopLeftImpl(PerRequestImpl):
    def query_offset(self, context_len: int) -> int:
        return 0  # query i sees keys 0..i: the cached context is ignored


class TopLeftCausalBackend(TorchBackend):
    name = "top_left_causal"

    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> TorchAttentionImpl:
        return TopLeftImpl(self, alibi_slopes=alibi_slopes, sinks=sinks)


# --- 2. padding slots written: slot -1 used as an index wraps to the last slot ------------------
class WritesPaddingImpl(TorchAttentionImpl):
    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata | None = None,
    ) -> None:
        n = slot_mapping.shape[0]
        slots = slot_mapping.long()  # no filtering of -1
        blk, off = slots // cache.block_size, slots % cache.block_size
        cache.key_nhd().index_put_((blk, off), key[:n])
        cache.value_nhd().index_put_((blk, off), value[:n])


class WritesPaddingBackend(TorchBackend):
    name = "writes_padding"
    capabilities = replace(TorchBackend.capabilities, kv_cache_dtypes=frozenset({"auto"}))

    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> TorchAttentionImpl:
        return WritesPaddingImpl(self, alibi_slopes=alibi_slopes, sinks=sinks)


# --- 3. the sliding window declared but ignored ------------------------------------------------
class NoWindowImpl(PerRequestImpl):
    def window(self) -> tuple[int, int]:
        return (-1, -1)


class IgnoresWindowBackend(TorchBackend):
    name = "ignores_window"

    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> TorchAttentionImpl:
        return NoWindowImpl(self, alibi_slopes=alibi_slopes, sinks=sinks)


# --- 4. graph capture declared, but forward reads device data on the host ---------------------
class SyncingImpl(TorchAttentionImpl):
    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        if int(meta.batch.seq_lens.max()) == 0:  # "nothing to do": a device-to-host sync
            return
        super().attend(query, key, value, cache, meta, out, lse)  # type: ignore[arg-type]


class SyncsInForwardBackend(TorchBackend):
    name = "syncs_in_forward"
    capabilities = replace(TorchBackend.capabilities, graph_capture=GraphSupport.ALWAYS)

    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> TorchAttentionImpl:
        return SyncingImpl(self, alibi_slopes=alibi_slopes, sinks=sinks)


# --- 4b. graph capture declared, but what is captured was planned on the host -------------------
class HostPlannedCaptureBuilder(TorchMetadataBuilder):
    def build_for_graph_capture(self, batch: BatchMetadata) -> TorchAttentionMetadata:
        return self.build(batch)  # the chunk plan: the capture step's blocks, slots, lengths


class BakesHostPlanBackend(TorchBackend):
    name = "bakes_host_plan"

    def metadata_builder(self) -> TorchMetadataBuilder:
        return HostPlannedCaptureBuilder(self)


# --- 5. an out-of-range slot accepted, and the cache written partly before failing -------------
class CorruptsOnBadSlotImpl(TorchAttentionImpl):
    @staticmethod
    def _check_extents(meta: AttentionMetadata, cache: PagedKVCache) -> None:
        pass  # "range checks are too slow"

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata | None = None,
    ) -> None:
        bs = cache.block_size
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot >= 0:
                cache.key[slot // bs, slot % bs] = key[t]  # IndexError on a bad slot, too late
                cache.value[slot // bs, slot % bs] = value[t]


class CorruptsOnBadSlotBackend(TorchBackend):
    name = "corrupts_on_bad_slot"
    capabilities = replace(TorchBackend.capabilities, kv_cache_dtypes=frozenset({"auto"}))

    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> TorchAttentionImpl:
        return CorruptsOnBadSlotImpl(self, alibi_slopes=alibi_slopes, sinks=sinks)


# --- 6. the softmax scale 1% off: inside bf16's elementwise tolerance everywhere -------------
class ScaleOffBackend(TorchBackend):
    name = "scale_1pct_off"
    capabilities = replace(TorchBackend.capabilities, dtypes=frozenset({torch.bfloat16}))
    scale_error = 1.01

    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> TorchAttentionImpl:
        impl = TorchAttentionImpl(self, alibi_slopes=alibi_slopes, sinks=sinks)
        impl.spec = replace(self.spec, scale=self.spec.scale * self.scale_error)  # the bug
        return impl


# --- 7. a tolerance loose enough to pass anything, and the scale 1.5x off ------------------------
class LooseToleranceBackend(ScaleOffBackend):
    name = "loose_tolerance"
    scale_error = 1.5
    capabilities = replace(
        TorchBackend.capabilities,
        tolerances={d: attnhub.Tolerance(1.0, 1.0) for d in TorchBackend.capabilities.dtypes},
    )


# --- 8. a quantized query and cache, and an accuracy bound better than they deliver -----------
class QueryQuantizingImpl(TorchAttentionImpl):
    """Attention over the query quantized as the capabilities declare (int8 per token and
    head): correct on the same quantized inputs."""

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        scheme = self.backend.capabilities.query_quantization[self.spec.kv_cache_dtype]
        q = simulate_query_quantization(query, scheme).to(query.dtype)
        super().attend(q, key, value, cache, meta, out, lse)  # type: ignore[arg-type]


class QuantizedCacheMutant(TorchBackend):
    """A torch backend whose impl over a quantized cache is ``quantized_impl`` (the plain one
    over an unquantized cache)."""

    quantized_impl: ClassVar[type[TorchAttentionImpl]] = TorchAttentionImpl

    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> TorchAttentionImpl:
        cls = TorchAttentionImpl if self.spec.kv_cache_dtype == "auto" else self.quantized_impl
        return cls(self, alibi_slopes=alibi_slopes, sinks=sinks)


class OverclaimsAccuracyBackend(QuantizedCacheMutant):
    name = "overclaims_accuracy"
    quantized_impl = QueryQuantizingImpl
    capabilities = replace(
        TorchBackend.capabilities,
        kv_cache_dtypes=frozenset({"auto", "fp8_e4m3"}),
        query_quantization={"fp8_e4m3": "int8_per_token_head"},
        # fp8 e4m3 keys and values alone err by a few percent: 0.005 is a bound it cannot meet
        quantization_accuracy={"fp8_e4m3": attnhub.AccuracyBound(0.005, 0.99999)},
    )


# --- 9. rounds its probabilities (declared), and reads V with a scale 3% off -----------------
class ValueScaleOffImpl(TorchAttentionImpl):
    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        assert cache.value_scale is not None
        off = replace(cache, value_scale=cache.value_scale * 1.03)  # the bug
        super().attend(query, key, value, off, meta, out, lse)


class ValueScaleOffBackend(QuantizedCacheMutant):
    """Declares that it rounds the softmax probabilities to fp8 (as FlashAttention-3 does),
    which widens the same-inputs tolerance by up to 6% of the weighted |V|: a 3% scale error
    hides inside that elementwise, but not from the bias check against a plain computation
    that rounds them too."""

    name = "value_scale_off"
    quantized_impl = ValueScaleOffImpl
    capabilities = replace(
        TorchBackend.capabilities,
        dtypes=frozenset({torch.bfloat16}),
        kv_cache_dtypes=frozenset({"auto", "fp8_e4m3"}),
        probability_quantization={"fp8_e4m3": "fp8_e4m3"},
        quantization_accuracy={"fp8_e4m3": attnhub.AccuracyBound(1.0, 0.9)},
    )


# --- 10. reads its new keys and values as if their rows were dense ----------------------------
def _as_if_dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` read through the strides of its ``.contiguous()`` copy at its own storage offset:
    a kernel that takes the data pointer and assumes dense rows. Right for a dense tensor;
    for a view of a fused QKV projection it reads the neighbouring columns."""
    return t.as_strided(t.shape, t.contiguous().stride(), t.storage_offset())


class IgnoresRowStrideImpl(TorchAttentionImpl):
    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata | None = None,
    ) -> None:
        super().store_kv(_as_if_dense(key), _as_if_dense(value), cache, slot_mapping, meta)


class IgnoresRowStrideBackend(TorchBackend):
    name = "ignores_row_stride"
    capabilities = replace(TorchBackend.capabilities, dtypes=frozenset({torch.bfloat16}))

    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> TorchAttentionImpl:
        return IgnoresRowStrideImpl(self, alibi_slopes=alibi_slopes, sinks=sinks)


# --- 11. split-KV decoding past 16k keys, its partial LSEs kept in bfloat16 --------------------
SPLIT_AT = 16 * 1024


class HalfPrecisionSplitImpl(TorchAttentionImpl):
    """Decodes over more than 16k keys in two splits (flash-decoding), merged by their LSEs,
    which it keeps in bfloat16 (the bug: ~0.03 off at LSE ~12, a few percent of each split's
    weight). Exact below 16k keys."""

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        super().attend(query, key, value, cache, meta, out, lse)  # type: ignore[arg-type]
        spec, batch = self.spec, meta.batch
        qsl = batch.query_start_loc_cpu.tolist()
        for r in range(batch.num_reqs):
            s = int(batch.seq_lens_cpu[r])
            if qsl[r + 1] - qsl[r] != 1 or s <= SPLIT_AT:
                continue
            k, v = reference.read_sequence(cache, batch.block_table[r], s)
            q = query[qsl[r] : qsl[r] + 1]
            (oa, la), (ob, lb) = (
                reference.attention(
                    q, k[a:b], v[a:b], scale=spec.scale, compute_dtype=torch.float32
                )
                for a, b in ((0, SPLIT_AT), (SPLIT_AT, s))
            )
            la, lb = (x.to(torch.bfloat16).double() for x in (la, lb))  # the bug
            o, _ = reference.merge_attn_states(oa, la, ob, lb)
            out[qsl[r] : qsl[r] + 1] = o.to(out.dtype)


class LosesPrecisionPast16kBackend(TorchBackend):
    name = "loses_precision_past_16k"
    capabilities = replace(
        TorchBackend.capabilities,
        dtypes=frozenset({torch.float32}),
        softcap=False,
        alibi=False,
        sinks=False,
        sliding_window=False,
    )

    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> TorchAttentionImpl:
        return HalfPrecisionSplitImpl(self, alibi_slopes=alibi_slopes, sinks=sinks)


# --- 12. a softmax that does not subtract the row maximum ---------------------------------------
class NoMaxSubtractionImpl(PerRequestImpl):
    def normalize(self, scores: torch.Tensor) -> torch.Tensor:
        e = scores.exp()  # exp(1e4) = inf: inf / inf = NaN
        return e / e.sum(-1, keepdim=True)


class NoMaxSubtractionBackend(TorchBackend):
    name = "no_max_subtraction"
    capabilities = replace(TorchBackend.capabilities, dtypes=frozenset({torch.bfloat16}))

    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> TorchAttentionImpl:
        return NoMaxSubtractionImpl(self, alibi_slopes=alibi_slopes, sinks=sinks)


# --- 13. refuses strided query rows, but only after writing the cache ---------------------------
class RefusesAfterWriteImpl(TorchAttentionImpl):
    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        if not query.is_contiguous():  # checked in attend: after forward wrote the cache
            raise InvalidInputError(f"query must be contiguous, got strides {query.stride()}")
        super().attend(query, key, value, cache, meta, out, lse)  # type: ignore[arg-type]


class RefusesAfterWriteBackend(TorchBackend):
    name = "refuses_after_write"
    capabilities = replace(TorchBackend.capabilities, dtypes=frozenset({torch.bfloat16}))

    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> TorchAttentionImpl:
        return RefusesAfterWriteImpl(self, alibi_slopes=alibi_slopes, sinks=sinks)


# --- 14. the plan completed by the first layer: a per-layer memo inside the metadata ------------
@dataclass(frozen=True)
class MemoMetadata(TorchAttentionMetadata):
    #: the kernels' keyword arguments, made by the first layer that attends (not by build)
    kernel_kwargs: dict[Any, dict[str, Any]] = field(default_factory=dict)


class MemoBuilder(TorchMetadataBuilder):
    metadata_type = MemoMetadata


class MemoizingImpl(TorchAttentionImpl):
    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        assert isinstance(meta, MemoMetadata)
        if self.backend not in meta.kernel_kwargs:  # "made once, by the first layer"
            meta.kernel_kwargs[self.backend] = {"scale": self.spec.scale}
        super().attend(query, key, value, cache, meta, out, lse)


class MemoizesPerLayerBackend(TorchBackend):
    """Right outputs; the metadata build returns is not the plan every layer reads."""

    name = "memoizes_per_layer"
    builder_type = MemoBuilder
    impl_type = MemoizingImpl


class Base2LseImpl(TorchAttentionImpl):
    def attend(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: TorchAttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        super().attend(query, key, value, cache, meta, out, lse)
        if lse is not None:  # log2 of the denominator (FlashInfer's kernels' base), unconverted
            n = meta.batch.num_actual_tokens
            lse[:n].div_(math.log(2))


class LseBase2Backend(TorchBackend):
    """Declares the LSE and returns it in base 2: the output is right, every merge by it is
    wrong."""

    name = "lse_base2"
    impl_type = Base2LseImpl


# --- MLA (the absorbed form): three bugs an MLA kernel author can make ------------------------
class IgnoresRopeImpl(TorchMLAImpl):
    def attend(  # type: ignore[override]
        self,
        query: torch.Tensor,
        cache: LatentKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        query = query.clone()
        query[..., self.spec.kv_lora_rank :] = 0  # the bug: scores over kv_c alone
        super().attend(query, cache, meta, out, lse)


class MlaIgnoresRopeBackend(TorchBackend):
    """Drops the rope part of the scores (q_pe . k_pe)."""

    name = "mla_ignores_rope"
    mla_impl_type = IgnoresRopeImpl


class LatentScaleImpl(TorchMLAImpl):
    def __init__(self, backend: TorchBackend) -> None:
        super().__init__(backend)
        # the bug: the absorbed head's width, (kv_lora_rank + rope) ** -0.5, for the spec's
        self.spec = replace(self.spec, scale=self.spec.latent_size**-0.5)


class MlaLatentScaleBackend(TorchBackend):
    """Scales the absorbed scores by (kv_lora_rank + rope) ** -0.5 instead of spec.scale."""

    name = "mla_latent_scale"
    mla_impl_type = LatentScaleImpl


class DropsFp8ScaleImpl(TorchMLAImpl):
    def attend(  # type: ignore[override]
        self,
        query: torch.Tensor,
        cache: LatentKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        if cache.scale is not None:  # the bug: fp8 latents read as if their scale were 1
            cache = replace(cache, scale=torch.ones_like(cache.scale))
        super().attend(query, cache, meta, out, lse)


class MlaDropsFp8ScaleBackend(TorchBackend):
    """Reads an fp8 latent cache without its per-tensor scale."""

    name = "mla_drops_fp8_scale"
    mla_impl_type = DropsFp8ScaleImpl


#: An MLA declaration of an fp8 kernel that quantizes its query (as FlashMLA's fp8 decode).
FP8_QUERY_MLA = replace(
    TorchBackend.capabilities.mla,
    kv_cache_dtypes=frozenset({"auto", "fp8_e4m3"}),
    query_quantization={"fp8_e4m3": "fp8_static"},
    quantization_accuracy={"fp8_e4m3": attnhub.AccuracyBound(0.4, 0.995)},
)


class MlaFp8QueryUnquantizedBackend(TorchBackend):
    """Declares that its fp8 MLA kernel quantizes the query (fp8_static) and attends with the
    query as given: the reference over the quantized query it declares disagrees."""

    name = "mla_fp8_query_unquantized"
    capabilities = replace(TorchBackend.capabilities, mla=FP8_QUERY_MLA)


class UnsaturatedFp8WriteImpl(TorchMLAImpl):
    def store_kv(  # type: ignore[override]
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cache: LatentKVCache,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata | None = None,
    ) -> None:
        if cache.scale is None:
            super().store_kv(kv_c, k_pe, cache, slot_mapping, meta)
            return
        slots = slot_mapping.long()
        rows = (slots >= 0).nonzero()[:, 0]
        blocks, offsets = slots[rows] // cache.block_size, slots[rows] % cache.block_size
        f = torch.finfo(cache.kv_c.dtype)
        beyond = f.max + 2.0 ** math.floor(math.log2(f.max)) * f.eps / 2  # max + half its ulp
        special = math.nan if cache.kv_c.dtype == torch.float8_e4m3fn else math.inf
        for plane, new in ((cache.kv_c, kv_c), (cache.k_pe, k_pe)):
            y = new.index_select(0, rows).float() / cache.scale
            # the bug: the conversion without saturation (CUDA's __NV_NOSAT, not __NV_SATFINITE):
            # what rounds past the largest finite value is stored as NaN (e4m3, which has no
            # infinity) or +-inf (e5m2); right for every value within the range
            y = torch.where(y.abs() > beyond, torch.full_like(y, special).copysign(y), y)
            plane.view(torch.uint8)[blocks, offsets] = y.to(plane.dtype).view(torch.uint8)


class MlaUnsaturatedFp8Backend(TorchBackend):
    """Writes fp8 latents without saturating at the format's largest value (NaN / inf)."""

    name = "mla_fp8_unsaturated"
    mla_impl_type = UnsaturatedFp8WriteImpl


class Fp8RopeUnscaledImpl(TorchMLAImpl):
    def store_kv(  # type: ignore[override]
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cache: LatentKVCache,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata | None = None,
    ) -> None:
        if cache.scale is not None:
            # the bug: the rope part stored as fp8(k_pe), outside the one scale (as FlashMLA's
            # fp8_ds_mla entry keeps its rope apart), where concat_and_cache_mla scales it too
            k_pe = (k_pe.float() * cache.scale).to(k_pe.dtype)
        super().store_kv(kv_c, k_pe, cache, slot_mapping, meta)


class MlaFp8RopeUnscaledBackend(TorchBackend):
    """Quantizes an fp8 latent's rope part without the per-tensor scale."""

    name = "mla_fp8_rope_unscaled"
    mla_impl_type = Fp8RopeUnscaledImpl


F32 = torch.float32


# --- 17. split-KV decoding whose split count follows the batch ----------------------------------
class BatchDependentSplitsImpl(TorchAttentionImpl):
    """Decodes in ``1 + (position + the step's token count) % 3`` key splits, each computed in
    float32 and merged by their LSEs (a split-KV heuristic that reads the batch, as
    FlashAttention's ``num_splits=0`` does). Right within float32 rounding, wherever the request
    sits; its bits follow its place and its companions."""

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        super().attend(query, key, value, cache, meta, out, lse)  # type: ignore[arg-type]
        spec, batch = self.spec, meta.batch
        qsl = batch.query_start_loc_cpu.tolist()
        for r in range(batch.num_reqs):
            s = int(batch.seq_lens_cpu[r])
            if qsl[r + 1] - qsl[r] != 1:
                continue
            splits = min(s, 1 + (r + batch.num_actual_tokens) % 3)  # the bug
            k, v = reference.read_sequence(cache, batch.block_table[r], s)
            q = query[qsl[r] : qsl[r] + 1]
            bounds = [s * i // splits for i in range(splits + 1)]
            parts = [
                reference.attention(q, k[a:b], v[a:b], scale=spec.scale, compute_dtype=F32)
                for a, b in itertools.pairwise(bounds)
            ]
            o, o_lse = parts[0]
            for o2, lse2 in parts[1:]:
                o, o_lse = reference.merge_attn_states(o, o_lse, o2, lse2)
            out[qsl[r] : qsl[r] + 1] = o.to(out.dtype)


class BatchDependentSplitsBackend(TorchBackend):
    """Declares bitwise batch invariance for float32; its decodes' bits follow the batch."""

    name = "batch_dependent_splits"
    capabilities = replace(
        TorchBackend.capabilities,
        dtypes=frozenset({torch.float32}),
        softcap=False,
        alibi=False,
        sinks=False,
        sliding_window=False,
        batch_invariant=attnhub.BatchInvariance(dtypes=frozenset({torch.float32})),
    )
    impl_type = BatchDependentSplitsImpl


# --- 18. values read at the key's head size: truncated to head_size, zero-padded back -----------
class KeyWidthValuesImpl(PerRequestImpl):
    """A kernel written for one head size: it keeps ``min(head_size, head_size_v)`` channels
    of each value (a tile as wide as the key's) and leaves the rest of the output zero. Right
    wherever values are no wider than keys (MLA's 192/128 included); wrong past head_size."""

    def values(self, v: torch.Tensor) -> torch.Tensor:
        kept = v.clone()
        kept[..., self.spec.head_size :] = 0
        return kept


class TruncatesValuesBackend(TorchBackend):
    name = "truncates_values"
    impl_type = KeyWidthValuesImpl


# --- a layer call that returns a fresh tensor instead of filling output= -------------------------
class FreshOutputImpl(TorchAttentionImpl):
    def forward(self, query, key, value, cache, meta, *, output=None, return_lse=False, lse=None):  # type: ignore[no-untyped-def, override]
        # output= dropped: a fresh tensor comes back, right for a caller that uses what forward
        # returns (eager model code), lost to one that reads its buffer (a compiled graph's op)
        if return_lse or lse is not None:
            return super().forward(query, key, value, cache, meta, return_lse=True, lse=lse)
        return super().forward(query, key, value, cache, meta)


class IgnoresOutputBufferBackend(TorchBackend):
    """Returns a fresh tensor where forward is given output=: eager code that uses the return
    value is right; a compiled model, whose op reads the buffer it passed, is not."""

    name = "ignores_output_buffer"
    impl_type = FreshOutputImpl


MUTANTS = (
    MlaIgnoresRopeBackend,
    MlaLatentScaleBackend,
    MlaDropsFp8ScaleBackend,
    MlaUnsaturatedFp8Backend,
    MlaFp8RopeUnscaledBackend,
    MlaFp8QueryUnquantizedBackend,
    TopLeftCausalBackend,
    WritesPaddingBackend,
    IgnoresWindowBackend,
    SyncsInForwardBackend,
    BakesHostPlanBackend,
    CorruptsOnBadSlotBackend,
    ScaleOffBackend,
    LooseToleranceBackend,
    OverclaimsAccuracyBackend,
    ValueScaleOffBackend,
    IgnoresRowStrideBackend,
    LosesPrecisionPast16kBackend,
    NoMaxSubtractionBackend,
    RefusesAfterWriteBackend,
    MemoizesPerLayerBackend,
    LseBase2Backend,
    BatchDependentSplitsBackend,
    TruncatesValuesBackend,
    IgnoresOutputBufferBackend,
)


# --- well-behaved variants: the suite must adapt to what they declare, and pass ----------------
class RefusesContextBuilder(TorchMetadataBuilder):
    reorder_batch_threshold = 1

    def plan(self, step: Step) -> Mapping[str, Any]:
        q, ctx = step.batch.query_lens_cpu, step.batch.context_lens_cpu
        if bool(((q > 1) & (ctx > 0)).any()):
            raise UnsupportedConfigurationError(
                self.backend.name, ["prefill requests with cached context are not supported"]
            )
        return super().plan(step)


class RestrictedBackend(TorchBackend):
    """Declares little: fp16, head sizes 128/256, block sizes of 16s, one feature, no chunked
    prefill (refused in build), decodes first."""

    name = "restricted"
    capabilities = replace(
        TorchBackend.capabilities,
        dtypes=frozenset({torch.float16}),
        head_sizes=frozenset({128, 256}),
        block_size_multiple=16,
        kv_cache_dtypes=frozenset({"auto"}),
        attn_types=frozenset({AttentionType.DECODER}),
        softcap=False,
        alibi=False,
        sinks=False,
        multi_token_decode=False,
        chunked_prefill=False,
        graph_capture=GraphSupport.NEVER,
        # MLA too: fp16, blocks of 16s, the joint layout, decode only, no LSE
        mla=replace(
            TorchBackend.capabilities.mla,
            dtypes=frozenset({torch.float16}),
            kv_cache_dtypes=frozenset({"auto"}),
            block_size_multiple=16,
            latent_sizes=frozenset({(64, 16), (512, 64)}),
            layouts=("joint",),
            max_query_len=1,
            lse=LseSupport(reason="declared without it"),
        ),
    )

    def metadata_builder(self) -> Any:
        if self.is_mla:
            return super().metadata_builder()
        return RefusesContextBuilder(self)


class CascadeBackend(TorchBackend):
    """Declares cascade: attention over a shared prefix is plain attention over the same blocks,
    so the torch backend's per-request computation is already right."""

    name = "declares_cascade"
    capabilities = replace(TorchBackend.capabilities, cascade=True)


class FakeVendorBackend(TorchBackend):
    """A vendor backend whose hardware is absent: usable only through its 'emulator'."""

    name = "fake_vendor"

    @classmethod
    def availability(cls, device: torch.device | str, emulate: bool = False) -> str | None:
        return None if emulate else "the fake vendor's accelerator is not present"

    @classmethod
    def is_emulated(cls, device: torch.device | str) -> bool:
        return True


class DenseRowsOnlyImpl(TorchAttentionImpl):
    def compute(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        # refused before its kernels write anything (the cache stays byte-identical)
        for name, t in (("query", query), ("key", key), ("value", value), ("output", out)):
            if t is not None and not t.is_contiguous():
                raise InvalidInputError(
                    f"{name} has strides {t.stride()}: this backend's kernels read and write "
                    "dense rows (pass .contiguous() tensors)"
                )
        super().compute(query, key, value, cache, meta, out, lse)


class DenseRowsOnlyBackend(TorchBackend):
    """Refuses strided rows (fused-QKV views, a strided output) with a reason, before any
    write: a conforming choice, reported as not supported."""

    name = "dense_rows_only"
    capabilities = replace(TorchBackend.capabilities, dtypes=frozenset({torch.bfloat16}))

    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> TorchAttentionImpl:
        return DenseRowsOnlyImpl(self, alibi_slopes=alibi_slopes, sinks=sinks)


class Fp8QueryMLAImpl(TorchMLAImpl):
    """The absorbed form over the query quantized as declared (fp8 e4m3, static scale 1.0: its
    values are exact in the model dtype)."""

    def attend(  # type: ignore[override]
        self,
        query: torch.Tensor,
        cache: LatentKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        scheme = self.backend.capabilities.mla.query_quantization.get(self.spec.kv_cache_dtype)
        if scheme is not None:
            query = simulate_query_quantization(query, scheme).to(query.dtype)
        super().attend(query, cache, meta, out, lse)


class Fp8QueryMLABackend(TorchBackend):
    """An MLA backend whose fp8 kernel quantizes the query, as it declares: it conforms."""

    name = "mla_fp8_query"
    capabilities = replace(TorchBackend.capabilities, mla=FP8_QUERY_MLA)
    mla_impl_type = Fp8QueryMLAImpl


VARIANTS = (
    RestrictedBackend,
    CascadeBackend,
    FakeVendorBackend,
    DenseRowsOnlyBackend,
    Fp8QueryMLABackend,
)


def pytest_configure() -> None:
    for cls in (*MUTANTS, *VARIANTS):
        attnhub.register_backend(cls, replace=True)
