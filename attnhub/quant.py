"""Quantization math of the quantized KV caches (see ``attnhub.spec.KV_CACHE_DTYPES``).

fp8: per-tensor scale, stored ``fp8(clamp(x / scale, -max, max))``, read back as ``fp8 * scale``.
int8: symmetric, ``scale = amax / 127`` over the reduced dimension(s) (or a given static scale),
stored ``clamp(round(x / scale), -128, 127)``, read back as ``int8 * scale``.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def indexable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a same-shape uint8 view of it where torch has no indexing kernels (fp8 on CPU:
    index_copy_, index_fill_). Copying or zero-filling the bytes is exact."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def quantize_fp8(
    x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float8_e4m3fn
) -> torch.Tensor:
    """``fp8(x / scale)``, saturated at the format's largest finite value."""
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-fmax, fmax).to(dtype)


def dequantize_fp8(
    x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return (x.to(torch.float32) * scale).to(dtype)


def int8_scale(x: torch.Tensor, dim: int | tuple[int, ...]) -> torch.Tensor:
    """Symmetric int8 scale ``amax / 127`` over ``dim`` (kept as size-1 dims), float32."""
    return x.float().abs().amax(dim=dim, keepdim=True) / 127.0


def quantize_int8(
    x: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:  # int8, same shape as x; scale broadcasts against x
    """``clamp(round(x / scale), -128, 127)``; a zero scale (all-zero input) stores zeros."""
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round(x.float() / safe).clamp_(-128, 127).to(torch.int8)


def quantize_int8_dynamic(
    x: torch.Tensor, dim: int | tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize with a scale computed from ``x`` itself: ``(int8 values, float32 scale)``."""
    scale = int8_scale(x, dim)
    return quantize_int8(x, scale), scale


def dequantize_int8(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return (x.to(torch.float32) * scale).to(dtype)
