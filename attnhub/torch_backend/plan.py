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
from typing import NamedTuple

import numpy as np
import torch

from attnhub.batch import BatchMetadata
from attnhub.spec import AttentionSpec
from attnhub.validation import StepFacts


class Chunk(NamedTuple):  # a tuple: made per chunk per step, at a third of a dataclass's cost
    first_token: int  # first query row of the chunk in q/out
    num_reqs: int  # C: requests in the chunk, consecutive in the batch
    query_len: int  # Q: every request of the chunk has this query_len
    kv_len: int  # L: keys gathered per request (from the first visible block to the longest end)
    num_blocks: int  # blocks gathered per request
    block_ids: torch.Tensor  # [C * num_blocks] int64, device
    pad_tokens: torch.Tensor | None  # [n] int64: gathered rows past a request's own keys
    visible: torch.Tensor | None  # (eager path) [C, 1, 1, Q, L] bool, device; None: all visible
    mask: torch.Tensor | None  # (SDPA path) the visibility as SDPA wants it: [C, 1, group * Q,
    #                              L] bool; when Q == 1, [C, 1, 1, L] additive (0 / -inf) in the
    #                              model dtype, broadcast over the rows; None: all visible
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
    qlens: np.ndarray,  # [B] int
    seqs: np.ndarray,  # [B] int
    decode_threshold: int,
    gather_budget_tokens: int,
    extremes: tuple[int, int, int] | None = None,
) -> list[tuple[int, int]]:  # [first request, end request) per chunk
    """Cut the batch into chunks: runs of requests with the same query_len <= decode_threshold
    are cut greedily so that ``num_reqs * longest`` stays within the budget (at least one
    request per chunk); every other request is a chunk of its own. ``extremes``: (shortest
    query, longest query, longest sequence) where known."""
    n = qlens.shape[0]
    if not n:
        return []
    if extremes is None:
        extremes = (int(qlens.min()), int(qlens.max()), int(seqs.max()))
    spans = _spans(qlens, seqs.tolist(), decode_threshold, gather_budget_tokens, extremes)
    return [(a, b) for a, b, _ in spans]


