"""A value head size other than the key head size (``AttentionSpec.head_size_v``): what MLA's
expanded prefill needs (keys 192, values 128 in DeepSeek). Spec, cache, KV write, reference,
capabilities and the torch backend's every path."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from attnhub import (
    AttentionSpec,
    Capabilities,
    HeadSizeVSupport,
    PagedKVCache,
    reference,
)
from attnhub.cli import main
from attnhub.errors import (
    InvalidInputError,
    InvalidSpecError,
    UnknownNameError,
    UnsupportedConfigurationError,
)
from attnhub.quant import calibrate_kv_scales
from attnhub.testing import (
    assert_within,
    fill_cache_random,
    generator,
    make_batch,
    random_qkv,
    random_sinks,
    reference_after_write,
)
from attnhub.torch_backend import TorchBackend

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
#: MLA's expanded prefill in DeepSeek: keys 192 wide, values 128.
MLA = dict(num_heads=8, num_kv_heads=2, head_size=192, head_size_v=128, block_size=16)


def tol(dtype: torch.dtype):  # type: ignore[no-untyped-def]
    return TorchBackend.capabilities.tolerance(dtype)


# --- the spec ------------------------------------------------------------------------------------
def test_head_size_v_defaults_to_head_size() -> None:
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64)
    assert spec.head_size_v == 64 and not spec.distinct_head_size_v


def test_the_default_scale_stays_the_key_head_sizes() -> None:
    spec = AttentionSpec(**MLA)
    assert spec.head_size_v == 128 and spec.distinct_head_size_v
    assert spec.scale == 192**-0.5


@pytest.mark.parametrize("bad", [0, -128, 1.5, True, "128"])
def test_a_bad_head_size_v_is_a_typed_error_naming_it(bad: object) -> None:
    with pytest.raises(InvalidSpecError, match=rf"head_size_v = {re.escape(repr(bad))}"):
        AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, head_size_v=bad)  # type: ignore[arg-type]


def test_replace_keeps_head_size_v_unless_asked_to_follow() -> None:
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64)
    assert dataclasses.replace(spec, head_size=128).head_size_v == 64
    assert dataclasses.replace(spec, head_size=128, head_size_v=None).head_size_v == 128


# --- the cache -----------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_the_value_plane_has_the_value_head_size(layout: str) -> None:
    cache = PagedKVCache.for_spec(AttentionSpec(**MLA), 5, "cpu", layout=layout)
    lead = (5, 16, 2) if layout == "NHD" else (5, 2, 16)
    assert cache.key.shape == (*lead, 192) and cache.value.shape == (*lead, 128)
    assert (cache.head_size, cache.head_size_v) == (192, 128)


def test_quantized_planes_get_scales_of_their_own_width() -> None:
    int8 = PagedKVCache.for_spec(AttentionSpec(**MLA, kv_cache_dtype="int8"), 3, "cpu")
    assert int8.key_scale is not None and int8.value_scale is not None
    assert int8.key_scale.shape == (3, 16, 2)  # per written (token, kv head)
    assert int8.value_scale.shape == (2, 128)  # static per (kv head, value channel)
    fp8 = PagedKVCache.for_spec(AttentionSpec(**MLA, kv_cache_dtype="fp8"), 3, "cpu")
    assert fp8.key_scale is not None and fp8.key_scale.shape == ()
    assert fp8.value_scale is not None and fp8.value_scale.shape == ()


def test_calibrated_int8_value_scales_are_value_head_size_wide() -> None:
    g = generator(1)
    keys, values = torch.randn(9, 2, 192, generator=g), torch.randn(9, 2, 128, generator=g)
    key_scale, value_scale = calibrate_kv_scales("int8", keys, values)
    assert key_scale is None and value_scale is not None and value_scale.shape == (2, 128)


def test_allocate_refuses_a_bad_head_size_v() -> None:
    with pytest.raises(InvalidInputError, match="head_size_v = 0"):
        PagedKVCache.allocate(2, 16, 2, 64, F32, head_size_v=0)


def test_swap_blocks_refuses_a_cache_of_another_value_head_size() -> None:
    src = PagedKVCache.allocate(2, 16, 2, 64, F32, head_size_v=32)
    dst = PagedKVCache.allocate(2, 16, 2, 64, F32)
    before = dst.clone()
    with pytest.raises(InvalidInputError, match=r"\(16, 2, 32\)"):
        src.swap_blocks(dst, [(0, 1)])
    assert dst.equal(before)


def test_a_side_by_side_allocation_holds_both_widths() -> None:
    """vLLM-style: one tensor with a slot's key then value in the last dim; the planes are its
    two column ranges and a write lands in each at its own width."""
    spec = AttentionSpec(**MLA, dtype=F32)
    both = torch.zeros(4, 16, 2, 192 + 128)
    cache = PagedKVCache(both[..., :192], both[..., 192:], block_size=16)
    backend = TorchBackend(spec)
    k, v = torch.randn(3, 2, 192), torch.randn(3, 2, 128)
    backend.impl().write_kv(k, v, cache, torch.tensor([5, 17, 40]))
    assert torch.equal(both.view(64, 2, 320)[17, :, :192], k[1])
    assert torch.equal(both.view(64, 2, 320)[17, :, 192:], v[1])


# --- the reference -------------------------------------------------------------------------------
def test_reference_output_is_value_head_size_wide_and_matches_plain_attention() -> None:
    """Golden: an independent float64 computation (torch's SDPA math on expanded heads)."""
    g = generator(2)
    q, k = torch.randn(5, 8, 48, generator=g), torch.randn(9, 2, 48, generator=g)
    v = torch.randn(9, 2, 24, generator=g)
    out, lse = reference.attention(q.double(), k.double(), v.double(), scale=0.2)
    assert out.shape == (5, 8, 24) and lse.shape == (8, 5)
    qh = q.double().transpose(0, 1)  # [H, q, D]
    kh = k.double().repeat_interleave(4, 1).transpose(0, 1)
    vh = v.double().repeat_interleave(4, 1).transpose(0, 1)
    mask = torch.ones(5, 9, dtype=torch.bool).tril(diagonal=4)  # bottom-right causal
    want = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=0.2)
    assert torch.allclose(out, want.transpose(0, 1), atol=1e-12)
    scores = (qh @ kh.transpose(1, 2) * 0.2).masked_fill(~mask, -math.inf)
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-12)


