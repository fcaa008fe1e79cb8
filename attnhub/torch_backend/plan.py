"""Host-side planning of one step for the torch backend (done once, shared by every layer).

A step's requests are cut into *chunks*; each chunk is one attention call:
  - consecutive requests with the same query_len <= ``decode_query_len`` share a chunk while
    the chunk's gathered K/V (padded to its longest request) stays within
    ``gather_budget_tokens``: short decodes batch into one call, long ones go one at a time so
    that what was gathered is still in the CPU cache when attention reads it;
  - every other request is a chunk of its own.
For each chunk the planner precomputes, on the device: the block ids to gather and, where the
attention pattern is not plain, a visibility mask (True = the query row sees the key) and the
query-key distances ALiBi needs. Query rows are "GQA-folded": the ``group`` query heads that
share a kv head become ``group * query_len`` rows of that kv head, ordered (head-in-group, token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attnhub.batch import BatchMetadata
from attnhub.spec import AttentionSpec


@dataclass
class Chunk:
    first_token: int  # first query row of the chunk in q/out
    num_reqs: int  # C: requests in the chunk, consecutive in the batch
    query_len: int  # Q: every request of the chunk has this query_len
    kv_len: int  # L: keys gathered per request (from the first visible block to the longest end)
    num_blocks: int  # blocks gathered per request
    block_ids: torch.Tensor  # [C * num_blocks] int64, device
    pad_tokens: torch.Tensor | None  # [n] int64: gathered rows past a request's own keys
    visible: torch.Tensor | None  # [C, 1, 1, Q, L] bool, device; None: every key visible
    mask: torch.Tensor | None  # visible as SDPA wants it: [C, 1, group * Q, L] (SDPA path only)
    causal_square: bool  # C == 1, Q == L, causal, no feature: SDPA's is_causal applies
    distance: torch.Tensor | None  # [C, 1, 1, Q, L] float32 |pos(i) - j|, for ALiBi


@dataclass
class StepPlan:
    chunks: list[Chunk]
    max_gather_blocks: int  # the largest C * num_blocks, to size the gather buffer once
    write: SlotWrite  # where this step's keys/values go


@dataclass
class SlotWrite:
    """A KV write with padding removed: rows ``rows`` (None: the first len(slots) rows) of the
    new keys/values go to flat cache slots ``slots``."""

    slots: torch.Tensor  # [n] int64, every slot >= 0
    rows: torch.Tensor | None  # [n] int64


def plan_slot_write(slot_mapping: torch.Tensor) -> SlotWrite:
    slots = slot_mapping.long()
    keep = slots >= 0
    if bool(keep.all()):
        return SlotWrite(slots=slots, rows=None)
    rows = keep.nonzero()[:, 0]
    return SlotWrite(slots=slots[rows], rows=rows)


def plan_step(
    spec: AttentionSpec,
    batch: BatchMetadata,
    *,
    decode_query_len: int,
    gather_budget_tokens: int,
    eager: bool,
    device: torch.device,
) -> StepPlan:
    """``eager``: the impl computes scores itself (softcap, ALiBi, sinks), so no SDPA mask."""
    bs = batch.block_size
    group = spec.num_queries_per_kv
    causal = spec.causal and batch.causal
    left, right = spec.window_pair
    if causal:
        right = 0
    qlens = batch.query_lens_cpu.tolist()
    seqs = batch.seq_lens_cpu.tolist()
    starts = batch.query_start_loc_cpu.tolist()
    table = batch.block_table.to("cpu")

    # 1. Cut the batch into chunks of request indices.
    spans: list[tuple[int, int]] = []  # [first request, end request)
    r = 0
    while r < batch.num_reqs:
        end = r + 1
        if qlens[r] <= decode_query_len:
            longest = seqs[r]
            while end < batch.num_reqs and qlens[end] == qlens[r]:
                longest = max(longest, seqs[end])
                if (end - r + 1) * longest > gather_budget_tokens:
                    break
                end += 1
        spans.append((r, end))
        r = end

    # 2. Per chunk: which blocks to gather (only those a query can see: a sliding window
    #    skips the older ones), and the mask / ALiBi distances where the pattern is not plain.
    #    Built on the host, then sent to the device in one transfer per kind.
    chunks = []
    host_ids: list[torch.Tensor] = []
    host_pads: list[torch.Tensor | None] = []
    host_visible: list[torch.Tensor | None] = []
    host_distance: list[torch.Tensor | None] = []
    max_gather = 0
    for a, b in spans:
        C, Q = b - a, qlens[a]
        lens = seqs[a:b]
        longest = max(lens)
        first_visible = 0 if left < 0 else max(0, min(lens) - Q - left)
        first_blk = first_visible // bs
        key_offset = first_blk * bs  # position of the first gathered key
        nblk = (longest + bs - 1) // bs - first_blk
        L = longest - key_offset
        ids = table[a:b, first_blk : first_blk + nblk].to(torch.int64)  # [C, nblk]
        ragged = any(x != longest for x in lens)
        pad_tokens = None
        if ragged:
            # A shorter request's columns past its own blocks may hold anything (-1, another
            # request's block): gather its first block there instead, then zero every padded
            # row, since a masked key still multiplies its value (0 * stale NaN = NaN).
            own = torch.tensor([(x + bs - 1) // bs - first_blk for x in lens])  # [C]
            past = torch.arange(nblk)[None, :] >= own[:, None]
            ids = torch.where(past, ids[:, :1], ids)
            pad_tokens = torch.cat(
                [
                    torch.arange(c * nblk * bs + x - key_offset, c * nblk * bs + L)
                    for c, x in enumerate(lens)
                ]
            )
        host_ids.append(ids.reshape(-1))
        host_pads.append(pad_tokens)
        max_gather = max(max_gather, C * nblk)

        needs_pattern = (causal and Q > 1) or left >= 0 or (right >= 0 and not causal)
        causal_square = C == 1 and Q == L and causal and not spec.features()
        visible = distance = None
        if ((ragged or needs_pattern) and not causal_square) or spec.use_alibi:
            kv_len = torch.tensor(lens)[:, None, None]  # [C, 1, 1]
            pos_q = (kv_len - Q) + torch.arange(Q)[None, :, None]  # [C, Q, 1]
            pos_k = key_offset + torch.arange(L)[None, None, :]  # [1, 1, L]
            if (ragged or needs_pattern) and not causal_square:
                # [C, Q, L]: padding keys of shorter requests are invisible
                visible = (pos_k < kv_len).expand(C, Q, L)
                if left >= 0:
                    visible = visible & (pos_k >= pos_q - left)
                if right >= 0:
                    visible = visible & (pos_k <= pos_q + right)
            if spec.use_alibi:
                distance = (pos_q - pos_k).abs().to(torch.float32)
        host_visible.append(visible)
        host_distance.append(distance)
        chunks.append(
            Chunk(
                first_token=starts[a],
                num_reqs=C,
                query_len=Q,
                kv_len=L,
                num_blocks=nblk,
                block_ids=host_ids[-1],
                pad_tokens=None,
                visible=None,
                mask=None,
                causal_square=causal_square,
                distance=None,
            )
        )

    for chunk, moved in zip(chunks, _to_device(list(host_ids), device), strict=True):
        assert moved is not None
        chunk.block_ids = moved
    for chunk, pads in zip(chunks, _to_device(host_pads, device), strict=True):
        chunk.pad_tokens = pads
    for chunk, vis in zip(chunks, _to_device(host_visible, device), strict=True):
        if vis is None:
            continue
        C, Q, L = vis.shape
        chunk.visible = vis[:, None, None]  # [C, 1, 1, Q, L]
        if not eager:
            chunk.mask = chunk.visible.expand(C, 1, group, Q, L).reshape(C, 1, group * Q, L)
    for chunk, dist in zip(chunks, _to_device(host_distance, device), strict=True):
        if dist is not None:
            chunk.distance = dist[:, None, None]  # [C, 1, 1, Q, L]
    return StepPlan(
        chunks=chunks, max_gather_blocks=max_gather, write=plan_slot_write(batch.slot_mapping)
    )


def _to_device(
    tensors: Sequence[torch.Tensor | None], device: torch.device
) -> list[torch.Tensor | None]:
    """Move host tensors (of one dtype) to ``device`` in one copy; views of it come back."""
    present = [t for t in tensors if t is not None]
    if not present or device.type == "cpu":
        return list(tensors)
    flat = torch.cat([t.reshape(-1) for t in present]).to(device)
    out: list[torch.Tensor | None] = []
    offset = 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out
