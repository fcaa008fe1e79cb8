"""Quantization math of the quantized KV caches (see ``attnhub.spec.KV_CACHE_DTYPES``).

fp8: per-tensor scale, stored ``fp8(clamp(x / scale, -max, max))``, read back as ``fp8 * scale``.
int8: symmetric, ``scale = amax / 127`` over the reduced dimension(s) (or a given static scale),
stored ``clamp(round(x / scale), -128, 127)``, read back as ``int8 * scale``.

Some kernels quantize the *query* too before attending over a quantized cache; what they do to
it is a named :class:`QueryQuantization` scheme, which a backend declares per KV-cache format
(``Capabilities.query_quantization``) and which :func:`simulate_query_quantization` reproduces,
so that the reference can be computed from the query the kernels actually use.
"""

from __future__ import annotations

import enum
from typing import TypeVar

import torch

from attnhub.errors import InvalidInputError, UnknownNameError

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


# --- query quantization ---------------------------------------------------------------------


class QueryQuantization(str, enum.Enum):
    """What a backend's kernels do to the query before attending (the value is the name
    backends declare in ``Capabilities.query_quantization``).

    A scheme describes the query only. A kernel that also rounds intermediate values, e.g. the
    softmax probabilities before ``P @ V`` (as an fp8 tensor-core path whose V is fp8 must),
    is not described by it: the same-inputs reference would not reproduce that rounding."""

    #: Dynamic symmetric int8 per (token, head): ``scale = amax / 127`` over ``head_size``,
    #: ``q = clamp(round(x / scale), -128, 127)`` (round half to even, as ``torch.round``), the
    #: kernels then compute with ``q * scale``; an all-zero head gets scale 0 and stores zeros.
    INT8_PER_TOKEN_HEAD = "int8_per_token_head"
    #: Static fp8 e4m3 with one per-tensor scale set with the model (default 1.0, vLLM's
    #: ``q_scale`` when the checkpoint has none): ``fp8(clamp(x / scale, -448, 448))``, the
    #: kernels then compute with ``fp8 * scale``, as with the fp8 KV caches.
    FP8_STATIC = "fp8_static"


#: Every scheme by name, with what it does in one line (``attnhub list`` and docs).
QUERY_QUANTIZATIONS: dict[str, str] = {
    QueryQuantization.INT8_PER_TOKEN_HEAD.value: (
        "int8, dynamic symmetric scale amax/127 per (token, head), round half to even"
    ),
    QueryQuantization.FP8_STATIC.value: "fp8 e4m3 with a static per-tensor scale (default 1.0)",
}


_Scheme = TypeVar("_Scheme", bound=enum.Enum)


def _scheme(kind: type[_Scheme], name: object, what: str, known: dict[str, str]) -> _Scheme:
    try:
        return kind(name)
    except ValueError:
        raise UnknownNameError(f"{what} {name!r} is unknown; known: {', '.join(known)}") from None


def query_quantization(name: str | QueryQuantization) -> QueryQuantization:
    """The scheme called ``name``; :class:`~attnhub.errors.UnknownNameError` for another."""
    return _scheme(QueryQuantization, name, "query quantization", QUERY_QUANTIZATIONS)


def simulate_query_quantization(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    scheme: str | QueryQuantization,
    *,
    scale: float = 1.0,  # fp8_static only: the static query scale
) -> torch.Tensor:  # float64, same shape
    """The query as kernels applying ``scheme`` compute with: quantized, then dequantized in
    float64 (exact: an int8 or fp8 value times a float32 scale is representable)."""
    kind = query_quantization(scheme)
    if query.dim() != 3:
        raise InvalidInputError(
            f"query must be [num_tokens, num_heads, head_size], got shape {tuple(query.shape)}"
        )
    if kind is QueryQuantization.INT8_PER_TOKEN_HEAD:
        q8, s = quantize_int8_dynamic(query, dim=-1)
        return q8.to(torch.float64) * s.to(torch.float64)
    stored = quantize_fp8(query, scale, torch.float8_e4m3fn)
    return stored.to(torch.float64) * float(torch.tensor(scale, dtype=torch.float32))


