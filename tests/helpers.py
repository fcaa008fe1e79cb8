"""Shared builders for the unit tests: random batches, filled caches, tolerance checks.

Everything takes an explicit seed or ``torch.Generator`` so every test is reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from attnhub import AttentionSpec, BatchMetadata, PagedKVCache, reference
from attnhub.capabilities import Tolerance
from attnhub.quant import quantize_fp8
from attnhub.spec import KV_CACHE_DTYPES

#: Per-tensor scale the tests put in fp8 caches (not 1, so a backend that ignores it fails).
FP8_TEST_SCALE = 1.0 / 32


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def blocks_needed(seq_lens: Sequence[int], block_size: int) -> list[int]:
    return [math.ceil(s / block_size) for s in seq_lens]


def num_blocks_for(seq_lens: Sequence[int], block_size: int, spare: int = 3) -> int:
    """Enough blocks for every sequence, plus block 0 (never used) and a few spare ones."""
    return sum(blocks_needed(seq_lens, block_size)) + 1 + spare


def shuffled_block_table(
    seq_lens: Sequence[int],
    block_size: int,
    num_blocks: int,
    g: torch.Generator,
    *,
    pad_value: int = 0,
    extra_width: int = 0,
) -> torch.Tensor:  # [num_reqs, max_blocks] int32
    """Each request gets distinct, randomly chosen blocks from 1..num_blocks-1 (block 0 is never
    handed out); unused entries hold ``pad_value``."""
    needed = blocks_needed(seq_lens, block_size)
    assert sum(needed) <= num_blocks - 1, "not enough blocks"
    pool = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    width = max([*needed, 1]) + extra_width
    table = torch.full((len(seq_lens), width), pad_value, dtype=torch.int32)
    used = 0
    for r, n in enumerate(needed):
        table[r, :n] = torch.tensor(pool[used : used + n], dtype=torch.int32)
        used += n
    return table


def make_batch(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_size: int,
    num_blocks: int | None = None,
    *,
    seed: int = 0,
    causal: bool = True,
    num_tokens: int | None = None,
    pad_value: int = 0,
) -> tuple[BatchMetadata, int]:
    """A batch with a shuffled block table that never uses block 0; returns (batch, num_blocks)."""
    if num_blocks is None:
        num_blocks = num_blocks_for(seq_lens, block_size)
    table = shuffled_block_table(seq_lens, block_size, num_blocks, gen(seed), pad_value=pad_value)
    batch = BatchMetadata.from_lengths(
        query_lens, seq_lens, table, block_size, "cpu", causal=causal, num_tokens=num_tokens
    )
    return batch, num_blocks


def fill_cache_random(cache: PagedKVCache, g: torch.Generator, *, model_dtype: torch.dtype) -> None:
    """Fill every slot of every plane with random data in the cache's storage format.

    This is the "context" already in the cache: the reference reads it back as it is stored.
    fp8 caches get the per-tensor scale FP8_TEST_SCALE.
    """
    fmt = KV_CACHE_DTYPES[cache.kv_cache_dtype]
    for which, plane in (("key", cache.key), ("value", cache.value)):
        x = torch.randn(plane.shape, generator=g, dtype=torch.float32)
        kind = getattr(fmt, f"{which}_scale")
        if kind == "none":
            plane.copy_(x.to(model_dtype))
        elif kind == "tensor":
            scale = getattr(cache, f"{which}_scale")
            scale.fill_(FP8_TEST_SCALE)
            plane.copy_(quantize_fp8(x, scale, plane.dtype))
        else:  # int8 planes
            plane.copy_(torch.randint(-127, 128, plane.shape, generator=g, dtype=torch.int8))
            scale = getattr(cache, f"{which}_scale")
            scale.copy_(torch.rand(scale.shape, generator=g) * 0.02 + 0.001)


def used_slots(batch: BatchMetadata) -> torch.Tensor:  # [n] int64: every slot of every sequence
    slots = []
    table = batch.block_table.to("cpu").long()
    bs = batch.block_size
    for r in range(batch.num_reqs):
        pos = torch.arange(int(batch.seq_lens_cpu[r]))
        slots.append(table[r, pos // bs] * bs + pos % bs)
    return torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)


def poison_unused_slots(cache: PagedKVCache, batch: BatchMetadata) -> None:
    """Write NaN to every key/value slot no sequence of ``batch`` covers (block 0, tails of
    partially used blocks, spare blocks): stale data a backend must never let leak."""
    keep = torch.zeros(cache.num_slots, dtype=torch.bool)
    keep[used_slots(batch)] = True
    for plane in (cache.key_nhd(), cache.value_nhd()):
        flat = plane.reshape(cache.num_slots, *plane.shape[2:]) if plane.is_contiguous() else None
        assert flat is not None, "poisoning needs an NHD cache"
        flat[~keep] = torch.tensor(float("nan")).to(plane.dtype)


def random_qkv(
    spec: AttentionSpec, num_tokens: int, g: torch.Generator, *, q_gain: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_size
    q = (torch.randn(num_tokens, H, D, generator=g) * q_gain).to(spec.dtype)
    k = torch.randn(num_tokens, Hkv, D, generator=g).to(spec.dtype)
    v = torch.randn(num_tokens, Hkv, D, generator=g).to(spec.dtype)
    return q, k, v


def alibi_slopes(num_heads: int) -> torch.Tensor:  # [num_heads] float32, the usual geometric set
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)])


def assert_within(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, what: str) -> None:
    """|actual - expected| <= atol + rtol * |expected| everywhere (expected is the float64
    reference); the message says where and by how much it fails."""
    a = actual.to("cpu", torch.float64)
    e = expected.to("cpu", torch.float64)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    if not torch.isfinite(a).all():
        where = (~torch.isfinite(a)).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: non-finite values, first at {where}")
    err = (a - e).abs()
    bound = tol.atol + tol.rtol * e.abs()
    bad = err > bound
    if bad.any():
        flat = int((err - bound).flatten().argmax())
        pos = torch.unravel_index(torch.tensor(flat), a.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} values outside atol={tol.atol} "
            f"rtol={tol.rtol}; worst at {[int(p) for p in pos]}: got {a.flatten()[flat]:.6g}, "
            f"expected {e.flatten()[flat]:.6g} (max abs err {err.max():.3g})"
        )


def reference_after_write(
    spec: AttentionSpec,
    cache: PagedKVCache,
    batch: BatchMetadata,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    *,
    alibi: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[PagedKVCache, torch.Tensor]:
    """What the cache must hold after a forward of this step, and the float64 expected output
    (computed on a clone; ``cache`` itself is not touched)."""
    expected_cache = cache.clone()
    if key is not None:
        assert value is not None
        reference.write_kv(expected_cache, key, value, batch.slot_mapping)
    out, _ = reference.paged_attention(
        query, expected_cache, batch, spec, alibi_slopes=alibi, sinks=sinks
    )
    return expected_cache, out
