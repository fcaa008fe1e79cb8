"""Bad input or configuration anywhere in the public API raises an attnhub error (a subclass
of ``attnhub.errors.AttnhubError``) naming the bad value, never a bare builtin exception."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

import attnhub
from attnhub import AttentionSpec, BatchMetadata, PagedKVCache, reference
from attnhub.errors import AttnhubError, UnknownNameError

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float32, block_size=4)


def _backend() -> attnhub.AttentionBackend:
    return attnhub.select_backend(SPEC, "cpu", prefer="torch")


def _batch() -> BatchMetadata:
    return BatchMetadata.from_lengths([1, 3], [5, 3], [[1, 2], [3]], 4)


def _cache() -> PagedKVCache:
    return _backend().allocate_kv_cache(8)


def _forward(**changes: object) -> None:
    backend = _backend()
    batch = _batch()
    args: dict[str, object] = dict(
        query=torch.randn(4, 4, 16),
        key=torch.randn(4, 2, 16),
        value=torch.randn(4, 2, 16),
        cache=backend.allocate_kv_cache(8),
        meta=backend.metadata_builder().build(batch),
    )
    args.update(changes)
    backend.impl().forward(**args)  # type: ignore[arg-type]


#: (what is wrong, the call, a word the message must contain)
BAD_CALLS: list[tuple[str, Callable[[], object], str]] = [
    ("spec: negative heads", lambda: AttentionSpec(-1, 1, 16), "-1"),
    ("spec: heads not a multiple", lambda: AttentionSpec(5, 2, 16), "5"),
    ("spec: float64", lambda: AttentionSpec(4, 2, 16, dtype=torch.float64), "float64"),
    ("spec: unknown kv cache", lambda: AttentionSpec(4, 2, 16, kv_cache_dtype="int4"), "int4"),
    ("spec: unknown attn type", lambda: AttentionSpec(4, 2, 16, attn_type="cross"), "cross"),
    ("spec: scale", lambda: AttentionSpec(4, 2, 16, scale=-1.0), "-1.0"),
    ("spec: window", lambda: AttentionSpec(4, 2, 16, sliding_window=0), "0"),
    ("spec: softcap", lambda: AttentionSpec(4, 2, 16, logits_soft_cap=-2.0), "-2.0"),
    ("select: unknown backend", lambda: attnhub.select_backend(SPEC, prefer="nope"), "nope"),
    ("select: unknown device", lambda: attnhub.select_backend(SPEC, "tpu:0"), "tpu"),
    ("get: unknown backend", lambda: attnhub.get_backend("nope"), "nope"),
    ("register: not a backend", lambda: attnhub.register_backend(int), "int"),  # type: ignore[arg-type]
    ("capabilities: unknown feature", lambda: _backend().capabilities.supports_feature("x"), "x"),
    (
        "capabilities: no tolerance",
        lambda: _backend().capabilities.tolerance(torch.float64),
        "float64",
    ),
    ("batch: lengths", lambda: BatchMetadata.from_lengths([2], [1], [[1]], 4), "seq_lens[0]"),
    ("batch: float lengths", lambda: BatchMetadata.from_lengths([1.5], [2], [[1]], 4), "float"),
    ("batch: block size", lambda: BatchMetadata.from_lengths([1], [2], [[1]], 0), "block_size"),
    ("batch: table width", lambda: BatchMetadata.from_lengths([1], [9], [[1]], 4), "9"),
    ("cache: num_blocks", lambda: _backend().allocate_kv_cache(0), "num_blocks"),
    (
        "cache: unknown format",
        lambda: PagedKVCache.allocate(2, 4, 2, 16, torch.float32, kv_cache_dtype="int4"),
        "int4",
    ),
    ("cache: layout", lambda: PagedKVCache.allocate(2, 4, 2, 16, torch.float32, layout="X"), "X"),
    ("cache: copy mapping", lambda: _cache().copy_blocks([[0, 99]]), "99"),
    ("cache: swap mapping", lambda: _cache().swap_blocks(_cache(), [[99, 0]]), "99"),
    ("build: not a batch", lambda: _backend().metadata_builder().build("batch"), "str"),  # type: ignore[arg-type]
    (
        "build: block size",
        lambda: _backend().metadata_builder().build(BatchMetadata.from_lengths([1], [2], [[1]], 8)),
        "block_size",
    ),
    ("impl: sinks not declared", lambda: _backend().impl(sinks=torch.zeros(4)), "sinks"),
    ("forward: query shape", lambda: _forward(query=torch.randn(4, 3, 16)), "query"),
    ("forward: dtype", lambda: _forward(key=torch.randn(4, 2, 16).half()), "float16"),
    ("forward: not a cache", lambda: _forward(cache="cache"), "str"),
    ("forward: small cache", lambda: _forward(cache=_backend().allocate_kv_cache(2)), "outside"),
    ("forward: not metadata", lambda: _forward(meta=object()), "object"),
    (
        "write_kv: bad slot",
        lambda: (
            _backend()
            .impl()
            .write_kv(torch.randn(1, 2, 16), torch.randn(1, 2, 16), _cache(), torch.tensor([99]))
        ),
        "99",
    ),
    (
        "reference: query shape",
        lambda: reference.paged_attention(torch.randn(4, 3, 16), _cache(), _batch(), SPEC),
        "query",
    ),
]


@pytest.mark.parametrize(
    ("call", "named"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_input_raises_an_attnhub_error_naming_the_value(
    call: Callable[[], object], named: str
) -> None:
    with pytest.raises(Exception) as info:
        call()
    assert isinstance(info.value, AttnhubError), (
        f"{type(info.value).__name__} is not an attnhub error: {info.value}"
    )
    assert named in str(info.value), str(info.value)


def test_kv_cache_dtype_aliases_are_accepted_where_specs_accept_them() -> None:
    cache = PagedKVCache.allocate(2, 4, 2, 16, torch.bfloat16, kv_cache_dtype="fp8")
    assert cache.kv_cache_dtype == "fp8_e4m3"
    assert dataclasses.replace(cache).kv_cache_dtype == "fp8_e4m3"


def test_unknown_names_are_lookup_errors_too() -> None:
    """Callers that catch KeyError for a failed lookup keep working; the message is plain."""
    with pytest.raises(KeyError) as info:
        _backend().capabilities.supports_feature("rope")
    assert isinstance(info.value, UnknownNameError)
    assert str(info.value) == "unknown feature 'rope'; known: sliding_window, softcap, alibi, sinks"