# --- probability quantization ---------------------------------------------------------------


class ProbabilityQuantization(str, enum.Enum):
    """What a backend's kernels do to the softmax probabilities ``P`` before ``P @ V`` (the
    value is the name backends declare in ``Capabilities.probability_quantization``).

    A kernel whose ``V`` is fp8 multiplies ``P`` on the same fp8 tensor cores, so it rounds
    ``P`` to fp8 first; the normalizing sum (and the LSE) still come from the unrounded
    values. Where the kernel rounds relative to a *running* maximum (an online softmax over
    key tiles), which values round how depends on its tiling: the same-inputs reference
    models the rounding with the row's maximum over all its keys
    (:func:`round_probabilities`), and the suite bounds what the tiling can change with
    :func:`probability_error_bound`."""

    #: FlashAttention-3's fp8 path: ``exp`` of the scores relative to the (running) row
    #: maximum, times ``2**8`` (``Max_offset = 8``, so that the largest is 256 and small
    #: probabilities stay out of e4m3's subnormals), rounded to fp8 e4m3 (round to nearest
    #: even) before ``P @ V`` [source: hopper/softmax.h, flash_fwd_kernel_sm90.h].
    FP8_E4M3 = "fp8_e4m3"


#: Every probability scheme by name, with what it does in one line.
PROBABILITY_QUANTIZATIONS: dict[str, str] = {
    ProbabilityQuantization.FP8_E4M3.value: (
        "softmax probabilities scaled so the row maximum is 2**8, rounded to fp8 e4m3 before "
        "P @ V (FlashAttention-3's fp8 path)"
    ),
}

#: FP8_E4M3: the scaled maximum (2**Max_offset) and e4m3's unit roundoff (3 mantissa bits).
_FP8_PROB_MAX = 2.0**8
_E4M3_UNIT_ROUNDOFF = 2.0**-4
#: e4m3's largest absolute rounding error below its smallest normal 2**-6 (half the 2**-9
#: subnormal spacing), in units of the scaled maximum: 2**-10 / 2**8.
_E4M3_SUBNORMAL_ERROR = 2.0**-10 / _FP8_PROB_MAX


def probability_quantization(name: str | ProbabilityQuantization) -> ProbabilityQuantization:
    """The scheme called ``name``; :class:`~attnhub.errors.UnknownNameError` for another."""
    return _scheme(
        ProbabilityQuantization, name, "probability quantization", PROBABILITY_QUANTIZATIONS
    )


def round_probabilities(
    p: torch.Tensor,  # [..., keys] normalized softmax probabilities (rows may hold a sink's share)
    scheme: str | ProbabilityQuantization,
) -> torch.Tensor:  # same shape and dtype
    """``p`` as a kernel applying ``scheme`` with the row's maximum over all keys multiplies
    ``V`` with: each row scaled so that its largest probability is ``2**8``, rounded to e4m3,
    scaled back. A row of zeros (it sees no key) stays zero."""
    probability_quantization(scheme)
    top = p.amax(dim=-1, keepdim=True)
    unit = torch.where(top > 0, top / _FP8_PROB_MAX, torch.ones_like(top))
    scaled = (p / unit).to(torch.float32).to(torch.float8_e4m3fn)
    return scaled.to(p.dtype) * unit


def probability_error_bound(
    p: torch.Tensor,  # [..., keys] normalized softmax probabilities
    scheme: str | ProbabilityQuantization,
) -> torch.Tensor:  # same shape: the largest |rounded - p| any tiling of the kernel can give
    """How far ``scheme`` can move each probability, whatever running maximum the kernel
    rounds it against: ``u * p`` in e4m3's normal range (``u = 2**-4``), and in its
    subnormal range at most ``min(p, 2**-18)``; a running maximum is never above the row's,
    and an unrounded normalizing sum is at least that maximum's share, so both hold in
    normalized units. Multiplied into ``|V|`` (``P @ |V|``) it bounds the output's change."""
    probability_quantization(scheme)
    return _E4M3_UNIT_ROUNDOFF * p + p.clamp(max=_E4M3_SUBNORMAL_ERROR)
