"""MLA's spec, latent paged cache and KV write (attnhub.mla): validation, layouts, and a write
that matches the reference's token-by-token write, skips padding and refuses bad input before
touching the cache."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from attnhub import reference
from attnhub.errors import InvalidInputError, InvalidSpecError
from attnhub.mla import LatentKVCache, MLASpec, check_latent_cache, write_latent_kv
from attnhub.quant import dequantize_fp8
from attnhub.testing import generator

L, R, P, V, H = 8, 4, 6, 5, 3  # kv_lora_rank, rope, nope, v_head_dim, heads
NB, BS = 5, 4


def spec(**kw: object) -> MLASpec:
    fields: dict[str, object] = dict(
        num_heads=H,
        kv_lora_rank=L,
        qk_rope_head_dim=R,
        qk_nope_head_dim=P,
        v_head_dim=V,
        dtype=torch.float32,
        block_size=BS,
    )
    fields.update(kw)
    return MLASpec(**fields)  # type: ignore[arg-type]


def latents(
    n: int, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    g = generator(seed)
    return torch.randn(n, L, generator=g).to(dtype), torch.randn(n, R, generator=g).to(dtype)


def filled(s: MLASpec, layout: str, seed: int = 1) -> LatentKVCache:
    """A cache whose every slot holds random latents (stale data a write must leave alone)."""
    cache = LatentKVCache.for_spec(s, NB, layout=layout)
    kv_c, k_pe = latents(NB * BS, seed, s.dtype)
    reference.write_latent_kv(cache, kv_c, k_pe, torch.arange(NB * BS))
    return cache


# --- spec -------------------------------------------------------------------------------------


def test_spec_default_scale_is_the_expanded_forms_not_the_latent_widths() -> None:
    s = spec()
    assert s.scale == pytest.approx((P + R) ** -0.5)
    assert s.scale != pytest.approx((L + R) ** -0.5)
    assert (s.qk_head_dim, s.latent_size) == (P + R, L + R)


def test_spec_keeps_a_given_scale_and_normalizes_fp8_alias() -> None:
    s = spec(scale=0.125, kv_cache_dtype="fp8")
    assert s.scale == 0.125 and s.kv_cache_dtype == "fp8_e4m3"
    e5m2 = spec(kv_cache_dtype="fp8_e5m2")
    assert e5m2.cache_storage_dtype is torch.float8_e5m2
    assert s.cache_storage_dtype is torch.float8_e4m3fn


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("kv_lora_rank", 0, "kv_lora_rank = 0"),
        ("qk_rope_head_dim", -64, "qk_rope_head_dim = -64"),
        ("qk_nope_head_dim", 128.0, "qk_nope_head_dim = 128.0"),
        ("v_head_dim", True, "v_head_dim = True"),
        ("num_heads", None, "num_heads = None"),
        ("block_size", 0, "block_size = 0"),
        ("dtype", torch.int8, "dtype = torch.int8"),
        ("scale", -1.0, "scale = -1.0"),
        ("scale", math.nan, "scale = nan"),
        ("kv_cache_dtype", "fp9", "kv_cache_dtype = 'fp9' is unknown"),
        ("kv_cache_dtype", "int8", "kv_cache_dtype = 'int8' has no latent-cache form"),
    ],
)
def test_spec_refuses_a_bad_field_naming_it(field: str, value: object, named: str) -> None:
    with pytest.raises(InvalidSpecError, match=named.replace("(", r"\(").replace(".", r"\.")):
        spec(**{field: value})


# --- cache layouts ----------------------------------------------------------------------------


def test_joint_cache_is_one_plane_latent_then_rope_as_vllm_keeps_it() -> None:
    cache = LatentKVCache.for_spec(spec(), NB, layout="joint")
    assert cache.joint.shape == (NB, BS, L + R)
    assert cache.joint.is_contiguous()
    assert cache.planes().keys() == {"joint"}
    cache.kv_c[2, 1] = 1.0
    cache.k_pe[2, 1] = 2.0
    assert cache.joint[2, 1].tolist() == [1.0] * L + [2.0] * R


def test_split_cache_keeps_latent_and_rope_planes_apart() -> None:
    cache = LatentKVCache.for_spec(spec(), NB, layout="split")
    assert cache.kv_c.shape == (NB, BS, L) and cache.k_pe.shape == (NB, BS, R)
    assert cache.planes().keys() == {"kv_c", "k_pe"}
    with pytest.raises(InvalidInputError, match="has no joint plane"):
        cache.joint  # noqa: B018


def test_from_joint_wraps_an_engines_plane_without_a_copy() -> None:
    plane = torch.zeros(NB, BS, L + R)
    cache = LatentKVCache.from_joint(plane, L)
    assert cache.joint.data_ptr() == plane.data_ptr()
    write_latent_kv(spec(), cache, *latents(1), torch.tensor([6]))
    assert plane[1, 2].abs().sum() > 0


def test_a_joint_cache_whose_parts_are_not_one_plane_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="two parts of each row of one plane"):
        LatentKVCache(torch.zeros(NB, BS, L), torch.zeros(NB, BS, R), BS, layout="joint")


@pytest.mark.parametrize(
    ("kv", "stored"), [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]
)
def test_fp8_cache_holds_fp8_planes_and_a_scalar_scale(kv: str, stored: torch.dtype) -> None:
    cache = LatentKVCache.for_spec(spec(kv_cache_dtype=kv), NB)
    assert cache.joint.dtype is stored
    assert cache.scale is not None and cache.scale.shape == () and float(cache.scale) == 1.0
    with pytest.raises(InvalidInputError, match="needs scale"):
        replace(cache, scale=None)


@pytest.mark.parametrize(
    ("why", "build", "named"),
    [
        (
            "unknown layout",
            lambda: LatentKVCache(torch.zeros(NB, BS, L), torch.zeros(NB, BS, R), BS, layout="NHD"),
            "layout = 'NHD' is not one of",
        ),
        (
            "4-D rope plane",
            lambda: LatentKVCache(torch.zeros(NB, BS, L), torch.zeros(NB, BS, 1, R), BS, "split"),
            r"cache k_pe must be a 3-D tensor .* got \[5, 4, 1, 4\]",
        ),
        (
            "block size not in dim 1",
            lambda: LatentKVCache(torch.zeros(NB, BS, L), torch.zeros(NB, BS, R), 8, "split"),
            "block_size = 8",
        ),
        (
            "parts of two dtypes",
            lambda: LatentKVCache(
                torch.zeros(NB, BS, L), torch.zeros(NB, BS, R, dtype=torch.bfloat16), BS, "split"
            ),
            "must share dtype and device",
        ),
        (
            "fp8 format over bf16 planes",
            lambda: LatentKVCache(
                torch.zeros(NB, BS, L, dtype=torch.bfloat16),
                torch.zeros(NB, BS, R, dtype=torch.bfloat16),
                BS,
                "split",
                "fp8",
                torch.ones(()),
            ),
            "'fp8_e4m3' stores torch.float8_e4m3fn, the cache planes are torch.bfloat16",
        ),
        (
            "auto format over int8 planes",
            lambda: LatentKVCache(
                torch.zeros(NB, BS, L, dtype=torch.int8),
                torch.zeros(NB, BS, R, dtype=torch.int8),
                BS,
                "split",
            ),
            "the cache planes are torch.int8",
        ),
        (
            "a scale for an unquantized cache",
            lambda: LatentKVCache(
                torch.zeros(NB, BS, L), torch.zeros(NB, BS, R), BS, "split", "auto", torch.ones(())
            ),
            "'auto' has no scale",
        ),
        (
            "a joint plane with no rope part",
            lambda: LatentKVCache.from_joint(torch.zeros(NB, BS, L), L),
            "kv_lora_rank = 8 must leave a rope part in a plane 8 wide",
        ),
        (
            "an int8 latent cache",
            lambda: LatentKVCache.allocate(NB, BS, L, R, torch.float32, kv_cache_dtype="int8"),
            "'int8' has no latent-cache form",
        ),
    ],
)
def test_a_cache_that_is_no_latent_cache_is_refused_naming_why(
    why: str, build: object, named: str
) -> None:
    with pytest.raises(InvalidInputError, match=named):
        build()  # type: ignore[operator]


def test_check_latent_cache_names_a_geometry_the_spec_does_not_have() -> None:
    cache = LatentKVCache.allocate(NB, BS, L, R + 1, torch.float32)
    with pytest.raises(InvalidInputError, match=r"\(8, 5\), the spec says \(8, 4\)"):
        check_latent_cache(spec(), cache, "cpu")


# --- write ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["joint", "split"])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_matches_the_reference_write_byte_for_byte(
    layout: str, kv: str, dtype: torch.dtype
) -> None:
    s = spec(kv_cache_dtype=kv, dtype=dtype)
    cache = filled(s, layout)
    if cache.scale is not None:
        cache.scale.fill_(0.05)
    expected = cache.clone()
    kv_c, k_pe = latents(7, seed=7, dtype=dtype)  # a row past the slot mapping is not written
    slots = torch.tensor([13, -1, 2, 19, -1, 4])
    write_latent_kv(s, cache, kv_c, k_pe, slots)
    reference.write_latent_kv(expected, kv_c, k_pe, slots)
    assert cache.equal(expected)


def test_write_puts_each_token_at_its_slot_and_skips_padding() -> None:
    s = spec()
    cache = filled(s, "joint")
    before = cache.clone()
    kv_c, k_pe = latents(3, seed=3)
    write_latent_kv(s, cache, kv_c, k_pe, torch.tensor([-1, 9, 0], dtype=torch.int32))
    assert torch.equal(cache.kv_c[2, 1], kv_c[1]) and torch.equal(cache.k_pe[2, 1], k_pe[1])
    assert torch.equal(cache.kv_c[0, 0], kv_c[2]) and torch.equal(cache.k_pe[0, 0], k_pe[2])
    written = torch.zeros(NB, BS, dtype=torch.bool)
    written[2, 1] = written[0, 0] = True
    assert torch.equal(cache.joint[~written], before.joint[~written])


@pytest.mark.parametrize(
    ("kv", "stored", "mantissa_bits"),
    [("fp8", torch.float8_e4m3fn, 3), ("fp8_e5m2", torch.float8_e5m2, 2)],
)
@pytest.mark.parametrize("layout", ["joint", "split"])
def test_fp8_write_stores_each_part_over_the_one_scale(
    kv: str, stored: torch.dtype, mantissa_bits: int, layout: str
) -> None:
    """vLLM's concat_and_cache_mla: kv_c and the rope part k_pe alike, fp8(x / scale)."""
    s = spec(kv_cache_dtype=kv)
    cache = LatentKVCache.for_spec(s, NB, layout=layout)
    assert cache.scale is not None
    cache.scale.fill_(0.5)
    kv_c, k_pe = latents(1, seed=4)
    write_latent_kv(s, cache, kv_c, k_pe, torch.tensor([5]))
    back = dequantize_fp8(cache.kv_c[1, 1], cache.scale)
    torch.testing.assert_close(back, kv_c[0], atol=0, rtol=2.0**-mantissa_bits)
    assert torch.equal(
        cache.k_pe[1, 1].view(torch.uint8), (k_pe[0] / 0.5).to(stored).view(torch.uint8)
    )


