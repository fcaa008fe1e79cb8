"""A KV cache whose written planes require grad is refused before any write.

Regression: KV writes are in place, which torch refuses under grad mode for a tensor that
requires grad; ascend's write failed on its value plane after the key plane was written, and
iluvatar's on its per-slot key scale after the planes: a half-written cache and an untyped
RuntimeError. The planes' check now refuses them, with the cache untouched."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attnhub_ascend import AscendBackend
from attnhub_iluvatar import IluvatarBackend

from attnhub import AttentionSpec, MLASpec, testing
from attnhub.errors import InvalidInputError
from attnhub.mla import LatentKVCache
from attnhub.torch_backend import TorchBackend

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float16, block_size=64)


@pytest.mark.parametrize(
    ("make", "kv_cache_dtype", "block_size", "plane"),
    [
        (TorchBackend, "auto", 64, "key"),
        (AscendBackend, "auto", 128, "value"),
        (IluvatarBackend, "int8", 64, "key_scale"),  # per-slot key scale, written with each key
    ],
    ids=["torch-key", "ascend-value", "iluvatar-int8-key-scale"],
)
def test_a_written_plane_that_requires_grad_is_refused_before_any_write(
    make: type, kv_cache_dtype: str, block_size: int, plane: str
) -> None:
    spec = dataclasses.replace(SPEC, kv_cache_dtype=kv_cache_dtype, block_size=block_size)
    kw = {} if make is TorchBackend else {"emulate": True}
    backend = make(spec, "cpu", **kw)
    batch, num_blocks = testing.make_batch([1, 3], [9, 12], spec.block_size, seed=0)
    cache = backend.allocate_kv_cache(num_blocks)
    getattr(cache, plane).requires_grad_(True)
    before = [t.detach().clone() for t in (cache.key, cache.value)]
    q, k, v = testing.random_qkv(spec, batch.num_tokens, testing.generator(1))
    impl, meta = backend.impl(), backend.metadata_builder().build(batch)
    with pytest.raises(InvalidInputError, match=rf"cache\.{plane} requires grad"):
        impl.forward(q, k, v, cache, meta)
    with pytest.raises(InvalidInputError, match=rf"cache\.{plane} requires grad"):
        impl.write_kv(k, v, cache, meta=meta)
    for was, now in zip(before, (cache.key, cache.value), strict=True):
        assert torch.equal(was, now.detach())


def test_a_latent_cache_whose_planes_require_grad_is_refused() -> None:
    spec = MLASpec(num_heads=4, dtype=torch.bfloat16, block_size=16, kv_lora_rank=64,
                   qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)  # fmt: skip
    cache = TorchBackend(spec).allocate_kv_cache(4)
    assert isinstance(cache, LatentKVCache)
    with pytest.raises(InvalidInputError, match=r"cache\.kv_c requires grad"):
        LatentKVCache(
            cache.kv_c.detach().clone().requires_grad_(True),
            cache.k_pe,
            block_size=cache.block_size,
        )
