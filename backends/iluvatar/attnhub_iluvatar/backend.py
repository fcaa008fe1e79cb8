"""The ``iluvatar`` backend: attnhub's protocol translated into ``ixformer``'s calling conventions.

Per step, the builder does every host-side thing once (FlashInfer's ``plan``): it splits the
leading decodes (query_len <= ``reorder_batch_threshold``) from the prefills that follow and
gives each part the arguments its kernel takes: sub-block tables, cumulative offsets re-based
to 0, maximum lengths, all from the batch's host copies. Per layer, the impl makes one KV write
and at most two attention calls, with no loop over requests and no host read of a device tensor:

  KV write       inference.functions.reshape_and_cache_flash   HND cache, int64 slots, -1 skipped
                   (8 arguments, as the fork's vllm._custom_ops passes them)
  decodes        contrib.vllm_flash_attn.flash_attn_with_kvcache (one token each, the
                   fork's threshold): q / out (T, 1, H, D), cache_seqlens, block_table,
                   cu_query_lens, max_query_len, every argument but q and the cache by keyword
  prefills       contrib.vllm_flash_attn.flash_attn_varlen_func, every argument by keyword
                   paged (block_table), cu_seqlens_q / cu_seqlens_k cumulative from 0
  non-causal     the whole step through flash_attn_varlen_func with causal=False
  shared prefix  (cascade) flash_attn_varlen_func twice (prefix, non-causal, all queries as one
                   sequence; suffix, causal) with their natural-log LSEs, then
                   contrib.vllm_flash_attn.merge_attn_states (output positional)
  int8 caches    decodes vllm_paged_attention_int8 / _mix, prefills flash_attn_varlen_int8_func
                   (mode 2: the 16-bit value cache, v_scale=None), all by keyword

Every ``[inferred]`` vendor semantic relied on is marked where it is used and listed in
docs/backends/iluvatar.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from attnhub.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    Step,
)
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
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.kit import (
    CheckedStates,
    QueryQuantization,
    as_contiguous,
    merge_attn_states,
    tensor_state,
)
from attnhub.kv_cache import PagedKVCache
from attnhub.spec import AttentionSpec, AttentionType
from attnhub_iluvatar import ops

#: Head sizes: the fork's ``supports_head_size``, ``head_size % 8 == 0 and head_size <= 256``
#: [callers].
HEAD_SIZES = frozenset(range(8, 257, 8))
#: The fork's ``get_supported_kernel_block_sizes`` [callers]; its cache shape also requires a
#: multiple of 16.
BLOCK_SIZES = frozenset({16, 32, 64})
#: The declared accuracy of modes 1 and 2 against attention over the unquantized inputs (max abs
#: error, min per-token cosine similarity). Measured through the emulator on the conformance
#: suite's accuracy cases, full scope (every batch shape, bf16 and fp16, N(0, 1) inputs):
#: int8 0.0430 / 0.99983, int8_k 0.0359 / 0.99989 (docs/backends/iluvatar.md); declared with
#: about 40% headroom on the error and 1.5-3x on 1 - cosine.
INT8_MAX_ABS, INT8_MIN_COS = 0.06, 0.9995
INT8_K_MAX_ABS, INT8_K_MIN_COS = 0.05, 0.9997


#: Why the LSE is returned for model-dtype caches without sinks only.
LSE_REASON = (
    "ixformer's int8 kernels (flash_attn_varlen_int8_func, vllm_paged_attention_int8 / _mix) "
    "return no LSE, and whether its LSE counts a sink in the denominator is not known"
)

_MAX = np.maximum.reduce  # ufunc.reduce directly: ndarray.max() adds a Python wrapper
#: A step's query lengths [B], sequence lengths [B] and query start offsets [B + 1] (numpy).
_Lengths = tuple[np.ndarray, np.ndarray, np.ndarray]


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
    #: [num_reqs + 1] int32 cumulative query ends from 0 (the batch's first num_reqs + 1),
    #: passed with every decode, as the fork does; q goes as (T, 1, H, D).
    cu_query_lens: torch.Tensor
    #: The call's keyword arguments that are the same for every layer (all but q, the cache,
    #: out, ALiBi slopes and sinks), made by the builder once per step; layers only read them.
    kwargs: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


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
    kwargs: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


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
    """The int8 caches' leading one-token decodes: one ``vllm_paged_attention_int8`` /
    ``_mix`` call, with ``cu_query_lens`` and ``max_query_len`` as the fork passes them."""

    num_tokens: int  # rows 0..num_tokens-1, one per decode
    context_lens: torch.Tensor  # [num_tokens] int32, device: keys incl. the new one
    block_table: torch.Tensor  # [num_tokens, max_blocks] int32, device
    max_context_len: int
    cu_query_lens: torch.Tensor  # [num_tokens + 1] int32, device
    #: A captured step: the kernel's capture-safe launch, max_context_len the graph's bound.
    use_cuda_graph: bool = False


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
        # The proven caller keeps K and V as one (2, num_blocks, Hkv, block_size, head_size)
        # tensor and passes one head_size [callers]; no ixformer entry point with a value head
        # size of its own is known.
        head_size_v=HeadSizeVSupport(
            reason="ixformer's paged attention takes one head size for keys and values"
        ),
        block_sizes=BLOCK_SIZES,
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
        # Both attention entry points take sinks= [callers]; the int8 kernels do not (refused
        # below), and natively the installed ixformer must take the keyword (__init__).
        sinks=True,
        multi_token_decode=True,
        chunked_prefill=True,
        cascade=True,
        # One-token decodes, as the fork captures them (use_graph: decode-only steps): the
        # decode kernels with use_cuda_graph=True and max_context_len sized for the graph
        # (build_for_graph_capture); NEVER for non-causal specs (builder.graph_support).
        graph_capture=GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE,
        graph_capture_reason=(
            "one-token decodes, as Iluvatar's vLLM fork captures them (use_graph on decode-only "
            "steps): the decode kernels with use_cuda_graph=True and max_context_len sized for "
            "the graph, every int8 mode included; longer queries (multi-token decodes "
            "included: reorder_batch_threshold 1) run flash_attn_varlen_func, which the fork "
            "never captures; non-causal specs: never (no decode kernel)"
        ),
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
        # Mode 0: flash_attn_varlen_func(return_softmax_lse=True), natural log [callers], the
        # decodes too (through the varlen op when the LSE is asked for: the decode op's LSE
        # layout is not proven). Not the int8 modes, not with sinks: docs/backends/iluvatar.md.
        lse=LseSupport(
            dtypes=frozenset({torch.float16, torch.bfloat16}),
            kv_cache_dtypes=frozenset({"auto"}),
            sinks=False,
            reason=LSE_REASON,
        ),
        batch_invariant=BatchInvariance(
            reason="ixformer's decode kernel sizes its work by the step's max_context_len "
            "[callers] and its split and tiling rules are not documented, so a request's "
            "reduction order may follow its companions [inferred]"
        ),
        mla=MlaSupport(
            reason="ixformer publishes no MLA entry point: none of its ops that Iluvatar's vLLM "
            "fork calls (docs/backends/iluvatar.md) takes a latent cache or a rope part"
        ),
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
        if spec.use_sinks and spec.kv_cache_format.is_quantized:
            reasons.append(
                Refusal(
                    f"sinks are not supported with kv_cache_dtype {spec.kv_cache_dtype!r} (the "
                    "int8 kernels, flash_attn_varlen_int8_func and vllm_paged_attention_int8 / "
                    "_mix, take no sinks argument)",
                    field="sinks",
                    value=True,
                )
            )
        return reasons

    def __init__(
        self, spec: AttentionSpec, device: torch.device | str = "cpu", *, emulate: bool = False
    ) -> None:
        super().__init__(spec, device, emulate=emulate)
        #: ixformer or the emulator, resolved once for this instance.
        self.ops: Any = ops.namespace(self.device, emulate)
        if spec.use_sinks:
            missing = ops.missing_sinks_keyword(self.ops)
            if missing:
                raise UnsupportedConfigurationError(
                    self.name, [f"sinks: the installed ixformer's {missing} takes no 'sinks'"]
                )

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

    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> IluvatarAttentionImpl:
        # int8 caches: the KV write of a decode-only step rides on the paged kernel
        quantized = self.spec.kv_cache_format.is_quantized
        cls = IluvatarInt8AttentionImpl if quantized else IluvatarAttentionImpl
        return cls(self, alibi_slopes=alibi_slopes, sinks=sinks)


#: Why the kernels refuse what Capabilities refuses, per refused field.
_WHY = {
    "head_size": "Iluvatar's vLLM backend takes head_size % 8 == 0 and head_size <= 256",
    "block_size": "the kernel block sizes Iluvatar's vLLM backend declares",
    "dtype": "the kernels take float16 and bfloat16",
    "kv_cache_dtype": "ixformer's caches hold the model dtype or int8",
}


class IluvatarMetadataBuilder(AttentionMetadataBuilder[IluvatarAttentionMetadata]):
    """Plans a step once for every layer: decode / prefill split, lengths, sub-tables."""

    backend: IluvatarBackend
    #: Leading requests with query_len <= this go to the decode kernel: 1, the fork's
    #: threshold without speculative tokens [callers]; longer ones (multi-token decodes
    #: included) go to the varlen call, which computes any request.
    reorder_batch_threshold: ClassVar[int] = 1
    metadata_type = IluvatarAttentionMetadata

    def __init__(self, backend: IluvatarBackend) -> None:
        super().__init__(backend)
        spec = self.spec
        self.softcap = spec.logits_soft_cap or 0.0
        # window_size follows flash-attn: (left, right) keys around the query's aligned
        # position, -1 unbounded; attnhub's normalized pair is exactly that [callers].
        self.causal_window = (spec.window[0], 0) if spec.has_window else (-1, -1)
        self.full_window = spec.window

    @property
    def graph_support(self) -> GraphSupport:
        """The declared level for causal specs; NEVER for the others, whose every request
        runs the varlen call (no decode kernel, and the fork captures none)."""
        if not self.spec.causal:
            return GraphSupport.NEVER
        return self.backend.capabilities.graph_capture

    def build_for_graph_capture(self, batch: BatchMetadata) -> IluvatarAttentionMetadata:
        """A captured decode-only step, as the fork's ``use_graph`` steps: one decode kernel
        call over the runner's persistent buffers with ``use_cuda_graph=True`` and
        ``max_context_len`` the block table's capacity (the fork passes the step's
        ``max_decode_seq_len``, which vLLM's capture run sets to the max model length: every
        replay's contexts fit); the KV write a separate op over the persistent slot mapping
        (the int8 caches' fused write is decided per step on host data: not captured)."""
        step = self.capture_step(batch)  # one-token decodes only (the level)
        batch = step.batch
        if not (self.spec.causal and batch.causal):
            raise UnsupportedConfigurationError(
                self.backend.name,
                [
                    "graph capture of a non-causal step: it runs flash_attn_varlen_func, not a "
                    "decode kernel (the fork captures decode-only steps)"
                ],
            )
        n = batch.num_actual_tokens
        fields: dict[str, Any] = dict(
            num_actual_tokens=n,
            causal=True,
            # the padded rows past num_actual_tokens are never handed to the write
            slot_mapping=as_contiguous(batch.slot_mapping[:n], torch.int64),
        )
        if not n:
            return self.metadata(step, fields)
        capacity = int(batch.block_table.shape[1]) * batch.block_size
        seq_lens, table = as_contiguous(batch.seq_lens), as_contiguous(batch.block_table)
        qsl = as_contiguous(batch.query_start_loc)
        if self.spec.kv_cache_format.is_quantized:
            fields["paged"] = PagedPlan(n, seq_lens, table, capacity, qsl, use_cuda_graph=True)
            return self.metadata(step, fields)
        plan = DecodePlan(batch.num_reqs, n, 1, capacity, seq_lens, table, qsl)
        plan.kwargs.update(self._decode_kwargs(plan), use_cuda_graph=True)
        fields["decode"] = plan
        return self.metadata(step, fields)

    def plan(self, step: Step) -> Mapping[str, Any]:
        batch = step.batch
        lengths = self._host_lengths(step)
        n = batch.num_actual_tokens
        causal = self.spec.causal and batch.causal
        common: dict[str, Any] = dict(
            num_actual_tokens=n,
            causal=causal,
            # Padding rows past num_actual_tokens are never handed to the write; the op itself
            # skips any slot < 0 among the rest.
            slot_mapping=batch.slot_mapping if batch.num_tokens == n else batch.slot_mapping[:n],
        )
        if batch.num_reqs == 0:
            return common
        if self.spec.kv_cache_format.is_quantized:  # modes 1 and 2
            nd = self._leading_decodes(batch, 1, lengths) if causal else 0
            return dict(
                common,
                paged=self._paged_decodes(batch, nd, lengths) if nd else None,
                prefill=self._prefill(batch, nd, lengths, causal) if nd < batch.num_reqs else None,
                fused_write=self._fusable(batch, causal),
            )
        prefix = self._cascade_prefix(step.common_prefix_len, causal)
        if prefix:
            return dict(common, cascade=self._cascade(batch, prefix))
        threshold = self.reorder_batch_threshold
        nd = self._leading_decodes(batch, threshold, lengths) if causal else 0
        return dict(
            common,
            decode=self._decode(batch, nd, lengths) if nd else None,
            prefill=self._prefill(batch, nd, lengths, causal) if nd < batch.num_reqs else None,
        )

    @staticmethod
    def _host_lengths(step: Step) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The step's query lengths [B], sequence lengths [B] and query start offsets [B + 1]
        on the host (numpy): as build's checks read them, else (structural checks) from the
        batch's host copies."""
        facts = step.facts
        q, seq, qsl = facts.query_lens, facts.seq_lens, facts.query_start_locs
        if q is not None and seq is not None and qsl is not None:
            return q, seq, qsl
        qsl = step.batch.query_start_loc_cpu.numpy()
        return qsl[1:] - qsl[:-1], step.batch.seq_lens_cpu.numpy(), qsl

    def _leading_decodes(self, batch: BatchMetadata, threshold: int, lengths: _Lengths) -> int:
        """How many requests at the front have query_len <= ``threshold`` (host data).

        Engines send decodes first (``reorder_batch_threshold``); a decode after a prefill is
        served by the prefill call, which computes any request correctly."""
        if batch.max_query_len <= threshold:  # checked against the lengths by build
            return batch.num_reqs
        small = lengths[0] <= threshold
        return int(small.argmin())  # the first request over it (there is one)

    def _paged_decodes(self, batch: BatchMetadata, nd: int, lengths: _Lengths) -> PagedPlan:
        """The int8 caches: the leading one-token decodes, one paged kernel call."""
        return PagedPlan(
            num_tokens=nd,
            context_lens=as_contiguous(batch.seq_lens[:nd]),
            block_table=as_contiguous(batch.block_table[:nd]),
            max_context_len=int(_MAX(lengths[1][:nd])),
            cu_query_lens=as_contiguous(batch.query_start_loc[: nd + 1]),
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

    def _decode(self, batch: BatchMetadata, nd: int, lengths: _Lengths) -> DecodePlan:
        """The leading ``nd`` decodes: their rows of the batch's device lengths and table (no
        host copy), maxima from the host lengths build's checks read; the call's keyword
        arguments."""
        plan = self._decode_rows(batch, nd, lengths)
        plan.kwargs.update(self._decode_kwargs(plan))
        return plan

    def _decode_kwargs(self, plan: DecodePlan) -> dict[str, Any]:
        """The decode call's keyword arguments every layer passes alike (eager launches:
        ``use_cuda_graph=False``, as the fork outside its graphs)."""
        return dict(
            block_table=plan.block_table,
            cache_seqlens=plan.seq_lens,
            max_query_len=plan.max_query_len,
            cu_query_lens=plan.cu_query_lens,
            softmax_scale=self.spec.scale,
            causal=True,
            window_size=self.causal_window,
            softcap=self.softcap,
            use_sqrt_alibi=False,
            use_cuda_graph=False,
            max_context_len=plan.max_seq_len,
        )

    def _decode_rows(self, batch: BatchMetadata, nd: int, lengths: _Lengths) -> DecodePlan:
        if nd == batch.num_reqs:  # the whole step: lengths and maxima as the batch holds them
            max_q = batch.max_query_len
            return DecodePlan(
                num_reqs=nd,
                num_tokens=batch.num_actual_tokens,
                max_query_len=max_q,
                max_seq_len=batch.max_seq_len,
                seq_lens=as_contiguous(batch.seq_lens),
                block_table=as_contiguous(batch.block_table),
                cu_query_lens=as_contiguous(batch.query_start_loc),
            )
        q_lens, seq_lens, qsl = lengths
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
            cu_query_lens=as_contiguous(batch.query_start_loc[: nd + 1]),
        )

    def _prefill(
        self, batch: BatchMetadata, nd: int, lengths: _Lengths, causal: bool
    ) -> PrefillPlan:
        """The requests from ``nd`` on, and the call's keyword arguments."""
        plan = self._prefill_rows(batch, nd, lengths)
        plan.kwargs.update(
            cu_seqlens_q=plan.cu_seqlens_q,
            cu_seqlens_k=plan.cu_seqlens_k,  # cumulative, also with the paged cache [callers]
            max_seqlen_q=plan.max_query_len,
            max_seqlen_k=plan.max_seq_len,
            softmax_scale=self.spec.scale,
            causal=causal,
            window_size=self.causal_window if causal else self.full_window,
            softcap=self.softcap,
            sqrt_alibi=False,
            block_table=plan.block_table,
        )
        return plan

    def _prefill_rows(self, batch: BatchMetadata, nd: int, lengths: _Lengths) -> PrefillPlan:
        """The requests from ``nd`` on: their query ends re-based to 0 and their cumulative KV
        lengths, from the host lengths build's checks read; their rows of the batch's device
        table. The whole step (no decodes before them): the batch's query ends as they are."""
        dev = self.backend.device
        _, all_seq_lens, all_qsl = lengths
        seq_lens = all_seq_lens[nd:]
        cu_k = np.zeros(seq_lens.size + 1, dtype=np.int32)
        np.add.accumulate(seq_lens, out=cu_k[1:])  # int32: build's checks bound every length
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
            # and the first prefill is over it (checked against the lengths by build)
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
        LSE), with sinks (whether ixformer's LSE counts the sink is not known, and the sink
        must join exactly one of the two parts), and where the prefix call cannot reproduce the
        per-request math: a sliding window or ALiBi depend on each query's own position."""
        if not common_prefix_len:  # the usual step: no shared prefix
            return 0
        spec = self.spec
        if (
            not causal
            or spec.has_window
            or spec.use_alibi
            or spec.use_sinks
            or spec.kv_cache_format.is_quantized
        ):
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
        #: What identified the static V scales' values each time they were found finite.
        self._checked_value_scales = CheckedStates()
        self._quantized = spec.kv_cache_format.is_quantized

    def check_call(self, cache: PagedKVCache, meta: AttentionMetadata) -> None:
        if not isinstance(meta, IluvatarAttentionMetadata):
            raise InvalidInputError(
                f"meta must come from the iluvatar backend's metadata_builder().build(batch), "
                f"got {type(meta).__name__}"
            )
        self._check_scales(cache)

    def _check_scales(self, cache: PagedKVCache) -> None:
        """The int8 caches' scale planes as the kernels read them: contiguous (their kind,
        dtype, shape and device are the core's ``check_cache``'s, made first: per-slot key
        scales ``(num_blocks, Hkv, block_size)``, mode 1's static value scale ``(Hkv,
        head_size)``), and mode 1's value scale finite (a NaN or infinite scale would be
        written into every value quantized with it). The value scale's values are read on the
        host once per change of that tensor (its torch version counter and storage): an
        engine sets it with the weights, so steps read nothing."""
        kv = self.spec.kv_cache_dtype
        if kv == "auto":
            return
        for name in ("key_scale", "value_scale") if kv == "int8" else ("key_scale",):
            plane = getattr(cache, name)
            if not plane.is_contiguous():
                raise InvalidInputError(
                    f"cache.{name} must be contiguous, got strides {plane.stride()}"
                )
        if kv != "int8":
            return
        scale = cache.value_scale
        assert scale is not None
        seen = tensor_state(scale)  # read once per change of the tensor, not per step
        if seen in self._checked_value_scales:
            return
        bad = ~torch.isfinite(scale)
        if bool(bad.any()):
            h, d = (int(i) for i in bad.nonzero()[0])
            raise InvalidInputError(
                f"cache.value_scale[{h}, {d}] = {float(scale[h, d])} is not finite: the static "
                f"value scale of kv_cache_dtype 'int8' must be finite ({int(bad.sum())} entries "
                "are not)"
            )
        self._checked_value_scales.add(seen)

    # --- KV write ---------------------------------------------------------------------------
    def store_kv(
        self,
        key: torch.Tensor,  # [>= n, num_kv_heads, head_size]
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,  # [n] int32/int64, -1 = padding
        meta: AttentionMetadata | None = None,
    ) -> None:
        if meta is not None:  # a step's write: the slots the builder planned
            assert isinstance(meta, IluvatarAttentionMetadata) and meta.slot_mapping is not None
            n = meta.num_actual_tokens
            if n:
                if key.shape[0] != n:  # padding rows past the step's tokens
                    key, value = key[:n], value[:n]
                self._write(key, value, cache, meta.slot_mapping)
            return
        self._check_scales(cache)  # write_kv without meta= (check_call is not called)
        n = slot_mapping.shape[0]
        if n:
            self._write(key[:n], value[:n], cache, slot_mapping)

    def _write(
        self, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache, slots: torch.Tensor
    ) -> None:
        # Each op writes slot_mapping.size(0) tokens into the HND cache, skipping slots < 0
        # [callers]; the int8 ones take keys already quantized per (token, kv head) with their
        # scales, and mode 1's values quantized with the static per-channel scale [inferred].
        fn = self.backend.ops.inference.functions
        kv = self.spec.kv_cache_dtype
        if kv == "auto":
            # as the fork's vllm._custom_ops.reshape_and_cache_flash calls it: 8 positional
            # arguments, the scales 1.0 (they matter for fp8 caches only)
            fn.reshape_and_cache_flash(key, value, cache.key, cache.value, slots, "auto", 1.0, 1.0)
            return
        qk, k_scale, v = self._quantize_kv(key, value, cache)
        write = fn.reshape_and_cache_flash_int8 if kv == "int8" else fn.reshape_and_cache_flash_mix
        write(
            key=qk,
            value=v,
            k_scale=k_scale,
            key_cache=cache.key,
            value_cache=cache.value,
            key_scale_cache=cache.key_scale,
            slot_mapping=slots,
            kv_cache_dtype="",  # as the fork passes it [callers]
        )

    def _quantize_kv(
        self, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int8 keys and their [T, Hkv] scales; values as the cache stores them (mode 1: int8
        with the cache's static value_scale; mode 2: unchanged)."""
        fn = self.backend.ops.inference.functions
        qk, k_scale = fn.scaled_int8_quant_for_attn(key, 2, transpose_scale=False)
        if self.spec.kv_cache_dtype == "int8":
            value, _ = fn.scaled_int8_quant_for_attn(
                value, 0, transpose_scale=False, scale=cache.value_scale
            )
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
        lse: torch.Tensor | None = None,  # [num_tokens, H] float32 (mode 0, no sinks)
    ) -> None:
        assert isinstance(meta, IluvatarAttentionMetadata)
        if meta.paged is not None:
            self._attend_paged(query, cache, meta.paged, out)
        if self._quantized and meta.prefill is not None:
            self._attend_prefill_int8(query, cache, meta.prefill, meta.causal, out)
            return
        if meta.cascade is not None:
            self._attend_cascade(query, cache, meta.cascade, out, lse)
            return
        if meta.decode is not None:
            if lse is None:
                self._attend_decode(query, cache, meta.decode, out)
            else:
                self._attend_decode_lse(query, cache, meta.decode, out, lse)
        if meta.prefill is not None:
            self._attend_prefill(query, cache, meta.prefill, meta.causal, out, lse)

    def _attend_decode(
        self, query: torch.Tensor, cache: PagedKVCache, plan: DecodePlan, out: torch.Tensor
    ) -> None:
        t = plan.num_tokens
        if query.shape[0] != t:  # prefills or padding follow (out is like query)
            query, out = query[:t], out[:t]
        # as the fork: q and out (T, 1, H, D), every other argument by keyword [callers]
        self.backend.ops.contrib.vllm_flash_attn.flash_attn_with_kvcache(
            q=query.unsqueeze(1),
            k_cache=cache.key,
            v_cache=cache.value,
            out=out.unsqueeze(1),
            alibi_slopes=self.alibi_slopes,
            sinks=self.sinks,
            **plan.kwargs,  # made by the builder (flash_attn_with_kvcache's but the layer's)
        )

    def _attend_decode_lse(
        self,
        query: torch.Tensor,
        cache: PagedKVCache,
        plan: DecodePlan,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """The decodes when the LSE is asked for: one ``flash_attn_varlen_func`` call with
        ``return_softmax_lse=True`` over the paged cache (its LSE is the callers' [H, T] in
        the natural log), not the decode op, whose LSE layout no caller shows [inferred]. Its
        cumulative KV lengths are made on the device (no host read), only on this path."""
        t = plan.num_tokens
        seq = plan.seq_lens
        cu_k = torch.zeros(seq.shape[0] + 1, dtype=torch.int32, device=seq.device)
        torch.cumsum(seq, 0, dtype=torch.int32, out=cu_k[1:])
        _, part = self.backend.ops.contrib.vllm_flash_attn.flash_attn_varlen_func(
            q=query[:t],
            k=cache.key,
            v=cache.value,
            out=out[:t],
            cu_seqlens_q=plan.cu_query_lens,
            cu_seqlens_k=cu_k,  # cumulative, also with the paged cache [callers]
            max_seqlen_q=plan.max_query_len,
            max_seqlen_k=plan.max_seq_len,
            softmax_scale=self.spec.scale,
            causal=True,
            window_size=self.causal_window,
            softcap=self.softcap,
            alibi_slopes=self.alibi_slopes,
            sqrt_alibi=False,
            block_table=plan.block_table,
            return_softmax_lse=True,
        )
        lse[:t].copy_(part.t())

    def _attend_prefill(
        self,
        query: torch.Tensor,
        cache: PagedKVCache,
        plan: PrefillPlan,
        causal: bool,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        start, t = plan.token_start, plan.num_tokens
        if start or query.shape[0] != t:  # decodes before them, or padding after
            query, out = query[start : start + t], out[start : start + t]
        result = self.backend.ops.contrib.vllm_flash_attn.flash_attn_varlen_func(
            q=query,
            k=cache.key,
            v=cache.value,
            out=out,
            alibi_slopes=self.alibi_slopes,
            sinks=self.sinks,
            **plan.kwargs,  # made by the builder (flash_attn_varlen_func's but the layer's)
            # the LSE from the same call: [H, t] float32, natural log [callers]
            **({} if lse is None else {"return_softmax_lse": True}),
        )
        if lse is not None:
            lse[start : start + t].copy_(result[1].t())

    def _attend_cascade(
        self,
        query: torch.Tensor,
        cache: PagedKVCache,
        plan: CascadePlan,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        fa = self.backend.ops.contrib.vllm_flash_attn
        q = query[: plan.num_tokens]
        shared = dict(
            softmax_scale=self.spec.scale,
            window_size=(-1, -1),  # cascade is planned only without a window
            softcap=self.softcap,
            return_softmax_lse=True,
        )
        # The prefix: every query token of the step, as one sequence, over the shared keys;
        # every key of the prefix precedes every query, so non-causal is exact.
        prefix_out, prefix_lse = fa.flash_attn_varlen_func(
            q=q,
            k=cache.key,
            v=cache.value,
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
            q=q,
            k=cache.key,
            v=cache.value,
            cu_seqlens_q=plan.cu_seqlens_q,
            cu_seqlens_k=plan.cu_suffix_k,
            max_seqlen_q=plan.max_query_len,
            max_seqlen_k=plan.max_suffix_len,
            causal=True,
            block_table=plan.suffix_block_table,
            **shared,
        )
        # Both LSEs are ixformer's own (natural log [inferred]), merged by its own op, output
        # positional, as the fork calls it [callers].
        if lse is None:
            fa.merge_attn_states(
                prefix_out, prefix_lse, suffix_out, suffix_lse, out[: plan.num_tokens]
            )
            return
        # ixformer's merge returns no LSE [callers: output only]: the kit's merge gives both
        # (the same math: natural log, an infinite LSE is an empty part)
        merged, merged_lse = merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse)
        out[: plan.num_tokens].copy_(merged)
        lse[: plan.num_tokens].copy_(merged_lse.t())

    # --- the int8 caches ----------------------------------------------------------------------
    def _attend_paged(
        self,
        query: torch.Tensor,
        cache: PagedKVCache,
        plan: PagedPlan,
        out: torch.Tensor,
        save: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``vllm_paged_attention_int8`` (mode 1) / ``_mix`` (mode 2), every argument by
        keyword as the fork passes them: Q quantized per (token, head), scales (T, H)."""
        fn = self.backend.ops.inference.functions
        spec = self.spec
        n = plan.num_tokens
        q, q_scale = fn.scaled_int8_quant_for_attn(query[:n], 2, transpose_scale=False)
        kwargs: dict[str, Any] = dict(
            output=out[:n],
            query=q,
            key_cache=cache.key,
            query_scale=q_scale,
            key_scale_cache=cache.key_scale,
            num_kv_heads=spec.num_kv_heads,
            scale=spec.scale,
            block_tables=plan.block_table,
            context_lens=plan.context_lens,
            block_size=spec.block_size,
            softcap=self.softcap,
            alibi_slopes=self.alibi_slopes,
            causal=True,
            window_left=self.causal_window[0],
            window_right=self.causal_window[1],
            use_sqrt_alibi=False,
            use_cuda_graph=plan.use_cuda_graph,
            max_context_len=plan.max_context_len,
            cu_query_lens=plan.cu_query_lens,
            max_query_len=1,
            value_cache=cache.value,
        )
        if save is not None:  # the fused KV write of a decode-only step
            qk, k_scale, v = self._quantize_kv(save[0], save[1], cache)
            kwargs.update(save_key=qk, save_value=v.contiguous(), save_key_scale=k_scale)
        if spec.kv_cache_dtype == "int8":
            fn.vllm_paged_attention_int8(value_scale_cache=cache.value_scale, **kwargs)
        else:
            fn.vllm_paged_attention_mix(**kwargs)

    def _attend_prefill_int8(
        self,
        query: torch.Tensor,
        cache: PagedKVCache,
        plan: PrefillPlan,
        causal: bool,
        out: torch.Tensor,
    ) -> None:
        """The int8 caches' other requests: ``flash_attn_varlen_int8_func`` with Q quantized
        per (token, head), its scales transposed (H, T); mode 2 passes its 16-bit value cache
        and ``v_scale=None`` [callers]."""
        fn = self.backend.ops.inference.functions
        rows = slice(plan.token_start, plan.token_start + plan.num_tokens)
        q, q_scale = fn.scaled_int8_quant_for_attn(query[rows], 2, transpose_scale=True)
        self.backend.ops.contrib.vllm_flash_attn.flash_attn_varlen_int8_func(
            q=q,
            k=cache.key,
            v=cache.value,
            q_scale=q_scale,
            k_scale=cache.key_scale,
            v_scale=cache.value_scale if self.spec.kv_cache_dtype == "int8" else None,
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

    def compute(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,  # never given: refused for int8 caches (.lse)
    ) -> None:
        """As the base class; on the int8 caches' decode-only steps the KV write rides on the
        paged kernel (its ``save_*`` arguments) instead of a separate call."""
        assert isinstance(meta, IluvatarAttentionMetadata)  # check_call
        if not meta.fused_write or key is None:
            super().compute(query, key, value, cache, meta, out)
            return
        assert meta.paged is not None and value is not None
        n = meta.num_actual_tokens
        self._attend_paged(query, cache, meta.paged, out, save=(key[:n], value[:n]))


IluvatarBackend.builder_type = IluvatarMetadataBuilder
IluvatarBackend.impl_type = IluvatarAttentionImpl  # impl() picks the int8 class by the spec
