"""vLLM's fp8 write of an MLA latent, from first principles: what the suite compares an fp8 latent
cache's bytes with, apart from ``attnhub.quant`` (which backends and the reference share).

vLLM's ``concat_and_cache_mla`` stores each element of ``kv_c`` and of ``k_pe`` as
``fp8::scaled_convert(x, *scale)``, i.e. ``__nv_cvt_float_to_fp8(float(x) / scale,
__NV_SATFINITE, E4M3 | E5M2)``: the model-dtype value widened to float32, divided by the
per-tensor float32 scale in float32, rounded to the nearest fp8 value with ties to the even
code, anything beyond the largest finite value (infinities too) stored as that value with its
sign; NaN stays NaN. Here the fp8 values come from the bit layout (sign, exponent, mantissa),
not from torch's fp8 dtypes, and the rounding is a search of that table in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

__all__ = ["FP8_FORMATS", "Fp8Format", "edge_values", "encode"]


@dataclass(frozen=True)
class Fp8Format:
    """One fp8 encoding: ``exponent_bits`` / ``mantissa_bits`` after the sign bit."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    #: e4m3fn: only S.1111.111 is NaN (no infinities); e5m2: exponent all ones is inf / NaN.
    ieee_specials: bool

    def decode(self, code: int) -> float:
        """The value of the 8-bit ``code`` (NaN or +-inf for the special codes)."""
        sign = -1.0 if code & 0x80 else 1.0
        e = (code >> self.mantissa_bits) & ((1 << self.exponent_bits) - 1)
        m = code & ((1 << self.mantissa_bits) - 1)
        top_e = (1 << self.exponent_bits) - 1
        if self.ieee_specials and e == top_e:
            return sign * float("inf") if m == 0 else float("nan")
        if not self.ieee_specials and e == top_e and m == (1 << self.mantissa_bits) - 1:
            return float("nan")
        frac = m / (1 << self.mantissa_bits)
        if e == 0:
            return sign * frac * 2.0 ** (1 - self.bias)
        return sign * (1.0 + frac) * 2.0 ** (e - self.bias)

    @property
    def finite_codes(self) -> tuple[np.ndarray, np.ndarray]:
        """(codes, values) of the non-negative finite codes, by increasing value."""
        return _table(self)

    @property
    def max(self) -> float:
        return float(self.finite_codes[1][-1])


FP8_FORMATS = {
    "fp8_e4m3": Fp8Format("fp8_e4m3", 4, 3, 7, ieee_specials=False),
    "fp8_e5m2": Fp8Format("fp8_e5m2", 5, 2, 15, ieee_specials=True),
}


@cache
def _table(fmt: Fp8Format) -> tuple[np.ndarray, np.ndarray]:
    codes = np.arange(0x80, dtype=np.int64)
    values = np.array([fmt.decode(int(c)) for c in codes])
    finite = np.isfinite(values)
    return codes[finite], values[finite]


def encode(x: torch.Tensor, scale: float, fmt: Fp8Format) -> torch.Tensor:  # uint8, x's shape
    """The fp8 codes vLLM stores for the model-dtype values ``x`` with the float32 ``scale``.
    A NaN becomes a NaN code (its exact bits are the hardware's: compare NaN-ness apart)."""
    y = x.detach().to("cpu", torch.float32).numpy() / np.float32(scale)  # float32, as the kernel
    flat = y.astype(np.float64).reshape(-1)
    codes, values = fmt.finite_codes
    mag = np.minimum(np.abs(flat), fmt.max)  # __NV_SATFINITE (and inf -> the largest)
    mag = np.where(np.isnan(flat), 0.0, mag)
    hi = np.clip(np.searchsorted(values, mag, side="left"), 0, values.size - 1)
    lo = np.clip(hi - 1, 0, values.size - 1)
    d_lo, d_hi = mag - values[lo], values[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    out = np.where(pick_hi, codes[hi], codes[lo])
    out = np.where(np.signbit(flat), out | 0x80, out)
    out = np.where(np.isnan(flat), 0x7F, out)  # a NaN code of both formats
    return torch.from_numpy(out.astype(np.uint8).reshape(y.shape))


def edge_values(fmt: Fp8Format, scale: float) -> torch.Tensor:  # float64, 1-D
    """Values whose fp8 writes exercise every rule (times ``scale``, a power of two, so that
    ``x / scale`` is exact): every finite code of both signs, every midpoint between two
    neighbours (ties: to the even code), just above and below some midpoints, beyond the
    largest value (saturation), below half the smallest subnormal (to +-0)."""
    _, values = fmt.finite_codes
    mids = (values[:-1] + values[1:]) / 2
    step = np.diff(values)
    off = np.concatenate([mids[::7] + step[::7] / 8, mids[3::7] - step[3::7] / 8])
    beyond = fmt.max * np.array([1.0 + 2.0**-fmt.mantissa_bits, 1.5, 2.0, 4.0])
    tiny = values[1] * np.array([0.25, 0.5, 0.75])
    pos = np.concatenate([values, mids, off, beyond, tiny])
    return torch.from_numpy(np.concatenate([pos, -pos]) * scale)
