"""AttentionSpec: one attention layer's configuration, validated and normalized on construction.

Window convention (vLLM's, shared by every backend): ``sliding_window=W`` lets a decoder query see
W keys including itself, i.e. the pair ``window=(W-1, 0)``; for non-causal attention types it is
``(W-1, W-1)``. ``(-1, -1)`` means no window. Either form may be given; both are normalized and a
disagreement between them is an error.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from attnhub.errors import InvalidSpecError


class AttentionType(str, enum.Enum):
    """What a layer attends over (vLLM's ``AttentionType``)."""

    DECODER = "decoder"  # causal self-attention over the paged cache
    ENCODER = "encoder"  # non-causal self-attention of an encoder-decoder model's encoder
    ENCODER_ONLY = "encoder_only"  # non-causal self-attention (BERT-like models)
    ENCODER_DECODER = "encoder_decoder"  # cross-attention: decoder queries, encoder keys

    @property
    def is_causal(self) -> bool:
        return self is AttentionType.DECODER


@dataclass(frozen=True)
class KVCacheDType:
    """One row of the quantized-cache table: what a ``kv_cache_dtype`` name stores and how.

    ``key_scale`` / ``value_scale`` say how the dequantization scale is laid out:
    ``"none"`` (unquantized), ``"tensor"`` (one float32 scalar for the whole cache, set by the
    engine), ``"slot"`` (one float32 per written token and kv head, computed at write time as
    amax/127 over the head), ``"channel"`` (a static float32 [num_kv_heads, head_size], loaded
    with the model).
    """

    name: str
    key_dtype: torch.dtype | None  # None: the model dtype (spec.dtype)
    value_dtype: torch.dtype | None
    key_scale: str
    value_scale: str
    description: str

    @property
    def is_quantized(self) -> bool:
        return self.key_scale != "none" or self.value_scale != "none"

    def storage_dtypes(self, model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        return (self.key_dtype or model_dtype, self.value_dtype or model_dtype)


#: The vendor-neutral names of KV-cache storage formats. Backends declare which they support.
KV_CACHE_DTYPES: dict[str, KVCacheDType] = {
    row.name: row
    for row in (
        KVCacheDType("auto", None, None, "none", "none", "keys and values in the model dtype"),
        KVCacheDType(
            "fp8_e4m3",
            torch.float8_e4m3fn,
            torch.float8_e4m3fn,
            "tensor",
            "tensor",
            "fp8 e4m3 keys and values, stored as fp8(x / scale) saturated at +-448, "
            "one per-tensor scale each (vLLM's fp8)",
        ),
        KVCacheDType(
            "fp8_e5m2",
            torch.float8_e5m2,
            torch.float8_e5m2,
            "tensor",
            "tensor",
            "fp8 e5m2 keys and values, per-tensor scale each",
        ),
        KVCacheDType(
            "int8",
            torch.int8,
            torch.int8,
            "slot",
            "channel",
            "symmetric int8 keys and values (stored clamp(round(x / scale), -128, 127)): key "
            "scale per written (token, kv head) = amax/127 over the head, stored per slot; value "
            "scale static per (kv head, channel), set by the engine like a weight",
        ),
        KVCacheDType(
            "int8_k",
            torch.int8,
            None,
            "slot",
            "none",
            "symmetric int8 keys as in 'int8' (scale per written token and kv head, stored per "
            "slot), values in the model dtype",
        ),
    )
}

#: Accepted spellings that mean the same row.
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"}

MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def canonical_kv_cache_dtype(name: object) -> str | None:
    """The canonical :data:`KV_CACHE_DTYPES` name for ``name`` or one of its aliases
    (``"fp8"`` -> ``"fp8_e4m3"``); None for a name that is neither."""
    if not isinstance(name, str):
        return None
    name = KV_CACHE_DTYPE_ALIASES.get(name, name)
    return name if name in KV_CACHE_DTYPES else None


def normalize_window(
    sliding_window: int | None,
    window: tuple[int, int] | None,
    attn_type: AttentionType,
) -> tuple[tuple[int, int], int | None]:
    """Return ``(window pair, sliding_window)`` in normal form, or raise InvalidSpecError.

    The pair is ``(left, right)``: keys visible to the query at aligned position p are
    ``p - left .. p + right``; -1 on a side means unbounded. Causal types always have right 0
    (or -1 with no window at all).
    """
    causal = attn_type.is_causal
    from_w: tuple[int, int] | None = None
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
            raise InvalidSpecError(f"sliding_window must be an int, got {sliding_window!r}")
        if sliding_window < 1:
            raise InvalidSpecError(
                f"sliding_window = {sliding_window} must be >= 1 (keys visible incl. self)"
            )
        left = sliding_window - 1
        from_w = (left, 0) if causal else (left, left)
    from_pair: tuple[int, int] | None = None
    # (-1, -1) is "no window", the normal form of window=None: it never conflicts with a
    # sliding_window, so dataclasses.replace(spec, sliding_window=W) works on a windowless spec.
    if window is not None and tuple(window) != (-1, -1):
        try:
            left, right = (int(x) for x in window)
        except (TypeError, ValueError):
            raise InvalidSpecError(f"window must be a pair (left, right), got {window!r}") from None
        if left < -1 or right < -1:
            raise InvalidSpecError(f"window = {window!r}: each side is -1 (unbounded) or >= 0")
        if causal:
            if right > 0:
                raise InvalidSpecError(
                    f"window = {window!r}: a causal ({attn_type.value}) layer sees no future "
                    "keys, so the right side must be 0 or -1"
                )
            right = 0 if left >= 0 else -1
        from_pair = (left, right)
    if from_w is not None and from_pair is not None and from_w != from_pair:
        raise InvalidSpecError(
            f"sliding_window = {sliding_window} means window {from_w} for a "
            f"{attn_type.value} layer, but window = {window!r} was given"
        )
    pair = from_w or from_pair or (-1, -1)
    if pair == (-1, -1):
        return pair, None
    left, right = pair
    if causal:
        derived = left + 1 if left >= 0 else None
    else:
        derived = left + 1 if left == right and left >= 0 else None
    return pair, derived


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer's configuration. Immutable and validated on construction.

    Every field has its final type once constructed: ``scale`` the softmax scale (None or
    left out: ``head_size ** -0.5``), ``head_size_v`` the value head size (None or left out:
    ``head_size``; another size is what MLA's expanded prefill needs, keys 192 and values 128 in
    DeepSeek: vLLM's ``head_size_v``; like ``scale``, it keeps its value through
    ``dataclasses.replace(spec, head_size=...)`` unless ``head_size_v=None`` is passed too),
    ``attn_type`` an :class:`AttentionType` (its string value
    is accepted), ``kv_cache_dtype`` a canonical name from :data:`KV_CACHE_DTYPES` (aliases such
    as ``"fp8"`` accepted), ``window`` the normalized ``(left, right)`` pair (None accepted) and
    ``sliding_window`` the W it stands for, when it is one.
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    scale: float = None  # type: ignore[assignment]  # None: head_size ** -0.5
    attn_type: AttentionType = AttentionType.DECODER
    sliding_window: int | None = None
    window: tuple[int, int] = (-1, -1)
    logits_soft_cap: float | None = None
    use_alibi: bool = False
    use_sinks: bool = False
    #: Ask for bitwise batch invariance: a request's output has the same bits whatever else is
    #: in the step and wherever it sits (vLLM's VLLM_BATCH_INVARIANT, per layer). Served only
    #: by a backend that declares it for the spec's dtype (``Capabilities.batch_invariant``);
    #: the others refuse the spec with their reason.
    batch_invariant: bool = False
    head_size_v: int = None  # type: ignore[assignment]  # None: head_size

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if not isinstance(self.batch_invariant, bool):
            raise InvalidSpecError(f"batch_invariant = {self.batch_invariant!r} must be a bool")
        if self.head_size_v is None:
            set_(self, "head_size_v", self.head_size)
        for name in ("num_heads", "num_kv_heads", "head_size", "head_size_v", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidSpecError(f"{name} = {value!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise InvalidSpecError(
                f"num_heads = {self.num_heads} is not a multiple of "
                f"num_kv_heads = {self.num_kv_heads}"
            )
        if self.dtype not in MODEL_DTYPES:
            raise InvalidSpecError(
                f"dtype = {self.dtype!r} is not a model dtype (one of float32, float16, bfloat16)"
            )
        try:
            attn_type = AttentionType(self.attn_type)
        except ValueError:
            names = ", ".join(t.value for t in AttentionType)
            raise InvalidSpecError(
                f"attn_type = {self.attn_type!r} is not one of {names}"
            ) from None
        set_(self, "attn_type", attn_type)
        kv = canonical_kv_cache_dtype(self.kv_cache_dtype)
        if kv is None:
            raise InvalidSpecError(
                f"kv_cache_dtype = {self.kv_cache_dtype!r} is unknown; known: "
                + ", ".join(KV_CACHE_DTYPES)
            )
        set_(self, "kv_cache_dtype", kv)
        scale = self.head_size**-0.5 if self.scale is None else self.scale
        if (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float))
            or not 0 < scale < math.inf
        ):
            raise InvalidSpecError(f"scale = {self.scale!r} must be a positive finite float")
        set_(self, "scale", float(scale))
        cap = self.logits_soft_cap
        if cap is not None and cap != 0:
            if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf:
                raise InvalidSpecError(
                    f"logits_soft_cap = {cap!r} must be finite and > 0 (or None)"
                )
            set_(self, "logits_soft_cap", float(cap))
        else:
            set_(self, "logits_soft_cap", None)
        pair, sliding = normalize_window(self.sliding_window, self.window, attn_type)
        set_(self, "window", pair)
        set_(self, "sliding_window", sliding)

    # --- derived facts ---------------------------------------------------------------------
    @property
    def causal(self) -> bool:
        return self.attn_type.is_causal

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_cache_format(self) -> KVCacheDType:
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def distinct_head_size_v(self) -> bool:
        """Whether values have another head size than keys (``head_size_v != head_size``)."""
        return self.head_size_v != self.head_size

    @property
    def has_window(self) -> bool:
        return self.window != (-1, -1)

    def features(self) -> set[str]:
        """The optional features this spec uses, by the names Capabilities declares."""
        used = set()
        if self.has_window:
            used.add("sliding_window")
        if self.logits_soft_cap is not None:
            used.add("softcap")
        if self.use_alibi:
            used.add("alibi")
        if self.use_sinks:
            used.add("sinks")
        return used
