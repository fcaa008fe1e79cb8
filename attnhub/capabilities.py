"""Capabilities: what a backend can do, declared as data (as xformers' fmha ops declare theirs).

Selection, refusal messages and the conformance suite's test matrix are all derived from this one
declaration, so a backend never has to describe itself twice.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from attnhub.errors import InvalidInputError, UnknownNameError
from attnhub.quant import probability_quantization, query_quantization
from attnhub.spec import KV_CACHE_DTYPES, AttentionSpec, AttentionType, canonical_kv_cache_dtype

#: Optional features a spec may use and a backend may declare (names used everywhere).
FEATURES = ("sliding_window", "softcap", "alibi", "sinks")


class GraphSupport(enum.IntEnum):
    """How much of a step a backend lets a device graph capture: vLLM's ``AttentionCGSupport``,
    same names, same order."""

    NEVER = 0  # forward reads host data or has data-dependent shapes
    UNIFORM_SINGLE_TOKEN_DECODE = 1  # decode-only batches, one query token per request
    UNIFORM_BATCH = 2  # batches whose requests all have the same query length
    ALWAYS = 3  # any batch, padded to a captured size


class Refusal(str):
    """One reason a backend refuses a spec: the sentence people read (a Refusal *is* that
    string) together with what was refused, so that code never parses the sentence back.

    ``field`` names what is refused: a :class:`Capabilities` field (``"dtype"``, ``"head_size"``,
    ``"block_size"``, ``"kv_cache_dtype"``, ``"attn_types"``, a feature such as ``"softcap"``)
    or, for a backend's own limits, the spec field (``"num_heads"``). ``value`` is the spec's
    value, ``supported`` what would have been accepted (None when a set does not say it).
    A backend explains a refusal in its own terms with :meth:`because`, per field.
    """

    field: str
    value: object
    supported: object

    def __new__(
        cls, sentence: str, *, field: str, value: object = None, supported: object = None
    ) -> Refusal:
        self = super().__new__(cls, sentence)
        self.field, self.value, self.supported = field, value, supported
        return self

    @property
    def sentence(self) -> str:
        return str.__str__(self)

    def because(self, why: str) -> Refusal:
        """The same refusal with the backend's reason appended: ``"... (why)"``."""
        return Refusal(
            f"{self.sentence} ({why})", field=self.field, value=self.value, supported=self.supported
        )

    def __reduce__(self) -> tuple[object, ...]:  # pickles (e.g. across pytest workers) whole
        return (_refusal, (self.sentence, self.field, self.value, self.supported))


def _refusal(sentence: str, field: str, value: object, supported: object) -> Refusal:
    return Refusal(sentence, field=field, value=value, supported=supported)


@dataclass(frozen=True)
class Tolerance:
    """Accepted difference from the float64 reference: |out - ref| <= atol + rtol * |ref|."""

    atol: float
    rtol: float


#: When a declared :class:`AccuracyBound` holds (its default ``condition``).
STATIC_SCALES_COVER = (
    "every static scale covers the values it quantizes (|x| <= scale * the format's largest "
    "stored value: 448 for fp8 e4m3, 127 for int8), as scales from "
    "attnhub.quant.calibrate_kv_scales do; a value beyond it is clipped and the error grows "
    "with the clipped part, unbounded (attnhub.quant.ClipCounter counts clipped values)"
)


@dataclass(frozen=True)
class AccuracyBound:
    """How far a quantized KV cache (and the query quantization that goes with it) may take a
    backend's output from attention over the *unquantized* inputs, on the conformance suite's
    standard cases (N(0, 1) inputs): the largest absolute difference, and the smallest cosine
    similarity of one token's output over all its heads, against the float64 reference.

    The bound holds under ``condition``: by default, that the cache's static scales cover the
    values (:data:`STATIC_SCALES_COVER`); docs/concepts.md shows what clipping costs."""

    max_abs_error: float
    min_cosine: float
    condition: str = STATIC_SCALES_COVER

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_abs_error) and self.max_abs_error > 0):
            raise InvalidInputError(
                f"AccuracyBound.max_abs_error = {self.max_abs_error!r} must be finite and > 0"
            )
        if not (0 < self.min_cosine <= 1):
            raise InvalidInputError(
                f"AccuracyBound.min_cosine = {self.min_cosine!r} must be in (0, 1]"
            )
        if not isinstance(self.condition, str) or not self.condition.strip():
            raise InvalidInputError(
                f"AccuracyBound.condition = {self.condition!r} must say when the bound holds"
            )


#: Why a backend that declares nothing of :class:`LseSupport` returns no LSE.
LSE_NOT_DECLARED = "the backend does not declare that its kernels return it"


