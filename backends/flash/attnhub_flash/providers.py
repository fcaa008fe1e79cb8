"""The six FlashAttention providers, one object each: where its functions live, what its
kernels take and why they refuse the rest, the arguments it needs planned once per step, the
KV write and the attention call. The backend (``backend.py``) never names a provider: its
builder asks the provider for a call's arguments and the write's plan, its impl for the write
and the call; ``ops.py`` resolves the provider's modules (or the emulator's stand-ins for them).

  provider  object    attention (every attention type: the keys are in the paged NHD cache)
  vllm      VLLM      flash_attn_varlen_func(block_table=, seqused_k=, out=, fa_version=2),
                      keywords only
  vllm-fa3  VLLM_FA3  the same with fa_version=3, s_aux= (sinks) and scheduler_metadata= (FA3's
                      tile schedule, planned once per step by get_scheduler_metadata, as vLLM
                      does)
  vllm-flashmla  VLLM_FLASHMLA  as vllm-fa3; MLA layers: FlashMLA's dense decode
                      (vllm.v1.attention.ops.flashmla: get_mla_metadata once per step,
                      flash_mla_with_kvcache per layer) instead of FA3's value query
  fa2       FA2       flash_attn_varlen_func(block_table=, cu_seqlens_k=cumulative KV lengths);
                      decode-only steps: flash_attn_with_kvcache(q (B, 1, H, D), cache_seqlens=)
  fa3       FA3       flash_attn_with_kvcache(page_table=, cache_seqlens=, cu_seqlens_q=,
                      max_seqlen_q=); decode-only steps: the same without cu_seqlens_q,
                      q (B, 1, H, D)
  fa4       FA4       flash_attn_varlen_func(page_table=, seqused_k=, window_size=(None, None)
                      when off, learnable_sink=)
  KV write  vllm, vllm-fa3 and vllm-flashmla: reshape_and_cache_flash (slot < 0 skipped by the
            op); the others (the base class): one index_copy_ of the rows with a slot, planned
            once per step

Each provider is a subclass of ``Provider`` that sets its class attributes and overrides the
hooks where its kernels differ, and one instance of it (``VLLM`` ... ``FA4``; ``PROVIDERS`` by
name). Every ``[inferred]`` vendor semantic relied on is marked where it is used and listed in
docs/backends/flash.md.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from attnhub.batch import BatchMetadata
from attnhub.capabilities import (
    AccuracyBound,
    BatchInvariance,
    Capabilities,
    GraphSupport,
    HeadSizeVSupport,
    LseSupport,
    MlaSupport,
    Refusal,
    Tolerance,
)
from attnhub.errors import InvalidInputError
from attnhub.kit import (
    FixedShapeWrite,
    as_contiguous,
    flat_slots,
    indexable,
    quantize_fp8,
    read_slots,
    store_latent_rows,
    write_slots,
)
from attnhub.kv_cache import PagedKVCache
from attnhub.mla import LatentKVCache, MLASpec
from attnhub.spec import AttentionSpec, AttentionType
from attnhub_flash import ops

if TYPE_CHECKING:
    from attnhub_flash.backend import FlashAttentionImpl, FlashAttentionMetadata, FlashBackend
    from attnhub_flash.mla import FlashMLAImpl

TOLERANCES = {
    # The kernels accumulate in float32 over fp16/bf16 operands and round once (as the
    # emulator does); the suite's caps.
    torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
    torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2),
}
#: FA3's ``num_splits``: 0 = the kernel's own split-KV heuristic, what vLLM passes outside full
#: CUDA graphs (it must be the same in get_scheduler_metadata and the attention call).
NUM_SPLITS = 0
#: FA3's ``num_splits`` in a captured graph (vllm-fa3): vLLM's
#: ``attention_config.flash_attn_max_num_splits_for_cuda_graph`` (32), "the upper bound of the
#: number of splits so that large enough intermediate buffers are pre-allocated during capture"
#: [callers: vllm/v1/attention/backends/flash_attn.py], in the schedule and the call alike.
GRAPH_NUM_SPLITS = 32
#: Upstream FA2's paged block sizes: "Paged KV cache block size must be divisible by 256"
FA2_PAGE_MULTIPLE = 256
#: vLLM's fork, FA3 with s_aux: "We only support query heads <= 64 with S aux", and
#: "We only support bf16 dtype for S aux." [source: the fork's hopper/flash_api.cpp]
S_AUX_MAX_HEADS = 64
HALF = frozenset({torch.float16, torch.bfloat16})
ALL_TYPES = frozenset(AttentionType)
VLLM_FA3_NAME = "vllm-fa3"
VLLM_FLASHMLA_NAME = "vllm-flashmla"
FP8_KV = "fp8_e4m3"
#: FA3's fp8 path (vLLM's fork with fa_version=3, and upstream hopper): q, k and v all fp8
#: e4m3 with float32 descales; the query quantized with a static scale as vLLM does
#: (``ops.scaled_fp8_quant(query, layer._q_scale)``, 1.0 unless the checkpoint sets one); the
#: softmax probabilities rounded to e4m3 before ``P @ V``: ``exp`` of the scores relative to
#: the running row maximum times ``2**8`` (``Max_offset = 8``), rounded to e4m3, the row sum
#: unrounded [source: hopper/softmax.h, flash_fwd_kernel_sm90.h], which is the core's scheme
#: ``attnhub.quant.ProbabilityQuantization.FP8_E4M3`` (the core states the math; this backend,
#: which kernels do it).
#: The accuracy bound is what the emulated kernels measure on the suite's standard cases
#: (worst over head sizes 64-256, block sizes, GQA, windows, softcap, sinks), rounded up:
#: docs/backends/flash.md.
FA3_FP8 = dict(
    kv_cache_dtypes=frozenset({"auto", FP8_KV}),
    query_quantization={FP8_KV: "fp8_static"},
    probability_quantization={FP8_KV: "fp8_e4m3"},
    quantization_accuracy={FP8_KV: AccuracyBound(max_abs_error=0.3, min_cosine=0.995)},
)
#: A value head size other than the key's (``spec.head_size_v``, MLA's expanded prefill among
#: them): FA2 checks v's shape against q's head size (``CHECK_SHAPE(v, ..., head_size)``
#: [source: csrc/flash_attn/flash_api.cpp]; vLLM pads v for it); FA3 (upstream hopper and
#: vLLM's fork, which builds both of its HDIMDIFF kernel families) takes keys in (128, 192]
#: with values in (96, 128] (the hdim 192 x hdimv 128 kernels: DeepSeek's 192 / 128, which
#: vLLM's MLA prefill passes unpadded on Hopper [callers]) and keys <= 64 with values <= 512
#: [source: hopper/flash_api.cpp mha_fwd], on Hopper only. Of the second region attnhub
#: declares values up to 64 (the hdim 64 x 64 kernel) and in (192, 512] (64 x 256 and
#: 64 x 512, the pairs FA3's tests run): for values in (64, 192] the host plans its tiles for
#: hdimv 128 / 192 while the kernel it runs is 64 x 256 [source: get_pagedkv_tma,
#: round_up_headdimv] [inferred: refused]. fp8: the 192 x 128 kernels exist in e4m3, the
#: hdim-64 ones as 64 x 64 only (``_head_size_v_refusals``).
FA3_HEAD_SIZE_V_PAIRS = (((129, 192), (97, 128)), ((8, 64), (8, 64)), ((8, 64), (193, 512)))
HEAD_SIZE_V_FA2 = HeadSizeVSupport(reason="FlashAttention-2 takes one head size for q, k and v")
HEAD_SIZE_V_FA3 = HeadSizeVSupport(
    pairs=FA3_HEAD_SIZE_V_PAIRS,
    reason="FlashAttention-3 takes a value head size other than the key's for keys in "
    "(128, 192] with values in (96, 128], or keys <= 64 with values <= 512 [source: "
    "hopper/flash_api.cpp]; of the latter attnhub serves values <= 64 or > 192 (for values "
    "in (64, 192] the host plans the tiles of another kernel than the 64 x 256 one it runs)",
)
#: FA4 (``_validate_head_dims`` [source: flash-attn-4 4.0.0b36 interface.py]): any pair in
#: 8..256 on SM90; both in 8..128, or (192, 128), on SM100/SM110 (``_fa4_refusals``, per
#: architecture); (64, 512) there is MLA's absorbed shape, which the interface sends to its
#: MLA kernels with ``qv`` (not declared without it).
HEAD_SIZE_V_FA4 = HeadSizeVSupport(
    pairs=(((8, 256), (8, 256)),),
    reason="FA4 takes value head sizes of 8..256 (SM90), or 8..128 and (192, 128) for keys "
    "of 192 (SM100/SM110) [source: _validate_head_dims]",
)
#: MLA's absorbed form through FA3's value query (``qv`` upstream, ``q_v`` in vLLM's fork;
#: attnhub_flash.mla): the latent pairs (kv_lora_rank, qk_rope_head_dim) of the kernels FA3
#: builds for a value query, hdim 64 x hdimv 256 and 512 [source: hopper/flash_api.cpp
#: run_mha_fwd; mha_fwd takes q/k head sizes <= 64 and 'q_v is only supported for hdim_v >=
#: 256', '(Q/K <= 64 and V <= 512)', multiples of 8, padding smaller ones up to these
#: kernels: the emulator takes those, attnhub declares the two unpadded shapes];
#: DeepSeek's (512, 64) among them.
MLA_LATENT_SIZES = frozenset({(256, 64), (512, 64)})
#: FA4's qv: head_dim 64 (the rope part) and head_dim_v 512 (kv_lora_rank) only [source:
#: flash-attn-4 4.0.0b36 interface.py _flash_attn_fwd], DeepSeek's latent.
FA4_MLA_LATENT = (512, 64)
_MLA_WHY = {
    "mla.dtype": "FA3's value query takes float16 and bfloat16 ('q_v is only supported for "
    "fp16 and bf16 data type')",
    "mla.kv_cache_dtype": "FA3's value query takes no fp8 cache (vLLM's FLASH_ATTN_MLA: 'FP8 "
    "FlashAttention MLA not yet supported')",
    "mla.latent_size": "FA3's value-query kernels are built for a rope part of 64 with a "
    "kv_lora_rank of 256 or 512 (hdim 64 x hdimv 256 / 512)",
}


def _fa4_mla_refusals(arch: int) -> list[Refusal]:
    """FA4's qv on ``arch``: "only support Blackwell arch with qv", and on SM90
    ``_validate_head_dims`` refuses head_dim_v 512 before it [source]."""
    if arch // 10 in (10, 11):
        return []
    return [
        Refusal(
            f"MLA is not served on SM{arch} (provider fa4: FA4's qv runs on SM100/SM110 only: "
            "'only support Blackwell arch with qv')",
            field="mla",
            value=arch,
        )
    ]


def _fa4_mla(arch: int) -> MlaSupport:
    """The absorbed MLA form through FA4's ``qv`` (provider fa4), declared where FA4 selects
    Blackwell kernels: ``arch`` is ``FLASH_ATTENTION_ARCH`` when the process sets it, else SM100
    (``ops.fa4_arch("cpu")``: no GPU is asked at import); a native backend on another GPU
    refuses an MLA layer at construction (``FA4Provider.device_refusals``)."""
    if _fa4_mla_refusals(arch):
        return MlaSupport(
            reason=f"provider fa4 on SM{arch}: FA4's qv runs on SM100/SM110 only ('only "
            "support Blackwell arch with qv'; _validate_head_dims refuses head_dim_v 512 on "
            "SM90)"
        )
    return MlaSupport(
        dtypes=HALF,
        kv_cache_dtypes=frozenset({"auto"}),
        latent_sizes=frozenset({FA4_MLA_LATENT}),
        # k and v are two arguments with strides of their own [schema]: vLLM's joint plane or
        # two planes; the write is the scatter (FA4 has no write op)
        layouts=("joint", "split"),
        max_query_len=None,  # varlen q, causal bottom-right as FA4's other calls [inferred]
        lse=LseSupport(dtypes=HALF, reason=_COMMON_WHY["dtype"]),
        tolerances=TOLERANCES,
        reason="provider fa4 (flash_attn.cute's qv): FA4's MLA kernels serve MLA's absorbed "
        "form on SM100/SM110",
        because={
            "mla.dtype": "FA4's qv here in fp16 and bf16 (its fp8 MLA path is not used)",
            "mla.kv_cache_dtype": "FA4's fp8 MLA path is not used",
            "mla.latent_size": "FA4's qv takes head_dim 64 and head_dim_v 512 only ('assert "
            "head_dim_v == 512', 'assert q is None or head_dim == 64')",
        },
    )


def _fa3_mla(block_size_multiple: int, where: str, layouts: tuple[str, ...]) -> MlaSupport:
    """The absorbed MLA form a provider with FA3's value query serves (attnhub_flash.mla)."""
    why = dict(_MLA_WHY)
    if block_size_multiple > 1:
        why["mla.block_size"] = f"{where} takes paged blocks in multiples of {block_size_multiple}"
    return MlaSupport(
        dtypes=HALF,
        kv_cache_dtypes=frozenset({"auto"}),
        block_size_multiple=block_size_multiple,
        latent_sizes=MLA_LATENT_SIZES,
        # k and v are the two parts of vLLM's joint plane (the one vLLM's concat_and_cache_mla
        # writes), or two planes where the write is a scatter: FA3 takes K and V with strides
        # of their own [source]
        layouts=layouts,
        # any query length, causal bottom-right [doc]; vLLM sends queries up to its
        # reorder_batch_threshold (512) through it, longer ones to its expanded prefill
        max_query_len=None,
        lse=LseSupport(dtypes=HALF, reason=_COMMON_WHY["dtype"]),
        tolerances=TOLERANCES,
        reason=f"{where}: FA3's value query serves MLA's absorbed form",
        because=why,
    )


