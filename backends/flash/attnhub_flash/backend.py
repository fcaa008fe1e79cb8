"""The ``flash`` backend: attnhub's protocol translated into FlashAttention's calling conventions.

One backend name, five providers (see ``ops.py``); the provider is fixed per class, and each
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
  vllm-fa3  the same with fa_version=3, s_aux= (sinks) and scheduler_metadata= (FA3's tile
            schedule, planned once per step by get_scheduler_metadata, as vLLM does)
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

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from attnhub.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
)
from attnhub.batch import BatchMetadata
from attnhub.capabilities import AccuracyBound, Capabilities, GraphSupport, Refusal, Tolerance
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.kit import as_contiguous, indexable, quantize_fp8
from attnhub.kv_cache import PagedKVCache
from attnhub.spec import AttentionSpec, AttentionType
from attnhub_flash import ops

TOLERANCES = {
    # The kernels accumulate in float32 over fp16/bf16 operands and round once (as the
    # emulator does); the suite's caps.
    torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
    torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2),
}
CascadePolicy = Literal["auto", "always", "never"]
#: FA3's ``num_splits``: 0 = the kernel's own split-KV heuristic, what vLLM passes outside full
#: CUDA graphs (it must be the same in get_scheduler_metadata and the attention call).
NUM_SPLITS = 0
#: Upstream FA2's paged block sizes: "Paged KV cache block size must be divisible by 256"
FA2_PAGE_MULTIPLE = 256
#: vLLM's fork, FA3 with s_aux: "We only support query heads <= 64 with S aux", and
#: "We only support bf16 dtype for S aux." [source: the fork's hopper/flash_api.cpp]
S_AUX_MAX_HEADS = 64
HALF = frozenset({torch.float16, torch.bfloat16})
ALL_TYPES = frozenset(AttentionType)
FP8_KV = "fp8_e4m3"
#: FA3's fp8 path (vLLM's fork with fa_version=3, and upstream hopper): q, k and v all fp8
#: e4m3 with float32 descales; the query quantized with a static scale as vLLM does
#: (``ops.scaled_fp8_quant(query, layer._q_scale)``, 1.0 unless the checkpoint sets one); the
#: softmax probabilities rounded to e4m3 before ``P @ V`` (hopper/softmax.h ``Max_offset``).
#: The accuracy bound is what the emulated kernels measure on the suite's standard cases
#: (worst over head sizes 64-256, block sizes, GQA, windows, softcap, sinks), rounded up:
#: docs/backends/flash.md.
FA3_FP8 = dict(
    kv_cache_dtypes=frozenset({"auto", FP8_KV}),
    query_quantization={FP8_KV: "fp8_static"},
    probability_quantization={FP8_KV: "fp8_e4m3"},
    quantization_accuracy={FP8_KV: AccuracyBound(max_abs_error=0.3, min_cosine=0.995)},
)


_NO_DESCALES: dict[str, Any] = {}  # a model-dtype cache: no fp8 descales


def _caps(**fields: Any) -> Capabilities:
    base: dict[str, Any] = dict(
        devices=frozenset({"cuda", "cpu"}),  # cpu: through the emulator only (emulate=True)
        dtypes=HALF,
        kv_cache_dtypes=frozenset({"auto"}),
        kv_cache_layout="NHD",
        # K/V planes may be strided views (vLLM's per-layer tensor holds a slot's key and
        # value side by side) with a contiguous last dim: flash-attn checks only
        # `k.stride(-1) == 1` and addresses paged blocks, rows and heads through the planes'
        # own strides [source: flash_api.cpp]; reshape_and_cache_flash indexes both planes
        # with key_cache's strides (so the impl refuses planes whose strides differ) and the
        # scatter writes through (block, offset) indices. FlashAttentionImpl.check_planes.
        strided_kv_cache=True,
        attn_types=ALL_TYPES,
        sliding_window=True,
        softcap=True,
        multi_token_decode=True,
        chunked_prefill=True,
        # common_prefix_len: a prefix call, a suffix call and an LSE merge (vLLM's cascade)
        cascade=True,
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
    # vLLM's fork with fa_version=3 (Hopper): s_aux sinks, bf16, contiguous, at most 64 query
    # heads [source: the fork's hopper/flash_api.cpp] (FlashBackend.unsupported_reasons);
    # no ALiBi [schema: the wrapper asserts alibi_slopes is None on FA3].
    "vllm-fa3": _caps(
        max_head_size=256,
        head_size_multiple=8,
        block_size_multiple=16,
        alibi=False,
        sinks=True,
        priority={"cuda": 85},
        **FA3_FP8,
    ),
    # Upstream FA2: "Paged KV cache block size must be divisible by 256" [source:
    # flash_api.cpp]: any multiple of 256 is taken (FlashFA2Backend.unsupported_reasons);
    # block_sizes lists the ones the conformance suite tries. Head sizes up to 256, multiples
    # of 8 (others are padded by the Python wrapper, which would copy the cache).
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
        **FA3_FP8,
    ),
    # FA4: _validate_head_dims: SM90 8..256, SM100/110 8..128 or 256, multiples of 8 for
    # 16-bit dtypes [source]: the union here, each GPU's own rule and the paged-KV head-dim
    # rule in _fa4_refusals; any page size for head sizes that are multiples of 16, 128 the
    # TMA fast path [schema]; learnable_sink [schema].
    "fa4": _caps(
        max_head_size=256,
        head_size_multiple=8,
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
        "kv_cache_dtype": "fp8 caches need fa_version=3: provider vllm-fa3",
    },
    "vllm-fa3": {
        "block_size": "vLLM's flash-attention fork takes paged blocks in multiples of 16",
        "head_size": "vLLM's flash-attention fork takes head sizes in multiples of 8 up to 256",
        "alibi": "vLLM's fork has no ALiBi with fa_version=3",
        "kv_cache_dtype": "FA3 takes fp8 e4m3 caches only",
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
        "kv_cache_dtype": "FA3 takes fp8 e4m3 caches only",
    },
    "fa4": {
        "alibi": "FA4 has no ALiBi (score_mod could express it; not done)",
        "head_size": "FA4 takes head sizes in multiples of 8 up to 256 (SM90), 8..128 or 256 "
        "(SM100/110)",
        "kv_cache_dtype": "FA4's fp8 path is not used yet",
    },
}
_COMMON_WHY = {"dtype": "FlashAttention kernels take float16 and bfloat16"}


@dataclass(frozen=True)
class KernelArgs:
    """The length and table arguments of one attention call over the paged cache."""

    query_start_loc: torch.Tensor  # [B + 1] int32, device: cumulative query lengths
    max_query_len: int
    seq_lens: torch.Tensor  # [B] int32, device: keys per sequence (seqused_k, cache_seqlens)
    cu_seqlens_k: torch.Tensor | None  # [B + 1] int32, device: cumulative keys (FA2 only)
    max_seq_len: int
    block_table: torch.Tensor  # [B, blocks] int32, contiguous, device
    causal: bool
    #: Every sequence has one query token and the tokens are exactly the sequences: FA2 and
    #: FA3 take their padded-batch decode path (q viewed as (B, 1, H, D)).
    decode_only: bool = False
    #: vllm-fa3: FA3's tile schedule for this call, planned once per step by the fork's
    #: get_scheduler_metadata (as vLLM's builder does) instead of by every layer's call.
    scheduler_metadata: torch.Tensor | None = None
    #: The call's keyword arguments that are the same for every layer of a backend (this
    #: call's lengths and table, the spec's scale, window and softcap), made by the first
    #: layer that calls with them and reused by the others (keyed by the backend). Not an
    #: argument: every copy (``dataclasses.replace``) starts empty.
    step_kwargs: dict[Any, dict[str, Any]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )


@dataclass(frozen=True)
class FlashAttentionMetadata(AttentionMetadata):
    """One step, planned: every argument of the kernels, ready to pass."""

    provider: str = "vllm"
    num_actual_tokens: int = 0
    main: KernelArgs | None = None  # the one call of a step (None: no tokens)
    #: Cascade: the shared prefix as one non-causal call of every query token over the
    #: prefix blocks, then ``suffix`` (each request over its own blocks), merged by LSE.
    prefix: KernelArgs | None = None
    suffix: KernelArgs | None = None
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int64, device (vLLM's write)
    write_rows: torch.Tensor | None = None  # [m] int64: tokens that have a slot (scatter)
    write_slots: torch.Tensor | None = None  # [m] int64: their slots

    @property
    def cascade(self) -> bool:
        return self.prefix is not None


def use_cascade(
    common_prefix_len: int,
    query_lens: torch.Tensor,  # [B] int, host
    num_heads: int,
    num_kv_heads: int,
    *,
    use_alibi: bool,
    use_sliding_window: bool,
    num_sms: int,
) -> bool:
    """vLLM's heuristic (``vllm/v1/attention/backends/flash_attn.py: use_cascade_attention``):
    is a shared prefix worth a separate call? A rough CTA-count model of FlashDecoding against
    the cascade's prefix pass [callers]."""
    if common_prefix_len < 256 or use_alibi or use_sliding_window:
        return False
    num_reqs = int(query_lens.numel())
    if num_reqs < 8:
        return False
    group = num_heads // num_kv_heads
    flash_decoding = group > 1 and bool((query_lens == 1).all())
    if not flash_decoding:
        return True
    tile = 128
    prefix_tiles = -(-common_prefix_len // tile)
    cascade_ctas = num_heads * -(-num_reqs // tile)
    cascade_time = -(-cascade_ctas // num_sms) * prefix_tiles
    decoding_ctas = num_reqs * num_kv_heads * -(-group // tile) * prefix_tiles
    return cascade_time < -(-decoding_ctas // num_sms)


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
        reasons = [
            r.because(f"provider {cls.provider}: {why[r.field]}") if r.field in why else r
            for r in super().unsupported_reasons(spec)
        ]
        if cls.provider == "fa2":  # any multiple of 256 [source]; block_sizes: the suite's
            reasons = [
                r
                for r in reasons
                if not (r.field == "block_size" and spec.block_size % FA2_PAGE_MULTIPLE == 0)
            ]
        if spec.kv_cache_dtype == FP8_KV and FP8_KV in cls.capabilities.kv_cache_dtypes:
            reasons += _fp8_refusals(cls.provider, spec)
        if cls.provider == "vllm-fa3" and spec.use_sinks:
            reasons += _s_aux_refusals(spec)
        if cls.provider == "fa4" and not any(r.field == "head_size" for r in reasons):
            reasons += _fa4_refusals(spec, ops.fa4_arch())
        return reasons

    def __init__(
        self, spec: AttentionSpec, device: torch.device | str = "cpu", *, emulate: bool = False
    ) -> None:
        super().__init__(spec, device, emulate=emulate)
        #: The provider's modules (or the emulator's namespaces), resolved once per instance.
        self.ops = ops.resolve(self.provider, self.device, emulate)
        if not self.ops.emulated:
            self._check_native_gpu()

    def _check_native_gpu(self) -> None:
        """What the spec needs of this very GPU beyond the provider's own range: FA3's fp8
        kernels exist only on 9.x ('FlashAttention on Ampere/Ada cards only supports fp16 and
        bf16 data type' [source: hopper/flash_api.cpp]); FA4's rules per architecture read the
        device (``unsupported_reasons`` read the current one)."""
        major, minor = torch.cuda.get_device_capability(self.device)
        reasons: list[str] = []
        if self.spec.kv_cache_dtype == FP8_KV and major < 9:
            reasons.append(
                f"kv_cache_dtype {FP8_KV!r} needs compute capability 9.x (provider "
                f"{self.provider}: FA3's fp8 kernels run on Hopper only); this GPU is "
                f"{major}.{minor}"
            )
        if self.provider == "fa4":
            reasons += _fa4_refusals(self.spec, ops.fa4_arch(self.device))
        if reasons:
            raise UnsupportedConfigurationError(self.name, reasons)

    def __repr__(self) -> str:
        mode = ", emulated" if self.emulated else ""
        return f"<{type(self).__name__} 'flash' ({self.provider}) on {self.device}{mode}>"

    def metadata_builder(self) -> FlashMetadataBuilder:
        return FlashMetadataBuilder(self)

    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> FlashAttentionImpl:
        return FlashAttentionImpl(self, alibi_slopes=alibi_slopes, sinks=sinks)


def _s_aux_refusals(spec: AttentionSpec) -> list[Refusal]:
    """The fork's FA3 with s_aux sinks [source: the fork's hopper/flash_api.cpp]: at most 64
    query heads, and the sinks in bf16 only. vLLM passes the layer's sinks in the model's dtype
    (gpt-oss makes them under the model's default dtype), so only bf16 models run sinks there;
    an fp16 model's sinks would lose precision beyond fp16's tolerance in the conversion, so
    attnhub refuses that pairing rather than round them."""
    reasons = []
    if spec.num_heads > S_AUX_MAX_HEADS:
        reasons.append(
            Refusal(
                f"use_sinks with num_heads {spec.num_heads} is not supported (provider "
                f"vllm-fa3: the fork's FA3 takes s_aux sinks with at most {S_AUX_MAX_HEADS} "
                "query heads: 'We only support query heads <= 64 with S aux')",
                field="num_heads",
                value=spec.num_heads,
            )
        )
    if spec.dtype != torch.bfloat16:
        reasons.append(
            Refusal(
                f"use_sinks with dtype {spec.dtype} is not supported (provider vllm-fa3: the "
                "fork's FA3 reads s_aux in bf16 only, 'We only support bf16 dtype for S aux.', "
                "and bf16 sink logits err beyond a float16 model's tolerance)",
                field="dtype",
                value=spec.dtype,
                supported=frozenset({torch.bfloat16}),
            )
        )
    return reasons


def fa4_tile_n(arch: int, head_size: int, *, causal: bool, local: bool) -> int:
    """The key tile (``tile_n``) FA4's forward picks for a head size (head_dim_v the same) on
    ``arch`` [source: flash-attn-4 4.0.0b36 interface.py: ``FwdConfig(128, 128)`` by default
    (SM100/110), ``_tile_size_fwd_sm90`` on SM90]: a paged cache whose page size is not this
    tile is read without TMA, which FA4 refuses for head sizes that are not multiples of 16
    ("Paged KV does not support irregular head dim", flash_fwd_sm90.py / flash_fwd_sm100.py).
    ``local``: a window after ``_resolve_causal_local_window`` (causal alone is not local)."""
    if arch // 10 != 9:
        return 128
    if head_size <= 64 or 96 < head_size <= 128:
        return 128
    if head_size <= 96:
        return 128 if causal or local else 144
    if head_size <= 192:
        return 96 if local else 112
    return 64 if local else 80


def _fa4_refusals(spec: AttentionSpec, arch: int) -> list[Refusal]:
    """What FA4 refuses of ``spec`` on ``arch`` beyond the declared union of head sizes:
    ``_validate_head_dims`` per architecture, and paged KV with a head size that is not a
    multiple of 16 unless the page size is FA4's key tile [source]. A step may be causal or
    not (encoder types, ``causal=False`` steps, a cascade's prefix call), so where the tile
    depends on it (SM90, head sizes 65..96 without a window) such head sizes are refused."""
    hs, bs = spec.head_size, spec.block_size
    name = f"SM{arch}"
    if arch // 10 in (10, 11) and 128 < hs < 256:
        return [
            Refusal(
                f"head_size {hs} is not supported on {name} (provider fa4: "
                "_validate_head_dims: 8..128 in multiples of 8, or 256, on SM100/SM110)",
                field="head_size",
                value=hs,
            )
        ]
    if hs % 16 == 0:
        return []
    local = spec.has_window
    tiles = {fa4_tile_n(arch, hs, causal=c, local=local) for c in (True, False)}
    if tiles == {bs}:
        return []
    want = " or ".join(str(t) for t in sorted(tiles))
    return [
        Refusal(
            f"block_size {bs} with head_size {hs} is not supported on {name} (provider fa4: "
            "paged KV with a head size that is not a multiple of 16 needs the page size to be "
            f"FA4's key tile, here {want}{' depending on causality' if len(tiles) > 1 else ''}: "
            "'Paged KV does not support irregular head dim')",
            field="block_size",
            value=bs,
            supported=frozenset(tiles) if len(tiles) == 1 else None,
        )
    ]


def _fp8_refusals(provider: str, spec: AttentionSpec) -> list[Refusal]:
    """What FA3's fp8 kernels refuse beyond the declaration [source: hopper/flash_api.cpp]."""
    reasons = []
    if spec.dtype != torch.bfloat16:
        reasons.append(
            Refusal(
                f"kv_cache_dtype {FP8_KV!r} with dtype {spec.dtype} is not supported (provider "
                f"{provider}: FA3's fp8 kernels write bfloat16 outputs only: 'For FP8 input, "
                "output must have dtype BF16')",
                field="kv_cache_dtype",
                value=spec.kv_cache_dtype,
            )
        )
    if spec.head_size % 16:
        reasons.append(
            Refusal(
                f"head_size {spec.head_size} is not a multiple of 16 (provider {provider}: "
                "FA3 aligns fp8 head sizes to 16)",
                field="head_size",
                value=spec.head_size,
            )
        )
    return reasons


class FlashVllmBackend(FlashBackend):
    provider = "vllm"
    capabilities = CAPABILITIES["vllm"]


class FlashVllmFA3Backend(FlashBackend):
    provider = "vllm-fa3"
    capabilities = CAPABILITIES["vllm-fa3"]


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
    "vllm-fa3": FlashVllmFA3Backend,
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

    def __init__(self, backend: FlashBackend) -> None:
        super().__init__(backend)
        #: When a shared prefix runs as a cascade: "auto" (vLLM's heuristic, ``use_cascade``),
        #: "always" (whenever it is whole blocks and the spec allows) or "never". The
        #: heuristic models GPU kernels; emulated, "always", so that the cascade path is the
        #: one the suite checks.
        self.cascade_policy: CascadePolicy = "always" if backend.emulated else "auto"
        #: The GPU's SM count, for the heuristic (read once per builder, not per step).
        self._num_sms = (
            0
            if backend.emulated
            else torch.cuda.get_device_properties(backend.device).multi_processor_count
        )

    def plan(self, batch: BatchMetadata, common_prefix_len: int) -> FlashAttentionMetadata:
        provider = self.backend.provider
        dev = self.backend.device
        n = batch.num_actual_tokens
        fields: dict[str, Any] = dict(
            batch=batch,
            common_prefix_len=common_prefix_len,
            provider=provider,
            num_actual_tokens=n,
        )
        if n:
            causal = self.spec.causal and batch.causal
            main = self._kernel_args(
                # int32 and contiguous once per step, not per layer
                as_contiguous(batch.query_start_loc),
                batch.max_query_len,
                as_contiguous(batch.seq_lens),
                batch.seq_lens_cpu,
                batch.max_seq_len,  # checked against the lengths by check_step
                as_contiguous(batch.block_table),
                causal,
                # every query one token: no query is longer than 1 and they are as many as
                # the requests
                decode_only=n == batch.num_reqs and batch.max_query_len == 1,
            )
            fields["main"] = main
            blocks = common_prefix_len // batch.block_size  # whole shared blocks
            if blocks and causal and self._wants_cascade(batch, blocks * batch.block_size):
                fields.update(self._cascade(batch, main, blocks))
        if self.backend.ops.cache_ops is not None:  # vLLM's fork
            # reshape_and_cache_flash skips slot < 0 itself [schema]; int64 as vLLM passes it,
            # and dense: the kernel reads slot_mapping[i] through a raw pointer, with no
            # stride check, so a strided view would write other slots [source:
            # csrc/cache_kernels.cu]
            fields["slot_mapping"] = as_contiguous(batch.slot_mapping, torch.int64)
        else:
            host = batch.host_slot_mapping()[:n].long()
            rows = torch.nonzero(host >= 0).flatten()
            fields["write_rows"] = rows.to(dev)
            fields["write_slots"] = host[rows].to(dev)
        return FlashAttentionMetadata(**fields)

    def _kernel_args(
        self,
        query_start_loc: torch.Tensor,
        max_query_len: int,
        seq_lens: torch.Tensor,  # device
        seq_lens_cpu: torch.Tensor,  # host
        max_seq_len: int,
        block_table: torch.Tensor,
        causal: bool,
        *,
        decode_only: bool = False,
    ) -> KernelArgs:
        cu_k = None
        metadata = None
        if self.backend.provider == "vllm-fa3":
            metadata = self._scheduler_metadata(
                query_start_loc, max_query_len, seq_lens, max_seq_len, block_table, causal
            )
        if self.backend.provider == "fa2":
            # FA2's paged varlen reads the KV lengths from cu_seqlens_k [inferred]
            cu = torch.zeros(seq_lens_cpu.numel() + 1, dtype=torch.int32)
            torch.cumsum(seq_lens_cpu.to(torch.int32), 0, out=cu[1:])
            cu_k = cu.to(self.backend.device)
        return KernelArgs(
            query_start_loc=query_start_loc,
            max_query_len=max_query_len,
            seq_lens=seq_lens,
            cu_seqlens_k=cu_k,
            max_seq_len=max_seq_len,
            block_table=block_table,
            causal=causal,
            decode_only=decode_only,
            scheduler_metadata=metadata,
        )

    def _scheduler_metadata(
        self,
        query_start_loc: torch.Tensor,
        max_query_len: int,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        block_table: torch.Tensor,
        causal: bool,
    ) -> torch.Tensor:
        """FA3's schedule for one call with these arguments (vLLM's
        ``FlashAttentionMetadataBuilder._get_scheduler_metadata``): a device op, no host read.
        ``num_splits=0``: the kernel's heuristic (vLLM fixes it only for full CUDA graphs,
        which this backend does not capture)."""
        spec = self.spec
        left, right = spec.window
        return self.backend.ops.attention.get_scheduler_metadata(
            batch_size=int(block_table.shape[0]),
            max_seqlen_q=max_query_len,
            max_seqlen_k=max_seq_len,
            num_heads_q=spec.num_heads,
            num_heads_kv=spec.num_kv_heads,
            headdim=spec.head_size,
            cache_seqlens=seq_lens,
            qkv_dtype=torch.float8_e4m3fn if spec.kv_cache_dtype == FP8_KV else spec.dtype,
            cu_seqlens_q=query_start_loc,
            page_size=spec.block_size,
            causal=causal,
            window_size=(left, right),
            has_softcap=bool(spec.logits_soft_cap),
            num_splits=NUM_SPLITS,
        )

    def _wants_cascade(self, batch: BatchMetadata, prefix_len: int) -> bool:
        policy = self.cascade_policy
        if policy not in ("auto", "always", "never"):
            raise InvalidInputError(
                f"cascade_policy = {policy!r} is not one of 'auto', 'always', 'never'"
            )
        if policy == "never":
            return False
        spec = self.spec
        if spec.use_alibi or spec.has_window:  # as vLLM: a cascade would break both
            return False
        if policy == "always":
            return True
        return use_cascade(
            prefix_len,
            batch.query_lens_cpu,
            spec.num_heads,
            spec.num_kv_heads,
            use_alibi=spec.use_alibi,
            use_sliding_window=spec.has_window,
            num_sms=self._num_sms,
        )

    def _cascade(self, batch: BatchMetadata, main: KernelArgs, blocks: int) -> dict[str, Any]:
        """The prefix and suffix calls (vLLM's ``cascade_attention``): every query token over
        the ``blocks`` shared blocks, non-causal (every query sits after the prefix); then each
        request causally over the rest of its blocks."""
        table = batch.host_block_table()
        shared = table[:, :blocks]
        if not bool((shared == shared[:1]).all()):
            r = int((shared != shared[:1]).any(1).nonzero()[0, 0])
            raise InvalidInputError(
                f"common_prefix_len = {batch.block_size * blocks} spans {blocks} blocks, but "
                f"block_table[{r}, :{blocks}] = {table[r, :blocks].tolist()} differs from "
                f"block_table[0, :{blocks}] = {table[0, :blocks].tolist()}"
            )
        dev = self.backend.device
        prefix_len = blocks * batch.block_size
        n = batch.num_actual_tokens
        prefix_lens = torch.tensor([prefix_len], dtype=torch.int32)
        suffix_lens = batch.seq_lens_cpu.to(torch.int32) - prefix_len
        prefix = self._kernel_args(
            torch.tensor([0, n], dtype=torch.int32, device=dev),
            n,
            prefix_lens.to(dev),
            prefix_lens,
            prefix_len,
            main.block_table[:1, :blocks].contiguous(),
            causal=False,
        )
        suffix = self._kernel_args(
            main.query_start_loc,
            main.max_query_len,
            suffix_lens.to(dev),
            suffix_lens,
            main.max_seq_len - prefix_len,
            main.block_table[:, blocks:].contiguous(),
            causal=True,
        )
        return dict(prefix=prefix, suffix=suffix)


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
        #: fp8 cache (FA3): the query goes in as fp8(q / q_scale) too, with this static
        #: scale (attnhub's ``fp8_static`` scheme, 1.0 as vLLM's default ``_q_scale``)
        self.fp8 = spec.kv_cache_dtype == FP8_KV
        self._q_scale = ones.clone()
        #: the last K/V planes check_planes accepted (a model calls each layer with its own
        #: cache, step after step: checked once, as the core remembers its cache checks)
        self._planes_ok: tuple[torch.Tensor, torch.Tensor] | None = None
        #: fp8: the descales last made (key scale, value scale, batch size, the descales),
        #: reused while the cache's scale tensors and the batch size are the same
        self._descales_made: tuple[Any, Any, int, dict[str, torch.Tensor]] | None = None
        #: The sinks as the provider's kernel takes them, made once per layer: the fork's FA3
        #: reads s_aux as bf16, contiguous ("We only support bf16 dtype for S aux."
        #: [source: the fork's hopper/flash_api.cpp]); FA4's learnable_sink takes fp16, bf16
        #: or fp32 and gets the layer's own.
        self.kernel_sinks = self.sinks
        if self.sinks is not None and backend.provider == "vllm-fa3":
            self.kernel_sinks = self.sinks.to(torch.bfloat16).contiguous()

    def check_step(self, cache: PagedKVCache, meta: AttentionMetadata) -> None:
        if not isinstance(meta, FlashAttentionMetadata) or meta.provider != self.backend.provider:
            raise InvalidInputError(
                f"meta must come from this flash backend's metadata_builder().build(batch) "
                f"(provider {self.backend.provider}), got {type(meta).__name__}"
            )
        self.check_planes(cache)

    def check_planes(self, cache: PagedKVCache) -> None:
        """What the kernels need of the K/V planes beyond attnhub's shared cache checks (which
        accept strided planes: ``strided_kv_cache=True``): a contiguous last dim (flash-attn's
        ``TORCH_CHECK(k.stride(-1) == 1)``), and for vLLM's ``reshape_and_cache_flash``, which
        addresses both planes with ``key_cache``'s strides, equal strides. O(1); raises
        InvalidInputError before anything is written."""
        key, value = cache.key, cache.value
        ok = self._planes_ok
        if ok is not None and ok[0] is key and ok[1] is value:
            return
        for name, plane in (("key", key), ("value", value)):
            if plane.stride(-1) != 1:
                raise InvalidInputError(
                    f"cache.{name} must have a contiguous last dimension (FlashAttention "
                    f"kernels check stride(-1) == 1), got strides {list(plane.stride())}"
                )
        if self.backend.ops.cache_ops is not None and key.stride() != value.stride():
            raise InvalidInputError(
                f"cache.key strides {list(key.stride())} and cache.value strides "
                f"{list(value.stride())} differ: vLLM's reshape_and_cache_flash addresses both "
                "planes with the key plane's strides"
            )
        self._planes_ok = (key, value)

    # --- KV write ---------------------------------------------------------------------------
    def store_kv(
        self,
        key: torch.Tensor,  # [>= n, num_kv_heads, head_size]
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,  # [n] int32/int64, -1 = padding
    ) -> None:
        self.check_planes(cache)  # write_kv without a step: not checked by check_step
        if slot_mapping.shape[0] == 0:
            return
        if self.backend.ops.cache_ops is not None:  # dense int64, as plan makes it
            self._reshape_and_cache(key, value, cache, as_contiguous(slot_mapping, torch.int64))
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
        fp8 = self.fp8
        cache_ops.reshape_and_cache_flash(
            _dense_rows(key),
            _dense_rows(value),
            cache.key,
            cache.value,
            slots,
            "fp8" if fp8 else "auto",  # fp8: stores fp8(x / scale) with the cache's scales
            cache.key_scale if fp8 else self._k_scale,
            cache.value_scale if fp8 else self._v_scale,
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
        planes = ((cache.key, key, cache.key_scale), (cache.value, value, cache.value_scale))
        for plane, src, scale in planes:
            new = src.index_select(0, rows)
            # fp8: stored fp8(x / scale), as bytes (no fp8 indexing kernels on CPU)
            new = indexable(quantize_fp8(new, scale, plane.dtype) if scale is not None else new)
            dst = indexable(plane)
            new = new.to(dst.dtype)
            page = plane.shape[1]
            if plane.stride(0) == page * plane.stride(1):  # blocks and rows merge into slots
                flat = dst.view(-1, *plane.shape[2:])  # [num_slots, num_kv_heads, head_size]
                flat.index_copy_(0, slots, new)
            else:  # strided blocks (e.g. padded between blocks): (block, offset) indices
                dst.index_put_((slots // page, slots % page), new)

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
        if query.shape[0] != n:  # padding rows past the step's tokens (out is like query)
            query, out = query[:n], out[:n]
        q, target = query, out
        if self.fp8:  # FA3 takes q, k and v in one dtype: fp8(q / q_scale) [source]
            q = quantize_fp8(q, self._q_scale)
        if meta.prefix is None:
            assert meta.main is not None
            result, _ = self._call(q, cache, meta.main, out=target)
            if result is not target:
                target.copy_(result)
            return
        assert meta.suffix is not None
        # the prefix carries no sink (it joins the denominator once: in the suffix call)
        o1, lse1 = self._call(q, cache, meta.prefix, lse=True, sinks=False)
        o2, lse2 = self._call(q, cache, meta.suffix, lse=True)
        assert lse1 is not None and lse2 is not None
        merge_attn_states(target, o1, lse1, o2, lse2)

    def _call(
        self,
        q: torch.Tensor,  # [n, num_heads, head_size]
        cache: PagedKVCache,
        args: KernelArgs,
        *,
        out: torch.Tensor | None = None,
        lse: bool = False,
        sinks: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [n, H, D], LSE [H, n] float32 or None
        """One attention call of this provider over the paged cache. Writes ``out`` where
        the provider takes it (vLLM's fork); the result is returned either way."""
        provider = self.backend.provider
        kernel_sinks = self.kernel_sinks if sinks else None
        if provider in ("vllm", "vllm-fa3"):
            return self._vllm(q, cache, args, out, lse, kernel_sinks)
        if provider == "fa2":
            return self._fa2(q, cache, args, lse)
        if provider == "fa3":
            return self._fa3(q, cache, args, lse)
        return self._fa4(q, cache, args, lse, kernel_sinks)

    def _descales(self, cache: PagedKVCache, a: KernelArgs) -> dict[str, torch.Tensor]:
        """fp8 calls: FA3's ``q/k/v_descale``, float32 (batch, num_kv_heads): the per-tensor
        scales expanded (stride 0, as vLLM passes ``layer._k_scale.expand(...)``); none for
        other caches."""
        if not self.fp8:
            return {}
        k_scale, v_scale = cache.key_scale, cache.value_scale
        assert k_scale is not None and v_scale is not None
        batch = a.block_table.shape[0]
        made = self._descales_made
        if made is not None and made[0] is k_scale and made[1] is v_scale and made[2] == batch:
            return made[3]  # views of the same scale tensors: they read any in-place update
        shape = (batch, self.spec.num_kv_heads)
        descales = {
            "q_descale": self._q_scale.reshape(1, 1).expand(shape),
            "k_descale": k_scale.reshape(1, 1).expand(shape),
            "v_descale": v_scale.reshape(1, 1).expand(shape),
        }
        self._descales_made = (k_scale, v_scale, batch, descales)
        return descales

    def _vllm(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        a: KernelArgs,
        out: torch.Tensor | None,
        lse: bool,
        sinks: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # vLLM's fork: positional order differs from upstream, so keywords only [schema];
        # block_table needs seqused_k [schema]; out= written in place. fa_version=3 takes the
        # sinks as s_aux, bf16 (H,) contiguous [source: the fork's flash_api.cpp].
        # The arguments every layer passes alike are made once per step (_vllm_step_kwargs);
        # the layer's own (ALiBi slopes, sinks, fp8 descales) are added here.
        step = a.step_kwargs.get(self.backend)
        if step is None:
            step = a.step_kwargs[self.backend] = self._vllm_step_kwargs(a)
        result = self.backend.ops.attention.flash_attn_varlen_func(
            q=q,
            k=cache.key,
            v=cache.value,
            out=out,
            alibi_slopes=self.alibi_slopes,
            return_softmax_lse=lse,
            s_aux=sinks,
            **step,
            **(self._descales(cache, a) if self.fp8 else _NO_DESCALES),
        )
        return result if lse else (result, None)

    def _vllm_step_kwargs(self, a: KernelArgs) -> dict[str, Any]:
        """The fork's keyword arguments of one call that do not depend on the layer."""
        return dict(
            cu_seqlens_q=a.query_start_loc,
            max_seqlen_q=a.max_query_len,
            seqused_k=a.seq_lens,
            max_seqlen_k=a.max_seq_len,
            softmax_scale=self.spec.scale,
            causal=a.causal,
            window_size=self.window,
            block_table=a.block_table,
            softcap=self.softcap,
            scheduler_metadata=a.scheduler_metadata,  # vllm-fa3: planned once per step
            num_splits=NUM_SPLITS,
            fa_version=3 if self.backend.provider == "vllm-fa3" else 2,
        )

    def _fa2(
        self, q: torch.Tensor, cache: PagedKVCache, a: KernelArgs, lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        fa = self.backend.ops.attention
        if a.decode_only and not lse:  # the decode kernel (split-KV): q as (B, 1, H, D)
            result = fa.flash_attn_with_kvcache(
                q.unsqueeze(1),
                cache.key,
                cache.value,
                cache_seqlens=a.seq_lens,
                block_table=a.block_table,
                softmax_scale=self.spec.scale,
                causal=a.causal,
                window_size=self.window,
                softcap=self.softcap,
                alibi_slopes=self.alibi_slopes,
            )
            return result.squeeze(1), None
        result = fa.flash_attn_varlen_func(
            q,
            cache.key,
            cache.value,
            a.query_start_loc,
            a.cu_seqlens_k,
            a.max_query_len,
            a.max_seq_len,
            softmax_scale=self.spec.scale,
            causal=a.causal,
            window_size=self.window,
            softcap=self.softcap,
            alibi_slopes=self.alibi_slopes,
            return_attn_probs=lse,  # (out, softmax_lse, S_dmask): the only way to the LSE
            block_table=a.block_table,
        )
        return (result[0], result[1]) if lse else (result, None)

    def _fa3(
        self, q: torch.Tensor, cache: PagedKVCache, a: KernelArgs, lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        shared: dict[str, Any] = dict(
            cache_seqlens=a.seq_lens,
            page_table=a.block_table,
            softmax_scale=self.spec.scale,
            causal=a.causal,
            window_size=self.window,
            softcap=self.softcap,
            return_softmax_lse=lse,
            **self._descales(cache, a),
        )
        fa = self.backend.ops.attention
        if a.decode_only and not lse:
            result = fa.flash_attn_with_kvcache(q.unsqueeze(1), cache.key, cache.value, **shared)
            return result.squeeze(1), None
        # varlen q through cu_seqlens_q / max_seqlen_q [schema; shapes inferred]
        result = fa.flash_attn_with_kvcache(
            q,
            cache.key,
            cache.value,
            cu_seqlens_q=a.query_start_loc,
            max_seqlen_q=a.max_query_len,
            **shared,
        )
        # with the LSE: (out, softmax_lse, *rest), rest the split-KV accumulators [schema]
        return (result[0], result[1]) if lse else (result, None)

    def _fa4(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        a: KernelArgs,
        lse: bool,
        sinks: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # every argument after v by keyword [schema]; returns (out, lse) [schema]
        out, lse_t = self.backend.ops.attention.flash_attn_varlen_func(
            q,
            cache.key,
            cache.value,
            cu_seqlens_q=a.query_start_loc,
            max_seqlen_q=a.max_query_len,
            seqused_k=a.seq_lens,
            max_seqlen_k=a.max_seq_len,
            page_table=a.block_table,
            softmax_scale=self.spec.scale,
            causal=a.causal,
            window_size=self.window_fa4,
            learnable_sink=sinks,
            softcap=self.softcap,
            return_lse=lse,
        )
        return out, lse_t


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` [n, H, D] with each row's heads dense, as reshape_and_cache_flash reads a token
    (``H * D`` consecutive elements from ``t.stride(0)``): a copy only when they are not."""
    if t.is_contiguous() or (t.stride(-1) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2])):
        return t
    return t.contiguous()


def merge_attn_states(
    out: torch.Tensor,  # [n, H, D], written
    o1: torch.Tensor,  # [n, H, D]
    lse1: torch.Tensor,  # [H, n] float32, natural log
    o2: torch.Tensor,
    lse2: torch.Tensor,
) -> None:
    """Two partial attentions over disjoint keys as one (vLLM's ``merge_attn_states``):
    m = max(l1, l2); w_i = exp(l_i - m); out = (w1 o1 + w2 o2) / (w1 + w2). A non-finite LSE
    is an empty part (+inf for FA2 and the fork's FA2, -inf for FA3, the fork's FA3 and FA4):
    weight 0; both empty give 0. Device ops only: no host read."""
    l1, l2 = lse1.t().unsqueeze(-1), lse2.t().unsqueeze(-1)  # [n, H, 1]
    ok1, ok2 = torch.isfinite(l1), torch.isfinite(l2)
    zero = torch.zeros_like(l1)
    l1, l2 = torch.where(ok1, l1, zero), torch.where(ok2, l2, zero)
    m = torch.maximum(torch.where(ok1, l1, l2), torch.where(ok2, l2, l1))
    w1 = torch.where(ok1, torch.exp(l1 - m), zero)
    w2 = torch.where(ok2, torch.exp(l2 - m), zero)
    total = w1 + w2
    merged = (w1 * o1.float() + w2 * o2.float()) / torch.where(total > 0, total, 1.0)
    out.copy_(merged)
