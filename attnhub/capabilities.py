"""Capabilities: what a backend can do, declared as data (as xformers' fmha ops declare theirs).

Selection, refusal messages and the conformance suite's test matrix are all derived from this one
declaration, so a backend never has to describe itself twice.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from attnhub.errors import InvalidInputError, UnknownNameError
from attnhub.quant import probability_quantization, query_quantization
from attnhub.spec import KV_CACHE_DTYPES, AttentionSpec, AttentionType, canonical_kv_cache_dtype

if TYPE_CHECKING:
    from attnhub.mla import MLASpec

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


def _check_declaration(
    owner: str, reason: object, kv_cache_dtypes: Iterable[str] | None = None
) -> None:
    """A declaration's ``reason`` says why not, and each KV-cache format it names is a
    canonical name (InvalidInputError / UnknownNameError naming ``owner``)."""
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidInputError(f"{owner}.reason = {reason!r} must say why not")
    for kv in kv_cache_dtypes or ():
        if canonical_kv_cache_dtype(kv) != kv:
            raise UnknownNameError(
                f"{owner} names kv_cache_dtype {kv!r}, which is not a canonical name; "
                f"known: {', '.join(KV_CACHE_DTYPES)}"
            )


def _dtype_or_format_refusal(
    spec: AttentionSpec | MLASpec,
    field_name: str,
    refused: str,
    dtypes: frozenset[torch.dtype],
    kv_cache_dtypes: frozenset[str] | None,
    reason: str,
) -> Refusal | None:
    """Why ``spec`` falls outside a declaration of dtypes and KV-cache formats (None: inside):
    ``"{refused} for dtype ..."`` or ``"{refused} with kv_cache_dtype ..."``, with ``reason``."""
    if spec.dtype not in dtypes:
        return Refusal(
            f"{refused} for dtype {spec.dtype} ({reason})",
            field=field_name,
            value=spec.dtype,
            supported=dtypes,
        )
    if kv_cache_dtypes is not None and spec.kv_cache_dtype not in kv_cache_dtypes:
        return Refusal(
            f"{refused} with kv_cache_dtype {spec.kv_cache_dtype!r} ({reason})",
            field=field_name,
            value=spec.kv_cache_dtype,
            supported=kv_cache_dtypes,
        )
    return None


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
        _check_declaration("LseSupport", self.reason, self.kv_cache_dtypes)

    def refusal(self, spec: AttentionSpec | MLASpec) -> Refusal | None:
        """Why ``forward`` refuses ``return_lse=True`` for ``spec`` (None: it returns it)."""
        outside = _dtype_or_format_refusal(
            spec, "lse", "return_lse: the LSE is not returned", self.dtypes,
            self.kv_cache_dtypes, self.reason,
        )  # fmt: skip
        if outside is not None:
            return outside
        if not self.sinks and getattr(spec, "use_sinks", False):  # (an MLA layer has none)
            return Refusal(
                f"return_lse: the LSE is not returned with sinks ({self.reason})",
                field="lse",
                value="sinks",
            )
        return None


#: Why a backend that declares nothing of :class:`MlaSupport` serves no MLA layer.
MLA_NOT_DECLARED = "not wired yet (the backend declares no Capabilities.mla)"


@dataclass(frozen=True)
class MlaSupport:
    """Which MLA layers (:class:`attnhub.mla.MLASpec`) a backend serves in the absorbed form
    (``Capabilities.mla``): multi-query attention of every head over the latent cache, queries
    ``[T, H, kv_lora_rank + qk_rope_head_dim]`` in, latent outputs ``[T, H, kv_lora_rank]``
    out (vLLM's ``MLACommonImpl.forward_mqa``). The default serves none.

    ``dtypes``: model dtypes (empty: no MLA at all, for ``reason``); ``kv_cache_dtypes``:
    latent-cache formats (``attnhub.mla.LATENT_KV_CACHE_DTYPES``); ``block_sizes`` /
    ``block_size_multiple`` as for standard attention; ``latent_sizes``: the
    ``(kv_lora_rank, qk_rope_head_dim)`` pairs the kernels are built for (None: any);
    ``num_heads``: the query head counts the kernels take (None: any; FIA's MLA form takes
    32, 64 or 128);
    ``layouts``: the latent-cache layouts the kernels read (``attnhub.mla.LATENT_LAYOUTS``),
    the first the one ``allocate_kv_cache`` makes; ``max_query_len``: the longest query of a
    request (None: any, causal bottom-right, chunked prefill with context included; 1:
    decode only); ``lse``: where ``forward(return_lse=True)`` returns the LSE;
    ``tolerances``: per dtype, against the float64 reference (absent: the backend's own);
    ``query_quantization`` / ``probability_quantization``: per fp8 latent format, what the
    kernels do to the query before attending over it and to the softmax probabilities before
    ``P @ V`` (the schemes of ``attnhub.quant``, as ``Capabilities`` names them for standard
    attention; absent: the query and the probabilities as they are), and
    ``quantization_accuracy``: per such format, how far the output may be from the absorbed
    form over the unquantized query and the latents as stored (required where either is
    declared); ``because``: per refused field (``"mla.dtype"``, ``"mla.kv_cache_dtype"``,
    ``"mla.block_size"``, ``"mla.latent_size"``, ``"mla.num_heads"``), the backend's reason,
    appended to the sentence (:meth:`Refusal.because`)."""

    dtypes: frozenset[torch.dtype] = frozenset()
    kv_cache_dtypes: frozenset[str] = frozenset({"auto"})
    block_sizes: frozenset[int] | None = None
    block_size_multiple: int = 1
    latent_sizes: frozenset[tuple[int, int]] | None = None
    num_heads: frozenset[int] | None = None
    layouts: tuple[str, ...] = ("joint",)
    max_query_len: int | None = None
    lse: LseSupport = field(default_factory=LseSupport)
    tolerances: Mapping[torch.dtype, Tolerance] = field(default_factory=dict)
    query_quantization: Mapping[str, str] = field(default_factory=dict)
    probability_quantization: Mapping[str, str] = field(default_factory=dict)
    quantization_accuracy: Mapping[str, AccuracyBound] = field(default_factory=dict)
    reason: str = MLA_NOT_DECLARED
    because: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from attnhub.mla import LATENT_KV_CACHE_DTYPES, LATENT_LAYOUTS

        _check_declaration("MlaSupport", self.reason)
        for kv in self.kv_cache_dtypes:
            if kv not in LATENT_KV_CACHE_DTYPES:
                raise UnknownNameError(
                    f"MlaSupport names kv_cache_dtype {kv!r}; a latent cache stores "
                    f"{', '.join(LATENT_KV_CACHE_DTYPES)}"
                )
        self._check_quantization()
        if not self.layouts or any(x not in LATENT_LAYOUTS for x in self.layouts):
            raise UnknownNameError(
                f"MlaSupport.layouts = {self.layouts!r} must name latent layouts of "
                f"{LATENT_LAYOUTS}"
            )
        if self.max_query_len is not None and (
            isinstance(self.max_query_len, bool)
            or not isinstance(self.max_query_len, int)
            or self.max_query_len < 1
        ):
            raise InvalidInputError(
                f"MlaSupport.max_query_len = {self.max_query_len!r} must be None or an int >= 1"
            )

    def _check_quantization(self) -> None:
        """The quantization declarations name declared fp8 latent formats and known schemes,
        each with an accuracy bound."""
        for what, mapping in (
            ("query_quantization", self.query_quantization),
            ("probability_quantization", self.probability_quantization),
            ("quantization_accuracy", self.quantization_accuracy),
        ):
            for kv in mapping:
                if kv == "auto" or kv not in self.kv_cache_dtypes:
                    raise UnknownNameError(
                        f"MlaSupport.{what} names latent format {kv!r}, which is not an fp8 "
                        f"format the declaration serves ({', '.join(sorted(self.kv_cache_dtypes))})"
                    )
        for scheme in self.query_quantization.values():
            query_quantization(scheme)
        for scheme in self.probability_quantization.values():
            probability_quantization(scheme)
        for kv in {*self.query_quantization, *self.probability_quantization}:
            if kv not in self.quantization_accuracy:
                raise UnknownNameError(
                    f"MlaSupport quantizes the query or the probabilities over {kv!r} latents "
                    "without an accuracy bound for it (quantization_accuracy)"
                )
        for kv, bound in self.quantization_accuracy.items():
            if not isinstance(bound, AccuracyBound):
                raise InvalidInputError(
                    f"MlaSupport.quantization_accuracy[{kv!r}] must be an AccuracyBound, got "
                    f"{type(bound).__name__}"
                )

    @property
    def declared(self) -> bool:
        """Whether the backend serves any MLA layer."""
        return bool(self.dtypes)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1

    def tolerance(self, dtype: torch.dtype, fallback: Mapping[torch.dtype, Tolerance]) -> Tolerance:
        """The declared tolerance for ``dtype`` (else the backend's standard one)."""
        found = self.tolerances.get(dtype) or fallback.get(dtype)
        if found is None:
            raise UnknownNameError(f"no MLA tolerance declared for {dtype}")
        return found

    def _refusal(self, field_name: str, sentence: str, value: object, supported: object) -> Refusal:
        r = Refusal(sentence, field=field_name, value=value, supported=supported)
        why = self.because.get(field_name)
        return r if why is None else r.because(why)

    def unsupported_reasons(self, spec: MLASpec) -> list[Refusal]:
        """Every reason this declaration refuses the MLA layer ``spec`` (empty = served)."""
        if not self.declared:
            return [Refusal(f"MLA is not served: {self.reason}", field="mla", value=True)]
        reasons = []
        if spec.dtype not in self.dtypes:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes))
            reasons.append(
                self._refusal(
                    "mla.dtype",
                    f"MLA dtype {spec.dtype} is not supported (supported: {names})",
                    spec.dtype,
                    self.dtypes,
                )
            )
        if spec.kv_cache_dtype not in self.kv_cache_dtypes:
            reasons.append(
                self._refusal(
                    "mla.kv_cache_dtype",
                    f"MLA kv_cache_dtype {spec.kv_cache_dtype!r} is not supported (supported: "
                    + ", ".join(sorted(self.kv_cache_dtypes))
                    + ")",
                    spec.kv_cache_dtype,
                    self.kv_cache_dtypes,
                )
            )
        for r in _size_refusals(
            "block_size", spec.block_size, self.block_sizes, self.block_size_multiple
        ):
            reasons.append(
                self._refusal("mla.block_size", f"MLA {r.sentence}", r.value, r.supported)
            )
        pair = (spec.kv_lora_rank, spec.qk_rope_head_dim)
        if self.latent_sizes is not None and pair not in self.latent_sizes:
            reasons.append(
                self._refusal(
                    "mla.latent_size",
                    f"MLA (kv_lora_rank, qk_rope_head_dim) = {pair} is not one of "
                    f"{sorted(self.latent_sizes)}",
                    pair,
                    self.latent_sizes,
                )
            )
        if self.num_heads is not None and spec.num_heads not in self.num_heads:
            reasons.append(
                self._refusal(
                    "mla.num_heads",
                    f"MLA num_heads {spec.num_heads} is not one of {sorted(self.num_heads)}",
                    spec.num_heads,
                    self.num_heads,
                )
            )
        return reasons

    def summary(self) -> dict[str, object]:
        """A JSON-friendly view (``Capabilities.summary()['mla']``)."""
        if not self.declared:
            return {"served": False, "reason": self.reason}
        return {
            "served": True,
            "form": "absorbed",
            "dtypes": sorted(str(d).removeprefix("torch.") for d in self.dtypes),
            "kv_cache_dtypes": sorted(self.kv_cache_dtypes),
            "block_sizes": "any" if self.block_sizes is None else sorted(self.block_sizes),
            "block_size_multiple": self.block_size_multiple,
            "latent_sizes": (
                "any" if self.latent_sizes is None else [list(p) for p in sorted(self.latent_sizes)]
            ),
            "num_heads": "any" if self.num_heads is None else sorted(self.num_heads),
            "layouts": list(self.layouts),
            "max_query_len": "any" if self.max_query_len is None else self.max_query_len,
            "lse": sorted(str(d).removeprefix("torch.") for d in self.lse.dtypes)
            or f"no: {self.lse.reason}",
            "query_quantization": dict(self.query_quantization),
            "probability_quantization": dict(self.probability_quantization),
            "quantization_accuracy": {
                kv: {"max_abs_error": b.max_abs_error, "min_cosine": b.min_cosine}
                for kv, b in sorted(self.quantization_accuracy.items())
            },
        }


#: Why a backend that declares nothing of :class:`BatchInvariance` refuses a batch-invariant spec.
BATCH_INVARIANCE_NOT_DECLARED = (
    "the backend does not declare that a request's output bits are independent of the batch"
)


@dataclass(frozen=True)
class BatchInvariance:
    """Where a spec with ``batch_invariant=True`` is served: a request's output has the same
    bits whatever else is in the step (decodes, prefills, chunked prefills of any lengths) and
    wherever it sits in it (``Capabilities.batch_invariant``; vLLM's and SGLang's
    batch-invariant modes). Same-call determinism (the same step twice, the same bits) is
    required of every backend and declared by none.

    ``dtypes``: the model dtypes it holds for (empty: none); ``kv_cache_dtypes``: the KV-cache
    formats (None: every format the backend declares); ``reason``: why not elsewhere, in the
    kernels' terms (e.g. "the split-KV heuristic picks a request's key splits from the batch
    size"). Elsewhere the spec is refused at construction, with that reason.
    """

    dtypes: frozenset[torch.dtype] = frozenset()
    kv_cache_dtypes: frozenset[str] | None = None
    reason: str = BATCH_INVARIANCE_NOT_DECLARED

    def __post_init__(self) -> None:
        _check_declaration("BatchInvariance", self.reason, self.kv_cache_dtypes)

    def refusal(self, spec: AttentionSpec) -> Refusal | None:
        """Why a spec with ``batch_invariant=True`` is refused (None: served; a spec that does
        not ask for it is never refused here)."""
        if not spec.batch_invariant:
            return None
        return _dtype_or_format_refusal(
            spec, "batch_invariant", "batch_invariant: outputs are not bitwise batch-invariant",
            self.dtypes, self.kv_cache_dtypes, self.reason,
        )  # fmt: skip


#: Why a backend that declares nothing of :class:`HeadSizeVSupport` refuses a value head size
#: other than the key head size.
HEAD_SIZE_V_NOT_DECLARED = "the backend does not declare that its kernels take it"

#: One declared region of (head_size, head_size_v): each side one size or an inclusive
#: ``(lo, hi)`` range of sizes.
SizeRange = int | tuple[int, int]


def _bounds(side: object) -> tuple[int, int]:
    """An inclusive ``(lo, hi)`` of a :data:`SizeRange` (InvalidInputError where it is none)."""
    if isinstance(side, int) and not isinstance(side, bool) and side > 0:
        return side, side
    if (
        isinstance(side, tuple)
        and len(side) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in side)
        and side[0] <= side[1]
    ):
        return side[0], side[1]
    raise InvalidInputError(
        f"HeadSizeVSupport.pairs entry side {side!r} must be a size or an inclusive (lo, hi) range"
    )


