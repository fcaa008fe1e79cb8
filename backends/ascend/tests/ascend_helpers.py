"""The ascend backend's own test builders: its default spec, an emulated backend, a step on it
(generic pieces from attnhub.testing)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from attnhub_ascend import AscendBackend

from attnhub import AttentionSpec, BatchMetadata, PagedKVCache, reference, testing


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
    causal: bool | None = None,
) -> Step:
    """A step over random context already in the cache (filled in place, not written through
    write_kv), with ``padding`` slot -1 rows after the real tokens; ``causal`` (default: the
    spec's) makes e.g. a decoder layer's step non-causal."""
    s = s or spec()
    b = backend(s)
    g = testing.generator(seed)
    query_lens, seq_lens = [q for q, _ in requests], [n for _, n in requests]
    batch, num_blocks = testing.make_batch(
        query_lens,
        seq_lens,
        s.block_size,
        testing.num_blocks_for(seq_lens, s.block_size, spare=2),
        seed=g,
        causal=s.causal if causal is None else causal,
        num_tokens=sum(query_lens) + padding,
    )
    cache = b.allocate_kv_cache(num_blocks)
    testing.fill_cache_random(cache, g)
    sinks = testing.random_sinks(s.num_heads, g) if s.use_sinks else None
    query, key, value = testing.random_qkv(s, batch.num_tokens, g)
    return Step(b, batch, cache, query, key, value, sinks)


def forward(st: Step) -> torch.Tensor:
    meta = st.backend.metadata_builder().build(st.batch)
    impl = st.backend.impl(sinks=st.sinks)
    return impl.forward(st.query, st.key, st.value, st.cache, meta)


def assert_matches_reference(st: Step, out: torch.Tensor) -> None:
    """``out`` matches the reference over the cache as ``forward`` left it."""
    n = st.batch.num_actual_tokens
    want, _ = reference.paged_attention(
        st.query[:n], st.cache, st.batch, st.backend.spec, sinks=st.sinks
    )
    tol = st.backend.capabilities.tolerance(st.backend.spec.dtype)
    testing.assert_within(out[:n], want, tol, "ascend forward", batch=st.batch)
