"""A catalogue of invalid calls: each raises the right attnhub error, names the bad value, and
leaves every KV cache byte-identical (validation happens before anything is written)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest
import torch

from attnhub import AttentionSpec, BatchMetadata, GraphSupport, PagedKVCache
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.testing import fill_cache_random, generator, make_batch, num_blocks_for, random_qkv
from attnhub.torch_backend import (
    TorchAttentionImpl,
    TorchAttentionMetadata,
    TorchBackend,
    TorchMetadataBuilder,
)

H, HKV, D, BS = 8, 2, 64, 16
SPEC = AttentionSpec(
    num_heads=H, num_kv_heads=HKV, head_size=D, dtype=torch.bfloat16, block_size=BS
)
QUERY_LENS, SEQ_LENS, NUM_TOKENS = (1, 5, 1), (20, 9, 33), 9  # 7 real tokens + 2 padding
NUM_SLOTS = num_blocks_for(SEQ_LENS, BS) * BS  # of the cache the ctx fixture allocates


@dataclass
class Ctx:
    backend: TorchBackend
    batch: BatchMetadata
    cache: PagedKVCache
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bad_caches: dict[str, PagedKVCache] = field(default_factory=dict)

    @property
    def impl(self) -> TorchAttentionImpl:
        return self.backend.impl()

    @property
    def builder(self) -> TorchMetadataBuilder:
        return self.backend.metadata_builder()

    @property
    def meta(self) -> TorchAttentionMetadata:
        return self.builder.build(self.batch)

    def forward(self, **kw: object) -> torch.Tensor:
        args: dict[str, object] = {
            "query": self.q,
            "key": self.k,
            "value": self.v,
            "cache": self.cache,
            "meta": self.meta,
        }
        args.update(kw)
        meta = args.pop("meta")
        return self.impl.forward(
            args["query"],
            args["key"],
            args["value"],
            args["cache"],
            meta,  # type: ignore[arg-type]
            output=args.get("output"),  # type: ignore[arg-type]
        )

    def write_kv(self, **kw: object) -> None:
        args: dict[str, object] = {
            "key": self.k,
            "value": self.v,
            "cache": self.cache,
            "slot_mapping": self.batch.slot_mapping,
        }
        args.update(kw)
        self.impl.write_kv(**args)  # type: ignore[arg-type]

    def edited_meta(self, **changes: object) -> TorchAttentionMetadata:
        """Metadata of a hand-edited batch (value errors that only forward can see)."""
        return self.builder.build(replace(self.batch, **changes))  # type: ignore[arg-type]

    def with_slot(self, i: int, slot: int) -> torch.Tensor:
        s = self.batch.slot_mapping.clone()
        s[i] = slot
        return s

    def with_table_entry(self, r: int, c: int, block: int) -> torch.Tensor:
        t = self.batch.block_table.clone()
        t[r, c] = block
        return t


def alloc(nblk: int, **kw: object) -> PagedKVCache:
    args: dict[str, object] = {
        "num_blocks": nblk,
        "block_size": BS,
        "num_kv_heads": HKV,
        "head_size": D,
        "dtype": torch.bfloat16,
    }
    layout = kw.pop("layout", "NHD")
    kv = kw.pop("kv_cache_dtype", "auto")
    args.update(kw)
    cache = PagedKVCache.allocate(**args, layout=layout, kv_cache_dtype=kv)  # type: ignore[arg-type]
    fill_cache_random(cache, generator(nblk))
    return cache


@pytest.fixture
def ctx() -> Ctx:
    batch, nblk = make_batch(QUERY_LENS, SEQ_LENS, BS, seed=5, num_tokens=NUM_TOKENS)
    backend = TorchBackend(SPEC, "cpu")
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(6))
    q, k, v = random_qkv(SPEC, NUM_TOKENS, generator(7))
    bad = {
        "hnd": alloc(nblk, layout="HND"),
        "fp8": alloc(nblk, kv_cache_dtype="fp8_e4m3"),
        "block_size_32": alloc(nblk, block_size=32),
        "fp16": alloc(nblk, dtype=torch.float16),
        "kv_heads_4": alloc(nblk, num_kv_heads=4),
        "head_size_128": alloc(nblk, head_size=128),
        "small": alloc(2),
    }
    return Ctx(backend, batch, cache, q, k, v, bad)


T = NUM_TOKENS
Call = Callable[[Ctx], object]

FORWARD_CASES: list[tuple[str, Call, str]] = [
    ("query_dtype", lambda c: c.forward(query=c.q.half()), "query has dtype torch.float16"),
    ("key_dtype", lambda c: c.forward(key=c.k.float()), "key has dtype torch.float32"),
    ("value_dtype", lambda c: c.forward(value=c.v.half()), "value has dtype torch.float16"),
    ("query_head_count", lambda c: c.forward(query=c.q[:, :3]), f"query has shape [{T}, 3, {D}]"),
    ("query_head_size", lambda c: c.forward(query=c.q[..., :32]), f"[{T}, {H}, 32]"),
    ("key_head_count", lambda c: c.forward(key=c.k.repeat(1, 2, 1)), f"key has shape [{T}, 4, "),
    ("value_head_size", lambda c: c.forward(value=c.v[..., :8]), f"value has shape [{T}, 2, 8]"),
    ("query_2d", lambda c: c.forward(query=c.q.flatten(1)), f"query has shape [{T}, {H * D}]"),
    ("query_not_tensor", lambda c: c.forward(query=c.q.tolist()), "got list"),
    ("query_too_few_tokens", lambda c: c.forward(query=c.q[:3]), "query has 3 tokens"),
    (
        "key_too_few_tokens",
        lambda c: c.forward(key=c.k[:3], value=c.v[:3]),
        f"key has 3 tokens but slot_mapping has {T}",
    ),
    ("key_value_mismatch", lambda c: c.forward(value=c.v[:-1]), f"value has {T - 1}"),
    ("query_on_meta", lambda c: c.forward(query=c.q.to("meta")), "query is on meta"),
    ("key_on_meta", lambda c: c.forward(key=c.k.to("meta")), "key is on meta"),
    ("value_on_meta", lambda c: c.forward(value=c.v.to("meta")), "value is on meta"),
    ("key_without_value", lambda c: c.forward(value=None), "key and value must both"),
    ("value_without_key", lambda c: c.forward(key=None), "key and value must both"),
    (
        "output_too_short",
        lambda c: c.forward(output=torch.empty(T - 1, H, D, dtype=torch.bfloat16)),
        f"output has shape [{T - 1}, {H}, {D}]",
    ),
    (
        "output_dtype",
        lambda c: c.forward(output=torch.empty(T, H, D)),
        "output has dtype torch.float32",
    ),
    (
        "output_on_meta",
        lambda c: c.forward(output=torch.empty(T, H, D, dtype=torch.bfloat16, device="meta")),
        "output is on meta",
    ),
    ("meta_is_batch", lambda c: c.forward(meta=c.batch), "got BatchMetadata"),
    ("meta_is_none", lambda c: c.forward(meta=None), "got NoneType"),
    ("cache_layout", lambda c: c.forward(cache=c.bad_caches["hnd"]), "cache layout is 'HND'"),
    ("cache_kv_dtype", lambda c: c.forward(cache=c.bad_caches["fp8"]), "'fp8_e4m3'"),
    (
        "cache_block_size",
        lambda c: c.forward(cache=c.bad_caches["block_size_32"]),
        "cache block_size is 32",
    ),
    ("cache_dtype", lambda c: c.forward(cache=c.bad_caches["fp16"]), "torch.float16"),
    ("cache_kv_heads", lambda c: c.forward(cache=c.bad_caches["kv_heads_4"]), "4 kv heads"),
    ("cache_head_size", lambda c: c.forward(cache=c.bad_caches["head_size_128"]), "size 128"),
    ("cache_is_tensor", lambda c: c.forward(cache=c.cache.key), "got Tensor"),
    (
        "slot_outside_cache",
        lambda c: c.forward(meta=c.edited_meta(slot_mapping=c.with_slot(2, 10**6))),
        "slot_mapping[2] = 1000000",
    ),
    (
        "slot_negative",
        lambda c: c.forward(meta=c.edited_meta(slot_mapping=c.with_slot(1, -5))),
        "slot_mapping[1] = -5",
    ),
    (
        "block_table_outside_cache",
        lambda c: c.forward(meta=c.edited_meta(block_table=c.with_table_entry(1, 0, 999))),
        "block_table[1, 0] = 999",
    ),
    (
        "block_table_negative",
        lambda c: c.forward(meta=c.edited_meta(block_table=c.with_table_entry(2, 2, -3))),
        "block_table[2, 2] = -3",
    ),
    (
        "cache_smaller_than_the_batch_needs",
        lambda c: c.forward(cache=c.bad_caches["small"]),
        "is outside the cache (2 blocks",
    ),
]

WRITE_KV_CASES: list[tuple[str, Call, str]] = [
    (
        "slot_outside_cache",
        lambda c: c.write_kv(slot_mapping=c.with_slot(2, 4096)),
        "slot_mapping[2] = 4096",
    ),
    (
        "slot_just_past_the_end",
        lambda c: c.write_kv(slot_mapping=c.with_slot(0, NUM_SLOTS)),
        f"slot_mapping[0] = {NUM_SLOTS} is outside the cache",
    ),
    ("slot_minus_two", lambda c: c.write_kv(slot_mapping=c.with_slot(1, -2)), "use -1"),
    (
        "slots_float",
        lambda c: c.write_kv(slot_mapping=c.batch.slot_mapping.float()),
        "slot_mapping has dtype torch.float32",
    ),
    (
        "slots_2d",
        lambda c: c.write_kv(slot_mapping=c.batch.slot_mapping[None]),
        f"slot_mapping has shape [1, {T}]",
    ),
    (
        "slots_on_meta",
        lambda c: c.write_kv(slot_mapping=c.batch.slot_mapping.to("meta")),
        "slot_mapping is on meta",
    ),
    (
        "key_shorter_than_slots",
        lambda c: c.write_kv(key=c.k[:4], value=c.v[:4]),
        f"key has 4 tokens but slot_mapping has {T}",
    ),
    ("key_dtype", lambda c: c.write_kv(key=c.k.float()), "key has dtype torch.float32"),
    ("value_head_count", lambda c: c.write_kv(value=c.v[:, :1]), f"value has shape [{T}, 1, "),
    ("key_on_meta", lambda c: c.write_kv(key=c.k.to("meta")), "key is on meta"),
    ("cache_layout", lambda c: c.write_kv(cache=c.bad_caches["hnd"]), "'HND'"),
    ("cache_kv_dtype", lambda c: c.write_kv(cache=c.bad_caches["fp8"]), "'fp8_e4m3'"),
]


def _check(ctx: Ctx, call: Call, named: str, error: type[Exception]) -> None:
    caches = [ctx.cache, *ctx.bad_caches.values()]
    before = [c.clone() for c in caches]
    with pytest.raises(error) as info:
        call(ctx)
    assert named in str(info.value), f"message {str(info.value)!r} does not name {named!r}"
    for c, b in zip(caches, before, strict=True):
        assert c.equal(b), "a rejected call changed a cache"


@pytest.mark.parametrize(("call", "named"), [pytest.param(c, n, id=i) for i, c, n in FORWARD_CASES])
def test_bad_forward_raises_invalid_input_and_leaves_cache_unchanged(
    ctx: Ctx, call: Call, named: str
) -> None:
    _check(ctx, call, named, InvalidInputError)


@pytest.mark.parametrize(
    ("call", "named"), [pytest.param(c, n, id=i) for i, c, n in WRITE_KV_CASES]
)
def test_bad_write_kv_raises_invalid_input_and_leaves_cache_unchanged(
    ctx: Ctx, call: Call, named: str
) -> None:
    assert ctx.cache.num_slots == NUM_SLOTS
    _check(ctx, call, named, InvalidInputError)


def test_block_table_is_rechecked_for_a_cache_of_another_size(ctx: Ctx) -> None:
    meta = ctx.meta
    impl = ctx.impl
    impl.forward(ctx.q, ctx.k, ctx.v, ctx.cache, meta)  # fine for the cache it was built for
    _check(
        ctx,
        lambda c: impl.forward(c.q, None, None, c.bad_caches["small"], meta),
        "outside the cache (2 blocks",
        InvalidInputError,
    )


def test_quantized_cache_without_its_scale_is_rejected() -> None:
    spec = replace(SPEC, kv_cache_dtype="fp8_e4m3")
    batch, nblk = make_batch(QUERY_LENS, SEQ_LENS, BS, seed=8)
    backend = TorchBackend(spec, "cpu")
    cache = replace(backend.allocate_kv_cache(nblk), key_scale=None)
    before = cache.clone()
    q, k, v = random_qkv(spec, batch.num_tokens, generator(9))
    meta = backend.metadata_builder().build(batch)
    with pytest.raises(InvalidInputError, match=r"needs cache\.key_scale"):
        backend.impl().forward(q, k, v, cache, meta)
    assert cache.equal(before)


@pytest.mark.parametrize(
    ("which", "scale", "named"),
    [
        # per kv head where the format has one per-tensor scale: the keys were written, then
        # the values' quantization raised torch's RuntimeError (a half-written cache)
        (
            "value_scale",
            torch.full((2,), 0.04),
            r"value_scale must be float32 \(\).*got torch\.float32 \(2,\)",
        ),
        (
            "value_scale",
            torch.full((2, 1), 0.04),
            r"value_scale must be float32 \(\).*got torch\.float32 \(2, 1\)",
        ),
        (
            "key_scale",
            torch.full((1, 1, 1, 1), 0.05),
            r"key_scale must be float32 \(\).*got torch\.float32 \(1, 1, 1, 1\)",
        ),
        ("key_scale", torch.tensor(1), r"key_scale must be float32 \(\).*got torch\.int64 \(\)"),
        ("key_scale", torch.tensor(0.05, device="meta"), r"key_scale is on meta"),
    ],
)
def test_a_static_scale_of_the_wrong_shape_dtype_or_device_is_refused_before_writing(
    which: str, scale: torch.Tensor, named: str
) -> None:
    """An engine attaches an fp8 cache's scales itself; one that is not the format's (one
    float per tensor, on the cache's device) is refused with InvalidInputError naming it,
    the cache untouched."""
    spec = replace(SPEC, kv_cache_dtype="fp8_e4m3")
    batch, nblk = make_batch(QUERY_LENS, SEQ_LENS, BS, seed=8)
    backend = TorchBackend(spec, "cpu")
    cache = replace(backend.allocate_kv_cache(nblk), **{which: scale})
    planes = [p.view(torch.uint8).clone() for p in (cache.key, cache.value)]
    q, k, v = random_qkv(spec, batch.num_tokens, generator(9))
    meta = backend.metadata_builder().build(batch)
    for call in (
        lambda: backend.impl().forward(q, k, v, cache, meta),
        lambda: backend.impl().write_kv(k, v, cache, batch.slot_mapping),
    ):
        with pytest.raises(InvalidInputError, match=named):
            call()
        for plane, held in zip((cache.key, cache.value), planes, strict=True):
            assert torch.equal(plane.view(torch.uint8), held)


# --- builder.build ------------------------------------------------------------------------------

BUILD_CASES: list[tuple[str, Call, type[Exception], str]] = [
    (
        "batch_block_size",
        lambda c: c.builder.build(BatchMetadata.from_lengths([1], [3], [[1]], 32)),
        InvalidInputError,
        "batch block_size is 32",
    ),
    ("not_a_batch", lambda c: c.builder.build({"seq_lens": [3]}), InvalidInputError, "got dict"),
    (
        "batch_on_meta",
        lambda c: c.builder.build(BatchMetadata.from_lengths([1], [3], [[1]], BS, "meta")),
        InvalidInputError,
        "batch tensors are on meta",
    ),
    (
        "inconsistent_batch",
        lambda c: c.builder.build(replace(c.batch, num_actual_tokens=99)),
        InvalidInputError,
        "num_actual_tokens = 99",
    ),
    (
        "query_start_loc_not_monotone",
        lambda c: c.builder.build(
            replace(c.batch, query_start_loc_cpu=torch.tensor([0, 6, 2, 7], dtype=torch.int32))
        ),
        InvalidInputError,
        "query_start_loc[1] = 6, query_start_loc[2] = 2",
    ),
    (
        "cascade_not_supported",
        lambda c: c.builder.build(c.batch, common_prefix_len=4),
        UnsupportedConfigurationError,
        "common_prefix_len = 4",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "named"), [pytest.param(c, e, n, id=i) for i, c, e, n in BUILD_CASES]
)
def test_bad_build_raises_naming_the_value(
    ctx: Ctx, call: Call, error: type[Exception], named: str
) -> None:
    _check(ctx, call, named, error)


# --- per-layer weights --------------------------------------------------------------------------

SLOPES = torch.ones(H) / 4
IMPL_CASES = [
    pytest.param(
        {},
        {"alibi_slopes": SLOPES},
        "alibi_slopes were given but spec.use_alibi is False",
        id="alibi_given_without_use_alibi",
    ),
    pytest.param(
        {"use_alibi": True}, {}, "spec.use_alibi is True but no alibi_slopes", id="alibi_missing"
    ),
    pytest.param(
        {},
        {"sinks": SLOPES},
        "sinks were given but spec.use_sinks is False",
        id="sinks_given_without_use_sinks",
    ),
    pytest.param(
        {"use_sinks": True}, {}, "spec.use_sinks is True but no sinks", id="sinks_missing"
    ),
    pytest.param(
        {"use_alibi": True}, {"alibi_slopes": torch.ones(4)}, "[4]", id="alibi_wrong_length"
    ),
    pytest.param(
        {"use_sinks": True},
        {"sinks": torch.ones(H, dtype=torch.int64)},
        "torch.int64",
        id="sinks_not_float",
    ),
]


@pytest.mark.parametrize(("spec_changes", "weights", "named"), IMPL_CASES)
def test_bad_per_layer_weights_raise_invalid_input(
    spec_changes: dict, weights: dict, named: str
) -> None:
    backend = TorchBackend(replace(SPEC, **spec_changes), "cpu")
    with pytest.raises(InvalidInputError) as info:
        backend.impl(**weights)
    assert named in str(info.value)


def test_backend_refuses_a_spec_it_does_not_support() -> None:
    with pytest.raises(UnsupportedConfigurationError, match="'int8'"):
        TorchBackend(replace(SPEC, kv_cache_dtype="int8"), "cpu")


def test_graph_capture_build_is_refused_by_a_backend_that_never_captures(ctx: Ctx) -> None:
    class NeverCaptures(TorchBackend):
        capabilities = replace(TorchBackend.capabilities, graph_capture=GraphSupport.NEVER)

    builder = NeverCaptures(SPEC, "cpu").metadata_builder()
    with pytest.raises(UnsupportedConfigurationError, match="graph capture"):
        builder.build_for_graph_capture(ctx.batch)


def test_graph_capture_build_refuses_a_batch_beyond_the_declared_level(ctx: Ctx) -> None:
    assert TorchBackend.capabilities.graph_capture == GraphSupport.UNIFORM_BATCH
    assert len(set(ctx.batch.query_lens_cpu.tolist())) > 1  # a mixed batch
    with pytest.raises(UnsupportedConfigurationError, match="uniform_batch batches only"):
        ctx.builder.build_for_graph_capture(ctx.batch)


def test_write_kv_needs_slot_mapping_or_meta(ctx: Ctx) -> None:
    _check(
        ctx,
        lambda c: c.write_kv(slot_mapping=None),
        "needs slot_mapping or meta=",
        InvalidInputError,
    )


def test_write_kv_with_meta_refuses_a_slot_mapping_that_is_not_the_steps(ctx: Ctx) -> None:
    meta = ctx.meta
    _check(
        ctx,
        lambda c: c.impl.write_kv(c.k, c.v, c.cache, c.batch.slot_mapping[:5], meta=meta),
        "is not meta.batch.slot_mapping",
        InvalidInputError,
    )


def test_write_kv_with_meta_checks_the_step_against_a_cache_of_another_size(ctx: Ctx) -> None:
    meta = ctx.meta
    impl = ctx.impl
    impl.write_kv(ctx.k, ctx.v, ctx.cache, meta=meta)  # fine for the cache it was built for
    _check(
        ctx,
        lambda c: impl.write_kv(c.k, c.v, c.bad_caches["small"], meta=meta),
        "outside the cache (2 blocks",
        InvalidInputError,
    )


def test_step_values_are_read_by_build_once_never_by_layers(
    ctx: Ctx, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's slots and block table are checked once, by build, on host data; write_kv(meta=)
    and forward compare the step's extents with the cache (O(1)): on an accelerator a value read
    per layer would be a device-to-host sync."""
    from attnhub import validation

    calls: list[str] = []
    for name in ("checked_step", "check_step", "check_batch_for_spec", "check_slot_values"):
        original = getattr(validation, name)
        monkeypatch.setattr(
            validation,
            name,
            lambda *a, _o=original, _n=name, **k: (calls.append(_n), _o(*a, **k))[1],
        )
    meta = ctx.builder.build(ctx.batch)  # (a new builder: it takes the patched checked_step)
    assert calls == ["checked_step"]
    layers = [ctx.impl for _ in range(3)]
    for impl in layers:
        impl.write_kv(ctx.k, ctx.v, ctx.cache, meta=meta)
        impl.forward(ctx.q, None, None, ctx.cache, meta)
    assert calls == ["checked_step"]


def test_metadata_is_frozen_after_build(ctx: Ctx) -> None:
    """Per-layer code only reads a step's plan (FlashInfer's plan/run split)."""
    import dataclasses

    meta = ctx.builder.build(ctx.batch)
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.common_prefix_len = 3  # type: ignore[misc]
    assert meta.gather_buffers is not None  # allocated by build, not by the first layer


def test_metadata_of_another_kind_is_refused_by_forward_and_write_kv(ctx: Ctx) -> None:
    """A bare AttentionMetadata (e.g. another backend's) never reaches the torch kernels."""
    from attnhub.backend import AttentionMetadata

    alien = AttentionMetadata(batch=ctx.batch)
    for call in (
        lambda c: c.impl.forward(c.q, c.k, c.v, c.cache, alien),
        lambda c: c.impl.write_kv(c.k, c.v, c.cache, meta=alien),
    ):
        _check(ctx, call, "meta must come from the torch backend", InvalidInputError)


def test_a_step_that_writes_one_slot_twice_is_refused_naming_both_positions() -> None:
    """Two requests whose blocks overlap: an engine bug named once per step, on host copies."""
    backend = TorchBackend(SPEC, "cpu")
    cache = backend.allocate_kv_cache(8)
    # request 1's new token lands in slot 3 of block 2, which request 0 writes too
    batch = BatchMetadata.from_lengths([4, 1], [4, 4], [[2], [2]], SPEC.block_size)
    before = cache.clone()
    with pytest.raises(InvalidInputError, match=r"slot_mapping\[3\] and slot_mapping\[4\]"):
        meta = backend.metadata_builder().build(batch)
        backend.impl().forward(
            torch.randn(5, SPEC.num_heads, SPEC.head_size, dtype=SPEC.dtype),
            torch.randn(5, SPEC.num_kv_heads, SPEC.head_size, dtype=SPEC.dtype),
            torch.randn(5, SPEC.num_kv_heads, SPEC.head_size, dtype=SPEC.dtype),
            cache,
            meta,
        )
    assert cache.equal(before)


def test_write_kv_alone_refuses_a_repeated_slot() -> None:
    backend = TorchBackend(SPEC, "cpu")
    cache = backend.allocate_kv_cache(8)
    kv = torch.randn(3, SPEC.num_kv_heads, SPEC.head_size, dtype=SPEC.dtype)
    with pytest.raises(InvalidInputError, match=r"slot_mapping\[0\] and slot_mapping\[2\]"):
        backend.impl().write_kv(kv, kv, cache, torch.tensor([7, -1, 7]))
