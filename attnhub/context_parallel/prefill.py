"""Prefill context parallel (vLLM's PCP): a long prefill's query tokens split over the ranks of a
group, every rank keeping the whole KV cache.

vLLM's head-tail split (its "DualChunkSwap"): with ``N`` ranks a prefill's ``q`` new tokens are
cut into ``2N`` chunks of ``ceil(q / 2N)`` (the last ones shorter or empty); rank ``r`` takes
chunk ``r`` and chunk ``2N - 1 - r``, so under a causal mask every rank does about the same work
(an early chunk sees few keys, a late one many). Decodes (``query_len <= decode_threshold``)
are replicated: every rank computes them whole. For ``N = 4``::

    chunks  | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 |
    rank 0    0                           7
    rank 1        1                   6
    rank 2            2           5
    rank 3                3   4

A step on every rank: compute q/k/v for its rows (``PrefillShard.token_rows`` of the step),
exchange the new keys and values so every rank holds all of them (``exchange``: one
all-gather, rows back in the step's order), write them all to the rank's cache with the step's
slot mapping, attend for its own rows through ``PrefillShard.batch`` (one request per chunk:
the chunk's tokens are the last of a sequence that ends where the chunk ends, so any causal
backend serves it unchanged; its slot mapping is all padding: the keys are already written),
and exchange the outputs back into the step's order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from attnhub.batch import BatchMetadata
from attnhub.context_parallel.sharding import _ints
from attnhub.errors import InvalidInputError


def prefill_chunks(
    query_lens: np.ndarray | torch.Tensor | list[int],
    world_size: int,
    rank: int,
    *,
    decode_threshold: int = 1,
) -> list[tuple[int, int, int]]:
    """``(request, offset in its query, length)`` of each chunk ``rank`` computes, decodes
    first, then prefills, each in request order (vLLM's ``PCPManager`` order)."""
    qlens = _ints(query_lens)
    n_chunks = 2 * world_size
    decodes, prefills = [], []
    for r, q in enumerate(qlens.tolist()):
        if q <= decode_threshold:
            decodes.append((r, 0, q))
            continue
        size = -(-q // n_chunks)
        for chunk in (rank, n_chunks - 1 - rank):
            length = min(size, q - chunk * size)
            if length > 0:
                prefills.append((r, chunk * size, length))
    return decodes + prefills


@dataclass(frozen=True)
class PrefillShard:
    """One rank's rows of a step under prefill context parallel (host tensors)."""

    world_size: int
    rank: int
    token_rows: torch.Tensor  # [local_tokens] int64: the step's rows this rank computes
    batch: BatchMetadata  # one request per chunk; slot mapping all -1 (nothing to write)
    rank_tokens: tuple[int, ...]  # every rank's local token count
    restore_rows: torch.Tensor  # [num_actual_tokens] int64: each step row in the gathered rows

    @property
    def padded_tokens(self) -> int:
        """Rows each rank sends in an exchange (the most any rank has)."""
        return max(self.rank_tokens)


def _rows(chunks: list[tuple[int, int, int]], starts: np.ndarray) -> np.ndarray:
    parts = [np.arange(starts[r] + off, starts[r] + off + n) for r, off, n in chunks]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def shard_prefill(
    batch: BatchMetadata, *, world_size: int, rank: int, decode_threshold: int = 1
) -> PrefillShard:
    """``rank``'s share of ``batch`` (the whole step, as every rank of the group is given it).
    Raises InvalidInputError naming a bad value."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise InvalidInputError(f"world_size = {world_size!r} must be a positive int")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidInputError(f"rank = {rank!r} must be an int in 0..{world_size - 1}")
    if not isinstance(batch, BatchMetadata):
        raise InvalidInputError(f"batch must be a BatchMetadata, got {type(batch).__name__}")
    if not batch.causal:
        raise InvalidInputError(
            "batch.causal is False: prefill context parallel splits causal steps only (a chunk "
            "sees the keys up to its last token)"
        )
    if isinstance(decode_threshold, bool) or not isinstance(decode_threshold, int):
        raise InvalidInputError(f"decode_threshold = {decode_threshold!r} must be an int")
    batch.validate()
    qsl = batch.query_start_loc_cpu.numpy().astype(np.int64)
    qlens, seq = qsl[1:] - qsl[:-1], batch.seq_lens_cpu.numpy().astype(np.int64)
    ctx = seq - qlens
    every = [
        prefill_chunks(qlens, world_size, r, decode_threshold=decode_threshold)
        for r in range(world_size)
    ]
    counts = tuple(sum(n for _, _, n in chunks) for chunks in every)
    padded = max(counts)
    # Each step row from the rank that computes it (a replicated decode: from rank 0).
    restore = np.full(batch.num_actual_tokens, -1, dtype=np.int64)
    for r in reversed(range(world_size)):
        rows = _rows(every[r], qsl)
        restore[rows] = r * padded + np.arange(rows.size)
    mine = every[rank]
    table = batch.host_block_table()
    req = [r for r, _, _ in mine]
    local = BatchMetadata.from_lengths(
        [n for _, _, n in mine],
        [int(ctx[r]) + off + n for r, off, n in mine],
        table[req] if req else torch.zeros((0, table.shape[1]), dtype=torch.int32),
        batch.block_size,
        batch.device,
        causal=batch.causal,
    )
    no_write = torch.full_like(local.slot_mapping, -1)
    local = replace(
        local,
        slot_mapping=no_write,
        slot_mapping_cpu=None if local.slot_mapping_cpu is None else no_write.cpu(),
    )
    return PrefillShard(
        world_size=world_size,
        rank=rank,
        token_rows=torch.from_numpy(_rows(mine, qsl)),
        batch=local,
        rank_tokens=counts,
        restore_rows=torch.from_numpy(restore),
    )
