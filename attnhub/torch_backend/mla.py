"""The ``torch`` backend's MLA layers, absorbed form: any dtype, block size, query length,
latent layout and latent format (``auto``, fp8 e4m3 and e5m2), with the LSE.

Per step the builder plans chunks on host data: decodes (query_len <= 16) sorted by length and
packed several to a chunk, each longer request alone in tiles of query rows, every chunk within
a budget of gathered keys and scores; per chunk, each member's block ids (entries past its
blocks replaced by block 0, never read), the row of each of its query tokens and the causal
bottom-right mask [members, rows, keys]. Per layer the impl writes the step's latents (padding
rows removed on the host) and, per chunk, makes a handful of tensor ops: gather the blocks,
dequantize (fp8: as vLLM's TRITON_MLA, ``attnhub.mla.dequantize_latent``), scores of every
head in float32, softmax, ``P @ kv_c``. Portable rather than fast (docs/backends/torch.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from attnhub.backend import AttentionMetadata, Step
from attnhub.errors import InvalidInputError
from attnhub.mla import LatentKVCache, dequantize_latent, store_latent_rows
from attnhub.mla_backend import MLAImpl, MLAMetadataBuilder
from attnhub.torch_backend.plan import SlotWrite, plan_slot_write
from attnhub.validation import StepFacts

#: Requests with query_len <= this are decodes: several per chunk (sorted by length).
DECODE_THRESHOLD = 16
#: Bounds of one chunk: key rows gathered (members x keys) and scores (members x query rows x
#: keys x heads), so that a long prefill beside many decodes never pads the whole step.
KEY_BUDGET = 1 << 15
SCORE_BUDGET = 1 << 24


@dataclass(frozen=True)
class MLAChunk:
    """One padded computation: ``b`` members (a request, or a tile of a long one's query
    rows), each with its blocks, its query rows and its causal mask (device tensors)."""

    block_ids: torch.Tensor  # [b, num_blocks] int64: the member's blocks, 0 past its own
    token_rows: torch.Tensor  # [b, lq] int64: the query row of each (0: padding)
    picked: torch.Tensor  # [n] int64: the real query rows among the b x lq
    out_rows: torch.Tensor  # [n] int64: their rows of the output
    mask: torch.Tensor  # [b, lq, num_blocks * block_size] bool: key visible


@dataclass(frozen=True)
class MLAStepPlan:
    """One step's chunks and write (made once for every layer)."""

    chunks: tuple[MLAChunk, ...]
    write: SlotWrite


@dataclass(frozen=True)
class TorchMLAMetadata(AttentionMetadata):
    mla: MLAStepPlan | None = None


