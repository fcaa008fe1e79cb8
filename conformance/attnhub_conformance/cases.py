"""Conformance cases, generated from what a backend declares (as xformers parametrizes its tests
from each op's declarations).

A declared feature is tested against the reference; an undeclared one must be refused at
construction, with a reason. Every case names what it proves (``rows``: the lines of the
features x backends matrix it stands for) and carries a test id that names the backend and the
whole configuration, e.g. ``torch-chunked_prefill-bf16-h128-gqa4-bs16-sliding_window``.

Lengths are written relative to the block size so that every shape crosses block boundaries and
ends mid-block whatever block size a backend declares.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from attnhub import FEATURES, Capabilities, GraphSupport
from attnhub.errors import InvalidSpecError
from attnhub.spec import KV_CACHE_DTYPES, MODEL_DTYPES, AttentionSpec, AttentionType
from attnhub_conformance.targets import Target

# --- the axes --------------------------------------------------------------------------------

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
#: The base dtype is the first one a backend declares, in this order.
DTYPE_PREFERENCE = (torch.bfloat16, torch.float16, torch.float32)

SOFTCAP = 1.5  # small enough that tanh bends scores of N(0, 1) inputs


def sliding_window_for(block_size: int) -> int:
    """A window that is not a multiple of the block size and shorter than most sequences."""
    return block_size + block_size // 2 + 5


@dataclass(frozen=True)
class Heads:
    name: str  # mha, gqa4, mqa: the id token
    num_heads: int
    num_kv_heads: int


HEADS = (Heads("gqa4", 8, 2), Heads("mha", 4, 4), Heads("mqa", 8, 1))


@dataclass(frozen=True)
class Scope:
    """How wide the matrix is: ``quick`` keeps every declared feature and every batch shape
    but few shape/dtype combinations; ``full`` crosses the axes."""

    name: str
    long_context: int  # context tokens of the chunked-prefill request
    many_requests: int  # requests in the many_requests batch (at least 64)
    head_sizes: tuple[int, ...]  # candidates, filtered by what the backend supports
    block_sizes: tuple[int, ...]
    full: bool


QUICK = Scope("quick", 384, 64, (64, 128, 256, 96, 80, 32), (16, 64, 32, 128, 8), full=False)
FULL = Scope(
    "full", 2100, 160, (64, 32, 80, 96, 112, 128, 192, 256), (16, 1, 8, 32, 64, 128), full=True
)
SCOPES = {"quick": QUICK, "full": FULL}


@dataclass(frozen=True)
class Config:
    """One attention layer configuration: everything that goes into an AttentionSpec."""

    dtype: torch.dtype
    head_size: int
    heads: Heads
    block_size: int
    kv_cache_dtype: str = "auto"
    attn_type: AttentionType = AttentionType.DECODER
    features: tuple[str, ...] = ()
    batch_invariant: bool = False  # the spec asks for bitwise batch invariance
    head_size_v: int | None = None  # None: head_size

    def spec(self) -> AttentionSpec:
        f = set(self.features)
        return AttentionSpec(
            num_heads=self.heads.num_heads,
            num_kv_heads=self.heads.num_kv_heads,
            head_size=self.head_size,
            head_size_v=self.head_size if self.head_size_v is None else self.head_size_v,
            dtype=self.dtype,
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            attn_type=self.attn_type,
            sliding_window=sliding_window_for(self.block_size) if "sliding_window" in f else None,
            logits_soft_cap=SOFTCAP if "softcap" in f else None,
            use_alibi="alibi" in f,
            use_sinks="sinks" in f,
            batch_invariant=self.batch_invariant,
        )

    def with_(self, **changes: object) -> Config:
        return replace(self, **changes)  # type: ignore[arg-type]

    @property
    def id(self) -> str:
        parts = [
            DTYPE_NAMES.get(self.dtype, str(self.dtype).removeprefix("torch.")),
            f"h{self.head_size}"
            + ("" if self.head_size_v in (None, self.head_size) else f"v{self.head_size_v}"),
            self.heads.name,
            f"bs{self.block_size}",
        ]
        if self.features:
            parts.append("+".join(self.features))
        if self.kv_cache_dtype != "auto":
            parts.append(f"kv_{self.kv_cache_dtype}")
        if self.attn_type is not AttentionType.DECODER:
            parts.append(self.attn_type.value)
        if self.batch_invariant:
            parts.append("batch_invariant")
        return "-".join(parts)


# --- batch shapes ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchPlan:
    """The lengths of one step: what the harness turns into a BatchMetadata."""

    requests: tuple[tuple[int, int], ...]  # (query_len, seq_len) per request, in batch order
    padding: int = 0  # slot_mapping rows of -1 after the real tokens (a graph-padded step)
    shared_prefix_blocks: int = 0  # cascade: leading blocks every request shares
    new_kv: bool = True  # False: forward(key=None) over keys written earlier (cross-attention)

    @property
    def query_lens(self) -> list[int]:
        return [q for q, _ in self.requests]

    @property
    def seq_lens(self) -> list[int]:
        return [s for _, s in self.requests]


@dataclass(frozen=True)
class Shape:
    """A batch composition; ``plan`` sizes it for a block size, a backend and a scope."""

    name: str
    proves: str
    plan: Callable[[int, Capabilities, Scope], BatchPlan] = field(compare=False, repr=False)
    needs: str | None = None  # the Capabilities flag the shape requires, if any


def _decode(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
    lens = (bs + 1, 3, 2 * bs, 5 * bs - 3, 2, 4 * bs + 9, bs - 1 if bs > 1 else 4)
    return BatchPlan(tuple((1, s) for s in lens), padding=1)


def _prefill(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
    return BatchPlan(tuple((n, n) for n in (bs + 5, 2 * bs, 3, 37)))


def _mixed(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
    reqs = [(1, 3 * bs + 1), (1, 9), (bs + 3, bs + 3), (1, 2 * bs), (1, 1)]
    if caps.chunked_prefill:
        reqs.insert(3, (9, 9 + 2 * bs + 3))
    if caps.multi_token_decode:
        reqs.insert(1, (3, 3 + bs))
    return BatchPlan(tuple(reqs), padding=3)


def _chunked_prefill(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
    return BatchPlan(((37, 37 + scope.long_context + 5), (bs + 1, 6 * bs), (1, 2 * bs + 1)))


def _multi_token_decode(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
    return BatchPlan(((2, 3 * bs + 2), (3, 17), (1, 40), (4, 5), (2, 2 * bs + 1), (3, 3 + bs)))


def _one_request(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
    return BatchPlan(((7, bs + 11),) if caps.chunked_prefill else ((bs + 11, bs + 11),))


def _many_requests(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
    rng = random.Random(f"many_requests-{bs}")
    reqs = []
    for i in range(scope.many_requests):
        if i % 8 == 7:
            q = rng.randint(1, 2 * bs + 3)
            reqs.append((q, q))
        elif i % 8 == 6 and caps.chunked_prefill:
            q = rng.randint(5, bs + 3)
            reqs.append((q, q + rng.randint(1, 2 * bs)))
        elif i % 8 == 5 and caps.multi_token_decode:
            q = rng.randint(2, 4)
            reqs.append((q, q + rng.randint(1, 3 * bs)))
        else:
            reqs.append((1, 1 + rng.randint(1, 3 * bs + 5)))
    return BatchPlan(tuple(reqs), padding=5)


def _unaligned(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
    b = max(bs, 4)
    reqs = [(b - 1, b - 1), (1, b + 1), (1, 2 * b - 1), (b + 1, b + 1)]
    if caps.chunked_prefill:
        reqs.append((b + 1, 2 * b + 3))  # new tokens start mid-block and cross a boundary
    return BatchPlan(tuple(reqs))


def _length_one(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
    return BatchPlan(((1, 1), (1, 1), (1, 2), (1, 1)))


def _cascade(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
    reqs = [(1, 2 * bs + 5), (1, 3 * bs + 1), (1, 2 * bs + 1)]
    if caps.chunked_prefill:
        reqs.append((5, 2 * bs + 9))
    return BatchPlan(tuple(reqs), shared_prefix_blocks=2)


def _encoder_prefill(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
    return BatchPlan(tuple((n, n) for n in (bs + 5, 2 * bs, 3, 37, 1)))


def _encoder_many(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
    rng = random.Random(f"encoder_many-{bs}")
    return BatchPlan(
        tuple((n, n) for n in (rng.randint(1, 2 * bs + 3) for _ in range(scope.many_requests)))
    )


def _cross_attention(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
    return BatchPlan(((1, 23), (5, 5 + bs), (3, 2 * bs + 7), (1, 1)), new_kv=False)


def _cross_one(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
    return BatchPlan(((4, 2 * bs + 3),), new_kv=False)


DECODE = Shape(
    "decode", "decode-only step (query_len 1 over cached context), graph-padded", _decode
)
PREFILL = Shape("prefill", "prefill-only step (no cached context)", _prefill)
MIXED = Shape("mixed", "decodes, prefills and chunked prefills in one step, padded", _mixed)
CHUNKED_PREFILL = Shape(
    "chunked_prefill",
    "prefill chunks over a long cached context",
    _chunked_prefill,
    needs="chunked_prefill",
)
MULTI_TOKEN_DECODE = Shape(
    "multi_token_decode",
    "speculative decode: ragged small query lengths over context",
    _multi_token_decode,
    needs="multi_token_decode",
)
ONE_REQUEST = Shape("one_request", "a batch of one request", _one_request)
MANY_REQUESTS = Shape("many_requests", "64+ requests of mixed kinds", _many_requests)
UNALIGNED = Shape("unaligned", "lengths that are not multiples of the block size", _unaligned)
LENGTH_ONE = Shape("length_one", "sequences of length 1", _length_one)
CASCADE = Shape(
    "cascade",
    "requests sharing prefix blocks, built with common_prefix_len",
    _cascade,
    needs="cascade",
)
ENCODER_PREFILL = Shape("prefill", "non-causal attention over whole sequences", _encoder_prefill)
ENCODER_MANY = Shape("many_requests", "64+ non-causal sequences", _encoder_many)
CROSS_ATTENTION = Shape(
    "cross_attention", "decoder queries over encoder keys already cached", _cross_attention
)
CROSS_ONE = Shape("one_request", "one request's queries over its encoder keys", _cross_one)
UNALIGNED_PREFILL = Shape(
    "unaligned",
    "lengths that are not multiples of the block size",
    lambda bs, caps, scope: BatchPlan(tuple((n, n) for n in (max(bs, 4) - 1, max(bs, 4) + 1, 7))),
)

DECODER_SHAPES = (
    DECODE,
    PREFILL,
    MIXED,
    CHUNKED_PREFILL,
    MULTI_TOKEN_DECODE,
    ONE_REQUEST,
    MANY_REQUESTS,
    UNALIGNED,
    LENGTH_ONE,
)
#: Every row a shape can stand for, in matrix order.
SHAPE_ORDER = [s.name for s in DECODER_SHAPES] + ["cascade", "cross_attention"]


def shapes_for(caps: Capabilities, attn_type: AttentionType) -> list[Shape]:
    """The batch shapes that make sense for ``attn_type`` and that ``caps`` declares."""
    if attn_type is AttentionType.ENCODER_DECODER:
        return [CROSS_ATTENTION, CROSS_ONE]
    if attn_type is not AttentionType.DECODER:
        return [ENCODER_PREFILL, ENCODER_MANY, UNALIGNED_PREFILL, LENGTH_ONE]
    return [s for s in DECODER_SHAPES if s.needs is None or getattr(caps, s.needs)]


def main_shape(attn_type: AttentionType) -> Shape:
    """The shape each non-shape axis is tested with: the one that mixes the most."""
    if attn_type is AttentionType.ENCODER_DECODER:
        return CROSS_ATTENTION
    if attn_type is not AttentionType.DECODER:
        return ENCODER_PREFILL
    return MIXED


# --- cases -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One test instance: a backend, what is checked, and the matrix rows it stands for."""

    target: Target
    kind: str
    name: str  # the test id after the backend name
    rows: tuple[str, ...]
    proves: str
    config: Config | None = None
    shape: Shape | None = None
    entry: str | None = None  # the catalogue entry or refused capability, where one applies
    skip: str | None = None  # skip with this reason instead of running
    not_supported: bool = False  # a pass proves a refusal: the matrix says "not supported"
    scope: Scope = QUICK
    #: skipped because the check does not apply here (not a refusal): "not applicable"
    not_applicable: bool = False

    @property
    def id(self) -> str:
        return f"{self.target.name}-{self.name}"

    def plan(self) -> BatchPlan:
        assert self.config is not None and self.shape is not None
        return self.shape.plan(self.config.block_size, self.target.capabilities, self.scope)


