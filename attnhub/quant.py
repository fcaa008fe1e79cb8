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
from collections.abc import Iterable
from typing import Any, NamedTuple, TypeVar

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

    #: ``exp`` of the scores relative to the (running) row maximum, times ``2**8`` (so that
    #: the largest is 256 and small probabilities stay out of e4m3's subnormals), rounded to
    #: fp8 e4m3 (round to nearest even) before ``P @ V``. Which kernels do this, and where
    #: their sources say so, is each backend's to document (its capabilities declare it).
    FP8_E4M3 = "fp8_e4m3"
    #: ``exp`` of the scores relative to the (running) row maximum, *not* scaled (the largest
    #: is 1), rounded to fp8 e4m3 (round to nearest even) before ``P @ V``: probabilities below
    #: e4m3's smallest normal ``2**-6`` keep the subnormals' absolute steps of ``2**-9``, and
    #: those below ``2**-10`` become 0. Which kernels do this is each backend's to document.
    FP8_E4M3_UNSCALED = "fp8_e4m3_unscaled"


#: Every probability scheme by name, with what it does in one line.
PROBABILITY_QUANTIZATIONS: dict[str, str] = {
    ProbabilityQuantization.FP8_E4M3.value: (
        "softmax probabilities scaled so the row maximum is 2**8, rounded to fp8 e4m3 before P @ V"
    ),
    ProbabilityQuantization.FP8_E4M3_UNSCALED.value: (
        "softmax probabilities relative to the row maximum (1), rounded to fp8 e4m3 before P @ V"
    ),
}

