"""The LSE through the protocol: declared per dtype and cache format (``Capabilities.lse``),
refused where not declared (typed, naming the dtype, before any write), checked (its buffer),
and handed to ``compute`` only where requested."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import pytest
import torch

from attnhub import AttentionSpec, Capabilities, LseSupport, Refusal
from attnhub.capabilities import LSE_NOT_DECLARED
from attnhub.errors import InvalidInputError, UnknownNameError, UnsupportedConfigurationError
from attnhub.testing import fill_cache_random, generator, make_batch, random_qkv
from attnhub.torch_backend import TorchBackend
from attnhub.torch_backend.backend import TorchAttentionImpl

SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


class Float32LseBackend(TorchBackend):
    """The torch backend declaring its LSE for float32 alone."""

    name = "torch-lse-f32"
    capabilities: ClassVar[Capabilities] = dataclasses.replace(
        TorchBackend.capabilities,
        lse=LseSupport(dtypes=frozenset({torch.float32}), reason="the test kernel's"),
    )


def setup(backend_type: type[TorchBackend], spec: AttentionSpec = SPEC) -> tuple[Any, ...]:
    batch, nblk = make_batch((1, 4), (9, 30), spec.block_size, seed=3)
    backend = backend_type(spec)
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(4))
    q, k, v = random_qkv(spec, batch.num_tokens, generator(5))
    return backend, cache, backend.metadata_builder().build(batch), q, k, v


def test_a_dtype_not_declared_is_refused_by_name_before_any_write() -> None:
    backend, cache, meta, q, k, v = setup(Float32LseBackend)
    before = cache.clone()
    with pytest.raises(UnsupportedConfigurationError) as info:
        backend.impl().forward(q, k, v, cache, meta, return_lse=True)
    assert "torch.bfloat16" in str(info.value) and "the test kernel's" in str(info.value)
    assert cache.equal(before), "the refused call wrote to the cache"
    # the same layer still serves calls without the LSE
    backend.impl().forward(q, k, v, cache, meta)


def test_the_declared_dtype_is_served() -> None:
    spec = dataclasses.replace(SPEC, dtype=torch.float32)
    backend, cache, meta, q, k, v = setup(Float32LseBackend, spec)
    _, lse = backend.impl().forward(q, k, v, cache, meta, return_lse=True)
    assert lse.shape == (q.shape[0], 8) and lse.dtype == torch.float32
    assert torch.isfinite(lse).all()


def test_the_declaration_refuses_by_dtype_and_by_cache_format_with_its_reason() -> None:
    support = LseSupport(
        dtypes=frozenset({torch.bfloat16}), kv_cache_dtypes=frozenset({"auto"}), reason="why"
    )
    assert support.refusal(SPEC) is None
    r = support.refusal(dataclasses.replace(SPEC, dtype=torch.float16))
    assert isinstance(r, Refusal) and (r.field, r.value) == ("lse", torch.float16)
    assert "dtype torch.float16" in r and "(why)" in r
    r = support.refusal(dataclasses.replace(SPEC, kv_cache_dtype="fp8_e4m3"))
    assert r is not None and r.value == "fp8_e4m3" and "kv_cache_dtype 'fp8_e4m3'" in r
    nothing = LseSupport().refusal(SPEC)
    assert nothing is not None and LSE_NOT_DECLARED in nothing


def test_a_declaration_without_sinks_refuses_a_spec_with_sinks_with_its_reason() -> None:
    support = LseSupport(dtypes=frozenset({torch.bfloat16}), sinks=False, reason="why")
    assert support.refusal(SPEC) is None
    r = support.refusal(dataclasses.replace(SPEC, use_sinks=True))
    assert isinstance(r, Refusal) and (r.field, r.value) == ("lse", "sinks")
    assert "with sinks" in r and "(why)" in r
    assert (
        LseSupport(dtypes=frozenset({torch.bfloat16})).refusal(
            dataclasses.replace(SPEC, use_sinks=True)
        )
        is None
    )
    caps = Capabilities(devices=None, dtypes=frozenset({torch.bfloat16}), lse=support)
    assert caps.summary()["lse"] == {
        "dtypes": ["bfloat16"],
        "kv_cache_dtypes": "any",
        "sinks": False,
        "reason": "why",
    }


def test_a_declaration_must_say_why_and_name_real_formats() -> None:
    with pytest.raises(InvalidInputError, match="must say why"):
        LseSupport(reason=" ")
    with pytest.raises(UnknownNameError, match="fp9"):
        LseSupport(kv_cache_dtypes=frozenset({"fp9"}))


def test_the_summary_shows_the_declaration() -> None:
    assert TorchBackend.capabilities.summary()["lse"] == {
        "dtypes": ["bfloat16", "float16", "float32"],
        "kv_cache_dtypes": "any",
    }
    assert Capabilities(devices=None, dtypes=frozenset({torch.float32})).summary()["lse"] == {
        "dtypes": [],
        "kv_cache_dtypes": "any",
        "reason": LSE_NOT_DECLARED,
    }


@pytest.mark.parametrize(
    ("lse", "why"),
    [
        (torch.empty(5, 8, dtype=torch.bfloat16), "float32"),
        (torch.empty(6, 8), r"\[num_tokens=5, num_heads=8\]"),
        (torch.empty(5, 4), r"\[num_tokens=5, num_heads=8\]"),
    ],
)
def test_a_bad_lse_buffer_is_refused_before_any_write(lse: torch.Tensor, why: str) -> None:
    backend, cache, meta, q, k, v = setup(TorchBackend)
    before = cache.clone()
    with pytest.raises(InvalidInputError, match=why):
        backend.impl().forward(q, k, v, cache, meta, return_lse=True, lse=lse)
    assert cache.equal(before)


def test_an_lse_buffer_without_return_lse_is_refused() -> None:
    backend, cache, meta, q, k, v = setup(TorchBackend)
    before = cache.clone()
    with pytest.raises(InvalidInputError, match="return_lse=True"):
        backend.impl().forward(q, k, v, cache, meta, lse=torch.empty(5, 8))  # type: ignore[call-overload]
    assert cache.equal(before)


class Recording(TorchAttentionImpl):
    seen: ClassVar[list[bool]] = []

    def compute(self, *args: Any, **kwargs: Any) -> None:
        Recording.seen.append("lse" in kwargs)
        super().compute(*args, **kwargs)


def test_compute_gets_the_lse_only_where_it_was_asked_for() -> None:
    class Backend(TorchBackend):
        impl_type = Recording

    backend, cache, meta, q, k, v = setup(Backend)
    impl = backend.impl()
    Recording.seen.clear()
    impl.forward(q, k, v, cache, meta)
    impl.forward(q, None, None, cache, meta, return_lse=True)
    assert Recording.seen == [False, True]