@pytest.mark.parametrize(("kv", "largest"), [("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)])
def test_fp8_write_saturates_both_parts_at_the_largest_finite_value(
    kv: str, largest: float
) -> None:
    """__NV_SATFINITE: beyond the range (inf too) the largest finite value with its sign, in
    kv_c and in the rope part; never NaN or inf."""
    s = spec(kv_cache_dtype=kv)
    cache = LatentKVCache.for_spec(s, NB, layout="joint")
    assert cache.scale is not None
    cache.scale.fill_(0.25)
    big = torch.tensor([largest, 2 * largest, -4 * largest, math.inf]) * 0.25
    kv_c = torch.cat([big, torch.zeros(L - 4)])[None]
    k_pe = -big[None, :R]
    write_latent_kv(s, cache, kv_c, k_pe, torch.tensor([0]))
    row = cache.joint[0, 0].float()
    assert row[:4].tolist() == [largest, largest, -largest, largest]
    assert row[L : L + 4].tolist() == [-largest, -largest, largest, -largest]


def test_dequantize_latent_rounds_to_the_model_dtype_as_vllms_kernels() -> None:
    from attnhub.mla import dequantize_latent

    raw = torch.tensor([1.125, -3.0, 0.0]).to(torch.float8_e4m3fn)
    scale = torch.tensor(0.1, dtype=torch.float32)
    f32 = dequantize_latent(raw, scale, torch.float32)
    bf16 = dequantize_latent(raw, scale, torch.bfloat16)
    assert f32.dtype == bf16.dtype == torch.float32
    assert f32[0] == torch.tensor(1.125, dtype=torch.float32) * scale  # a float32 product
    assert bf16[0] == f32[0].to(torch.bfloat16).float() and bf16[0] != f32[0]
    plain = torch.tensor([1.5, 2.0], dtype=torch.bfloat16)
    assert torch.equal(dequantize_latent(plain, None, torch.bfloat16), plain.float())


@pytest.mark.parametrize("layout", ["joint", "split"])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_latent_rows_reads_what_the_oracle_reads_in_the_model_dtype(
    layout: str, kv: str, dtype: torch.dtype
) -> None:
    """The read that mirrors the write (a prefill's cached context): the rows at the slots in
    either layout, fp8 as ``dequantize_latent`` reads it, in the model dtype."""
    from attnhub.mla import read_latent_rows

    s = spec(kv_cache_dtype=kv, dtype=dtype)
    cache = filled(s, layout)
    if cache.scale is not None:
        cache.scale.fill_(0.05)
    kv_c, k_pe = latents(NB * BS, seed=8, dtype=dtype)
    write_latent_kv(s, cache, kv_c, k_pe, torch.arange(NB * BS))
    slots = torch.tensor([13, 2, 19, 4, 4])
    got_c, got_pe = read_latent_rows(cache, slots, dtype)
    assert got_c.dtype == got_pe.dtype == dtype
    assert got_c.shape == (5, L) and got_pe.shape == (5, R)
    table = torch.arange(NB, dtype=torch.int32)
    want_c, want_pe = reference.read_latent_sequence(cache, table, NB * BS)  # float64
    assert torch.equal(got_c, want_c[slots].to(dtype))
    assert torch.equal(got_pe, want_pe[slots].to(dtype))
    if kv == "auto":  # what was written, bit for bit
        assert torch.equal(got_c, kv_c[slots]) and torch.equal(got_pe, k_pe[slots])


def _bad_writes() -> list[tuple[str, dict[str, object], str]]:
    kv_c, k_pe = latents(3)
    slots = torch.tensor([1, 2, 3])
    return [
        ("latent too wide", {"kv_c": torch.zeros(3, L + 1)}, r"kv_c has shape \[3, 9\]"),
        ("rope part missing", {"k_pe": None}, "k_pe is None"),
        ("rope part of the wrong width", {"k_pe": k_pe[:, :2]}, r"k_pe has shape \[3, 2\]"),
        ("rope with a head dim", {"k_pe": k_pe[:, None]}, r"k_pe has shape \[3, 1, 4\]"),
        ("wrong dtype", {"kv_c": kv_c.double()}, "kv_c has dtype torch.float64"),
        ("strided rows", {"kv_c": torch.zeros(3, 2 * L)[:, ::2]}, "kv_c's last dimension"),
        ("fewer rope rows", {"k_pe": k_pe[:2]}, "kv_c has 3 tokens but k_pe has 2"),
        ("more slots than tokens", {"slot_mapping": torch.arange(4)}, "slot_mapping has 4"),
        ("slot past the cache", {"slot_mapping": torch.tensor([1, 20, 3])}, r"\[1\] = 20"),
        ("slot below -1", {"slot_mapping": torch.tensor([1, -2, 3])}, r"\[1\] = -2"),
        ("repeated slot", {"slot_mapping": torch.tensor([4, 2, 4])}, "both 4"),
        ("float slots", {"slot_mapping": slots.float()}, "slot_mapping has dtype"),
        ("2-D slots", {"slot_mapping": slots[None]}, r"slot_mapping has shape \[1, 3\]"),
        ("not a cache", {"cache": torch.zeros(NB, BS, L + R)}, "must be a LatentKVCache"),
        (
            "cache of another format",
            {"cache": LatentKVCache.allocate(NB, BS, L, R, torch.float32, kv_cache_dtype="fp8")},
            "cache kv_cache_dtype is 'fp8_e4m3'",
        ),
        (
            "cache of another model dtype",
            {"cache": LatentKVCache.allocate(NB, BS, L, R, torch.bfloat16)},
            "cache stores torch.bfloat16",
        ),
    ]


@pytest.mark.parametrize("layout", ["joint", "split"])
@pytest.mark.parametrize(
    ("why", "change", "named"), _bad_writes(), ids=[b[0] for b in _bad_writes()]
)
def test_a_bad_write_raises_naming_the_value_and_leaves_the_cache_unchanged(
    layout: str, why: str, change: dict[str, object], named: str
) -> None:
    s = spec()
    cache = filled(s, layout)
    kv_c, k_pe = latents(3, seed=5)
    call: dict[str, object] = dict(
        cache=cache, kv_c=kv_c, k_pe=k_pe, slot_mapping=torch.tensor([1, 2, 3])
    )
    call.update(change)
    before = cache.clone()
    with pytest.raises(InvalidInputError, match=named):
        write_latent_kv(s, **call)  # type: ignore[arg-type]
    assert cache.equal(before), why