def test_values_padded_with_zero_columns_give_the_same_first_columns() -> None:
    """Consistency: a head_size_v=128 layer equals a head_size_v=192 layer whose values carry
    64 zero columns (first 128 columns of the output; the LSE unchanged)."""
    narrow = AttentionSpec(**MLA, dtype=F32)
    wide = dataclasses.replace(narrow, head_size_v=192)
    batch, nblk = make_batch((1, 7, 3), (30, 7, 20), 16, seed=3)
    cache = PagedKVCache.for_spec(narrow, nblk, "cpu")
    fill_cache_random(cache, generator(4))
    padded = dataclasses.replace(
        cache, value=torch.cat([cache.value, torch.zeros(*cache.value.shape[:3], 64)], -1)
    )
    q, _, _ = random_qkv(narrow, batch.num_tokens, generator(5))
    out, lse = reference.paged_attention(q, cache, batch, narrow)
    out_wide, lse_wide = reference.paged_attention(q, padded, batch, wide)
    assert out.shape[-1] == 128 and out_wide.shape[-1] == 192
    assert torch.allclose(out, out_wide[..., :128], atol=1e-12)
    assert (out_wide[..., 128:] == 0).all() and torch.equal(lse, lse_wide)


def test_the_reference_refuses_a_cache_of_another_value_head_size() -> None:
    spec = AttentionSpec(**MLA)
    batch, nblk = make_batch((2,), (2,), 16)
    cache = PagedKVCache.allocate(nblk, 16, 2, 192, BF16)  # values 192 wide
    q, _, _ = random_qkv(spec, batch.num_tokens, generator(6))
    with pytest.raises(InvalidInputError, match="head_size_v"):
        reference.paged_attention(q, cache, batch, spec)


# --- the torch backend: every path ---------------------------------------------------------------
PAIRS = [(192, 128), (64, 128), (48, 16)]


