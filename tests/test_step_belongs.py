"""A step's metadata belongs to the layer that runs it, and what reaches a kernel is dense.

The checks of ``build`` and of every layer call (``forward``, ``write_kv(meta=)``), written
once in the core for every backend: metadata built for another spec (block size, head size),
by another kind of backend or for another device is refused before any write; an integer
tensor of the batch that is a strided view is made dense once per step (or refused where a
captured graph must read the batch's own tensors); ``common_prefix_len`` must name blocks
every request shares. Over the torch backend; the conformance catalogue holds every backend
to the same (``meta_other_block_size``, ``common_prefix_not_shared``, ...).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from attnhub import AttentionSpec, BatchMetadata
from attnhub.backend import AttentionMetadataBuilder
from attnhub.errors import InvalidInputError
from attnhub.testing import fill_cache_random, generator, make_batch, random_qkv
from attnhub.torch_backend import TorchBackend
from attnhub.validation import dense_batch

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float32, block_size=8)


def _step(spec: AttentionSpec = SPEC, seed: int = 0) -> tuple[BatchMetadata, int]:
    return make_batch([1, 3, 1], [9, 12, 17], spec.block_size, seed=generator(seed))


def _layer(spec: AttentionSpec = SPEC, num_blocks: int = 12):  # type: ignore[no-untyped-def]
    backend = TorchBackend(spec)
    cache = backend.allocate_kv_cache(num_blocks)
    fill_cache_random(cache, generator(1))
    return backend, backend.impl(), cache


# --- metadata of another spec -----------------------------------------------------------------


@pytest.mark.parametrize("call", ["forward", "write_kv"])
def test_metadata_built_for_another_block_size_is_refused_before_any_write(call: str) -> None:
    _, impl, cache = _layer()
    batch, _ = _step()
    larger = TorchBackend(dataclasses.replace(SPEC, block_size=16))
    meta = larger.metadata_builder().build(dataclasses.replace(batch, block_size=16))
    q, k, v = random_qkv(SPEC, batch.num_tokens, generator(2))
    before = cache.clone()
    with pytest.raises(InvalidInputError, match=r"block_size 16 \(this layer: 8\)"):
        if call == "forward":
            impl.forward(q, k, v, cache, meta)
        else:
            impl.write_kv(k, v, cache, meta=meta)
    assert cache.equal(before)


def test_metadata_built_for_another_head_size_is_refused_without_a_resize_warning() -> None:
    _, impl, cache = _layer()
    batch, _ = _step()
    wide = TorchBackend(dataclasses.replace(SPEC, head_size=64, head_size_v=None))
    meta = wide.metadata_builder().build(batch)
    q, k, v = random_qkv(SPEC, batch.num_tokens, generator(2))
    before = cache.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "output ... resized" would be one
        with pytest.raises(InvalidInputError, match=r"head_size 64 \(this layer: 32\)"):
            impl.forward(q, k, v, cache, meta)
    assert cache.equal(before)


def test_metadata_of_an_equal_spec_from_another_instance_is_accepted_and_the_same() -> None:
    backend, impl, cache = _layer()
    batch, _ = _step()
    q, k, v = random_qkv(SPEC, batch.num_tokens, generator(2))
    twin = TorchBackend(dataclasses.replace(SPEC))  # equal, not the same object
    other_cache = cache.clone()
    expected = impl.forward(q, k, v, other_cache, backend.metadata_builder().build(batch))
    twin_meta = twin.metadata_builder().build(batch)
    for _ in range(2):  # the second call takes the one-pass path (the twin remembered)
        got = impl.forward(q, k, v, cache, twin_meta)
        assert torch.equal(got, expected)
    assert impl._usual_step(cache, twin_meta)
    assert cache.equal(other_cache)
    own_meta = backend.metadata_builder().build(batch)
    impl.forward(q, k, v, cache, own_meta)  # its own backend's steps again: one pass again
    assert impl._usual_step(cache, own_meta)


def test_metadata_of_another_backend_kind_with_the_same_spec_is_refused() -> None:
    _, impl, cache = _layer()
    batch, _ = _step()
    kin = type("Kin", (TorchBackend,), {"name": "kin"})(SPEC)
    meta = kin.metadata_builder().build(batch)
    q, k, v = random_qkv(SPEC, batch.num_tokens, generator(2))
    with pytest.raises(InvalidInputError, match="built by the 'kin' backend"):
        impl.forward(q, k, v, cache, meta)


# --- dense integer tensors ----------------------------------------------------------------------


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t`` as every other entry of a buffer twice as long (the others: other slots)."""
    buf = torch.full((2 * t.shape[0],), 5, dtype=t.dtype)
    buf[0::2] = t
    return buf[0::2]


