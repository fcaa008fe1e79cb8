"""Host-side planning of one step for the torch backend (done once, shared by every layer).

A step's requests are cut into *chunks*; each chunk is one attention call:
  - consecutive requests with the same query_len <= ``decode_threshold`` share a chunk while
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

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from attnhub.batch import BatchMetadata
from attnhub.spec import AttentionSpec
from attnhub.validation import StepExtents


@dataclass(frozen=True)
class Chunk:
    first_token: int  # first query row of the chunk in q/out
    num_reqs: int  # C: requests in the chunk, consecutive in the batch
    query_len: int  # Q: every request of the chunk has this query_len
    kv_len: int  # L: keys gathered per request (from the first visible block to the longest end)
    num_blocks: int  # blocks gathered per request
    block_ids: torch.Tensor  # [C * num_blocks] int64, device
    pad_tokens: torch.Tensor | None  # [n] int64: gathered rows past a request's own keys
    visible: torch.Tensor | None  # [C, 1, 1, Q, L] bool, device; None: every key visible
    mask: torch.Tensor | None  # visible as SDPA wants it (SDPA path only): [C, 1, group * Q, L]
    #                              bool; when Q == 1, [C, 1, 1, L] additive (0 / -inf) in the
    #                              model dtype, broadcast over the rows
    causal_square: bool  # C == 1, Q == L, causal, no feature: SDPA's is_causal applies
    distance: torch.Tensor | None  # [C, 1, 1, Q, L] float32 |pos(i) - j|, for ALiBi


@dataclass(frozen=True)
class StepPlan:
    chunks: tuple[Chunk, ...]
    max_gather_blocks: int  # the largest C * num_blocks, to size the gather buffers
    write: SlotWrite  # where this step's keys/values go


@dataclass(frozen=True)
class SlotWrite:
    """A KV write with padding removed: rows ``rows`` (None: the first len(slots) rows) of the
    new keys/values go to flat cache slots ``slots``."""

    slots: torch.Tensor  # [n] int64, every slot >= 0
    rows: torch.Tensor | None  # [n] int64


def plan_slot_write(
    slot_mapping: torch.Tensor, host: torch.Tensor | None = None, min_slot: int | None = None
) -> SlotWrite:
    """Where a write goes, padding (-1) removed. ``host``: the slot mapping's host copy (a
    step's): where some slot is padding, the rows to keep are found there, no device read.
    Without it (write_kv given a device slot mapping of its own) they are found on the
    device (its output size depends on the data: a sync). ``min_slot``: the smallest slot, when
    the step's checks found it (>= 0: no padding, nothing to read)."""
    slots = slot_mapping if slot_mapping.dtype is torch.int64 else slot_mapping.long()
    if min_slot is not None and min_slot >= 0:
        return SlotWrite(slots=slots, rows=None)
    if host is None and slots.device.type == "cpu":
        host = slots
    if host is not None:
        keep_np = host.numpy() >= 0  # numpy: ~1 us where a torch reduction costs ~5
        if keep_np.all():
            return SlotWrite(slots=slots, rows=None)
        rows = torch.from_numpy(np.flatnonzero(keep_np)).to(slots.device)
        return SlotWrite(slots=slots[rows], rows=rows)
    keep = slots >= 0
    if bool(keep.all()):
        return SlotWrite(slots=slots, rows=None)
    rows = keep.nonzero()[:, 0]
    return SlotWrite(slots=slots[rows], rows=rows)


def chunk_spans(
    qlens: np.ndarray,  # [B] int64
    seqs: np.ndarray,  # [B] int64
    decode_threshold: int,
    gather_budget_tokens: int,
    extremes: tuple[int, int, int] | None = None,
) -> list[tuple[int, int]]:  # [first request, end request) per chunk
    """Cut the batch into chunks: runs of requests with the same query_len <= decode_threshold
    are cut greedily so that ``num_reqs * longest`` stays within the budget (at least one
    request per chunk); every other request is a chunk of its own. Loops per chunk, not per
    request. ``extremes``: (shortest query, longest query, longest sequence) where known."""
    n = qlens.shape[0]
    if not n:
        return []
    if extremes is None:
        extremes = (int(qlens.min()), int(qlens.max()), int(seqs.max()))
    q_min, q_max, s_max = extremes
    if q_min == q_max and q_max <= decode_threshold:  # the usual decode step: one run
        if n * s_max <= gather_budget_tokens:
            return [(0, n)]
        decode = np.ones(n, dtype=bool)
        bounds = [0, n]
    else:
        decode = qlens <= decode_threshold
        # a run starts where the query_len changes or either neighbour is not a decode
        starts = np.ones(n, dtype=bool)
        starts[1:] = (qlens[1:] != qlens[:-1]) | ~decode[1:] | ~decode[:-1]
        bounds = np.append(np.flatnonzero(starts), n).tolist()
    spans: list[tuple[int, int]] = []
    for a, end in itertools.pairwise(bounds):
        while a < end:
            if end - a == 1 or not decode[a]:
                spans.append((a, a + 1))
                a += 1
                continue
            # padded size of the chunk [a, a + k) is k * max(seqs[a:a + k]): non-decreasing in k
            padded = np.maximum.accumulate(seqs[a:end]) * np.arange(1, end - a + 1)
            k = max(1, int(np.searchsorted(padded, gather_budget_tokens, side="right")))
            spans.append((a, a + k))
            a += k
    return spans