@pytest.mark.parametrize(("k", "v"), PAIRS)
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_torch_matches_the_reference(k: int, v: int, dtype: torch.dtype, kv: str) -> None:
    spec = AttentionSpec(
        **{**MLA, "head_size": k, "head_size_v": v}, dtype=dtype, kv_cache_dtype=kv
    )
    backend = TorchBackend(spec)
    batch, nblk = make_batch((1, 1, 9, 4), (33, 5, 9, 40), 16, seed=7, num_tokens=17)
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(8))
    q, key, value = random_qkv(spec, batch.num_tokens, generator(9))
    expected_cache, expected = reference_after_write(spec, cache, batch, q, key, value)
    out = backend.impl().forward(q, key, value, cache, backend.metadata_builder().build(batch))
    assert out.shape == (17, 8, v)
    assert cache.equal(expected_cache)
    assert_within(out[: batch.num_actual_tokens], expected, tol(dtype), f"{k}/{v}")
    assert (out[batch.num_actual_tokens :] == 0).all()


@pytest.mark.parametrize(("k", "v"), PAIRS)
def test_torch_eager_path_with_every_feature_and_the_lse(k: int, v: int) -> None:
    spec = AttentionSpec(
        **{**MLA, "head_size": k, "head_size_v": v},
        dtype=F32,
        sliding_window=20,
        logits_soft_cap=5.0,
        use_alibi=True,
        use_sinks=True,
    )
    backend = TorchBackend(spec)
    batch, nblk = make_batch((1, 6, 3), (40, 6, 25), 16, seed=10)
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(11))
    q, key, value = random_qkv(spec, batch.num_tokens, generator(12))
    slopes = torch.linspace(0.01, 0.1, 8)
    sinks = random_sinks(8, generator(13))
    expected_cache, _ = reference_after_write(spec, cache, batch, q, key, value)
    want, want_lse = reference.paged_attention(
        q, expected_cache, batch, spec, alibi_slopes=slopes, sinks=sinks
    )
    impl = backend.impl(alibi_slopes=slopes, sinks=sinks)
    meta = backend.metadata_builder().build(batch)
    out, lse = impl.forward(q, key, value, cache, meta, return_lse=True)
    assert out.shape[-1] == v and lse.shape == (batch.num_tokens, 8)
    assert_within(out, want, tol(F32), "eager")
    assert_within(lse, want_lse.t(), tol(F32), "lse")


@pytest.mark.parametrize(("k", "v"), PAIRS)
def test_torch_graph_path_and_output_buffer(k: int, v: int) -> None:
    spec = AttentionSpec(**{**MLA, "head_size": k, "head_size_v": v}, dtype=F16)
    backend = TorchBackend(spec)
    batch, nblk = make_batch((2, 2, 2), (5, 30, 17), 16, seed=14)
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(15))
    q, key, value = random_qkv(spec, batch.num_tokens, generator(16))
    expected_cache, expected = reference_after_write(spec, cache, batch, q, key, value)
    meta = backend.metadata_builder().build_for_graph_capture(batch)
    assert meta.graph is not None
    buf = torch.full((batch.num_tokens, 8, v), math.nan, dtype=F16)
    out = backend.impl().forward(q, key, value, cache, meta, output=buf)
    assert out is buf and cache.equal(expected_cache)
    assert_within(out, expected, tol(F16), "graph path")


# --- bad input: typed errors, the cache byte-identical -------------------------------------------
def _layer():  # type: ignore[no-untyped-def]
    spec = AttentionSpec(**MLA, dtype=BF16)
    backend = TorchBackend(spec)
    batch, nblk = make_batch((1, 5), (20, 5), 16, seed=17)
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(18))
    q, k, v = random_qkv(spec, batch.num_tokens, generator(19))
    return backend, batch, cache, q, k, v


@pytest.mark.parametrize("width", [192, 64, 136])
def test_a_value_of_the_wrong_width_is_refused_before_any_write(width: int) -> None:
    backend, batch, cache, q, k, v = _layer()
    bad = torch.zeros(*v.shape[:2], width, dtype=v.dtype)
    before = cache.clone()
    impl, meta = backend.impl(), backend.metadata_builder().build(batch)
    with pytest.raises(InvalidInputError, match=rf"value has shape \[6, 2, {width}\]"):
        impl.forward(q, k, bad, cache, meta)
    with pytest.raises(InvalidInputError, match=rf"value has shape \[6, 2, {width}\]"):
        impl.write_kv(k, bad, cache, batch.slot_mapping)
    with pytest.raises(InvalidInputError, match=rf"value has shape \[6, 2, {width}\]"):
        impl.write_kv(k, bad, cache, meta=meta)
    assert cache.equal(before)


