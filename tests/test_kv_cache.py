"""PagedKVCache: allocation per layout and format, block copy / swap, byte-level comparison."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from attnhub import PagedKVCache
from attnhub.errors import InvalidInputError
from attnhub.kv_cache import BlockPacking
from attnhub.spec import AttentionSpec
from attnhub.testing import cache_after_write, cache_differences, fill_cache_random, generator
from attnhub.validation import check_cache

NB, BS, HKV, D = 6, 4, 2, 8


def alloc(kv: str = "auto", layout: str = "NHD", nb: int = NB, **kw: object) -> PagedKVCache:
    return PagedKVCache.allocate(
        nb,
        BS,
        HKV,
        D,
        torch.bfloat16,
        layout=layout,
        kv_cache_dtype=kv,
        **kw,  # type: ignore[arg-type]
    )


def filled(kv: str = "auto", layout: str = "NHD", nb: int = NB, seed: int = 0) -> PagedKVCache:
    cache = alloc(kv, layout, nb)
    fill_cache_random(cache, generator(seed))
    return cache


# --- allocation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "shape"),
    [("NHD", (NB, BS, HKV, D)), ("HND", (NB, HKV, BS, D))],
)
def test_allocate_uses_the_layout_shape(layout: str, shape: tuple[int, ...]) -> None:
    c = alloc(layout=layout)
    assert c.key.shape == shape and c.value.shape == shape
    assert (c.num_blocks, c.block_size, c.num_kv_heads, c.head_size) == (NB, BS, HKV, D)
    assert c.num_slots == NB * BS
    assert c.key_nhd().shape == (NB, BS, HKV, D)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_allocate_zero_fills(layout: str) -> None:
    c = alloc(layout=layout)
    assert not c.key.any() and not c.value.any()


# kv_cache_dtype -> (key dtype, value dtype, key scale shape, value scale shape); "slot" scale
# planes have the layout's [blocks, slots, heads] order, filled with zeros (nothing written yet);
# static scales are ones.
SLOT_NHD, SLOT_HND = (NB, BS, HKV), (NB, HKV, BS)
FORMATS = {
    "auto": (torch.bfloat16, torch.bfloat16, None, None),
    "fp8_e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn, (), ()),
    "fp8_e5m2": (torch.float8_e5m2, torch.float8_e5m2, (), ()),
    "int8": (torch.int8, torch.int8, "slot", (HKV, D)),
    "int8_k": (torch.int8, torch.bfloat16, "slot", None),
}


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv", list(FORMATS))
def test_allocate_makes_the_planes_of_each_kv_cache_dtype(kv: str, layout: str) -> None:
    kdt, vdt, kscale, vscale = FORMATS[kv]
    c = alloc(kv, layout)
    assert (c.key.dtype, c.value.dtype) == (kdt, vdt)
    for plane, want in ((c.key_scale, kscale), (c.value_scale, vscale)):
        if want is None:
            assert plane is None
            continue
        assert plane is not None and plane.dtype == torch.float32
        if want == "slot":
            assert plane.shape == (SLOT_NHD if layout == "NHD" else SLOT_HND)
            assert not plane.any()
        else:
            assert plane.shape == want
            assert (plane == 1).all()


@pytest.mark.parametrize("num_blocks", [0, -1, 2.0, True], ids=repr)
def test_allocate_rejects_bad_num_blocks(num_blocks: object) -> None:
    with pytest.raises(InvalidInputError, match=f"num_blocks = {num_blocks!r}"):
        alloc(nb=num_blocks)  # type: ignore[arg-type]


def test_allocate_rejects_unknown_layout() -> None:
    with pytest.raises(InvalidInputError, match="'HDN'"):
        alloc(layout="HDN")


def test_constructor_rejects_key_value_shape_mismatch() -> None:
    with pytest.raises(InvalidInputError, match=r"\(2, 4, 1, 8\) and \(2, 4, 2, 8\)"):
        PagedKVCache(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 2, 8), block_size=4)


def test_constructor_takes_a_value_plane_of_another_head_size() -> None:
    cache = PagedKVCache(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 4), block_size=4)
    assert (cache.head_size, cache.head_size_v) == (8, 4)


def test_constructor_rejects_block_size_not_in_the_layout_dim() -> None:
    with pytest.raises(InvalidInputError, match="block_size = 4"):
        PagedKVCache(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8), 4, layout="HND")


# --- clone / equal ------------------------------------------------------------------------


def test_clone_is_equal_and_independent() -> None:
    c = filled("fp8_e4m3")
    d = c.clone()
    assert d.equal(c)
    d.key.view(torch.uint8)[0, 0, 0, 0] ^= 1
    assert not d.equal(c)


def test_equal_detects_a_change_in_a_scale_plane() -> None:
    c = filled("int8")
    d = c.clone()
    d.key_scale[1, 2, 0] += 1
    assert not d.equal(c)


def test_equal_treats_identical_nan_bytes_as_equal() -> None:
    c = alloc()
    c.key.fill_(float("nan"))
    assert c.clone().equal(c)


# --- copy_blocks ----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "int8", "int8_k"])
def test_copy_blocks_copies_every_per_block_plane(kv: str, layout: str) -> None:
    c = filled(kv, layout)
    before = c.clone()
    c.copy_blocks([[1, 4], [3, 5]])
    for name, plane in c.planes().items():
        old = before.planes()[name]
        assert torch.equal(plane[4].view(torch.uint8), old[1].view(torch.uint8)), name
        assert torch.equal(plane[5].view(torch.uint8), old[3].view(torch.uint8)), name
        untouched = [0, 1, 2, 3]
        assert torch.equal(plane[untouched].view(torch.uint8), old[untouched].view(torch.uint8))
    # static scales are per cache, not per block: never copied
    for which in ("key_scale", "value_scale"):
        a, b = getattr(c, which), getattr(before, which)
        if a is not None and which not in c.planes():
            assert torch.equal(a, b)


def test_copy_blocks_reads_every_source_before_writing() -> None:
    # a chain 1 -> 2 -> 3: block 3 gets the *old* block 2, not the new one
    c = filled()
    before = c.clone()
    c.copy_blocks(torch.tensor([[1, 2], [2, 3]]))
    assert torch.equal(c.key[2], before.key[1])
    assert torch.equal(c.key[3], before.key[2])
    assert torch.equal(c.value[3], before.value[2])


def test_copy_blocks_swap_pair_exchanges_blocks() -> None:
    c = filled()
    before = c.clone()
    c.copy_blocks([[1, 2], [2, 1]])
    assert torch.equal(c.key[1], before.key[2]) and torch.equal(c.key[2], before.key[1])


def test_copy_blocks_with_empty_mapping_changes_nothing() -> None:
    c = filled()
    before = c.clone()
    c.copy_blocks([])
    c.copy_blocks(torch.zeros(0, 2, dtype=torch.int64))
    assert c.equal(before)


BAD_MAPPINGS = [
    pytest.param([[1, NB]], f"dst block {NB}", id="dst_past_end"),
    pytest.param([[NB + 3, 1]], f"src block {NB + 3}", id="src_past_end"),
    pytest.param([[1, 2], [-1, 3]], "block_mapping[1] src block -1", id="src_negative"),
    pytest.param([[1, -2]], "dst block -2", id="dst_negative"),
    pytest.param([[1, 2, 3]], "(1, 3)", id="triples"),
    pytest.param([1, 2], "(2,)", id="flat"),
    pytest.param([[1.5, 2.0]], "torch.float32", id="float_ids"),
    pytest.param(torch.tensor([[True, False]]), "torch.bool", id="bool_ids"),
    pytest.param(None, "got NoneType None", id="none"),
    pytest.param("01", "got str '01'", id="a_string"),
    pytest.param({0: 1}, "got dict {0: 1}", id="a_dict"),
    pytest.param([[0, 1], [2]], "[[0, 1], [2]] is not [n, 2]", id="ragged_rows"),
    pytest.param([[0, "a"]], "[[0, 'a']] is not [n, 2]", id="a_string_id"),
    pytest.param({(0, 1)}, "is not [n, 2]", id="a_set"),
    pytest.param(torch.zeros(1, 2, dtype=torch.int64, device="meta"), "meta tensor", id="meta"),
    pytest.param(
        [[0, 3], [1, 2], [4, 3]],
        "[0] and block_mapping[2] both copy to dst block 3",
        id="dst_twice",
    ),
]


@pytest.mark.parametrize(("mapping", "named"), BAD_MAPPINGS)
def test_copy_blocks_bad_mapping_raises_and_leaves_cache_unchanged(
    mapping: object, named: str
) -> None:
    c = filled("int8")
    before = c.clone()
    with pytest.raises(InvalidInputError) as info:
        c.copy_blocks(mapping)  # type: ignore[arg-type]
    assert named in str(info.value)
    assert c.equal(before)


# --- swap_blocks ----------------------------------------------------------------------------


@pytest.mark.parametrize("kv", ["auto", "fp8_e5m2", "int8"])
def test_swap_blocks_moves_blocks_to_another_cache(kv: str) -> None:
    device_cache = filled(kv, seed=1)
    host = filled(kv, nb=3, seed=2)
    for name in ("key_scale", "value_scale"):  # a swap space shares the static scales
        scale = getattr(device_cache, name)
        if name not in host.planes() and scale is not None:
            getattr(host, name).copy_(scale)
    host_before, device_before = host.clone(), device_cache.clone()
    device_cache.swap_blocks(host, [[4, 0], [1, 2]])
    assert device_cache.equal(device_before)  # the source is only read
    for name, plane in host.planes().items():
        src = device_before.planes()[name]
        assert torch.equal(plane[0].view(torch.uint8), src[4].view(torch.uint8)), name
        assert torch.equal(plane[2].view(torch.uint8), src[1].view(torch.uint8)), name
        assert torch.equal(
            plane[1].view(torch.uint8), host_before.planes()[name][1].view(torch.uint8)
        )


def test_swap_blocks_back_restores_the_blocks() -> None:
    a, b = filled(seed=3), alloc(nb=2)
    a.swap_blocks(b, [[2, 0], [5, 1]])
    restored = a.clone()
    restored.key.zero_()
    restored.value.zero_()
    b.swap_blocks(restored, [[0, 2], [1, 5]])
    assert torch.equal(restored.key[[2, 5]], a.key[[2, 5]])
    assert torch.equal(restored.value[[2, 5]], a.value[[2, 5]])


@pytest.mark.parametrize(
    ("mapping", "named"),
    [
        pytest.param([[0, 3]], "dst block 3", id="dst_outside_destination"),
        pytest.param([[NB, 0]], f"src block {NB}", id="src_outside_source"),
        pytest.param([[0, -1]], "dst block -1", id="dst_negative"),
    ],
)
def test_swap_blocks_bad_mapping_raises_and_leaves_both_caches_unchanged(
    mapping: object, named: str
) -> None:
    src, dst = filled(seed=4), filled(nb=3, seed=5)
    src_before, dst_before = src.clone(), dst.clone()
    with pytest.raises(InvalidInputError) as info:
        src.swap_blocks(dst, mapping)  # type: ignore[arg-type]
    assert named in str(info.value)
    assert src.equal(src_before) and dst.equal(dst_before)


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda: alloc(layout="HND"), id="layout"),
        pytest.param(lambda: alloc("fp8_e4m3"), id="kv_cache_dtype"),
        pytest.param(
            lambda: PagedKVCache.allocate(NB, BS, HKV, D, torch.float16), id="model_dtype"
        ),
        pytest.param(
            lambda: PagedKVCache.allocate(NB, BS, HKV + 1, D, torch.bfloat16), id="kv_heads"
        ),
        pytest.param(
            lambda: PagedKVCache.allocate(NB, BS * 2, HKV, D, torch.bfloat16), id="block_size"
        ),
    ],
)
def test_swap_blocks_between_different_formats_raises_and_changes_nothing(other: object) -> None:
    src = filled(seed=6)
    dst = other()  # type: ignore[operator]
    src_before, dst_before = src.clone(), dst.clone()
    with pytest.raises(InvalidInputError, match="swap_blocks needs caches"):
        src.swap_blocks(dst, [[1, 1]])
    assert src.equal(src_before) and dst.equal(dst_before)


@pytest.mark.parametrize(
    ("dst", "named"),
    [
        pytest.param(lambda c: None, "got NoneType None", id="none"),
        pytest.param(lambda c: (c.key, c.value), "got tuple (tensor(", id="planes_as_a_tuple"),
        pytest.param(lambda c: c.key, "got Tensor", id="a_tensor"),
    ],
)
def test_swap_blocks_to_what_is_not_a_cache_raises_and_changes_nothing(
    dst: object, named: str
) -> None:
    src = filled(seed=7)
    before = src.clone()
    with pytest.raises(InvalidInputError, match="swap_blocks' dst must be a PagedKVCache") as info:
        src.swap_blocks(dst(src), [[0, 0]])  # type: ignore[operator]
    assert named in str(info.value) and "\n" not in str(info.value)
    assert src.equal(before)


def test_swap_blocks_to_a_cache_without_a_scale_plane_raises_and_changes_nothing() -> None:
    src, dst = filled("int8", seed=8), filled("int8", nb=3, seed=9)
    dst.key_scale = None  # e.g. a host copy made without its per-slot key scales
    src_before, dst_before = src.clone(), dst.clone()
    with pytest.raises(InvalidInputError, match=r"dst\.key_scale per block is none"):
        src.swap_blocks(dst, [[1, 1]])
    assert src.equal(src_before) and dst.equal(dst_before)


@pytest.mark.parametrize(("mapping", "named"), BAD_MAPPINGS)
def test_swap_blocks_bad_mapping_of_any_kind_raises_and_changes_nothing(
    mapping: object, named: str
) -> None:
    src, dst = filled(seed=10), filled(nb=NB, seed=11)
    src_before, dst_before = src.clone(), dst.clone()
    with pytest.raises(InvalidInputError) as info:
        src.swap_blocks(dst, mapping)  # type: ignore[arg-type]
    assert named in str(info.value)
    assert src.equal(src_before) and dst.equal(dst_before)


# --- empty_like -----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "int8", "int8_k"])
def test_empty_like_is_a_zeroed_cache_of_the_same_format(kv: str, layout: str) -> None:
    c = filled(kv, layout)
    e = c.empty_like(num_blocks=3)
    assert (e.layout, e.kv_cache_dtype, e.block_size) == (c.layout, c.kv_cache_dtype, c.block_size)
    assert e.num_blocks == 3
    assert e.key.shape[1:] == c.key.shape[1:]
    for name, plane in e.planes().items():
        assert plane.dtype == c.planes()[name].dtype
        assert not plane.view(torch.uint8).any(), name


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_empty_like_copies_static_scales(kv: str) -> None:
    c = filled(kv)
    e = c.empty_like()
    assert e.num_blocks == c.num_blocks
    if kv == "fp8_e4m3":  # per-tensor scales
        assert torch.equal(e.key_scale, c.key_scale)
        assert torch.equal(e.value_scale, c.value_scale)
        assert e.key_scale.data_ptr() != c.key_scale.data_ptr()
    else:  # static per-channel value scale, per-slot key scale starts at zero
        assert torch.equal(e.value_scale, c.value_scale)
        assert not e.key_scale.any()


def test_empty_like_does_not_alias_the_original() -> None:
    c = filled()
    e = c.empty_like()
    e.key.fill_(1)
    assert not c.equal(e)
    assert not (c.key == 1).all()


# --- packed blocks ------------------------------------------------------------------------


@dataclass(frozen=True)
class Reversed(BlockPacking):
    """A toy packing: each (block, kv head) stores its elements in reverse order (keys) or
    channel-major (values): no strided view shows the first as tokens x channels."""

    name: str = "reversed"

    def unpack(self, storage: torch.Tensor, which: str) -> torch.Tensor:
        b, h, n, d = storage.shape
        if which == "key":
            return storage.reshape(b, h, n * d).flip(-1).reshape(b, h, n, d)
        return storage.reshape(b, h, d, n).transpose(2, 3).contiguous()

    def pack(self, logical: torch.Tensor, which: str, out: torch.Tensor) -> None:
        b, h, n, d = out.shape
        if which == "key":
            out.copy_(logical.reshape(b, h, n * d).flip(-1).reshape(b, h, n, d))
        else:
            out.view(b, h, d, n).copy_(logical.transpose(2, 3))


def packed(seed: int = 0) -> tuple[PagedKVCache, PagedKVCache]:
    """A packed cache and the plain HND cache of its logical contents."""
    plain = filled(layout="HND", seed=seed)
    key, value = torch.empty_like(plain.key), torch.empty_like(plain.value)
    Reversed().pack(plain.key, "key", key)
    Reversed().pack(plain.value, "value", value)
    return PagedKVCache(key, value, BS, "HND", packing=Reversed()), plain


def test_a_packed_cache_reads_its_logical_planes_through_unpacked() -> None:
    cache, plain = packed()
    logical = cache.unpacked()
    assert logical.packing is None and plain.unpacked() is plain
    assert torch.equal(logical.key, plain.key) and torch.equal(logical.value, plain.value)
    assert not torch.equal(cache.key, plain.key)  # the storage is not the logical plane


def test_a_packed_cache_refuses_views_that_would_misread_it() -> None:
    cache, _ = packed()
    for view in (cache.key_nhd, cache.value_nhd):
        with pytest.raises(InvalidInputError, match=r"packed \(reversed\)"):
            view()
    with pytest.raises(InvalidInputError, match="HND"):
        PagedKVCache(cache.key, cache.value, BS, "NHD", packing=Reversed())


def test_edit_writes_logical_changes_into_the_packed_storage() -> None:
    cache, plain = packed()
    with cache.edit() as logical:
        logical.key[2, 1, 3] = 5.0
    plain.key[2, 1, 3] = 5.0
    assert torch.equal(cache.unpacked().key, plain.key)
    assert torch.equal(cache.unpacked().value, plain.value)


def test_the_test_helpers_and_the_reference_read_and_write_packed_caches_logically() -> None:
    cache, plain = packed()
    g = generator(4)
    k, v = torch.randn(3, HKV, D, generator=g), torch.randn(3, HKV, D, generator=g)
    slots = torch.tensor([5, -1, 17])
    want, got = cache_after_write(plain, k, v, slots), cache_after_write(cache, k, v, slots)
    assert got.packing == Reversed()
    assert torch.equal(got.unpacked().key, want.key)
    assert cache_differences(got, want.unpacked(), slots) == []
    changed = cache_differences(got, cache, slots)  # against the cache before: written slots
    assert changed and not any("must not write" in c for c in changed)
    with cache.edit() as logical:
        logical.value[0, 0, 0, 0] += 1  # slot 0: not written
    problems = cache_differences(cache, got, slots)
    assert "value changed in slots this call must not write: 0 (block 0" in " ".join(problems)


def test_block_copies_and_swaps_move_packed_blocks_whole() -> None:
    cache, plain = packed()
    cache.copy_blocks([[1, 4]])
    plain.copy_blocks([[1, 4]])
    assert torch.equal(cache.unpacked().key, plain.key)
    host = cache.empty_like(num_blocks=2)
    assert host.packing == Reversed()
    cache.swap_blocks(host, [[3, 0]])
    assert torch.equal(host.unpacked().value[0], plain.value[3])
    with pytest.raises(InvalidInputError, match="packed alike: packed reversed vs not packed"):
        cache.swap_blocks(alloc(layout="HND"), [[0, 0]])
    assert not cache.equal(replace(cache, packing=None))


def test_a_cache_packed_otherwise_than_the_backends_blocks_is_refused() -> None:
    cache, _ = packed()
    spec = AttentionSpec(
        num_heads=HKV, num_kv_heads=HKV, head_size=D, dtype=torch.bfloat16, block_size=BS
    )
    device = torch.device("cpu")
    with pytest.raises(InvalidInputError, match="packed reversed, this backend's kernels' blocks"):
        check_cache(spec, "HND", cache, device)
    check_cache(spec, "HND", cache, device, packing=Reversed())
    check_cache(spec, "HND", cache.unpacked(), device, packing=Reversed())  # plain: the backend's


def test_swap_blocks_to_a_cache_of_another_static_scale_raises_and_changes_nothing() -> None:
    """Static (per-tensor) scales are not moved with the blocks: swapping fp8 bytes stored under
    one scale into a cache read under another would silently change every value."""
    src, dst = filled("fp8_e4m3", seed=10), filled("fp8_e4m3", nb=3, seed=11)
    assert src.key_scale is not None and dst.key_scale is not None
    src.key_scale.fill_(0.5)
    dst.key_scale.fill_(2.0)
    src_before, dst_before = src.clone(), dst.clone()
    with pytest.raises(InvalidInputError, match=r"dst\.key_scale is .*this cache's is"):
        src.swap_blocks(dst, [[1, 1]])
    assert src.equal(src_before) and dst.equal(dst_before)
    dst.key_scale.fill_(0.5)
    dst.value_scale = src.value_scale.clone() if src.value_scale is not None else None
    src.swap_blocks(dst, [[1, 1]])  # equal static scales: the bytes mean the same values
