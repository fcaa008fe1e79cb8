"""The ``torch`` backend's MLA layers, absorbed form: any dtype, block size, query length,
latent layout and latent format (``auto``, fp8 e4m3), with the LSE.

Per step the builder plans one padded computation for the whole batch on host data: each
request's block ids (entries past its blocks replaced by block 0, never read), the row of each
of its query tokens, and the causal bottom-right mask [B, max_query_len, keys]. Per layer the
impl writes the step's latents (padding rows removed on the host) and makes a handful of
tensor ops: gather the blocks, dequantize, scores of every head in float32, softmax, ``P @
kv_c``. Portable rather than fast: its memory is B x max_query_len x max_seq_len scores per
head (docs/backends/torch.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from attnhub.backend import AttentionMetadata, Step
from attnhub.errors import InvalidInputError
from attnhub.mla import LatentKVCache, store_latent_rows
from attnhub.mla_backend import MLAImpl, MLAMetadataBuilder
from attnhub.torch_backend.plan import SlotWrite, plan_slot_write
from attnhub.validation import StepFacts


@dataclass(frozen=True)
class MLAStepPlan:
    """One step's padded computation (device tensors, made once for every layer)."""

    block_ids: torch.Tensor  # [B, num_blocks] int64: each request's blocks, 0 past its own
    token_rows: torch.Tensor  # [B, max_query_len] int64: the query row of each (0: padding)
    picked: torch.Tensor  # [n] int64: the real query tokens among the B x max_query_len
    out_rows: torch.Tensor  # [n] int64: their rows of the output
    mask: torch.Tensor  # [B, max_query_len, num_blocks * block_size] bool: key visible
    write: SlotWrite


@dataclass(frozen=True)
class TorchMLAMetadata(AttentionMetadata):
    mla: MLAStepPlan | None = None


class TorchMLAMetadataBuilder(MLAMetadataBuilder):
    metadata_type = TorchMLAMetadata

    def plan(self, step: Step) -> Mapping[str, Any]:
        batch, facts = step.batch, step.facts
        if facts.query_lens is None:  # structural checks: the lengths were not read
            facts = StepFacts.of(batch)
        assert facts.query_lens is not None and facts.seq_lens is not None
        qlens, seqs = facts.query_lens.astype(np.int64), facts.seq_lens.astype(np.int64)
        qsl = batch.query_start_loc_cpu.numpy().astype(np.int64)
        device, bs = self.backend.device, batch.block_size
        B = batch.num_reqs
        lq = int(qlens.max()) if B else 0
        nblk = int(-(-int(seqs.max()) // bs)) if B else 0
        table = batch.host_block_table().numpy()[:, :nblk].astype(np.int64)
        used = np.arange(nblk)[None, :] < -(-seqs[:, None] // bs)
        table = np.where(used, table, 0)
        i = np.arange(lq)[None, :]
        valid = i < qlens[:, None]  # [B, Lq]
        rows = np.where(valid, qsl[:-1, None] + i, 0)
        keys = np.arange(nblk * bs)[None, None, :]
        ctx = (seqs - qlens)[:, None, None]
        mask = valid[:, :, None] & (keys <= ctx + i[:, :, None])  # bottom-right causal
        picked = np.flatnonzero(valid)
        write = plan_slot_write(
            batch.slot_mapping, host=batch.slot_mapping_cpu, min_slot=step.facts.min_slot
        )
        plan = MLAStepPlan(
            block_ids=torch.from_numpy(table).to(device),
            token_rows=torch.from_numpy(rows).to(device),
            picked=torch.from_numpy(picked).to(device),
            out_rows=torch.from_numpy(rows.reshape(-1)[picked]).to(device),
            mask=torch.from_numpy(mask).to(device),
            write=write,
        )
        return {"mla": plan}


class TorchMLAImpl(MLAImpl):
    def check_call(self, cache: LatentKVCache, meta: AttentionMetadata) -> None:
        if not isinstance(meta, TorchMLAMetadata) or meta.mla is None:
            raise InvalidInputError(
                "meta must come from the torch backend's metadata_builder().build(batch) for "
                f"this MLA layer, got {type(meta).__name__}"
            )

    def store_kv(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cache: LatentKVCache,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata | None = None,
    ) -> None:
        write = (
            meta.mla.write
            if isinstance(meta, TorchMLAMetadata) and meta.mla is not None
            else plan_slot_write(slot_mapping)
        )
        n = write.slots.shape[0]
        if not n:
            return
        rows = write.rows
        new_c = kv_c[:n] if rows is None else kv_c.index_select(0, rows)
        new_pe = k_pe[:n] if rows is None else k_pe.index_select(0, rows)
        store_latent_rows(cache, new_c, new_pe, write.slots)

    def attend(
        self,
        query: torch.Tensor,  # [T, H, R + P]
        cache: LatentKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,  # [T, H, R]
        lse: torch.Tensor | None = None,
    ) -> None:
        assert isinstance(meta, TorchMLAMetadata) and meta.mla is not None  # check_call
        plan, spec = meta.mla, self.spec
        B = plan.block_ids.shape[0]
        if not B:
            return
        R = spec.kv_lora_rank
        ids = plan.block_ids.reshape(-1)
        # [B, keys, R] and [B, keys, P]: each request's latents, in float32
        kv_c = cache.kv_c.index_select(0, ids).reshape(B, -1, R).float()
        k_pe = cache.k_pe.index_select(0, ids).reshape(B, -1, spec.qk_rope_head_dim).float()
        if cache.scale is not None:  # fp8: stored fp8(x / scale)
            kv_c, k_pe = kv_c * cache.scale, k_pe * cache.scale
        q = query.index_select(0, plan.token_rows.reshape(-1)).float()
        q = q.reshape(B, -1, spec.num_heads, spec.latent_size)  # [B, Lq, H, R + P]
        scores = torch.einsum("bqhd,bkd->bhqk", q[..., :R], kv_c)
        scores += torch.einsum("bqhd,bkd->bhqk", q[..., R:], k_pe)
        scores *= spec.scale
        scores.masked_fill_(~plan.mask[:, None], float("-inf"))
        top = scores.amax(dim=-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
        p = torch.exp(scores - top)
        denom = p.sum(dim=-1, keepdim=True)
        o = torch.einsum("bhqk,bkd->bqhd", p / denom.clamp_min(1e-30), kv_c)  # [B, Lq, H, R]
        H = spec.num_heads
        o = o.reshape(-1, H, R).index_select(0, plan.picked)
        out.index_copy_(0, plan.out_rows, o.to(out.dtype))
        if lse is not None:
            row_lse = (top + denom.log()).squeeze(-1).transpose(1, 2)  # [B, Lq, H]
            lse.index_copy_(0, plan.out_rows, row_lse.reshape(-1, H).index_select(0, plan.picked))