class Cases:
    """Collects cases; the same configuration reached from two axes is one case with both rows."""

    def __init__(self, target: Target, kind: str, scope: Scope) -> None:
        self.target, self.kind, self.scope = target, kind, scope
        self._by_name: dict[str, Case] = {}

    def add(
        self,
        row: str,
        proves: str,
        *,
        config: Config | None = None,
        shape: Shape | None = None,
        entry: str | None = None,
        name: str | None = None,
        skip: str | None = None,
        not_supported: bool = False,
        not_applicable: bool = False,
    ) -> None:
        if name is None:
            assert config is not None and shape is not None
            name = f"{shape.name}-{config.id}"
        old = self._by_name.get(name)
        if old is not None:
            if row not in old.rows:
                self._by_name[name] = replace(old, rows=(*old.rows, row))
            return
        self._by_name[name] = Case(
            self.target,
            self.kind,
            name,
            (row,),
            proves,
            config,
            shape,
            entry,
            skip,
            not_supported,
            self.scope,
            not_applicable,
        )

    def list(self) -> list[Case]:
        return list(self._by_name.values())


class Axes:
    """The values of each axis that a backend supports, around one supported base config."""

    def __init__(self, target: Target, scope: Scope) -> None:
        self.target, self.scope = target, scope
        caps = self.caps = target.capabilities
        self.head_size_candidates = _unique([*scope.head_sizes, *sorted(caps.head_sizes or ())])
        self.block_size_candidates = _unique([*scope.block_sizes, *sorted(caps.block_sizes or ())])
        self.base = self._find_base()

    def _find_base(self) -> Config | None:
        caps = self.caps
        kvs = ["auto", *sorted(k for k in caps.kv_cache_dtypes if k != "auto")]
        attns = [AttentionType.DECODER, *sorted(caps.attn_types, key=lambda t: t.value)]
        for dtype, attn, kv, heads, hs, bs in itertools.product(
            [d for d in DTYPE_PREFERENCE if d in caps.dtypes],
            attns,
            kvs,
            HEADS,
            self.head_size_candidates,
            self.block_size_candidates,
        ):
            config = Config(dtype, hs, heads, bs, kv, attn)
            if self.supports(config):
                return config
        return None

    def supports(self, config: Config) -> bool:
        """The backend accepts ``config`` (and it is a valid spec at all)."""
        try:
            spec = config.spec()
        except InvalidSpecError:
            return False
        return not self.target.refusal(spec)

    @cached_property
    def dtypes(self) -> list[torch.dtype]:
        assert self.base
        return [d for d in DTYPE_PREFERENCE if self.supports(self.base.with_(dtype=d))]

    @cached_property
    def head_sizes(self) -> list[int]:
        assert self.base
        ok = [h for h in self.head_size_candidates if self.supports(self.base.with_(head_size=h))]
        if self.scope.full:
            return sorted(ok)
        larger = [h for h in ok if h > self.base.head_size]  # in candidate order: 128 first
        return [self.base.head_size, *larger[:1]]  # head size 64 and one larger

    @cached_property
    def heads(self) -> list[Heads]:
        assert self.base
        return [h for h in HEADS if self.supports(self.base.with_(heads=h))]

    @cached_property
    def block_sizes(self) -> list[int]:
        assert self.base
        ok = [b for b in self.block_size_candidates if self.supports(self.base.with_(block_size=b))]
        if self.scope.full:
            return sorted(ok)
        return ok[:2]

    @cached_property
    def features(self) -> list[str]:
        assert self.base
        return [
            f
            for f in FEATURES
            if self.caps.supports_feature(f) and self.supports(self.base.with_(features=(f,)))
        ]

    @cached_property
    def kv_cache_dtypes(self) -> list[str]:
        assert self.base
        return [
            k
            for k in KV_CACHE_DTYPES
            if k != self.base.kv_cache_dtype
            and k in self.caps.kv_cache_dtypes
            and self.supports(self.base.with_(kv_cache_dtype=k))
        ]

    @cached_property
    def attn_types(self) -> list[AttentionType]:
        assert self.base
        return [
            t
            for t in AttentionType
            if t is not self.base.attn_type
            and t in self.caps.attn_types
            and self.supports(self.base.with_(attn_type=t))
        ]

    def combined_features(self, config: Config) -> Config | None:
        """``config`` with every declared feature at once (their interplay), if supported."""
        feats = tuple(self.features)
        if len(feats) < 2:
            return None
        combined = config.with_(features=feats)
        return combined if self.supports(combined) else None


