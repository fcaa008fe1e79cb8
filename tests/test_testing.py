"""attnhub.testing builds what every backend test relies on; these check that it does."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnhub import AttentionSpec, BatchMetadata, PagedKVCache, Tolerance, reference, testing
from attnhub.errors import InvalidInputError
from attnhub.spec import KV_CACHE_DTYPES
from attnhub.torch_backend import TorchBackend

F32, BF16 = torch.float32, torch.bfloat16
FORMATS = sorted(KV_CACHE_DTYPES)
LAYOUTS = ["NHD", "HND"]


def cache_of(kv: str, layout: str = "NHD", num_blocks: int = 6, block_size: int = 4):
    return PagedKVCache.allocate(
        num_blocks, block_size, 2, 8, BF16, layout=layout, kv_cache_dtype=kv
    )


def slot_view(cache: PagedKVCache, name: str) -> torch.Tensor:  # [num_slots, bytes] uint8
    if name in ("key", "value"):
        plane = cache.key_nhd() if name == "key" else cache.value_nhd()
    else:
        scale = cache.slot_scale_nhd(name)
        assert scale is not None
        plane = scale
    return plane.reshape(cache.num_slots, -1).contiguous().view(torch.uint8)


# --- seeds -------------------------------------------------------------------------------------


def test_generator_replays_the_same_stream_for_the_same_seed() -> None:
    a, b = testing.generator(7), testing.generator(7)
    assert torch.equal(torch.randn(5, generator=a), torch.randn(5, generator=b))
    assert not torch.equal(
        torch.randn(5, generator=a), torch.randn(5, generator=testing.generator(8))
    )


def test_seed_of_is_stable_across_processes() -> None:
    assert testing.seed_of("decode-bf16") == 442667919  # crc32, not the salted hash()
    assert testing.seed_of("decode-bf16") != testing.seed_of("decode-fp16")


# --- block tables --------------------------------------------------------------------------------


def test_num_blocks_for_counts_block_zero_spares_and_a_shared_prefix_once() -> None:
    assert testing.blocks_needed([1, 16, 17, 0], 16) == [1, 1, 2, 0]
    assert testing.num_blocks_for([1, 16, 17], 16) == 4 + 1 + 3
    assert testing.num_blocks_for([1, 16, 17], 16, spare=0) == 4 + 1
    assert testing.num_blocks_for([40, 50], 16, 3, shared_prefix_blocks=2) == 1 + 2 + 1 + 2 + 3


@settings(max_examples=60, deadline=None)
@given(
    seq_lens=st.lists(st.integers(0, 70), min_size=0, max_size=12),
    block_size=st.sampled_from([1, 4, 16]),
    spare=st.integers(0, 4),
    keep_last=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_shuffled_table_never_hands_out_block_zero_or_a_block_twice(
    seq_lens: list[int], block_size: int, spare: int, keep_last: bool, seed: int
) -> None:
    num_blocks = testing.num_blocks_for(seq_lens, block_size, spare + keep_last)
    table = testing.shuffled_block_table(
        seq_lens,
        block_size,
        num_blocks,
        testing.generator(seed),
        pad_value=-1,
        keep_last_block_free=keep_last,
    )
    needed = testing.blocks_needed(seq_lens, block_size)
    assert table.dtype == torch.int32 and table.shape == (len(seq_lens), max([*needed, 1]))
    used = [int(b) for r, n in enumerate(needed) for b in table[r, :n]]
    assert len(set(used)) == len(used), "a block was handed out twice"
    assert all(1 <= b < num_blocks - keep_last for b in used), used
    assert all((table[r, n:] == -1).all() for r, n in enumerate(needed))


def test_shuffled_table_is_not_in_order() -> None:
    seq_lens = [64] * 8
    table = testing.shuffled_block_table(seq_lens, 16, 40, testing.generator(0))
    used = table.flatten().tolist()
    assert used != sorted(used)


def test_shared_prefix_blocks_are_the_same_in_every_row_and_nowhere_else() -> None:
    seq_lens = [40, 70, 33]
    n = testing.num_blocks_for(seq_lens, 16, shared_prefix_blocks=2)
    table = testing.shuffled_block_table(
        seq_lens, 16, n, testing.generator(1), shared_prefix_blocks=2, extra_width=1
    )
    assert table.shape == (3, 5 + 1)
    assert (table[:, :2] == table[0, :2]).all()
    own = [int(b) for r, k in enumerate([3, 5, 3]) for b in table[r, 2:k]]
    assert len(set(own)) == len(own) and not set(own) & set(table[0, :2].tolist())


def test_shuffled_table_refuses_a_cache_too_small() -> None:
    with pytest.raises(ValueError, match=r"3 blocks needed .* 2 to hand out"):
        testing.shuffled_block_table([16, 32], 16, 3, testing.generator(0))
    with pytest.raises(ValueError, match="0 to hand out"):
        testing.shuffled_block_table([1], 16, 2, testing.generator(0), keep_last_block_free=True)


# --- batches ---------------------------------------------------------------------------------


def test_make_batch_maps_every_token_to_its_sequence_position() -> None:
    batch, num_blocks = testing.make_batch([1, 5], [20, 5], 4, seed=3, num_tokens=8)
    assert num_blocks == testing.num_blocks_for([20, 5], 4)
    table = batch.block_table.long()
    expected = [int(table[0, 19 // 4]) * 4 + 19 % 4]
    expected += [int(table[1, p // 4]) * 4 + p % 4 for p in range(5)]
    assert batch.slot_mapping.tolist() == [*expected, -1, -1]


def test_make_batch_is_reproducible_from_a_seed_and_advances_a_generator() -> None:
    a, _ = testing.make_batch([1, 1], [30, 40], 4, seed=5)
    b, _ = testing.make_batch([1, 1], [30, 40], 4, seed=5)
    assert torch.equal(a.block_table, b.block_table)
    g = testing.generator(5)
    first, _ = testing.make_batch([1, 1], [30, 40], 4, seed=g)
    second, _ = testing.make_batch([1, 1], [30, 40], 4, seed=g)
    assert torch.equal(first.block_table, a.block_table)
    assert not torch.equal(second.block_table, first.block_table)


def test_make_batch_validates_lengths_and_cache_size() -> None:
    with pytest.raises(InvalidInputError, match="seq_lens has 1"):
        testing.make_batch([1, 1], [5], 4)
    with pytest.raises(InvalidInputError):
        testing.make_batch([6], [5], 4)  # more new tokens than the sequence holds
    with pytest.raises(ValueError, match="blocks needed"):
        testing.make_batch([1], [40], 4, num_blocks=5)


def test_used_slots_lists_each_slot_of_the_sequences_once() -> None:
    table = torch.tensor([[3, 1, 0], [3, 1, 4]], dtype=torch.int32)  # a shared 2-block prefix
    batch = BatchMetadata.from_lengths([1, 2], [6, 10], table, 4)
    slots = testing.used_slots(batch).tolist()
    assert slots == [12, 13, 14, 15, 4, 5, 6, 7, 16, 17]  # request 1 adds 6, 7, 16, 17
    context = testing.used_slots(batch, context_only=True).tolist()
    assert context == [12, 13, 14, 15, 4, 5, 6, 7]  # 5, then 8 cached positions


# --- caches ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv", FORMATS)
def test_fill_cache_random_fills_every_plane_in_its_storage_dtype(kv: str, layout: str) -> None:
    cache = cache_of(kv, layout)
    dtypes = {name: plane.dtype for name, plane in cache.planes().items()}
    testing.fill_cache_random(cache, testing.generator(0))
    fmt = KV_CACHE_DTYPES[kv]
    for name, plane in cache.planes().items():
        assert plane.dtype == dtypes[name], name
        assert slot_view(cache, name).any(dim=1).all(), f"{name}: a slot was left zero"
        if plane.dtype == torch.int8:
            assert plane.min() >= -127 and plane.max() <= 127
    for which, want in zip(("key", "value"), testing.FP8_TEST_SCALES, strict=True):
        kind, scale = getattr(fmt, f"{which}_scale"), getattr(cache, f"{which}_scale")
        if kind == "tensor":
            assert torch.equal(scale, torch.tensor(want, dtype=torch.float32))
        elif kind in ("slot", "channel"):
            assert scale.min() > 0 and torch.isfinite(scale).all()
    key, value = reference.read_sequence(cache, torch.arange(cache.num_blocks), cache.num_slots)
    for x in (key, value):  # dequantized: finite values of about unit size
        assert torch.isfinite(x).all() and 0.3 < float(x.std()) < 5.0


def test_fp8_key_and_value_scales_differ() -> None:
    key_scale, value_scale = testing.FP8_TEST_SCALES
    assert key_scale != value_scale and 1.0 not in testing.FP8_TEST_SCALES


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "int8"])
def test_fill_cache_random_is_reproducible(kv: str) -> None:
    a, b = cache_of(kv), cache_of(kv)
    testing.fill_cache_random(a, testing.generator(4))
    testing.fill_cache_random(b, testing.generator(4))
    assert a.equal(b)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv", FORMATS)
def test_poison_unused_slots_leaves_used_slots_alone(kv: str, layout: str) -> None:
    batch, num_blocks = testing.make_batch([1, 3], [6, 3], 4, seed=2)
    cache = cache_of(kv, layout, num_blocks=num_blocks)
    testing.fill_cache_random(cache, testing.generator(1))
    before = cache.clone()
    testing.poison_unused_slots(cache, batch)
    used = torch.zeros(cache.num_slots, dtype=torch.bool)
    used[testing.used_slots(batch)] = True
    assert int(used.sum()) == 9
    for name in cache.planes():
        assert torch.equal(slot_view(cache, name)[used], slot_view(before, name)[used]), name
        plane = cache.key_nhd() if name == "key" else cache.value_nhd()
        if name.endswith("_scale"):
            scale = cache.slot_scale_nhd(name)
            assert scale is not None
            plane = scale
        stale = plane.reshape(cache.num_slots, -1)[~used]
        if plane.dtype == torch.int8:
            assert (stale == -128).all(), name
        else:
            assert stale.float().isnan().all(), name


# --- inputs ----------------------------------------------------------------------------------


def test_random_qkv_has_the_spec_shapes_and_dtype() -> None:
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=16, dtype=BF16)
    q, k, v = testing.random_qkv(spec, 5, testing.generator(0))
    assert q.shape == (5, 8, 16) and k.shape == v.shape == (5, 2, 16)
    assert q.dtype == k.dtype == v.dtype == BF16
    assert not torch.equal(k, v)
    loud, k2, _ = testing.random_qkv(spec, 5, testing.generator(0), q_gain=3.0)
    raw = torch.randn(5, 8, 16, generator=testing.generator(0))  # the query is drawn first
    assert torch.equal(q, raw.to(BF16)) and torch.equal(loud, (raw * 3).to(BF16))
    assert torch.equal(k2, k)


def test_alibi_slopes_follow_the_paper_for_any_head_count() -> None:
    assert testing.alibi_slopes(8).tolist() == [2.0 ** (-(i + 1)) for i in range(8)]
    twelve = [2.0 ** (-(i + 1)) for i in range(8)] + [2.0 ** (-0.5 - i) for i in range(4)]
    got = testing.alibi_slopes(12)
    assert got.dtype == F32 and torch.allclose(got, torch.tensor(twelve))


def test_random_sinks_are_one_per_head_around_the_mean() -> None:
    sinks = testing.random_sinks(4096, testing.generator(0), mean=0.5)
    assert sinks.shape == (4096,) and sinks.dtype == F32
    assert abs(float(sinks.mean()) - 0.5) < 0.1


# --- the reference --------------------------------------------------------------------------


def test_reference_after_write_writes_a_clone_and_attends_over_it() -> None:
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8, dtype=F32, block_size=4)
    batch, num_blocks = testing.make_batch([2, 1], [5, 9], 4, seed=0, num_tokens=4)
    cache = PagedKVCache.for_spec(spec, num_blocks, "cpu")
    testing.fill_cache_random(cache, testing.generator(1))
    before = cache.clone()
    q, k, v = testing.random_qkv(spec, batch.num_tokens, testing.generator(2))
    expected_cache, out = testing.reference_after_write(spec, cache, batch, q, k, v)
    assert cache.equal(before)
    assert expected_cache.equal(testing.cache_after_write(cache, k, v, batch.slot_mapping))
    assert not expected_cache.equal(cache)
    want, _ = reference.paged_attention(q, expected_cache, batch, spec)
    assert out.shape == (3, 4, 8) and torch.equal(out, want)
    unchanged, _ = testing.reference_after_write(spec, cache, batch, q, None, None)
    assert unchanged.equal(cache)


# --- comparing outputs ------------------------------------------------------------------------


def test_assert_within_passes_inside_the_tolerance() -> None:
    expected = torch.linspace(-2, 2, 60, dtype=torch.float64).reshape(5, 3, 4)
    testing.assert_within(expected + 0.009 + 0.01 * expected.abs(), expected, Tolerance(0.01, 0.01))


def test_assert_within_names_the_worst_position_and_by_how_much() -> None:
    batch = BatchMetadata.from_lengths([1, 3], [7, 3], [[1, 2], [3, 0]], 4)
    expected = torch.zeros(4, 2, 5, dtype=torch.float64)
    actual = expected.clone()
    actual[0, 0, 1] = 0.5
    actual[2, 1, 3] = 2.0
    with pytest.raises(AssertionError) as info:
        testing.assert_within(actual, expected, Tolerance(0.1, 0.0), "prefill", batch=batch)
    message = str(info.value)
    assert message.startswith("prefill: 2 of 40 elements outside atol=0.1")
    assert "worst at token 2 (request 1 (query_len 3, seq_len 3), query 1, position 1)" in message
    assert "head 1, channel 3: got 2, expected 0 (|diff| 2, allowed 0.1)" in message
    assert "requests with errors: [0, 1]" in message
    without_batch = testing.mismatch(actual, expected, Tolerance(0.1, 0.0))
    assert without_batch is not None and "worst at index [2, 1, 3]" in without_batch


def test_mismatch_fails_on_nan_and_on_a_wrong_shape() -> None:
    expected = torch.zeros(3, 2, dtype=torch.float64)
    actual = expected.clone()
    actual[1, 0] = float("nan")
    why = testing.mismatch(actual, expected, Tolerance(1.0, 1.0))
    assert why is not None and "worst at index [1, 0]: got nan" in why
    assert testing.mismatch(expected[:2], expected, Tolerance(1.0, 1.0)) == (
        "shape [2, 2], expected [3, 2]"
    )


# --- comparing caches ------------------------------------------------------------------------


def test_cache_differences_is_empty_for_a_faithful_write() -> None:
    cache = cache_of("auto")
    testing.fill_cache_random(cache, testing.generator(0))
    spec = AttentionSpec(num_heads=2, num_kv_heads=2, head_size=8, dtype=BF16, block_size=4)
    _, k, v = testing.random_qkv(spec, 3, testing.generator(1))
    slots = torch.tensor([5, -1, 9])
    expected = testing.cache_after_write(cache, k, v, slots)
    reference.write_kv(cache, k, v, slots)
    assert testing.cache_differences(cache, expected, slots) == []


def test_cache_differences_names_a_slot_that_must_not_change() -> None:
    cache = cache_of("auto")
    testing.fill_cache_random(cache, testing.generator(0))
    expected = cache.clone()
    cache.value_nhd()[2, 3] += 1  # slot 2 * 4 + 3 = 11
    cache.key_nhd()[-1, -1] += 1  # the last slot: where a padding slot -1 lands
    problems = testing.cache_differences(cache, expected, torch.tensor([4]))
    assert "value changed in slots this call must not write: 11 (block 2, offset 3)" in problems
    assert any("a padding slot -1 used as an index wraps to it" in p for p in problems)


def test_cache_differences_allows_one_quantization_step_in_written_slots() -> None:
    cache = cache_of("fp8_e4m3")
    testing.fill_cache_random(cache, testing.generator(0))
    expected = cache.clone()
    bits = cache.key_nhd()[1, 2].view(torch.uint8)
    bits.copy_(torch.where(bits & 0x7F < 0x7E, bits + 1, bits))  # one fp8 step up (not NaN)
    assert testing.cache_differences(cache, expected, torch.tensor([6])) == []
    cache.key_scale.mul_(2)
    assert "the engine-owned tensor key_scale was modified" in testing.cache_differences(
        cache, expected, torch.tensor([6])
    )


def test_cache_differences_allows_one_step_under_a_negative_fp8_scale() -> None:
    # Regression: the allowance was ``2**-mant * |want| + scale * tiny``, negative (nothing
    # allowed, every written slot flagged) under a negative scale, which round-trips and is served
    cache = cache_of("fp8_e4m3")
    testing.fill_cache_random(cache, testing.generator(0), fp8_scales=(-0.025, -0.02))
    expected = cache.clone()
    bits = cache.key_nhd()[1, 2].view(torch.uint8)
    bits.copy_(torch.where(bits & 0x7F < 0x7E, bits + 1, bits))  # one fp8 step up (not NaN)
    assert testing.cache_differences(cache, expected, torch.tensor([6])) == []


def test_cache_differences_flags_a_written_value_off_by_more_than_a_step() -> None:
    cache = cache_of("int8")
    testing.fill_cache_random(cache, testing.generator(0))
    expected = cache.clone()
    plane = cache.key_nhd()[1, 2]
    plane.copy_(torch.where(plane > 0, plane - 50, plane + 50))
    problems = testing.cache_differences(cache, expected, torch.tensor([6]))
    assert any(
        p.startswith("dequantized key differs") and "6 (block 1, offset 2)" in p for p in problems
    )


# --- the rounding-aware comparison the conformance suite applies --------------------------------


def _attention_pair(scale_error: float = 1.0, dtype: torch.dtype = torch.bfloat16):  # type: ignore[no-untyped-def]
    """One request's attention: (a backend-like result, exact f64, plain-dtype reference)."""
    g = testing.generator(7)
    q = torch.randn(64, 4, 64, generator=g).to(dtype)
    k = torch.randn(256, 2, 64, generator=g).to(dtype)
    v = torch.randn(256, 2, 64, generator=g).to(dtype)
    s = 64**-0.5
    exact, _ = reference.attention(q, k, v, scale=s)
    rounded, _ = reference.attention(q, k, v, scale=s, compute_dtype=dtype)
    # a careful backend: float32 math, rounded once to the model dtype
    got, _ = reference.attention(q, k, v, scale=s * scale_error, compute_dtype=torch.float32)
    return got.to(dtype), exact, rounded


