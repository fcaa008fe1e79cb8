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
from attnhub.validation import StepFacts as CheckedFacts


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
    seqs: list[int],  # [B]
    decode_threshold: int,
    budget: int,
    extremes: tuple[int, int, int],  # shortest query, longest query, longest sequence
) -> list[tuple[int, int, int]]:  # [first request, end request) and the longest sequence
    """Cut the batch into chunks: runs of requests with the same query_len <= decode_threshold
    are cut greedily so that ``num_reqs * longest`` stays within the budget (at least one
    request per chunk); every other request is a chunk of its own. Each chunk comes with its
    longest sequence (which the cut finds anyway). No numpy call per chunk: any
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


class StepFacts(NamedTuple):
    """What the planner reads of a step: the host facts the step's checks read (or, where
    they read none, the batch's host copies), and the step's attention pattern."""

    qlens: np.ndarray  # [B] query lengths
    seqs: np.ndarray  # [B] sequence lengths
    lens: list[int]  # seqs as a list (the cut and per-chunk extremes read it)
    starts: np.ndarray  # [B + 1] query start offsets
    table: np.ndarray  # [B, max_blocks] block table
    extremes: tuple[int, int, int] | None  # shortest, longest query; longest sequence
    min_context: int | None  # the shortest context, where the checks read the step
    block_size: int
    causal: bool  # the spec's and the batch's
    left: int  # the window: keys left of / right of the query position (-1: unbounded)
    right: int
    pattern: bool  # hides more than keys past a request's end (besides causality for Q > 1)


class ChunkShape(NamedTuple):
    """One chunk's extents, before its arrays are made."""

    first_token: int  # first query row of the chunk in q/out
    first_req: int  # requests first_req..end_req-1 of the batch
    end_req: int
    query_len: int  # Q
    kv_len: int  # L: keys gathered per request, from its first gathered block
    num_blocks: int  # blocks gathered per request
    first_block: int  # the first gathered block's column in the table (a window skips some)
    shortest: int  # the shortest request's sequence length
    ragged: bool  # the requests' sequence lengths differ: padding to hide and zero
    causal_square: bool  # SDPA's is_causal applies (see Chunk)
    masked: bool  # a pattern beyond the padding: causality for Q > 1 (not causal_square), a window
    #: A ragged decode chunk whose only pattern is its shorter requests' padding (one query
    #: token, no window, no ALiBi): planned with the others by :meth:`Planner.ragged_decodes`.
    batched: bool


class _HostChunk(NamedTuple):  # a chunk's arrays on the host, before the one transfer
    block_ids: torch.Tensor  # [C * num_blocks] int
    pad_tokens: torch.Tensor | None  # [n] int64
    visible: torch.Tensor | None  # bool: eager [C, Q, L], SDPA [C, group, Q, L]; Q == 1: [C, 1, L]
    distance: torch.Tensor | None  # [C, Q, L] float32