#: (head_size, head_size_v) pairs tried for ``spec.head_size_v``, in order: MLA's expanded
#: prefill (DeepSeek: keys 192, values 128) first, then values narrower and wider than keys.
HEAD_SIZE_V_PAIRS = ((192, 128), (128, 64), (64, 128), (64, 96), (32, 64), (128, 96), (64, 32))


def _head_size_v_pairs(ax: Axes) -> list[tuple[int, int]]:
    """The pairs the backend serves with the base config: the first with values narrower than
    keys and the first with values wider (full scope: every one served)."""
    base = ax.base
    assert base is not None
    ok = [
        (k, v) for k, v in HEAD_SIZE_V_PAIRS if ax.supports(base.with_(head_size=k, head_size_v=v))
    ]
    if ax.scope.full:
        return ok
    narrower = [p for p in ok if p[1] < p[0]][:1]
    wider = [p for p in ok if p[1] > p[0]][:1]
    return narrower + wider


def head_size_v_row(k: int, v: int) -> str:
    return f"value head size: {k}/{v}"


def _unique(xs: list[int]) -> list[int]:
    return list(dict.fromkeys(xs))


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


# --- generators, one per kind of test ---------------------------------------------------------


def output_cases(target: Target, scope: Scope) -> list[Case]:
    """``test_matches_reference``: every declared shape, dtype, head size, head layout, block
    size, feature, KV-cache format and attention type, checked against the reference."""
    ax = Axes(target, scope)
    out = Cases(target, "outputs", scope)
    base = ax.base
    if base is None:
        return []
    caps = ax.caps
    proves = "forward matches attnhub.reference within the declared tolerance"

    def add(config: Config, shape: Shape, row: str) -> None:
        if ax.supports(config):
            out.add(row, proves, config=config, shape=shape)

    shapes = shapes_for(caps, base.attn_type)
    mixed = main_shape(base.attn_type)
    for shape, dtype in itertools.product(shapes, ax.dtypes):  # every shape in every dtype
        add(base.with_(dtype=dtype), shape, f"batch: {shape.name}")
        add(base.with_(dtype=dtype), shape, f"dtype: {dtype_name(dtype)}")
    if caps.cascade and base.attn_type is AttentionType.DECODER:
        add(base, CASCADE, "cascade")
    for hs in ax.head_sizes:
        add(base.with_(head_size=hs), mixed, f"head size: {hs}")
    if base.attn_type is AttentionType.DECODER:
        _head_size_v_output_cases(ax, add, shapes)
    for heads in ax.heads:
        add(base.with_(heads=heads), mixed, f"heads: {heads.name}")
    for bs in ax.block_sizes:
        for shape in (mixed, UNALIGNED if mixed is MIXED else UNALIGNED_PREFILL):
            add(base.with_(block_size=bs), shape, f"block size: {bs}")
    feature_shapes = [s for s in (mixed, CHUNKED_PREFILL, DECODE, PREFILL) if s in shapes][:3]
    for feature, dtype in itertools.product(ax.features, ax.dtypes):
        for shape in feature_shapes:
            add(base.with_(features=(feature,), dtype=dtype), shape, f"feature: {feature}")
    combined = ax.combined_features(base)
    if combined is not None:
        for shape, dtype in itertools.product(feature_shapes[:2], ax.dtypes):
            add(combined.with_(dtype=dtype), shape, "feature: combined")
    for kv, dtype in itertools.product(ax.kv_cache_dtypes, ax.dtypes):
        for shape in (mixed, DECODE if DECODE in shapes else mixed):
            add(base.with_(kv_cache_dtype=kv, dtype=dtype), shape, f"kv cache: {kv}")
    for attn in ax.attn_types:
        config = base.with_(attn_type=attn)
        for shape in shapes_for(caps, attn)[: None if scope.full else 2]:
            add(config, shape, f"attention: {attn.value}")
        if "sliding_window" in ax.features and not attn.is_causal:
            add(
                config.with_(features=("sliding_window",)),
                main_shape(attn),
                "feature: sliding_window",
            )
    if scope.full:
        _full_output_cases(ax, add)
    return out.list()


def _head_size_v_output_cases(
    ax: Axes, add: Callable[[Config, Shape, str], None], shapes: list[Shape]
) -> None:
    """Each served (head_size, head_size_v) pair: prefill, decode, chunked prefill and mixed
    batches in every dtype; the pair with every declared feature at once, each quantized
    cache, each head layout."""
    base = ax.base
    assert base is not None
    picked = [s for s in (PREFILL, DECODE, CHUNKED_PREFILL, MIXED) if s in shapes]
    for k, v in _head_size_v_pairs(ax):
        pair = base.with_(head_size=k, head_size_v=v)
        row = head_size_v_row(k, v)
        for shape, dtype in itertools.product(picked, ax.dtypes):
            add(pair.with_(dtype=dtype), shape, row)
        combined = ax.combined_features(pair)
        extras = [combined] if combined is not None else []
        extras += [pair.with_(features=(f,)) for f in ax.features if combined is None]
        extras += [pair.with_(kv_cache_dtype=kv) for kv in ax.kv_cache_dtypes]
        extras += [pair.with_(heads=h) for h in ax.heads if h != base.heads]
        for config in extras:
            add(config, MIXED, row)


