"""The ``ascend`` backend: attnhub's protocol translated into ``torch_npu``'s calling conventions.

Per step, the builder does every host-side thing once (FlashInfer's ``plan``): it turns the
lengths into the lists the kernels take (cumulative query ends, per-sequence KV lengths with
the paged cache, cumulative KV ends for packed K/V), converts the block table to int32 (and the
slot mapping, for the ATB write only), and picks up the compressed 2048x2048 causal mask (one
per device, built once per process); the step's state is named on first read. Per layer, the
impl makes one KV write and **one** fused attention call for the whole batch, mixed or not,
with no loop over requests and no host read of a device tensor. Both are paid on every step
and layer, so they are kept cheap on the host (docs/performance.md): no torch op in the usual
plan, FIA's keyword arguments made once per step, the usual layer call checked in one pass.

  decoder          npu_fused_infer_attention_score.out     TND, paged NHD cache viewed as
                   (..._v2.out with learnable_sink)        (num_blocks, block_size, KV_N*D),
                                                           sparse_mode 3 (causal) or 4 (window)
  non-causal       npu_fusion_attention                    TND, packed K/V: this step's keys,
  (encoder types)                                          or gathered from the cache where
                                                           there is context (cross-attention),
                                                           sparse_mode 0 (4 with a window and
                                                           a bool mask)
  KV write         npu_scatter_pa_kv_cache(cache_mode=     the engine's slots (int32 or int64),
                   "Norm"); _npu_reshape_and_cache (ATB,   -1 rows left out by the builder;
                   310P) with AscendBackend.kv_write_op    int32 slots, the ATB op skips -1

Every ``[inferred]`` vendor semantic relied on is marked where it is used and listed in
docs/backends/ascend.md.
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
    scratch_field,
)
from attnhub.batch import BatchMetadata
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
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.kit import FixedShapeWrite, StepFacts, flat_slots, read_slots
from attnhub.kv_cache import PagedKVCache
from attnhub.spec import AttentionSpec, AttentionType
from attnhub_ascend import ops

INT_MAX = 2147483647  # the kernels' default for pre_tokens / next_tokens: unbounded
MASK_SIZE = 2048
#: The kernels' limits that Capabilities cannot express (checked in unsupported_reasons).
MAX_HEADS = 256
MAX_GQA_RATIO = 64
MAX_KV_HIDDEN = 65535  # KV_N * D in the (num_blocks, block_size, KV_N*D) cache view
MAX_SINK_HEAD_SIZE = 128
MAX_ENCODER_BATCH = 1024  # npu_fusion_attention varlen: at most 1024 sequences per call
MAX_FIA_BATCH = 4096  # FIA TND: at most 4096 requests (len(actual_seq_lengths)) per call
#: (1, 2, ..., MAX_FIA_BATCH): the query ends of a step whose requests all have one token.
_UNIT_ENDS = tuple(range(1, MAX_FIA_BATCH + 1))
_MIN, _OR = np.minimum.reduce, np.logical_or.reduce
#: The KV-cache write ops. ``npu_scatter_pa_kv_cache`` (cache_mode "Norm") is the A2/A3 one
#: (910B) and vllm-ascend's current write; ``_npu_reshape_and_cache`` is the ATB op (needs the
#: NNAL/ATB package), which vllm-ascend keeps for 310P only.
SCATTER_PA_KV_CACHE = "npu_scatter_pa_kv_cache"
RESHAPE_AND_CACHE = "_npu_reshape_and_cache"
#: Every declared head size (Capabilities.head_sizes) and where it comes from.
HEAD_SIZE_SOURCES = {
    64: "[callers] vllm-ascend's e2e quickstart serves Qwen2.5-0.5B-Instruct (head_dim 64) "
    "through this TND FIA call",
    128: "[doc] FIA TND constraints, without rope: Q_D = K_D = V_D = 128",
    192: "[doc] FIA TND constraints, without rope: Q_D = K_D = 192 with V_D 128 or 192",
    256: "[callers] vllm-ascend's e2e accuracy runs gemma-3-4b-it (head_dim 256) and Gemma4's "
    "sliding layers through this TND FIA call",
}


_MASKS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def compressed_causal_mask(
    device: torch.device, dtype: torch.dtype = torch.int8
) -> torch.Tensor:  # [2048, 2048]
    """The mask sparse_mode 2/3/4 take: ``triu(ones(2048, 2048), 1)``, 1 = masked (the kernels'
    polarity). Built once per device, dtype and process, shared by every step, layer and
    backend. FIA takes it as int8 (vllm-ascend's); npu_fusion_attention only as bool or uint8
    [doc], so the non-causal path asks for bool."""
    mask = _MASKS.get((device, dtype))
    if mask is None:
        ones = torch.ones(MASK_SIZE, MASK_SIZE, dtype=dtype, device=device)
        mask = _MASKS[device, dtype] = torch.triu(ones, 1)
    return mask


#: Why a value head size other than the key's is served only where it is.
HEAD_SIZE_V_REASON = (
    "FIA takes values narrower than keys only in TND without page attention: query and key D "
    "192 with value D 128 (or 128 + a 64-wide rope part with values 128), bfloat16 only, "
    "sparse_mode 0 or 3 (no window)"
)


@dataclass(frozen=True)
class SparseArgs:
    """The spec's mask pattern in the kernels' terms (the same for every step and layer)."""

    sparse_mode: int
    pre_tokens: int
    next_tokens: int
    needs_mask: bool

    @classmethod
    def for_spec(cls, spec: AttentionSpec, causal: bool) -> SparseArgs:
        left, right = spec.window
        if causal:
            if left < 0:
                # sparse_mode 3: bottom-right causal, key j visible to query i iff
                # j <= i + (kv_len - q_len); pre/next are ignored.
                return cls(3, INT_MAX, INT_MAX, True)
            # sparse_mode 4, the documented band: keep -pre <= (j - i) - (kv - q) <= next.
            # attnhub's sliding_window W keeps W keys (left = W - 1), so pre_tokens = W - 1 and
            # next_tokens = 0. vllm-ascend passes pre_tokens = W, which by the same band keeps
            # W + 1 keys; we follow the documented band (a deliberate difference).
            return cls(4, left, 0, True)
        if left < 0 and right < 0:
            return cls(0, INT_MAX, INT_MAX, False)  # non-causal, no window: no mask at all
        return cls(4, left if left >= 0 else INT_MAX, right if right >= 0 else INT_MAX, True)


@dataclass(frozen=True)
class AscendAttentionMetadata(AttentionMetadata):
    """One step, planned: every host-side argument of the kernels, ready to pass."""

    num_actual_tokens: int = 0
    #: True: non-causal attention over packed K/V (npu_fusion_attention); False: the fused
    #: paged call (FIA).
    packed: bool = False
    #: Packed path: the cache slot of every key, request after request. Read where the keys
    #: are not all this step's (context, cross-attention), or where forward is given no keys
    #: (key=value=None after write_kv: the step's keys are read back from the cache).
    kv_slots: torch.Tensor | None = None  # [sum(seq_lens)] int64, device
    #: Packed path: every key is one of this step's new ones (no context, not cross-attention),
    #: so a forward given key/value attends over them directly, without the gather.
    keys_in_step: bool = False
    #: With ``packed``: a causal step of a spec whose values are narrower than its keys, FIA in
    #: TND without page attention over the packed keys (``fia_kwargs``), not
    #: npu_fusion_attention.
    packed_fia: bool = False
    sparse: SparseArgs = field(default_factory=lambda: SparseArgs(3, INT_MAX, INT_MAX, True))
    #: TND ``actual_seq_lengths`` / ``actual_seq_qlen``: cumulative query ends, one per request
    #: (including the window padding rows of decode requests, see ``query_rows``).
    query_ends: tuple[int, ...] = ()
    #: ``actual_seq_lengths_kv`` with the paged cache: per-sequence KV lengths (seq_lens, as
    #: vllm-ascend passes them [callers]); for npu_fusion_attention's packed K/V,
    #: ``actual_seq_kvlen``: cumulative KV ends [doc].
    kv_lengths: tuple[int, ...] = ()
    block_table: torch.Tensor | None = None  # [num_reqs, max_blocks] int32, device
    slot_mapping: torch.Tensor | None = None  # [rows written] int32, device
    #: The rows of this step's key/value the KV write takes, when some real token has slot -1
    #: and the write op has no padding slot (npu_scatter_pa_kv_cache); None: the first
    #: num_actual_tokens rows.
    write_rows: torch.Tensor | None = None  # [rows written] int64, device
    atten_mask: torch.Tensor | None = None  # the per-device compressed causal mask, or None
    #: Window decode rows (see AscendMetadataBuilder._pad_window_decodes): the query row each
    #: kernel row reads, and the kernel row each real token's output comes from. None: 1:1.
    query_rows: torch.Tensor | None = None  # [kernel_tokens] int64, device
    output_rows: torch.Tensor | None = None  # [num_actual_tokens] int64, device
    kernel_tokens: int = 0  # T of the fused call (num_actual_tokens + window padding rows)
    #: FIA's keyword arguments for this step but the query, the cache views, the sink and the
    #: outputs (v2's names with sinks; the two length lists included), made by the builder
    #: once for every layer (the spec gives the layer-wide ones).
    fia_kwargs: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    #: Set by build_for_graph_capture: the FIA task groups forward records while captured
    #: (one per layer), and the graph's workspaces: scratch layers write into.
    graph: AscendGraph | None = scratch_field()


class GraphTask:
    """One captured FIA call: its task-group handle, the ExternalEvent its replay waits on, and
    the call itself (op, positional tensors, keyword arguments without the length lists)."""

    def __init__(
        self,
        handle: Any,
        event: Any,
        op: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        list_names: tuple[str, str],
    ) -> None:
        self.handle, self.event, self.op = handle, event, op
        self.args, self.kwargs, self.list_names = args, kwargs, list_names


class AscendGraph:
    """What a captured step's metadata carries for its updates: the tasks forward captured.
    A plain class (not a dataclass): every copy of the metadata shares one list."""

    def __init__(self) -> None:
        self.tasks: list[GraphTask] = []
        #: One FIA workspace per backend (spec) for this captured graph (one per capture size,
        #: as vllm-ascend keeps ``graph_params.workspaces[runtime_shape]``), sized by the
        #: max-workspace query at capture and passed at capture and in every update. Held here:
        #: the graph's tasks read it at every replay.
        self.workspaces: dict[Any, Any] = {}


class AscendBackend(AttentionBackend):
    name = "ascend"
    capabilities = Capabilities(
        devices=frozenset({"npu", "cpu"}),  # cpu: through the emulator only (emulate=True)
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        # Only head sizes the FIA doc names for TND without rope, or that vllm-ascend runs
        # through this TND call on hardware (see HEAD_SIZE_SOURCES). D = 512 in TND needs
        # query_rope / key_rope (MLA) [doc]; vllm-ascend routes D = 512 elsewhere.
        head_sizes=frozenset({64, 128, 192, 256}),
        # FIA's key and value must have one shape, but in TND without page attention and
        # without rope it takes Q_D = K_D = 192 with V_D 128 [doc] (MLA's expanded prefill, as
        # vllm-ascend calls it [callers]): causal steps go there over keys gathered from the
        # cache (see _packed_fia; more limits in unsupported_reasons).
        head_size_v=HeadSizeVSupport(
            pairs=((192, 128),),
            dtypes=frozenset({torch.bfloat16}),
            reason=HEAD_SIZE_V_REASON,
        ),
        # FIA page attention with query lengths > 1 needs block_size a multiple of 128 in
        # 128..512; one fused call serves prefills too, so decode-only sizes (16-aligned) are
        # not enough.
        block_sizes=frozenset({128, 256, 384, 512}),
        kv_cache_dtypes=frozenset({"auto"}),
        kv_cache_layout="NHD",
        # The fused ops view each plane as (num_blocks, block_size, KV_N * D): contiguous.
        strided_kv_cache=False,
        attn_types=frozenset(AttentionType),
        sliding_window=True,
        softcap=False,
        alibi=False,
        sinks=True,
        multi_token_decode=True,
        chunked_prefill=True,
        cascade=False,
        # Uniform batches of causal specs without a window (the builder's graph_support says
        # NEVER for the others): FIA's host-side length lists, baked into a captured graph,
        # are refreshed per step by task-group updates (update_graph_params, docs/graphs.md).
        graph_capture=GraphSupport.UNIFORM_BATCH,
        graph_capture_reason=(
            "uniform batches of causal specs without a window (NEVER for the others: window "
            "decodes are padded per step, a data-dependent size; non-causal steps run "
            "npu_fusion_attention over host-planned key slots); FIA's length lists are "
            "refreshed per step by task-group updates; mixed batches are not declared (the "
            "seed's vLLM builder declares UNIFORM_SINGLE_TOKEN_DECODE)"
        ),
        # The emulator computes in float32 and rounds once; the kernels accumulate in float32
        # with float16/bfloat16 operands.
        tolerances={
            torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
            torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2),
        },
        priority={"npu": 100},
        # Every path returns each row's natural-log LSE from its one call: FIA's
        # softmax_lse_flag (v2: return_softmax_lse, the sink counted [inferred]) and
        # npu_fusion_attention's softmax_max + log(softmax_sum) (docs/backends/ascend.md "LSE").
        lse=LseSupport(
            dtypes=frozenset({torch.float16, torch.bfloat16}),
            reason="the Ascend kernels take float16 and bfloat16",
        ),
        batch_invariant=BatchInvariance(
            reason="CANN tiles npu_fused_infer_attention_score per call from the whole step "
            "(batch size, lengths, cores) and documents no batch-invariant mode, so a "
            "request's reduction order may follow its companions [inferred]"
        ),
        # MLA's absorbed form through FIA's MLA form (query_rope / key_rope, attnhub_ascend.mla):
        # what the FIA doc allows on A2/A3 with query D 512 (docs/backends/ascend.md "MLA").
        mla=MlaSupport(
            dtypes=frozenset({torch.float16, torch.bfloat16}),
            kv_cache_dtypes=frozenset({"auto"}),
            block_sizes=frozenset({16, 128}),
            latent_sizes=frozenset({(512, 64)}),
            num_heads=frozenset({32, 64, 128}),
            layouts=("split",),  # nope and rope planes apart, as vllm-ascend keeps them
            max_query_len=16,
            # FIA's MLA form has no softmax_lse_flag [doc]: return_lse goes to ATB's MLA op
            # (npu_multi_head_latent_attention, calc_type_ring), whose lse is in the model
            # dtype and converted to float32 (attnhub_ascend.mla; docs/backends/ascend.md)
            lse=LseSupport(
                dtypes=frozenset({torch.float16, torch.bfloat16}),
                reason="ATB's MLA op takes float16 and bfloat16",
            ),
            because={
                "mla.dtype": "FIA's MLA form takes float16 and bfloat16",
                "mla.kv_cache_dtype": "FIA's MLA form takes no quantized cache (antiquant) here",
                "mla.block_size": "FIA's MLA form takes page attention with blocks of 16 or 128",
                "mla.latent_size": "FIA's MLA form takes query/key D 512 with a rope part of 64",
                "mla.num_heads": "FIA's MLA form takes query N 32, 64 or 128",
            },
            tolerances={
                torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
                torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2),
            },
        ),
    )

    #: The KV-cache write op: ``npu_scatter_pa_kv_cache`` (the 910B / A2 / A3 default, as in
    #: vllm-ascend) or ``_npu_reshape_and_cache`` (ATB, needs NNAL; the only one on 310P). Set on
    #: the class (or a subclass) before building impls.
    kv_write_op: ClassVar[str] = SCATTER_PA_KV_CACHE

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
        ratio = spec.num_heads // spec.num_kv_heads
        if spec.num_heads > MAX_HEADS:
            reasons.append(
                Refusal(
                    f"num_heads {spec.num_heads} exceeds the kernels' {MAX_HEADS}",
                    field="num_heads",
                    value=spec.num_heads,
                )
            )
        if ratio > MAX_GQA_RATIO:
            reasons.append(
                Refusal(
                    f"num_heads / num_kv_heads = {ratio} exceeds the kernels' GQA ratio limit "
                    f"{MAX_GQA_RATIO}",
                    field="num_kv_heads",
                    value=spec.num_kv_heads,
                )
            )
        if spec.num_kv_heads * spec.head_size > MAX_KV_HIDDEN:
            reasons.append(
                Refusal(
                    f"num_kv_heads * head_size = {spec.num_kv_heads * spec.head_size} exceeds "
                    f"{MAX_KV_HIDDEN}, FIA's limit for the (num_blocks, block_size, KV_N*D) "
                    "cache",
                    field="head_size",
                    value=spec.head_size,
                )
            )
        if spec.head_size_v != spec.head_size:
            reasons += _head_size_v_refusals(spec)
        # Sinks of a non-causal attention type go to npu_fusion_attention's float32 `sink`
        # alone (CANN >= 8.5) [doc]: no limit of FIA v2's learnable_sink applies to them.
        if spec.use_sinks and spec.causal:
            if spec.dtype != torch.bfloat16:
                reasons.append(
                    Refusal(
                        f"sinks need a bfloat16 model, got {spec.dtype}: learnable_sink of "
                        "npu_fused_infer_attention_score_v2 is bfloat16 only, so float16 sinks "
                        "would lose 3 mantissa bits, a per-head error that biases the whole "
                        "output beyond float16 rounding",
                        field="sinks",
                        value=spec.dtype,
                    )
                )
            if spec.head_size > MAX_SINK_HEAD_SIZE:
                reasons.append(
                    Refusal(
                        f"sinks need head_size <= {MAX_SINK_HEAD_SIZE} (learnable_sink), got "
                        f"{spec.head_size}",
                        field="sinks",
                        value=spec.head_size,
                    )
                )
        return reasons

    def __init__(
        self, spec: AttentionSpec, device: torch.device | str = "cpu", *, emulate: bool = False
    ) -> None:
        super().__init__(spec, device, emulate=emulate)
        if self.kv_write_op not in (SCATTER_PA_KV_CACHE, RESHAPE_AND_CACHE):
            raise UnsupportedConfigurationError(
                self.name,
                [
                    f"kv_write_op = {self.kv_write_op!r} is not {SCATTER_PA_KV_CACHE!r} or "
                    f"{RESHAPE_AND_CACHE!r}"
                ],
            )
        #: torch_npu or the emulator, resolved once for this instance.
        self.ops: Any = ops.namespace(self.device, emulate)
        self._graph_api: Any = None

    @property
    def graph_api(self) -> Any:
        """``torch.npu`` natively (NPUGraph, task groups, streams, events), else its emulation
        (``attnhub_ascend.npu_graph``); resolved on first use."""
        if self._graph_api is None:
            self._graph_api = ops.graph_namespace(self.device, self.emulate)
        return self._graph_api

    def graph_adaptor(self) -> Any:
        """attnhub's NPUGraphAdaptor over this backend's graph API."""
        from attnhub.kit import NPUGraphAdaptor

        return NPUGraphAdaptor(self.graph_api)


#: Why the kernels refuse what Capabilities refuses, per refused field.
_WHY = {
    "softcap": "FIA has no logit soft-capping",
    "alibi": "FIA's pse_shift bias is not supported with the TND layout",
    "kv_cache_dtype": "FIA's int8 antiquant modes are not supported with page attention in TND",
    "block_size": "FIA page attention with query lengths > 1 needs a multiple of 128 up to 512",
    "head_size": (
        "FIA in TND without rope documents D 128 and 192; vllm-ascend runs 64 and 256 through "
        "the same call; D 512 needs query_rope/key_rope"
    ),
    "dtype": "the kernels take float16 and bfloat16",
}


class AscendMetadataBuilder(AttentionMetadataBuilder[AscendAttentionMetadata]):
    """Plans a step once for every layer: state, length lists, int32 tensors, mask."""

    backend: AscendBackend
    #: Requests with query_len <= this over cached context count as (multi-token) decodes
    #: when the builder names the step's state.
    reorder_batch_threshold: ClassVar[int] = 16
    #: Give windowed one-token requests a leading padding row (see _window_decode_rows), so
    #: that the band applies to them under either reading of "Q_S为1时该参数无效". Set to
    #: False once a hardware run shows FIA applies sparse_mode 4 to one-token requests of a
    #: TND batch (docs/backends/ascend.md, "To verify on hardware").
    pad_window_decodes: ClassVar[bool] = True
    metadata_type = AscendAttentionMetadata

    def __init__(self, backend: AscendBackend) -> None:
        super().__init__(backend)
        #: The mask pattern of causal steps and of non-causal ones (an encoder spec, or a
        #: decoder spec given a batch with causal=False).
        self.sparse_causal = SparseArgs.for_spec(self.spec, causal=True)
        self.sparse_full = SparseArgs.for_spec(self.spec, causal=False)

    @property
    def graph_support(self) -> GraphSupport:
        """The declared level, but NEVER for specs whose step has data-dependent shapes: a
        window (decode rows padded per step, see _window_decode_rows) or non-causal attention
        (npu_fusion_attention over keys gathered by a host-planned slot list)."""
        spec = self.spec
        if not spec.causal or (self.pad_window_decodes and spec.window[0] >= 0):
            return GraphSupport.NEVER
        if spec.head_size_v != spec.head_size:  # keys gathered by host-planned slots
            return GraphSupport.NEVER
        return super().graph_support

    def build_for_graph_capture(self, batch: BatchMetadata) -> AscendAttentionMetadata:
        """The step's plan with the runner's persistent buffers as its tensors (block table,
        slots: the KV write finds its rows on the device) and an empty task list that forward
        fills while captured. The length lists are this batch's; update_graph_params replaces
        them in the captured tasks every step."""
        if self.graph_support == GraphSupport.NEVER:
            raise UnsupportedConfigurationError(
                self.backend.name,
                [
                    "graph capture of this spec: a sliding window pads decode rows per step, "
                    "non-causal attention and values narrower than keys gather host-planned "
                    "key slots (data-dependent shapes); graph_support is NEVER for it"
                ],
            )
        if not batch.causal:
            raise UnsupportedConfigurationError(
                self.backend.name,
                ["graph capture of a non-causal batch (npu_fusion_attention's packed path)"],
            )
        step = self.capture_step(batch)
        planned = self.plan(step)
        if planned.get("query_rows") is not None or planned["block_table"] is not batch.block_table:
            raise UnsupportedConfigurationError(
                self.backend.name,
                ["graph capture needs an int32 contiguous block table and no window padding"],
            )
        return self.metadata(
            step, {**planned, "slot_mapping": None, "write_rows": None, "graph": AscendGraph()}
        )

    def update_graph_params(
        self, graph_meta: AscendAttentionMetadata, batch: BatchMetadata, stream: Any
    ) -> None:
        """Re-launch every captured FIA task with this step's lists, inside
        graph_task_update_begin/end on the adaptor's update stream (already ordered after the
        previous replay), then record the task's ExternalEvent there, which the replay's
        captured wait consumes (vllm-ascend's update_attn_params, without its synchronize)."""
        assert graph_meta.graph is not None, "metadata not from build_for_graph_capture"
        npu = self.backend.graph_api
        query_ends = tuple(batch.query_start_loc_cpu[1:].tolist())  # host data
        kv_lengths = tuple(batch.seq_lens_cpu.tolist())
        for task in graph_meta.graph.tasks:
            q_name, kv_name = task.list_names
            npu.graph_task_update_begin(stream, task.handle)
            task.op(*task.args, **task.kwargs, **{q_name: query_ends, kv_name: kv_lengths})
            npu.graph_task_update_end(stream)
            task.event.record(stream)

    def plan(self, step: Step) -> Mapping[str, Any]:
        # Paid once per engine step: no torch op on the usual step (a torch op after build's
        # numpy checks costs 5-20 us here, the CPU caches being cold for torch's dispatcher;
        # docs/performance.md). The lengths come from what build's checks read (numpy).
        batch = step.batch
        facts = self._facts(step)
        causal = self.spec.causal and batch.causal
        sparse = self.sparse_causal if causal else self.sparse_full
        mask = None
        if sparse.needs_mask:  # FIA takes int8 (vllm-ascend's); npu_fusion_attention bool
            mask = compressed_causal_mask(self.backend.device, torch.int8 if causal else torch.bool)
        slot_mapping, write_rows = self._kv_write_rows(batch, facts)
        common: dict[str, Any] = dict(  # what every kind of step's metadata holds
            num_actual_tokens=batch.num_actual_tokens,
            sparse=sparse,
            atten_mask=mask,
            slot_mapping=slot_mapping,
            write_rows=write_rows,
        )
        B = batch.num_reqs
        if B and batch.max_query_len == 1:  # one token per request: the ends are 1..B
            query_ends = _UNIT_ENDS[:B] if B <= MAX_FIA_BATCH else tuple(range(1, B + 1))
        else:
            query_ends = tuple(batch.query_start_loc_cpu.numpy()[1:].tolist())  # host data
        if not causal:  # npu_fusion_attention over packed K/V
            return self._packed(batch, facts, common, query_ends)
        if self.spec.head_size_v != self.spec.head_size:  # FIA over packed K/V
            return self._packed_fia(batch, facts, common, query_ends)
        fields = self._paged(batch, facts, common, query_ends)
        fields["fia_kwargs"] = self._fia_kwargs(fields)
        return fields

    def _packed(
        self,
        batch: BatchMetadata,
        facts: StepFacts,
        common: dict[str, Any],
        query_ends: tuple[int, ...],
    ) -> dict[str, Any]:
        """A non-causal step: npu_fusion_attention over packed K/V."""
        self._check_batch_size(batch, MAX_ENCODER_BATCH, "sequences", ENCODER_BATCH_LIMIT)
        seq_lens, context_lens = facts.seq_lens, facts.context_lens
        assert seq_lens is not None and context_lens is not None  # _facts
        cross = self.spec.attn_type is AttentionType.ENCODER_DECODER
        return dict(
            common,
            packed=True,
            kernel_tokens=batch.num_actual_tokens,
            query_ends=query_ends,
            kv_lengths=tuple(np.cumsum(seq_lens).tolist()),  # cumulative KV ends
            # planned for every non-causal step: forward(q, None, None, ...) after
            # write_kv reads even a step without context back from the cache
            kv_slots=self._kv_slots(batch, seq_lens),
            keys_in_step=not cross and not bool(_OR(context_lens)),
        )

    def _paged(
        self,
        batch: BatchMetadata,
        facts: StepFacts,
        common: dict[str, Any],
        query_ends: tuple[int, ...],
    ) -> dict[str, Any]:
        """A causal step: FIA over the paged cache in TND."""
        self._check_batch_size(batch, MAX_FIA_BATCH, "requests", FIA_BATCH_LIMIT)
        assert facts.seq_lens is not None and facts.context_lens is not None  # _facts
        table = batch.block_table
        if table.dtype is not torch.int32 or not table.is_contiguous():
            table = table.to(torch.int32).contiguous()
        # paged cache: per-sequence KV lengths [callers: vllm-ascend passes seq_lens; the FIA
        # doc calls both TND lists cumulative]
        kv_lengths = tuple(facts.seq_lens.tolist())
        if (
            self.pad_window_decodes
            and common["sparse"].sparse_mode == 4
            and (facts.min_context_len > 0 or bool(_OR(facts.context_lens)))  # some context
        ):
            padded = self._window_decode_rows(batch, facts)
            if padded:
                return dict(common, block_table=table, kv_lengths=kv_lengths, **padded)
        return dict(
            common,
            kernel_tokens=batch.num_actual_tokens,
            block_table=table,
            query_ends=query_ends,
            kv_lengths=kv_lengths,
        )

    def _check_batch_size(self, batch: BatchMetadata, limit: int, what: str, op: str) -> None:
        """A step of more than ``limit`` requests is refused, naming the count (the engine
        splits it)."""
        check_batch_size(self.backend, batch.num_reqs, limit, what, op)

    def _packed_fia(
        self,
        batch: BatchMetadata,
        facts: StepFacts,
        common: dict[str, Any],
        query_ends: tuple[int, ...],
    ) -> dict[str, Any]:
        """A causal step of a spec whose values are narrower than its keys: FIA in TND without
        page attention (its only form with K_D != V_D [doc]) over every request's keys,
        gathered from the cache after the write (or the step's own where no request has
        context), cumulative KV ends, sparse_mode 3 with the compressed mask, as many K/V
        heads as query heads; vllm-ascend's MLA prefill call (``block_table=None``,
        ``block_size=0``) [callers]."""
        self._check_batch_size(batch, MAX_FIA_BATCH, "requests", FIA_BATCH_LIMIT)
        seq_lens, context_lens = facts.seq_lens, facts.context_lens
        assert seq_lens is not None and context_lens is not None  # _facts
        kv_ends = tuple(np.cumsum(seq_lens).tolist())
        spec = self.spec
        fia_kwargs: dict[str, Any] = dict(
            atten_mask=common["atten_mask"],
            block_table=None,
            block_size=0,
            num_heads=spec.num_heads,
            num_key_value_heads=spec.num_heads,
            input_layout="TND",
            sparse_mode=3,
            scale=spec.scale,
            actual_seq_lengths=query_ends,  # cumulative ends, both [doc: TND]
            actual_seq_lengths_kv=kv_ends,
            workspace=None,
        )
        return dict(
            common,
            packed=True,
            packed_fia=True,
            kernel_tokens=batch.num_actual_tokens,
            query_ends=query_ends,
            kv_lengths=kv_ends,
            kv_slots=self._kv_slots(batch, seq_lens),
            keys_in_step=not bool(_OR(context_lens)),
            fia_kwargs=fia_kwargs,
        )

    def _fia_kwargs(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """FIA's keyword arguments for a paged step's planned ``fields`` (v2's names with
        sinks) but the sink and the outputs, with the two length lists (cumulative query ends
        for TND, per-sequence KV lengths for the paged cache [callers]); a captured task's
        leave the lists out (``fia_lists``: they are updated per replay)."""
        spec, sparse = self.spec, fields["sparse"]
        kwargs: dict[str, Any] = dict(
            atten_mask=fields["atten_mask"],
            block_table=fields["block_table"],
            num_key_value_heads=spec.num_kv_heads,
            pre_tokens=sparse.pre_tokens,
            next_tokens=sparse.next_tokens,
            input_layout="TND",
            sparse_mode=sparse.sparse_mode,
            block_size=spec.block_size,
            workspace=None,
        )
        if spec.use_sinks:  # the layers call v2, with their learnable sink
            kwargs.update(num_query_heads=spec.num_heads, softmax_scale=spec.scale)
        else:
            kwargs.update(num_heads=spec.num_heads, scale=spec.scale)
        q_name, kv_name = fia_lists(spec)
        kwargs.update({q_name: fields["query_ends"], kv_name: fields["kv_lengths"]})
        return kwargs

    @staticmethod
    def _facts(step: Step) -> StepFacts:
        """What build's checks read of the step (numpy lengths, the smallest slot), or the
        lengths read here where the checks were structural."""
        facts = step.facts
        if facts.seq_lens is not None and facts.context_lens is not None:
            return facts
        return StepFacts.of(step.batch)  # min_slot unknown (-1): the write's rows are looked for

    def _kv_write_rows(
        self, batch: BatchMetadata, facts: StepFacts
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return kv_write_rows(self.backend, batch, facts)

    def _kv_slots(
        self, batch: BatchMetadata, seq_lens: np.ndarray
    ) -> torch.Tensor:  # [sum(seq_lens)] int64, device
        """The cache slot of every key of every request, in order, for the packed path to gather
        (non-causal attention over cached context, cross-attention). Positions are host data
        (numpy); the block table is read on the device, so building it needs no device-to-host
        sync."""
        seq = seq_lens.astype(np.int64)
        req = np.repeat(np.arange(seq.shape[0]), seq)  # the request of every key
        pos = np.arange(req.shape[0]) - np.repeat(np.cumsum(seq) - seq, seq)  # its position
        dev, bs = self.backend.device, batch.block_size
        req_d = torch.from_numpy(req).to(dev)
        block_d = torch.from_numpy(pos // bs).to(dev)
        return batch.block_table[req_d, block_d].long() * bs + torch.from_numpy(pos % bs).to(dev)

    def _window_decode_rows(self, batch: BatchMetadata, facts: StepFacts) -> dict[str, Any]:
        """Give every windowed one-token request a leading padding row: the metadata fields
        that say so (none when no request needs one).

        FIA computes a request with one query token in its incremental (IFA) branch, where
        sparse_mode, pre_tokens and next_tokens are ignored [doc: "Q_S为1时该参数无效"; read
        per decode row of a TND batch, as vendor-ops.md does]: such a row would see all its
        keys, not the window. With one extra query row in front (a copy of the token's query,
        aligned one position earlier, its output dropped) the request has two query tokens and
        the band applies to the real one. Only requests whose window actually cuts
        (seq_len > W) are padded; if the hardware does apply the band to single rows, the
        padding changes nothing.
        """
        q, seq = facts.query_lens, facts.seq_lens
        assert q is not None and seq is not None
        decodes_only = batch.max_query_len == 1
        visible = self.spec.window[0] + 1
        pad = seq > visible if decodes_only else (q == 1) & (seq > visible)
        if not _OR(pad):
            return {}
        # numpy on host lengths (a torch op here costs several times more, see plan): every
        # token once, a padded request's one token twice (its padding row reads the same query
        # row); each token's output is its last kernel row
        n = batch.num_actual_tokens
        qsl = batch.query_start_loc_cpu.numpy()
        copies = np.ones(n, dtype=np.int64)
        copies[qsl[:-1][pad]] = 2
        src = np.repeat(np.arange(n), copies)  # [kernel_tokens]
        ends = np.cumsum(copies)  # each token's last kernel row + 1
        dev = self.backend.device
        return dict(
            query_rows=torch.from_numpy(src).to(dev),
            output_rows=torch.from_numpy(ends - 1).to(dev),
            # a request's query end is its last token's (one token per request: all of them)
            query_ends=tuple((ends if decodes_only else ends[qsl[1:] - 1]).tolist()),
            kernel_tokens=int(src.shape[0]),
        )


class AscendAttentionImpl(AttentionImpl):
    """One layer: one KV write, then one fused attention call for the whole batch."""

    backend: AscendBackend

    def __init__(
        self,
        backend: AscendBackend,
        *,
        alibi_slopes: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        super().__init__(backend, alibi_slopes=alibi_slopes, sinks=sinks)
        # learnable_sink is bfloat16 (Q_N,) [doc]: converted once per layer, not per call. Only
        # bfloat16 models take sinks (unsupported_reasons): there the sink's rounding is the
        # model dtype's own, as in a plain bfloat16 computation.
        self.learnable_sink = None if self.sinks is None else self.sinks.to(torch.bfloat16)
        # npu_fusion_attention's `sink` (non-causal steps: an encoder type, or a decoder
        # layer's step with causal=False) is float32 [head_num] [doc, CANN >= 8.5]: the sinks
        # as given, never dropped.
        self.fa_sink = None if self.sinks is None else self.sinks.float().contiguous()
        # softmax_lse of the .out overloads is a reserved output without the LSE flag; a
        # one-element float32 tensor is accepted there [inferred; the docs' example passes one].
        self._lse = torch.empty(1, dtype=torch.float32, device=backend.device)
        #: FIA's LSE flag, as the layer's op spells it (v1, or v2 with the sink)
        self._lse_flag = {
            "return_softmax_lse" if self.sinks is not None else "softmax_lse_flag": True
        }
        self._storage_checked: torch.Tensor | None = None  # the key plane last checked
        #: (key plane, value plane, their (num_blocks, block_size, KV_N*D) views)
        self._paged_views: tuple[torch.Tensor, ...] | None = None

    def check_call(self, cache: PagedKVCache, meta: AttentionMetadata) -> None:
        if not isinstance(meta, AscendAttentionMetadata):
            raise InvalidInputError(
                f"meta must come from the ascend backend's metadata_builder().build(batch), "
                f"got {type(meta).__name__}"
            )
        if cache.key is not self._storage_checked:  # once per cache plane, not per layer call
            _check_cache_storage(cache)
            self._storage_checked = cache.key

    # --- KV write ---------------------------------------------------------------------------
    def store_kv(
        self,
        key: torch.Tensor,  # [>= n, num_kv_heads, head_size]
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,  # [n] int32/int64, -1 = padding
        meta: AttentionMetadata | None = None,
    ) -> None:
        if meta is not None:
            self._store_step_kv(key, value, cache, meta)
            return
        n = slot_mapping.shape[0]
        if n == 0:
            return
        _check_cache_storage(cache)
        # The engine's own slot tensor (write_kv alone): converted per call.
        key, value, slots = key[:n], value[:n], slot_mapping.to(torch.int32).contiguous()
        if self.backend.kv_write_op == SCATTER_PA_KV_CACHE:
            # No padding slot in this op: drop the -1 rows. write_kv without meta has already
            # read these slots on the host (the core's value check), so this read adds none
            # that a step's forward would make.
            host = slot_mapping.to("cpu")
            if bool((host < 0).any()):
                rows = (host >= 0).nonzero()[:, 0].to(key.device)
                if rows.numel() == 0:
                    return
                key, value, slots = key[rows], value[rows], slots[rows]
        self._write(key, value, cache, slots)

    def _store_step_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> None:
        """A step's KV write, with the slots (and rows) the builder planned."""
        assert isinstance(meta, AscendAttentionMetadata)
        if meta.graph is not None:
            self._write_graph_step(key, value, cache, meta.batch.slot_mapping)
            return
        assert meta.slot_mapping is not None
        if meta.write_rows is not None:  # some real token has slot -1 (scatter op only)
            key, value = key[meta.write_rows], value[meta.write_rows]
        n = meta.slot_mapping.shape[0]
        if n:
            if key.shape[0] != n:
                key, value = key[:n], value[:n]
            self._write(key, value, cache, meta.slot_mapping)  # planned once per step

    def _write_graph_step(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        """The KV write of a captured step, with a fixed shape: the rows to leave out (slot -1:
        padding) are not known at capture. _npu_reshape_and_cache skips them itself;
        npu_scatter_pa_kv_cache takes no -1, so each such row is redirected to the step's first
        written row (same slot, same value: duplicates of one value), and a step that writes
        nothing rewrites slot 0 with what it holds (the kit's FixedShapeWrite). Device ops
        only: the graph captures them."""
        T = slot_mapping.shape[0]
        if self.backend.kv_write_op == RESHAPE_AND_CACHE:
            self._write(key[:T], value[:T], cache, slot_mapping.to(torch.int32).contiguous())
            return
        write = FixedShapeWrite.of(slot_mapping)
        k, v = (
            write.pick(
                src.index_select(0, write.rows), read_slots(plane, flat_slots(plane), write.slots)
            )
            for src, plane in ((key, cache.key), (value, cache.value))
        )
        self._write(k, v, cache, write.slots.to(torch.int32))

    def _write(
        self, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache, slots: torch.Tensor
    ) -> None:
        """The KV write op; ``slots`` contiguous already (planned once per step, or made so by
        the caller)."""
        write_kv_planes(self.backend, key, value, cache.key, cache.value, slots)

    # --- attention ----------------------------------------------------------------------------
    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,  # [num_tokens, num_heads, head_size]
        lse: torch.Tensor | None = None,  # [num_tokens, num_heads] float32: return_lse=True
    ) -> None:
        assert isinstance(meta, AscendAttentionMetadata)
        n = meta.num_actual_tokens
        if n == 0:
            return
        if meta.packed:
            if meta.keys_in_step and key is not None and value is not None:
                k, v = key[:n], value[:n]  # no context: the keys are this step's
            else:  # one gather per layer of every request's keys from the cache
                assert meta.kv_slots is not None
                k = _flat(cache.key).index_select(0, meta.kv_slots)
                v = _flat(cache.value).index_select(0, meta.kv_slots)
            attend = self._attend_packed_fia if meta.packed_fia else self._attend_packed
            attend(query[:n], k, v, meta, out[:n], None if lse is None else lse[:n])
            return
        if meta.query_rows is None:
            if query.shape[0] != n:
                query, out = query[:n], out[:n]
            q = query.contiguous()
            direct = out.is_contiguous()
            target = out if direct else torch.empty_like(q)
        else:  # window decode rows padded: kernel rows != token rows
            q = query.index_select(0, meta.query_rows)
            direct = False
            target = torch.empty_like(q)
        if lse is None:
            self._attend_paged(q, cache, meta, target, self._lse)
        else:
            self._attend_paged_lse(q, cache, meta, target, lse[:n])
        if direct:
            return
        if meta.output_rows is not None:
            target = target.index_select(0, meta.output_rows)
        out[:n].copy_(target)

    def _attend_paged_lse(
        self,
        q: torch.Tensor,  # [kernel_tokens, num_heads, head_size], TND
        cache: PagedKVCache,
        meta: AscendAttentionMetadata,
        target: torch.Tensor,
        lse: torch.Tensor,  # [n, num_heads] float32: the step's rows
    ) -> None:
        """FIA with its LSE flag: ``softmax_lse`` float32 ``(T, N, 1)`` [doc], natural log,
        written straight into the caller's rows where they are that buffer (one row per token,
        dense), else into one of the op's shape and copied (the window decode padding rows'
        LSEs dropped as their outputs are). Every row sees a key (causal, seq_len >= query_len),
        so none is left as the op's uncorrected NaN."""
        rows = meta.output_rows
        if rows is None and lse.is_contiguous():
            self._attend_paged(q, cache, meta, target, lse.unsqueeze(-1), self._lse_flag)
            return
        kernel_lse = torch.empty(q.shape[0], q.shape[1], 1, dtype=torch.float32, device=q.device)
        self._attend_paged(q, cache, meta, target, kernel_lse, self._lse_flag)
        kernel_lse = kernel_lse[:, :, 0]
        lse.copy_(kernel_lse if rows is None else kernel_lse.index_select(0, rows))

    def _attend_paged(
        self,
        q: torch.Tensor,  # [kernel_tokens, num_heads, head_size], TND
        cache: PagedKVCache,
        meta: AscendAttentionMetadata,
        target: torch.Tensor,  # like q: written by the kernel
        softmax_lse: torch.Tensor,  # .out's second output: reserved, or (T, N, 1) with the flag
        flag: dict[str, bool] | None = None,  # the LSE flag (None: not asked for)
    ) -> None:
        # NHD cache viewed as (num_blocks, block_size, KV_N * D): views remembered for the last
        # cache's very planes, so a reallocated cache is never stale. TND + this paged view
        # with float16 or head sizes other than 128/192 follows vllm-ascend's callers over one
        # docs section that lists "BFLOAT16, D 128/192" for TND [callers over doc, inferred to
        # cover paged TND].
        views = self._paged_views
        if views is None or views[0] is not cache.key or views[1] is not cache.value:
            num_blocks, block_size = cache.key.shape[:2]
            views = self._paged_views = (
                cache.key,
                cache.value,
                cache.key.view(num_blocks, block_size, -1),
                cache.value.view(num_blocks, block_size, -1),
            )
        key_cache, value_cache = views[2], views[3]
        extra = _NO_FLAG if flag is None else flag
        if meta.graph is not None:
            self._attend_paged_graph(q, key_cache, value_cache, meta, target, softmax_lse, extra)
            return
        # the step's keyword arguments, made by the builder once for all layers (the block
        # size is the spec's: the cache was checked against it)
        kwargs = meta.fia_kwargs
        if self.learnable_sink is None:
            self.backend.ops.npu_fused_infer_attention_score.out(
                q, key_cache, value_cache, **kwargs, **extra, out=[target, softmax_lse]
            )
        else:
            self.backend.ops.npu_fused_infer_attention_score_v2.out(
                q,
                key_cache,
                value_cache,
                **kwargs,
                **extra,
                learnable_sink=self.learnable_sink,
                out=[target, softmax_lse],
            )

    def _attend_paged_graph(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AscendAttentionMetadata,
        target: torch.Tensor,
        softmax_lse: torch.Tensor,
        flag: dict[str, bool],
    ) -> None:
        """FIA on a step made by build_for_graph_capture: recorded in a task group while the
        stream is captured, called directly otherwise (the step run before capture)."""
        ops_ = self.backend.ops
        lists = fia_lists(self.spec)
        shared = {k: v for k, v in meta.fia_kwargs.items() if k not in lists}
        shared.update(flag)  # the LSE flag is the task's: every update re-issues it
        shared["out"] = [target, softmax_lse]
        if self.learnable_sink is None:
            op = ops_.npu_fused_infer_attention_score.out
            max_workspace = ops_._npu_fused_infer_attention_score_get_max_workspace
        else:
            op = ops_.npu_fused_infer_attention_score_v2.out
            max_workspace = ops_._npu_fused_infer_attention_score_v2_get_max_workspace
            shared["learnable_sink"] = self.learnable_sink
        args = (q, key_cache, value_cache)
        step_lists = {lists[0]: meta.query_ends, lists[1]: meta.kv_lengths}
        npu = self.backend.graph_api
        if not npu.is_current_stream_capturing():
            op(*args, **shared, **step_lists)  # the warm-up run: a workspace of its own
            return
        # Captured: the lists are host values the task bakes in, and so is the workspace the
        # task runs in. One workspace per captured graph (and spec), sized once by the
        # max-workspace query for the largest lengths this graph's shapes allow (the block
        # table's capacity), kept alive by the graph's metadata and passed to the capture and
        # to every update, as vllm-ascend's wrapper does [callers]. workspace=None would size
        # the capture's for its own lengths and make each update allocate one freed when the
        # update returns (op-plugin's .out) while the replay still reads it.
        assert meta.graph is not None
        workspace = meta.graph.workspaces.get(self.backend)
        if workspace is None:
            query_kwargs = {k: v for k, v in shared.items() if k not in ("out", "workspace")}
            workspace = max_workspace(*args, **query_kwargs, **step_lists)
            meta.graph.workspaces[self.backend] = workspace
        shared["workspace"] = workspace
        # Record the call in a task group, after a wait on an ExternalEvent that each step's
        # update records (update_graph_params), as vllm-ascend's full-graph FIA path does
        # [callers].
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        op(*args, **shared, **step_lists)
        handle = npu.graph_task_group_end(stream)
        meta.graph.tasks.append(GraphTask(handle, event, op, args, shared, lists))

    def _attend_packed_fia(
        self,
        query: torch.Tensor,  # [n, num_heads, head_size]
        key: torch.Tensor,  # [sum(seq_lens), num_kv_heads, head_size], request after request
        value: torch.Tensor,  # [sum(seq_lens), num_kv_heads, head_size_v]
        meta: AscendAttentionMetadata,
        out: torch.Tensor,  # [n, num_heads, head_size_v]
        lse: torch.Tensor | None = None,  # [n, num_heads] float32: return_lse=True
    ) -> None:
        """FIA in TND without page attention, keys and values at their own widths [doc]; its
        LSE flag where asked (float32 (T, N, 1), as on the paged path). That form takes as many
        K/V heads as query heads ("Q_N、K_N、V_N相等" [doc]): with GQA each K/V head is repeated
        for its query heads (head h reads K/V head h // group), one copy per layer."""
        group = self.spec.num_heads // self.spec.num_kv_heads
        if group > 1:
            key = key.repeat_interleave(group, dim=1)
            value = value.repeat_interleave(group, dim=1)
        direct = out.is_contiguous()
        target = out if direct else torch.empty(out.shape, dtype=out.dtype, device=out.device)
        if lse is None:
            softmax_lse, flag = self._lse, _NO_FLAG
        else:
            softmax_lse = torch.empty(*out.shape[:2], 1, dtype=torch.float32, device=out.device)
            flag = {"softmax_lse_flag": True}
        self.backend.ops.npu_fused_infer_attention_score.out(
            query.contiguous(),
            key.contiguous(),
            value.contiguous(),
            **meta.fia_kwargs,
            **flag,
            out=[target, softmax_lse],
        )
        if not direct:
            out.copy_(target)
        if lse is not None:
            lse.copy_(softmax_lse[:, :, 0])

    def _attend_packed(
        self,
        query: torch.Tensor,  # [n, num_heads, head_size]
        key: torch.Tensor,  # [sum(seq_lens), num_kv_heads, head_size], request after request
        value: torch.Tensor,
        meta: AscendAttentionMetadata,
        out: torch.Tensor,  # [n, num_heads, head_size]
        lse: torch.Tensor | None = None,  # [n, num_heads] float32: return_lse=True
    ) -> None:
        # Non-causal attention goes through the training FA, not FIA's sparse_mode 0: FIA with
        # TND + sparse_mode 0 + no mask was reported to skip the softmax on one CANN stack
        # (vllm-ascend#13699); vllm-ascend's pooling path uses npu_fusion_attention too.
        spec, sparse = self.spec, meta.sparse
        # `sink` only with sinks: older torch_npu (before 7.3.0) has no such parameter
        extra = {} if self.fa_sink is None else {"sink": self.fa_sink}
        result = self.backend.ops.npu_fusion_attention(
            query.contiguous(),
            key.contiguous(),
            value.contiguous(),
            spec.num_heads,
            "TND",
            atten_mask=meta.atten_mask,  # None without a window: full attention
            scale=spec.scale,
            pre_tockens=sparse.pre_tokens,  # sic: the vendor's spelling
            next_tockens=sparse.next_tokens,
            actual_seq_qlen=meta.query_ends,  # cumulative (TND)
            actual_seq_kvlen=meta.kv_lengths,  # cumulative (packed K/V)
            sparse_mode=sparse.sparse_mode,
            **extra,
            # with the LSE: softmax_max / softmax_sum as (T, N, 8) [schema: softmax_layout]
            **(_NO_FLAG if lse is None else _TND_STATS),
        )
        out.copy_(result[0])
        if lse is not None:
            # No LSE output: softmax_max (each row's largest scaled score) and softmax_sum
            # (sum of exp(s - max), the sink's term included [inferred]) give it as
            # max + log(sum), natural log; the 8 copies of a row are equal: take the first
            # [doc: the statistics ring attention merges, MindSpore's ring_attention_update]
            lse.copy_(result[1][:, :, 0] + torch.log(result[2][:, :, 0]))


#: The ops whose batch limits ``check_batch_size`` names.
FIA_BATCH_LIMIT = "FIA's TND layout (len(actual_seq_lengths))"
ENCODER_BATCH_LIMIT = "npu_fusion_attention's varlen mode"


def check_batch_size(backend: AscendBackend, count: int, limit: int, what: str, op: str) -> None:
    """Refuse a step of more than ``limit`` ``what`` (requests, sequences) for ``op``, naming
    the count: one sentence for every path (standard, non-causal, MLA)."""
    if count > limit:
        raise UnsupportedConfigurationError(
            backend.name, [f"{count} {what} in one step: {op} takes at most {limit}"]
        )


def _head_size_v_refusals(spec: AttentionSpec) -> list[Refusal]:
    """What FIA's TND form with differing K/V head sizes does not take beyond the declared
    pair and dtype: a window (sparse_mode 0 or 3 only) [doc]; sinks (FIA v2 is not wired for
    it). GQA is served: the gathered K/V heads are repeated to the query's ("Q_N、K_N、V_N相等")."""
    out = []
    if spec.window != (-1, -1) and spec.causal:
        out.append(
            Refusal(
                f"head_size_v {spec.head_size_v} != head_size {spec.head_size} with a sliding "
                "window: FIA's TND form for it takes sparse_mode 0 or 3 only",
                field="sliding_window",
                value=spec.window,
            )
        )
    if spec.use_sinks and spec.causal:
        out.append(
            Refusal(
                f"head_size_v {spec.head_size_v} != head_size {spec.head_size} with sinks: "
                "not wired (FIA v2's learnable_sink on the TND form without page attention)",
                field="sinks",
                value=True,
            )
        )
    return out


def kv_write_rows(
    backend: AscendBackend, batch: BatchMetadata, facts: StepFacts
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The KV write's slots (once per step, not per layer) and, where needed, the rows it
    takes. Padding rows past num_actual_tokens are never written. A slot -1 among the real
    tokens is skipped by _npu_reshape_and_cache itself; npu_scatter_pa_kv_cache takes only
    slots in [0, num_slots) [doc], so for it such rows are left out here, from the batch's
    host copy of the slots (no device read). npu_scatter_pa_kv_cache takes int32 or int64
    slots [doc]: the engine's own tensor is passed as it is (no conversion per step);
    _npu_reshape_and_cache takes int32 only."""
    n = batch.num_actual_tokens
    scatter = backend.kv_write_op == SCATTER_PA_KV_CACHE
    if scatter and n and facts.min_slot < 0:  # a -1 somewhere (build saw every slot)
        host = batch.host_slot_mapping().numpy()[:n]
        if int(_MIN(host)) < 0:  # a real token's write is skipped, not only padding
            keep = np.flatnonzero(host >= 0)
            dev = backend.device
            return torch.from_numpy(host[keep]).to(dev), torch.from_numpy(keep).to(dev)
    slots = batch.slot_mapping
    if slots.shape[0] != n:
        slots = slots[:n]
    if not scatter and slots.dtype is not torch.int32:
        slots = slots.to(torch.int32)
    if not slots.is_contiguous():
        slots = slots.contiguous()  # once per step: every layer's write takes it as is
    return slots, None


def write_kv_planes(
    backend: AscendBackend,
    key: torch.Tensor,  # [n, KV_N, Dk]
    value: torch.Tensor,  # [n, KV_N, Dv]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KV_N, Dk]
    value_cache: torch.Tensor,  # [num_blocks, block_size, KV_N, Dv]
    slots: torch.Tensor,  # [n], contiguous; -1 rows left out for the scatter op
) -> None:
    """The backend's KV write op (``AscendBackend.kv_write_op``) over two cache planes; K and V
    widths may differ (both ops take them apart), so MLA's (kv_c, k_pe) planes use it too."""
    if backend.kv_write_op == SCATTER_PA_KV_CACHE:
        # vllm-ascend's A2/A3 write: ND caches (num_blocks, block_size, KV_N, D), every slot
        # in range (the builder / store_kv left out -1 rows) [doc]
        backend.ops.npu_scatter_pa_kv_cache(
            key=key.contiguous(),
            value=value.contiguous(),
            key_cache=key_cache,
            value_cache=value_cache,
            slot_mapping=slots,
            cache_mode="Norm",
        )
        return
    # _npu_reshape_and_cache skips slots < 0 [schema from op registrations, vendor-ops.md]
    backend.ops._npu_reshape_and_cache(
        key=key.contiguous(),
        value=value.contiguous(),
        key_cache=key_cache,
        value_cache=value_cache,
        slot_indices=slots,
    )


#: No extra keyword arguments (no LSE asked for).
_NO_FLAG: dict[str, Any] = {}
#: npu_fusion_attention's statistics in (T, N, 8), the layout the LSE is read in.
_TND_STATS: dict[str, Any] = {"softmax_layout": "TND"}
#: The names of FIA's two length lists (query ends, KV lengths): v1 and v2 (with sinks).
_FIA_LISTS = ("actual_seq_lengths", "actual_seq_lengths_kv")
_FIA_V2_LISTS = ("actual_seq_qlen", "actual_seq_kvlen")


def fia_lists(spec: AttentionSpec) -> tuple[str, str]:
    """The names of FIA's two length lists for ``spec``'s layers (v2's with sinks)."""
    return _FIA_V2_LISTS if spec.use_sinks else _FIA_LISTS


def _flat(plane: torch.Tensor) -> torch.Tensor:  # [num_slots, num_kv_heads, head_size] view
    return plane.view(-1, *plane.shape[2:])


def _check_cache_storage(cache: PagedKVCache) -> None:
    """Slots addressable by int32 (contiguous planes: the base class, strided_kv_cache=False)."""
    if cache.num_slots > INT_MAX:
        raise InvalidInputError(
            f"a cache of {cache.num_slots} slots cannot be addressed by int32 slot indices"
        )


AscendBackend.builder_type = AscendMetadataBuilder
AscendBackend.impl_type = AscendAttentionImpl

from attnhub_ascend.mla import AscendMLAImpl, AscendMLAMetadataBuilder  # noqa: E402 (a cycle)

AscendBackend.mla_builder_type = AscendMLAMetadataBuilder
AscendBackend.mla_impl_type = AscendMLAImpl