def test_a_dense_batch_is_built_as_it_is() -> None:
    batch, _ = _step()
    assert dense_batch(batch) is batch
    meta = TorchBackend(SPEC).metadata_builder().build(batch)
    assert meta.batch is batch


def test_a_strided_slot_mapping_is_made_dense_once_per_step_and_writes_the_same() -> None:
    backend, impl, cache = _layer()
    batch, _ = _step()
    strided = dataclasses.replace(batch, slot_mapping=_strided(batch.slot_mapping))
    assert not strided.slot_mapping.is_contiguous()
    q, k, v = random_qkv(SPEC, batch.num_tokens, generator(2))
    dense_cache = cache.clone()
    expected = impl.forward(q, k, v, dense_cache, backend.metadata_builder().build(batch))
    meta = backend.metadata_builder().build(strided)
    assert meta.batch.slot_mapping.is_contiguous()
    assert torch.equal(meta.batch.slot_mapping, batch.slot_mapping)
    assert torch.equal(impl.forward(q, k, v, cache, meta), expected)
    assert cache.equal(dense_cache)


def test_write_kv_takes_the_engines_strided_slot_mapping_with_or_without_the_step() -> None:
    backend, impl, cache = _layer()
    batch, _ = _step()
    slots = _strided(batch.slot_mapping)
    strided = dataclasses.replace(batch, slot_mapping=slots)
    _, k, v = random_qkv(SPEC, batch.num_tokens, generator(2))
    expected = cache.clone()
    impl.write_kv(k, v, expected, batch.slot_mapping)
    for meta in (None, backend.metadata_builder().build(strided)):
        written = cache.clone()
        impl.write_kv(k, v, written, slots, meta=meta)
        assert written.equal(expected)


def test_a_graph_capture_of_a_strided_batch_is_refused_with_the_tensor_named() -> None:
    batch, _ = make_batch([1, 1], [9, 12], SPEC.block_size, seed=generator(0))
    strided = dataclasses.replace(batch, slot_mapping=_strided(batch.slot_mapping))
    builder = TorchBackend(SPEC).metadata_builder()
    with pytest.raises(InvalidInputError, match=r"batch.slot_mapping is a strided view"):
        builder.build_for_graph_capture(strided)
    # the base class's capture (build on the runner's buffers) refuses it too: a dense copy
    # made by build would be what the graph reads on every replay
    with pytest.raises(InvalidInputError, match=r"batch.slot_mapping is a strided view"):
        AttentionMetadataBuilder.build_for_graph_capture(builder, strided)


# --- common_prefix_len ----------------------------------------------------------------------------

CASCADE = type(
    "Cascade",
    (TorchBackend,),
    {
        "name": "cascade",
        "capabilities": dataclasses.replace(TorchBackend.capabilities, cascade=True),
    },
)


def test_a_common_prefix_the_requests_do_not_share_is_refused_at_build() -> None:
    bs = SPEC.block_size
    batch = BatchMetadata.from_lengths([1, 1], [bs + 1, bs + 1], [[3, 1], [5, 2]], bs)
    with pytest.raises(InvalidInputError, match=r"block_table\[1, :1\] = \[5\] differs"):
        CASCADE(SPEC).metadata_builder().build(batch, common_prefix_len=bs)


def test_a_common_prefix_the_requests_share_is_accepted() -> None:
    bs = SPEC.block_size
    batch = BatchMetadata.from_lengths([1, 1], [2 * bs + 1, bs + 1], [[3, 1, 4], [3, 2]], bs)
    meta = CASCADE(SPEC).metadata_builder().build(batch, common_prefix_len=bs)
    assert meta.common_prefix_len == bs


def test_a_partial_block_of_common_prefix_is_not_compared() -> None:
    """Backends share whole blocks only (the partial one is read per request)."""
    bs = SPEC.block_size
    batch = BatchMetadata.from_lengths([1, 1], [bs + 2, bs + 2], [[3, 1], [5, 2]], bs)
    CASCADE(SPEC).metadata_builder().build(batch, common_prefix_len=bs - 1)


@pytest.mark.parametrize("value", [8.0, "8", True], ids=repr)
def test_a_common_prefix_len_that_is_not_an_int_is_refused(value: object) -> None:
    batch, _ = _step()
    with pytest.raises(InvalidInputError, match="must be an int"):
        CASCADE(SPEC).metadata_builder().build(batch, common_prefix_len=value)  # type: ignore[arg-type]
