"""The suite's own model of vLLM's fp8 latent write (attnhub_conformance.mla_fp8): its code table
and its rounding, checked against hand-worked values and against torch's fp8 dtypes."""

from __future__ import annotations

import math

import pytest
import torch
from attnhub_conformance import mla_fp8

from attnhub.quant import quantize_fp8

E4M3, E5M2 = mla_fp8.FP8_FORMATS["fp8_e4m3"], mla_fp8.FP8_FORMATS["fp8_e5m2"]
TORCH_DTYPE = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_the_code_table_is_torchs_for_every_byte(name: str) -> None:
    fmt = mla_fp8.FP8_FORMATS[name]
    theirs = torch.arange(256, dtype=torch.uint8).view(TORCH_DTYPE[name]).double().tolist()
    for code, want in enumerate(theirs):
        got = fmt.decode(code)
        assert (math.isnan(got) and math.isnan(want)) or got == want, (code, got, want)


@pytest.mark.parametrize(
    ("fmt", "x", "code", "why"),
    [
        (E4M3, 1.0, 0x38, "exponent 7 (bias 7), mantissa 0"),
        (E4M3, 1.0625, 0x38, "halfway 1.0 / 1.125: to the even code"),
        (E4M3, 1.1875, 0x3A, "halfway 1.125 / 1.25: to the even code, 1.25"),
        (E4M3, 1.2, 0x3A, "nearer 1.25"),
        (E4M3, 448.0, 0x7E, "the largest finite value"),
        (E4M3, 464.0, 0x7E, "halfway past the largest: saturated"),
        (E4M3, 1e30, 0x7E, "far beyond: saturated, not NaN"),
        (E4M3, -math.inf, 0xFE, "-inf: saturated to -448 (e4m3 has no infinity)"),
        (E4M3, 2.0**-9, 0x01, "the smallest subnormal"),
        (E4M3, 2.0**-10, 0x00, "halfway 0 / 2**-9: to zero (even)"),
        (E4M3, 3 * 2.0**-11, 0x01, "nearer the smallest subnormal"),
        (E4M3, -(2.0**-12), 0x80, "rounds to -0, the sign kept"),
        (E5M2, 1.0, 0x3C, "exponent 15 (bias 15), mantissa 0"),
        (E5M2, 1.125, 0x3C, "halfway 1.0 / 1.25: to the even code"),
        (E5M2, 1.375, 0x3E, "halfway 1.25 / 1.5: to the even code, 1.5"),
        (E5M2, 57344.0, 0x7B, "the largest finite value"),
        (E5M2, 1e9, 0x7B, "beyond: saturated, not inf"),
        (E5M2, math.inf, 0x7B, "inf: saturated (SATFINITE)"),
        (E5M2, 2.0**-16, 0x01, "the smallest subnormal"),
        (E5M2, 2.0**-17, 0x00, "halfway 0 / 2**-16: to zero (even)"),
    ],
)
def test_encode_rounds_to_nearest_even_and_saturates(
    fmt: mla_fp8.Fp8Format, x: float, code: int, why: str
) -> None:
    got = int(mla_fp8.encode(torch.tensor([x]), 1.0, fmt)[0])
    assert got == code, f"{why}: 0x{got:02x}, want 0x{code:02x}"


def test_encode_divides_by_the_scale_in_float32_as_the_kernel_does() -> None:
    """1.2890625 / float32(0.4125) is 3.125 in float32 (a tie: to 3.0, the even code) but
    3.12500005 in float64 (to 3.25): vLLM's ``a / scale`` is a float32 division."""
    x, scale = torch.tensor([1.2890625], dtype=torch.bfloat16), float(torch.tensor(0.4125))
    assert 1.2890625 / scale > 3.125  # float64 would round up
    assert int(mla_fp8.encode(x, scale, E4M3)[0]) == 0x44 and E4M3.decode(0x44) == 3.0
    stored = quantize_fp8(x, torch.tensor(scale), torch.float8_e4m3fn)
    assert float(stored.float()) == 3.0  # attnhub's write agrees


def test_a_nan_is_a_nan_code() -> None:
    for fmt in (E4M3, E5M2):
        assert math.isnan(fmt.decode(int(mla_fp8.encode(torch.tensor([math.nan]), 1.0, fmt)[0])))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("scale", [1.0, 0.125, 0.0371])
def test_encode_is_torchs_saturated_conversion_over_every_binade(name: str, scale: float) -> None:
    """attnhub.quant's write and this model agree on values from 2**-30 to 2**25 times N(0, 1)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50_000, generator=g) * torch.exp2(
        torch.randint(-30, 26, (50_000,), generator=g).float()
    )
    fmt = mla_fp8.FP8_FORMATS[name]
    s = torch.tensor(scale, dtype=torch.float32)
    want = quantize_fp8(x, s, TORCH_DTYPE[name]).view(torch.uint8)
    assert torch.equal(mla_fp8.encode(x, float(s), fmt), want)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_edge_values_hold_every_code_tie_and_saturation_exactly_in_bf16(name: str) -> None:
    fmt = mla_fp8.FP8_FORMATS[name]
    edges = mla_fp8.edge_values(fmt, 0.125)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert torch.equal(edges.to(dtype).double(), edges), dtype
    codes = mla_fp8.encode(edges, 0.125, fmt)
    _, values = fmt.finite_codes
    assert set(range(values.size)) <= set(codes.tolist())  # every non-negative code
    assert {c | 0x80 for c in range(values.size)} <= set(codes.tolist())  # and its negative
    y = edges / 0.125
    assert bool((y.abs() > fmt.max).any())  # saturation is exercised
