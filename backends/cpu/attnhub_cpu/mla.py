"""The ``cpu`` backend's MLA layers, through the MLA backend vLLM picks on the CPU
(``backend.mla_path``, :func:`attnhub_cpu.mla_ops.vllm_mla_backend`): ``CPU_MLA``'s decode kernel
(``torch.ops._C.mla_decode_kvcache``) or, on AMX CPUs, ``AMX_MLA``'s write and decode ops
(``concat_and_cache_mla_cpu``, ``decode_attention_cpu``), over a joint latent cache.

``CPU_MLA``:
What it compiles is what is served: ``kv_lora_rank + qk_rope_head_dim`` = 512 + 64, block 16,
the model dtypes of ``CPU_MLA``, the ``auto`` latent format, one query token per request
(decode only: vLLM runs MLA prefill as an SDPA in the expanded form, no kernel of its own).
Per step the builder makes the int32 block table and lengths the kernel takes and the rows the
write keeps (padding removed), on host data; per layer the impl writes the latents with plain
tensor stores (as ``CPU_MLA``'s ``do_kv_cache_update`` does) and makes one kernel call for the
whole batch.

``AMX_MLA`` (vllm/v1/attention/backends/mla/amx_mla.py, called exactly as there): bfloat16,
blocks in multiples of 32, decode only (its prefill, ``extend_attention_cpu`` in
``forward_mha``, is not wired). Per step the builder makes what ``AMXMLAMetadataBuilder.build``
adds to a decode: ``req_to_token`` (the block table, one slot per position),
``req_pool_indices`` (arange), int64 ``seq_lens`` and ``num_kv_splits`` (from the longest
sequence and the torch thread count), and the int64 slots; per layer the impl makes
``do_kv_cache_update``'s one ``concat_and_cache_mla_cpu`` call (slots < 0 skipped by the op)
and ``forward_mqa``'s one ``decode_attention_cpu`` call, its output and ``attn_logits``
zeroed per call as vLLM allocates them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from attnhub import AttentionMetadata, LatentKVCache, MLAImpl, MLAMetadataBuilder, Step
from attnhub.errors import InvalidInputError
from attnhub.kit import store_latent_rows
from attnhub_cpu import mla_ops


@dataclass(frozen=True)
class CpuMLAMetadata(AttentionMetadata):
    block_table: torch.Tensor | None = None  # [B, max_blocks] int32, dense
    seq_lens: torch.Tensor | None = None  # [B] int32
    write_rows: torch.Tensor | None = None  # [n] int64: the rows written (None: the first n)
    write_slots: torch.Tensor | None = None  # [n] int64: their slots
    # AMX_MLA (backend.mla_path == "AMX_MLA"): decode_attention_cpu's per-step arguments
    req_to_token: torch.Tensor | None = None  # [B, max_blocks * block_size], block table dtype
    req_pool_indices: torch.Tensor | None = None  # [B] int64: arange
    seq_lens_i64: torch.Tensor | None = None  # [B] int64
    num_kv_splits: int = 1


class CpuMLAMetadataBuilder(MLAMetadataBuilder):
    metadata_type = CpuMLAMetadata
    reorder_batch_threshold = 1

    def plan(self, step: Step) -> Mapping[str, Any]:
        batch = step.batch
        if self.backend.mla_path == "AMX_MLA":  # type: ignore[attr-defined]
            return self._plan_amx(step)
        slots = batch.slot_mapping.long()
        host = batch.host_slot_mapping().numpy()
        keep = host >= 0
        rows = None
        if not keep.all():
            picked = np.flatnonzero(keep)
            rows = torch.from_numpy(picked)
            slots = slots.index_select(0, rows)
        return {
            "block_table": batch.block_table.to(torch.int32).contiguous(),
            "seq_lens": batch.seq_lens.to(torch.int32).contiguous(),
            "write_rows": rows,
            "write_slots": slots,
        }

    def _plan_amx(self, step: Step) -> Mapping[str, Any]:
        """``AMXMLAMetadataBuilder.build``'s decode fields, once per step; the write's slots
        as vLLM passes them (``slot_mapping.flatten()``: the op skips those < 0)."""
        batch = step.batch
        B = batch.num_reqs
        max_seq_len = int(batch.seq_lens_cpu[:B].max()) if B else 0
        return {
            "block_table": batch.block_table,
            "req_to_token": mla_ops.expand_block_table(batch.block_table, batch.block_size),
            "req_pool_indices": torch.arange(B, dtype=torch.int64),
            "seq_lens_i64": batch.seq_lens.to(torch.int64),
            "num_kv_splits": mla_ops.num_kv_splits(max_seq_len, torch.get_num_threads()),
            "write_slots": batch.slot_mapping.to(torch.int64),
        }


class CpuMLAImpl(MLAImpl):
    def check_call(self, cache: LatentKVCache, meta: AttentionMetadata) -> None:
        if not isinstance(meta, CpuMLAMetadata) or meta.write_slots is None:
            raise InvalidInputError(
                "meta must come from the cpu backend's metadata_builder().build(batch) for "
                f"this MLA layer, got {type(meta).__name__}"
            )
        if not cache.joint.is_contiguous():
            amx = self.backend.mla_path == "AMX_MLA"  # type: ignore[attr-defined]
            op = "decode_attention_cpu" if amx else "mla_decode_kvcache"
            raise InvalidInputError(
                f"vLLM's {op} reads a dense joint plane [num_blocks, {cache.block_size}, "
                f"{cache.joint.shape[-1]}]; this cache's strides are {cache.joint.stride()}"
            )

    def store_kv(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cache: LatentKVCache,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata | None = None,
    ) -> None:
        if self.backend.mla_path == "AMX_MLA":  # type: ignore[attr-defined]
            if isinstance(meta, CpuMLAMetadata) and meta.write_slots is not None:
                slots = meta.write_slots
            else:  # write_kv with slots of its own (checked on the host already)
                slots = slot_mapping.to(torch.int64)
            n = slots.shape[0]
            if n:  # do_kv_cache_update: one op call, padding (slot < 0) skipped by the op
                self.backend.ops.concat_and_cache_mla_cpu(kv_c[:n], k_pe[:n], cache.joint, slots)
            return
        if isinstance(meta, CpuMLAMetadata) and meta.write_slots is not None:
            rows, slots = meta.write_rows, meta.write_slots
        else:  # write_kv with slots of its own (checked on the host already)
            keep = slot_mapping.long() >= 0
            rows = keep.nonzero()[:, 0]
            slots = slot_mapping.long().index_select(0, rows)
        n = slots.shape[0]
        if not n:
            return
        new_c = kv_c[:n] if rows is None else kv_c.index_select(0, rows)
        new_pe = k_pe[:n] if rows is None else k_pe.index_select(0, rows)
        store_latent_rows(cache, new_c, new_pe, slots)

    def attend(
        self,
        query: torch.Tensor,  # [T, H, 576]: row r is request r's one token
        cache: LatentKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,  # [T, H, 512]
        lse: torch.Tensor | None = None,  # never given: capabilities.mla.lse declares none
    ) -> None:
        assert isinstance(meta, CpuMLAMetadata)  # check_call
        B = meta.batch.num_reqs
        if not B:
            return
        if self.backend.mla_path == "AMX_MLA":  # type: ignore[attr-defined]
            self._attend_amx(query[:B], cache, meta, out[:B])
            return
        dst = out[:B]
        target = dst if dst.is_contiguous() else torch.empty_like(dst)
        self.backend.ops.mla_decode_kvcache(
            target,
            query[:B].contiguous(),
            cache.joint,
            self.spec.scale,
            meta.block_table,
            meta.seq_lens,
        )
        if target is not dst:
            dst.copy_(target)

    def _attend_amx(
        self, q: torch.Tensor, cache: LatentKVCache, meta: CpuMLAMetadata, dst: torch.Tensor
    ) -> None:
        """``AMXMLAImpl.forward_mqa``: the joint plane seen as ``[slots, 1, 576]`` keys with
        its first 512 columns the values, one ``decode_attention_cpu`` call."""
        spec = self.spec
        width = spec.kv_lora_rank + spec.qk_rope_head_dim
        kv_flat = cache.joint.view(-1, 1, width)
        o = torch.zeros(q.shape[0], spec.num_heads, spec.kv_lora_rank, dtype=q.dtype)
        attn_logits = torch.zeros(
            q.shape[0], spec.num_heads, meta.num_kv_splits, spec.kv_lora_rank + 1
        )
        self.backend.ops.decode_attention_cpu(
            q if q.stride(-1) == 1 else q.contiguous(),
            kv_flat,
            kv_flat[..., : spec.kv_lora_rank],
            o,
            None,
            None,
            None,  # loc: the cache is written already (store_kv)
            attn_logits,
            meta.req_to_token,
            meta.req_pool_indices,
            meta.seq_lens_i64,
            spec.scale,
            0.0,
            False,
            0,
            None,
            None,
        )
        dst.copy_(o)
