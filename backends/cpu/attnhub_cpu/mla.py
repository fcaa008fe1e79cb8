"""The ``cpu`` backend's MLA layers: vLLM's ``CPU_MLA`` decode kernel
(``torch.ops._C.mla_decode_kvcache``, :mod:`attnhub_cpu.mla_ops`) over a joint latent cache.

What it compiles is what is served: ``kv_lora_rank + qk_rope_head_dim`` = 512 + 64, block 16,
the model dtypes of ``CPU_MLA``, the ``auto`` latent format, one query token per request
(decode only: vLLM runs MLA prefill as an SDPA in the expanded form, no kernel of its own).
Per step the builder makes the int32 block table and lengths the kernel takes and the rows the
write keeps (padding removed), on host data; per layer the impl writes the latents with plain
tensor stores (as ``CPU_MLA``'s ``do_kv_cache_update`` does) and makes one kernel call for the
whole batch. ``AMX_MLA`` (``decode_attention_cpu`` over a per-token index) is not wired.
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


@dataclass(frozen=True)
class CpuMLAMetadata(AttentionMetadata):
    block_table: torch.Tensor | None = None  # [B, max_blocks] int32, dense
    seq_lens: torch.Tensor | None = None  # [B] int32
    write_rows: torch.Tensor | None = None  # [n] int64: the rows written (None: the first n)
    write_slots: torch.Tensor | None = None  # [n] int64: their slots


class CpuMLAMetadataBuilder(MLAMetadataBuilder):
    metadata_type = CpuMLAMetadata
    reorder_batch_threshold = 1

    def plan(self, step: Step) -> Mapping[str, Any]:
        batch = step.batch
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


class CpuMLAImpl(MLAImpl):
    def check_call(self, cache: LatentKVCache, meta: AttentionMetadata) -> None:
        if not isinstance(meta, CpuMLAMetadata) or meta.write_slots is None:
            raise InvalidInputError(
                "meta must come from the cpu backend's metadata_builder().build(batch) for "
                f"this MLA layer, got {type(meta).__name__}"
            )
        if not cache.joint.is_contiguous():
            raise InvalidInputError(
                "vLLM's mla_decode_kvcache reads a dense joint plane [num_blocks, 16, 576]; "
                f"this cache's strides are {cache.joint.stride()}"
            )

    def store_kv(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cache: LatentKVCache,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata | None = None,
    ) -> None:
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
