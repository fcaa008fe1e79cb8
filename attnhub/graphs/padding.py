"""Padding a step's batch to its descriptor, on host data.

Padding requests are *dummy* requests: each has the descriptor's query length, a sequence of
exactly that many tokens (no context), a block-table row of zeros and slot -1 for every token.
They satisfy every rule a batch obeys (query_len >= 1, seq_len >= query_len), so a backend's
``build`` and step extents accept them unchanged, and they cannot disturb real requests:
they write nothing (slot -1, skipped by every KV write), and what they read (block 0) only
feeds their own output rows, which the runner drops. Real requests keep their rows, lengths and
blocks; the block table is widened (zeros) or narrowed to the runner's fixed width.

A *mixed* descriptor (``uniform_decode=False``: an ``ALWAYS`` backend's graph of any batch) fixes
the token count T and the request count R, not the query lengths. Its dummy requests share the
T - t spare tokens (at least one each, as even as can be). Where they are fewer than the
requests missing (an engine's graph of R requests in T tokens, e.g. vLLM's, given a batch that
fills the tokens with fewer requests), real requests are *split*: a request's last tokens
become requests of one token each over the same blocks and positions (``seq_len`` the
position after the token). A causal query row sees keys up to its own position whichever
request it belongs to, so a split changes no output, no KV write and no row; a non-causal batch
is never split (refused). Rows stay in order: real tokens first, dummies after.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
    if not desc.uniform_decode:
        return _pad_mixed(batch, desc, width)
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


def _pad_mixed(batch: BatchMetadata, desc: BatchDescriptor, width: int) -> PaddedStep:
    """``batch`` padded to a mixed descriptor: dummy requests for the spare tokens, real
    requests split where requests are still missing (module docstring)."""
    R, B, T = desc.num_reqs, batch.num_reqs, desc.num_tokens
    n = batch.num_actual_tokens
    if B > R or n > T or R > T:
        raise InvalidInputError(
            f"the batch ({B} requests, {n} tokens) does not fit {desc} (every request needs a "
            "token of its own)"
        )
    spare, missing = T - n, R - B
    if spare and not missing:
        raise InvalidInputError(
            f"the batch ({B} requests, {n} tokens) does not fit {desc}: its {spare} spare "
            "tokens need a padding request and every request is taken"
        )
    dummies = min(missing, spare)
    splits = missing - dummies
    if splits and not batch.causal:
        raise InvalidInputError(
            f"the non-causal batch ({B} requests, {n} tokens) would have to be split into "
            f"{splits} more requests to fit {desc}; only causal queries can be split"
        )
    q = batch.query_lens_cpu.numpy().astype(np.int64)
    s = batch.seq_lens_cpu.numpy().astype(np.int64)
    longest = int(s.max()) if B else 0
    needed = -(-longest // batch.block_size)
    if needed > width:
        r = int(s.argmax())
        raise InvalidInputError(
            f"request {r} (seq_len {longest}) needs {needed} blocks of {batch.block_size}; the "
            f"graph runner's block table holds {width} (max_blocks_per_req)"
        )
    # tokens peeled off each real request (its last ones, one request each), last requests
    # first: vLLM orders decodes first, so prefills are split before decodes are touched
    peel = np.zeros(B, dtype=np.int64)
    left = splits
    for r in range(B - 1, -1, -1):
        if not left:
            break
        peel[r] = min(int(q[r]) - 1, left)
        left -= int(peel[r])
    pieces = 1 + peel  # requests each real one becomes
    owner = np.repeat(np.arange(B), pieces)  # the real request of each padded one
    first = np.concatenate(([0], np.cumsum(pieces)[:-1])).astype(np.int64)
    j = np.arange(len(owner)) - first[owner]  # 0: the head piece, 1..: peeled tokens
    lens = np.where(j == 0, q[owner] - peel[owner], 1)
    seqs = np.where(j == 0, s[owner] - peel[owner], s[owner] - peel[owner] + j)
    extra = [spare // dummies + (i < spare % dummies) for i in range(dummies)] if dummies else []
    most = max(extra, default=0)
    if -(-most // batch.block_size) > width:
        raise InvalidInputError(
            f"a padding request of {most} tokens needs {-(-most // batch.block_size)} blocks "
            f"of {batch.block_size}; the graph runner's block table holds {width}"
        )
    lens = np.concatenate((lens, extra)).astype(np.int64)
    seqs = np.concatenate((seqs, extra)).astype(np.int64)
    table = torch.zeros((R, width), dtype=torch.int32)
    host_table = batch.host_block_table()
    cols = min(width, host_table.shape[1])
    table[: len(owner), :cols] = host_table[torch.from_numpy(owner), :cols]
    qsl = torch.zeros(R + 1, dtype=torch.int32)
    qsl[1:] = torch.from_numpy(np.cumsum(lens)).to(torch.int32)
    slots = torch.full((T,), -1, dtype=torch.int64)
    slots[:n] = batch.host_slot_mapping()[:n]
    return PaddedStep(
        query_start_loc=qsl,
        seq_lens=torch.from_numpy(seqs).to(torch.int32),
        block_table=table,
        slot_mapping=slots,
        num_real_tokens=n,
        max_query_len=int(lens.max()),
        max_seq_len=int(seqs.max()),
    )