def _full_output_cases(ax: Axes, add: Callable[[Config, Shape, str], None]) -> None:
    base = ax.base
    assert base is not None
    caps = ax.caps
    shapes = shapes_for(caps, base.attn_type)
    mixed = main_shape(base.attn_type)
    for shape, dtype, heads in itertools.product(shapes, ax.dtypes, ax.heads):
        add(base.with_(dtype=dtype, heads=heads), shape, f"batch: {shape.name}")
    for dtype, hs, bs in itertools.product(ax.dtypes, ax.head_sizes, ax.block_sizes):
        config = base.with_(dtype=dtype, head_size=hs, block_size=bs)
        add(config, mixed, f"head size: {hs}")
        add(config, mixed, f"block size: {bs}")
    feature_sets: list[tuple[str, ...]] = [(f,) for f in ax.features]
    combined = ax.combined_features(base)
    if combined is not None:
        feature_sets.append(combined.features)
    for feats, dtype, shape in itertools.product(feature_sets, ax.dtypes, shapes):
        row = "feature: combined" if len(feats) > 1 else f"feature: {feats[0]}"
        add(base.with_(features=feats, dtype=dtype), shape, row)
    for kv, dtype, shape in itertools.product(ax.kv_cache_dtypes, ax.dtypes, shapes):
        add(base.with_(kv_cache_dtype=kv, dtype=dtype), shape, f"kv cache: {kv}")
    for attn, dtype, heads in itertools.product(ax.attn_types, ax.dtypes, ax.heads):
        for shape in shapes_for(caps, attn):
            add(
                base.with_(attn_type=attn, dtype=dtype, heads=heads),
                shape,
                f"attention: {attn.value}",
            )


def kv_cache_cases(target: Target, scope: Scope) -> list[Case]:
    """The cache holds exactly what was written; every other slot (padding included) is
    byte-identical. Through ``forward``, through ``write_kv`` alone and through ``write_kv``
    with the step's metadata (the write engines that separate it from attention use); for
    the base config, every KV format, every block size and every attention type that writes
    new keys (full scope: every dtype with every format too)."""
    ax = Axes(target, scope)
    out = Cases(target, "kv_cache", scope)
    base = ax.base
    if base is None:
        return []
    configs = [base]
    configs += [base.with_(kv_cache_dtype=k) for k in ax.kv_cache_dtypes]
    configs += [base.with_(block_size=b) for b in ax.block_sizes]
    configs += [base.with_(attn_type=t) for t in ax.attn_types]
    if base.attn_type is AttentionType.DECODER:  # the value plane at its own width
        for k, v in _head_size_v_pairs(ax):
            pair = base.with_(head_size=k, head_size_v=v)
            configs += [pair, *(pair.with_(kv_cache_dtype=kv) for kv in ax.kv_cache_dtypes)]
    if scope.full:
        pairs = [
            base.with_(dtype=d, kv_cache_dtype=k)
            for d in ax.dtypes
            for k in [base.kv_cache_dtype, *ax.kv_cache_dtypes]
        ]
        configs += [c for c in pairs if ax.supports(c)]  # e.g. fp8 with bf16 models only
    for config in configs:
        if config.attn_type is AttentionType.ENCODER_DECODER:
            continue  # cross-attention steps write no new keys
        shape = main_shape(config.attn_type)
        for call in ("forward", "write_kv", "write_kv_step"):
            how = "write_kv(meta=)" if call == "write_kv_step" else call
            out.add(
                "kv cache writes",
                f"{how} writes exactly the new tokens' slots; padding (-1) and every other "
                "slot stay byte-identical",
                config=config,
                shape=shape,
                entry=call,
                name=f"{call}-{shape.name}-{config.id}",
            )
    if base.attn_type is not AttentionType.ENCODER_DECODER:
        shape = main_shape(base.attn_type)
        for call in ("forward_strided_slots", "write_kv_strided_slots"):
            how = "forward" if call.startswith("forward") else "write_kv"
            out.add(
                "kv cache writes",
                f"{how} with a strided slot_mapping (every other entry of an engine's buffer) "
                "writes exactly the new tokens' slots, as with a dense one",
                config=base,
                shape=shape,
                entry=call,
                name=f"{call}-{shape.name}-{base.id}",
            )
    return out.list()


def quantization_accuracy_cases(target: Target, scope: Scope) -> list[Case]:
    """Each declared quantized KV-cache format (and each format the backend quantizes the
    query for): forward over it matches the reference on the same quantized inputs, and stays
    within the declared ``quantization_accuracy`` of attention over the unquantized query,
    keys and values. Required (a missing bound fails) where the query is quantized or the
    cache is int8; skipped with the reason for other formats that declare none (fp8 caches
    whose kernels take the query as it is: the same-inputs cases check their whole math)."""
    ax = Axes(target, scope)
    out = Cases(target, "quantization_accuracy", scope)
    base = ax.base
    if base is None:
        return []
    caps = ax.caps
    proves = (
        "forward matches the reference on the quantized inputs and stays within the declared "
        "max abs error / min cosine of attention over the unquantized inputs"
    )
    kvs = [k for k in [base.kv_cache_dtype, *ax.kv_cache_dtypes] if _quantizes(caps, k)]
    for kv in kvs:
        required = kv in caps.query_quantization or KV_CACHE_DTYPES[kv].key_dtype == torch.int8
        row = f"quantized cache accuracy: {kv}"
        if kv not in caps.quantization_accuracy and not required:
            out.add(
                row,
                proves,
                config=base.with_(kv_cache_dtype=kv),
                name=f"kv_{kv}",
                skip=f"no accuracy bound declared for {kv} (Capabilities.quantization_accuracy); "
                "its kernels take the query unquantized",
            )
            continue
        shapes = shapes_for(caps, base.attn_type)
        mixed = main_shape(base.attn_type)
        picked = shapes if scope.full else [mixed, *(s for s in (DECODE, PREFILL) if s in shapes)]
        for dtype, shape in itertools.product(ax.dtypes, picked):
            config = base.with_(kv_cache_dtype=kv, dtype=dtype)
            if ax.supports(config):
                out.add(row, proves, config=config, shape=shape)
    return out.list()


def _quantizes(caps: Capabilities, kv: str) -> bool:
    return KV_CACHE_DTYPES[kv].is_quantized or kv in caps.query_quantization


def strided_cache_cases(target: Target, scope: Scope) -> list[Case]:
    """What ``capabilities.strided_kv_cache`` declares holds: a backend that takes K/V planes
    that are strided views (one tensor with a slot's key and value side by side, as vLLM
    allocates) computes and writes through them correctly; one that does not refuses them
    with InvalidInputError, the cache untouched. Per KV format."""
    ax = Axes(target, scope)
    out = Cases(target, "strided_cache", scope)
    base = ax.base
    if base is None:
        return []
    declared = ax.caps.strided_kv_cache
    proves = (
        "forward over K/V planes that are strided views of one tensor writes and attends as "
        "over contiguous ones"
        if declared
        else "strided K/V planes (strided_kv_cache=False) are refused, the cache untouched"
    )
    configs = [base, *(base.with_(kv_cache_dtype=k) for k in ax.kv_cache_dtypes)]
    if base.attn_type is AttentionType.DECODER:  # a slot's key and value of two widths
        configs += [base.with_(head_size=k, head_size_v=v) for k, v in _head_size_v_pairs(ax)]
    for config in configs:
        if config.attn_type is AttentionType.ENCODER_DECODER:
            continue
        out.add(
            "strided K/V planes",
            proves,
            config=config,
            shape=main_shape(config.attn_type),
            entry="views" if declared else "refused",
            name=f"{main_shape(config.attn_type).name}-{config.id}",
            not_supported=not declared,
        )
    return out.list()


def simple_cases(kind: str, row: str, proves: str, target: Target, scope: Scope) -> list[Case]:
    """Cases for the checks that need a few representative configs, not the whole matrix:
    the base, all declared features together, each quantized cache (full: every dtype)."""
    ax = Axes(target, scope)
    out = Cases(target, kind, scope)
    base = ax.base
    if base is None:
        return []
    shape = main_shape(base.attn_type)
    configs = [base]
    combined = ax.combined_features(base)
    configs += [combined] if combined else [base.with_(features=(f,)) for f in ax.features]
    configs += [base.with_(kv_cache_dtype=k) for k in ax.kv_cache_dtypes]
    if scope.full:
        configs += [base.with_(dtype=d) for d in ax.dtypes]
        configs += [base.with_(heads=h) for h in ax.heads]
    for config in configs:
        out.add(row, proves, config=config, shape=shape)
    return out.list()


