"""Padding a step's batch to its descriptor, on host data.

Padding requests are *dummy* requests: each has the descriptor's query length, a sequence of
exactly that many tokens (no context), a block-table row of zeros and slot -1 for every token.
They satisfy every rule a batch obeys (query_len >= 1, seq_len >= query_len), so a backend's
``build`` and step extents accept them unchanged, and they cannot disturb real requests:
they write nothing (slot -1, skipped by every KV write), and what they read (block 0) only
feeds their own output rows, which the runner drops. Real requests keep their rows, lengths and
blocks; the block table is widened (zeros) or narrowed to the runner's fixed width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnhub.batch import BatchMetadata
from attnhub.errors import InvalidInputError
from attnhub.graphs.descriptor import BatchDescriptor


@dataclass(frozen=True)
class PaddedStep:
    """A step padded to a descriptor: host tensors, ready to copy into persistent buffers."""

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, width] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_real_tokens: int  # rows of real requests (the first ones)
    max_query_len: int
    max_seq_len: int


def pad_batch(batch: BatchMetadata, desc: BatchDescriptor, width: int) -> PaddedStep:
    """``batch`` padded to ``desc`` with dummy requests (see the module docstring), its block
    table ``width`` blocks wide. Raises InvalidInputError when a request needs more blocks."""
    R, B, T = desc.num_reqs, batch.num_reqs, desc.num_tokens
    q = desc.query_len
    if B > R or batch.num_actual_tokens > T:
        raise InvalidInputError(
            f"the batch ({B} requests, {batch.num_actual_tokens} tokens) does not fit {desc}"
        )
    seq = torch.full((R,), q, dtype=torch.int32)
    seq[:B] = batch.seq_lens_cpu
    longest = int(batch.seq_lens_cpu.max()) if B else 0
    needed = -(-longest // batch.block_size)
    if needed > width:
        r = int(batch.seq_lens_cpu.argmax())
        raise InvalidInputError(
            f"request {r} (seq_len {longest}) needs {needed} blocks of {batch.block_size}; the "
            f"graph runner's block table holds {width} (max_blocks_per_req)"
        )
    table = torch.zeros((R, width), dtype=torch.int32)
    host_table = batch.host_block_table()
    cols = min(width, host_table.shape[1])
    table[:B, :cols] = host_table[:, :cols]
    qsl = torch.arange(0, (R + 1) * q, q, dtype=torch.int32)
    n = batch.num_actual_tokens
    slots = torch.full((T,), -1, dtype=torch.int64)
    slots[:n] = batch.host_slot_mapping()[:n]
    return PaddedStep(
        query_start_loc=qsl,
        seq_lens=seq,
        block_table=table,
        slot_mapping=slots,
        num_real_tokens=n,
        max_query_len=q,
        max_seq_len=max(longest, q),
    )