_NO_DESCALES: dict[str, Any] = {}  # a model-dtype cache: no fp8 descales
_COMMON_WHY = {"dtype": "FlashAttention kernels take float16 and bfloat16"}


#: Graph capture, per provider (``Capabilities.graph_capture``), as vLLM's own FlashAttention
#: backend declares it (``FlashAttentionMetadataBuilder._cudagraph_support``: ALWAYS with FA3,
#: UNIFORM_BATCH otherwise) [callers]. Every captured call takes its host ints as the graph's
#: bounds (``max_seqlen_q``: the descriptor's query length, or its token count for a mixed
#: batch; ``max_seqlen_k``: the block table's capacity, as vLLM captures with the max model
#: length) and reads every per-step value from the runner's persistent buffers.
_FA2_GRAPH_WHY = (
    "uniform batches only, as vLLM's FlashAttention backend with FA2: a graph captured with "
    "max_seqlen_q = 1 takes FA2's one-query packed-GQA path, which mixed batches cannot "
    "replay (vLLM: 'these graphs will not work for mixed prefill-decode')"
)
_FA3_GRAPH_WHY = (
    "any batch, as vLLM's FlashAttention backend with FA3: the tile schedule reads the "
    "lengths on the device and the split count is fixed for the graph"
)
_FA4_GRAPH_WHY = (
    "uniform batches only, as vLLM's FlashAttention backend with FA4 (UNIFORM_BATCH: only FA3 "
    "is ALWAYS there); FA4's varlen kernels are compiled and launched for the max_seqlen_q "
    "baked into the graph [inferred]"
)


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
        # with key_cache's strides (so VllmProvider.check_planes refuses planes whose strides
        # differ) and the scatter writes through (block, offset) indices.
        strided_kv_cache=True,
        attn_types=ALL_TYPES,
        sliding_window=True,
        softcap=True,
        multi_token_decode=True,
        chunked_prefill=True,
        # common_prefix_len: a prefix call, a suffix call and an LSE merge (vLLM's cascade)
        cascade=True,
        tolerances=TOLERANCES,
        # Every provider returns each row's natural-log LSE from the attention call itself
        # (return_softmax_lse / return_attn_probs / return_lse), for every dtype and cache it
        # serves, the sink counted where it takes one: docs/backends/flash.md "LSE".
        lse=LseSupport(dtypes=HALF, reason=_COMMON_WHY["dtype"]),
        batch_invariant=BatchInvariance(
            reason="FlashAttention's split-KV heuristic (num_splits=0: vLLM's fork, FA3 and "
            "FA2's decode call, as vLLM passes it outside its batch-invariant mode) picks a "
            "request's key splits from the batch size, heads and SM count, so its reduction "
            "order follows its companions; vLLM's VLLM_BATCH_INVARIANT fixes num_splits=1 "
            "(not done here); FA4 (num_splits=1) is not read for its other per-step choices "
            "[inferred]"
        ),
        head_size_v=HEAD_SIZE_V_FA2,
        mla=MlaSupport(
            reason="not wired yet: FA3's value-query argument (qv upstream, q_v in vLLM's fork, "
            "as vLLM's FLASH_ATTN_MLA calls it) and FlashMLA serve MLA decode on Hopper; "
            "no provider here translates an MLA layer yet"
        ),
    )
    base.update(fields)
    return Capabilities(**base)


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
    #: FA3's ``num_splits`` (the schedule's and the call's): 0 eagerly, a fixed bound in graphs.
    num_splits: int = NUM_SPLITS
    #: Planned for a captured graph (``build_for_graph_capture``): the host ints are the
    #: graph's bounds (``max_seqlen_k``: the block table's capacity, as vLLM captures with the
    #: max model length), every tensor the runner's persistent buffers or made from them on the
    #: device inside the call (FA2's ``cu_seqlens_k``).
    graph: bool = False
    #: The call's keyword arguments that are the same for every layer of a backend (this
    #: call's lengths and table, the spec's scale, window and softcap), made by the builder
    #: once per step (``Provider.step_kwargs``); layers only read them.
    step_kwargs: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


Result = tuple[torch.Tensor, torch.Tensor | None]  # [n, H, D], LSE [H, n] float32 or None


def _padded_lse(lse: torch.Tensor) -> torch.Tensor:  # [H, B] (a view)
    """A padded-batch decode call's LSE, ``(batch, nheads, seqlen_q=1)`` [doc], as the varlen
    calls' ``[H, n]`` (one token per sequence: row b is token b)."""
    return lse[:, :, 0].t()


@dataclass(frozen=True)
class _Slots:
    """What vLLM's KV write reads of a step's metadata, for a write without a step."""

    slot_mapping: torch.Tensor  # [n] int64, dense