@dataclass(frozen=True)
class HeadSizeVSupport:
    """Where a value head size other than the key head size is served
    (``Capabilities.head_size_v``; ``spec.head_size_v == spec.head_size`` is always the
    ordinary case and never refused by it).

    ``pairs``: the ``(head_size, head_size_v)`` regions served, each side one size or an
    inclusive ``(lo, hi)`` range ("keys in (128, 192] with values in (96, 128]" is
    ``((129, 192), (97, 128))``); None: every pair (``head_size_v`` then passes the same
    size rules as ``head_size``: ``head_sizes``, ``max_head_size``, ``head_size_multiple``);
    empty: none. ``dtypes`` / ``kv_cache_dtypes``: where (None: every one the backend
    declares). ``reason``: why not elsewhere (the refusal names the kernel or the vendor's
    limit; "not wired yet (vendor supports X)" where the vendor has it and attnhub does not yet
    translate it).
    """

    pairs: tuple[tuple[SizeRange, SizeRange], ...] | None = ()
    dtypes: frozenset[torch.dtype] | None = None
    kv_cache_dtypes: frozenset[str] | None = None
    reason: str = HEAD_SIZE_V_NOT_DECLARED

    def __post_init__(self) -> None:
        _check_declaration("HeadSizeVSupport", self.reason, self.kv_cache_dtypes)
        for pair in self.pairs or ():
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise InvalidInputError(
                    f"HeadSizeVSupport.pairs entry {pair!r} must be (head_size, head_size_v)"
                )
            _bounds(pair[0]), _bounds(pair[1])

    @property
    def declared(self) -> bool:
        """Whether any distinct value head size is served."""
        return self.pairs is None or bool(self.pairs)

    def covers(self, head_size: int, head_size_v: int) -> bool:
        """Whether ``(head_size, head_size_v)`` lies in a declared region (None: every pair)."""
        if self.pairs is None:
            return True
        for k, v in self.pairs:
            (k_lo, k_hi), (v_lo, v_hi) = _bounds(k), _bounds(v)
            if k_lo <= head_size <= k_hi and v_lo <= head_size_v <= v_hi:
                return True
        return False

    def refusal(self, spec: AttentionSpec) -> Refusal | None:
        """Why ``spec``'s value head size is refused (None: served, or equal to head_size)."""
        if not spec.distinct_head_size_v:
            return None
        pair = (spec.head_size, spec.head_size_v)
        where = f"head_size_v {spec.head_size_v} != head_size {spec.head_size}"
        if not self.covers(*pair):
            said = "no pair is declared" if not self.declared else f"declared: {self.describe()}"
            return Refusal(
                f"{where} is not supported ({said}; {self.reason})",
                field="head_size_v",
                value=pair,
                supported=self.pairs,
            )
        if self.dtypes is not None and spec.dtype not in self.dtypes:
            return Refusal(
                f"{where} is not supported for dtype {spec.dtype} ({self.reason})",
                field="head_size_v",
                value=pair,
                supported=self.dtypes,
            )
        if self.kv_cache_dtypes is not None and spec.kv_cache_dtype not in self.kv_cache_dtypes:
            return Refusal(
                f"{where} is not supported with kv_cache_dtype {spec.kv_cache_dtype!r} "
                f"({self.reason})",
                field="head_size_v",
                value=pair,
                supported=self.kv_cache_dtypes,
            )
        return None

    def describe(self) -> str:
        """The declared regions as words: ``"any"``, ``"none"`` or ``"(192, 128), ..."``."""
        if self.pairs is None:
            return "any"
        if not self.pairs:
            return "none"

        def side(x: SizeRange) -> str:
            lo, hi = _bounds(x)
            return str(lo) if lo == hi else f"{lo}..{hi}"

        return ", ".join(f"({side(k)}, {side(v)})" for k, v in self.pairs)

    def summary(self) -> dict[str, object]:
        """A JSON-friendly view (``attnhub list --json``)."""
        out: dict[str, object] = {
            "pairs": (
                "any"
                if self.pairs is None
                else [[list(_bounds(k)), list(_bounds(v))] for k, v in self.pairs]
            )
        }
        if self.dtypes is not None:
            out["dtypes"] = sorted(str(d).removeprefix("torch.") for d in self.dtypes)
        if self.kv_cache_dtypes is not None:
            out["kv_cache_dtypes"] = [k for k in KV_CACHE_DTYPES if k in self.kv_cache_dtypes]
        if self.pairs is not None:
            out["reason"] = self.reason
        return out


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
    #: Which MLA layers it serves (the absorbed form, :class:`MlaSupport`); the default none.
    mla: MlaSupport = field(default_factory=MlaSupport)
    #: Where a spec with ``batch_invariant=True`` is served, bit for bit (the default declares
    #: none: such a spec is refused with :data:`BATCH_INVARIANCE_NOT_DECLARED` or the
    #: backend's own ``reason``).
    batch_invariant: BatchInvariance = field(default_factory=BatchInvariance)
    #: Where the value head size may differ from the key head size (``spec.head_size_v``,
    #: what MLA's expanded prefill needs); the default declares none (every such spec refused
    #: with :data:`HEAD_SIZE_V_NOT_DECLARED` or the backend's own ``reason``).
    head_size_v: HeadSizeVSupport = field(default_factory=HeadSizeVSupport)

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
        if spec.distinct_head_size_v:
            refused = self.head_size_v.refusal(spec)
            if refused is not None:
                reasons.append(refused)
            elif self.head_size_v.pairs is None:  # any pair: the head-size rules hold for both
                reasons += _size_refusals(
                    "head_size_v",
                    spec.head_size_v,
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
        invariance = self.batch_invariant.refusal(spec)
        if invariance is not None:
            reasons.append(invariance)
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
            "mla": self.mla.summary(),
            "batch_invariant": {
                "dtypes": names(self.batch_invariant.dtypes),
                "kv_cache_dtypes": names(self.batch_invariant.kv_cache_dtypes),
                "reason": self.batch_invariant.reason,
            },
            "head_size_v": self.head_size_v.summary(),
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
