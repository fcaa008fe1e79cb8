"""The ``ascend`` backend's MLA layers (the absorbed form) through FIA's MLA form.

vllm-ascend keeps the latent's two parts apart (``kv_cache[0]`` the nope part ``kv_c``,
``kv_cache[1]`` the rope part ``k_pe``), so the latent cache here is attnhub's "split" layout:
``kv_c`` [num_blocks, block_size, 512] and ``k_pe`` [num_blocks, block_size, 64].

  KV write    AscendBackend.kv_write_op (npu_scatter_pa_kv_cache "Norm", or ATB's
              _npu_reshape_and_cache): key = kv_c [n, 1, 512] into the nope plane, value = k_pe
              [n, 1, 64] into the rope plane, one call per layer (both ops take K and V widths
              apart) [inferred: vllm-ascend writes these planes with its fused
              npu_kv_rmsnorm_rope_cache, which also normalizes and ropes; attnhub is given
              both parts ready]
  attention   npu_fused_infer_attention_score.out(q_nope, k_nope, k_nope, query_rope=q_pe,
              key_rope=k_pe, ...): TND, the planes viewed (num_blocks, 1, block_size, D),
              num_key_value_heads 1, sparse_mode 0 without a mask for decode-only steps, 3 with
              the compressed mask otherwise [doc; callers: vllm-ascend's update_mla_attn_params]

Per step the builder plans FIA's keyword arguments once for every layer (cumulative query ends,
per-sequence KV lengths, the int32 block table, the mask) and the write's slots (-1 rows left out
for the scatter op); per layer the impl makes one write and one FIA call for the whole batch.
FIA's MLA form takes query N 32/64/128, 1-16 query tokens per request, blocks of 16 or 128 and
returns no LSE [doc]: ``Capabilities.mla`` declares exactly that.

The LSE (``forward(..., return_lse=True)``) comes from ATB's MLA op instead, the one
vllm-ascend's MLA DCP decode calls [callers]:
``torch_npu.atb.npu_multi_head_latent_attention(q_nope, q_pe, ctkv, k_rope, block_tables,
context_lens, H, scale, 1, return_lse=True, calc_type="calc_type_ring", output=, lse=)``, the
planes viewed ``[num_blocks, block_size, 1, D]``. It takes one query token per batch entry
(no ``qseqlen``), so every query token is its own entry: its context length is its causal
extent (``seq_len - query_len + i + 1``, host ints) and its block-table row its request's (the
table's rows repeated per token on the device, once per step, only where a request has
several tokens). Its lse is ``[T, H, 1]`` in the model dtype [doc, callers], converted to
attnhub's float32 ``[T, H]``: it carries the model dtype's precision (docs/backends/ascend.md).

Graph capture (uniform batches): the FIA call is recorded in a task group, in one workspace per
captured graph sized by the max-workspace query, and every step's ``update_graph_params``
re-issues it with the step's two length lists, then records the task's event, as vllm-ascend's
``update_mla_attn_params`` does [callers] (without its synchronize: the runner orders the update
stream after the previous replay). The write of a captured step has a fixed shape (padding rows
redirected to the step's first written row, the kit's ``FixedShapeWrite``; ATB's write skips -1
itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from attnhub import (
    AttentionMetadata,
    BatchMetadata,
    LatentKVCache,
    MLAImpl,
    MLAMetadataBuilder,
    Step,
)
from attnhub.backend import scratch_field
from attnhub.capabilities import GraphSupport, Refusal
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.kit import FixedShapeWrite, flat_slots, read_slots
from attnhub_ascend.backend import (
    FIA_BATCH_LIMIT,
    INT_MAX,
    MAX_FIA_BATCH,
    RESHAPE_AND_CACHE,
    SCATTER_PA_KV_CACHE,
    AscendBackend,
    AscendGraph,
    AscendMetadataBuilder,
    GraphTask,
    check_batch_size,
    compressed_causal_mask,
    kv_write_rows,
    write_kv_planes,
)

#: ATB's MLA op: "batch <= 8192" [doc]; the LSE route passes one entry per query token.
ATB_MLA_MAX_BATCH = 8192

#: FIA's two length lists, which a captured task is re-issued with every step.
_LISTS = ("actual_seq_lengths", "actual_seq_lengths_kv")


@dataclass(frozen=True)
class AscendMLAMetadata(AttentionMetadata):
    """One MLA step, planned: FIA's keyword arguments and the write's slots."""

    num_actual_tokens: int = 0
    #: FIA's keyword arguments but the tensors of the layer (query parts, cache planes, outputs)
    fia_kwargs: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    slot_mapping: torch.Tensor | None = None  # [rows written] int32/int64, device
    #: the rows of kv_c / k_pe the write takes where some real token has slot -1 (the scatter
    #: op has no padding slot); None: the first rows
    write_rows: torch.Tensor | None = None
    #: Set by build_for_graph_capture: the FIA task groups forward records while captured (one
    #: per layer) and the graph's workspace: scratch layers write into.
    graph: AscendGraph | None = scratch_field()
    #: ATB's MLA call (the LSE route): its block table and host context lengths, one entry per
    #: query token, made by the first layer that asks for the LSE in this step
    atb: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


class AscendMLAMetadataBuilder(MLAMetadataBuilder):
    metadata_type = AscendMLAMetadata
    backend: AscendBackend

    @property
    def graph_support(self) -> GraphSupport:
        """Uniform batches: one query length per captured graph, so one ``sparse_mode``."""
        return GraphSupport.UNIFORM_BATCH

    def build_for_graph_capture(self, batch: BatchMetadata) -> AttentionMetadata:
        """The step's plan over the runner's persistent buffers (block table, slots: the write
        finds its rows on the device) and an empty task list forward fills while captured;
        the length lists are this batch's, replaced in the tasks by every update."""
        step = self.capture_step(batch)
        planned = self.plan(step)
        if planned["fia_kwargs"]["block_table"] is not batch.block_table:
            raise UnsupportedConfigurationError(
                self.backend.name, ["graph capture needs an int32 contiguous block table"]
            )
        return self.metadata(
            step, {**planned, "slot_mapping": None, "write_rows": None, "graph": AscendGraph()}
        )

    def update_graph_params(
        self, graph_meta: AttentionMetadata, batch: BatchMetadata, stream: Any
    ) -> None:
        """Re-issue every captured FIA task with this step's lists inside
        graph_task_update_begin/end on the update stream, then record its event (vllm-ascend's
        update_mla_attn_params, without its synchronize)."""
        assert isinstance(graph_meta, AscendMLAMetadata) and graph_meta.graph is not None
        npu = self.backend.graph_api
        lists = {
            _LISTS[0]: tuple(batch.query_start_loc_cpu[1:].tolist()),  # host data
            _LISTS[1]: tuple(batch.seq_lens_cpu.tolist()),
        }
        for task in graph_meta.graph.tasks:
            npu.graph_task_update_begin(stream, task.handle)
            task.op(*task.args, **task.kwargs, **lists)
            npu.graph_task_update_end(stream)
            task.event.record(stream)

    def plan(self, step: Step) -> Mapping[str, Any]:
        batch = step.batch
        facts = AscendMetadataBuilder._facts(step)
        check_batch_size(self.backend, batch.num_reqs, MAX_FIA_BATCH, "requests", FIA_BATCH_LIMIT)
        assert facts.seq_lens is not None
        table = batch.block_table
        if table.dtype is not torch.int32 or not table.is_contiguous():
            table = table.to(torch.int32).contiguous()
        # Q_S 1 (every request one token): sparse_mode 0 and no mask; longer queries:
        # sparse_mode 3 (bottom-right causal) with the compressed mask [doc]
        decode_only = batch.max_query_len <= 1
        # the write's slots and rows, planned as for standard layers (one rule for both)
        slot_mapping, write_rows = kv_write_rows(self.backend, batch, facts)
        spec = self.spec
        fia_kwargs: dict[str, Any] = dict(
            num_heads=spec.num_heads,
            num_key_value_heads=1,
            input_layout="TND",
            atten_mask=None if decode_only else compressed_causal_mask(self.backend.device),
            sparse_mode=0 if decode_only else 3,
            scale=spec.scale,
            block_table=table,
            block_size=spec.block_size,
            # TND: cumulative query ends; paged cache: per-sequence KV lengths [doc, callers]
            actual_seq_lengths=tuple(batch.query_start_loc_cpu.numpy()[1:].tolist()),
            actual_seq_lengths_kv=tuple(facts.seq_lens.tolist()),
        )
        return {
            "num_actual_tokens": batch.num_actual_tokens,
            "fia_kwargs": fia_kwargs,
            "slot_mapping": slot_mapping,
            "write_rows": write_rows,
        }