def _spans(
    qlens: np.ndarray,
    seqs: list[int],
    decode_threshold: int,
    budget: int,
    extremes: tuple[int, int, int],
) -> list[tuple[int, int, int]]:  # [first request, end request) and the longest sequence
    """:func:`chunk_spans` on the sequence lengths as a list, with each chunk's longest
    sequence (which the cut finds anyway). No numpy call per chunk: any
    ``budget // longest sequence`` requests of a run fit (k * their longest <= k * the step's
    longest), so each chunk takes that many with one ``max`` of a list slice, then grows one
    request at a time while the padded size fits (a Python step per request past the sure
    part: none where the lengths are alike, as an engine's decodes are)."""
    n = len(seqs)
    q_min, q_max, s_max = extremes
    if q_min == q_max and q_max <= decode_threshold:  # the usual decode step: one run
        if n * s_max <= budget:
            return [(0, n, s_max)]
        bounds = [0, n]
        q_lens = None  # every request is a decode
    else:
        # a run starts where the query_len changes (three numpy calls); a run of non-decodes
        # (prefills of one length) is cut into single requests below
        bounds = [0, *(np.flatnonzero(qlens[1:] != qlens[:-1]) + 1).tolist(), n]
        q_lens = qlens.tolist()
    sure = max(1, budget // s_max)
    spans: list[tuple[int, int, int]] = []
    for a, end in itertools.pairwise(bounds):
        if end - a == 1:
            spans.append((a, end, seqs[a]))  # a run of one request
            continue
        if q_lens is not None and q_lens[a] > decode_threshold:
            spans.extend((r, r + 1, seqs[r]) for r in range(a, end))  # each non-decode alone
            continue
        while a < end:
            b = min(a + sure, end)
            longest = max(seqs[a:b])
            while b < end:  # padded size (b + 1 - a) * longest is non-decreasing in b
                s = seqs[b]
                top = s if s > longest else longest
                if (b + 1 - a) * top > budget:
                    break
                longest = top
                b += 1
            spans.append((a, b, longest))
            a = b
    return spans


#: A ragged decode chunk waiting for the batched pass: (index, first query row, first request,
#: end request, blocks per request, keys per request, padding rows, shortest sequence).
_Ragged = tuple[int, int, int, int, int, int, int, int]


class Planner:
    """Plans steps for one spec: what depends only on the spec is read once, here.

    ``eager``: the impl computes scores itself (softcap, ALiBi, sinks), so no SDPA mask; it
    reads ``Chunk.visible`` instead. Host work runs in numpy on the batch's host copies. The
    usual chunk of a step, a ragged decode chunk (one query token, no window, no ALiBi), is
    planned for every such chunk of the step at once in a fixed number of numpy operations
    (:meth:`_ragged_decodes`, masks included); every other chunk, once per chunk.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        *,
        decode_threshold: int,
        gather_budget_tokens: int,
        eager: bool,
        device: torch.device,
    ) -> None:
        self.spec = spec
        self.decode_threshold = decode_threshold
        self.budget = gather_budget_tokens
        self.eager = eager
        self.device = device
        self.on_cpu = device.type == "cpu"
        self.group = spec.num_queries_per_kv
        self.window = spec.window
        self.causal = spec.causal
        self.plain = not spec.features()
        self.alibi = spec.use_alibi
        self.dtype = spec.dtype
        self._starts: dict[tuple[int, int], np.ndarray] = {}
        self._ar = np.arange(1024)  # see _arange
        self._stairs = np.zeros(0, dtype=np.bool_)  # see _staircase
        #: How the batched pass writes masks in numpy: (numpy dtype, visible, hidden, the torch
        #: dtype to view it as): the eager kernel's bool ``visible``; SDPA's additive mask in
        #: the model dtype, bf16 (which numpy lacks) as int16 bits (0xFF80 is -inf).
        self._mask_kind: tuple[type, object, object, torch.dtype | None]
        if eager:
            self._mask_kind = (np.bool_, True, False, None)
        elif spec.dtype == torch.bfloat16:
            self._mask_kind = (np.int16, 0, np.int16(-128), torch.bfloat16)
        else:
            np_dtype = {torch.float32: np.float32, torch.float16: np.float16}.get(spec.dtype)
            self._mask_kind = (np_dtype or np.float32, 0, -math.inf, None)

    def plan(self, batch: BatchMetadata, step: StepFacts | None = None) -> StepPlan:
        """``step``: what the step's checks read (``Step.facts``), reused."""
        return self._plan(batch, step, batched=True)

    def _plan(self, batch: BatchMetadata, step: StepFacts | None, *, batched: bool) -> StepPlan:
        # batched=False plans every chunk on its own (the tests compare the two)
        bs = batch.block_size
        causal = self.causal and batch.causal
        left, right = self.window
        if causal:
            right = 0
        extremes: tuple[int, int, int] | None  # shortest, longest query; longest sequence
        read = (  # the step's checks read its values (not so under structural checks)
            step is not None
            and step.query_lens is not None
            and step.seq_lens is not None
            and step.query_start_locs is not None
            and step.block_table is not None
        )
        if read:  # what the step's checks read, as they read it
            assert step is not None and step.seq_lens is not None
            assert step.query_lens is not None and step.query_start_locs is not None
            assert step.block_table is not None
            qlens, seqs = step.query_lens, step.seq_lens  # int32: positions stay below 2**31
            starts, table = step.query_start_locs, step.block_table
            extremes = (step.min_query_len, batch.max_query_len, batch.max_seq_len)
        else:
            starts = batch.query_start_loc_cpu.numpy().astype(np.int64)
            qlens = starts[1:] - starts[:-1]
            seqs = batch.seq_lens_cpu.numpy().astype(np.int64)
            extremes = (int(qlens.min()), int(qlens.max()), int(seqs.max())) if len(qlens) else None
            table = batch.host_block_table().numpy()  # [B, max_blocks]
        B = qlens.shape[0]
        if not B:
            spans: list[tuple[int, int, int]] = []
            lens_list: list[int] = []
        else:
            assert extremes is not None
            lens_list = seqs.tolist()
            spans = _spans(qlens, lens_list, self.decode_threshold, self.budget, extremes)
        uniform = extremes is not None and extremes[0] == extremes[1]
        # a pattern beyond "keys past the request's end are hidden" (besides causality for Q > 1)
        pattern = left >= 0 or (right >= 0 and not causal)
        eager, plain = self.eager, self.plain
        write = plan_slot_write(
            batch.slot_mapping, batch.host_slot_mapping(), None if step is None else step.min_slot
        )
        one_token = uniform and extremes is not None and extremes[1] == 1  # decodes only
        if batched and one_token and not pattern and not self.alibi:  # the usual step
            decodes, max_gather = self._decodes(spans, lens_list, seqs, table, bs, causal)
            return StepPlan(chunks=decodes, max_gather_blocks=max_gather, write=write)

        # Per chunk: which blocks to gather (only those a query can see: a sliding window skips
        # the older ones), and the mask / ALiBi distances where the pattern is not plain. Built on
        # the host in numpy, then sent to the device in one transfer per kind.
        shapes: list[tuple[int, int, int, int, int, bool]] = []  # (first_token, C, Q, L, nblk, sq)
        host_ids: list[torch.Tensor | None] = []
        host_pads: list[torch.Tensor | None] = []
        host_visible: list[torch.Tensor | None] = []  # bool, see below
        host_distance: list[torch.Tensor | None] = []
        ragged_decodes: list[_Ragged] = []
        max_gather = 0
        for i, (a, b, longest) in enumerate(spans):
            C, Q = b - a, int(qlens[a])
            if C == 1:
                shortest = longest
            elif C == B and uniform and read and step is not None:
                # the whole batch, one query length: its extremes are the step's (no reduction)
                shortest = step.min_context_len + Q
            else:
                shortest = min(lens_list[a:b])
            first_visible = 0 if left < 0 else max(0, shortest - Q - left)
            first_blk = first_visible // bs
            key_offset = first_blk * bs  # position of the first gathered key
            nblk = (longest + bs - 1) // bs - first_blk
            L = longest - key_offset
            if C * nblk > max_gather:
                max_gather = C * nblk
            ragged = shortest != longest
            needs_pattern = pattern or (causal and Q > 1)
            causal_square = C == 1 and Q == L and causal and plain
            shapes.append((int(starts[a]), C, Q, L, nblk, causal_square))
            if ragged and batched and Q == 1 and not pattern and not self.alibi:
                n_pad = C * L - sum(lens_list[a:b])  # padding rows of the chunk
                ragged_decodes.append((i, int(starts[a]), a, b, nblk, L, n_pad, shortest))
                host_ids.append(None)
                host_pads.append(None)
                host_visible.append(None)
                host_distance.append(None)
                continue
            lens = seqs[a:b]  # [C]
            ids = table[a:b, first_blk : first_blk + nblk]  # [C, nblk] int32 or int64
            pad_tokens = None
            own_keys: np.ndarray | None = None  # [C, L] bool: row j of request c is its own key
            if ragged:
                # A shorter request's columns past its own blocks may hold anything (-1,
                # another request's block): gather its first block there instead, then zero
                # every padded row, since a masked key still multiplies its value (0 * stale
                # NaN = NaN).
                own = (lens + bs - 1) // bs - first_blk  # [C]
                ids = np.where(np.arange(nblk)[None, :] >= own[:, None], ids[:, :1], ids)
                own_keys = np.arange(L)[None, :] < (lens - key_offset)[:, None]
                pad = (~own_keys).ravel().nonzero()[0]  # c * L + j -> buffer row c*nblk*bs + j
                pad_tokens = torch.from_numpy(pad + (pad // L) * (nblk * bs - L))
            # whole rows of a contiguous table: a view, no copy
            host_ids.append(torch.from_numpy(np.ascontiguousarray(ids).reshape(-1)))
            host_pads.append(pad_tokens)

            seen = distance = None  # seen: [C, Q, L] (or [C, 1, L]) bool
            if ragged and not needs_pattern and not causal_square:
                # only the shorter requests' padding to hide (a decode, or no causality)
                assert own_keys is not None
                seen = own_keys[:, None, :]  # [C, 1, L]
            if needs_pattern and C == 1 and Q > 1 and right == 0 and left < 0 and not self.alibi:
                # one request, causal, no window (a chunked prefill): query q sees keys
                # 0..context + q, read off one staircase array (no arithmetic)
                if not causal_square:
                    seen = self._staircase(lens_list[a] - Q, Q, L)
            elif (needs_pattern and not causal_square) or self.alibi:
                # positions in int32 where only a causal comparison follows (the step's lengths
                # are int32: comparing them with int64 positions converts first, ~1.5x slower)
                pos = np.int32 if right == 0 and left < 0 and not self.alibi else np.int64
                kv_len = lens[:, None, None]  # [C, 1, 1]
                pos_q = (kv_len - Q) + np.arange(Q, dtype=pos)[None, :, None]  # [C, Q, 1]
                pos_k = key_offset + np.arange(L, dtype=pos)[None, None, :]  # [1, 1, L]
                if needs_pattern and not causal_square:
                    # [C, Q, L]: padding keys of shorter requests are invisible (pos_k <= pos_q
                    # implies pos_k < kv_len, so a causal pattern needs one comparison)
                    seen = pos_k <= pos_q if right == 0 else pos_k < kv_len
                    if right > 0:
                        seen = seen & (pos_k <= pos_q + right)
                    if left >= 0:
                        seen = seen & (pos_k >= pos_q - left)
                if self.alibi:
                    distance = torch.from_numpy(np.abs(pos_q - pos_k).astype(np.float32))
            visible = None
            if seen is None:
                pass
            elif Q == 1:  # [C, 1, L]: a decode's row broadcasts over the query rows
                visible = torch.from_numpy(np.ascontiguousarray(seen))
            else:
                # the eager kernel's [C, Q, L]; SDPA's [C, group, Q, L] (its rows are
                # (head-in-group, token)), written by one numpy broadcast
                rows = (C, Q, L) if eager else (C, self.group, Q, L)
                full = np.empty(rows, dtype=bool)
                full[...] = seen if eager else seen[:, None]
                visible = torch.from_numpy(full)
            host_visible.append(visible)
            host_distance.append(distance)

        done = {}  # chunk index -> the chunk, for the ragged decode chunks
        if ragged_decodes:
            planned = self._ragged_decodes(ragged_decodes, seqs, table, bs)
            done = {r[0]: chunk for r, chunk in zip(ragged_decodes, planned, strict=True)}
        chunks: list[Chunk] = []
        for i, ((first, C, Q, L, nblk, causal_square), ids_d, pads_d, vis, dist) in enumerate(
            zip(
                shapes,
                _to_device(host_ids, self.device),
                _to_device(host_pads, self.device),
                _to_device(host_visible, self.device),
                _to_device(host_distance, self.device),
                strict=True,
            )
        ):
            visible = mask = None
            if ids_d is None:  # a ragged decode chunk, planned with the others
                chunks.append(done[i])
                continue
            if vis is None:
                pass
            elif eager:
                visible = vis.view(C, 1, 1, Q, L)
            elif Q == 1:
                # Decode: one query token broadcasts over SDPA's rows as it is, and the mask
                # goes in additive form in the model dtype (0 / -inf): SDPA converts a bool
                # mask to it on every call, measured ~17% of a small bf16 decode call; here
                # once per step.
                zero, minus_inf = _additive_values(self.dtype, self.device)
                mask = torch.where(vis.view(C, 1, 1, L), zero, minus_inf)
            else:  # SDPA's rows, (head-in-group, token), made so on the host
                mask = vis.view(C, 1, self.group * Q, L)
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
        return StepPlan(chunks=tuple(chunks), max_gather_blocks=max_gather, write=write)

    def _decodes(
        self,
        spans: list[tuple[int, int, int]],
        lens_list: list[int],
        seqs: np.ndarray,
        table: np.ndarray,
        bs: int,
        causal: bool,
    ) -> tuple[tuple[Chunk, ...], int]:
        """The chunks of a step of one-token decodes (no window, no ALiBi): what the general
        loop of :meth:`_plan` does for them, less what a decode never needs (no query offset,
        no pattern, no distances). A chunk whose requests are all as long gathers whole table
        rows and needs no padding nor mask; the ragged ones go to :meth:`_ragged_decodes`."""
        square = causal and self.plain  # one request of one key: SDPA's is_causal applies
        ragged: list[_Ragged] = []
        chunks: list[Chunk] = []
        max_gather = 0
        for a, b, longest in spans:  # a decode's first query row is its request's index
            C = b - a
            part = lens_list[a:b]
            shortest = longest if C == 1 else min(part)
            nblk = (longest + bs - 1) // bs
            if C * nblk > max_gather:
                max_gather = C * nblk
            if shortest != longest:  # planned below with the other ragged ones
                n_pad = C * longest - sum(part)
                ragged.append((len(chunks), a, a, b, nblk, longest, n_pad, shortest))
                chunks.append(_NO_CHUNK)
                continue
            ids = torch.from_numpy(np.ascontiguousarray(table[a:b, :nblk]).reshape(-1))
            sq = C == 1 == longest and square
            chunks.append(Chunk(a, C, 1, longest, nblk, ids, None, None, None, sq, None))
        if not self.on_cpu:  # the plain chunks' ids in one transfer
            plain = [i for i, c in enumerate(chunks) if c is not _NO_CHUNK]
            moved = _to_device([chunks[i].block_ids for i in plain], self.device)
            for i, ids_d in zip(plain, moved, strict=True):
                assert ids_d is not None
                chunks[i] = chunks[i]._replace(block_ids=ids_d)
        if ragged:
            for r, chunk in zip(ragged, self._ragged_decodes(ragged, seqs, table, bs), strict=True):
                chunks[r[0]] = chunk
        return tuple(chunks), max_gather

    def _ragged_decodes(
        self,
        ragged: list[_Ragged],
        seqs: np.ndarray,
        table: np.ndarray,
        bs: int,
    ) -> list[Chunk]:
        """Plan every ragged decode chunk of the step at once (no window: each gathers from
        its requests' first block, and its keys are positions 0..L-1). Same block ids, padding
        rows and masks as planning each chunk on its own, in a fixed number of operations on
        arrays of one entry per request (or per padding row): a request's padding rows are
        one range, listed with one ``repeat`` for all, and a mask is zeros with -inf put at
        those rows (never a comparison per (request, key)).
        Returns the chunks' records, in the order of ``ragged``."""
        # Per request (row r of all the chunks' requests, in order): keys len_r..L-1 of its
        # chunk are padding. They end at buf_end_r in its chunk's gather buffer (its rows
        # start at (row in chunk) * nblk * bs) and at mask_end_r in the masks of all the chunks
        # laid end to end. Both ends are affine in r within a chunk (slope nblk * bs or L), so
        # one [4, C] array of per-chunk values, repeated per request (no repeat for one chunk:
        # it broadcasts), gives both for every request with one multiply-add.
        sizes: list[int] = []
        per: list[list[int]] = [[], [], [], []]  # slopes (buffer, mask: L), intercepts
        nblks: list[int] = []
        Ls: list[int] = []
        pad_counts: list[int] = []  # padding rows per chunk
        row = mask_at = 0
        lo, hi = ragged[0][2], ragged[-1][3]
        shortest = ragged[0][7]
        for _, _, a, b, nblk, L, pad, short in ragged:
            C, wbs = b - a, nblk * bs
            per[0].append(wbs)
            per[1].append(L)
            per[2].append(L - row * wbs)  # buf_end_r = r * wbs + L - row0 * wbs
            per[3].append(mask_at + L - row * L)  # mask_end_r = mask_at + (r - row0 + 1) * L
            sizes.append(C)
            nblks.append(nblk)
            Ls.append(L)
            pad_counts.append(pad)
            if short < shortest:
                shortest = short
            row += C
            mask_at += C * L
        R, W, total = row, max(nblks), sum(pad_counts)
        if hi - lo == R:  # a decode run's chunks are adjacent
            lens, grid = seqs[lo:hi], table[lo:hi, :W]
        else:
            rows = np.concatenate([np.arange(a, b) for _, _, a, b, *_ in ragged])
            lens, grid = seqs[rows], table[rows, :W]
        coef = np.array(per)  # [4, chunks]
        if len(ragged) > 1:
            coef = np.repeat(coef, sizes, axis=1)  # [4, R]
        counts = coef[1] - lens  # padding rows per request
        ends = _ACCUMULATE(counts, dtype=np.int64)  # padding rows up to and with each request
        # [2, R]: where each request's padding starts, less its first padding row's index
        starts = coef[:2] * self._arange(R) + (coef[2:4] - ends)
        ar = self._arange(total)
        spots = np.repeat(starts, counts, axis=1) + ar  # [2, total]: buffer rows, mask entries
        pads = torch.from_numpy(spots[0])
        # masks: visible everywhere but at the padding rows, built in numpy (bf16 as its bits)
        dtype, visible, hidden, as_dtype = self._mask_kind
        masks: np.ndarray = (np.zeros if visible == 0 else np.ones)(mask_at, dtype=dtype)
        masks[spots[1]] = hidden
        vis = torch.from_numpy(masks)
        if as_dtype is not None:
            vis = vis.view(as_dtype)
        if not self.eager and vis.dtype != self.dtype:  # a model dtype numpy lacks: convert
            vis = vis.to(self.dtype)
        # block ids: past its own blocks, a request gathers its first block again (only where
        # some request has fewer blocks of its own than the widest chunk gathers)
        ids = grid
        if shortest <= (W - 1) * bs:
            ids = np.where(self._block_starts(W, bs) >= lens[:, None], grid[:, :1], grid)
            if min(nblks) != W:  # each request keeps its own chunk's width
                ids = ids[self._block_starts(W, 1) < (coef[0] // bs)[:, None]]
        ids_t = torch.from_numpy(ids.reshape(-1))  # whole rows of a contiguous table: a view
        if not self.on_cpu:
            dev = self.device
            ids_t, pads, vis = ids_t.to(dev), pads.to(dev), vis.to(dev)
        per_ids: Sequence[torch.Tensor] = (ids_t,)
        per_pads: Sequence[torch.Tensor] = (pads,)
        per_vis: Sequence[torch.Tensor] = (vis,)
        if len(ragged) > 1:  # one split per kind
            per_ids = ids_t.split_with_sizes([c * nb for c, nb in zip(sizes, nblks, strict=True)])
            per_pads = pads.split_with_sizes(pad_counts)
            per_vis = vis.split_with_sizes([c * L for c, L in zip(sizes, Ls, strict=True)])
        chunks = []
        for (_, first, a, b, nblk, L, _, _), ids_c, pads_c, v in zip(
            ragged, per_ids, per_pads, per_vis, strict=True
        ):
            if self.eager:  # the eager kernel's visible: [C, 1, 1, 1, L]
                visible, mask = v.view(b - a, 1, 1, 1, L), None
            else:  # SDPA's additive mask: [C, 1, 1, L]
                visible, mask = None, v.view(b - a, 1, 1, L)
            chunks.append(
                Chunk(first, b - a, 1, L, nblk, ids_c, pads_c, visible, mask, False, None)
            )
        return chunks

    def _staircase(self, context: int, Q: int, L: int) -> np.ndarray:
        """[1, Q, L] bool, row q True at keys 0..context + q and False after (L = context + Q):
        the rows of one [True] * K + [False] * K array, each one element left of the row
        before (a strided view of it, never written)."""
        stairs = self._stairs
        K = stairs.shape[0] // 2
        if K < L:
            K = max(L, 2 * K)
            stairs = np.zeros(2 * K, dtype=np.bool_)
            stairs[:K] = True
            self._stairs = stairs  # filled first: views of the old one stay as they are
        # row q, key k reads stairs[K - 1 - context - q + k]: True iff k <= context + q
        return np.ndarray(
            (1, Q, L), dtype=np.bool_, buffer=stairs, offset=K - 1 - context, strides=(0, -1, 1)
        )

    def _arange(self, n: int) -> np.ndarray:
        """0..n-1 (int64), a view of one array kept and grown as needed."""
        ar = self._ar  # read once: another thread may grow it meanwhile
        if n > ar.shape[0]:
            ar = self._ar = np.arange(max(n, 2 * ar.shape[0]))
        return ar[:n]

    def _block_starts(self, width: int, bs: int) -> np.ndarray:
        """[1, width] the first key position of each block, made once per (width, block size)."""
        key = (width, bs)
        starts = self._starts.get(key)
        if starts is None:
            starts = self._starts[key] = np.arange(width)[None, :] * bs
        return starts


#: A place in :meth:`Planner._decodes`'s list for a chunk planned later.
_NO_CHUNK = Chunk(0, 0, 0, 0, 0, torch.empty(0, dtype=torch.int64), None, None, None, False, None)

_ACCUMULATE = np.add.accumulate  # np.cumsum less its Python wrapper (~2 us on small arrays)

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
) -> Sequence[torch.Tensor | None]:
    """Move host tensors (of one dtype) to ``device`` in one copy; views of it come back."""
    if device.type == "cpu":
        return tensors
    present = [t for t in tensors if t is not None]
    if not present:
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