def plan_step(
    spec: AttentionSpec,
    batch: BatchMetadata,
    *,
    decode_threshold: int,
    gather_budget_tokens: int,
    eager: bool,
    device: torch.device,
    step: StepExtents | None = None,
) -> StepPlan:
    """``eager``: the impl computes scores itself (softcap, ALiBi, sinks), so no SDPA mask.
    ``step``: what the step's checks read (``AttentionMetadataBuilder.step``), reused.

    Host work runs in numpy on the batch's host copies, once per chunk (never per request)."""
    bs = batch.block_size
    group = spec.num_queries_per_kv
    causal = spec.causal and batch.causal
    left, right = spec.window
    if causal:
        right = 0
    starts = batch.query_start_loc_cpu.numpy()
    extremes = None
    if step is not None and step.query_lens is not None and step.seq_lens is not None:
        qlens, seqs = step.query_lens, step.seq_lens  # int32: positions stay below 2**31
        extremes = (step.min_query_len, batch.max_query_len, batch.max_seq_len)
    else:
        starts = starts.astype(np.int64)
        qlens = starts[1:] - starts[:-1]
        seqs = batch.seq_lens_cpu.numpy().astype(np.int64)
    table_t = batch.host_block_table()
    table = table_t.numpy()  # [B, max_blocks]
    spans = chunk_spans(qlens, seqs, decode_threshold, gather_budget_tokens, extremes)
    plain = not spec.features()
    B = qlens.shape[0]

    # Per chunk: which blocks to gather (only those a query can see: a sliding window skips
    # the older ones), and the mask / ALiBi distances where the pattern is not plain. Built on
    # the host in numpy, then sent to the device in one transfer per kind.
    shapes: list[tuple[int, int, int, int, int, bool]] = []  # (first_token, C, Q, L, nblk, sq)
    host_ids: list[torch.Tensor] = []
    host_pads: list[torch.Tensor | None] = []
    host_visible: list[torch.Tensor | None] = []
    host_distance: list[torch.Tensor | None] = []
    max_gather = 0
    span_extremes = None
    if len(spans) > 2:  # every chunk's longest and shortest sequence in two operations
        firsts = [a for a, _ in spans]
        span_extremes = zip(
            np.maximum.reduceat(seqs, firsts).tolist(),
            np.minimum.reduceat(seqs, firsts).tolist(),
            strict=True,
        )
    width = table.shape[1]
    flat_table = table_t.view(-1) if table_t.is_contiguous() else None
    for a, b in spans:
        C, Q = b - a, int(qlens[a])
        lens = seqs[a:b]  # [C]
        if span_extremes is not None:
            longest, shortest = next(span_extremes)
        elif C == 1:
            longest = shortest = int(lens[0])
        elif C == B and extremes is not None and extremes[0] == extremes[1]:
            # the whole batch, one query length: its extremes are the step's (no reduction)
            longest, shortest = extremes[2], step.min_context_len + Q  # type: ignore[union-attr]
        else:
            longest, shortest = int(lens.max()), int(lens.min())
        first_visible = 0 if left < 0 else max(0, shortest - Q - left)
        first_blk = first_visible // bs
        key_offset = first_blk * bs  # position of the first gathered key
        nblk = (longest + bs - 1) // bs - first_blk
        L = longest - key_offset
        ids = table[a:b, first_blk : first_blk + nblk]  # [C, nblk] int32 or int64
        ragged = shortest != longest
        pad_tokens = None
        own_keys: np.ndarray | None = None  # [C, L] bool: row j of request c is its own key
        if ragged:
            # A shorter request's columns past its own blocks may hold anything (-1, another
            # request's block): gather its first block there instead, then zero every padded
            # row, since a masked key still multiplies its value (0 * stale NaN = NaN).
            own = (lens + bs - 1) // bs - first_blk  # [C]
            ids = np.where(np.arange(nblk)[None, :] >= own[:, None], ids[:, :1], ids)
            own_keys = np.arange(L)[None, :] < (lens - key_offset)[:, None]
            pad = (~own_keys).ravel().nonzero()[0]  # c * L + j -> buffer row c * nblk * bs + j
            pad_tokens = torch.from_numpy(pad + (pad // L) * (nblk * bs - L))
        if flat_table is not None and first_blk == 0 and nblk == width and not ragged:
            host_ids.append(flat_table[a * width : b * width])  # rows of the table: no copy
        else:
            host_ids.append(torch.from_numpy(np.ascontiguousarray(ids).reshape(-1)))
        host_pads.append(pad_tokens)
        max_gather = max(max_gather, C * nblk)

        needs_pattern = (causal and Q > 1) or left >= 0 or (right >= 0 and not causal)
        causal_square = C == 1 and Q == L and causal and plain
        visible = distance = None
        if ragged and not needs_pattern and not causal_square:
            # only the shorter requests' padding to hide (a decode, or no causality)
            assert own_keys is not None
            rows = own_keys[:, None, :]  # [C, 1, L]
            visible = torch.from_numpy(rows if Q == 1 else np.broadcast_to(rows, (C, Q, L)).copy())
        if (needs_pattern and not causal_square) or spec.use_alibi:
            kv_len = lens[:, None, None]  # [C, 1, 1]
            pos_q = (kv_len - Q) + np.arange(Q)[None, :, None]  # [C, Q, 1]
            pos_k = key_offset + np.arange(L)[None, None, :]  # [1, 1, L]
            if needs_pattern and not causal_square:
                # [C, Q, L]: padding keys of shorter requests are invisible (pos_k <= pos_q
                # implies pos_k < kv_len, so a causal pattern needs one comparison)
                seen = pos_k <= pos_q if right == 0 else pos_k < kv_len
                if right > 0:
                    seen = seen & (pos_k <= pos_q + right)
                if left >= 0:
                    seen = seen & (pos_k >= pos_q - left)
                if seen.shape != (C, Q, L):
                    seen = np.broadcast_to(seen, (C, Q, L)).copy()
                visible = torch.from_numpy(seen)
            if spec.use_alibi:
                distance = torch.from_numpy(np.abs(pos_q - pos_k).astype(np.float32))
        host_visible.append(visible)
        host_distance.append(distance)
        shapes.append((int(starts[a]), C, Q, L, nblk, causal_square))

    chunks = []
    for (first, C, Q, L, nblk, causal_square), ids_d, pads_d, vis, dist in zip(
        shapes,
        _to_device(list(host_ids), device),
        _to_device(host_pads, device),
        _to_device(host_visible, device),
        _to_device(host_distance, device),
        strict=True,
    ):
        assert ids_d is not None
        visible = mask = None
        if vis is not None:
            visible = vis.view(C, 1, 1, Q, L)
            if eager:
                pass
            elif Q == 1:
                # Decode: one query token broadcasts over SDPA's rows as it is, and the mask
                # goes in additive form in the model dtype (0 / -inf): SDPA converts a bool
                # mask to it on every call, measured ~17% of a small bf16 decode call; here
                # once per step.
                zero, minus_inf = _additive_values(spec.dtype, device)
                mask = torch.where(vis.view(C, 1, 1, L), zero, minus_inf)
            else:  # SDPA's rows are (head-in-group, token)
                mask = visible.expand(C, 1, group, Q, L).reshape(C, 1, group * Q, L)
        chunks.append(
            Chunk(
                first_token=first,
                num_reqs=C,
                query_len=Q,
                kv_len=L,
                num_blocks=nblk,
                block_ids=ids_d,
                pad_tokens=pads_d,
                visible=visible,
                mask=mask,
                causal_square=causal_square,
                distance=None if dist is None else dist[:, None, None],  # [C, 1, 1, Q, L]
            )
        )
    return StepPlan(
        chunks=tuple(chunks),
        max_gather_blocks=max_gather,
        write=plan_slot_write(
            batch.slot_mapping,
            batch.host_slot_mapping(),
            None if step is None else step.min_slot,
        ),
    )


_ADDITIVE: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _additive_values(
    dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # 0 and -inf, 0-d, made once per dtype and device
    values = _ADDITIVE.get((dtype, device))
    if values is None:
        values = _ADDITIVE[dtype, device] = (
            torch.zeros((), dtype=dtype, device=device),
            torch.full((), -math.inf, dtype=dtype, device=device),
        )
    return values


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
