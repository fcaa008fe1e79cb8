"""Which rank of a context-parallel group holds which token of a request (vLLM's decode context
parallel, DCP), and each rank's view of a step: its sequence lengths, slot mapping and table.

``N`` ranks, interleave ``I`` (vLLM's ``cp_kv_cache_interleave_size``; ``I`` divides the
per-rank block size ``B``). Token ``t`` of a request lives on rank ``(t // I) % N``: runs of
``I`` tokens dealt round-robin. The engine allocates *virtual* blocks of ``N * B`` tokens, one
block id per virtual block in the step's table; rank ``r`` keeps its ``B`` tokens of virtual
block ``v`` in its own cache's block ``table[v]``. So every rank reads the same block table, and
a rank's tokens of a request, in order, are the positions ``0 .. local_len - 1`` of an ordinary
paged sequence of block size ``B``: global position ``t`` is local position
``(t // (N * I)) * I + t % I``.

Everything here is host arithmetic on the step's host copies (numpy), done once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from attnhub.batch import BatchMetadata
from attnhub.errors import InvalidInputError

IntArray = np.ndarray | torch.Tensor | Sequence[int]
IntTable = np.ndarray | torch.Tensor | Sequence[Sequence[int]]


def check_layout(world_size: object, rank: object, block_size: object, interleave: object) -> None:
    """The group layout itself: positive ints, ``0 <= rank < world_size``, ``interleave``
    dividing ``block_size``. Raises InvalidInputError naming the bad value."""
    for name, value in (
        ("world_size", world_size),
        ("block_size", block_size),
        ("interleave", interleave),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidInputError(f"{name} = {value!r} must be a positive int")
    assert isinstance(world_size, int) and isinstance(block_size, int)
    assert isinstance(interleave, int)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidInputError(f"rank = {rank!r} must be an int in 0..{world_size - 1}")
    if block_size % interleave:
        raise InvalidInputError(
            f"interleave = {interleave} does not divide block_size = {block_size}: a run of "
            "interleaved tokens must not straddle a rank's blocks"
        )


def _ints(values: IntArray | IntTable) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise InvalidInputError(
                f"context-parallel sharding reads host data; got a tensor on {values.device}"
            )
        values = values.numpy()
    a = np.asarray(values)
    if a.size == 0:
        return a.astype(np.int64)
    if not np.issubdtype(a.dtype, np.integer):
        raise InvalidInputError(f"expected integers, got dtype {a.dtype}")
    return a.astype(np.int64)


def token_rank(positions: IntArray, world_size: int, interleave: int = 1) -> np.ndarray:
    """The rank that holds each position: ``(t // I) % N``. Returns int64 like ``positions``."""
    t = _ints(positions)
    return (t // interleave) % world_size


def local_positions(positions: IntArray, world_size: int, interleave: int = 1) -> np.ndarray:
    """Each position's place in its owner's local sequence: ``(t // (N*I)) * I + t % I``."""
    t = _ints(positions)
    return (t // (world_size * interleave)) * interleave + t % interleave


def local_seq_lens(
    seq_lens: IntArray, world_size: int, rank: int, interleave: int = 1
) -> np.ndarray:
    """How many of the first ``seq_len`` tokens of each request ``rank`` holds (vLLM's
    ``get_dcp_local_seq_lens``): every full round of ``N * I`` tokens gives each rank ``I``;
    of the last partial round, rank ``r`` gets ``clip(rest - r * I, 0, I)``. Int64."""
    s = _ints(seq_lens)
    base = s // interleave // world_size * interleave
    rest = s - base * world_size
    return base + np.clip(rest - rank * interleave, 0, interleave)


def local_slot_mapping(
    positions: IntArray,  # [num_tokens]; a negative entry is a padding row
    token_request: IntArray,  # [num_tokens]: each token's request (row of block_table)
    block_table: IntTable,  # [num_reqs, max_blocks]: one block id per virtual block
    block_size: int,  # B, the per-rank block size
    world_size: int,
    rank: int,
    interleave: int = 1,
) -> np.ndarray:  # [num_tokens] int64
    """The cache slot on ``rank`` of each token, or -1 where the token is another rank's or
    the row is padding (a negative position): the KV write skips it. The slot of a local
    token is ``table[req, t // (N*B)] * B + local_position(t) % B``."""
    t = _ints(positions)
    req = _ints(token_request)
    table = _ints(block_table)
    if table.ndim != 2:
        raise InvalidInputError(f"block_table must be 2-D, got shape {table.shape}")
    if t.shape != req.shape:
        raise InvalidInputError(
            f"positions has shape {t.shape} and token_request {req.shape}: one each per token"
        )
    out = np.full(t.shape, -1, dtype=np.int64)
    mine = (t >= 0) & (token_rank(np.maximum(t, 0), world_size, interleave) == rank)
    if not mine.any():
        return out
    tm, rm = t[mine], req[mine]
    if rm.min() < 0 or rm.max() >= table.shape[0]:
        bad = int(rm[(rm < 0) | (rm >= table.shape[0])][0])
        raise InvalidInputError(
            f"token_request holds request {bad}, the block table has {table.shape[0]} rows"
        )
    virtual = tm // (world_size * block_size)
    if virtual.max() >= table.shape[1]:
        i = int(np.argmax(virtual >= table.shape[1]))
        raise InvalidInputError(
            f"position {int(tm[i])} of request {int(rm[i])} is in virtual block {int(virtual[i])}"
            f" (of {world_size} x {block_size} tokens), the block table has {table.shape[1]}"
        )
    local = local_positions(tm, world_size, interleave)
    out[mine] = table[rm, virtual] * block_size + local % block_size
    return out


@dataclass(frozen=True)
class ContextShard:
    """One rank's view of a step whose KV cache is sharded over a context-parallel group.

    Every rank attends for every query token of the step (the query is gathered over the
    group's heads), over its own keys only. vLLM's split of a step (the DCP path of its GQA
    backends): the keys cached *before* the step (``context_lens``, sharded) are seen by every query
    row, so a rank attends over them without a causal mask; the step's new tokens attend to one
    another causally on every rank alike (their keys and values are in hand); the two parts
    merge by their LSEs. ``seq_lens`` (the rank's keys once this step's are written) serves a
    decode-only step, where the one query token sees every key.

    Host tensors; ``query_start_loc`` and ``block_table`` are the step's own (the same on every
    rank).
    """

    world_size: int
    rank: int
    interleave: int
    block_size: int  # B: the per-rank block size (the step's virtual blocks hold N * B)
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, the step's
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, the step's
    seq_lens: torch.Tensor  # [num_reqs] int32: this rank's keys after the step's write
    context_lens: torch.Tensor  # [num_reqs] int32: this rank's keys before the step
    slot_mapping: torch.Tensor  # [num_tokens] int64: -1 = another rank's token, or padding

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def max_context_len(self) -> int:
        """The longest local context (host value; 0 for a step without context)."""
        return int(self.context_lens.max()) if self.num_reqs else 0

    def empty_context_rows(self) -> torch.Tensor:  # [num_tokens] bool, host
        """Rows whose request has no key of this rank's context, and padding rows: their
        partial result is empty, whatever a kernel returns for them (the merge ignores it)."""
        qsl = self.query_start_loc.long()
        qlens = qsl[1:] - qsl[:-1]
        empty = torch.ones(self.num_tokens, dtype=torch.bool)
        total = int(qsl[-1]) if self.num_reqs else 0
        empty[:total] = torch.repeat_interleave(self.context_lens == 0, qlens)
        return empty


def shard_step(
    batch: BatchMetadata,
    *,
    world_size: int,
    rank: int,
    block_size: int,
    interleave: int = 1,
) -> ContextShard:
    """``rank``'s share of ``batch``, a step as the engine schedules it: lengths of whole
    requests and a table of virtual blocks, so ``batch.block_size`` is ``world_size *
    block_size``. Raises InvalidInputError naming a bad value (``interleave`` not dividing
    ``block_size``, a batch whose block size is not the virtual one)."""
    check_layout(world_size, rank, block_size, interleave)
    if not isinstance(batch, BatchMetadata):
        raise InvalidInputError(f"batch must be a BatchMetadata, got {type(batch).__name__}")
    virtual = world_size * block_size
    if batch.block_size != virtual:
        raise InvalidInputError(
            f"batch.block_size = {batch.block_size}, but a context-parallel step's table holds "
            f"virtual blocks of world_size x block_size = {world_size} x {block_size} = "
            f"{virtual} tokens"
        )
    batch.validate()
    qsl = batch.query_start_loc_cpu.to(torch.int32)
    seq = batch.seq_lens_cpu.numpy().astype(np.int64)
    qlens = (qsl[1:] - qsl[:-1]).numpy().astype(np.int64)
    ctx = seq - qlens
    table = batch.host_block_table().to(torch.int32)
    # positions of the step's tokens (context_len .. seq_len - 1 of each request), padding -1
    req = np.repeat(np.arange(batch.num_reqs), qlens)
    starts = np.repeat(qsl[:-1].numpy().astype(np.int64), qlens)
    pos = np.full(batch.num_tokens, -1, dtype=np.int64)
    pos[: req.size] = ctx[req] + np.arange(req.size) - starts
    token_req = np.zeros(batch.num_tokens, dtype=np.int64)
    token_req[: req.size] = req
    slots = local_slot_mapping(
        pos, token_req, table.numpy(), block_size, world_size, rank, interleave
    )
    return ContextShard(
        world_size=world_size,
        rank=rank,
        interleave=interleave,
        block_size=block_size,
        query_start_loc=qsl.clone(),
        block_table=table.clone(),
        seq_lens=torch.from_numpy(local_seq_lens(seq, world_size, rank, interleave)).int(),
        context_lens=torch.from_numpy(local_seq_lens(ctx, world_size, rank, interleave)).int(),
        slot_mapping=torch.from_numpy(slots),
    )
