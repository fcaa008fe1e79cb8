"""The iluvatar backend's own test builders: its default spec, an emulated backend, a step on it
(generic pieces from attnhub.testing)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from attnhub_iluvatar import IluvatarBackend, emulator

from attnhub import AttentionSpec, BatchMetadata, PagedKVCache, reference, testing

VARLEN = "contrib.vllm_flash_attn.flash_attn_varlen_func"
KVCACHE = "contrib.vllm_flash_attn.flash_attn_with_kvcache"
WRITE = "inference.functions.reshape_and_cache_flash"
MERGE = "contrib.vllm_flash_attn.merge_attn_states"


def spec(**changes: object) -> AttentionSpec:
    """A small spec the backend supports: 4 query heads over 2 kv heads, head 64, bf16,
    block size 16."""
    fields: dict[str, object] = dict(
        num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, block_size=16
    )
    fields.update(changes)
    return AttentionSpec(**fields)  # type: ignore[arg-type]


def backend(
    s: AttentionSpec | None = None, cls: type[IluvatarBackend] = IluvatarBackend
) -> IluvatarBackend:
    return cls(s or spec(), "cpu", emulate=True)


@dataclass
class Step:
    backend: IluvatarBackend
    batch: BatchMetadata
    cache: PagedKVCache
    query: torch.Tensor  # [num_tokens, H, D]
    key: torch.Tensor  # [num_tokens, Hkv, D]
    value: torch.Tensor
    alibi_slopes: torch.Tensor | None
    sinks: torch.Tensor | None = None


def step(
    requests: Sequence[tuple[int, int]],  # (query_len, seq_len) per request
    s: AttentionSpec | None = None,
    *,
    padding: int = 0,
    seed: int = 0,
    table: torch.Tensor | None = None,
    cls: type[IluvatarBackend] = IluvatarBackend,
) -> Step:
    """A step over random context already in the cache (filled in place, not written through
    write_kv), with ``padding`` slot -1 rows after the real tokens."""
    s = s or spec()
    b = backend(s, cls)
    g = testing.generator(seed)
    query_lens, seq_lens = [q for q, _ in requests], [n for _, n in requests]
    num_tokens = sum(query_lens) + padding
    if table is None:
        batch, num_blocks = testing.make_batch(
            query_lens,
            seq_lens,
            s.block_size,
            testing.num_blocks_for(seq_lens, s.block_size, spare=2),
            seed=g,
            causal=s.causal,
            num_tokens=num_tokens,
        )
    else:
        batch = BatchMetadata.from_lengths(
            query_lens, seq_lens, table, s.block_size, causal=s.causal, num_tokens=num_tokens
        )
        num_blocks = int(table.max()) + 2
    cache = b.allocate_kv_cache(num_blocks)
    testing.fill_cache_random(cache, g)
    slopes = testing.alibi_slopes(s.num_heads) if s.use_alibi else None
    query, key, value = testing.random_qkv(s, batch.num_tokens, g)
    sinks = testing.random_sinks(s.num_heads, g) if s.use_sinks else None
    return Step(b, batch, cache, query, key, value, slopes, sinks)


def forward(st: Step, common_prefix_len: int = 0) -> torch.Tensor:
    meta = st.backend.metadata_builder().build(st.batch, common_prefix_len=common_prefix_len)
    impl = st.backend.impl(alibi_slopes=st.alibi_slopes, sinks=st.sinks)
    return impl.forward(st.query, st.key, st.value, st.cache, meta)


def calls_of(st: Step, common_prefix_len: int = 0) -> tuple[torch.Tensor, list[emulator.Call]]:
    with emulator.record_calls() as calls:
        out = forward(st, common_prefix_len)
    return out, calls


def only(calls: list[emulator.Call], name: str) -> emulator.Call:
    found = [c for c in calls if c.name == name]
    assert len(found) == 1, f"{name} called {len(found)} times: {[c.name for c in calls]}"
    return found[0]


def assert_matches_reference(st: Step, out: torch.Tensor) -> None:
    """``out`` matches the reference over the cache as ``forward`` left it."""
    n = st.batch.num_actual_tokens
    want, _ = reference.paged_attention(
        st.query[:n],
        st.cache,
        st.batch,
        st.backend.spec,
        alibi_slopes=st.alibi_slopes,
        sinks=st.sinks,
    )
    tol = st.backend.capabilities.tolerance(st.backend.spec.dtype)
    testing.assert_within(out[:n], want, tol, "iluvatar forward", batch=st.batch)