def test_rounding_check_accepts_a_careful_low_precision_result() -> None:
    got, exact, rounded = _attention_pair()
    assert testing.rounding_mismatch(got, exact, rounded, torch.bfloat16) is None


def test_rounding_check_catches_a_softmax_scale_one_percent_off_in_bf16() -> None:
    got, exact, rounded = _attention_pair(scale_error=1.01)
    tol = TorchBackend.capabilities.tolerances[torch.bfloat16]
    assert testing.mismatch(got, exact, tol) is None  # the elementwise bound cannot see it
    why = testing.rounding_mismatch(got, exact, rounded, torch.bfloat16)
    assert why is not None and "more than rounding explains" in why


def test_rounding_check_catches_a_small_error_everywhere() -> None:
    got, exact, rounded = _attention_pair()
    shifted = (got.double() + 4e-3 * exact.sign()).to(torch.bfloat16)
    assert testing.rounding_mismatch(shifted, exact, rounded, torch.bfloat16) is not None


def test_declared_tolerances_are_capped_per_dtype() -> None:
    cap = testing.TOLERANCE_CAPS[torch.bfloat16]
    assert testing.capped_tolerance(Tolerance(1e-3, 1e-3), torch.bfloat16) == Tolerance(1e-3, 1e-3)
    assert testing.capped_tolerance(cap, torch.bfloat16) == cap
    assert testing.capped_tolerance(Tolerance(1.0, 1.0), torch.bfloat16) is None
    assert testing.capped_tolerance(Tolerance(cap.atol, 2 * cap.rtol), torch.bfloat16) is None
