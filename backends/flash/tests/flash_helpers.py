"""The flash backend's own test builders: a spec each provider supports, an emulated backend of
a provider, a step on it (generic pieces from attnhub.testing)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from attnhub_flash import BACKENDS, FlashBackend

from attnhub import AttentionSpec, BatchMetadata, MLASpec, PagedKVCache, reference, testing

PROVIDERS = tuple(BACKENDS)
#: the smallest block size each provider's paged kernels take
BLOCK_SIZE = {"vllm": 16, "vllm-fa3": 16, "vllm-flashmla": 16, "fa2": 256, "fa3": 16, "fa4": 16}


def spec(provider: str = "vllm", **changes: object) -> AttentionSpec:
    """4 query heads over 2 kv heads, head 64, bf16, the provider's smallest block size."""
    fields: dict[str, object] = dict(
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.bfloat16,
        block_size=BLOCK_SIZE[provider],
    )
    fields.update(changes)
    return AttentionSpec(**fields)  # type: ignore[arg-type]


def mla_spec(**changes: object) -> MLASpec:
    """DeepSeek's MLA geometry (kv_lora_rank 512, rope 64, qk_nope / v head 128), 4 heads,
    bfloat16, block 16; ``changes`` replace any field."""
    fields: dict[str, object] = dict(
        num_heads=4, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, dtype=torch.bfloat16, block_size=16,
    )  # fmt: skip
    fields.update(changes)
    return MLASpec(**fields)  # type: ignore[arg-type]


def backend(provider: str = "vllm", s: AttentionSpec | None = None) -> FlashBackend:
    return BACKENDS[provider](s or spec(provider), "cpu", emulate=True)


@dataclass
class Step:
    backend: FlashBackend
    batch: BatchMetadata
    cache: PagedKVCache
    query: torch.Tensor  # [num_tokens, H, D]
    key: torch.Tensor  # [num_tokens, Hkv, D]
    value: torch.Tensor
    sinks: torch.Tensor | None
    alibi: torch.Tensor | None


def step(
    requests: Sequence[tuple[int, int]],  # (query_len, seq_len) per request
    provider: str = "vllm",
    s: AttentionSpec | None = None,
    *,
    padding: int = 0,
    seed: int = 0,
    shared_prefix_blocks: int = 0,
) -> Step:
    """A step over random context already in the cache, with ``padding`` slot -1 rows; the
    first ``shared_prefix_blocks`` blocks of every request are the same ones (cascade)."""
    s = s or spec(provider)
    b = backend(provider, s)
    g = testing.generator(seed)
    query_lens, seq_lens = [q for q, _ in requests], [n for _, n in requests]
    num_blocks = testing.num_blocks_for(
        seq_lens, s.block_size, spare=2, shared_prefix_blocks=shared_prefix_blocks
    )
    table = testing.shuffled_block_table(
        seq_lens, s.block_size, num_blocks, g, shared_prefix_blocks=shared_prefix_blocks
    )
    batch = BatchMetadata.from_lengths(
        query_lens,
        seq_lens,
        table,
        s.block_size,
        causal=s.causal,
        num_tokens=sum(query_lens) + padding,
    )
    cache = b.allocate_kv_cache(num_blocks)
    testing.fill_cache_random(cache, g)
    sinks = testing.random_sinks(s.num_heads, g) if s.use_sinks else None
    alibi = testing.alibi_slopes(s.num_heads) if s.use_alibi else None
    query, key, value = testing.random_qkv(s, batch.num_tokens, g)
    return Step(b, batch, cache, query, key, value, sinks, alibi)


def forward(st: Step) -> torch.Tensor:
    meta = st.backend.metadata_builder().build(st.batch)
    impl = st.backend.impl(sinks=st.sinks, alibi_slopes=st.alibi)
    return impl.forward(st.query, st.key, st.value, st.cache, meta)


def assert_matches_reference(st: Step, out: torch.Tensor) -> None:
    """``out`` matches the reference over the cache as ``forward`` left it."""
    n = st.batch.num_actual_tokens
    want, _ = reference.paged_attention(
        st.query[:n],
        st.cache,
        st.batch,
        st.backend.spec,
        sinks=st.sinks,
        alibi_slopes=st.alibi,
    )
    tol = st.backend.capabilities.tolerance(st.backend.spec.dtype)
    testing.assert_within(out[:n], want, tol, f"flash ({st.backend.provider})", batch=st.batch)
