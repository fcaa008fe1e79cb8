"""Which rank holds which token, and a rank's view of a step, against a plain Python oracle
(one loop over positions: no formula shared with the code under test)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnhub import BatchMetadata
from attnhub.context_parallel import (
    local_positions,
    local_seq_lens,
    local_slot_mapping,
    prefill_chunks,
    shard_prefill,
    shard_step,
    token_rank,
)
from attnhub.errors import InvalidInputError
from attnhub.testing import generator, num_blocks_for, shuffled_block_table


def owner(t: int, n: int, interleave: int) -> int:
    """Runs of ``interleave`` tokens dealt to the ranks in turn."""
    return (t // interleave) % n


def oracle_tokens(seq_len: int, n: int, rank: int, interleave: int) -> list[int]:
    """The positions of a request that ``rank`` holds, in order."""
    return [t for t in range(seq_len) if owner(t, n, interleave) == rank]


def oracle_slot(t: int, row: list[int], n: int, rank: int, interleave: int, bs: int) -> int:
    """A rank keeps its tokens of a request as an ordinary paged sequence of block size
    ``bs`` whose k-th block is the table's k-th entry; another rank's token is -1."""
    if owner(t, n, interleave) != rank:
        return -1
    local = len(oracle_tokens(t, n, rank, interleave))  # the rank's tokens before t
    return row[local // bs] * bs + local % bs


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, int, int]:
    """(world_size, block_size, interleave): interleave divides block_size."""
    n = draw(st.integers(1, 5))
    bs = draw(st.sampled_from([1, 2, 4, 8, 16]))
    interleave = draw(st.sampled_from([i for i in (1, 2, 4, 8, 16) if bs % i == 0]))
    return n, bs, interleave


@settings(max_examples=200, deadline=None)
@given(layout=layouts(), seq_lens=st.lists(st.integers(0, 300), min_size=1, max_size=6))
def test_local_seq_lens_count_the_tokens_each_rank_holds(
    layout: tuple[int, int, int], seq_lens: list[int]
) -> None:
    n, _, interleave = layout
    for rank in range(n):
        got = local_seq_lens(seq_lens, n, rank, interleave).tolist()
        assert got == [len(oracle_tokens(s, n, rank, interleave)) for s in seq_lens]


@settings(max_examples=100, deadline=None)
@given(layout=layouts(), seq_len=st.integers(1, 200))
def test_a_rank_holds_its_tokens_in_order_at_consecutive_local_positions(
    layout: tuple[int, int, int], seq_len: int
) -> None:
    n, _, interleave = layout
    t = torch.arange(seq_len)
    owners, local = token_rank(t, n, interleave), local_positions(t, n, interleave)
    for rank in range(n):
        assert local[owners == rank].tolist() == list(range(int((owners == rank).sum())))


@settings(max_examples=150, deadline=None)
@given(
    layout=layouts(),
    lengths=st.lists(
        st.integers(1, 90).flatmap(lambda s: st.tuples(st.integers(1, s), st.just(s))),
        min_size=1,
        max_size=5,
    ),
    padding=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_shard_step_matches_the_oracle(
    layout: tuple[int, int, int], lengths: list[tuple[int, int]], padding: int, seed: int
) -> None:
    n, bs, interleave = layout
    query_lens = [q for q, _ in lengths]
    seq_lens = [s for _, s in lengths]
    virtual = n * bs
    table = shuffled_block_table(
        seq_lens, virtual, num_blocks_for(seq_lens, virtual), generator(seed)
    )
    batch = BatchMetadata.from_lengths(
        query_lens, seq_lens, table, virtual, num_tokens=sum(query_lens) + padding
    )
    every_rank_slots = []
    for rank in range(n):
        shard = shard_step(batch, world_size=n, rank=rank, block_size=bs, interleave=interleave)
        want_slots = [
            oracle_slot(t, table[r].tolist(), n, rank, interleave, bs)
            for r, (q, s) in enumerate(lengths)
            for t in range(s - q, s)
        ] + [-1] * padding
        assert shard.slot_mapping.tolist() == want_slots
        assert shard.seq_lens.tolist() == [len(oracle_tokens(s, n, rank, interleave))
                                           for s in seq_lens]  # fmt: skip
        assert shard.context_lens.tolist() == [
            len(oracle_tokens(s - q, n, rank, interleave)) for q, s in lengths
        ]
        assert torch.equal(shard.block_table, table)
        assert torch.equal(shard.query_start_loc, batch.query_start_loc_cpu)
        empty = [shard.context_lens[r] == 0 for r, (q, _) in enumerate(lengths) for _ in range(q)]
        assert shard.empty_context_rows().tolist() == empty + [True] * padding
        every_rank_slots.append(shard.slot_mapping)
    # each token of the step is written by exactly one rank
    written = (torch.stack(every_rank_slots)[:, : sum(query_lens)] >= 0).sum(dim=0)
    assert written.tolist() == [1] * sum(query_lens)


def test_local_slot_mapping_skips_padding_rows() -> None:
    table = torch.tensor([[7, 3]])
    slots = local_slot_mapping([-1, 0, 1, -1], [0, 0, 0, 0], table, 2, 2, 0, 1)
    assert slots.tolist() == [-1, 14, -1, -1]


def test_an_interleave_that_does_not_divide_the_block_size_is_refused() -> None:
    batch = BatchMetadata.from_lengths([1], [5], [[1]], 8)
    with pytest.raises(InvalidInputError, match="interleave = 3 does not divide block_size = 4"):
        shard_step(batch, world_size=2, rank=0, block_size=4, interleave=3)


def test_a_batch_whose_blocks_are_not_the_virtual_ones_is_refused() -> None:
    batch = BatchMetadata.from_lengths([1], [5], [[1, 2]], 4)
    with pytest.raises(InvalidInputError, match=r"batch.block_size = 4, .* 2 x 4 = 8 tokens"):
        shard_step(batch, world_size=2, rank=0, block_size=4)


@pytest.mark.parametrize(
    ("world_size", "rank", "match"),
    [(0, 0, "world_size = 0"), (2, 2, "rank = 2 must be an int in 0..1"), (2, -1, "rank = -1")],
)
def test_a_bad_group_layout_is_refused(world_size: int, rank: int, match: str) -> None:
    batch = BatchMetadata.from_lengths([1], [5], [[1]], 8)
    with pytest.raises(InvalidInputError, match=match):
        shard_step(batch, world_size=world_size, rank=rank, block_size=4)


def test_a_position_past_the_table_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="position 16 of request 0 is in virtual block 2"):
        local_slot_mapping([16], [0], [[1, 2]], 4, 2, 0, 1)


# --- prefill context parallel ----------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    world_size=st.integers(1, 6),
    query_lens=st.lists(st.integers(1, 120), min_size=1, max_size=6),
)
def test_prefill_chunks_cover_every_prefill_row_once_and_every_decode_on_every_rank(
    world_size: int, query_lens: list[int]
) -> None:
    held: dict[tuple[int, int], list[int]] = {}
    for rank in range(world_size):
        chunks = prefill_chunks(query_lens, world_size, rank)
        prefills = [c for c in chunks if query_lens[c[0]] > 1]
        assert len(prefills) <= 2 * len(query_lens)  # a head and a tail chunk per prefill
        for r, off, n in chunks:
            for i in range(off, off + n):
                held.setdefault((r, i), []).append(rank)
    for r, q in enumerate(query_lens):
        for i in range(q):
            want = list(range(world_size)) if q == 1 else held[(r, i)][:1]
            assert held[(r, i)] == want and len(want) >= 1


def test_rank_r_takes_chunks_r_and_2n_minus_1_minus_r() -> None:
    # 4 ranks, 16 tokens: 8 chunks of 2
    assert prefill_chunks([16], 4, 0) == [(0, 0, 2), (0, 14, 2)]
    assert prefill_chunks([16], 4, 3) == [(0, 6, 2), (0, 8, 2)]
    assert prefill_chunks([1, 16], 4, 1) == [(0, 0, 1), (1, 2, 2), (1, 12, 2)]


def test_prefill_shard_batch_ends_each_chunk_where_the_chunk_ends() -> None:
    batch = BatchMetadata.from_lengths([1, 8], [6, 20], [[1, 2], [3, 4, 5]], 8)
    shard = shard_prefill(batch, world_size=2, rank=1)
    # request 1: context 12, chunks of 2; rank 1 takes offsets 2..3 and 4..5
    assert shard.token_rows.tolist() == [0, 3, 4, 5, 6]
    assert shard.batch.query_lens_cpu.tolist() == [1, 2, 2]
    assert shard.batch.seq_lens_cpu.tolist() == [6, 16, 18]
    assert shard.batch.slot_mapping.tolist() == [-1] * 5
    assert shard.rank_tokens == (5, 5)


def test_prefill_context_parallel_refuses_a_non_causal_step() -> None:
    batch = BatchMetadata.from_lengths([4], [4], [[1]], 8, causal=False)
    with pytest.raises(InvalidInputError, match="causal steps only"):
        shard_prefill(batch, world_size=2, rank=0)
