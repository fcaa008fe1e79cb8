"""BatchMetadata construction and validation, and the batch helpers engines use."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnhub import (
    AttentionSpec,
    BatchMetadata,
    make_local_attention_virtual_batches,
    reference,
    reorder_decodes_first,
    split_decodes_and_prefills,
)
from attnhub.errors import InvalidInputError
from attnhub.testing import assert_within, fill_cache_random, generator, make_batch, random_qkv
from attnhub.torch_backend import TorchBackend

# A small batch checked by hand (block_size 4):
#   request 0: 1 new token after 4 cached -> position 4, block_table[0][1] = 2 -> slot 2*4+0 = 8
#   request 1: 3 new tokens, no context   -> positions 0..2 in block 5        -> slots 20, 21, 22
#   request 2: 2 new tokens after 7       -> position 7: block 8, offset 3    -> slot 35
#                                            position 8: block 3, offset 0    -> slot 12
HAND_QUERY_LENS = [1, 3, 2]
HAND_SEQ_LENS = [5, 3, 9]
HAND_TABLE = [[7, 2], [5], [1, 8, 3]]
HAND_SLOTS = [8, 20, 21, 22, 35, 12]


def hand_batch(block_table: object = HAND_TABLE, **kw: object) -> BatchMetadata:
    return BatchMetadata.from_lengths(HAND_QUERY_LENS, HAND_SEQ_LENS, block_table, 4, **kw)  # type: ignore[arg-type]


# --- from_lengths -------------------------------------------------------------------------


def test_from_lengths_computes_query_start_loc_as_cumulative_query_lens() -> None:
    b = hand_batch()
    assert b.query_start_loc.tolist() == [0, 1, 4, 6]
    assert b.query_start_loc_cpu.tolist() == [0, 1, 4, 6]
    assert b.num_reqs == 3
    assert b.num_actual_tokens == 6


def test_from_lengths_keeps_seq_lens_and_host_copies() -> None:
    b = hand_batch()
    assert b.seq_lens.tolist() == HAND_SEQ_LENS
    assert b.seq_lens_cpu.tolist() == HAND_SEQ_LENS
    assert b.query_start_loc_cpu.device.type == "cpu"
    assert b.seq_lens_cpu.device.type == "cpu"


def test_from_lengths_uses_int32_lengths_and_table_and_int64_slots() -> None:
    b = hand_batch()
    assert b.query_start_loc.dtype == torch.int32
    assert b.query_start_loc_cpu.dtype == torch.int32
    assert b.seq_lens.dtype == torch.int32
    assert b.seq_lens_cpu.dtype == torch.int32
    assert b.block_table.dtype == torch.int32
    assert b.slot_mapping.dtype == torch.int64


def test_from_lengths_refuses_a_negative_int32_sequence_length_exactly() -> None:
    """Regression: seq_lens - query_lens was taken in int32, where -2**31 - 1 wraps to
    2**31 - 1 (a context that looked >= 0): an IndexError followed. Lengths are compared in
    int64."""
    with pytest.raises(InvalidInputError, match=r"seq_lens\[0\] = -2147483648 is less than"):
        BatchMetadata.from_lengths(
            torch.tensor([1], dtype=torch.int32), torch.tensor([-(2**31)], dtype=torch.int32),
            [[0]], 16,
        )  # fmt: skip


def test_from_lengths_slot_mapping_follows_block_table_and_positions() -> None:
    assert hand_batch().slot_mapping.tolist() == HAND_SLOTS


def test_from_lengths_pads_ragged_block_table_rows() -> None:
    b = hand_batch()
    assert b.block_table.shape == (3, 3)
    assert b.block_table[:, :1].flatten().tolist() == [7, 5, 1]


def test_from_lengths_accepts_an_int64_tensor_block_table() -> None:
    table = torch.tensor([[7, 2, 0], [5, 0, 0], [1, 8, 3]], dtype=torch.int64)
    b = BatchMetadata.from_lengths(HAND_QUERY_LENS, HAND_SEQ_LENS, table, 4)
    assert b.block_table.dtype == torch.int32
    assert b.slot_mapping.tolist() == HAND_SLOTS


def test_from_lengths_accepts_any_value_past_each_requests_blocks() -> None:
    table = [[7, 2, -1], [5, -1, 99], [1, 8, 3]]
    assert hand_batch(block_table=table).slot_mapping.tolist() == HAND_SLOTS


def test_from_lengths_pads_slot_mapping_to_num_tokens_with_minus_one() -> None:
    b = hand_batch(num_tokens=9)
    assert b.slot_mapping.tolist() == [*HAND_SLOTS, -1, -1, -1]
    assert b.num_tokens == 9
    assert b.num_actual_tokens == 6


def test_from_lengths_reports_max_lengths() -> None:
    b = hand_batch()
    assert (b.max_query_len, b.max_seq_len) == (3, 9)


def test_derived_query_and_context_lens() -> None:
    b = hand_batch()
    assert b.query_lens_cpu.tolist() == HAND_QUERY_LENS
    assert b.context_lens_cpu.tolist() == [4, 0, 7]


def test_from_lengths_defaults_to_causal_and_records_non_causal() -> None:
    assert hand_batch().causal
    assert not hand_batch(causal=False).causal


def test_from_lengths_builds_a_batch_that_validates() -> None:
    hand_batch(num_tokens=8).validate()


def test_from_lengths_of_no_requests_is_empty() -> None:
    b = BatchMetadata.from_lengths([], [], [], 16)
    assert (b.num_reqs, b.num_actual_tokens, b.max_query_len, b.max_seq_len) == (0, 0, 0, 0)
    assert b.query_start_loc.tolist() == [0]
    b.validate()


# --- invalid batches ----------------------------------------------------------------------

BAD_FROM_LENGTHS = [
    pytest.param({"query_lens": [1, 0, 2]}, "query_lens[1] = 0", id="query_len_zero"),
    pytest.param({"query_lens": [1, 3, -2]}, "query_lens[2] = -2", id="query_len_negative"),
    pytest.param(
        {"seq_lens": [5, 2, 9]},
        "seq_lens[1] = 2 is less than query_lens[1] = 3",
        id="seq_len_below_query_len",
    ),
    pytest.param({"seq_lens": [5, 3, 13]}, "request 2 has seq_len 13", id="block_table_too_narrow"),
    pytest.param({"seq_lens": [5, 3]}, "seq_lens has 2", id="mismatched_lengths"),
    pytest.param({"block_table": [[7, 2], [5]]}, "got shape (2, 2)", id="block_table_missing_row"),
    pytest.param({"block_table": torch.ones(3, 3)}, "torch.float32", id="block_table_float"),
    pytest.param(
        {"block_table": [[7, -1], [5], [1, 8, 3]]},
        "block_table[0, 1] = -1 is negative",
        id="block_table_negative_in_use",
    ),
    pytest.param({"query_lens": [1.0, 3.0, 2.0]}, "torch.float32", id="query_lens_float"),
    pytest.param({"seq_lens": [[5, 3, 9]]}, "(1, 3)", id="seq_lens_2d"),
    pytest.param({"block_size": 0}, "block_size = 0", id="block_size_zero"),
    pytest.param({"block_size": True}, "block_size = True", id="block_size_bool"),
    pytest.param({"num_tokens": 5}, "num_tokens = 5", id="num_tokens_too_small"),
]


@pytest.mark.parametrize(("override", "named"), BAD_FROM_LENGTHS)
def test_invalid_lengths_raise_invalid_input_error_naming_the_value(
    override: dict[str, object], named: str
) -> None:
    args: dict[str, object] = {
        "query_lens": HAND_QUERY_LENS,
        "seq_lens": HAND_SEQ_LENS,
        "block_table": HAND_TABLE,
        "block_size": 4,
    }
    args.update(override)
    with pytest.raises(InvalidInputError) as info:
        BatchMetadata.from_lengths(**args)  # type: ignore[arg-type]
    assert named in str(info.value)


def edited(**changes: object) -> BatchMetadata:
    return dataclasses.replace(hand_batch(), **changes)  # type: ignore[arg-type]


BAD_EDITS = [
    pytest.param(
        {"query_start_loc_cpu": torch.tensor([0, 4, 1, 6], dtype=torch.int32)},
        "query_start_loc[1] = 4, query_start_loc[2] = 1",
        id="query_start_loc_not_monotone",
    ),
    pytest.param(
        {"query_start_loc_cpu": torch.tensor([0, 1, 1, 6], dtype=torch.int32)},
        "query_start_loc[1] = 1, query_start_loc[2] = 1",
        id="query_start_loc_flat",
    ),
    pytest.param(
        {"query_start_loc_cpu": torch.tensor([1, 2, 4, 6], dtype=torch.int32)},
        "query_start_loc[0] = 1",
        id="query_start_loc_not_from_zero",
    ),
    pytest.param(
        {"query_start_loc_cpu": torch.tensor([0, 1, 6], dtype=torch.int32)},
        "num_reqs + 1 = 4",
        id="query_start_loc_wrong_length",
    ),
    # the device tensors are read by kernels: a regression (only the host copies' lengths were
    # checked, so a short device query_start_loc or seq_lens reached the kernels)
    pytest.param(
        {"query_start_loc": torch.tensor([0, 1, 4], dtype=torch.int32)},
        "query_start_loc (the device tensor) must have num_reqs + 1 = 4 entries",
        id="device_query_start_loc_short",
    ),
    pytest.param(
        {"seq_lens": torch.tensor([[5, 3, 9]], dtype=torch.int32)},
        "seq_lens (the device tensor) must have num_reqs = 3 entries, got shape (1, 3)",
        id="device_seq_lens_2d",
    ),
    pytest.param({"num_actual_tokens": 7}, "num_actual_tokens = 7", id="num_actual_tokens_wrong"),
    pytest.param({"max_query_len": 2}, "max_query_len = 2", id="max_query_len_wrong"),
    pytest.param({"max_seq_len": 5}, "max_seq_len = 5", id="max_seq_len_wrong"),
    pytest.param(
        {"seq_lens_cpu": torch.tensor([5, 2, 9], dtype=torch.int32)},
        "seq_lens[1] = 2",
        id="seq_len_below_query_len",
    ),
    pytest.param(
        {"slot_mapping": torch.zeros(4, dtype=torch.int64)}, "needs at least 6", id="slots_short"
    ),
    pytest.param(
        {"slot_mapping": torch.zeros(6, dtype=torch.float32)},
        "torch.float32",
        id="slots_float",
    ),
    pytest.param(
        {"block_table": torch.zeros(3, 2, dtype=torch.int32)},
        "block_table has 2 blocks per request",
        id="block_table_too_narrow",
    ),
    pytest.param(
        {"seq_lens": torch.tensor([5, 3, 9], dtype=torch.int32, device="meta")},
        "meta",
        id="seq_lens_other_device",
    ),
]


@pytest.mark.parametrize(("changes", "named"), BAD_EDITS)
def test_validate_rejects_an_inconsistent_batch_naming_the_value(
    changes: dict[str, object], named: str
) -> None:
    with pytest.raises(InvalidInputError) as info:
        edited(**changes).validate()
    assert named in str(info.value)


# --- split / reorder ------------------------------------------------------------------------


def lens_batch(query_lens: list[int], seq_lens: list[int], **kw: object) -> BatchMetadata:
    batch, _ = make_batch(query_lens, seq_lens, 4, seed=7, **kw)  # type: ignore[arg-type]
    return batch


def test_split_counts_decodes_then_prefills() -> None:
    s = split_decodes_and_prefills(lens_batch([1, 1, 4, 7], [9, 3, 4, 20]))
    assert (s.num_decodes, s.num_prefills) == (2, 2)
    assert (s.num_decode_tokens, s.num_prefill_tokens) == (2, 11)


def test_split_threshold_makes_short_queries_decodes() -> None:
    s = split_decodes_and_prefills(lens_batch([1, 2, 2, 5], [9, 3, 4, 20]), decode_threshold=2)
    assert (s.num_decodes, s.num_prefills, s.num_decode_tokens, s.num_prefill_tokens) == (
        3,
        1,
        5,
        5,
    )


def test_split_of_all_decodes_and_all_prefills() -> None:
    d = split_decodes_and_prefills(lens_batch([1, 1], [5, 6]))
    assert (d.num_decodes, d.num_prefills, d.num_prefill_tokens) == (2, 0, 0)
    p = split_decodes_and_prefills(lens_batch([3, 2], [5, 6]))
    assert (p.num_decodes, p.num_prefills, p.num_decode_tokens) == (0, 2, 0)


def test_split_rejects_a_decode_after_a_prefill() -> None:
    with pytest.raises(InvalidInputError, match="request 2"):
        split_decodes_and_prefills(lens_batch([1, 4, 1], [5, 6, 7]))


REORDER_Q = [4, 1, 3, 1, 1]
REORDER_S = [10, 6, 3, 9, 2]


def test_reorder_puts_decodes_first_keeping_relative_order() -> None:
    batch, order = reorder_decodes_first(lens_batch(REORDER_Q, REORDER_S))
    assert order.request_order.tolist() == [1, 3, 4, 0, 2]
    assert batch.query_lens_cpu.tolist() == [1, 1, 1, 4, 3]
    assert batch.seq_lens_cpu.tolist() == [6, 9, 2, 10, 3]
    s = split_decodes_and_prefills(batch)
    assert (s.num_decodes, s.num_prefills) == (3, 2)


def test_reorder_moves_block_table_rows_with_their_requests() -> None:
    old = lens_batch(REORDER_Q, REORDER_S)
    new, order = reorder_decodes_first(old)
    assert torch.equal(new.block_table, old.block_table[order.request_order])


def test_reorder_of_a_decodes_first_batch_is_the_identity() -> None:
    old = lens_batch([1, 1, 3], [4, 5, 6])
    new, order = reorder_decodes_first(old)
    assert order.request_order.tolist() == [0, 1, 2]
    assert order.token_order.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(new.slot_mapping, old.slot_mapping)


def test_reorder_token_order_gives_each_request_its_own_rows() -> None:
    old = lens_batch(REORDER_Q, REORDER_S, num_tokens=13)
    new, order = reorder_decodes_first(old)
    # row t of q is labelled with (request, offset in request); padding rows with (-1, t)
    labels = [(r, i) for r, n in enumerate(REORDER_Q) for i in range(n)]
    labels += [(-1, t) for t in range(old.num_actual_tokens, old.num_tokens)]
    q = torch.tensor(labels)
    q_new = q[order.token_order]
    qsl = new.query_start_loc_cpu.tolist()
    for i, r_old in enumerate(order.request_order.tolist()):
        rows = q_new[qsl[i] : qsl[i + 1]]
        assert rows.tolist() == [[r_old, j] for j in range(REORDER_Q[r_old])]
    assert q_new[new.num_actual_tokens :].tolist() == q[old.num_actual_tokens :].tolist()


def test_reorder_slot_mapping_follows_token_order() -> None:
    old = lens_batch(REORDER_Q, REORDER_S, num_tokens=12)
    new, order = reorder_decodes_first(old)
    assert torch.equal(new.slot_mapping, old.slot_mapping[order.token_order])
    assert new.slot_mapping[-1].item() == -1
    new.validate()


def test_reorder_inverse_token_order_undoes_it() -> None:
    old = lens_batch(REORDER_Q, REORDER_S, num_tokens=12)
    _, order = reorder_decodes_first(old)
    x = torch.randn(12, 3, generator=generator(1))
    assert torch.equal(x[order.token_order][order.inverse_token_order], x)


def test_reorder_with_threshold_counts_short_queries_as_decodes() -> None:
    _, order = reorder_decodes_first(lens_batch([4, 2, 3, 1], [9, 8, 7, 6]), decode_threshold=3)
    assert order.request_order.tolist() == [1, 2, 3, 0]


def test_attention_on_a_reordered_batch_matches_the_original_order() -> None:
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float32, block_size=4
    )
    old, nblk = make_batch(REORDER_Q, REORDER_S, 4, seed=3)
    new, order = reorder_decodes_first(old)
    backend = TorchBackend(spec, "cpu")
    q, k, v = random_qkv(spec, old.num_tokens, generator(4))
    outs = []
    for batch, perm in ((old, None), (new, order.token_order)):
        cache = backend.allocate_kv_cache(nblk)
        fill_cache_random(cache, generator(5))
        meta = backend.metadata_builder().build(batch)
        args = (q, k, v) if perm is None else (q[perm], k[perm], v[perm])
        outs.append(backend.impl().forward(*args, cache, meta))
    tol = TorchBackend.capabilities.tolerance(spec.dtype)
    assert_within(outs[1][order.inverse_token_order], outs[0].double(), tol, "reordered")


# --- local attention virtual batches -------------------------------------------------------


def test_virtual_batches_split_each_request_at_chunk_boundaries() -> None:
    # chunk 4, block 2: request 0 has 5 new tokens at positions 6..10 -> chunks [4, 8) and
    # [8, 12): virtual requests (query 2, seq 4) and (query 3, seq 3); request 1 is a decode at
    # position 2 -> one virtual request (query 1, seq 3)
    table = [[11, 12, 13, 14, 15, 16], [21, 22]]
    batch = BatchMetadata.from_lengths([5, 1], [11, 3], table, 2)
    v = make_local_attention_virtual_batches(batch, 4)
    assert v.num_reqs == 3
    assert v.query_lens_cpu.tolist() == [2, 3, 1]
    assert v.seq_lens_cpu.tolist() == [4, 3, 3]
    assert v.block_table.tolist() == [[13, 14], [15, 16], [21, 22]]
    assert torch.equal(v.slot_mapping, batch.slot_mapping)
    assert v.num_actual_tokens == batch.num_actual_tokens
    v.validate()


@pytest.mark.parametrize("chunk", [0, 3, -4], ids=lambda c: f"chunk{c}")
def test_virtual_batches_reject_chunk_not_multiple_of_block_size(chunk: int) -> None:
    batch = BatchMetadata.from_lengths([1], [3], [[1]], 4)
    with pytest.raises(InvalidInputError, match=f"attn_chunk_size = {chunk}"):
        make_local_attention_virtual_batches(batch, chunk)


def local_attention_expected(
    spec: AttentionSpec, q: torch.Tensor, cache: object, batch: BatchMetadata, chunk: int
) -> torch.Tensor:
    """Each query at position p sees keys floor(p / chunk) * chunk .. p: one query at a time."""
    rows = []
    qsl = batch.query_start_loc_cpu.tolist()
    for r in range(batch.num_reqs):
        seq_len = int(batch.seq_lens_cpu[r])
        k_all, v_all = reference.read_sequence(cache, batch.block_table[r], seq_len)  # type: ignore[arg-type]
        ctx = seq_len - (qsl[r + 1] - qsl[r])
        for i, t in enumerate(range(qsl[r], qsl[r + 1])):
            p = ctx + i
            start = (p // chunk) * chunk
            out, _ = reference.attention(
                q[t : t + 1], k_all[start : p + 1], v_all[start : p + 1], scale=spec.scale
            )
            rows.append(out)
    return torch.cat(rows)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "block_size", "chunk"),
    [
        ([5, 1], [11, 3], 2, 4),
        ([1, 1, 1], [16, 17, 33], 4, 8),
        ([20, 3, 1], [20, 40, 9], 4, 8),
        ([12], [30], 16, 16),
    ],
    ids=["straddle", "decodes_at_boundaries", "mixed", "block_equals_chunk"],
)
def test_torch_backend_on_virtual_batches_computes_local_attention(
    query_lens: list[int], seq_lens: list[int], block_size: int, chunk: int
) -> None:
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float32, block_size=block_size
    )
    batch, nblk = make_batch(query_lens, seq_lens, block_size, seed=11)
    backend = TorchBackend(spec, "cpu")
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(12))
    q, k, v = random_qkv(spec, batch.num_tokens, generator(13))
    expected_cache = cache.clone()
    reference.write_kv(expected_cache, k, v, batch.slot_mapping)
    expected = local_attention_expected(spec, q, expected_cache, batch, chunk)

    virtual = make_local_attention_virtual_batches(batch, chunk)
    out = backend.impl().forward(q, k, v, cache, backend.metadata_builder().build(virtual))
    assert cache.equal(expected_cache)
    assert_within(out, expected, TorchBackend.capabilities.tolerance(spec.dtype), "local attn")


# --- properties over random batches --------------------------------------------------------------


@st.composite
def lengths(draw: st.DrawFn) -> tuple[list[int], list[int], int]:
    n = draw(st.integers(1, 8))
    q = draw(st.lists(st.integers(1, 9), min_size=n, max_size=n))
    ctx = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    return q, [a + b for a, b in zip(q, ctx, strict=True)], bs


@settings(max_examples=60, deadline=None)
@given(lengths(), st.integers(0, 2**16))
def test_slot_mapping_matches_a_token_by_token_computation(
    lens: tuple[list[int], list[int], int], seed: int
) -> None:
    q, s, bs = lens
    batch, _ = make_batch(q, s, bs, seed=seed)
    table = batch.block_table.tolist()
    expected = [
        table[r][p // bs] * bs + p % bs for r in range(len(q)) for p in range(s[r] - q[r], s[r])
    ]
    assert batch.slot_mapping.tolist() == expected
    assert len(set(expected)) == len(expected)  # distinct blocks: no two tokens share a slot
    batch.validate()


@settings(max_examples=60, deadline=None)
@given(lengths(), st.integers(1, 4))
def test_reorder_keeps_every_requests_lengths_and_slots(
    lens: tuple[list[int], list[int], int], threshold: int
) -> None:
    q, s, bs = lens
    old, _ = make_batch(q, s, bs, seed=1)
    new, order = reorder_decodes_first(old, decode_threshold=threshold)
    new.validate()
    split = split_decodes_and_prefills(new, decode_threshold=threshold)  # does not raise
    assert split.num_decodes == sum(x <= threshold for x in q)
    old_qsl, new_qsl = old.query_start_loc_cpu.tolist(), new.query_start_loc_cpu.tolist()
    for i, r in enumerate(order.request_order.tolist()):
        assert int(new.seq_lens_cpu[i]) == s[r]
        assert (
            new.slot_mapping[new_qsl[i] : new_qsl[i + 1]].tolist()
            == old.slot_mapping[old_qsl[r] : old_qsl[r + 1]].tolist()
        )
    decode_flags = [q[r] <= threshold for r in order.request_order.tolist()]
    assert decode_flags == sorted(decode_flags, reverse=True)
    for flag in (True, False):  # stable: relative order kept within decodes and prefills
        kept = [r for r in order.request_order.tolist() if (q[r] <= threshold) == flag]
        assert kept == sorted(kept)


@settings(max_examples=15, deadline=None)
@given(lengths(), st.integers(1, 4), st.integers(0, 2**16))
def test_virtual_batches_compute_local_attention_on_random_batches(
    lens: tuple[list[int], list[int], int], blocks_per_chunk: int, seed: int
) -> None:
    q_lens, s_lens, bs = lens
    chunk = bs * blocks_per_chunk
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float32, block_size=bs
    )
    batch, nblk = make_batch(q_lens, s_lens, bs, seed=seed)
    backend = TorchBackend(spec, "cpu")
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(seed + 1))
    q, k, v = random_qkv(spec, batch.num_tokens, generator(seed + 2))
    expected_cache = cache.clone()
    reference.write_kv(expected_cache, k, v, batch.slot_mapping)
    expected = local_attention_expected(spec, q, expected_cache, batch, chunk)

    virtual = make_local_attention_virtual_batches(batch, chunk)
    virtual.validate()
    out = backend.impl().forward(q, k, v, cache, backend.metadata_builder().build(virtual))
    assert_within(out, expected, TorchBackend.capabilities.tolerance(spec.dtype), "local attn")


def test_as_contiguous_is_the_tensor_itself_when_it_already_is():
    from attnhub.batch import as_contiguous

    t = torch.arange(6, dtype=torch.int32).view(2, 3)
    assert as_contiguous(t) is t
    wide = t.long()
    assert as_contiguous(wide).dtype == torch.int32 and as_contiguous(wide).equal(t)
    strided = t.t()
    made = as_contiguous(strided)
    assert made.is_contiguous() and made.equal(strided) and made.data_ptr() != t.data_ptr()
    assert as_contiguous(wide, torch.int64) is wide
    assert as_contiguous(t, torch.int64).dtype == torch.int64
