"""Builders for the ascend backend's unit tests: an emulated backend, a step, its reference."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from attnhub_ascend import AscendBackend

from attnhub import AttentionSpec, BatchMetadata, PagedKVCache, reference


def spec(**changes: object) -> AttentionSpec:
    """A small spec the backend supports: 4 query heads over 2 kv heads, head 64, bf16,
    block size 128."""
    fields: dict[str, object] = dict(
        num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, block_size=128
    )
    fields.update(changes)
    return AttentionSpec(**fields)  # type: ignore[arg-type]


def backend(s: AttentionSpec | None = None) -> AscendBackend:
    return AscendBackend(s or spec(), "cpu", emulate=True)


@dataclass
class Step:
    backend: AscendBackend
    batch: BatchMetadata
    cache: PagedKVCache
    query: torch.Tensor  # [num_tokens, H, D]
    key: torch.Tensor  # [num_tokens, Hkv, D]
    value: torch.Tensor
    sinks: torch.Tensor | None


def step(
    requests: Sequence[tuple[int, int]],  # (query_len, seq_len) per request
    s: AttentionSpec | None = None,
    *,
    padding: int = 0,
    seed: int = 0,
) -> Step:
    """A step whose cached context is already in the cache (written through write_kv)."""
    s = s or spec()
    b = backend(s)
    g = torch.Generator().manual_seed(seed)
    bs = s.block_size
    needed = [math.ceil(n / bs) for _, n in requests]
    num_blocks = sum(needed) + 3
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(requests), max([*needed, 1]), dtype=torch.int32)
    for r, n in enumerate(needed):
        table[r, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    batch = BatchMetadata.from_lengths(
        [q for q, _ in requests],
        [n for _, n in requests],
        table,
        bs,
        "cpu",
        causal=s.causal,
        num_tokens=sum(q for q, _ in requests) + padding,
    )
    cache = b.allocate_kv_cache(num_blocks)
    cache.key.copy_(torch.randn(cache.key.shape, generator=g).to(s.dtype))
    cache.value.copy_(torch.randn(cache.value.shape, generator=g).to(s.dtype))
    t = batch.num_tokens

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(s.dtype)

    sinks = torch.randn(s.num_heads, generator=g) if s.use_sinks else None
    return Step(
        b,
        batch,
        cache,
        rand(t, s.num_heads, s.head_size),
        rand(t, s.num_kv_heads, s.head_size),
        rand(t, s.num_kv_heads, s.head_size),
        sinks,
    )


def forward(st: Step) -> torch.Tensor:
    meta = st.backend.metadata_builder().build(st.batch)
    impl = st.backend.impl(sinks=st.sinks)
    return impl.forward(st.query, st.key, st.value, st.cache, meta)


def assert_matches_reference(st: Step, out: torch.Tensor) -> None:
    n = st.batch.num_actual_tokens
    want, _ = reference.paged_attention(
        st.query[:n], st.cache, st.batch, st.backend.spec, sinks=st.sinks
    )
    tol = st.backend.capabilities.tolerance(st.backend.spec.dtype)
    torch.testing.assert_close(out[:n].double(), want, atol=tol.atol, rtol=tol.rtol)