def host_sync_cases(target: Target, scope: Scope) -> list[Case]:
    """A backend that runs off the CPU does no device-to-host sync per layer: forward and
    write_kv(meta=) read no device tensor on the host (value checks run once per step, in
    build, on host copies). Graph-capable backends are checked on the metadata they build for
    capture; the others on their ordinary metadata."""
    ax = Axes(target, scope)
    out = Cases(target, "host_sync", scope)
    base = ax.base
    row = "no host sync per layer"
    if base is None:
        return []
    devices = ax.caps.devices
    if devices is not None and devices <= {"cpu"}:
        out.add(
            row,
            "the backend runs on the CPU only, where nothing syncs",
            name="host_sync",
            skip="not applicable here: the backend declares the CPU as its only device, so "
            "there is no device to sync",
            not_applicable=True,
        )
        return out.list()
    level = ax.caps.graph_capture
    proves = (
        "forward and write_kv(meta=) read no device tensor on the host (no .item(), bool(), "
        ".cpu(), ...), every check on"
    )
    if level in (GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE, GraphSupport.UNIFORM_BATCH):
        shapes = [DECODE] if base.attn_type is AttentionType.DECODER else []
    else:
        shapes = [
            s
            for s in (main_shape(base.attn_type), DECODE, CHUNKED_PREFILL)
            if s in shapes_for(ax.caps, base.attn_type)
        ]
    configs = [base]
    combined = ax.combined_features(base)
    configs += [combined] if combined else [base.with_(features=(f,)) for f in ax.features]
    configs += [base.with_(kv_cache_dtype=k) for k in ax.kv_cache_dtypes]
    for config, shape in itertools.product(configs, shapes):
        out.add(row, proves, config=config, shape=shape)
    return out.list()


# Head and block sizes tried, in order, to find one a restricted backend refuses.
_REFUSED_HEAD_SIZES = (48, 72, 104, 160, 200, 320, 512, 33, 65, 129, 1024)
_REFUSED_BLOCK_SIZES = (24, 48, 256, 512, 1024, 2, 4, 8, 1, 15, 17)