class AscendMLAImpl(MLAImpl):
    """One MLA layer: one write of (kv_c, k_pe) into the two planes, one FIA call."""

    backend: AscendBackend

    def __init__(self, backend: AscendBackend) -> None:
        super().__init__(backend)
        # softmax_lse of .out is a reserved output without the LSE flag (as the standard path)
        self._lse = torch.empty(1, dtype=torch.float32, device=backend.device)
        self._checked: tuple[torch.Tensor, torch.Tensor] | None = None
        scale = self.spec.scale
        if self._lse_refusal is None and not 0 < scale <= 1:
            self._lse_refusal = Refusal(
                f"return_lse: the LSE is not returned for scale {scale} (ATB's MLA op, which "
                "gives it, takes qk_scale in (0, 1])",
                field="lse",
                value=scale,
            )

    def forward(
        self,
        query: torch.Tensor,
        kv_c: torch.Tensor | None,
        k_pe: torch.Tensor | None,
        cache: LatentKVCache,
        meta: AttentionMetadata,
        *,
        output: torch.Tensor | None = None,
        return_lse: bool = False,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The protocol's forward; a step the LSE route cannot take is refused before anything
        is written: a captured one (ATB's op is not captured here), or one of more tokens than
        ATB's batch limit (one entry per query token)."""
        if (return_lse or lse is not None) and isinstance(meta, AscendMLAMetadata):
            why = None
            if meta.graph is not None:
                why = "return_lse on a captured MLA step: ATB's MLA op is not captured here"
            elif meta.num_actual_tokens > ATB_MLA_MAX_BATCH:
                why = (
                    f"return_lse with {meta.num_actual_tokens} query tokens: ATB's MLA op takes "
                    f"one batch entry per token, at most {ATB_MLA_MAX_BATCH}"
                )
            if why is not None:
                raise UnsupportedConfigurationError(self.backend.name, [why])
        return super().forward(
            query, kv_c, k_pe, cache, meta, output=output, return_lse=return_lse, lse=lse
        )

    def check_call(self, cache: LatentKVCache, meta: AttentionMetadata) -> None:
        if not isinstance(meta, AscendMLAMetadata) or (
            meta.slot_mapping is None and meta.graph is None
        ):
            raise InvalidInputError(
                "meta must come from the ascend backend's metadata_builder().build(batch) for "
                f"this MLA layer, got {type(meta).__name__}"
            )
        self._check_planes(cache)

    def _check_planes(self, cache: LatentKVCache) -> None:
        """Dense planes (FIA and the writes take contiguous tensors) with int32 slots."""
        checked = self._checked
        if checked is not None and checked[0] is cache.kv_c and checked[1] is cache.k_pe:
            return
        if not (cache.kv_c.is_contiguous() and cache.k_pe.is_contiguous()):
            raise InvalidInputError(
                "FIA's MLA form reads dense nope and rope planes; this cache's strides are "
                f"{cache.kv_c.stride()} / {cache.k_pe.stride()}"
            )
        if cache.num_slots > INT_MAX:
            raise InvalidInputError(
                f"a cache of {cache.num_slots} slots cannot be addressed by int32 slot indices"
            )
        self._checked = (cache.kv_c, cache.k_pe)

    # --- KV write ---------------------------------------------------------------------------
    def store_kv(
        self,
        kv_c: torch.Tensor,  # [>= n, kv_lora_rank]
        k_pe: torch.Tensor,  # [>= n, qk_rope_head_dim]
        cache: LatentKVCache,
        slot_mapping: torch.Tensor,  # [n] int, -1 = padding; every slot checked
        meta: AttentionMetadata | None = None,
    ) -> None:
        if isinstance(meta, AscendMLAMetadata) and meta.graph is not None:
            self._store_graph_step(kv_c, k_pe, cache, meta.batch.slot_mapping)
            return
        if isinstance(meta, AscendMLAMetadata) and meta.slot_mapping is not None:
            slots, rows = meta.slot_mapping, meta.write_rows
        else:  # write_kv alone: the engine's slots, read on the host by the core's check
            self._check_planes(cache)
            slots, rows = slot_mapping.to(torch.int32).contiguous(), None
            if self.backend.kv_write_op == SCATTER_PA_KV_CACHE:
                host = slot_mapping.to("cpu")  # no padding slot in this op: drop -1 rows
                if bool((host < 0).any()):
                    rows = (host >= 0).nonzero()[:, 0].to(kv_c.device)
                    slots = slots.index_select(0, rows)
        n = slots.shape[0]
        if not n:
            return
        if rows is not None:
            kv_c, k_pe = kv_c.index_select(0, rows), k_pe.index_select(0, rows)
        elif kv_c.shape[0] != n:
            kv_c, k_pe = kv_c[:n], k_pe[:n]
        write_kv_planes(
            self.backend,
            kv_c.unsqueeze(1),  # [n, 1, 512]: one KV head
            k_pe.unsqueeze(1),  # [n, 1, 64]
            cache.kv_c.unsqueeze(2),  # [num_blocks, block_size, 1, 512]
            cache.k_pe.unsqueeze(2),
            slots,
        )

    def _store_graph_step(
        self, kv_c: torch.Tensor, k_pe: torch.Tensor, cache: LatentKVCache, slots: torch.Tensor
    ) -> None:
        """The write of a captured step, with a fixed shape (device ops only): ATB's write
        skips -1 itself; for the scatter op each padding row is redirected to the step's first
        written row (the kit's FixedShapeWrite), as for standard layers."""
        T = slots.shape[0]
        planes = (cache.kv_c.unsqueeze(2), cache.k_pe.unsqueeze(2))
        if self.backend.kv_write_op == RESHAPE_AND_CACHE:
            new = (kv_c[:T], k_pe[:T])
            write_slots = slots.to(torch.int32).contiguous()
        else:
            write = FixedShapeWrite.of(slots)
            new = tuple(
                write.pick(
                    src.index_select(0, write.rows),
                    read_slots(plane, flat_slots(plane), write.slots),
                )
                for src, plane in ((kv_c, cache.kv_c), (k_pe, cache.k_pe))
            )  # type: ignore[assignment]
            write_slots = write.slots.to(torch.int32)
        write_kv_planes(
            self.backend, new[0].unsqueeze(1), new[1].unsqueeze(1), *planes, write_slots
        )

    # --- attention ----------------------------------------------------------------------------
    def attend(
        self,
        query: torch.Tensor,  # [T, H, 512 + 64] = [q_nope @ W_UK ; q_pe]
        cache: LatentKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,  # [T, H, 512]
        lse: torch.Tensor | None = None,  # [T, H] float32: return_lse=True (ATB's MLA op)
    ) -> None:
        assert isinstance(meta, AscendMLAMetadata)  # check_call
        n = meta.num_actual_tokens
        if n == 0:
            return
        R = self.spec.kv_lora_rank
        q = query[:n]
        # FIA takes the two query parts as separate dense tensors (one copy each per layer)
        q_nope, q_pe = q[..., :R].contiguous(), q[..., R:].contiguous()
        dst = out[:n]
        target = dst if dst.is_contiguous() else torch.empty_like(q_nope)
        nb, bs = cache.num_blocks, cache.block_size
        # the planes as (num_blocks, KV_N = 1, block_size, D), as vllm-ascend views them
        k_nope = cache.kv_c.view(nb, 1, bs, R)
        k_rope = cache.k_pe.view(nb, 1, bs, cache.qk_rope_head_dim)
        args = (q_nope, k_nope, k_nope)  # the values are the nope part [callers]
        if lse is not None:
            self._attend_lse(q_nope, q_pe, cache, meta, target, lse[:n])
        elif meta.graph is not None:
            self._attend_graph(args, q_pe, k_rope, meta, target)
        else:
            self.backend.ops.npu_fused_infer_attention_score.out(
                *args, query_rope=q_pe, key_rope=k_rope, **meta.fia_kwargs, out=[target, self._lse]
            )
        if target is not dst:
            dst.copy_(target)

    def _attend_lse(
        self,
        q_nope: torch.Tensor,  # [n, H, 512]
        q_pe: torch.Tensor,  # [n, H, 64]
        cache: LatentKVCache,
        meta: AscendMLAMetadata,
        target: torch.Tensor,  # [n, H, 512], dense
        lse: torch.Tensor,  # [n, H] float32
    ) -> None:
        """ATB's MLA op with its ring calc type: the output and each row's LSE, one batch entry
        per query token (docstring above); the LSE comes in the model dtype and is converted."""
        table, context_lens = self._atb_plan(meta)
        nb, bs, R = cache.num_blocks, cache.block_size, self.spec.kv_lora_rank
        spec = self.spec
        model_lse = torch.empty(*q_nope.shape[:2], 1, dtype=spec.dtype, device=q_nope.device)
        self.backend.ops.atb.npu_multi_head_latent_attention(
            q_nope,
            q_pe,
            cache.kv_c.view(nb, bs, 1, R),
            cache.k_pe.view(nb, bs, 1, cache.qk_rope_head_dim),
            table,
            context_lens,
            spec.num_heads,
            spec.scale,
            1,
            return_lse=True,
            calc_type="calc_type_ring",
            output=target,
            lse=model_lse,
        )
        lse.copy_(model_lse[:, :, 0])

    @staticmethod
    def _atb_plan(meta: AscendMLAMetadata) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Per query token: its request's block-table row and its context length (host ints),
        made once per step by the first layer that asks."""
        plan = meta.atb
        if not plan:
            batch = meta.batch
            table = meta.fia_kwargs["block_table"]
            q = batch.query_lens_cpu.numpy().astype(np.int64)
            seq = batch.seq_lens_cpu.numpy().astype(np.int64)
            req = np.repeat(np.arange(q.shape[0]), q)  # each token's request
            first = np.cumsum(q) - q  # each request's first token
            # token i of request r sees its context and itself: seq - q + i + 1 keys
            lens = seq[req] - q[req] + (np.arange(req.shape[0]) - first[req]) + 1
            if req.shape[0] != table.shape[0] or bool((q != 1).any()):
                table = table.index_select(0, torch.from_numpy(req).to(table.device))
            plan.update(table=table, lens=tuple(lens.tolist()))
        return plan["table"], plan["lens"]

    def _attend_graph(
        self,
        args: tuple[torch.Tensor, ...],
        q_pe: torch.Tensor,
        k_rope: torch.Tensor,
        meta: AscendMLAMetadata,
        target: torch.Tensor,
    ) -> None:
        """FIA on a step made by build_for_graph_capture: recorded in a task group after a
        wait on an ExternalEvent while the stream is captured (vllm-ascend's MLA capture),
        called directly otherwise (the warm-up run)."""
        ops_ = self.backend.ops
        op = ops_.npu_fused_infer_attention_score.out
        shared = {k: v for k, v in meta.fia_kwargs.items() if k not in _LISTS}
        shared.update(query_rope=q_pe, key_rope=k_rope)
        step_lists = {name: meta.fia_kwargs[name] for name in _LISTS}
        npu = self.backend.graph_api
        if not npu.is_current_stream_capturing():
            op(*args, **shared, **step_lists, out=[target, self._lse])
            return
        assert meta.graph is not None
        # one workspace per captured graph, sized for the block table's capacity, passed to
        # the capture and to every update (as the standard path and vllm-ascend do) [callers]
        workspace = meta.graph.workspaces.get(self.backend)
        if workspace is None:
            workspace = ops_._npu_fused_infer_attention_score_get_max_workspace(
                *args, **shared, **step_lists
            )
            meta.graph.workspaces[self.backend] = workspace
        shared.update(workspace=workspace, out=[target, self._lse])
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        op(*args, **shared, **step_lists)
        handle = npu.graph_task_group_end(stream)
        meta.graph.tasks.append(GraphTask(handle, event, op, args, shared, _LISTS))
