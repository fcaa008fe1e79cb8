"""The ``cpu`` backend's MLA layers, through the MLA backend vLLM picks on the CPU
(``backend.mla_path``, :func:`attnhub_cpu.mla_ops.vllm_mla_backend`): ``CPU_MLA``'s decode kernel
(``torch.ops._C.mla_decode_kvcache``) or, on AMX CPUs, ``AMX_MLA``'s write, decode and extend
ops (``concat_and_cache_mla_cpu``, ``decode_attention_cpu``, ``extend_attention_cpu``), over a
joint latent cache.

``CPU_MLA``:
What it compiles is what is served: ``kv_lora_rank + qk_rope_head_dim`` = 512 + 64, block 16,
the model dtypes of ``CPU_MLA``, the ``auto`` latent format, one query token per request
(decode only: vLLM runs MLA prefill as an SDPA in the expanded form, no kernel of its own).
Per step the builder makes the int32 block table and lengths the kernel takes and the rows the
write keeps (padding removed), on host data; per layer the impl writes the latents with plain
tensor stores (as ``CPU_MLA``'s ``do_kv_cache_update`` does) and makes one kernel call for the
whole batch.

``AMX_MLA`` (vllm/v1/attention/backends/mla/amx_mla.py, called exactly as there): bfloat16,
blocks in multiples of 32, every query length. Per step the builder makes what
``AMXMLAMetadataBuilder.build`` makes (:func:`attnhub_cpu.mla_ops.amx_mla_step`): vLLM's split
(the leading one-token requests are decodes, the rest prefills), for the decodes
``req_to_token`` (the block table, one slot per position), ``req_pool_indices`` (arange),
int64 ``seq_lens`` and ``num_kv_splits`` (from the longest sequence and the torch thread
count), for the prefills the same three in int64 plus the extend lengths and starts; and the
int64 slots. Per layer the impl makes ``do_kv_cache_update``'s one ``concat_and_cache_mla_cpu``
call (slots < 0 skipped by the op), ``forward_mqa``'s one ``decode_attention_cpu`` call over
the decodes (its output and ``attn_logits`` zeroed per call as vLLM allocates them) and
``forward_mha``'s one ``extend_attention_cpu`` call over the prefills, in latent space (the
query comes absorbed: ``forward_mha``'s ``W_UK`` / ``W_UV`` products are the engine's), the new
tokens' latents as ``k_extend``.
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
    # AMX_MLA (backend.mla_path == "AMX_MLA"): the decode and extend calls' per-step arguments
    amx: mla_ops.AmxMlaStep | None = None
    # [prefill tokens] int64: the cache rows at the prefill tokens' positions (through the block
    # table), where extend_attention_cpu's k_extend is read from when forward has no new latents
    extend_cache_rows: torch.Tensor | None = None


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
        """``AMXMLAMetadataBuilder.build``, once per step (:func:`mla_ops.amx_mla_step`); the
        write's slots as vLLM passes them (``slot_mapping.flatten()``: the op skips those
        < 0)."""
        batch = step.batch
        B = batch.num_reqs
        amx = mla_ops.amx_mla_step(
            batch.block_table,
            batch.seq_lens[:B],
            batch.query_start_loc_cpu[: B + 1],
            batch.block_size,
            batch.max_seq_len,
            torch.get_num_threads(),
        )
        rows = None
        if amx.prefill is not None:
            p = amx.prefill
            req = torch.repeat_interleave(torch.arange(B - p.first_req), p.extend_seq_lens)
            start = (p.seq_lens - p.extend_seq_lens - p.extend_start_loc)[req]
            rows = p.req_to_token[req, start + torch.arange(p.num_tokens)]
        return {
            "block_table": batch.block_table,
            "amx": amx,
            "extend_cache_rows": rows,
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
            op = "decode_attention_cpu / extend_attention_cpu" if amx else "mla_decode_kvcache"
            raise InvalidInputError(
                f"vLLM's {op} reads a dense joint plane [num_blocks, {cache.block_size}, "
                f"{cache.joint.shape[-1]}]; this cache's strides are {cache.joint.stride()}"
            )

    def compute(
        self,
        query: torch.Tensor,
        kv_c: torch.Tensor | None,
        k_pe: torch.Tensor | None,
        cache: LatentKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        """``AMX_MLA``: the write, then the decodes and the prefills, the prefills reading the
        step's new latents as given (``forward_mha``'s ``k_extend``); ``CPU_MLA``: the base
        class's write then ``attend``."""
        if self.backend.mla_path != "AMX_MLA":  # type: ignore[attr-defined]
            super().compute(query, kv_c, k_pe, cache, meta, out, lse)
            return
        if kv_c is not None:
            assert k_pe is not None
            self.store_kv(kv_c, k_pe, cache, meta.batch.slot_mapping, meta)
        assert isinstance(meta, CpuMLAMetadata)  # check_call
        self._attend_amx(query, kv_c, k_pe, cache, meta, out)

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
        if self.backend.mla_path == "AMX_MLA":  # type: ignore[attr-defined]
            self._attend_amx(query, None, None, cache, meta, out)
            return
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

    def _attend_amx(
        self,
        query: torch.Tensor,  # [T, H, 576]
        kv_c: torch.Tensor | None,  # [T, 512]: the step's new latents (None: in the cache)
        k_pe: torch.Tensor | None,  # [T, 64]
        cache: LatentKVCache,
        meta: CpuMLAMetadata,
        out: torch.Tensor,  # [T, H, 512]
    ) -> None:
        """``AMXMLAImpl.forward_mqa`` over the step's decodes, then ``forward_mha``'s extend
        call over its prefills: the joint plane seen as ``[slots, 1, 576]`` keys with its first
        512 columns the values."""
        assert meta.amx is not None
        spec = self.spec
        R = spec.kv_lora_rank
        kv_flat = cache.joint.view(-1, 1, R + spec.qk_rope_head_dim)
        v_buffer = kv_flat[..., :R]
        decode, prefill = meta.amx.decode, meta.amx.prefill
        if decode is not None:
            n = decode.num_reqs
            q = query[:n]
            o = torch.zeros(n, spec.num_heads, R, dtype=q.dtype)
            attn_logits = torch.zeros(n, spec.num_heads, decode.num_kv_splits, R + 1)
            self.backend.ops.decode_attention_cpu(
                q,
                kv_flat,
                v_buffer,
                o,
                None,
                None,
                None,  # loc: the cache is written already (store_kv)
                attn_logits,
                decode.req_to_token,
                decode.req_pool_indices,
                decode.seq_lens,
                spec.scale,
                0.0,
                False,
                0,
                None,
                None,
            )
            out[:n].copy_(o)
        if prefill is None:
            return
        a, b = prefill.first_token, prefill.first_token + prefill.num_tokens
        if kv_c is not None:  # forward_mha's k_extend: [kv_c ; k_pe], one kv head
            assert k_pe is not None
            k_extend = torch.cat([kv_c[a:b], k_pe[a:b]], dim=-1).unsqueeze(1)
        else:  # the same latents, written earlier: the cache rows of their positions
            assert meta.extend_cache_rows is not None
            k_extend = kv_flat.index_select(0, meta.extend_cache_rows)
        dst = out[a:b]
        target = dst if dst.is_contiguous() else torch.empty_like(dst)
        self.backend.ops.extend_attention_cpu(
            query[a:b],
            k_extend,
            k_extend[..., :R],
            target,
            kv_flat,
            v_buffer,
            prefill.req_to_token,
            prefill.req_pool_indices,
            prefill.seq_lens,
            prefill.extend_seq_lens,
            prefill.extend_start_loc,
            prefill.max_len_extend,
            spec.scale,
            0.0,
            False,
            0,
            None,
            None,
            None,
        )
        if target is not dst:
            dst.copy_(target)
