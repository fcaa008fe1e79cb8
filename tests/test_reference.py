"""Hand-checked conventions of the float64 reference (the oracle every backend is held to).

Many tests use one-hot values (value of key j = e_j), so the output of a query *is* its
attention weights over the key positions and visibility can be read off directly.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnhub import PagedKVCache, reference
from attnhub.quant import dequantize_fp8, dequantize_int8, quantize_fp8, quantize_int8

F64 = torch.float64


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def one_hot_values(seq_len: int, num_kv_heads: int = 1) -> torch.Tensor:
    """[seq_len, num_kv_heads, seq_len]: the value of key j is e_j."""
    return torch.eye(seq_len, dtype=F64)[:, None, :].expand(seq_len, num_kv_heads, seq_len)


def weights(
    q_len: int, seq_len: int, *, num_heads: int = 2, num_kv_heads: int = 1, seed: int = 0, **kw
) -> torch.Tensor:  # [q_len, num_heads, seq_len]: attention weight of each query on each key
    q = rand(q_len, num_heads, seq_len, seed=seed)
    k = rand(seq_len, num_kv_heads, seq_len, seed=seed + 1)
    out, _ = reference.attention(
        q, k, one_hot_values(seq_len, num_kv_heads), scale=seq_len**-0.5, **kw
    )
    return out


def visible_keys(w: torch.Tensor, i: int, h: int = 0) -> list[int]:
    return (w[i, h] > 0).nonzero()[:, 0].tolist()


# --- visibility ---------------------------------------------------------------------------


def test_chunked_prefill_query_sees_keys_up_to_its_own_position() -> None:
    # 2 new tokens after 3 cached ones: positions 3 and 4 (bottom-right alignment).
    w = weights(2, 5, causal=True)
    for h in range(2):
        assert visible_keys(w, 0, h) == [0, 1, 2, 3]
        assert visible_keys(w, 1, h) == [0, 1, 2, 3, 4]
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, dtype=F64))


def test_decode_query_sees_every_cached_key() -> None:
    w = weights(1, 6, causal=True)
    assert visible_keys(w, 0) == list(range(6))


@pytest.mark.parametrize("W", [1, 2, 3, 5])
def test_causal_sliding_window_shows_exactly_w_keys(W: int) -> None:
    w = weights(3, 8, causal=True, window=(W - 1, 0))
    for i in range(3):
        p = 5 + i
        assert visible_keys(w, i) == list(range(p - W + 1, p + 1))


def test_non_causal_window_is_symmetric_around_the_query() -> None:
    # encoder: window (2, 2) around position p, clipped to the sequence
    w = weights(6, 6, causal=False, window=(2, 2))
    for p in range(6):
        assert visible_keys(w, p) == list(range(max(0, p - 2), min(6, p + 3)))


def test_non_causal_query_sees_every_key_of_its_sequence() -> None:
    w = weights(3, 7, causal=False)
    for i in range(3):
        assert visible_keys(w, i) == list(range(7))


def test_causal_flag_ignores_right_side_of_window() -> None:
    a = weights(3, 6, causal=True, window=(2, 2))
    b = weights(3, 6, causal=True, window=(2, 0))
    torch.testing.assert_close(a, b, atol=0, rtol=0)


# --- GQA ----------------------------------------------------------------------------------


def test_gqa_query_head_h_reads_kv_head_h_div_group() -> None:
    # values of kv head g are all e_g, so the output of query head h is e_{h // group}
    H, Hkv, L = 8, 2, 5
    q = rand(2, H, 4, seed=1)
    k = rand(L, Hkv, 4, seed=2)
    v = torch.zeros(L, Hkv, Hkv, dtype=F64)
    v[:, 0, 0] = 1
    v[:, 1, 1] = 1
    out, _ = reference.attention(q, k, v, scale=0.5)
    expected = torch.eye(Hkv, dtype=F64)[torch.arange(H) // (H // Hkv)].expand(2, H, Hkv)
    torch.testing.assert_close(out, expected)


def test_gqa_equals_one_head_at_a_time_with_the_shared_kv_head() -> None:
    H, Hkv, L = 4, 2, 6
    q, k, v = rand(3, H, 8, seed=3), rand(L, Hkv, 8, seed=4), rand(L, Hkv, 8, seed=5)
    out, lse = reference.attention(q, k, v, scale=0.3)
    for h in range(H):
        g = h // (H // Hkv)
        o1, l1 = reference.attention(q[:, h : h + 1], k[:, g : g + 1], v[:, g : g + 1], scale=0.3)
        torch.testing.assert_close(out[:, h : h + 1], o1)
        torch.testing.assert_close(lse[h : h + 1], l1)


# --- scores: LSE, softcap, ALiBi, sinks -------------------------------------------------


def hand_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """[H, q_len, seq_len] scale * q.k with bottom-right causal masking, one kv head per head."""
    q_len, seq_len = q.shape[0], k.shape[0]
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    for i in range(q_len):
        s[:, i, seq_len - q_len + i + 1 :] = -math.inf
    return s


def test_lse_is_natural_log_of_the_softmax_denominator() -> None:
    q, k, v = rand(3, 2, 4, seed=6), rand(5, 2, 4, seed=7), rand(5, 2, 4, seed=8)
    _, lse = reference.attention(q, k, v, scale=0.7)
    torch.testing.assert_close(lse, torch.logsumexp(hand_scores(q, k, 0.7), dim=-1))


def test_output_is_softmax_weighted_sum_of_values() -> None:
    q, k, v = rand(3, 2, 4, seed=9), rand(5, 2, 4, seed=10), rand(5, 2, 4, seed=11)
    out, _ = reference.attention(q, k, v, scale=0.7)
    p = torch.softmax(hand_scores(q, k, 0.7), dim=-1)
    torch.testing.assert_close(out, torch.einsum("hij,jhd->ihd", p, v))


def test_softcap_bounds_every_score_by_the_cap() -> None:
    # huge queries: uncapped scores would be ~100; capped ones stay within +-cap, so the
    # LSE is at most cap + log(seq_len) and the weights spread accordingly
    cap, L = 2.0, 6
    q = rand(2, 1, 8, seed=12) * 50
    k = rand(L, 1, 8, seed=13)
    _, lse_capped = reference.attention(q, k, one_hot_values(L), scale=1.0, logits_soft_cap=cap)
    _, lse_plain = reference.attention(q, k, one_hot_values(L), scale=1.0)
    assert (lse_capped <= cap + math.log(L)).all()
    assert (lse_plain > cap + math.log(L)).any()


def test_softcap_is_cap_times_tanh_of_scaled_score() -> None:
    cap = 1.5
    q, k = rand(2, 1, 4, seed=14) * 4, rand(4, 1, 4, seed=15)
    w, lse = reference.attention(q, k, one_hot_values(4), scale=0.5, logits_soft_cap=cap)
    s = hand_scores(q, k, 0.5)
    s = cap * torch.tanh(s / cap)  # tanh(-inf) = -1: re-mask
    s[:, 0, 3] = -math.inf
    torch.testing.assert_close(w.permute(1, 0, 2), torch.softmax(s, dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=-1))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non_causal"])
def test_alibi_bias_is_minus_slope_times_distance(causal: bool) -> None:
    # zero queries: every raw score is 0, so the weights are softmax(-slope * |pos(i) - j|)
    L, q_len = 6, 2
    slopes = torch.tensor([0.5, 0.25], dtype=F64)
    q = torch.zeros(q_len, 2, 4, dtype=F64)
    k = rand(L, 2, 4, seed=16)
    w, _ = reference.attention(
        q, k, one_hot_values(L, 2), scale=1.0, causal=causal, alibi_slopes=slopes
    )
    for i in range(q_len):
        p = L - q_len + i
        for h in range(2):
            js = torch.arange(p + 1 if causal else L, dtype=F64)
            bias = torch.exp(-slopes[h] * (p - js).abs())
            expected = torch.zeros(L, dtype=F64)
            expected[: js.numel()] = bias / bias.sum()
            torch.testing.assert_close(w[i, h], expected)


def test_sinks_lower_the_total_weight_by_the_sink_share() -> None:
    L = 5
    q, k = rand(2, 2, 4, seed=17), rand(L, 1, 4, seed=18)
    sinks = torch.tensor([0.3, -1.0], dtype=F64)
    _, lse_plain = reference.attention(q, k, one_hot_values(L), scale=0.5)
    w, lse = reference.attention(q, k, one_hot_values(L), scale=0.5, sinks=sinks)
    # the sink logit joins the denominator as is (not multiplied by scale)
    share = torch.exp(lse_plain) / (torch.exp(lse_plain) + torch.exp(sinks)[:, None])  # [H, q]
    torch.testing.assert_close(w.sum(-1), share.T)
    assert (w.sum(-1) < 1).all()
    torch.testing.assert_close(lse, torch.logaddexp(lse_plain, sinks[:, None].expand_as(lse)))


def test_sinks_carry_no_value() -> None:
    # with a sink the output is the sink-free output scaled down: no value joins it
    L = 5
    q, k, v = rand(2, 2, 4, seed=19), rand(L, 1, 4, seed=20), rand(L, 1, 4, seed=21)
    sinks = torch.tensor([0.3, 2.0], dtype=F64)
    out_plain, lse_plain = reference.attention(q, k, v, scale=0.5)
    out, lse = reference.attention(q, k, v, scale=0.5, sinks=sinks)
    torch.testing.assert_close(out, out_plain * torch.exp(lse_plain - lse).T[..., None])


# --- LSE merge ----------------------------------------------------------------------------


def test_merge_with_an_empty_part_returns_the_other_part() -> None:
    a_out, a_lse = rand(3, 2, 4, seed=22), rand(2, 3, seed=23)
    empty_lse = torch.full((2, 3), math.inf, dtype=F64)
    out, lse = reference.merge_attn_states(a_out, a_lse, torch.zeros(3, 2, 4, dtype=F64), empty_lse)
    torch.testing.assert_close(out, a_out)
    torch.testing.assert_close(lse, a_lse)
    out, lse = reference.merge_attn_states(torch.zeros(3, 2, 4, dtype=F64), empty_lse, a_out, a_lse)
    torch.testing.assert_close(out, a_out)
    torch.testing.assert_close(lse, a_lse)


def test_merge_of_two_empty_parts_is_zero_output_and_inf_lse() -> None:
    inf = torch.full((2, 3), math.inf, dtype=F64)
    out, lse = reference.merge_attn_states(rand(3, 2, 4, seed=24), inf, rand(3, 2, 4, seed=25), inf)
    assert torch.equal(out, torch.zeros(3, 2, 4, dtype=F64))
    assert torch.isposinf(lse).all()


def test_merge_of_disjoint_key_halves_equals_attention_over_the_union() -> None:
    q, k, v = rand(2, 2, 4, seed=26), rand(7, 2, 4, seed=27), rand(7, 2, 4, seed=28)
    a = reference.attention(q, k[:3], v[:3], scale=0.5, causal=False)
    b = reference.attention(q, k[3:], v[3:], scale=0.5, causal=False)
    out, lse = reference.merge_attn_states(*a, *b)
    full_out, full_lse = reference.attention(q, k, v, scale=0.5, causal=False)
    torch.testing.assert_close(out, full_out)
    torch.testing.assert_close(lse, full_lse)


def test_merge_of_shared_prefix_and_causal_suffix_equals_causal_attention() -> None:
    # cascade attention: a prefix every query sees in full, then a causal suffix
    q, k, v = rand(3, 2, 4, seed=29), rand(8, 1, 4, seed=30), rand(8, 1, 4, seed=31)
    prefix = reference.attention(q, k[:4], v[:4], scale=0.5, causal=False)
    suffix = reference.attention(q, k[4:], v[4:], scale=0.5, causal=True)
    out, lse = reference.merge_attn_states(*prefix, *suffix)
    full_out, full_lse = reference.attention(q, k, v, scale=0.5, causal=True)
    torch.testing.assert_close(out, full_out)
    torch.testing.assert_close(lse, full_lse)


# --- quantization helpers -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "fmax"),
    [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)],
    ids=["e4m3", "e5m2"],
)
def test_fp8_quantization_saturates_at_the_largest_finite_value(
    dtype: torch.dtype, fmax: float
) -> None:
    x = torch.tensor([1e6, -1e6, 1.0, 0.0])
    q = quantize_fp8(x, 1.0, dtype)
    assert q.dtype == dtype
    assert q.float().tolist() == [fmax, -fmax, 1.0, 0.0]


def test_fp8_e4m3_saturates_at_448_after_dividing_by_the_scale() -> None:
    x = torch.tensor([1000.0, -1000.0, 2.0])
    q = quantize_fp8(x, torch.tensor(2.0))  # 500 -> 448, 1.0 stays
    assert q.float().tolist() == [448.0, -448.0, 1.0]
    assert dequantize_fp8(q, torch.tensor(2.0)).tolist() == [896.0, -896.0, 2.0]


def test_int8_scale_is_symmetric_amax_over_127() -> None:
    x = torch.tensor([[-127.0, 64.0, 1.0, 0.0], [0.5, -63.5, 0.0, 0.0]])
    q, scale = reference.quantize_int8_dynamic(x, dim=-1)
    assert scale.shape == (2, 1)
    torch.testing.assert_close(scale, torch.tensor([[1.0], [0.5]]))
    assert q.dtype == torch.int8
    assert q.tolist() == [[-127, 64, 1, 0], [1, -127, 0, 0]]
    torch.testing.assert_close(dequantize_int8(q, scale), x)


def test_int8_quantization_rounds_and_clamps_to_the_int8_range() -> None:
    x = torch.tensor([300.0, -300.0, 2.4, 2.6, -1.4])
    assert quantize_int8(x, torch.tensor(1.0)).tolist() == [127, -128, 2, 3, -1]


def test_int8_of_all_zero_input_gives_zero_scale_and_zeros() -> None:
    q, scale = reference.quantize_int8_dynamic(torch.zeros(3, 8), dim=-1)
    assert torch.equal(scale, torch.zeros(3, 1))
    assert torch.equal(q, torch.zeros(3, 8, dtype=torch.int8))
    assert torch.equal(dequantize_int8(q, scale), torch.zeros(3, 8))


# --- write_kv / read_sequence ---------------------------------------------------------------


def _sequence_slots(table_row: torch.Tensor, seq_len: int, bs: int) -> torch.Tensor:
    pos = torch.arange(seq_len)
    return table_row.long()[pos // bs] * bs + pos % bs


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_write_kv_then_read_sequence_round_trips_model_dtype(layout: str) -> None:
    bs, L = 4, 10
    cache = PagedKVCache.allocate(8, bs, 2, 8, torch.float32, layout=layout)
    row = torch.tensor([5, 2, 7], dtype=torch.int32)
    k, v = rand(L, 2, 8, seed=32).float(), rand(L, 2, 8, seed=33).float()
    reference.write_kv(cache, k, v, _sequence_slots(row, L, bs))
    k2, v2 = reference.read_sequence(cache, row, L)
    assert k2.dtype == F64
    torch.testing.assert_close(k2, k.double(), atol=0, rtol=0)
    torch.testing.assert_close(v2, v.double(), atol=0, rtol=0)


def test_write_kv_skips_padding_slots() -> None:
    bs = 4
    cache = PagedKVCache.allocate(4, bs, 1, 2, torch.float32)
    k = torch.arange(1, 9, dtype=torch.float32).reshape(4, 1, 2)
    slots = torch.tensor([5, -1, 6, -1])
    reference.write_kv(cache, k, -k, slots)
    flat_k = cache.key.reshape(16, 1, 2)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[6], k[2])
    written = torch.zeros(16, dtype=torch.bool)
    written[[5, 6]] = True
    assert (flat_k[~written] == 0).all()
    assert (cache.value.reshape(16, 1, 2)[~written] == 0).all()


def test_write_kv_fp8_stores_quantized_values_and_read_dequantizes() -> None:
    cache = PagedKVCache.allocate(4, 4, 2, 8, torch.bfloat16, kv_cache_dtype="fp8_e4m3")
    cache.key_scale.fill_(0.25)
    cache.value_scale.fill_(0.5)
    row = torch.tensor([3, 1], dtype=torch.int32)
    k, v = rand(6, 2, 8, seed=34).bfloat16(), rand(6, 2, 8, seed=35).bfloat16()
    reference.write_kv(cache, k, v, _sequence_slots(row, 6, 4))
    k2, v2 = reference.read_sequence(cache, row, 6)
    expected_k = dequantize_fp8(quantize_fp8(k, 0.25), 0.25, F64)
    expected_v = dequantize_fp8(quantize_fp8(v, 0.5), 0.5, F64)
    torch.testing.assert_close(k2, expected_k, atol=0, rtol=0)
    torch.testing.assert_close(v2, expected_v, atol=0, rtol=0)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int8_k"])
def test_write_kv_int8_uses_per_slot_key_scales(layout: str, kv_cache_dtype: str) -> None:
    cache = PagedKVCache.allocate(
        4, 4, 2, 8, torch.float16, layout=layout, kv_cache_dtype=kv_cache_dtype
    )
    if cache.value_scale is not None:  # int8: static per-channel value scale
        cache.value_scale.fill_(0.05)
    row = torch.tensor([2, 3], dtype=torch.int32)
    k, v = rand(7, 2, 8, seed=36).half(), rand(7, 2, 8, seed=37).half()
    reference.write_kv(cache, k, v, _sequence_slots(row, 7, 4))
    k2, v2 = reference.read_sequence(cache, row, 7)
    # keys: scale = amax / 127 per (token, kv head), so the error is at most half a step
    step = k.double().abs().amax(-1, keepdim=True) / 127
    assert ((k2 - k.double()).abs() <= step / 2 + 1e-6).all()
    assert (k2.abs().amax(-1) > 0).all()
    if kv_cache_dtype == "int8":
        expected_v = quantize_int8(v, torch.full((2, 8), 0.05)).double() * 0.05
        torch.testing.assert_close(v2, expected_v.double(), rtol=0, atol=1e-7)
    else:
        torch.testing.assert_close(v2, v.double(), atol=0, rtol=0)


@pytest.mark.parametrize(
    "features",
    [
        {},
        {"sliding_window": 13},
        {"logits_soft_cap": 2.0, "use_alibi": True, "use_sinks": True},
    ],
    ids=["plain", "window", "softcap_alibi_sinks"],
)
@pytest.mark.parametrize("causal", [True, False])
def test_paged_attention_chunked_equals_paged_attention(features: dict, causal: bool) -> None:
    """Per head, and (causal) in query-row chunks of a few rows: the same outputs and LSEs."""
    from attnhub import AttentionSpec, testing
    from attnhub.spec import AttentionType

    spec = AttentionSpec(
        num_heads=4,
        num_kv_heads=2,
        head_size=16,
        dtype=torch.float32,
        block_size=8,
        attn_type=AttentionType.DECODER if causal else AttentionType.ENCODER_ONLY,
        **features,
    )
    g = testing.generator(7)
    q_lens, seq_lens = ([1, 9, 23, 5], [40, 9, 61, 5]) if causal else ([9, 23], [9, 23])
    batch, num_blocks = testing.make_batch(q_lens, seq_lens, block_size=8, seed=g)
    cache = PagedKVCache.for_spec(spec, num_blocks, "cpu")
    testing.fill_cache_random(cache, g)
    q = torch.randn(batch.num_tokens, 4, 16, generator=g)
    slopes = testing.alibi_slopes(4) if spec.use_alibi else None
    sinks = testing.random_sinks(4, g) if spec.use_sinks else None
    want = reference.paged_attention(q, cache, batch, spec, alibi_slopes=slopes, sinks=sinks)
    got = reference.paged_attention_chunked(
        q, cache, batch, spec, alibi_slopes=slopes, sinks=sinks, max_scores=70
    )
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)