@dataclass(frozen=True)
class LseSupport:
    """Where ``forward(..., return_lse=True)`` returns the natural-log LSE of each query row
    from the same kernel call that computes the output (``Capabilities.lse``).

    ``dtypes``: the model dtypes it is returned for (empty: none); ``kv_cache_dtypes``: the
    KV-cache formats (None: every format the backend declares); ``sinks``: False where it is
    not returned for a spec with sinks (a kernel whose LSE is not known to count the sink in
    the denominator); ``reason``: why it is not returned elsewhere (the refusal names the
    kernel, e.g. "vLLM's CPU kernels return no LSE").
    """

    dtypes: frozenset[torch.dtype] = frozenset()
    kv_cache_dtypes: frozenset[str] | None = None
    reason: str = LSE_NOT_DECLARED
    sinks: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise InvalidInputError(f"LseSupport.reason = {self.reason!r} must say why not")
        for kv in self.kv_cache_dtypes or ():
            if canonical_kv_cache_dtype(kv) != kv:
                raise UnknownNameError(
                    f"LseSupport names kv_cache_dtype {kv!r}, which is not a canonical name; "
                    f"known: {', '.join(KV_CACHE_DTYPES)}"
                )

    def refusal(self, spec: AttentionSpec) -> Refusal | None:
        """Why ``forward`` refuses ``return_lse=True`` for ``spec`` (None: it returns it)."""
        if spec.dtype not in self.dtypes:
            return Refusal(
                f"return_lse: the LSE is not returned for dtype {spec.dtype} ({self.reason})",
                field="lse",
                value=spec.dtype,
                supported=self.dtypes,
            )
        if self.kv_cache_dtypes is not None and spec.kv_cache_dtype not in self.kv_cache_dtypes:
            return Refusal(
                f"return_lse: the LSE is not returned with kv_cache_dtype "
                f"{spec.kv_cache_dtype!r} ({self.reason})",
                field="lse",
                value=spec.kv_cache_dtype,
                supported=self.kv_cache_dtypes,
            )
        if spec.use_sinks and not self.sinks:
            return Refusal(
                f"return_lse: the LSE is not returned with sinks ({self.reason})",
                field="lse",
                value="sinks",
            )
        return None