class Planner:
    """Plans steps for one spec: what depends only on the spec is read once, here.

    ``eager``: the impl computes scores itself (softcap, ALiBi, sinks), so no SDPA mask; it
    reads ``Chunk.visible`` instead. Host work runs in numpy on the step's host facts. One
    planner makes every chunk (:meth:`chunks`: block ids, padding rows, mask and distances,
    each by whole-array numpy operations), with three fast paths where measured to pay
    (docs/performance.md), each held to it by a property test: a step of one-token decodes
    only skips the extents step (:meth:`decodes`); the ragged decode chunks of a
    step (the usual chunk) are planned all at once by :meth:`ragged_decodes`, in a fixed
    number of numpy operations for any number of chunks; a chunked prefill's causal mask is
    read off a cached staircase (:meth:`_staircase`) instead of compared position by position.
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
        self.causal = spec.causal
        self.window = spec.window
        self.group = spec.num_queries_per_kv
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

    def plan(self, batch: BatchMetadata, step: CheckedFacts | None = None) -> StepPlan:
        """``step``: what the step's checks read (``Step.facts``), reused."""
        facts = self.facts(batch, step)
        chunks: Sequence[Chunk]
        ext = facts.extremes
        if ext is not None and ext[0] == ext[1] == 1 and not facts.pattern and not self.alibi:
            chunks, max_gather = self.decodes(facts)  # the usual engine step
            min_slot = None if step is None else step.min_slot
            write = plan_slot_write(batch.slot_mapping, batch.host_slot_mapping(), min_slot)
            return StepPlan(chunks=tuple(chunks), max_gather_blocks=max_gather, write=write)
        shapes, max_gather = self.shapes(facts)
        together = [s for s in shapes if s.batched]
        if not together:
            chunks = self.chunks(facts, shapes)
        elif len(together) == len(shapes):
            chunks = self.ragged_decodes(facts, shapes)
        else:  # both kinds: back in the step's order
            batched = iter(self.ragged_decodes(facts, together))
            alone = iter(self.chunks(facts, [s for s in shapes if not s.batched]))
            chunks = [next(batched) if s.batched else next(alone) for s in shapes]
        min_slot = None if step is None else step.min_slot
        write = plan_slot_write(batch.slot_mapping, batch.host_slot_mapping(), min_slot)
        return StepPlan(chunks=tuple(chunks), max_gather_blocks=max_gather, write=write)

    def decodes(self, f: StepFacts) -> tuple[list[Chunk], int]:
        """Fast path for a step of one-token decodes only (no window, no ALiBi), held to
        :meth:`shapes` + :meth:`chunks` by a property test: what they make for such a step,
        less what a decode never needs (no query offset, no first block, no pattern). A chunk
        whose requests are all as long gathers whole table rows, nothing else; the ragged ones
        go to :meth:`ragged_decodes` together."""
        assert f.extremes is not None
        spans = chunk_spans(f.qlens, f.lens, self.decode_threshold, self.budget, f.extremes)
        square, bs, lens, table = f.causal and self.plain, f.block_size, f.lens, f.table
        chunks: list[Chunk | None] = []
        ragged: list[ChunkShape] = []
        max_gather = 0
        for a, b, longest in spans:  # a decode's first query row is its request's index
            C = b - a
            shortest = longest if C == 1 else min(lens[a:b])
            nblk = (longest + bs - 1) // bs
            if C * nblk > max_gather:
                max_gather = C * nblk
            if shortest != longest:  # planned below, with the other ragged ones
                shape = (a, a, b, 1, longest, nblk, 0, shortest, True, False, False, True)
                ragged.append(_new_tuple(ChunkShape, shape))
                chunks.append(None)
                continue
            ids = torch.from_numpy(np.ascontiguousarray(table[a:b, :nblk]).reshape(-1))
            sq = square and C == 1 == longest
            chunks.append(
                _new_tuple(Chunk, (a, C, 1, longest, nblk, ids, None, None, None, sq, None))
            )
        if not self.on_cpu:  # the plain chunks' ids in one transfer
            plain = [(i, c) for i, c in enumerate(chunks) if c is not None]
            moved = _to_device([c.block_ids for _, c in plain], self.device)
            for (i, c), ids_d in zip(plain, moved, strict=True):
                assert ids_d is not None
                chunks[i] = c._replace(block_ids=ids_d)
        if ragged:
            done = iter(self.ragged_decodes(f, ragged))
            chunks = [next(done) if c is None else c for c in chunks]
        return chunks, max_gather  # type: ignore[return-value]

    def facts(self, batch: BatchMetadata, step: CheckedFacts | None) -> StepFacts:
        """The step's host facts: as the step's checks read them, where they read them (not
        so under structural checks), else from the batch's host copies."""
        causal = self.causal and batch.causal
        left, right = self.window
        if causal:
            right = 0
        pattern = left >= 0 or (right >= 0 and not causal)
        extremes: tuple[int, int, int] | None
        if (
            step is not None
            and step.query_lens is not None
            and step.seq_lens is not None
            and step.query_start_locs is not None
            and step.block_table is not None
        ):
            qlens, seqs = step.query_lens, step.seq_lens  # int32: positions stay below 2**31
            starts, table = step.query_start_locs, step.block_table
            extremes = (step.min_query_len, batch.max_query_len, batch.max_seq_len)
            min_context: int | None = step.min_context_len
        else:
            starts = batch.query_start_loc_cpu.numpy().astype(np.int64)
            qlens = starts[1:] - starts[:-1]
            seqs = batch.seq_lens_cpu.numpy().astype(np.int64)
            extremes = (int(qlens.min()), int(qlens.max()), int(seqs.max())) if len(qlens) else None
            table = batch.host_block_table().numpy()  # [B, max_blocks]
            min_context = None
        return StepFacts(
            qlens, seqs, seqs.tolist(), starts, table, extremes, min_context,
            batch.block_size, causal, left, right, pattern,
        )  # fmt: skip

    def shapes(self, f: StepFacts) -> tuple[list[ChunkShape], int]:
        """Cut the step into chunks (:func:`chunk_spans`) and find each one's extents: the
        blocks it gathers (only those a query can see: a sliding window skips the older).
        Also the most blocks a chunk gathers, to size the gather buffers."""
        if f.extremes is None:
            return [], 0
        spans = chunk_spans(f.qlens, f.lens, self.decode_threshold, self.budget, f.extremes)
        bs, left, lens, B = f.block_size, f.left, f.lens, len(f.lens)
        q_min, q_max, _ = f.extremes
        # one query length, the step read by its checks: the whole batch's shortest sequence
        # is the step's, and a request's first query row is its index times the length
        whole = q_min == q_max and f.min_context is not None
        context = -1 if f.min_context is None else f.min_context
        square, batchable = f.causal and self.plain, not f.pattern and not self.alibi
        shapes, max_gather = [], 0
        for a, b, longest in spans:
            C = b - a
            Q, first = (q_min, a * q_min) if whole else (int(f.qlens[a]), int(f.starts[a]))
            if C == 1:
                shortest = longest
            elif B == C and whole:
                shortest = q_min + context
            else:
                shortest = min(lens[a:b])
            first_block = 0 if left < 0 else max(0, shortest - Q - left) // bs
            L = longest - first_block * bs
            nblk = (longest + bs - 1) // bs - first_block
            if C * nblk > max_gather:
                max_gather = C * nblk
            ragged = shortest != longest
            square_c = square and C == 1 and Q == L
            masked = (f.pattern or (f.causal and Q > 1)) and not square_c
            batched = ragged and Q == 1 and batchable
            shape = (first, a, b, Q, L, nblk, first_block, shortest, ragged, square_c, masked)
            shapes.append(_new_tuple(ChunkShape, (*shape, batched)))
        return shapes, max_gather

    def chunks(self, f: StepFacts, shapes: Sequence[ChunkShape]) -> list[Chunk]:
        """The chunks, each planned on its own on the host (:meth:`arrays`), then sent to the
        device in one transfer per kind of array."""
        arrays: Sequence[_HostChunk] = [self.arrays(f, s) for s in shapes]
        if not self.on_cpu:
            moved = [_to_device([h[k] for h in arrays], self.device) for k in range(4)]
            arrays = [_HostChunk(*h) for h in zip(*moved, strict=True)]
        chunks = []
        for s, (ids, pads, vis, dist) in zip(shapes, arrays, strict=True):
            C, Q, L = s.end_req - s.first_req, s.query_len, s.kv_len
            visible = mask = None
            if vis is None:
                pass
            elif self.eager:
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
            distance = None if dist is None else dist[:, None, None]  # [C, 1, 1, Q, L]
            record = (s.first_token, C, Q, L, s.num_blocks, ids, pads, visible, mask)
            chunks.append(_new_tuple(Chunk, (*record, s.causal_square, distance)))
        return chunks

    def arrays(self, f: StepFacts, s: ChunkShape) -> _HostChunk:
        """One chunk's arrays, on the host: the block ids to gather (whole table rows where
        its requests are as long), the padding rows of its shorter requests, its mask (None:
        every gathered key visible) and ALiBi distances."""
        _, a, b, Q, L, nblk, first_block, _, ragged, _, masked, _ = s
        ids = f.table[a:b, first_block : first_block + nblk]  # [C, nblk] int32 or int64
        if not (ragged or masked or self.alibi):  # every gathered key visible
            ids_t = torch.from_numpy(np.ascontiguousarray(ids).reshape(-1))
            return _new_tuple(_HostChunk, (ids_t, None, None, None))
        C, bs = b - a, f.block_size
        pad_tokens = own_keys = None  # own_keys: [C, L] bool, row j of request c is its own key
        if ragged:
            # A shorter request's columns past its own blocks may hold anything (-1, another
            # request's block): gather its first block there instead, then zero every padded
            # row, since a masked key still multiplies its value (0 * stale NaN = NaN).
            lens = f.seqs[a:b]  # [C]
            own = (lens + bs - 1) // bs - first_block  # [C]
            ids = np.where(np.arange(nblk)[None, :] >= own[:, None], ids[:, :1], ids)
            own_keys = np.arange(L)[None, :] < (lens - first_block * bs)[:, None]
            pad = (~own_keys).ravel().nonzero()[0]  # c * L + j -> buffer row c*nblk*bs + j
            pad_tokens = torch.from_numpy(pad + (pad // L) * (nblk * bs - L))
        ids_t = torch.from_numpy(np.ascontiguousarray(ids).reshape(-1))  # whole rows: a view
        seen, distance = self._pattern(f, s, own_keys)  # seen: [C, Q, L] (or [C, 1, L]) bool
        if seen is None:
            return _HostChunk(ids_t, pad_tokens, None, distance)
        if Q == 1:  # [C, 1, L]: a decode's row broadcasts over the query rows
            return _HostChunk(
                ids_t, pad_tokens, torch.from_numpy(np.ascontiguousarray(seen)), distance
            )
        # the eager kernel's [C, Q, L]; SDPA's [C, group, Q, L] (its rows are (head-in-group,
        # token)), written by one numpy broadcast
        full = np.empty((C, Q, L) if self.eager else (C, self.group, Q, L), dtype=np.bool_)
        full[...] = seen if self.eager else seen[:, None]
        return _HostChunk(ids_t, pad_tokens, torch.from_numpy(full), distance)

    def _pattern(
        self, f: StepFacts, s: ChunkShape, own_keys: np.ndarray | None
    ) -> tuple[np.ndarray | None, torch.Tensor | None]:
        """A chunk's visibility ([C, Q, L] or [C, 1, L] bool; None: every key visible) and
        ALiBi distances ([C, Q, L] float32). ``own_keys``: [C, L] the requests' own keys,
        where ragged (all a chunk without a pattern hides)."""
        if not s.masked and not self.alibi:
            return (None if own_keys is None else own_keys[:, None, :]), None  # padding only
        if self.staircase(f, s):
            # one request, causal, no window (a chunked prefill): query q sees keys
            # 0..context + q, read off one staircase array (no arithmetic)
            context = f.lens[s.first_req] - s.query_len
            return self._staircase(context, s.query_len, s.kv_len), None
        seen, distance = self._positions(f, s)
        if not s.masked:
            return (None if own_keys is None else own_keys[:, None, :]), distance
        return seen, distance

    def staircase(self, f: StepFacts, s: ChunkShape) -> bool:
        """Whether the chunk's mask is read off the staircase (:meth:`_staircase`) rather than
        compared from positions (:meth:`_positions`): one request, causal, no window, no ALiBi."""
        one = s.end_req - s.first_req == 1
        return s.masked and one and f.right == 0 and f.left < 0 and not self.alibi

    def _positions(self, f: StepFacts, s: ChunkShape) -> tuple[np.ndarray, torch.Tensor | None]:
        """A chunk's visibility [C, Q, L] bool and ALiBi distances [C, Q, L] float32 |pos(i) -
        j| (None without ALiBi), from positions: a query's is its request's length - Q + its
        index, a key's its gathered index + the first gathered block's position."""
        Q, L = s.query_len, s.kv_len
        # positions in int32 where only a causal comparison follows (the step's lengths are
        # int32: comparing them with int64 positions converts first, ~1.5x slower)
        pos = np.int32 if f.right == 0 and f.left < 0 and not self.alibi else np.int64
        lens = f.seqs[s.first_req : s.end_req, None, None]  # [C, 1, 1]
        pos_q = (lens - Q) + np.arange(Q, dtype=pos)[None, :, None]  # [C, Q, 1]
        pos_k = s.first_block * f.block_size + np.arange(L, dtype=pos)[None, None, :]  # [1, 1, L]
        distance = None
        if self.alibi:
            distance = torch.from_numpy(np.abs(pos_q - pos_k).astype(np.float32))
        # padding keys of shorter requests are invisible (pos_k <= pos_q implies pos_k <
        # kv_len, so a causal pattern needs one comparison)
        seen = pos_k <= pos_q if f.right == 0 else pos_k < lens
        if f.right > 0:
            seen = seen & (pos_k <= pos_q + f.right)
        if f.left >= 0:
            seen = seen & (pos_k >= pos_q - f.left)
        return seen, distance

    def ragged_decodes(self, f: StepFacts, shapes: Sequence[ChunkShape]) -> list[Chunk]:
        """Every ragged decode chunk of the step (``ChunkShape.batched``), at once: the block
        ids, padding rows and masks :meth:`chunks` makes for each, in a fixed number of numpy
        operations on arrays of one entry per request (or per padding row): a request's
        padding rows are one range, listed with one ``repeat`` for all, and a mask is zeros
        with -inf put at those rows (never a comparison per (request, key))."""
        bs = f.block_size
        coef, sizes, pad_counts, id_sizes, mask_sizes = self._affine(f, shapes)  # [4, R]
        W, shortest = max([s.num_blocks for s in shapes]), min([s.shortest for s in shapes])
        lo, hi = shapes[0].first_req, shapes[-1].end_req
        if hi - lo == sum(sizes):  # a decode run's chunks are adjacent
            lens, grid = f.seqs[lo:hi], f.table[lo:hi, :W]
        else:
            rows = np.concatenate([np.arange(s.first_req, s.end_req) for s in shapes])
            lens, grid = f.seqs[rows], f.table[rows, :W]
        pads, vis = self._padding(coef, lens, sum(pad_counts), sum(mask_sizes))
        # block ids: past its own blocks, a request gathers its first block again (only where
        # some request has fewer blocks of its own than the widest chunk gathers)
        ids = grid
        if shortest <= (W - 1) * bs:
            ids = np.where(self._block_starts(W, bs) >= lens[:, None], grid[:, :1], grid)
            if any(s.num_blocks != W for s in shapes):  # each request keeps its chunk's width
                ids = ids[self._block_starts(W, 1) < (coef[0] // bs)[:, None]]
        ids_t = torch.from_numpy(ids.reshape(-1))  # whole rows of a contiguous table: a view
        if not self.on_cpu:
            ids_t, pads, vis = ids_t.to(self.device), pads.to(self.device), vis.to(self.device)
        per: Sequence[tuple[torch.Tensor, ...]] = [(ids_t, pads, vis)]
        if len(shapes) > 1:  # one split per kind
            splits = (
                ids_t.split_with_sizes(id_sizes),
                pads.split_with_sizes(pad_counts),
                vis.split_with_sizes(mask_sizes),
            )
            per = list(zip(*splits, strict=True))
        chunks = []
        for s, C, (ids_c, pads_c, v) in zip(shapes, sizes, per, strict=True):
            if not (self.eager or self.on_cpu) and v.storage_offset() * v.element_size() % 16:
                # SDPA takes the mask as it is, and its CUDA kernels read it with 16-byte
                # loads from its first element: a view of the masks' array starting elsewhere
                # is misaligned (a kernel fault), so such a chunk's mask gets its own memory
                v = v.clone()
            view = v.view(C, 1, 1, 1, s.kv_len) if self.eager else v.view(C, 1, 1, s.kv_len)
            visible, mask = (view, None) if self.eager else (None, view)  # see Chunk
            record = (s.first_token, C, 1, s.kv_len, s.num_blocks, ids_c, pads_c, visible, mask)
            chunks.append(_new_tuple(Chunk, (*record, False, None)))
        return chunks

    def _affine(
        self, f: StepFacts, shapes: Sequence[ChunkShape]
    ) -> tuple[np.ndarray, list[int], list[int], list[int], list[int]]:
        """[4, R] per request r of the ragged decode chunks (in order): its chunk's slopes and
        intercepts of where r's padding ends; per chunk, its requests, padding rows, block ids
        and mask entries.
        Keys len_r..L-1 of its chunk are padding; they end at buf_end_r in its chunk's gather
        buffer (its rows start at (row in chunk) * nblk * bs) and at mask_end_r in the masks
        of all the chunks laid end to end. Both are affine in r within a chunk (slope nblk *
        bs or L): per-chunk values, repeated per request (no repeat for one chunk: it
        broadcasts), give both for every request with one multiply-add."""
        per: list[list[int]] = [[], [], [], []]  # slopes (buffer, mask: L), intercepts
        sizes, pad_counts, id_sizes, mask_sizes = [], [], [], []
        row = mask_at = 0
        lens, bs = f.lens, f.block_size
        for _, a, b, _, L, nblk, _, _, _, _, _, _ in shapes:  # unpacked: read per chunk per step
            C, wbs = b - a, nblk * bs
            per[0].append(wbs)
            per[1].append(L)
            per[2].append(L - row * wbs)  # buf_end_r = r * wbs + L - row0 * wbs
            per[3].append(mask_at + L - row * L)  # mask_end_r = mask_at + (r - row0 + 1) * L
            sizes.append(C)
            pad_counts.append(C * L - sum(lens[a:b]))
            id_sizes.append(C * nblk)
            mask_sizes.append(C * L)
            row += C
            mask_at += C * L
        coef = np.array(per)
        coef = np.repeat(coef, sizes, axis=1) if len(shapes) > 1 else coef
        return coef, sizes, pad_counts, id_sizes, mask_sizes

    def _padding(
        self, coef: np.ndarray, lens: np.ndarray, total: int, mask_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ragged decode chunks' padding rows (in their gather buffers, laid end to end)
        and masks (visible everywhere but at the padding rows, built in numpy; bf16 as its
        bits), from :meth:`_affine`'s coefficients and the requests' lengths."""
        counts = coef[1] - lens  # padding rows per request
        ends = _ACCUMULATE(counts, dtype=np.int64)  # padding rows up to and with each request
        # [2, R]: where each request's padding starts, less its first padding row's index
        starts = coef[:2] * self._arange(lens.shape[0]) + (coef[2:4] - ends)
        spots = np.repeat(starts, counts, axis=1) + self._arange(total)  # buffer rows, masks
        dtype, visible, hidden, as_dtype = self._mask_kind
        masks: np.ndarray = (np.zeros if visible == 0 else np.ones)(mask_size, dtype=dtype)
        masks[spots[1]] = hidden
        vis = torch.from_numpy(masks)
        if as_dtype is not None:
            vis = vis.view(as_dtype)
        if not self.eager and vis.dtype != self.dtype:  # a model dtype numpy lacks: convert
            vis = vis.to(self.dtype)
        return torch.from_numpy(spots[0]), vis

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
        # row q, key k reads stairs[K - 1 - context - q + k]: True iff k <= context + q. One
        # row (Q == 1) takes stride 0: numpy's contiguity ignores an axis of one, so
        # ascontiguousarray would keep a -1 there, which torch.from_numpy refuses
        step = -1 if Q > 1 else 0
        return np.ndarray(
            (1, Q, L), dtype=np.bool_, buffer=stairs, offset=K - 1 - context, strides=(0, step, 1)
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


#: Makes a NamedTuple from a tuple of its fields: its ``__new__`` less a Python call (~0.3 us
#: per record, one per chunk per step).
_new_tuple = tuple.__new__

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