#: Per scheme, the value the row maximum is scaled to before the rounding (FP8_E4M3: 2**8).
_FP8_PROB_MAX = {
    ProbabilityQuantization.FP8_E4M3: 2.0**8,
    ProbabilityQuantization.FP8_E4M3_UNSCALED: 1.0,
}
#: e4m3's unit roundoff (3 mantissa bits).
_E4M3_UNIT_ROUNDOFF = 2.0**-4
#: e4m3's largest absolute rounding error below its smallest normal 2**-6 (half the 2**-9
#: subnormal spacing); in units of the scaled maximum it is divided by that maximum.
_E4M3_SUBNORMAL_ERROR = 2.0**-10


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
    ``V`` with: each row scaled so that its largest probability is ``2**8`` (``FP8_E4M3``) or
    1 (``FP8_E4M3_UNSCALED``), rounded to e4m3, scaled back. A row of zeros (it sees no key)
    stays zero."""
    kind = probability_quantization(scheme)
    top = p.amax(dim=-1, keepdim=True)
    unit = torch.where(top > 0, top / _FP8_PROB_MAX[kind], torch.ones_like(top))
    scaled = (p / unit).to(torch.float32).to(torch.float8_e4m3fn)
    return scaled.to(p.dtype) * unit


def probability_error_bound(
    p: torch.Tensor,  # [..., keys] normalized softmax probabilities
    scheme: str | ProbabilityQuantization,
) -> torch.Tensor:  # same shape: the largest |rounded - p| any tiling of the kernel can give
    """How far ``scheme`` can move each probability, whatever running maximum the kernel
    rounds it against: ``u * p`` in e4m3's normal range (``u = 2**-4``), and in its
    subnormal range at most ``min(p, 2**-10 / M)`` with ``M`` the scaled maximum (``2**-18``
    for ``FP8_E4M3``, ``2**-10`` for ``FP8_E4M3_UNSCALED``); a running maximum is never above
    the row's, and an unrounded normalizing sum is at least that maximum's share, so both hold
    in normalized units. Multiplied into ``|V|`` (``P @ |V|``) it bounds the output's
    change."""
    kind = probability_quantization(scheme)
    return _E4M3_UNIT_ROUNDOFF * p + p.clamp(max=_E4M3_SUBNORMAL_ERROR / _FP8_PROB_MAX[kind])


# --- static scales: calibration and clipping ------------------------------------------------
#
# A quantized cache whose scale is static (fp8's per-tensor scales, int8's per-channel value
# scale: set with the model like a weight) stores ``x / scale`` saturated at the format's
# largest value: a value beyond ``scale * limit`` is clipped, and attention over it is off by
# as much as the clipped part. A backend's declared accuracy bound (``AccuracyBound``) holds
# where the static scales cover the values; dynamic scales (int8 keys: ``amax / 127`` per
# written token) never clip.

#: The largest stored magnitude of each quantized storage dtype (int8: 127, the symmetric
#: range; -128 is stored only by rounding).
STATIC_LIMITS: dict[torch.dtype, float] = {
    torch.float8_e4m3fn: float(torch.finfo(torch.float8_e4m3fn).max),  # 448
    torch.float8_e5m2: float(torch.finfo(torch.float8_e5m2).max),  # 57344
    torch.int8: 127.0,
}

#: The planes of a KV-cache format whose scales are static (set by the engine), by kind.
_STATIC_KINDS = ("tensor", "channel")


def _format(kv_cache_dtype: str):  # type: ignore[no-untyped-def]  # -> attnhub.spec.KVCacheDType
    from attnhub.spec import KV_CACHE_DTYPES, canonical_kv_cache_dtype

    canonical = canonical_kv_cache_dtype(kv_cache_dtype)
    if canonical is None:
        raise UnknownNameError(
            f"kv_cache_dtype {kv_cache_dtype!r} is unknown; known: {', '.join(KV_CACHE_DTYPES)}"
        )
    return KV_CACHE_DTYPES[canonical]


def _samples(x: torch.Tensor | Iterable[torch.Tensor], name: str) -> list[torch.Tensor]:
    items = [x] if isinstance(x, torch.Tensor) else list(x)
    if not items:
        raise InvalidInputError(f"{name}: no sample activations were given")
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or not t.is_floating_point():
            what = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t)
            raise InvalidInputError(
                f"{name}[{i}] must be a float tensor [num_tokens, num_kv_heads, head_size], "
                f"got {what}"
            )
        if t.shape[1:] != items[0].shape[1:]:
            raise InvalidInputError(
                f"{name}[{i}] has shape {tuple(t.shape)}, {name}[0] {tuple(items[0].shape)}"
            )
    return items


def calibrate_kv_scales(
    kv_cache_dtype: str,
    keys: torch.Tensor | Iterable[torch.Tensor],  # [num_tokens, num_kv_heads, head_size] each
    values: torch.Tensor | Iterable[torch.Tensor],
    *,
    margin: float = 1.0,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # (key_scale, value_scale), float32
    """Static scales for a quantized cache from sample activations (one layer's keys and
    values over calibration batches): for each plane whose scale is static, the scale that
    makes the largest sample magnitude times ``margin`` the format's largest stored value
    (``amax * margin / limit``, :data:`STATIC_LIMITS`), so that values like the samples are
    never clipped. Per the format's scale kind: "tensor" a 0-d tensor, "channel"
    ``[num_kv_heads, head_size]``; None for a plane whose scale is dynamic or absent. A channel
    that is zero in every sample gets the scale that covers ``|x| <= margin``.

    Copy them into the cache's planes (``cache.value_scale.copy_(value_scale)``) as an engine
    loads a checkpoint's scales. ``margin > 1`` leaves headroom for activations larger than
    the samples (at the cost of resolution: the step grows by the same factor)."""
    fmt = _format(kv_cache_dtype)
    if not (isinstance(margin, (int, float)) and not isinstance(margin, bool) and margin >= 1):
        raise InvalidInputError(f"margin = {margin!r} must be a number >= 1")
    out: list[torch.Tensor | None] = []
    for name, samples, kind, dtype in (
        ("keys", keys, fmt.key_scale, fmt.key_dtype),
        ("values", values, fmt.value_scale, fmt.value_dtype),
    ):
        items = _samples(samples, name)
        if kind not in _STATIC_KINDS or dtype is None:
            out.append(None)
            continue
        dims: tuple[int, ...] = (0, 1, 2) if kind == "tensor" else (0,)
        amax = torch.stack([t.detach().float().abs().amax(dim=dims) for t in items]).amax(0)
        amax = torch.where(amax > 0, amax, torch.ones_like(amax)) * margin
        out.append((amax / STATIC_LIMITS[dtype]).to(torch.float32))
    return out[0], out[1]


class ClipCount(NamedTuple):
    """One layer's clipped values since counting began: how many values a static scale did
    not cover (stored saturated) out of how many were written, per plane."""

    key_clipped: int
    key_written: int
    value_clipped: int
    value_written: int

    @property
    def clipped(self) -> int:
        return self.key_clipped + self.value_clipped

    @property
    def fraction(self) -> float:
        written = self.key_written + self.value_written
        return self.clipped / written if written else 0.0


class LayerClipCounter:
    """Counts, on the device, the values one layer writes that its cache's static scales
    clip. Opt in with ``impl.clip_counter = counter`` (or :meth:`ClipCounter.watch`); every
    KV write of the layer then adds a few device ops (no host read, no sync: graph-safe);
    :meth:`read` copies the totals to the host, when asked."""

    def __init__(self) -> None:
        #: [4] int64 on the cache's device: key clipped, key written, value clipped, value
        #: written (None until the first write).
        self.totals: torch.Tensor | None = None

    def add(
        self,
        key: torch.Tensor,  # [n, num_kv_heads, head_size], the rows being written
        value: torch.Tensor,
        slot_mapping: torch.Tensor,  # [n] int, -1 = not written
        cache: Any,  # PagedKVCache
    ) -> None:
        fmt = _format(cache.kv_cache_dtype)
        totals = self.totals
        if totals is None or totals.device != key.device:
            totals = self.totals = torch.zeros(4, dtype=torch.int64, device=key.device)
        written = (slot_mapping >= 0)[:, None, None]  # [n, 1, 1]
        planes = (
            (0, key, fmt.key_scale, fmt.key_dtype, cache.key_scale),
            (2, value, fmt.value_scale, fmt.value_dtype, cache.value_scale),
        )
        for at, x, kind, dtype, scale in planes:
            if kind not in _STATIC_KINDS or dtype is None or scale is None:
                continue
            q = x.float() / scale
            if dtype == torch.int8:  # stored clamp(round(x / scale), -128, 127)
                r = torch.round(q)
                clipped = (r > 127) | (r < -128)
            else:  # stored fp8(clamp(x / scale, -max, max))
                clipped = q.abs() > STATIC_LIMITS[dtype]
            totals[at] += (clipped & written).sum()
            totals[at + 1] += written.sum() * (x.shape[1] * x.shape[2])

    def read(self) -> ClipCount:
        """The totals, copied to the host (a device-to-host sync: call it when asked, not per
        step)."""
        if self.totals is None:
            return ClipCount(0, 0, 0, 0)
        k, kw, v, vw = (int(x) for x in self.totals.tolist())
        return ClipCount(k, kw, v, vw)

    def reset(self) -> None:
        if self.totals is not None:
            self.totals.zero_()


class ClipCounter:
    """Clipped-value counts of a model's layers, by name: an opt-in diagnostic for static
    scales that do not cover the activations (a miscalibrated checkpoint), which would
    otherwise lose accuracy without a sign. ::

        counter = attnhub.quant.ClipCounter()
        for name, impl in layers.items():
            counter.watch(name, impl)
        ...  # serve steps: counting stays on the device
        counter.counts()  # {"layers.0": ClipCount(...), ...}: read here, when asked
    """

    def __init__(self) -> None:
        self.layers: dict[str, LayerClipCounter] = {}

    def watch(self, name: str, impl: Any) -> LayerClipCounter:
        """Count the clipped values ``impl`` (an AttentionImpl) writes, as layer ``name``."""
        if name in self.layers:
            raise InvalidInputError(f"layer {name!r} is already watched")
        layer = self.layers[name] = LayerClipCounter()
        impl.clip_counter = layer
        return layer

    def counts(self) -> dict[str, ClipCount]:
        """Every watched layer's totals (one host read per layer)."""
        return {name: layer.read() for name, layer in self.layers.items()}

    def reset(self) -> None:
        for layer in self.layers.values():
            layer.reset()