@dataclass(frozen=True)
class Capabilities:
    """A backend's declaration. ``None`` in a set-valued field means "any".

    ``devices`` are device types ("cpu", "cuda", "npu"); ``priority`` ranks backends per device
    type when several can serve a spec (higher wins; a device type absent from ``priority`` gets
    0). ``head_size_multiple`` / ``block_size_multiple`` add a divisibility rule on top of the
    explicit sets.
    """

    devices: frozenset[str] | None
    dtypes: frozenset[torch.dtype]
    head_sizes: frozenset[int] | None = None
    max_head_size: int | None = None
    head_size_multiple: int = 1
    block_sizes: frozenset[int] | None = None
    block_size_multiple: int = 1
    kv_cache_dtypes: frozenset[str] = frozenset({"auto"})
    kv_cache_layout: str = "NHD"
    #: Whether the kernels take K/V planes that are strided views (one tensor holding a slot's
    #: key and value side by side, as vLLM allocates its per-layer cache); False: each plane
    #: must be contiguous (an engine then lays K and V out as two planes).
    strided_kv_cache: bool = True
    #: Whether the kernels need finite values in the slots of a sequence's blocks that lie past
    #: its length (the tail of its last block): kernels that compute on whole blocks and mask the
    #: scores past ``seq_len`` multiply those slots' values by 0, and 0 x NaN is NaN. False:
    #: stale NaN there never reaches the output. Engines that zero new caches and reuse freed
    #: blocks of finite K/V meet the condition; a request that wrote non-finite K/V leaves them
    #: in blocks another request may later get.
    finite_stale_slots: bool = False
    #: The largest ``|score / logits_soft_cap|`` the kernels' soft cap computes without
    #: overflow (None: any). A kernel that evaluates tanh through exp overflows past ~88.7 in
    #: float32 (e^88.7 is float32's largest), and inf / inf is NaN: a score beyond this many
    #: caps, on any key the kernel reads (masked tail slots of a block included), gives NaN
    #: where the math saturates at +-cap. The suite's softcap cases stay within it.
    softcap_score_limit: float | None = None
    attn_types: frozenset[AttentionType] = frozenset({AttentionType.DECODER})
    sliding_window: bool = False
    softcap: bool = False
    alibi: bool = False
    sinks: bool = False
    multi_token_decode: bool = False  # decode requests with query_len > 1 (speculation)
    chunked_prefill: bool = True  # prefill requests with cached context
    cascade: bool = False  # shared-prefix (cascade) attention via common_prefix_len
    graph_capture: GraphSupport = GraphSupport.NEVER
    #: Why the level is what it is (what a higher one would need; a builder may say less for
    #: some specs: ``builder.graph_support``). Shown by ``attnhub list``.
    graph_capture_reason: str = ""
    tolerances: Mapping[torch.dtype, Tolerance] = field(default_factory=dict)
    priority: Mapping[str, int] = field(default_factory=dict)
    #: Per KV-cache format, the :class:`~attnhub.quant.QueryQuantization` scheme (its name)
    #: the kernels apply to the query with that cache; a format absent here leaves the query
    #: as it is. The suite's same-inputs reference then uses the query so quantized.
    query_quantization: Mapping[str, str] = field(default_factory=dict)
    #: Per quantized KV-cache format, how far the output may be from attention over the
    #: unquantized query, keys and values (required where the query is quantized or the cache
    #: is int8; the suite checks it on its standard cases).
    quantization_accuracy: Mapping[str, AccuracyBound] = field(default_factory=dict)
    #: Per KV-cache format, the :class:`~attnhub.quant.ProbabilityQuantization` scheme (its
    #: name) by which the kernels round the softmax probabilities before ``P @ V`` with that
    #: cache (an fp8 V multiplied on fp8 tensor cores); a format absent here keeps them
    #: unrounded. The suite's same-inputs comparison then allows what that rounding can change.
    probability_quantization: Mapping[str, str] = field(default_factory=dict)
    #: Where ``forward(..., return_lse=True)`` also returns each query row's natural-log LSE
    #: (from the same kernel call); the default declares none (every request refused, with
    #: :data:`LSE_NOT_DECLARED` or the backend's own ``reason``).
    lse: LseSupport = field(default_factory=LseSupport)

    def __post_init__(self) -> None:
        for what, mapping in (
            ("query_quantization", self.query_quantization),
            ("quantization_accuracy", self.quantization_accuracy),
            ("probability_quantization", self.probability_quantization),
        ):
            for kv in mapping:
                name = canonical_kv_cache_dtype(kv)
                if name is None or name != kv:
                    raise UnknownNameError(
                        f"{what} names kv_cache_dtype {kv!r}, which is not a canonical name; "
                        f"known: {', '.join(KV_CACHE_DTYPES)}"
                    )
                if kv not in self.kv_cache_dtypes:
                    raise UnknownNameError(
                        f"{what} names kv_cache_dtype {kv!r}, which the capabilities do not "
                        "declare (kv_cache_dtypes)"
                    )
        for scheme in self.query_quantization.values():
            query_quantization(scheme)  # UnknownNameError for a name that is no scheme
        for kv, scheme in self.probability_quantization.items():
            probability_quantization(scheme)
            if kv not in self.quantization_accuracy:
                raise UnknownNameError(
                    f"probability_quantization names kv_cache_dtype {kv!r} without an accuracy "
                    "bound for it (quantization_accuracy): rounded probabilities move the "
                    "output away from attention over the unquantized inputs"
                )
        for kv, bound in self.quantization_accuracy.items():
            if not KV_CACHE_DTYPES[kv].is_quantized and kv not in self.query_quantization:
                raise UnknownNameError(
                    f"quantization_accuracy names kv_cache_dtype {kv!r}, which quantizes "
                    "nothing (neither the cache nor the query)"
                )
            if not isinstance(bound, AccuracyBound):
                raise InvalidInputError(
                    f"quantization_accuracy[{kv!r}] must be an AccuracyBound, got "
                    f"{type(bound).__name__}"
                )

    def accuracy_bound(self, kv_cache_dtype: str) -> AccuracyBound:
        """The declared :class:`AccuracyBound` for ``kv_cache_dtype`` (UnknownNameError if
        none)."""
        try:
            return self.quantization_accuracy[kv_cache_dtype]
        except KeyError:
            declared = ", ".join(self.quantization_accuracy) or "none"
            raise UnknownNameError(
                f"no accuracy bound declared for kv_cache_dtype {kv_cache_dtype!r} "
                f"(declared: {declared})"
            ) from None

    def supports_feature(self, feature: str) -> bool:
        if feature not in FEATURES:
            raise UnknownNameError(f"unknown feature {feature!r}; known: {', '.join(FEATURES)}")
        return bool(getattr(self, feature))

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        try:
            return self.tolerances[dtype]
        except KeyError:
            declared = ", ".join(str(d) for d in self.tolerances) or "none"
            raise UnknownNameError(
                f"no tolerance declared for {dtype} (declared: {declared})"
            ) from None

    def supports_device(self, device_type: str) -> bool:
        return self.devices is None or device_type in self.devices

    def unsupported_reasons(self, spec: AttentionSpec) -> list[Refusal]:
        """Every reason this declaration refuses ``spec`` (empty = supported)."""
        reasons = []
        if spec.dtype not in self.dtypes:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes))
            reasons.append(
                Refusal(
                    f"dtype {spec.dtype} is not supported (supported: {names})",
                    field="dtype",
                    value=spec.dtype,
                    supported=self.dtypes,
                )
            )
        reasons += _size_refusals(
            "head_size",
            spec.head_size,
            self.head_sizes,
            self.head_size_multiple,
            maximum=self.max_head_size,
        )
        reasons += _size_refusals(
            "block_size", spec.block_size, self.block_sizes, self.block_size_multiple
        )
        if spec.kv_cache_dtype not in self.kv_cache_dtypes:
            reasons.append(
                Refusal(
                    f"kv_cache_dtype {spec.kv_cache_dtype!r} is not supported (supported: "
                    + ", ".join(k for k in KV_CACHE_DTYPES if k in self.kv_cache_dtypes)
                    + ")",
                    field="kv_cache_dtype",
                    value=spec.kv_cache_dtype,
                    supported=self.kv_cache_dtypes,
                )
            )
        if spec.attn_type not in self.attn_types:
            reasons.append(
                Refusal(
                    f"attention type {spec.attn_type.value!r} is not supported (supported: "
                    + ", ".join(sorted(t.value for t in self.attn_types))
                    + ")",
                    field="attn_types",
                    value=spec.attn_type,
                    supported=self.attn_types,
                )
            )
        for feature in sorted(spec.features()):
            if not self.supports_feature(feature):
                reasons.append(
                    Refusal(f"feature {feature!r} is not supported", field=feature, value=True)
                )
        return reasons

    def summary(self) -> dict[str, object]:
        """A JSON-friendly view (for ``attnhub list`` and conformance reports)."""

        def names(xs: object) -> object:
            if xs is None:
                return "any"
            return sorted(str(x).removeprefix("torch.") for x in xs)  # type: ignore[attr-defined]

        return {
            "devices": names(self.devices),
            "dtypes": names(self.dtypes),
            "head_sizes": "any" if self.head_sizes is None else sorted(self.head_sizes),
            "max_head_size": self.max_head_size,
            "block_sizes": "any" if self.block_sizes is None else sorted(self.block_sizes),
            "block_size_multiple": self.block_size_multiple,
            "kv_cache_dtypes": [k for k in KV_CACHE_DTYPES if k in self.kv_cache_dtypes],
            "kv_cache_layout": self.kv_cache_layout,
            "strided_kv_cache": self.strided_kv_cache,
            "attn_types": sorted(t.value for t in self.attn_types),
            "features": [f for f in FEATURES if self.supports_feature(f)],
            "multi_token_decode": self.multi_token_decode,
            "chunked_prefill": self.chunked_prefill,
            "cascade": self.cascade,
            "graph_capture": self.graph_capture.name.lower(),
            "graph_capture_reason": self.graph_capture_reason,
            "priority": dict(self.priority),
            "query_quantization": {
                k: self.query_quantization[k]
                for k in KV_CACHE_DTYPES
                if k in self.query_quantization
            },
            "quantization_accuracy": {
                k: {
                    "max_abs_error": b.max_abs_error,
                    "min_cosine": b.min_cosine,
                    "condition": b.condition,
                }
                for k, b in self.quantization_accuracy.items()
            },
            "probability_quantization": {
                k: self.probability_quantization[k]
                for k in KV_CACHE_DTYPES
                if k in self.probability_quantization
            },
            "lse": {
                "dtypes": names(self.lse.dtypes),
                "kv_cache_dtypes": names(self.lse.kv_cache_dtypes),
                **({} if self.lse.sinks else {"sinks": False}),
                **({} if self.lse.dtypes and self.lse.sinks else {"reason": self.lse.reason}),
            },
        }


def _size_refusals(
    name: str,
    value: int,
    allowed: frozenset[int] | None,
    multiple: int,
    maximum: int | None = None,
) -> list[Refusal]:
    """Why a size (head_size, block_size) is refused: not one of ``allowed``, above
    ``maximum``, not a multiple of ``multiple`` (empty = accepted)."""
    reasons = []
    if allowed is not None and value not in allowed:
        reasons.append(
            Refusal(
                f"{name} {value} is not one of {sorted(allowed)}",
                field=name,
                value=value,
                supported=allowed,
            )
        )
    if maximum is not None and value > maximum:
        reasons.append(
            Refusal(f"{name} {value} exceeds the maximum {maximum}", field=name, value=value)
        )
    if value % multiple:
        reasons.append(
            Refusal(f"{name} {value} is not a multiple of {multiple}", field=name, value=value)
        )
    return reasons