class Provider(abc.ABC):
    """One FlashAttention provider: the attributes say where its functions live, what its
    kernels take and why they refuse the rest; the methods are the hooks the backend calls,
    each overridden where a provider's kernels differ. The base class is what most share: the
    KV write as one scatter planned once per step, a window spelled ``(left, right)`` with -1
    for no bound, sinks as the layer gives them."""

    name: ClassVar[str]
    #: What its LSE holds for a row that sees no key: +inf (FA2 and the fork's FA2: attnhub's
    #: convention) or -inf (FA3, the fork's FA3, FA4), docs/backends/flash.md "LSE" [source].
    empty_lse: ClassVar[float] = math.inf
    #: Where its functions live (``ops.resolve`` imports them, or takes the emulator's).
    source: ClassVar[ops.Source]
    #: What its kernels take (the backend class's ``capabilities``).
    capabilities: ClassVar[Capabilities]
    #: Why its kernels refuse what ``capabilities`` refuses, per refused field.
    why: ClassVar[Mapping[str, str]]
    #: Whether a captured call takes a host-planned value that must be refreshed before every
    #: replay (``refresh_graph_args``; the builder's ``update_graph_params`` then calls it).
    graph_updates: ClassVar[bool] = False
    #: FA2's kernels (upstream and the fork's ``fa_version=2``): on their causal branch the
    #: ALiBi bias is ``+slope * j`` ("we add the same bias vector to all rows"), the same
    #: softmax as ``-slope * |i + Sk - Sq - j|`` but an LSE higher by ``slope`` times the
    #: query's position [source: csrc/flash_attn/src/mask.h ``Mask::apply_mask``]:
    #: ``unbias_alibi_lse`` takes it off.
    causal_alibi_column_bias: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"<FlashAttention provider {self.name!r}>"

    # --- availability and refusals (once, at setup) ---------------------------------------
    def native_reason(self, device: torch.device) -> str | None:
        """Why this provider cannot run on ``device`` beyond its modules and its range of
        compute capabilities (None: it can). Asked by ``ops.unavailable_reason``."""
        return None

    def refusals(self, spec: AttentionSpec, declared: list[Refusal]) -> list[Refusal]:
        """``declared`` (what ``capabilities`` refuses of ``spec``), each with the provider's
        reason, and what its kernels refuse beyond the declaration."""
        why = {**_COMMON_WHY, **self.why}
        reasons = [
            r.because(f"provider {self.name}: {why[r.field]}") if r.field in why else r
            for r in declared
        ]
        if spec.kv_cache_dtype == FP8_KV and FP8_KV in self.capabilities.kv_cache_dtypes:
            reasons += _fp8_refusals(self.name, spec)
        return reasons

    def device_refusals(self, spec: AttentionSpec, device: torch.device) -> list[str]:
        """What ``spec`` needs of this very GPU beyond the provider's range (a native backend,
        at construction): FA3's fp8 kernels and its value query (MLA) exist only on 9.x
        ('FlashAttention on Ampere/Ada cards only supports fp16 and bf16 data type', 'q_v is
        only supported for Hopper GPUs' [source: hopper/flash_api.cpp])."""
        major, minor = torch.cuda.get_device_capability(device)
        if isinstance(spec, MLASpec) and major != 9:
            # mha_fwd: 'q_v is only supported for Hopper GPUs'; run_mha_fwd builds the hdim 64
            # x hdimv 256 / 512 kernels for Arch == 90 only [source: hopper/flash_api.cpp]
            return [
                f"MLA needs compute capability 9.x (provider {self.name}: FA3's value query "
                f"runs on Hopper only); this GPU is {major}.{minor}"
            ]
        if spec.kv_cache_dtype == FP8_KV and major < 9:
            return [
                f"kv_cache_dtype {FP8_KV!r} needs compute capability 9.x (provider "
                f"{self.name}: FA3's fp8 kernels run on Hopper only); this GPU is "
                f"{major}.{minor}"
            ]
        return []

    def check_planes(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """What the kernels need of the K/V planes beyond attnhub's shared cache checks (which
        accept strided planes): a contiguous last dim (flash-attn's
        ``TORCH_CHECK(k.stride(-1) == 1)``). O(1); raises InvalidInputError."""
        for name, plane in (("key", key), ("value", value)):
            if plane.stride(-1) != 1:
                raise InvalidInputError(
                    f"cache.{name} must have a contiguous last dimension (FlashAttention "
                    f"kernels check stride(-1) == 1), got strides {list(plane.stride())}"
                )

    # --- per step (the builder) -----------------------------------------------------------
    def kernel_args(
        self,
        backend: FlashBackend,
        query_start_loc: torch.Tensor,  # [B + 1] int32, device
        max_query_len: int,
        seq_lens: torch.Tensor,  # [B] int32, device
        seq_lens_cpu: torch.Tensor,  # [B] int, host
        max_seq_len: int,
        block_table: torch.Tensor,  # [B, blocks] int32, contiguous, device
        causal: bool,
        decode_only: bool = False,
        graph: bool = False,
    ) -> KernelArgs:
        """The arguments of one attention call, made once per step for every layer (``graph``:
        once per captured graph, for every replay of it)."""
        return KernelArgs(
            query_start_loc=query_start_loc,
            max_query_len=max_query_len,
            seq_lens=seq_lens,
            cu_seqlens_k=None,
            max_seq_len=max_seq_len,
            block_table=block_table,
            causal=causal,
            decode_only=decode_only,
            graph=graph,
        )

    def refresh_graph_args(self, backend: FlashBackend, a: KernelArgs) -> bool:
        """Before a replay of a graph captured with ``a``: refresh what the captured call took
        from the host per step, from ``a``'s persistent tensors (already holding the step).
        Returns whether there was anything to refresh. Default: nothing (the captured call
        reads every per-step value from the device)."""
        return False

    def step_kwargs(self, spec: AttentionSpec, a: KernelArgs) -> dict[str, Any]:
        """The keyword arguments of a call with ``a`` that every layer of ``spec`` passes
        alike, made once per step by the builder (``KernelArgs.step_kwargs``). Default: none
        (the call passes ``a``'s fields itself)."""
        return {}

    def plan_graph_write(self, batch: BatchMetadata) -> dict[str, Any]:
        """A captured step's KV write: the persistent slot mapping itself (int64, -1 =
        padding), read on the device by the write (``write_step``) at every replay."""
        return {"slot_mapping": as_contiguous(batch.slot_mapping, torch.int64)}

    def plan_write(
        self, batch: BatchMetadata, device: torch.device, spec: AttentionSpec | None = None
    ) -> dict[str, Any]:
        """The KV write's plan, metadata fields: the rows that have a slot, and their slots
        (``spec``: the backend's, where a provider's write depends on it)."""
        host = batch.host_slot_mapping()[: batch.num_actual_tokens].long()
        rows = torch.nonzero(host >= 0).flatten()
        return {"write_rows": rows.to(device), "write_slots": host[rows].to(device)}

    # --- MLA (attnhub_flash.mla), where capabilities.mla is declared -----------------------
    def mla_kwargs(
        self,
        backend: FlashBackend,
        query_start_loc: torch.Tensor,  # [B + 1] int32, device
        max_query_len: int,
        seq_lens: torch.Tensor,  # [B] int32, device
        max_seq_len: int,
        block_table: torch.Tensor,  # [B, blocks] int32, contiguous, device
    ) -> dict[str, Any]:
        """The keyword arguments of a step's MLA call that every layer passes alike."""
        raise NotImplementedError(f"provider {self.name} has no MLA call")

    def mla_refusals(self, spec: MLASpec) -> list[Refusal]:
        """What the provider refuses of an MLA layer beyond ``capabilities.mla`` (where its
        kernels' architecture decides). Default: nothing."""
        return []

    def mla_plan_write(self, batch: BatchMetadata, device: torch.device) -> dict[str, Any]:
        """The latent write's plan, metadata fields (``mla_plan_slots`` of the step's slots)."""
        n = batch.num_actual_tokens
        return self.mla_plan_slots(batch.host_slot_mapping()[:n], batch.slot_mapping, device)

    def mla_plan_slots(
        self, host: torch.Tensor, slot_mapping: torch.Tensor, device: torch.device
    ) -> dict[str, Any]:
        """Default (no write op of the provider's own): the rows that have a slot (-1:
        padding, never written) and their slots, found on the host, for one scatter."""
        host = host.long()
        rows = torch.nonzero(host >= 0).flatten()
        return {"write_rows": rows.to(device), "write_slots": host[rows].to(device)}

    def mla_write(
        self,
        impl: FlashMLAImpl,
        kv_c: torch.Tensor,  # [>= n, kv_lora_rank]
        k_pe: torch.Tensor,  # [>= n, rope]
        cache: LatentKVCache,
        plan: Mapping[str, Any],  # mla_plan_slots' fields
    ) -> None:
        """A step's latent write. Default: one scatter of the planned rows (the kit's
        ``store_latent_rows``: either layout)."""
        rows, slots = plan["write_rows"], plan["write_slots"]
        if rows is not None and rows.numel():
            store_latent_rows(cache, kv_c.index_select(0, rows), k_pe.index_select(0, rows), slots)

    def mla_attend(
        self,
        backend: FlashBackend,
        query: torch.Tensor,  # [n, H, kv_lora_rank + rope]
        cache: LatentKVCache,
        kwargs: dict[str, Any],
        out: torch.Tensor,  # [n, H, kv_lora_rank]
        lse: bool,
    ) -> Result:
        """A step's one MLA call for a layer. Default: FA3's / FA4's value query (``mla_call``)
        with the query's rope part as ``q``, its latent part as the value query, the rope plane
        as ``k`` and the latent plane as ``v`` (one kv head), as vLLM's
        ``FlashAttnMLAImpl.forward_mqa`` splits them [callers]."""
        R = cache.kv_c.shape[-1]
        return self.mla_call(
            backend,
            query[..., R:],  # q: the rope part
            query[..., :R],  # the value query: the latent part
            cache.k_pe.unsqueeze(-2),  # k: the rope plane, one kv head
            cache.kv_c.unsqueeze(-2),  # v: the latent plane
            kwargs,
            out,
            lse,
        )

    def mla_call(
        self,
        backend: FlashBackend,
        q: torch.Tensor,  # [n, H, rope]
        qv: torch.Tensor,  # [n, H, kv_lora_rank]
        k: torch.Tensor,  # [blocks, block_size, 1, rope]
        v: torch.Tensor,  # [blocks, block_size, 1, kv_lora_rank]
        kwargs: dict[str, Any],
        out: torch.Tensor,  # [n, H, kv_lora_rank]
        lse: bool,
    ) -> Result:
        """One MLA call with FA3's value query over the whole step."""
        raise NotImplementedError(f"provider {self.name} has no MLA call")

    # --- per layer (the impl) -------------------------------------------------------------
    def store_lse(
        self,
        lse: torch.Tensor,  # [n, H] float32: the caller's rows
        kernel_lse: torch.Tensor,  # [H, n] float32: the call's LSE (natural log)
        sinks: torch.Tensor | None,  # the layer's sinks as the kernel took them (layer_sinks)
    ) -> None:
        """A call's LSE into attnhub's ``[tokens, heads]`` rows, an empty row as attnhub has
        it: +inf without a sink; with one, the sink alone (``log exp(sink)``, the reference's
        row with no key). FA2's empty rows are +inf already (and it takes no sinks); the
        -inf of FA3 / FA4 (a sequence with no key: ``store_zero`` without the sink, or a
        fully masked row) is replaced. Device ops only; a finite LSE is untouched."""
        lse.copy_(kernel_lse.t())
        if self.empty_lse == math.inf:
            return
        empty = torch.isneginf(lse)
        if sinks is None:
            lse.masked_fill_(empty, math.inf)
        else:
            lse.copy_(torch.where(empty, sinks.float().view(1, -1), lse))

    def unbias_alibi_lse(
        self,
        lse: torch.Tensor,  # [n, H] float32: the call's rows (store_lse), n > 0
        slopes: torch.Tensor,  # [H] float32: the layer's ALiBi slopes
        a: KernelArgs,
        window: tuple[int, int],  # the layer's (left, right), -1 = unbounded
        block_size: int,
    ) -> None:
        """An ALiBi call's LSE as attnhub has it (the bias ``-slope * |i + Sk - Sq - j|``):
        where the call ran FA2's causal branch (``causal_alibi_column_bias``), each row's
        LSE less ``slope * (i + Sk - Sq)``, its query's position (+inf rows stay +inf).
        Device ops only; a host decision from the call's host ints, as the kernel's."""
        if not self.causal_alibi_column_bias:
            return
        # the kernel's branch [source: flash_api.cpp]: causal forces right to 0, a side at
        # or past seqlen_k is unbounded, and is_causal = left < 0 && right == 0
        seqlen_k = self.kernel_seqlen_k(a, block_size)
        left, right = (-1 if side >= seqlen_k else side for side in window)
        if a.causal:
            right = 0
        if not (left < 0 and right == 0):
            return  # the local / non-causal branch: the bias as attnhub's
        n = lse.shape[0]
        ends = a.query_start_loc[1:]  # each request's query end
        token = torch.arange(n, device=lse.device, dtype=ends.dtype)
        req = torch.searchsorted(ends, token, right=True)
        position = a.seq_lens[req] - ends[req] + token  # i + Sk - Sq of every row
        lse.sub_(position.float()[:, None] * slopes.float()[None, :])

    def kernel_seqlen_k(self, a: KernelArgs, block_size: int) -> int:
        """The ``seqlen_k`` the call's kernel compares the window with: the varlen call's
        ``max_seqlen_k``."""
        return a.max_seq_len

    def window(self, spec: AttentionSpec) -> tuple[Any, Any]:
        """The spec's window as the kernels spell it: (left, right), -1 = unbounded."""
        return spec.window

    def layer_sinks(self, sinks: torch.Tensor | None) -> torch.Tensor | None:
        """A layer's sinks as the kernels take them, made once per layer."""
        return sinks

    def write_step(
        self,
        impl: FlashAttentionImpl,
        key: torch.Tensor,  # [>= n, num_kv_heads, head_size]
        value: torch.Tensor,
        cache: PagedKVCache,
        meta: FlashAttentionMetadata,
    ) -> None:
        """A step's KV write, as ``plan_write`` planned it (a captured step: the fixed-shape
        write of ``plan_graph_write``'s slot mapping)."""
        if meta.graph:
            assert meta.slot_mapping is not None
            scatter_fixed(key, value, cache, meta.slot_mapping)
            return
        assert meta.write_rows is not None and meta.write_slots is not None
        scatter(key, value, cache, meta.write_rows, meta.write_slots)

    def write(
        self,
        impl: FlashAttentionImpl,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,  # [n] int32/int64, -1 = padding; checked on the host
    ) -> None:
        """A KV write without a step (``write_kv`` with a slot mapping)."""
        host = slot_mapping.cpu().long()
        rows = torch.nonzero(host >= 0).flatten()
        dev = impl.backend.device
        scatter(key, value, cache, rows.to(dev), host[rows].to(dev))

    @abc.abstractmethod
    def call(
        self,
        impl: FlashAttentionImpl,
        q: torch.Tensor,  # [n, num_heads, head_size]
        cache: PagedKVCache,
        a: KernelArgs,
        out: torch.Tensor | None,
        lse: bool,
        sinks: torch.Tensor | None,  # the layer's (layer_sinks), None: no sink in this call
    ) -> Result:
        """One attention call of this provider over the paged cache. Writes ``out`` where the
        provider takes it; the result is returned either way."""


class VllmProvider(Provider):
    """vLLM's fork of flash-attention with its FA2 kernels, and vLLM's KV write."""

    name = "vllm"
    source = ops.Source("vllm.vllm_flash_attn", "vllm._custom_ops", "vllm", 8, None)
    # get_supported_head_sizes "multiple of 8 up to 256", MultipleOf(16) block sizes
    # [callers]; ALiBi on FA2 only [schema: the wrapper asserts it away on FA3]; s_aux sinks
    # need fa_version=3 (provider vllm-fa3).
    capabilities = _caps(
        max_head_size=256,
        head_size_multiple=8,
        block_size_multiple=16,
        alibi=True,
        sinks=False,
        priority={"cuda": 80},
        graph_capture=GraphSupport.UNIFORM_BATCH,
        graph_capture_reason=_FA2_GRAPH_WHY,
        mla=MlaSupport(
            reason="provider vllm: the fork's FA2 kernels (fa_version=2) take no value query "
            "(its wrapper passes q_v to FA3 and FA4 only) and one head size for q, k and v; "
            "MLA runs on provider vllm-fa3 (q_v with fa_version=3, as vLLM's FLASH_ATTN_MLA)"
        ),
    )
    why: ClassVar[Mapping[str, str]] = {
        "block_size": "vLLM's flash-attention fork takes paged blocks in multiples of 16",
        "head_size": "vLLM's flash-attention fork takes head sizes in multiples of 8 up to 256",
        "sinks": "vLLM's fork takes s_aux sinks only with fa_version=3, not used here yet",
        "kv_cache_dtype": "fp8 caches need fa_version=3: provider vllm-fa3",
    }
    fa_version: ClassVar[int] = 2
    causal_alibi_column_bias = True  # the fork's FA2 kernels [source: its mask.h]

    def check_planes(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Also equal strides: ``reshape_and_cache_flash`` addresses both planes with
        ``key_cache``'s strides."""
        super().check_planes(key, value)
        if key.stride() != value.stride():
            raise InvalidInputError(
                f"cache.key strides {list(key.stride())} and cache.value strides "
                f"{list(value.stride())} differ: vLLM's reshape_and_cache_flash addresses both "
                "planes with the key plane's strides"
            )

    def plan_write(
        self, batch: BatchMetadata, device: torch.device, spec: AttentionSpec | None = None
    ) -> dict[str, Any]:
        # reshape_and_cache_flash skips slot < 0 itself [schema]; int64 as vLLM passes it, and
        # dense: the kernel reads slot_mapping[i] through a raw pointer, with no stride check,
        # so a strided view would write other slots [source: csrc/cache_kernels.cu]
        return {"slot_mapping": as_contiguous(batch.slot_mapping, torch.int64)}

    def write_step(
        self,
        impl: FlashAttentionImpl,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: PagedKVCache,
        meta: FlashAttentionMetadata | _Slots,
    ) -> None:
        # writes slot_mapping.size(0) tokens (key may be longer: padding), slot < 0 skipped
        # [schema]; the slots dense int64, as plan_write makes them
        cache_ops = impl.backend.ops.cache_ops
        assert cache_ops is not None
        fp8 = impl.fp8
        k_scale, v_scale = (cache.key_scale, cache.value_scale) if fp8 else impl.unit_scales
        cache_ops.reshape_and_cache_flash(
            _dense_rows(key),
            _dense_rows(value),
            cache.key,
            cache.value,
            meta.slot_mapping,
            "fp8" if fp8 else "auto",  # fp8: stores fp8(x / scale) with the cache's scales
            k_scale,
            v_scale,
        )

    def write(
        self,
        impl: FlashAttentionImpl,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        self.write_step(impl, key, value, cache, _Slots(as_contiguous(slot_mapping, torch.int64)))

    def call(
        self,
        impl: FlashAttentionImpl,
        q: torch.Tensor,
        cache: PagedKVCache,
        a: KernelArgs,
        out: torch.Tensor | None,
        lse: bool,
        sinks: torch.Tensor | None,
    ) -> Result:
        # vLLM's fork: positional order differs from upstream, so keywords only [schema];
        # block_table needs seqused_k [schema]; out= written in place. fa_version=3 takes the
        # sinks as s_aux, bf16 (H,) contiguous [source: the fork's flash_api.cpp].
        # The arguments every layer passes alike were made once per step by the builder
        # (step_kwargs); the layer's own (ALiBi slopes, sinks, fp8 descales) are added here.
        result = impl.backend.ops.attention.flash_attn_varlen_func(
            q=q,
            k=cache.key,
            v=cache.value,
            out=out,
            alibi_slopes=impl.alibi_slopes,
            return_softmax_lse=lse,
            s_aux=sinks,
            **a.step_kwargs,
            **(impl.descales(cache, a) if impl.fp8 else _NO_DESCALES),
        )
        return result if lse else (result, None)

    def step_kwargs(self, spec: AttentionSpec, a: KernelArgs) -> dict[str, Any]:
        """The fork's keyword arguments of one call that do not depend on the layer."""
        return dict(
            cu_seqlens_q=a.query_start_loc,
            max_seqlen_q=a.max_query_len,
            seqused_k=a.seq_lens,
            max_seqlen_k=a.max_seq_len,
            softmax_scale=spec.scale,
            causal=a.causal,
            window_size=self.window(spec),
            block_table=a.block_table,
            softcap=spec.logits_soft_cap or 0.0,  # 0.0 = off, the kernels' spelling
            scheduler_metadata=a.scheduler_metadata,  # vllm-fa3: planned once per step
            num_splits=a.num_splits,
            fa_version=self.fa_version,
        )


class VllmFA3Provider(VllmProvider):
    """vLLM's fork with ``fa_version=3`` (Hopper): sinks as ``s_aux``, fp8 caches, FA3's tile
    schedule planned once per step."""

    name = VLLM_FA3_NAME
    empty_lse = -math.inf  # the fork's hopper/softmax.h finalize, epilogue store_zero [source]
    causal_alibi_column_bias = False  # no ALiBi on FA3 (the wrapper asserts it away)
    # vLLM's _is_fa3_supported: "FA3 is only supported on devices with compute capability 9.x"
    source = ops.Source(
        "vllm.vllm_flash_attn",
        "vllm._custom_ops",
        "vllm",
        9,
        9,
        "vLLM: 'FA3 is only supported on devices with compute capability 9.x'",
    )
    # s_aux sinks, bf16, contiguous, at most 64 query heads [source: the fork's
    # hopper/flash_api.cpp] (refusals); no ALiBi [schema: the wrapper asserts alibi_slopes is
    # None on FA3].
    capabilities = _caps(
        max_head_size=256,
        head_size_multiple=8,
        block_size_multiple=16,
        alibi=False,
        sinks=True,
        priority={"cuda": 85},
        head_size_v=HEAD_SIZE_V_FA3,
        graph_capture=GraphSupport.ALWAYS,
        graph_capture_reason=_FA3_GRAPH_WHY + " (get_scheduler_metadata planned into the "
        "graph's persistent buffer before every replay, num_splits 32 as vLLM's graphs)",
        mla=_fa3_mla(16, "provider vllm-fa3 (vLLM's fork, q_v with fa_version=3)", ("joint",)),
        **FA3_FP8,
    )
    why: ClassVar[Mapping[str, str]] = {
        "block_size": "vLLM's flash-attention fork takes paged blocks in multiples of 16",
        "head_size": "vLLM's flash-attention fork takes head sizes in multiples of 8 up to 256",
        "alibi": "vLLM's fork has no ALiBi with fa_version=3",
        "kv_cache_dtype": "FA3 takes fp8 e4m3 caches only",
    }
    fa_version = 3
    graph_updates = True  # the schedule

    def native_reason(self, device: torch.device) -> str | None:
        fork, _ = ops.import_once(self.source.attention)
        why = ops.fork_fa3_unsupported_reason(fork, device)
        return f"provider 'vllm-fa3': {why}" if why else None

    def refusals(self, spec: AttentionSpec, declared: list[Refusal]) -> list[Refusal]:
        reasons = super().refusals(spec, declared)
        reasons += _head_size_v_refusals(self.name, spec, s_aux=True)
        return reasons + _s_aux_refusals(spec) if spec.use_sinks else reasons

    # --- a value head size other than the key's: the KV write -----------------------------
    # vLLM's reshape_and_cache_flash addresses both planes with the key plane's strides
    # (``TORCH_CHECK(key_cache.stride(0) == value_cache.stride(0))`` [source]): vLLM passes
    # two views of one [..., head_size + head_size_v] tensor [callers], attnhub's planes of
    # two widths are two tensors. Such a spec's write is the other providers' scatter (one
    # ``index_copy_`` per plane, planned once per step), the attention call the fork's own.
    def check_planes(self, key: torch.Tensor, value: torch.Tensor) -> None:
        if key.shape[-1] != value.shape[-1]:  # the scatter writes each plane by its strides
            Provider.check_planes(self, key, value)
            return
        super().check_planes(key, value)

    def plan_write(
        self, batch: BatchMetadata, device: torch.device, spec: AttentionSpec | None = None
    ) -> dict[str, Any]:
        if spec is not None and spec.distinct_head_size_v:
            return Provider.plan_write(self, batch, device, spec)
        return super().plan_write(batch, device, spec)

    def write_step(
        self,
        impl: FlashAttentionImpl,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: PagedKVCache,
        meta: FlashAttentionMetadata | _Slots,
    ) -> None:
        if impl.spec.distinct_head_size_v:
            assert not isinstance(meta, _Slots)
            Provider.write_step(self, impl, key, value, cache, meta)
            return
        super().write_step(impl, key, value, cache, meta)

    def write(
        self,
        impl: FlashAttentionImpl,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        if impl.spec.distinct_head_size_v:
            Provider.write(self, impl, key, value, cache, slot_mapping)
            return
        super().write(impl, key, value, cache, slot_mapping)

    def kernel_args(
        self,
        backend: FlashBackend,
        query_start_loc: torch.Tensor,
        max_query_len: int,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        max_seq_len: int,
        block_table: torch.Tensor,
        causal: bool,
        decode_only: bool = False,
        graph: bool = False,
    ) -> KernelArgs:
        """Also FA3's schedule for the call (vLLM's
        ``FlashAttentionMetadataBuilder._get_scheduler_metadata``): a device op, no host read.
        ``num_splits=0``: the kernel's heuristic; in a captured graph the fixed bound vLLM uses
        under full CUDA graphs (``GRAPH_NUM_SPLITS``), and the schedule is the graph's
        persistent buffer, planned again before every replay (``refresh_graph_args``)."""
        a = KernelArgs(
            query_start_loc=query_start_loc,
            max_query_len=max_query_len,
            seq_lens=seq_lens,
            cu_seqlens_k=None,
            max_seq_len=max_seq_len,
            block_table=block_table,
            causal=causal,
            decode_only=decode_only,
            num_splits=GRAPH_NUM_SPLITS if graph else NUM_SPLITS,
            graph=graph,
        )
        schedule = self.schedule(backend, a)
        if graph:  # the buffer the graph reads: this one, refilled in place per step
            schedule = schedule.clone()
        return dataclasses.replace(a, scheduler_metadata=schedule)

    def schedule(self, backend: FlashBackend, a: KernelArgs) -> torch.Tensor:
        """FA3's tile schedule for a call with ``a`` (the fork's get_scheduler_metadata, with
        the same host ints and ``num_splits`` as the call: its layout depends on them)."""
        spec = backend.spec
        return backend.ops.attention.get_scheduler_metadata(
            batch_size=int(a.block_table.shape[0]),
            max_seqlen_q=a.max_query_len,
            max_seqlen_k=a.max_seq_len,
            num_heads_q=spec.num_heads,
            num_heads_kv=spec.num_kv_heads,
            headdim=spec.head_size,
            cache_seqlens=a.seq_lens,
            qkv_dtype=torch.float8_e4m3fn if spec.kv_cache_dtype == FP8_KV else spec.dtype,
            # the tiles the call runs with (they follow v's head size) [source: the fork's
            # mha_fwd_get_scheduler_metadata]
            headdim_v=spec.head_size_v,
            cu_seqlens_q=a.query_start_loc,
            page_size=spec.block_size,
            causal=a.causal,
            window_size=spec.window,
            has_softcap=bool(spec.logits_soft_cap),
            num_splits=a.num_splits,
        )

    def refresh_graph_args(self, backend: FlashBackend, a: KernelArgs) -> bool:
        """The schedule, planned again for this step's lengths (the persistent seq_lens and
        query_start_loc, refilled for it) into the buffer the captured call reads, as vLLM's
        builder writes its ``scheduler_metadata`` buffer before every full-graph replay
        (``_store_scheduler_metadata``). The host ints are the captured call's own (its bounds:
        ``max_seqlen_k`` the table's capacity), so the layout is the captured one [inferred:
        vLLM plans it with the step's own maxima; a bound is as valid a plan and keeps the
        layout the call was captured with]."""
        assert a.scheduler_metadata is not None
        a.scheduler_metadata.copy_(self.schedule(backend, a))
        return True

    def layer_sinks(self, sinks: torch.Tensor | None) -> torch.Tensor | None:
        # s_aux in bf16, contiguous: "We only support bf16 dtype for S aux." [source: the
        # fork's hopper/flash_api.cpp]
        return None if sinks is None else sinks.to(torch.bfloat16).contiguous()

    def mla_plan_slots(
        self, host: torch.Tensor, slot_mapping: torch.Tensor, device: torch.device
    ) -> dict[str, Any]:
        # concat_and_cache_mla skips slot < 0 itself and reads the slots through a raw int64
        # pointer: dense int64, as vLLM passes slot_mapping.flatten() [callers; source]
        return {"slot_mapping": as_contiguous(slot_mapping, torch.int64)}

    def mla_write(
        self,
        impl: FlashMLAImpl,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cache: LatentKVCache,
        plan: Mapping[str, Any],
    ) -> None:
        """vLLM's ``concat_and_cache_mla`` into the joint plane (``MLACommonImpl.
        do_kv_cache_update``: model-dtype caches, where ``scale`` is not read) [callers]."""
        cache_ops = impl.backend.ops.cache_ops
        assert cache_ops is not None
        cache_ops.concat_and_cache_mla(
            kv_c, k_pe, cache.joint, plan["slot_mapping"], "auto", impl.unit_scale
        )

    def mla_kwargs(
        self,
        backend: FlashBackend,
        query_start_loc: torch.Tensor,
        max_query_len: int,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        block_table: torch.Tensor,
    ) -> dict[str, Any]:
        """vLLM's FLASH_ATTN_MLA call but the layer's tensors, with FA3's schedule planned as
        its builder plans it (``_schedule_decode``: one kv head, ``headdim`` the rope size,
        ``headdim_v`` the latent rank, causal, num_splits 0 outside full graphs) [callers]."""
        spec = backend.spec
        assert isinstance(spec, MLASpec)
        schedule = backend.ops.attention.get_scheduler_metadata(
            batch_size=int(block_table.shape[0]),
            max_seqlen_q=max_query_len,
            max_seqlen_k=max_seq_len,
            num_heads_q=spec.num_heads,
            num_heads_kv=1,
            headdim=spec.qk_rope_head_dim,
            cache_seqlens=seq_lens,
            qkv_dtype=spec.dtype,
            headdim_v=spec.kv_lora_rank,
            page_size=spec.block_size,
            cu_seqlens_q=query_start_loc,
            causal=True,
            num_splits=NUM_SPLITS,
        )
        return dict(
            max_seqlen_q=max(max_query_len, 1),
            cu_seqlens_q=query_start_loc,
            max_seqlen_k=max_seq_len,
            seqused_k=seq_lens,
            block_table=block_table,
            softmax_scale=spec.scale,
            causal=True,
            fa_version=3,  # vLLM: "only version 3 is supported"
            scheduler_metadata=schedule,
            num_splits=NUM_SPLITS,
        )

    def mla_call(
        self,
        backend: FlashBackend,
        q: torch.Tensor,
        qv: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kwargs: dict[str, Any],
        out: torch.Tensor,
        lse: bool,
    ) -> Result:
        # keywords only, as FLASH_ATTN_MLA calls it; out= written in place [schema]
        result = backend.ops.attention.flash_attn_varlen_func(
            q=q, k=k, v=v, q_v=qv, out=out, return_softmax_lse=lse, **kwargs
        )
        return result if lse else (result, None)


#: FlashMLA's dense decode (vLLM's FLASHMLA backend) [source: vLLM 0.33
#: vllm/third_party/flashmla/flash_mla_interface.py, FlashMLA csrc/api/dense_decode and
#: sm90/decode/dense/config.h; callers: vllm/v1/attention/backends/mla/flashmla.py]
FLASHMLA_BLOCK_SIZE = 64  # "Currently page_block_size must be 64"; FLASHMLA's [64]
FLASHMLA_LATENT = (512, 64)  # head_size_k 576 (HEAD_DIM_K) = 512 + 64, head_size_v 512
#: FlashMLA's fp8 dense decode (``flash_mla_with_kvcache_fp8``, vllm-project/FlashMLA's
#: csrc/extension/sm90/dense_fp8, which vLLM's FLASHMLA calls for an fp8 cache): q and the joint
#: latent plane both e4m3 ("query and key must have the same dtype"), the query quantized by
#: vLLM's layer with its static per-tensor ``_q_scale`` (``_DecodeConcatQuantFP8``: 1.0 unless
#: the checkpoint sets one; the ``fp8_static`` scheme); ``exp(score - running max)``, not
#: scaled, rounded to e4m3 before ``P @ V`` (``fp8_e4m3_unscaled``), the sum unrounded;
#: bfloat16 output only
#: (``out_type = torch::kBFloat16``) [source: dense_fp8/pybind.cpp, flash_fwd_mla_kernel.h,
#: softmax.h; callers: vllm/model_executor/layers/attention/mla_attention.py]. The accuracy
#: bound is what the emulated kernel measures on the suite's cases, rounded up:
#: docs/backends/flash.md "FlashMLA".
FLASHMLA_FP8: dict[str, Any] = dict(
    query_quantization={FP8_KV: "fp8_static"},
    probability_quantization={FP8_KV: "fp8_e4m3_unscaled"},
    # measured on the emulated kernel: worst 0.296 / 0.99703 over 120 decode steps of the suite's
    # shape (4, 8 and 16 heads, N(0, 1) queries and latents): docs/backends/flash.md
    quantization_accuracy={FP8_KV: AccuracyBound(max_abs_error=0.4, min_cosine=0.995)},
)


def _flashmla_mla() -> MlaSupport:
    """The absorbed MLA form through FlashMLA's dense decode (provider vllm-flashmla)."""
    where = "provider vllm-flashmla (FlashMLA's dense decode, as vLLM's FLASHMLA)"
    return MlaSupport(
        dtypes=HALF,  # "TORCH_CHECK(q_dtype == torch::kBFloat16 || q_dtype == torch::kHalf)"
        # fp8: flash_mla_with_kvcache_fp8 (a kernel of its own), e4m3 only, bfloat16 models only
        # (mla_refusals); vLLM's FLASHMLA declares "fp8" / "fp8_e4m3"
        kv_cache_dtypes=frozenset({"auto", FP8_KV}),
        **FLASHMLA_FP8,
        block_sizes=frozenset({FLASHMLA_BLOCK_SIZE}),
        latent_sizes=frozenset({FLASHMLA_LATENT}),
        num_heads=None,  # any count: "num_heads_q % num_heads_k == 0" with one kv head
        layouts=("joint",),  # k_cache: the joint plane concat_and_cache_mla writes, unsqueezed
        # q is (batch, seq_len_q, heads, 576): one query length for every request of a call
        # (vLLM: QueryLenSupport.UNIFORM); attnhub's steps mix lengths, so decodes only
        max_query_len=1,
        lse=LseSupport(dtypes=HALF, reason=_COMMON_WHY["dtype"]),
        tolerances=TOLERANCES,
        reason=f"{where}: FlashMLA serves MLA's absorbed form in decode steps",
        because={
            "mla.dtype": "FlashMLA's dense decode takes float16 and bfloat16",
            "mla.kv_cache_dtype": "FlashMLA's fp8 dense decode (flash_mla_with_kvcache_fp8) "
            "takes e4m3 only: the query and the cache in float8_e4m3fn; vLLM's FLASHMLA declares "
            "fp8 and fp8_e4m3",
            "mla.block_size": "FlashMLA's dense decode pages by 64 ('Currently page_block_size "
            "must be 64'; vLLM's FLASHMLA declares block size 64)",
            "mla.latent_size": "FlashMLA's SM90 dense kernel is built for head_dim 576 (512 + "
            "64) and head_dim_v 512",
        },
    )


class VllmFlashMLAProvider(VllmFA3Provider):
    """``vllm-fa3`` with MLA layers through FlashMLA (``vllm.v1.attention.ops.flashmla``, the
    ops vLLM's FLASHMLA backend calls) instead of FA3's value query: the same standard
    attention, KV writes and latent write (``concat_and_cache_mla``); per step the builder
    makes one empty ``FlashMLASchedMeta`` (``get_mla_metadata``, as vLLM's builder), which the
    step's first layer call fills with the kernel's tile schedule and every later layer reuses;
    per layer one ``flash_mla_with_kvcache`` call over the joint plane. Why a provider of its
    own: docs/backends/flash.md "FlashMLA"."""

    name = VLLM_FLASHMLA_NAME
    empty_lse = -math.inf  # the standard path is vllm-fa3's; FlashMLA's empty rows are +inf
    source = ops.Source(
        "vllm.vllm_flash_attn",
        "vllm._custom_ops",
        "vllm",
        9,
        9,
        "vLLM: 'FlashMLA Dense is only supported on Hopper devices.'",
        mla_ops="vllm.v1.attention.ops.flashmla",
    )
    capabilities = dataclasses.replace(VllmFA3Provider.capabilities, mla=_flashmla_mla())

    def native_reason(self, device: torch.device) -> str | None:
        why = super().native_reason(device)
        if why:
            return why.replace(VLLM_FA3_NAME, self.name, 1)
        assert self.source.mla_ops is not None
        flashmla, error = ops.import_once(self.source.mla_ops)
        if flashmla is None:
            return f"provider {self.name!r}: {self.source.mla_ops} is not importable: {error}"
        try:
            supported, reason = flashmla.is_flashmla_dense_supported()
        except Exception as exc:
            return f"provider {self.name!r}: is_flashmla_dense_supported() raised {exc!r}"
        return None if supported else f"provider {self.name!r}: vLLM says {reason}"

    def mla_refusals(self, spec: MLASpec) -> list[Refusal]:
        """The fp8 kernel writes bfloat16 output whatever the query's dtype (``out_type =
        torch::kBFloat16`` [source: dense_fp8/pybind.cpp]), which vLLM's layer multiplies by
        ``W_UV`` in the model dtype (``torch.bmm``: one dtype): fp8 latents in bfloat16 models
        only [inferred: vLLM declares float16 with fp8 and its bmm would refuse the pair]."""
        if spec.kv_cache_dtype != FP8_KV or spec.dtype == torch.bfloat16:
            return []
        return [
            Refusal(
                f"MLA kv_cache_dtype {FP8_KV} is not served with dtype "
                f"{str(spec.dtype).removeprefix('torch.')} (provider {self.name}: FlashMLA's fp8 "
                "dense decode writes bfloat16 output only, out_type = torch::kBFloat16)",
                field="mla.kv_cache_dtype",
                value=spec.kv_cache_dtype,
                supported="bfloat16 models",
            )
        ]

    def mla_write(
        self,
        impl: FlashMLAImpl,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cache: LatentKVCache,
        plan: Mapping[str, Any],
    ) -> None:
        """vLLM's ``concat_and_cache_mla`` into the joint plane, as ``vllm-fa3``; over an fp8
        cache with ``kv_cache_dtype`` "fp8_e4m3" and the cache's scale (vLLM's ``_k_scale``):
        each element of ``kv_c`` and ``k_pe`` stored as ``fp8(x / scale)`` [callers:
        ``MLACommonImpl.do_kv_cache_update``; source: csrc/cache_kernels.cu]."""
        if cache.scale is None:
            super().mla_write(impl, kv_c, k_pe, cache, plan)
            return
        cache_ops = impl.backend.ops.cache_ops
        assert cache_ops is not None
        cache_ops.concat_and_cache_mla(
            kv_c, k_pe, cache.joint, plan["slot_mapping"], FP8_KV, cache.scale
        )

    def mla_kwargs(
        self,
        backend: FlashBackend,
        query_start_loc: torch.Tensor,
        max_query_len: int,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        block_table: torch.Tensor,
    ) -> dict[str, Any]:
        """vLLM's FLASHMLA call but the layer's tensors: one ``FlashMLASchedMeta`` for the
        step from ``get_mla_metadata(seq_lens, max_query_len * num_heads, 1)`` as its
        ``FlashMLAMetadataBuilder._build_decode`` asks it (the interface ignores the arguments
        and returns an empty one; the step's first call plans the kernel's tile schedule into
        it and the other layers reuse it, valid while the lengths stay those of this step
        [doc]) [callers]."""
        spec = backend.spec
        assert isinstance(spec, MLASpec)
        mla_ops = backend.ops.mla_ops
        assert mla_ops is not None
        fp8 = spec.kv_cache_dtype == FP8_KV
        schedule, _ = mla_ops.get_mla_metadata(
            seq_lens, max_query_len * spec.num_heads, 1, is_fp8_kvcache=fp8
        )
        if fp8:
            # vLLM's builder with an fp8 cache: the fp8 kernel's own schedule, planned now
            # (get_mla_metadata_dense_fp8), in the FlashMLASchedMeta's two tensors [callers]
            tile_meta, num_splits = mla_ops.get_mla_metadata_dense_fp8(
                seq_lens, max_query_len * spec.num_heads, 1
            )
            return dict(
                block_table=block_table,
                cache_seqlens=seq_lens,
                head_dim_v=spec.kv_lora_rank,
                tile_scheduler_metadata=tile_meta,
                num_splits=num_splits,
                softmax_scale=spec.scale,
                causal=True,
                # the query's static scale: 1.0, vLLM's default _q_scale (a checkpoint's own
                # q_scale has no place in attnhub's protocol yet)
                descale_q=torch.ones(1, dtype=torch.float32, device=seq_lens.device),
            )
        return dict(
            block_table=block_table,
            cache_seqlens=seq_lens,
            head_dim_v=spec.kv_lora_rank,
            tile_scheduler_metadata=schedule,
            softmax_scale=spec.scale,
            causal=True,
            is_fp8_kvcache=False,
        )

    def mla_attend(
        self,
        backend: FlashBackend,
        query: torch.Tensor,  # [n, H, kv_lora_rank + rope]: one token per request
        cache: LatentKVCache,
        kwargs: dict[str, Any],
        out: torch.Tensor,
        lse: bool,
    ) -> Result:
        """``flash_mla_with_kvcache`` as vLLM's ``FlashMLAImpl.forward_mqa`` calls it: q the
        whole query viewed ``(batch, n / batch, H, 576)`` (``reshape_query_for_spec_decode``),
        k_cache the joint plane with a head dim of 1, keywords only [callers]. Its output
        ``(batch, s_q, H, 512)`` is a fresh tensor (``out=`` is not passed, as vLLM), its LSE
        ``(batch, H, s_q)`` is returned as ``[H, n]``."""
        mla_ops = backend.ops.mla_ops
        assert mla_ops is not None
        n, num_heads, width = query.shape
        batch = int(kwargs["cache_seqlens"].shape[0])
        q = query.view(batch, n // batch, num_heads, width)
        if cache.scale is not None:
            # fp8 latents: vLLM's layer quantizes the absorbed query with its static _q_scale
            # (fp8_static), FLASHMLA passes descale_q = _q_scale, descale_k = _k_scale, shape
            # (1,) [callers]; the kernel returns bfloat16 (the model dtype: mla_refusals)
            result, kernel_lse = mla_ops.flash_mla_with_kvcache_fp8(
                q=quantize_fp8(q, kwargs["descale_q"]),
                k_cache=cache.joint.unsqueeze(-2),
                descale_k=cache.scale.reshape(1),
                **kwargs,
            )
        else:
            result, kernel_lse = mla_ops.flash_mla_with_kvcache(
                q=q, k_cache=cache.joint.unsqueeze(-2), **kwargs
            )
        result = result.view(n, num_heads, -1)
        return result, kernel_lse.permute(1, 0, 2).reshape(num_heads, n) if lse else None


class FA2Provider(Provider):
    """Upstream flash-attn 2."""

    name = "fa2"
    source = ops.Source("flash_attn", None, "flash-attn", 8, None)
    # "Paged KV cache block size must be divisible by 256" [source: flash_api.cpp]: any
    # multiple of 256 is taken (refusals); block_sizes lists the ones the conformance suite
    # tries. Head sizes up to 256, multiples of 8 (others are padded by the Python wrapper,
    # which would copy the cache).
    capabilities = _caps(
        max_head_size=256,
        head_size_multiple=8,
        block_sizes=frozenset({256, 512}),
        block_size_multiple=FA2_PAGE_MULTIPLE,
        alibi=True,
        sinks=False,
        priority={"cuda": 70},
        graph_capture=GraphSupport.UNIFORM_BATCH,
        graph_capture_reason=_FA2_GRAPH_WHY,
        mla=MlaSupport(
            reason="provider fa2: FlashAttention-2's flash_attn_varlen_func and "
            "flash_attn_with_kvcache take no value query (no qv argument) and one head size "
            "for q, k and v (at most 256: the absorbed form's 576-wide keys are beyond it)"
        ),
    )
    why: ClassVar[Mapping[str, str]] = {
        "block_size": "upstream FA2's paged KV needs page_block_size a multiple of 256",
        "head_size": "FA2 takes head sizes up to 256 (multiples of 8 without copying the cache)",
        "sinks": "FA2 has no attention sinks",
        "kv_cache_dtype": "FA2 has no fp8 or int8 KV cache",
    }

    causal_alibi_column_bias = True  # FA2's kernels [source: csrc/flash_attn/src/mask.h]

    def kernel_seqlen_k(self, a: KernelArgs, block_size: int) -> int:
        """Also the decode call's: flash_attn_with_kvcache's ``seqlen_k`` is the block table's
        capacity, ``max_num_blocks_per_seq * page_block_size`` [source: flash_api.cpp]."""
        if a.decode_only:
            return a.block_table.shape[1] * block_size
        return a.max_seq_len

    def refusals(self, spec: AttentionSpec, declared: list[Refusal]) -> list[Refusal]:
        # any multiple of 256 [source]; block_sizes: the suite's
        return [
            r
            for r in super().refusals(spec, declared)
            if not (r.field == "block_size" and spec.block_size % FA2_PAGE_MULTIPLE == 0)
        ]

    def kernel_args(
        self,
        backend: FlashBackend,
        query_start_loc: torch.Tensor,
        max_query_len: int,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        max_seq_len: int,
        block_table: torch.Tensor,
        causal: bool,
        decode_only: bool = False,
        graph: bool = False,
    ) -> KernelArgs:
        """Also the cumulative KV lengths: FA2's paged varlen reads them from cu_seqlens_k
        [inferred]. In a captured graph they are made inside the call, on the device, from the
        persistent seq_lens (``call``): host-made ones would be the capture step's forever."""
        cu_k = None
        if not graph:
            cu = torch.zeros(seq_lens_cpu.numel() + 1, dtype=torch.int32)
            torch.cumsum(seq_lens_cpu.to(torch.int32), 0, out=cu[1:])
            cu_k = cu.to(backend.device)
        return KernelArgs(
            query_start_loc=query_start_loc,
            max_query_len=max_query_len,
            seq_lens=seq_lens,
            cu_seqlens_k=cu_k,
            max_seq_len=max_seq_len,
            block_table=block_table,
            causal=causal,
            decode_only=decode_only,
            graph=graph,
        )

    def call(
        self,
        impl: FlashAttentionImpl,
        q: torch.Tensor,
        cache: PagedKVCache,
        a: KernelArgs,
        out: torch.Tensor | None,
        lse: bool,
        sinks: torch.Tensor | None,
    ) -> Result:
        fa = impl.backend.ops.attention
        if a.decode_only:  # the decode kernel (split-KV): q as (B, 1, H, D)
            result = fa.flash_attn_with_kvcache(
                q.unsqueeze(1),
                cache.key,
                cache.value,
                cache_seqlens=a.seq_lens,
                block_table=a.block_table,
                softmax_scale=impl.spec.scale,
                causal=a.causal,
                window_size=impl.window,
                softcap=impl.softcap,
                alibi_slopes=impl.alibi_slopes,
                return_softmax_lse=lse,  # (out, softmax_lse (B, H, 1)) [doc]
            )
            if lse:
                return result[0].squeeze(1), _padded_lse(result[1])
            return result.squeeze(1), None
        cu_k = a.cu_seqlens_k
        if cu_k is None:  # a captured graph: from the persistent seq_lens, on the device
            cu_k = torch.nn.functional.pad(torch.cumsum(a.seq_lens, 0, dtype=torch.int32), (1, 0))
        result = fa.flash_attn_varlen_func(
            q,
            cache.key,
            cache.value,
            a.query_start_loc,
            cu_k,
            a.max_query_len,
            a.max_seq_len,
            softmax_scale=impl.spec.scale,
            causal=a.causal,
            window_size=impl.window,
            softcap=impl.softcap,
            alibi_slopes=impl.alibi_slopes,
            return_attn_probs=lse,  # (out, softmax_lse, S_dmask): the only way to the LSE
            block_table=a.block_table,
        )
        return (result[0], result[1]) if lse else (result, None)


class FA3Provider(Provider):
    """Upstream flash-attn 3 (``hopper/``)."""

    name = "fa3"
    empty_lse = -math.inf  # hopper/softmax.h finalize, epilogue_fwd.hpp store_zero [source]
    # hopper/ builds as the top-level module flash_attn_interface [doc: hopper/README]; it
    # builds sm80 kernels too and runs fp16/bf16 on sm8x ("FlashAttention only supports Ampere
    # GPUs or newer"; fp8 only on 9.x) [source: hopper/flash_api.cpp mha_fwd, hopper/setup.py
    # FLASH_ATTENTION_DISABLE_SM80]; its sm90 kernels are built for sm_90a only
    source = ops.Source(
        "flash_attn_interface",
        None,
        "flash-attn (hopper/ build)",
        8,
        9,
        "its kernels are built for sm80 and sm_90a only",
    )
    # "page_block_size can be arbitrary" [doc]; no ALiBi; no sinks in 2.8.3.
    capabilities = _caps(
        max_head_size=256,
        head_size_multiple=8,
        alibi=False,
        sinks=False,
        priority={"cuda": 90},
        head_size_v=HEAD_SIZE_V_FA3,
        graph_capture=GraphSupport.ALWAYS,
        graph_capture_reason=_FA3_GRAPH_WHY + " (no scheduler_metadata passed: the call plans "
        "its schedule inside the graph, on the device [inferred])",
        mla=_fa3_mla(1, "provider fa3 (flash_attn_with_kvcache's qv)", ("joint", "split")),
        **FA3_FP8,
    )
    why: ClassVar[Mapping[str, str]] = {
        "alibi": "FA3 has no ALiBi",
        "sinks": "FA3 2.8.3 has no attention sinks",
        "head_size": "FA3 takes head sizes in multiples of 8 up to 256",
        "kv_cache_dtype": "FA3 takes fp8 e4m3 caches only",
    }

    def refusals(self, spec: AttentionSpec, declared: list[Refusal]) -> list[Refusal]:
        return super().refusals(spec, declared) + _head_size_v_refusals(self.name, spec)

    def device_refusals(self, spec: AttentionSpec, device: torch.device) -> list[str]:
        """Also a value head size other than the key's: 'Only Hopper supports different V
        headdim' [source: hopper/flash_api.cpp] (this provider runs on 8.x too)."""
        reasons = super().device_refusals(spec, device)
        major, minor = torch.cuda.get_device_capability(device)
        if isinstance(spec, AttentionSpec) and spec.distinct_head_size_v and major != 9:
            reasons.append(
                f"head_size_v {spec.head_size_v} != head_size {spec.head_size} needs compute "
                f"capability 9.x (provider {self.name}: 'Only Hopper supports different V "
                f"headdim'); this GPU is {major}.{minor}"
            )
        return reasons

    def call(
        self,
        impl: FlashAttentionImpl,
        q: torch.Tensor,
        cache: PagedKVCache,
        a: KernelArgs,
        out: torch.Tensor | None,
        lse: bool,
        sinks: torch.Tensor | None,
    ) -> Result:
        shared: dict[str, Any] = dict(
            cache_seqlens=a.seq_lens,
            page_table=a.block_table,
            softmax_scale=impl.spec.scale,
            causal=a.causal,
            window_size=impl.window,
            softcap=impl.softcap,
            return_softmax_lse=lse,
            **impl.descales(cache, a),
        )
        fa = impl.backend.ops.attention
        if a.decode_only:
            result = fa.flash_attn_with_kvcache(q.unsqueeze(1), cache.key, cache.value, **shared)
            if lse:  # (out, softmax_lse (B, H, 1), *rest) [doc: the padded-q shape]
                return result[0].squeeze(1), _padded_lse(result[1])
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

    def mla_kwargs(
        self,
        backend: FlashBackend,
        query_start_loc: torch.Tensor,
        max_query_len: int,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        block_table: torch.Tensor,
    ) -> dict[str, Any]:
        """flash_attn_with_kvcache's paged varlen call, causal, the spec's scale (its default
        would be (rope + kv_lora_rank) ** -0.5 [schema], not MLA's)."""
        return dict(
            cache_seqlens=seq_lens,
            page_table=block_table,
            cu_seqlens_q=query_start_loc,
            max_seqlen_q=max(max_query_len, 1),
            softmax_scale=backend.spec.scale,
            causal=True,
        )

    def mla_call(
        self,
        backend: FlashBackend,
        q: torch.Tensor,
        qv: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kwargs: dict[str, Any],
        out: torch.Tensor,
        lse: bool,
    ) -> Result:
        # no out= in FA3's flash_attn_with_kvcache [schema]: the result is copied
        result = backend.ops.attention.flash_attn_with_kvcache(
            q, k, v, qv=qv, return_softmax_lse=lse, **kwargs
        )
        return (result[0], result[1]) if lse else (result, None)


class FA4Provider(Provider):
    """flash-attn-4 (``flash_attn.cute``)."""

    name = "fa4"
    empty_lse = -math.inf  # _flash_attn_fwd's lse.fill_(-inf) [schema]
    # SM 12.x: "Paged KV not supported on SM 12.0" [source: flash-attn-4 4.0.0b36
    # interface.py, the SM120 branch of _flash_attn_fwd]; every attnhub call is paged
    source = ops.Source(
        "flash_attn.cute",
        None,
        "flash-attn-4",
        9,
        11,
        "FA4 asserts 'Paged KV not supported on SM 12.0' and every call here is paged",
    )
    # _validate_head_dims: SM90 8..256, SM100/110 8..128 or 256, multiples of 8 for 16-bit
    # dtypes [source]: the union here, each GPU's own rule and the paged-KV head-dim rule in
    # _fa4_refusals; any page size for head sizes that are multiples of 16, 128 the TMA fast
    # path [schema]; learnable_sink [schema].
    capabilities = _caps(
        max_head_size=256,
        head_size_multiple=8,
        alibi=False,
        sinks=True,
        priority={"cuda": 95},
        head_size_v=HEAD_SIZE_V_FA4,
        graph_capture=GraphSupport.UNIFORM_BATCH,
        graph_capture_reason=_FA4_GRAPH_WHY,
        mla=_fa4_mla(ops.fa4_arch("cpu")),
    )
    why: ClassVar[Mapping[str, str]] = {
        "alibi": "FA4 has no ALiBi (score_mod could express it; not done)",
        "head_size": "FA4 takes head sizes in multiples of 8 up to 256 (SM90), 8..128 or 256 "
        "(SM100/110)",
        "kv_cache_dtype": "FA4's fp8 path is not used yet",
    }

    def refusals(self, spec: AttentionSpec, declared: list[Refusal]) -> list[Refusal]:
        """Also what FA4 refuses on the architecture it selects its kernels by
        (``ops.fa4_arch``: ``FLASH_ATTENTION_ARCH``, else the current GPU, else SM100)."""
        reasons = super().refusals(spec, declared)
        if any(r.field in ("head_size", "head_size_v") for r in reasons):
            return reasons
        return reasons + _fa4_refusals(spec, ops.fa4_arch())

    def device_refusals(self, spec: AttentionSpec, device: torch.device) -> list[str]:
        arch = ops.fa4_arch(device)
        if isinstance(spec, MLASpec):  # FA4's qv: Blackwell, not FA3's Hopper
            return [str(r) for r in _fa4_mla_refusals(arch)]
        return [*super().device_refusals(spec, device), *_fa4_refusals(spec, arch)]

    def mla_refusals(self, spec: MLASpec) -> list[Refusal]:
        return _fa4_mla_refusals(ops.fa4_arch())

    def mla_kwargs(
        self,
        backend: FlashBackend,
        query_start_loc: torch.Tensor,
        max_query_len: int,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        block_table: torch.Tensor,
    ) -> dict[str, Any]:
        """flash_attn_varlen_func's paged varlen call with qv, causal, the spec's scale (its
        default would be (rope + kv_lora_rank) ** -0.5 [schema], not MLA's)."""
        return dict(
            cu_seqlens_q=query_start_loc,
            max_seqlen_q=max(max_query_len, 1),
            seqused_k=seq_lens,
            max_seqlen_k=max_seq_len,
            page_table=block_table,
            softmax_scale=backend.spec.scale,
            causal=True,
        )

    def mla_call(
        self,
        backend: FlashBackend,
        q: torch.Tensor,
        qv: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kwargs: dict[str, Any],
        out: torch.Tensor,
        lse: bool,
    ) -> Result:
        # no out= in FA4's flash_attn_varlen_func [schema]: the result is copied; with qv the
        # LSE is (total_q, nheads) [doc], the varlen calls' (nheads, total_q) transposed
        result, lse_t = backend.ops.attention.flash_attn_varlen_func(
            q, k, v, qv=qv, return_lse=lse, **kwargs
        )
        return result, (lse_t.t() if lse else None)

    def window(self, spec: AttentionSpec) -> tuple[Any, Any]:
        # FA4 spells "no bound" None, and (None, None) when there is no window [schema]
        left, right = spec.window
        return (None if left < 0 else left, None if right < 0 else right)

    def call(
        self,
        impl: FlashAttentionImpl,
        q: torch.Tensor,
        cache: PagedKVCache,
        a: KernelArgs,
        out: torch.Tensor | None,
        lse: bool,
        sinks: torch.Tensor | None,
    ) -> Result:
        # every argument after v by keyword [schema]; returns (out, lse) [schema]; FA4's
        # learnable_sink takes fp16, bf16 or fp32 and gets the layer's own
        result, lse_t = impl.backend.ops.attention.flash_attn_varlen_func(
            q,
            cache.key,
            cache.value,
            cu_seqlens_q=a.query_start_loc,
            max_seqlen_q=a.max_query_len,
            seqused_k=a.seq_lens,
            max_seqlen_k=a.max_seq_len,
            page_table=a.block_table,
            softmax_scale=impl.spec.scale,
            causal=a.causal,
            window_size=impl.window,
            learnable_sink=sinks,
            softcap=impl.softcap,
            return_lse=lse,
        )
        return result, lse_t


# --- what a provider refuses beyond one Capabilities field -----------------------------------


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


def fa4_tile_n(
    arch: int, head_size: int, *, causal: bool, local: bool, head_size_v: int | None = None
) -> int:
    """The key tile (``tile_n``) FA4's forward picks for a head size (``head_size_v``: the
    value head size, None: the same) on
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
        return 96 if local else (128 if (head_size_v or head_size) <= 128 else 112)
    return 64 if local else 80


def _fa4_refusals(spec: AttentionSpec, arch: int) -> list[Refusal]:
    """What FA4 refuses of ``spec`` on ``arch`` beyond the declared union of head sizes:
    ``_validate_head_dims`` per architecture (for the pair with a value head size of its
    own), and paged KV with a head size or value head size that is not a multiple of 16
    unless the page size is FA4's key tile [source]. A step may be causal or not (encoder
    types, ``causal=False`` steps, a cascade's prefix call), so where the tile depends on it
    (SM90, head sizes 65..96 without a window) such head sizes are refused."""
    hs, hv, bs = spec.head_size, spec.head_size_v, spec.block_size
    name = f"SM{arch}"
    blackwell = arch // 10 in (10, 11)
    if spec.distinct_head_size_v:
        if hv % 8:
            return [
                Refusal(
                    f"head_size_v {hv} is not a multiple of 8 (provider fa4: "
                    "_validate_head_dims: 'divisible by 8')",
                    field="head_size_v",
                    value=(hs, hv),
                )
            ]
        if blackwell and not ((hs <= 128 and hv <= 128) or (hs, hv) == (192, 128)):
            return [
                Refusal(
                    f"head_size_v {hv} != head_size {hs} is not supported on {name} (provider "
                    "fa4: _validate_head_dims: both in 8..128, or (192, 128), on SM100/SM110; "
                    "its (64, 512) is MLA's absorbed shape, for the MLA kernels with qv)",
                    field="head_size_v",
                    value=(hs, hv),
                )
            ]
    elif blackwell and 128 < hs < 256:
        return [
            Refusal(
                f"head_size {hs} is not supported on {name} (provider fa4: "
                "_validate_head_dims: 8..128 in multiples of 8, or 256, on SM100/SM110)",
                field="head_size",
                value=hs,
            )
        ]
    if hs % 16 == 0 and hv % 16 == 0:
        return []
    local = spec.has_window
    tiles = {fa4_tile_n(arch, hs, causal=c, local=local, head_size_v=hv) for c in (True, False)}
    if tiles == {bs}:
        return []
    want = " or ".join(str(t) for t in sorted(tiles))
    sizes = f"head_size {hs}" + (f" and head_size_v {hv}" if hv != hs else "")
    return [
        Refusal(
            f"block_size {bs} with {sizes} is not supported on {name} (provider fa4: "
            "paged KV with a head size that is not a multiple of 16 needs the page size to be "
            f"FA4's key tile, here {want}{' depending on causality' if len(tiles) > 1 else ''}: "
            "'Paged KV does not support irregular head dim')",
            field="block_size",
            value=bs,
            supported=frozenset(tiles) if len(tiles) == 1 else None,
        )
    ]


def _head_size_v_refusals(
    provider: str, spec: AttentionSpec, *, s_aux: bool = False
) -> list[Refusal]:
    """What FA3 refuses of a declared pair (``HEAD_SIZE_V_FA3``) beyond its regions [source:
    hopper/flash_api.cpp]: a value head size aligned to 8 (16 for fp8), and fp8 only where
    run_mha_fwd builds an e4m3 kernel as wide as the values (hdim 192 x hdimv 128, hdim 64 x
    hdimv 64); vLLM's fork: no s_aux sinks with it ('We don't support S aux with hdim !=
    hdim_v'; vLLM moves such layers to FA4), where the provider passes sinks as ``s_aux``."""
    if not spec.distinct_head_size_v:
        return []
    hs, hv = spec.head_size, spec.head_size_v
    pair = (hs, hv)
    fp8 = spec.kv_cache_dtype == FP8_KV
    align = 16 if fp8 else 8
    reasons = []
    if hv % align:
        reasons.append(
            Refusal(
                f"head_size_v {hv} is not a multiple of {align} (provider {provider}: "
                f"'head_size_v should be a multiple of {align}')",
                field="head_size_v",
                value=pair,
            )
        )
    if fp8 and hs <= 64 and hv > 64:
        reasons.append(
            Refusal(
                f"head_size_v {hv} != head_size {hs} is not supported with kv_cache_dtype "
                f"{FP8_KV!r} (provider {provider}: FA3 builds its fp8 kernels of hdim 64 for "
                "hdimv 64 only)",
                field="head_size_v",
                value=pair,
            )
        )
    if spec.use_sinks and s_aux:
        reasons.append(
            Refusal(
                f"use_sinks with head_size_v {hv} != head_size {hs} is not supported (provider "
                f"{provider}: the fork's FA3 takes s_aux with one head size only: 'We don't "
                "support S aux with hdim != hdim_v')",
                field="head_size_v",
                value=pair,
            )
        )
    return reasons


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


# --- the KV writes ----------------------------------------------------------------------------


def scatter(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    rows: torch.Tensor,  # [m] int64
    slots: torch.Tensor,  # [m] int64
) -> None:
    """Rows ``rows`` of key and value into ``slots`` of the cache, one ``index_copy_`` per
    plane (padding never written); fp8 planes get ``fp8(x / scale)``."""
    if rows.numel() == 0:
        return
    planes = ((cache.key, key, cache.key_scale), (cache.value, value, cache.value_scale))
    for plane, src, scale in planes:
        new = src.index_select(0, rows)
        # fp8: stored fp8(x / scale), as bytes (no fp8 indexing kernels on CPU)
        new = indexable(quantize_fp8(new, scale, plane.dtype) if scale is not None else new)
        dst = indexable(plane)
        write_slots(dst, flat_slots(dst), slots, new.to(dst.dtype))  # one index_copy_ where
        # blocks and offsets merge into slots, else (block, offset) indices (the kit's)


def scatter_fixed(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = padding: the persistent buffer
) -> None:
    """A captured step's write: ``T`` rows whatever the step's padding, device ops only
    (``FixedShapeWrite``: a padding row rewrites the first written row's slot with that row's
    value; a step writing nothing rewrites slot 0 with its own bytes), so the bytes are those
    of ``scatter``'s write of the same step."""
    write = FixedShapeWrite.of(slot_mapping)
    planes = ((cache.key, key, cache.key_scale), (cache.value, value, cache.value_scale))
    for plane, src, scale in planes:
        new = src.index_select(0, write.rows)
        new = indexable(quantize_fp8(new, scale, plane.dtype) if scale is not None else new)
        dst = indexable(plane)
        flat = flat_slots(dst)
        held = read_slots(dst, flat, write.slots)
        write_slots(dst, flat, write.slots, write.pick(new.to(dst.dtype), held))


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` [n, H, D] with each row's heads dense, as reshape_and_cache_flash reads a token
    (``H * D`` consecutive elements from ``t.stride(0)``): a copy only when they are not."""
    if t.is_contiguous() or (t.stride(-1) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2])):
        return t
    return t.contiguous()


# --- the providers, and which one serves ``flash`` -------------------------------------------

VLLM = VllmProvider()
VLLM_FA3 = VllmFA3Provider()
VLLM_FLASHMLA = VllmFlashMLAProvider()
FA2 = FA2Provider()
FA3 = FA3Provider()
FA4 = FA4Provider()
PROVIDERS: dict[str, Provider] = {p.name: p for p in (VLLM, VLLM_FA3, VLLM_FLASHMLA, FA2, FA3, FA4)}
#: Best first when several are importable: FA4 and FA3 are the newer kernels; vLLM's fork ships
#: with engines; upstream FA2 last. ``vllm-fa3`` and ``vllm-flashmla`` only when named: whether
#: vLLM's build holds its FA3 (and FlashMLA) kernels is known only by importing it.
PREFERENCE = ("fa4", "fa3", "vllm", "fa2")
#: What engines ship; on a machine without any provider, the emulated default.
DEFAULT = VLLM.name


def chosen_provider() -> str:
    """The provider the ``flash`` backend serves with: ``ATTNHUB_FLASH_PROVIDER`` when set,
    else the first of ``PREFERENCE`` installed (``ops.module_exists``, which imports nothing),
    else ``DEFAULT``."""
    name = os.environ.get(ops.ENV, "").strip().lower()
    if name:
        if name not in PROVIDERS:
            raise InvalidInputError(
                f"{ops.ENV}={name!r} is not a FlashAttention provider (one of "
                f"{', '.join(PROVIDERS)})"
            )
        return name
    for candidate in PREFERENCE:
        if ops.module_exists(PROVIDERS[candidate].source.attention):
            return candidate
    return DEFAULT
