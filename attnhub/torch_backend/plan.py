"""Host-side planning of one step for the torch backend (done once, shared by every layer).

A step's requests are cut into *chunks*; each chunk is one attention call:
  - consecutive requests with the same query_len <= ``decode_query_len`` share a chunk (up to
    ``decode_chunk`` requests): their blocks are gathered side by side, padded to the longest;
  - every other request is a chunk of its own.
For each chunk the planner precomputes, on the device: the block ids to gather and, where the
attention pattern is not plain, a visibility mask (True = the query row sees the key) and the
query-key distances ALiBi needs. Query rows are "GQA-folded": the ``group`` query heads that
share a kv head become ``group * query_len`` rows of that kv head, ordered (head-in-group, token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnhub.batch import BatchMetadata
from attnhub.spec import AttentionSpec


@dataclass
class Chunk:
    first_token: int  # first query row of the chunk in q/out
    num_reqs: int  # C: requests in the chunk, consecutive in the batch
    query_len: int  # Q: every request of the chunk has this query_len
    kv_len: int  # L: keys per request after gathering (the longest seq_len of the chunk)
    num_blocks: int  # blocks gathered per request (ceil(L / block_size))
    block_ids: torch.Tensor  # [C * num_blocks] int64, device
    visible: torch.Tensor | None  # [C, 1, 1, Q, L] bool, device; None: every key visible
    mask: torch.Tensor | None  # visible as SDPA wants it: [C, 1, group * Q, L] (SDPA path only)
    causal_square: bool  # C == 1, Q == L, causal, no feature: SDPA's is_causal applies
    distance: torch.Tensor | None  # [C, 1, 1, Q, L] float32 |pos(i) - j|, for ALiBi


@dataclass
class StepPlan:
    chunks: list[Chunk]
    max_gather_blocks: int  # the largest C * num_blocks, to size the gather buffer once


def plan_step(
    spec: AttentionSpec,
    batch: BatchMetadata,
    *,
    decode_query_len: int,
    decode_chunk: int,
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
            while end < batch.num_reqs and end - r < decode_chunk and qlens[end] == qlens[r]:
                end += 1
        spans.append((r, end))
        r = end

    chunks = []
    max_gather = 0
    for a, b in spans:
        C, Q = b - a, qlens[a]
        lens = seqs[a:b]
        L = max(lens)
        nblk = (L + bs - 1) // bs
        ids = table[a:b, :nblk].to(torch.int64).reshape(-1)
        max_gather = max(max_gather, C * nblk)

        ragged = any(x != L for x in lens)
        needs_pattern = (causal and Q > 1) or left >= 0 or (right >= 0 and not causal)
        causal_square = C == 1 and Q == L and causal and not spec.features()
        visible_dev = mask = distance = None
        if ragged or needs_pattern or spec.use_alibi:
            kv_len = torch.tensor(lens)[:, None, None]  # [C, 1, 1]
            pos_q = (kv_len - Q) + torch.arange(Q)[None, :, None]  # [C, Q, 1]
            pos_k = torch.arange(L)[None, None, :]  # [1, 1, L]
            visible = pos_k < kv_len  # [C, Q, L]: padding keys of shorter requests
            if left >= 0:
                visible = visible & (pos_k >= pos_q - left)
            if right >= 0:
                visible = visible & (pos_k <= pos_q + right)
            if (ragged or needs_pattern) and not causal_square:
                visible_dev = visible[:, None, None].to(device)  # [C, 1, 1, Q, L]
                if not eager:
                    mask = visible_dev.expand(C, 1, group, Q, L).reshape(C, 1, group * Q, L)
            if spec.use_alibi:
                distance = (pos_q - pos_k).abs().to(torch.float32)[:, None, None].to(device)
        chunks.append(
            Chunk(
                first_token=starts[a],
                num_reqs=C,
                query_len=Q,
                kv_len=L,
                num_blocks=nblk,
                block_ids=ids.to(device),
                visible=visible_dev,
                mask=mask,
                causal_square=causal_square,
                distance=distance,
            )
        )
    return StepPlan(chunks=chunks, max_gather_blocks=max_gather)