def test_an_output_buffer_of_the_querys_shape_is_refused_before_any_write() -> None:
    backend, batch, cache, q, k, v = _layer()
    before = cache.clone()
    with pytest.raises(
        InvalidInputError, match=r"output has shape \[6, 8, 192\], expected \[6, 8, 128\]"
    ):
        backend.impl().forward(
            q, k, v, cache, backend.metadata_builder().build(batch), output=torch.empty_like(q)
        )
    assert cache.equal(before)


def test_a_cache_of_another_value_head_size_is_refused() -> None:
    backend, batch, cache, q, k, v = _layer()
    wide = PagedKVCache.allocate(cache.num_blocks, 16, 2, 192, BF16)  # values 192 wide
    before = wide.clone()
    with pytest.raises(InvalidInputError, match="head_size_v = 128"):
        backend.impl().forward(q, k, v, wide, backend.metadata_builder().build(batch))
    assert wide.equal(before)


# --- capabilities ------------------------------------------------------------------------------
def _caps(**head_size_v: object) -> Capabilities:
    return dataclasses.replace(
        TorchBackend.capabilities,
        head_size_v=HeadSizeVSupport(**head_size_v),  # type: ignore[arg-type]
    )


def test_undeclared_distinct_value_head_sizes_are_refused_naming_the_field() -> None:
    (r,) = _caps(reason="the kernel has one head size").unsupported_reasons(AttentionSpec(**MLA))
    assert r.field == "head_size_v" and r.value == (192, 128)
    assert "head_size_v 128 != head_size 192 is not supported" in r
    assert "the kernel has one head size" in r
    assert not _caps().unsupported_reasons(
        AttentionSpec(num_heads=8, num_kv_heads=2, head_size=192)
    )


def test_declared_regions_sizes_and_ranges() -> None:
    caps = _caps(pairs=((192, 128), ((129, 192), (97, 128))))  # FlashAttention-3's first region
    ok = [
        AttentionSpec(**{**MLA, "head_size": k, "head_size_v": v})
        for k, v in ((192, 128), (160, 104))
    ]
    assert all(not caps.unsupported_reasons(s) for s in ok)
    (r,) = caps.unsupported_reasons(AttentionSpec(**{**MLA, "head_size": 192, "head_size_v": 96}))
    assert r.field == "head_size_v" and "declared: (192, 128), (129..192, 97..128)" in r


def test_per_dtype_and_format_declarations() -> None:
    caps = _caps(pairs=None, dtypes=frozenset({BF16}), kv_cache_dtypes=frozenset({"auto"}))
    assert not caps.unsupported_reasons(AttentionSpec(**MLA, dtype=BF16))
    (r,) = caps.unsupported_reasons(AttentionSpec(**MLA, dtype=F16))
    assert r.field == "head_size_v" and "dtype torch.float16" in r
    (r,) = caps.unsupported_reasons(AttentionSpec(**MLA, dtype=BF16, kv_cache_dtype="fp8"))
    assert "kv_cache_dtype 'fp8_e4m3'" in r


def test_any_pair_still_applies_the_head_size_rules_to_the_value() -> None:
    caps = dataclasses.replace(_caps(pairs=None), max_head_size=256, head_size_multiple=8)
    (r,) = caps.unsupported_reasons(AttentionSpec(**{**MLA, "head_size_v": 100}))
    assert r.field == "head_size_v" and "not a multiple of 8" in r


@pytest.mark.parametrize(
    "bad",
    [
        dict(pairs=((192,),)),
        dict(pairs=((0, 128),)),
        dict(pairs=(((192, 129), 128),)),
        dict(reason=" "),
        dict(kv_cache_dtypes=frozenset({"fp9"})),
    ],
)
def test_a_malformed_declaration_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises((InvalidInputError, UnknownNameError)):
        HeadSizeVSupport(**bad)  # type: ignore[arg-type]


def test_a_backend_refuses_at_construction() -> None:
    class OneSize(TorchBackend):
        name = "one-size-test"
        capabilities = _caps(reason="one head size")

    with pytest.raises(UnsupportedConfigurationError, match="head_size_v 128"):
        OneSize(AttentionSpec(**MLA))


def test_attnhub_list_json_shows_the_declaration(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--json"]) == 0
    listed = {b["name"]: b for b in json.loads(capsys.readouterr().out)}
    assert listed["torch"]["capabilities"]["head_size_v"] == {"pairs": "any"}