def _members(qlens: np.ndarray, seqs: np.ndarray, heads: int) -> list[list[tuple[int, int, int]]]:
    """The step's chunks as lists of members (request, first query row within it, rows):
    decodes sorted by length and packed within the budgets; each longer request in tiles of
    query rows within them."""
    chunks: list[list[tuple[int, int, int]]] = []
    decodes = [r for r in range(qlens.size) if qlens[r] <= DECODE_THRESHOLD]
    group: list[tuple[int, int, int]] = []
    longest_q = 0
    for r in sorted(decodes, key=lambda r: int(seqs[r])):
        q, keys = int(qlens[r]), int(seqs[r])
        wide_q = max(longest_q, q)
        n = len(group) + 1
        if group and (n * keys > KEY_BUDGET or n * wide_q * keys * heads > SCORE_BUDGET):
            chunks.append(group)
            group, wide_q = [], q
        group.append((r, 0, q))
        longest_q = wide_q
    if group:
        chunks.append(group)
    for r in range(qlens.size):
        q, seq = int(qlens[r]), int(seqs[r])
        if q <= DECODE_THRESHOLD:
            continue
        tile = max(1, min(q, SCORE_BUDGET // (heads * seq)))
        chunks += [[(r, i0, min(tile, q - i0))] for i0 in range(0, q, tile)]
    return chunks


def _chunk(
    members: list[tuple[int, int, int]],
    qsl: np.ndarray,  # [B + 1] query start offsets
    ctx: np.ndarray,  # [B] context lengths
    table: np.ndarray,  # [B, max_blocks] the host block table
    bs: int,
    device: torch.device,
) -> MLAChunk:
    reqs = np.array([m[0] for m in members], dtype=np.int64)
    first = np.array([m[1] for m in members], dtype=np.int64)
    rows_n = np.array([m[2] for m in members], dtype=np.int64)
    keys_n = ctx[reqs] + first + rows_n  # keys the member's last row sees
    lq, nblk = int(rows_n.max()), int(-(-int(keys_n.max()) // bs))
    ids = table[reqs, :nblk].astype(np.int64)
    ids = np.where(np.arange(nblk)[None, :] < -(-keys_n[:, None] // bs), ids, 0)
    i = np.arange(lq)[None, :]
    valid = i < rows_n[:, None]  # [b, lq]
    pos = (ctx[reqs] + first)[:, None] + i  # each row's position in its sequence
    rows = np.where(valid, (qsl[reqs] + first)[:, None] + i, 0)
    keys = np.arange(nblk * bs)[None, None, :]
    mask = valid[:, :, None] & (keys <= pos[:, :, None])  # bottom-right causal
    picked = np.flatnonzero(valid)
    return MLAChunk(
        block_ids=torch.from_numpy(ids).to(device),
        token_rows=torch.from_numpy(rows).to(device),
        picked=torch.from_numpy(picked).to(device),
        out_rows=torch.from_numpy(rows.reshape(-1)[picked]).to(device),
        mask=torch.from_numpy(mask).to(device),
    )


class TorchMLAMetadataBuilder(MLAMetadataBuilder):
    metadata_type = TorchMLAMetadata

    def plan(self, step: Step) -> Mapping[str, Any]:
        batch, facts = step.batch, step.facts
        if facts.query_lens is None:  # structural checks: the lengths were not read
            facts = StepFacts.of(batch)
        assert facts.query_lens is not None and facts.seq_lens is not None
        qlens, seqs = facts.query_lens.astype(np.int64), facts.seq_lens.astype(np.int64)
        qsl = batch.query_start_loc_cpu.numpy().astype(np.int64)
        table = batch.host_block_table().numpy()
        device, bs = self.backend.device, batch.block_size
        chunks = tuple(
            _chunk(m, qsl, seqs - qlens, table, bs, device)
            for m in _members(qlens, seqs, self.spec.num_heads)
        )
        write = plan_slot_write(
            batch.slot_mapping, host=batch.slot_mapping_cpu, min_slot=step.facts.min_slot
        )
        return {"mla": MLAStepPlan(chunks=chunks, write=write)}


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
        for chunk in meta.mla.chunks:
            self._attend_chunk(query, cache, chunk, out, lse)

    def _attend_chunk(
        self,
        query: torch.Tensor,
        cache: LatentKVCache,
        chunk: MLAChunk,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> None:
        spec = self.spec
        b, R, H = chunk.block_ids.shape[0], spec.kv_lora_rank, spec.num_heads
        ids = chunk.block_ids.reshape(-1)
        # [b, keys, R] and [b, keys, P]: each member's latents in float32, fp8 dequantized as
        # vLLM's TRITON_MLA reads them (fp8 * scale in float32, rounded to the model dtype)
        kv_c = cache.kv_c.index_select(0, ids).reshape(b, -1, R)
        k_pe = cache.k_pe.index_select(0, ids).reshape(b, -1, spec.qk_rope_head_dim)
        kv_c = dequantize_latent(kv_c, cache.scale, spec.dtype)
        k_pe = dequantize_latent(k_pe, cache.scale, spec.dtype)
        q = query.index_select(0, chunk.token_rows.reshape(-1)).float()
        q = q.reshape(b, -1, H, spec.latent_size)  # [b, lq, H, R + P]
        scores = torch.einsum("bqhd,bkd->bhqk", q[..., :R], kv_c)
        scores += torch.einsum("bqhd,bkd->bhqk", q[..., R:], k_pe)
        scores *= spec.scale
        scores.masked_fill_(~chunk.mask[:, None], float("-inf"))
        top = scores.amax(dim=-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
        p = torch.exp(scores - top)
        denom = p.sum(dim=-1, keepdim=True)
        # keys no row of the member sees (the rest of its last block, block 0 past its own)
        # may hold anything, NaN included (an unwritten slot): p is 0 there, 0 * NaN is not
        kv_c = kv_c.masked_fill(~chunk.mask.any(dim=1)[..., None], 0.0)
        o = torch.einsum("bhqk,bkd->bqhd", p / denom.clamp_min(1e-30), kv_c)  # [b, lq, H, R]
        o = o.reshape(-1, H, R).index_select(0, chunk.picked)
        out.index_copy_(0, chunk.out_rows, o.to(out.dtype))
        if lse is not None:
            row_lse = (top + denom.log()).squeeze(-1).transpose(1, 2)  # [b, lq, H]
            picked = row_lse.reshape(-1, H).index_select(0, chunk.picked)
            lse.index_copy_(0, chunk.out_rows, picked)