def refusal_cases(target: Target, scope: Scope) -> list[Case]:
    """Every undeclared capability is refused at construction (or, for batch-level ones, at
    build) with a reason: never a wrong answer."""
    ax = Axes(target, scope)
    out = Cases(target, "refusals", scope)
    base = ax.base
    if base is None:
        return []
    caps = ax.caps
    proves = "refused at construction with UnsupportedConfigurationError and its reasons"

    def refuse(config: Config, row: str, name: str) -> None:
        try:
            config.spec()
        except InvalidSpecError:
            return
        out.add(row, proves, config=config, name=name, not_supported=True)

    for dtype in MODEL_DTYPES:
        if dtype not in caps.dtypes:
            refuse(
                base.with_(dtype=dtype), f"dtype: {dtype_name(dtype)}", f"dtype_{dtype_name(dtype)}"
            )
    for kv in KV_CACHE_DTYPES:
        if kv not in caps.kv_cache_dtypes:
            refuse(base.with_(kv_cache_dtype=kv), f"kv cache: {kv}", f"kv_cache_{kv}")
    for attn in AttentionType:
        if attn not in caps.attn_types:
            refuse(
                base.with_(attn_type=attn), f"attention: {attn.value}", f"attention_{attn.value}"
            )
    for feature in FEATURES:
        if not caps.supports_feature(feature):
            refuse(base.with_(features=(feature,)), f"feature: {feature}", f"feature_{feature}")
    for hs in _REFUSED_HEAD_SIZES:
        if caps.unsupported_reasons(base.with_(head_size=hs).spec()):
            refuse(base.with_(head_size=hs), f"head size: {hs}", f"head_size_{hs}")
            break
    for k, v in (*HEAD_SIZE_V_PAIRS[:1], (base.head_size, base.head_size // 2)):
        config = base.with_(head_size=k, head_size_v=v)
        fields = {r.field for r in caps.unsupported_reasons(config.spec())}
        if "head_size_v" in fields and "head_size" not in fields:  # refused for the pair
            refuse(config, head_size_v_row(k, v), f"head_size_v_{k}_{v}")
            break
    for bs in _REFUSED_BLOCK_SIZES:
        if caps.unsupported_reasons(base.with_(block_size=bs).spec()):
            refuse(base.with_(block_size=bs), f"block size: {bs}", f"block_size_{bs}")
            break
    if base.attn_type is AttentionType.DECODER:
        if not caps.cascade:
            out.add(
                "cascade",
                "build(batch, common_prefix_len > 0) raises UnsupportedConfigurationError",
                config=base,
                shape=CASCADE,
                entry="cascade",
                name="cascade",
                not_supported=True,
            )
        for flag, shape in (
            ("multi_token_decode", MULTI_TOKEN_DECODE),
            ("chunked_prefill", CHUNKED_PREFILL),
        ):
            if not getattr(caps, flag):
                out.add(
                    f"batch: {shape.name}",
                    "an undeclared batch kind is refused with a "
                    "reason or computed correctly, never answered wrongly",
                    config=base,
                    shape=shape,
                    entry=flag,
                    name=flag,
                )
    if caps.graph_capture == GraphSupport.NEVER:
        out.add(
            "graph capture",
            "build_for_graph_capture raises UnsupportedConfigurationError",
            config=base,
            shape=main_shape(base.attn_type),
            entry="graph_capture",
            name="graph_capture",
            not_supported=True,
        )
    return out.list()


def invalid_input_cases(target: Target, scope: Scope) -> list[Case]:
    """Each catalogue entry raises its typed error and leaves the cache byte-identical."""
    from attnhub_conformance.catalogue import INVALID_INPUTS

    ax = Axes(target, scope)
    out = Cases(target, "invalid_inputs", scope)
    base = ax.base
    if base is None:
        return []
    configs = [base]
    if scope.full:
        configs += [base.with_(kv_cache_dtype=k) for k in ax.kv_cache_dtypes]
    widths = {"value_head_size", "value_as_wide_as_key", "output_as_wide_as_query"}
    widths |= {"write_kv_value_head_size", "write_kv_value_as_wide_as_key"}
    if base.attn_type is AttentionType.DECODER:  # values of another width than keys
        configs += [base.with_(head_size=k, head_size_v=v) for k, v in _head_size_v_pairs(ax)]
    for config in configs:
        suffix = "" if config is base else f"-{config.id}"
        distinct = config.head_size_v not in (None, config.head_size)
        for entry in INVALID_INPUTS:
            if distinct and entry.name not in widths:
                continue
            if entry.not_applicable(target, config) is None:
                out.add(
                    "invalid inputs",
                    entry.proves,
                    config=config,
                    shape=main_shape(config.attn_type),
                    entry=entry.name,
                    name=f"{entry.name}{suffix}",
                )
    return out.list()


def availability_case(target: Target, scope: Scope) -> Case:
    """Every selected backend gets one: it loads, runs here, and serves some spec."""
    config = None
    if target.load_error is not None:
        proves = "the backend's plugin loads"
    elif target.unavailable is not None:
        proves = "the backend runs on this device"
    else:
        proves = "the backend serves a spec of the suite's candidates and allocates a cache"
        config = Axes(target, scope).base
    return Case(
        target,
        "availability",
        "availability",
        ("availability",),
        proves,
        config=config,
        skip=None if target.cannot_run else target.unavailable,  # else the test fails, saying why
        scope=scope,
    )


def property_case(target: Target, scope: Scope) -> list[Case]:
    ax = Axes(target, scope)
    if ax.base is None:
        return []
    return [
        Case(
            target,
            "properties",
            "random_batches",
            ("random batches (hypothesis)",),
            "random batch compositions within the declared capabilities match the reference",
            config=ax.base,
            scope=scope,
        )
    ]


def soak_cases(kind: str, row: str, proves: str, target: Target, scope: Scope) -> list[Case]:
    """One case per backend: the soak and the fuzz pick their own spec
    (``attnhub_conformance.soak.default_spec``)."""
    if Axes(target, scope).base is None:
        return []
    return [Case(target, kind, kind, (row,), proves, scope=scope)]


GENERATORS: dict[str, Callable[[Target, Scope], list[Case]]] = {
    "soak": lambda t, s: soak_cases(
        "soak",
        "soak (engine steps)",
        "random engine steps (chunked prefill, multi-token decode with rejected drafts, "
        "preemption by recompute and swap, copy-on-write, cascade, padding, poisoned free "
        "blocks) match a shadow float64 model; the cache holds exactly what was written",
        t,
        s,
    ),
    "fuzz": lambda t, s: soak_cases(
        "fuzz",
        "API fuzz",
        "spoiled calls raise typed errors only and leave caches byte-identical; accepted ones "
        "are correct",
        t,
        s,
    ),
    "outputs": output_cases,
    "kv_cache": kv_cache_cases,
    "invalid_inputs": invalid_input_cases,
    "refusals": refusal_cases,
    "host_sync": host_sync_cases,
    "strided_cache": strided_cache_cases,
    "quantization_accuracy": quantization_accuracy_cases,
    "properties": property_case,
    "output_buffer": lambda t, s: simple_cases(
        "output_buffer", "output buffer", "forward(..., output=buf) fills and returns buf", t, s
    ),
    "determinism": lambda t, s: simple_cases(
        "determinism", "determinism", "the same inputs give the same bits", t, s
    ),
    "batch_invariance": lambda t, s: simple_cases(
        "batch_invariance",
        "batch invariance",
        "a request's output does not depend on its neighbours or its place in the batch",
        t,
        s,
    ),
    "metadata_reuse": lambda t, s: simple_cases(
        "metadata_reuse",
        "metadata reuse",
        "metadata built once serves every layer, unchanged by forward",
        t,
        s,
    ),
    "threads": lambda t, s: simple_cases(
        "threads",
        "threads",
        "two threads driving their own caches through one backend, builder and impl compute "
        "what one thread does",
        t,
        s,
    ),
}


def _graph_cases(target: Target, scope: Scope) -> list[Case]:
    from attnhub_conformance.graph_cases import graph_cases

    return graph_cases(target, scope)


GENERATORS["graphs"] = _graph_cases


def _mla_cases(target: Target, scope: Scope) -> list[Case]:
    from attnhub_conformance.mla_cases import mla_cases

    return mla_cases(target, scope)


GENERATORS["mla"] = _mla_cases


def _compiled_cases(target: Target, scope: Scope) -> list[Case]:
    from attnhub_conformance.compiled import compiled_cases

    return compiled_cases(target, scope)


GENERATORS["compiled"] = _compiled_cases


def generate(kind: str, target: Target, scope: Scope) -> list[Case]:
    """The cases of one kind of test for one target (none for a target that cannot run)."""
    if kind == "availability":
        return [availability_case(target, scope)]
    if not target.runnable:
        return []
    return GENERATORS[kind](target, scope)


# --- long contexts, non-contiguous inputs, extreme logits ------------------------------------

#: Keys of the full scope's long cases: at least 32k, and one case near 128k (Capabilities
#: declares no maximum sequence length, so every backend that serves a spec takes any length).
LONG_KEYS = 32 * 1024
LONGEST_KEYS = 128 * 1024 - 1000
#: Keys that cross the split thresholds the backends' docs name (docs/backends/<name>.md,
#: "Where the kernels switch paths"), where a backend gives no figure of its own: vLLM CPU's
#: KV split of a decode, FlashAttention's split-KV and FIA's tiling all switch well below this.
SPLIT_KEYS = 8 * 1024


def split_threshold_keys(target: Target, config: Config) -> int:
    """The key count past which the backend's kernels take another path, where the backend
    says (the torch backend: its planner gathers at most ``gather_budget_bytes`` of K/V per
    decode chunk, so one longer request is planned alone); else :data:`SPLIT_KEYS`."""
    budget = getattr(target.backend, "gather_budget_bytes", None)
    if not isinstance(budget, int) or budget <= 0:
        return SPLIT_KEYS
    fmt = KV_CACHE_DTYPES[config.kv_cache_dtype]
    k_dtype, v_dtype = fmt.storage_dtypes(config.dtype)
    per_token = config.heads.num_kv_heads * config.head_size * (k_dtype.itemsize + v_dtype.itemsize)
    return max(SPLIT_KEYS, budget // per_token)


def _long_decode(keys: int) -> Callable[[int, Capabilities, Scope], BatchPlan]:
    def plan(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
        # the long request mid-block; a second past half of it; a short one beside them
        return BatchPlan(((1, 3 * bs + 1), (1, keys + bs // 2 + 3), (1, keys // 2 + 7)), padding=1)

    return plan


def _long_chunked_prefill(keys: int) -> Callable[[int, Capabilities, Scope], BatchPlan]:
    def plan(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
        return BatchPlan(((1, 2 * bs + 1), (300, keys + 300 + 5)))

    return plan


def long_context_cases(target: Target, scope: Scope) -> list[Case]:
    """Decodes (and, full scope, a chunked prefill) over long cached contexts: quick, just past
    the backend's split threshold (:func:`split_threshold_keys`); full, over 32k keys in every
    dtype and with every declared feature, and near 128k once. Needle keys (keys close to the
    query, so that they carry much of the weight) sit early, past 16k and near the end, so that
    a key read or weighted wrongly anywhere shows. The reference is computed in chunks
    (``attnhub.reference.paged_attention_chunked``)."""
    ax = Axes(target, scope)
    out = Cases(target, "long_context", scope)
    base = ax.base
    if base is None or base.attn_type is not AttentionType.DECODER:
        return []
    proves = (
        "forward over a long cached context matches the reference (needles early, past 16k "
        "keys and at the end)"
    )
    split = split_threshold_keys(target, base)
    shape = Shape(f"long_decode_{split}", "decodes past the split threshold", _long_decode(split))
    out.add("long context: past the split threshold", proves, config=base, shape=shape)
    if not scope.full:
        return out.list()
    dec = Shape("long_decode_32k", "decodes over 32k keys", _long_decode(LONG_KEYS))
    for dtype in ax.dtypes:
        out.add("long context: decode 32k", proves, config=base.with_(dtype=dtype), shape=dec)
    # the declared features over 32k keys: a sliding window alone (its blocks skipped), the
    # others together (softcap, ALiBi, sinks: every key weighted)
    unwindowed = tuple(f for f in ax.features if f != "sliding_window")
    feature_sets: list[tuple[str, ...]] = (
        [("sliding_window",)] if "sliding_window" in ax.features else []
    )
    feature_sets += [unwindowed] if unwindowed else []
    for feats in feature_sets:
        config = base.with_(features=feats)
        if ax.supports(config):
            out.add("long context: decode 32k", proves, config=config, shape=dec)
        else:  # each on its own
            for f in feats:
                out.add(
                    "long context: decode 32k", proves, config=base.with_(features=(f,)), shape=dec
                )
    if ax.caps.chunked_prefill:
        pre = Shape(
            "long_chunked_prefill_32k",
            "a 300-token chunk over 32k cached keys",
            _long_chunked_prefill(LONG_KEYS),
        )
        out.add("long context: chunked prefill 32k", proves, config=base, shape=pre)
    longest = Shape("long_decode_128k", "decodes near 128k keys", _long_decode(LONGEST_KEYS))
    out.add("long context: decode 128k", proves, config=base, shape=longest)
    return out.list()


def noncontiguous_cases(target: Target, scope: Scope) -> list[Case]:
    """q, k and v as views of one fused QKV projection ``[T, (H + 2 * Hkv) * D]`` (strided
    rows, dense channels), the output a strided view of a larger buffer: computed as with
    dense tensors, nothing outside the views written; or refused with a typed error, the cache
    untouched. The base, every declared feature together, each KV format (full: each dtype)."""
    ax = Axes(target, scope)
    out = Cases(target, "noncontiguous", scope)
    base = ax.base
    if base is None:
        return []
    proves = (
        "fused-QKV views in, a strided output view out: the reference's answer, the rest of "
        "both buffers untouched (or a typed refusal, the cache untouched)"
    )
    configs = [base]
    combined = ax.combined_features(base)
    configs += [combined] if combined else [base.with_(features=(f,)) for f in ax.features]
    configs += [base.with_(kv_cache_dtype=k) for k in ax.kv_cache_dtypes]
    if scope.full:
        configs += [base.with_(dtype=d) for d in ax.dtypes]
    shapes = [main_shape(base.attn_type)]
    if DECODE in shapes_for(ax.caps, base.attn_type):
        shapes.append(DECODE)
    for config in configs:
        for shape in shapes:
            out.add("non-contiguous q/k/v and output", proves, config=config, shape=shape)
    return out.list()


#: The extreme-logit cases: (entry, matrix row, feature it needs or None).
EXTREME_LOGITS = (
    ("large_scores", "extreme logits: scores ~1e4", None),
    ("equal_logits", "extreme logits: all logits equal", None),
    ("softcap_limit", "extreme logits: at the softcap limit", "softcap"),
    ("alibi_far", "extreme logits: very negative ALiBi", "alibi"),
)
#: Keys of the ALiBi case's longest request: the steepest slope (1/2) times this distance is a
#: bias near -1000.
ALIBI_FAR_KEYS = 2 * 1024


def _alibi_far(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
    reqs = [(1, ALIBI_FAR_KEYS + 3), (1, bs + 2), (1, ALIBI_FAR_KEYS // 2 + 1)]
    if caps.chunked_prefill:
        reqs.append((17, ALIBI_FAR_KEYS + 17))
    return BatchPlan(tuple(reqs))


ALIBI_FAR = Shape("alibi_far", "long distances under ALiBi", _alibi_far)


def extreme_logit_cases(target: Target, scope: Scope) -> list[Case]:
    """Per dtype: scores of magnitude ~1e4 (a shift shared by every key of a row: the math is
    that of the unshifted scores), rows whose logits are all equal (a zero query), logits at
    the softcap limit (where declared), ALiBi biases near -1000 (where declared). Checked
    against the reference's bounds; never NaN or inf."""
    ax = Axes(target, scope)
    out = Cases(target, "extreme_logits", scope)
    base = ax.base
    if base is None:
        return []
    proves = "forward stays finite and matches the reference where the logits are extreme"
    shape = main_shape(base.attn_type)
    for (entry, row, feature), dtype in itertools.product(EXTREME_LOGITS, ax.dtypes):
        config = base.with_(dtype=dtype)
        use = shape
        if feature is not None:
            if feature not in ax.features:
                continue
            config = config.with_(features=(feature,))
            if feature == "alibi" and base.attn_type is AttentionType.DECODER:
                use = ALIBI_FAR
        if ax.supports(config):
            out.add(
                row,
                proves,
                config=config,
                shape=use,
                entry=entry,
                name=f"{entry}-{use.name}-{config.id}",
            )
    return out.list()


GENERATORS["long_context"] = long_context_cases
GENERATORS["noncontiguous"] = noncontiguous_cases
GENERATORS["extreme_logits"] = extreme_logit_cases


#: The LSE cases' matrix row.
LSE_ROW = "lse"


def _lse_halves(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
    """Decodes whose keys each span more than one block: split at a block boundary, both halves
    hold keys (a query token at the end sees every key of either half, causal or not)."""
    return BatchPlan(tuple((1, s) for s in (bs + 1, 2 * bs + 3, 5 * bs, 3 * bs + bs // 2 + 1)))


LSE_HALVES = Shape("lse_halves", "decodes split over two halves of their block tables", _lse_halves)


def _lse_context_and_new(bs: int, caps: Capabilities, scope: Scope) -> BatchPlan:
    """Chunked prefills (and a decode) whose context spans at least one block more than their
    query: split at the context's last block boundary, the first part is context alone."""
    return BatchPlan(((3, 2 * bs + 4), (bs + 1, 4 * bs + 1), (1, 2 * bs + 5)))


LSE_CONTEXT_AND_NEW = Shape(
    "lse_context_and_new",
    "chunked prefills split into their context (non-causal) and the rest (causal)",
    _lse_context_and_new,
)


def lse_cases(target: Target, scope: Scope) -> list[Case]:
    """``forward(..., return_lse=True)``, generated from ``Capabilities.lse``: where declared,
    the LSE's value (natural log) against the reference's, its shape, dtype and padding rows
    (+inf), per dtype, cache format, with each feature alone and every feature at once; and a
    merge of the (out, LSE) of two halves of each request's keys (two builds over split block
    tables) equal to attention over the whole. Where not declared: a typed refusal, the cache
    untouched."""
    ax = Axes(target, scope)
    out = Cases(target, "lse", scope)
    base = ax.base
    if base is None:
        return []
    configs = [base.with_(dtype=d) for d in ax.dtypes]
    configs += [base.with_(kv_cache_dtype=k) for k in ax.kv_cache_dtypes]
    combined = ax.combined_features(base)
    # every feature alone too, beside all at once: one feature can hide another's effect on
    # the LSE (a window that cuts keys takes FA2's kernels off the causal branch whose ALiBi
    # bias shifts each row's LSE by slope times the query's position)
    configs += [combined] if combined else []
    configs += [base.with_(features=(f,)) for f in ax.features]
    shape = main_shape(base.attn_type)
    declared = target.capabilities.lse
    if combined and "sinks" in combined.features and not declared.sinks:
        # refused with sinks: the other features' LSE is still checked, together
        unsunk = combined.with_(features=tuple(f for f in combined.features if f != "sinks"))
        configs += [unsunk] if ax.supports(unsunk) else []
    for config in configs:
        if declared.refusal(config.spec()) is not None:
            out.add(
                LSE_ROW,
                "return_lse=True is refused with a typed error where the LSE is not declared, "
                "the cache untouched",
                config=config,
                shape=shape,
                entry="refused",
                name=f"refused-{shape.name}-{config.id}",
                not_supported=True,
            )
            continue
        out.add(
            LSE_ROW,
            "the LSE is the reference's (natural log), [num_tokens, num_heads] float32, "
            "padding rows +inf, the output unchanged",
            config=config,
            shape=shape,
            entry="value",
            name=f"value-{shape.name}-{config.id}",
        )
    halves = base.with_(features=())
    if (
        base.attn_type is AttentionType.DECODER
        and declared.refusal(halves.spec()) is None
        and ax.supports(halves)
    ):
        out.add(
            LSE_ROW,
            "merging the (out, LSE) of two halves of the keys gives attention over the whole",
            config=halves,
            shape=LSE_HALVES,
            entry="merge",
            name=f"merge-{LSE_HALVES.name}-{halves.id}",
        )
        if target.capabilities.chunked_prefill:
            out.add(
                LSE_ROW,
                "merging the (out, LSE) of a chunked prefill's context (non-causal) and of the "
                "rest (causal) gives attention over the whole",
                config=halves,
                shape=LSE_CONTEXT_AND_NEW,
                entry="merge",
                name=f"merge-{LSE_CONTEXT_AND_NEW.name}-{halves.id}",
            )
    return out.list()


GENERATORS["lse"] = lse_cases


def _batch_invariance_cases(target: Target, scope: Scope) -> list[Case]:
    from attnhub_conformance.batch_invariance import batch_invariance_cases

    return batch_invariance_cases(target, scope)


def _determinism_cases(target: Target, scope: Scope) -> list[Case]:
    from attnhub_conformance.batch_invariance import determinism_cases

    return determinism_cases(target, scope)


GENERATORS["placements"] = _batch_invariance_cases
GENERATORS["determinism_again"] = _determinism_cases
#: The multi-rank cases' matrix row prefix (a row per group size).
MULTI_RANK_ROW = "multi-rank: decode context parallel"
#: Group sizes: the quick scope spawns one group of 2 ranks per backend, the full one 2 and 4.
MULTI_RANK_SIZES = {False: (2,), True: (2, 4)}


def multi_rank_cases(target: Target, scope: Scope) -> list[Case]:
    """Decode context parallel through the backend over real gloo process groups (the
    ``multi_rank`` marker, ``attnhub_conformance.multi_rank``), for any backend that declares
    the LSE: a case per group size, each a spawned group running decodes, a multi-token decode
    and chunked-prefill rows in one step, interleave 1 and the block size, sinks where declared.
    Where the backend cannot serve it (no LSE for the spec, or the gathered spec refused): a
    skip that gives the declaration's reason."""
    from attnhub.context_parallel import dcp_unsupported_reasons

    ax = Axes(target, scope)
    base = ax.base
    if base is None or base.attn_type is not AttentionType.DECODER:
        return []
    caps = target.capabilities
    config = base.with_(features=())
    for dtype in ax.dtypes:  # a dtype the LSE is declared for, where there is one
        if caps.lse.refusal(config.with_(dtype=dtype).spec()) is None:
            config = config.with_(dtype=dtype)
            break
    spec = config.spec()
    out = Cases(target, "multi_rank", scope)
    assert target.backend is not None
    for n in MULTI_RANK_SIZES[scope.full]:
        row = f"{MULTI_RANK_ROW} {n} ranks"
        name = f"dcp-N{n}-{config.id}"
        reasons = [str(r) for r in dcp_unsupported_reasons(target.backend, spec)]
        if not reasons:
            gathered = replace(spec, num_heads=n * spec.num_heads)
            reasons = [f"the gathered spec ({gathered.num_heads} heads): {r}"
                       for r in target.refusal(gathered)]  # fmt: skip
        if target.device != "cpu":
            reasons.append(
                f"the multi-rank cases run gloo groups on the host (device cpu), not "
                f"{target.device}"
            )
        if reasons:
            out.add(
                row,
                "decode context parallel is refused with the declaration's reason",
                config=config,
                name=name,
                entry=str(n),
                skip="; ".join(reasons),
                not_supported=True,
            )
            continue
        out.add(
            row,
            f"decode context parallel over {n} gloo ranks (decodes, a multi-token decode, "
            "chunked prefill; interleave 1 and the block size; sinks once) equals the "
            "reference and the single-rank run; each rank's cache holds exactly its shard",
            config=config,
            name=name,
            entry=str(n),
        )
    return out.list()


GENERATORS["multi_rank"] = multi_rank_cases
#: The MLA multi-rank cases' matrix row prefix (a row per group size).
MULTI_RANK_MLA_ROW = "multi-rank: decode context parallel of MLA layers"
#: Query heads per rank an MLA case tries, fewest first (the quick cases' 2 where any serve).
MULTI_RANK_MLA_HEADS = (2, 4, 8, 16, 32, 64, 128)


def multi_rank_mla_cases(target: Target, scope: Scope) -> list[Case]:
    """Decode context parallel of MLA layers in the absorbed form through the backend over
    real gloo process groups (the ``multi_rank`` marker, ``attnhub_conformance.multi_rank``'s
    ``dcp_sub_case``), for any backend that declares the MLA LSE
    (``Capabilities.mla.lse``): a case per group size, the same steps as the standard cases
    (interleave 1 and the block size, both communication variants) over a declared MLA layer
    whose per-rank and gathered head counts the backend both serves. Where it cannot serve
    it: a skip that gives the declaration's reason. No case where MLA is not declared."""
    from attnhub.context_parallel import dcp_unsupported_reasons
    from attnhub_conformance.mla_cases import SMALL_LATENT, MLACase, MLAConfig

    mla = target.capabilities.mla
    if not mla.declared or target.backend is None:
        return []
    backend = target.backend
    # the finest declared dtype the MLA LSE is declared for: the merge scales each rank's
    # partial by exp(lse_r - L), so an LSE returned in the model dtype (ascend's ATB route)
    # carries that dtype's rounding into every weight (docs/context-parallel.md, "MLA layers")
    dtypes = [d for d in (torch.float32, torch.float16, torch.bfloat16) if d in mla.dtypes]
    lse_dtypes = [
        d for d in dtypes
        if mla.lse.refusal(MLAConfig(d, 16, SMALL_LATENT, "joint").spec()) is None
    ]  # fmt: skip
    if not dtypes:
        return []
    dtype = (lse_dtypes or dtypes)[0]
    blocks = [
        b
        for b in dict.fromkeys([*scope.block_sizes, *sorted(mla.block_sizes or ())])
        if (mla.block_sizes is None or b in mla.block_sizes) and b % mla.block_size_multiple == 0
    ]
    if not blocks:
        return []
    latent = sorted(mla.latent_sizes)[0] if mla.latent_sizes is not None else SMALL_LATENT
    out: list[Case] = []
    for n in MULTI_RANK_SIZES[scope.full]:
        row = f"{MULTI_RANK_MLA_ROW} {n} ranks"
        reasons: list[str] = []
        config = None
        for heads in MULTI_RANK_MLA_HEADS:  # a head count served per rank and gathered
            config = MLAConfig(dtype, blocks[0], latent, mla.layouts[0], num_heads=heads)
            spec = config.spec()
            why = [str(r) for r in dcp_unsupported_reasons(backend, spec)]
            why += [str(r) for r in backend.mla_unsupported_reasons(spec)]
            why += [
                f"the gathered spec ({n * heads} heads): {r}"
                for r in backend.mla_unsupported_reasons(replace(spec, num_heads=n * heads))
            ]
            reasons = why
            if not why:
                break
        assert config is not None
        if not reasons and target.device != "cpu":
            reasons = [
                f"the multi-rank cases run gloo groups on the host (device cpu), not "
                f"{target.device}"
            ]
        proves = (
            "decode context parallel of an MLA layer is refused with the declaration's reason"
            if reasons
            else f"decode context parallel of an MLA layer over {n} gloo ranks (decodes, a "
            "multi-token decode, chunked prefill; interleave 1 and the block size) equals the "
            "reference's absorbed form and the single-rank MLA run; each rank's latent cache "
            "holds exactly its shard"
        )
        case = MLACase(
            target=target, kind="multi_rank_mla", name=f"mla-dcp-N{n}-{config.id}", rows=(row,),
            proves=proves, scope=scope, mla=config, entry=str(n),
            skip="; ".join(reasons) or None, not_supported=bool(reasons),
        )  # fmt: skip
        out.append(case)
    return out


GENERATORS["multi_rank_mla"] = multi_rank_mla_cases
