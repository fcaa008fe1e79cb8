"""What every test of an attnhub backend needs: seeds, shuffled block tables, batches, caches
filled in their storage format, random inputs, and comparisons with ``attnhub.reference``.

The core's tests, the conformance suite and the vendor backends' tests all build their steps
with these helpers; a third-party backend's tests can too, in any test framework (this module
imports torch and attnhub, never pytest). Everything random is drawn on the host from an
explicit ``torch.Generator`` (or a seed) and then moved to the device, so a seed gives the same
data on every device and every run::

    from attnhub import testing

    g = testing.generator(testing.seed_of("decode-bf16"))
    batch, num_blocks = testing.make_batch([1, 5], [20, 5], block_size=16, seed=g)
    cache = backend.allocate_kv_cache(num_blocks)
    testing.fill_cache_random(cache, g)                       # cached context, any format
    q, k, v = testing.random_qkv(spec, batch.num_tokens, g)
    expected_cache, expected = testing.reference_after_write(spec, cache, batch, q, k, v)
    out = backend.impl().forward(q, k, v, cache, backend.metadata_builder().build(batch))
    testing.assert_within(out, expected, backend.capabilities.tolerance(spec.dtype), batch=batch)
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from attnhub import reference
from attnhub.batch import BatchMetadata
from attnhub.capabilities import AccuracyBound, Capabilities, Tolerance
from attnhub.errors import InvalidInputError
from attnhub.kv_cache import PagedKVCache
from attnhub.quant import (
    FP8_DTYPES,
    probability_error_bound,
    quantize_fp8,
    round_probabilities,
    simulate_query_quantization,
)
from attnhub.spec import KV_CACHE_DTYPES, AttentionSpec

if TYPE_CHECKING:
    from attnhub.backend import AttentionBackend, AttentionImpl
    from attnhub.mla import LatentKVCache, MLASpec

__all__ = [
    "FINITE_POISON",
    "FP8_LATENT_TEST_SCALE",
    "FP8_TEST_SCALES",
    "ROUNDING_FLOORS",
    "TOLERANCE_CAPS",
    "MLAStep",
    "accuracy",
    "accuracy_mismatch",
    "alibi_slopes",
    "assert_within",
    "bad_layer_calls",
    "blocks_needed",
    "cache_after_write",
    "cache_differences",
    "call_outcome",
    "capped_tolerance",
    "checked_in_full",
    "fill_cache_random",
    "fill_latent_cache_random",
    "generator",
    "make_batch",
    "mismatch",
    "mla_probability_allowance",
    "num_blocks_for",
    "poison_unused_slots",
    "probability_allowance",
    "probability_rounding",
    "quantized_query",
    "random_kv",
    "random_latent_kv",
    "random_mla_query",
    "random_mla_step",
    "random_mla_weights",
    "random_qkv",
    "random_sinks",
    "reference_after_write",
    "rounding_mismatch",
    "seed_of",
    "set_static_scales",
    "shuffled_block_table",
    "strided_last_dim",
    "token_origin",
    "used_slots",
]

#: The per-tensor scale the helpers put in fp8 latent caches (not 1: a backend ignoring it fails).
FP8_LATENT_TEST_SCALE = 0.025

#: The per-tensor (key, value) scales the helpers put in fp8 caches: not 1, so a backend that
#: ignores a scale fails, and not equal, so one that swaps them fails.
FP8_TEST_SCALES = (0.025, 0.02)


# --- seeds ------------------------------------------------------------------------------------


def generator(seed: int) -> torch.Generator:
    """A host generator seeded with ``seed``: draw with it, then move the result to the device."""
    return torch.Generator().manual_seed(seed)


def seed_of(text: str) -> int:
    """A stable seed from a name, e.g. a test case's id (the same case gets the same data on
    every run; Python's ``hash`` of a string changes between processes)."""
    return zlib.crc32(text.encode())


def _as_generator(seed: int | torch.Generator) -> torch.Generator:
    return seed if isinstance(seed, torch.Generator) else generator(seed)


# --- block tables and batches -----------------------------------------------------------------


def blocks_needed(seq_lens: Sequence[int], block_size: int) -> list[int]:
    """``ceil(seq_len / block_size)`` per request: the blocks each sequence occupies."""
    return [math.ceil(s / block_size) for s in seq_lens]


def num_blocks_for(
    seq_lens: Sequence[int], block_size: int, spare: int = 3, *, shared_prefix_blocks: int = 0
) -> int:
    """A cache size for ``seq_lens``: every sequence's blocks (the ``shared_prefix_blocks``
    leading ones counted once), plus block 0 (never handed out) and ``spare`` unused blocks."""
    own = sum(n - shared_prefix_blocks for n in blocks_needed(seq_lens, block_size))
    return 1 + shared_prefix_blocks + own + spare


def shuffled_block_table(
    seq_lens: Sequence[int],
    block_size: int,
    num_blocks: int,
    g: torch.Generator,
    *,
    pad_value: int = 0,
    extra_width: int = 0,
    shared_prefix_blocks: int = 0,
    keep_last_block_free: bool = False,
) -> torch.Tensor:  # [num_reqs, max_blocks + extra_width] int32, host
    """Each request gets distinct blocks drawn at random from ``1..num_blocks-1``, so a backend
    that assumes contiguous or ordered blocks fails. Block 0 is never handed out; with
    ``keep_last_block_free`` neither is the last block (a padding slot -1 misused as an index
    lands in one of the two). The first ``shared_prefix_blocks`` blocks of every row are the
    same (a shared prefix, as in cascade attention). Entries past a sequence's blocks hold
    ``pad_value``; ``extra_width`` adds columns of it."""
    if block_size <= 0:
        raise ValueError(f"block_size = {block_size} must be positive")
    if any(s < 0 for s in seq_lens):
        raise ValueError(f"seq_lens = {list(seq_lens)} must not be negative")
    needed = blocks_needed(seq_lens, block_size)
    shared = shared_prefix_blocks
    if shared < 0 or any(n < shared for n in needed):
        raise ValueError(
            f"shared_prefix_blocks = {shared} must be between 0 and every sequence's blocks "
            f"({needed})"
        )
    usable = num_blocks - (2 if keep_last_block_free else 1)
    want = shared + sum(n - shared for n in needed)
    if want > usable:
        raise ValueError(
            f"{want} blocks needed for seq_lens {list(seq_lens)} at block_size {block_size}, "
            f"but a cache of {num_blocks} blocks has {max(usable, 0)} to hand out "
            f"(see num_blocks_for)"
        )
    ids = (torch.randperm(max(usable, 0), generator=g) + 1).tolist()
    prefix, ids = ids[:shared], ids[shared:]
    width = max([*needed, 1]) + extra_width
    table = torch.full((len(needed), width), pad_value, dtype=torch.int32)
    for r, n in enumerate(needed):
        table[r, :shared] = torch.tensor(prefix, dtype=torch.int32)
        table[r, shared:n] = torch.tensor(ids[: n - shared], dtype=torch.int32)
        ids = ids[n - shared :]
    return table


def make_batch(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_size: int,
    num_blocks: int | None = None,
    *,
    seed: int | torch.Generator = 0,
    causal: bool = True,
    num_tokens: int | None = None,
    pad_value: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[BatchMetadata, int]:
    """A batch over a shuffled block table (see ``shuffled_block_table``) and the number of
    blocks its cache needs (``num_blocks``, or ``num_blocks_for(seq_lens, block_size)``).

    ``seed`` is an int or a generator to draw from (its state advances). ``num_tokens`` pads the
    step with slot -1 rows. The lengths are validated by ``BatchMetadata.from_lengths``
    (``InvalidInputError``); too small a ``num_blocks`` raises ``ValueError``.
    """
    if num_blocks is None:
        num_blocks = num_blocks_for(seq_lens, block_size)
    table = shuffled_block_table(
        seq_lens, block_size, num_blocks, _as_generator(seed), pad_value=pad_value
    )
    batch = BatchMetadata.from_lengths(
        query_lens, seq_lens, table, block_size, device, causal=causal, num_tokens=num_tokens
    )
    return batch, num_blocks


def used_slots(batch: BatchMetadata, *, context_only: bool = False) -> torch.Tensor:
    """The cache slots of every position of every sequence in ``batch`` (``context_only``:
    only the positions cached before this step, ``seq_len - query_len`` per request), request
    by request, each slot once (a shared prefix is listed at its first use).
    Returns [n] int64 on the host."""
    table = batch.block_table.to("cpu", torch.int64)  # [num_reqs, max_blocks]
    counts = batch.context_lens_cpu if context_only else batch.seq_lens_cpu
    counts = counts.to(torch.int64)
    bs = batch.block_size
    rows = torch.repeat_interleave(torch.arange(batch.num_reqs), counts)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    pos = torch.arange(rows.numel()) - starts  # position within its sequence
    slots = table[rows, pos // bs] * bs + pos % bs
    return torch.tensor(list(dict.fromkeys(slots.tolist())), dtype=torch.int64)


# --- caches -----------------------------------------------------------------------------------


def fill_cache_random(
    cache: PagedKVCache, g: torch.Generator, *, fp8_scales: tuple[float, float] = FP8_TEST_SCALES
) -> None:
    """Give every slot random, finite data in the cache's storage format, for any
    ``kv_cache_dtype`` of ``attnhub.spec.KV_CACHE_DTYPES``, and set the engine-owned scales.

    Unquantized planes hold N(0, 1) values clamped to +-4; fp8 planes hold such values quantized
    with ``fp8_scales`` (key, value), which ``set_static_scales`` then puts in the cache; int8
    planes hold integers in [-127, 127] and per-slot scales lie in [0.01, 0.05]. The result is
    context that ``attnhub.reference`` reads back as stored, and, in slots a step must not
    touch, stale data a backend must ignore.
    """
    with cache.edit() as plain:  # packed blocks: the logical planes, packed back after
        _fill_random(plain, g, fp8_scales)
    set_static_scales(cache, g, fp8_scales=fp8_scales)


def _fill_random(cache: PagedKVCache, g: torch.Generator, fp8_scales: tuple[float, float]) -> None:
    fmt = KV_CACHE_DTYPES[cache.kv_cache_dtype]
    for name, plane in cache.planes().items():  # key, value, then any per-slot scale planes
        x: torch.Tensor
        if plane.dtype == torch.int8:
            x = torch.randint(-127, 128, plane.shape, generator=g, dtype=torch.int8)
        elif name.endswith("_scale"):
            x = torch.rand(plane.shape, generator=g) * 0.04 + 0.01
        else:
            x = torch.randn(plane.shape, generator=g).clamp(-4, 4)
            if getattr(fmt, f"{name}_scale") == "tensor":  # fp8 with a per-tensor scale
                x = quantize_fp8(x, fp8_scales[0 if name == "key" else 1], plane.dtype)
            x = x.to(plane.dtype)
        plane.copy_(x.to(plane.device))


def set_static_scales(
    cache: PagedKVCache, g: torch.Generator, *, fp8_scales: tuple[float, float] = FP8_TEST_SCALES
) -> None:
    """Set the scales an engine owns (loaded with the model, never written by a backend): fp8
    per-tensor scales to ``fp8_scales`` (key, value), int8 per-channel scales to random values
    in [0.035, 0.05], so that N(0, 1) values up to 4.5 sigma stay within +-127 steps."""
    fmt = KV_CACHE_DTYPES[cache.kv_cache_dtype]
    for which, fp8_scale in zip(("key_scale", "value_scale"), fp8_scales, strict=True):
        plane = getattr(cache, which)
        kind = getattr(fmt, which)
        if kind == "tensor":
            plane.fill_(fp8_scale)
        elif kind == "channel":
            plane.copy_((torch.rand(plane.shape, generator=g) * 0.015 + 0.035).to(plane.device))


#: The stale value ``poison_unused_slots(finite=True)`` writes in floating planes: finite in every
#: model dtype, and far outside what attention inputs hold, so a slot read that should not be
#: gives a visibly wrong output.
FINITE_POISON = 1e3


def poison_unused_slots(cache: PagedKVCache, batch: BatchMetadata, *, finite: bool = False) -> None:
    """Make every slot no sequence of ``batch`` covers (block 0, the tail of a partly used
    block, spare blocks) hold stale data a backend must never let through: NaN in floating
    planes (fp8 included) and per-slot scales (``finite``: :data:`FINITE_POISON`, for a backend
    that declares ``finite_stale_slots``), -128 (outside the symmetric range) in int8 planes.
    Works for both layouts."""
    unused = torch.ones(cache.num_slots, dtype=torch.bool)
    unused[used_slots(batch)] = False
    unused = unused.view(cache.num_blocks, cache.block_size).to(cache.device)
    with cache.edit() as plain:  # packed blocks: the logical planes, packed back after
        _poison(plain, unused, FINITE_POISON if finite else float("nan"))


def _poison(cache: PagedKVCache, unused: torch.Tensor, stale: float) -> None:
    for name in cache.planes():
        if name in ("key", "value"):
            plane = cache.key_nhd() if name == "key" else cache.value_nhd()
        else:
            scale = cache.slot_scale_nhd(name)
            assert scale is not None
            plane = scale
        # a view with [num_blocks, block_size] leading: writing through it changes the cache
        bad = torch.tensor(stale if plane.is_floating_point() else -128).to(plane.dtype)
        if plane.element_size() == 1:  # fp8 / int8: write the bytes (no fp8 indexing kernels)
            plane, bad = plane.view(torch.uint8), bad.view(torch.uint8)
        plane[unused] = bad.to(plane.device)


def fill_latent_cache_random(
    cache: LatentKVCache, g: torch.Generator, *, fp8_scale: float = FP8_LATENT_TEST_SCALE
) -> None:
    """Give every slot of an MLA latent cache (either layout) random, finite data in its storage
    format, written straight into its planes (a latent cache has no packed form to edit):
    N(0, 1) values clamped to +-4; for fp8 such values quantized with ``fp8_scale``, which
    becomes the cache's (engine-owned) scale. Context ``attnhub.reference`` reads back as stored,
    and stale data in slots a step must not touch."""
    for plane in cache.planes().values():
        x = torch.randn(plane.shape, generator=g).clamp(-4, 4)
        if cache.scale is not None:
            x = quantize_fp8(x, fp8_scale, plane.dtype)
        plane.copy_(x.to(plane.dtype).to(plane.device))
    if cache.scale is not None:
        cache.scale.fill_(fp8_scale)


# --- inputs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MLAStep:
    """One random MLA step for a backend: its batch, a latent cache of the backend's layout
    filled with random context and stale data, and the step's absorbed query and new latents
    (one row per token, the padding rows included)."""

    batch: BatchMetadata
    cache: LatentKVCache
    query: torch.Tensor  # [num_tokens, H, kv_lora_rank + rope]
    kv_c: torch.Tensor  # [num_tokens, kv_lora_rank]
    k_pe: torch.Tensor  # [num_tokens, rope]


def random_mla_step(
    backend: AttentionBackend,
    requests: Sequence[tuple[int, int]],  # (query_len, seq_len) per request
    *,
    seed: int | torch.Generator = 9,
    padding: int = 2,
) -> MLAStep:
    """A step of ``requests`` over a shuffled block table for an MLA ``backend`` (its spec, its
    cache layout), with ``padding`` rows past the real tokens."""
    from attnhub.mla import LatentKVCache, MLASpec

    spec = backend.spec
    assert isinstance(spec, MLASpec)
    g = _as_generator(seed)
    query_lens, seq_lens = [q for q, _ in requests], [s for _, s in requests]
    batch, nb = make_batch(
        query_lens, seq_lens, spec.block_size, seed=g, num_tokens=sum(query_lens) + padding
    )
    cache = backend.allocate_kv_cache(nb + 1)
    assert isinstance(cache, LatentKVCache)
    fill_latent_cache_random(cache, g)
    kv_c, k_pe = random_latent_kv(spec, batch.num_tokens, g)
    query = random_mla_query(spec, batch.num_tokens, g)
    return MLAStep(batch, cache, query, kv_c, k_pe)


def random_mla_weights(
    spec: MLASpec, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:  # w_uk [L, H, qk_nope], w_uv [L, H, v_head], float64
    """An MLA layer's up-projections ``W_UK`` and ``W_UV`` (``attnhub.reference``'s shapes):
    N(0, 1 / kv_lora_rank), so absorbed queries and projected outputs stay of order one."""
    lat, h = spec.kv_lora_rank, spec.num_heads
    w_uk = torch.randn(lat, h, spec.qk_nope_head_dim, generator=g, dtype=torch.float64)
    w_uv = torch.randn(lat, h, spec.v_head_dim, generator=g, dtype=torch.float64)
    return w_uk / lat**0.5, w_uv / lat**0.5


def random_latent_kv(
    spec: MLASpec, num_tokens: int, g: torch.Generator, *, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:  # kv_c [n, kv_lora_rank], k_pe [n, qk_rope_head_dim]
    """N(0, 1) latents and rope keys, one per token, in ``spec.dtype`` (what a layer writes)."""
    kv_c = torch.randn(num_tokens, spec.kv_lora_rank, generator=g).to(spec.dtype)
    k_pe = torch.randn(num_tokens, spec.qk_rope_head_dim, generator=g).to(spec.dtype)
    return kv_c.to(device), k_pe.to(device)


def random_mla_query(
    spec: MLASpec,
    num_tokens: int,
    g: torch.Generator,
    *,
    form: str = "absorbed",
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """An N(0, 1) MLA query in ``spec.dtype``: form "absorbed" [n, H, kv_lora_rank + rope] (what
    an absorbed-form kernel takes), "expanded" [n, H, qk_nope + rope]."""
    widths = {"absorbed": spec.latent_size, "expanded": spec.qk_head_dim}
    if form not in widths:
        raise InvalidInputError(f"form = {form!r} is not one of {sorted(widths)}")
    q = torch.randn(num_tokens, spec.num_heads, widths[form], generator=g)
    return q.to(spec.dtype).to(device)


def random_kv(
    spec: AttentionSpec, num_tokens: int, g: torch.Generator, *, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:  # key [n, num_kv_heads, head_size], value [.., head_size_v]
    """N(0, 1) keys and values in ``spec.dtype``."""
    key = torch.randn(num_tokens, spec.num_kv_heads, spec.head_size, generator=g)
    value = torch.randn(num_tokens, spec.num_kv_heads, spec.head_size_v, generator=g)
    key, value = key.to(spec.dtype), value.to(spec.dtype)
    return key.to(device), value.to(device)


def random_qkv(
    spec: AttentionSpec,
    num_tokens: int,
    g: torch.Generator,
    *,
    q_gain: float = 1.0,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """N(0, 1) query [num_tokens, num_heads, head_size] (times ``q_gain``: larger logits, e.g. to
    make a soft cap bite), key [num_tokens, num_kv_heads, head_size] and value
    [num_tokens, num_kv_heads, head_size_v], in ``spec.dtype``."""
    shape = (num_tokens, spec.num_heads, spec.head_size)
    query = (torch.randn(shape, generator=g) * q_gain).to(spec.dtype)
    key, value = random_kv(spec, num_tokens, g)
    return query.to(device), key.to(device), value.to(device)


def random_sinks(
    num_heads: int, g: torch.Generator, *, mean: float = 0.0, device: torch.device | str = "cpu"
) -> torch.Tensor:  # [num_heads] float32
    """Attention-sink logits, one per query head: N(mean, 1)."""
    return (torch.randn(num_heads, generator=g) + mean).to(device)


def alibi_slopes(num_heads: int, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ALiBi paper's slopes, [num_heads] float32: the geometric sequence
    ``2 ** (-8 i / n)`` for the closest power of two ``n <= num_heads``, then the odd terms of
    the sequence for ``2 n`` for the remaining heads."""
    p = 2 ** math.floor(math.log2(num_heads))
    base = [2 ** (-8 * (i + 1) / p) for i in range(p)]
    extra = [2 ** (-4 * (2 * i + 1) / p) for i in range(num_heads - p)]
    return torch.tensor(base + extra, dtype=torch.float32, device=device)


# --- the reference ----------------------------------------------------------------------------


def cache_after_write(
    cache: PagedKVCache,
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int; -1 = padding
) -> PagedKVCache:
    """What ``cache`` must hold after writing ``key``/``value`` to ``slot_mapping``:
    ``attnhub.reference.write_kv`` applied to a clone (``cache`` itself is not touched)."""
    expected = cache.clone()
    reference.write_kv(expected, key, value, slot_mapping)
    return expected


def reference_after_write(
    spec: AttentionSpec,
    cache: PagedKVCache,
    batch: BatchMetadata,
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_size]; None: nothing new
    value: torch.Tensor | None,
    *,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[PagedKVCache, torch.Tensor]:  # expected cache, output [num_actual_tokens, H, D] f64
    """What a ``forward`` of this step must leave in the cache and return: the reference's write
    of the new tokens to ``batch.slot_mapping``, then the float64 reference over that cache.
    Call it before ``forward`` (``cache`` itself is not touched)."""
    if key is None or value is None:
        if key is not value:
            raise ValueError("key and value must both be tensors or both None")
        expected = cache.clone()
    else:
        expected = cache_after_write(cache, key, value, batch.slot_mapping)
    out, _ = reference.paged_attention(
        query, expected, batch, spec, alibi_slopes=alibi_slopes, sinks=sinks
    )
    return expected, out


def quantized_query(
    query: torch.Tensor, capabilities: Capabilities, kv_cache_dtype: str
) -> torch.Tensor:
    """The query as a backend declaring ``capabilities`` computes with over a
    ``kv_cache_dtype`` cache: quantized and dequantized (float64) where it declares a
    ``query_quantization`` scheme for that format, else ``query`` itself. Give it to the
    reference for the "same inputs" comparison."""
    scheme = capabilities.query_quantization.get(kv_cache_dtype)
    if scheme is None:
        return query
    return simulate_query_quantization(query.detach().to("cpu"), scheme).to(query.device)


def probability_rounding(
    capabilities: Capabilities, kv_cache_dtype: str
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The map of normalized probabilities a backend declaring ``capabilities`` applies before
    ``P @ V`` over a ``kv_cache_dtype`` cache (``attnhub.quant.round_probabilities`` for its
    declared ``probability_quantization`` scheme), for ``reference.paged_attention(
    probabilities=)``; None where it declares none."""
    scheme = capabilities.probability_quantization.get(kv_cache_dtype)
    if scheme is None:
        return None
    return functools.partial(round_probabilities, scheme=scheme)


def probability_allowance(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size], as the kernels use it
    cache: PagedKVCache,
    batch: BatchMetadata,
    spec: AttentionSpec,
    scheme: str,
    *,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_actual_tokens, H, D] f64, host
    """How far rounding the probabilities by ``scheme`` can move each output element from the
    unrounded reference, whatever the kernel's tiling: ``sum_j bound(p_j) * |v_j|`` with
    ``bound = attnhub.quant.probability_error_bound``, i.e. the reference over ``|V|`` with
    the probabilities replaced by their bounds. Added to the tolerance of the same-inputs
    comparison (``mismatch(allowance=)``)."""
    out, _ = reference.paged_attention(
        query,
        _abs_values(cache),
        batch,
        spec,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        probabilities=functools.partial(probability_error_bound, scheme=scheme),
    )
    return out


def mla_probability_allowance(
    query: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank + rope], as the kernels use it
    cache: LatentKVCache,
    batch: BatchMetadata,
    spec: MLASpec,
    scheme: str,
) -> torch.Tensor:  # [num_actual_tokens, H, kv_lora_rank] f64, host
    """:func:`probability_allowance` for the absorbed MLA form: per request, the attention of
    ``query`` over the latents as stored (keys ``[kv_c ; k_pe]``) with the probabilities
    replaced by ``attnhub.quant.probability_error_bound`` and the values by ``|kv_c|``."""
    bound = functools.partial(probability_error_bound, scheme=scheme)
    qsl = batch.query_start_loc_cpu.tolist()
    outs = [torch.zeros(0, spec.num_heads, spec.kv_lora_rank, dtype=torch.float64)]
    for r in range(batch.num_reqs):
        seq_len = int(batch.seq_lens_cpu[r])
        kv_c, k_pe = reference.read_latent_sequence(cache, batch.block_table[r], seq_len)
        out, _ = reference.attention(
            query[qsl[r] : qsl[r + 1]].to("cpu"),
            torch.cat([kv_c, k_pe], dim=-1)[:, None, :],
            kv_c.abs()[:, None, :],
            scale=spec.scale,
            causal=batch.causal,
            probabilities=bound,
        )
        outs.append(out)
    return torch.cat(outs)


def _abs_values(cache: PagedKVCache) -> PagedKVCache:
    """``cache`` with every value replaced by its magnitude (a copy; keys shared)."""
    plane = cache.value
    if plane.dtype in FP8_DTYPES:  # no fp8 abs kernel on CPU: clear the sign bit
        magnitude = (plane.view(torch.uint8) & 0x7F).view(plane.dtype)
    elif plane.is_floating_point():
        magnitude = plane.abs()
    else:
        raise InvalidInputError(
            f"value plane of dtype {plane.dtype}: probability rounding bounds are defined for "
            "floating-point and fp8 values only"
        )
    scale = cache.value_scale
    return replace(cache, value=magnitude, value_scale=None if scale is None else scale.abs())


# --- comparing outputs ------------------------------------------------------------------------


def token_origin(batch: BatchMetadata, t: int) -> str:
    """Where query row ``t`` of ``batch`` comes from: its request and position."""
    qsl = batch.query_start_loc_cpu.tolist()
    for r in range(batch.num_reqs):
        if qsl[r] <= t < qsl[r + 1]:
            q = qsl[r + 1] - qsl[r]
            s = int(batch.seq_lens_cpu[r])
            i = t - qsl[r]
            return f"request {r} (query_len {q}, seq_len {s}), query {i}, position {s - q + i}"
    return "a padding row"


def mismatch(
    actual: torch.Tensor,  # e.g. a forward's output [n, H, D], any dtype and device
    expected: torch.Tensor,  # same shape, usually the float64 reference
    tol: Tolerance,
    batch: BatchMetadata | None = None,
    *,
    allowance: torch.Tensor | None = None,  # same shape, >= 0: added to what is allowed
) -> str | None:
    """None when ``|actual - expected| <= tol.atol + tol.rtol * |expected| [+ allowance]``
    everywhere and ``actual`` is finite; otherwise a sentence: how many elements fail, the
    worst one (with ``batch`` and 3-D tensors: its token's request and position, head and
    channel) and by how much, and which requests have errors."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        return f"shape {list(a.shape)}, expected {list(e.shape)}"
    err = (a - e).abs()
    allowed = tol.atol + tol.rtol * e.abs()
    if allowance is not None:
        allowed = allowed + allowance.detach().to("cpu", torch.float64)
    finite = torch.isfinite(a)
    bad = (err > allowed) | ~finite
    if not bool(bad.any()):
        return None
    score = torch.where(finite, err - allowed, math.inf).masked_fill(~bad, -math.inf)
    flat = int(torch.argmax(score))
    pos = [int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)]
    if batch is not None and a.dim() == 3:
        t, h, d = pos
        where = f"token {t} ({token_origin(batch, t)}), head {h}, channel {d}"
    else:
        where = f"index {pos}"
    got, want = float(a.flatten()[flat]), float(e.flatten()[flat])
    message = (
        f"{int(bad.sum())} of {bad.numel()} elements outside atol={tol.atol:g} + "
        f"rtol={tol.rtol:g}*|ref|{' + allowance' if allowance is not None else ''}; "
        f"worst at {where}: got {got:.6g}, expected {want:.6g} "
        f"(|diff| {abs(got - want):.3g}, allowed {float(allowed.flatten()[flat]):.3g})"
    )
    if batch is not None and a.dim() >= 1:
        rows = bad.flatten(1).any(1).nonzero()[:, 0] if a.dim() > 1 else bad.nonzero()[:, 0]
        qsl = batch.query_start_loc_cpu
        reqs = sorted({int(torch.searchsorted(qsl, r, right=True)) - 1 for r in rows.tolist()})
        reqs = [r for r in reqs if r < batch.num_reqs]  # rows past the last request: padding
        more = " ..." if len(reqs) > 12 else ""
        message += f"; requests with errors: {reqs[:12]}{more}"
    return message


#: The loosest tolerance (|out - ref| <= atol + rtol * |ref|, against the float64 reference) the
#: conformance suite accepts per model dtype: a backend may declare tighter, never looser.
TOLERANCE_CAPS: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
    torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2),
}

#: Absolute floors (max error, mean error, magnitude bias) added to the rounding bounds of
#: :func:`rounding_mismatch`, per dtype: where every value happens to be exact, rounding alone
#: errs by nothing, and a correct backend may still differ by a last bit.
ROUNDING_FLOORS: dict[torch.dtype, tuple[float, float, float]] = {
    torch.float32: (1e-5, 1e-6, 1e-6),
    torch.float16: (1e-4, 1e-5, 1e-4),
    torch.bfloat16: (1e-3, 1e-4, 1e-3),
}


def capped_tolerance(declared: Tolerance, dtype: torch.dtype) -> Tolerance | None:
    """``declared`` when it is no looser than the suite's cap for ``dtype``; None otherwise."""
    cap = TOLERANCE_CAPS.get(dtype)
    if cap is None or (declared.atol <= cap.atol and declared.rtol <= cap.rtol):
        return declared
    return None


def rounding_mismatch(
    actual: torch.Tensor,  # [n, H, D] a backend's output, in its model dtype
    exact: torch.Tensor,  # the float64 reference
    rounded: torch.Tensor,  # the reference computed in the model dtype (compute_dtype=)
    dtype: torch.dtype,
    *,
    plain: str | None = None,  # what ``rounded`` is, in words (default: a plain computation)
) -> str | None:
    """None when ``actual`` is as close to ``exact`` as rounding to ``dtype`` allows; else why.

    Three bounds, each twice what a plain implementation in ``dtype`` (``rounded``) errs by, plus
    the dtype's floor (:data:`ROUNDING_FLOORS`):
      - the largest error (flash-attn's own test criterion);
      - the mean error over every element, so that an error too small for the maximum to see,
        but everywhere, does not hide under it;
      - the magnitude bias ``sum(|actual| - |exact|) / sum(|exact|)``: rounding is unbiased,
        a wrong softmax scale, a rounded dequantization scale or a missing sink is not.
    """
    a = actual.detach().to("cpu", torch.float64)
    e = exact.detach().to("cpu", torch.float64)
    r = rounded.detach().to("cpu", torch.float64)
    if not a.numel():
        return None
    f_max, f_mean, f_bias = ROUNDING_FLOORS.get(dtype, (0.0, 0.0, 0.0))
    err, base = (a - e).abs(), (r - e).abs()
    total = float(e.abs().sum()) or 1.0

    def bias(x: torch.Tensor) -> float:
        return float((x.abs() - e.abs()).sum()) / total

    checks = (
        ("largest error", float(err.max()), float(base.max()), f_max),
        ("mean error", float(err.mean()), float(base.mean()), f_mean),
        ("magnitude bias", abs(bias(a)), abs(bias(r)), f_bias),
    )
    said = plain or f"a plain {str(dtype).removeprefix('torch.')} computation"
    for what, got, base_err, floor in checks:
        if got > 2 * base_err + floor:
            return (
                f"{what} {got:.3g} vs the float64 reference exceeds 2 x {base_err:.3g} (what "
                f"{said} errs by) + {floor:g}: more than rounding explains"
            )
    return None


def assert_within(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tol: Tolerance,
    what: str = "output",
    *,
    batch: BatchMetadata | None = None,
) -> None:
    """Raise ``AssertionError`` unless ``actual`` is within ``tol`` of ``expected`` (see
    ``mismatch``); the message starts with ``what`` and says where and by how much."""
    why = mismatch(actual, expected, tol, batch)
    if why is not None:
        raise AssertionError(f"{what}: {why}")


def accuracy(
    actual: torch.Tensor,  # [n, H, D] a backend's output
    expected: torch.Tensor,  # [n, H, D] e.g. the float64 reference over unquantized inputs
) -> tuple[float, float]:
    """``(max abs error, min cosine similarity)`` of ``actual`` against ``expected``: the
    cosine is taken per token over all its heads and channels (a token whose two outputs are
    both zero counts 1). Non-finite output gives ``(inf, -1)``."""
    a = actual.detach().to("cpu", torch.float64).reshape(actual.shape[0], -1)
    e = expected.detach().to("cpu", torch.float64).reshape(expected.shape[0], -1)
    if not a.numel():
        return 0.0, 1.0
    if not bool(torch.isfinite(a).all()):
        return math.inf, -1.0
    err = float((a - e).abs().max())
    na, ne = a.norm(dim=1), e.norm(dim=1)
    both_zero = (na == 0) & (ne == 0)
    cos = (a * e).sum(1) / (na * ne).clamp_min(torch.finfo(torch.float64).tiny)
    cos = torch.where(both_zero, torch.ones_like(cos), cos)
    return err, float(cos.min())


def accuracy_mismatch(
    actual: torch.Tensor,
    expected: torch.Tensor,
    bound: AccuracyBound,
    batch: BatchMetadata | None = None,
) -> str | None:
    """None when ``actual`` is within ``bound`` of ``expected`` (see :func:`accuracy`); else
    a sentence with the measured max abs error and min cosine, and where the worst are."""
    err, cos = accuracy(actual, expected)
    if err <= bound.max_abs_error and cos >= bound.min_cosine:
        return None
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    flat = int(torch.argmax(torch.nan_to_num((a - e).abs(), nan=math.inf)))
    t = flat // max(1, a[0].numel()) if a.dim() > 1 else flat
    where = f"token {t}" + (f" ({token_origin(batch, t)})" if batch is not None else "")
    return (
        f"max abs error {err:.4g} (declared bound {bound.max_abs_error:g}), min cosine "
        f"similarity {cos:.6f} (declared bound {bound.min_cosine:g}); largest error at {where}"
    )


# --- comparing caches -------------------------------------------------------------------------


def _slot_bytes(cache: PagedKVCache, name: str) -> torch.Tensor:  # [num_slots, bytes] uint8
    cache = cache.unpacked()
    if name in ("key", "value"):
        plane = cache.key_nhd() if name == "key" else cache.value_nhd()
    else:
        scale = cache.slot_scale_nhd(name)
        assert scale is not None
        plane = scale
    # flattened before the byte view: a [num_slots, 1] plane (one kv head, HND) is contiguous
    # with a last stride other than 1, which .view(uint8) refuses
    flat = plane.to("cpu").reshape(cache.num_slots, -1).contiguous().reshape(-1)
    return flat.view(torch.uint8).reshape(cache.num_slots, -1)


def _describe_slots(cache: PagedKVCache, slots: list[int]) -> str:
    bs = cache.block_size
    shown = ", ".join(f"{s} (block {s // bs}, offset {s % bs})" for s in slots[:6])
    more = f" and {len(slots) - 6} more" if len(slots) > 6 else ""
    hint = ""
    if cache.num_slots - 1 in slots:
        hint = " [the last slot changed: a padding slot -1 used as an index wraps to it]"
    return shown + more + hint


def _dequantized_tolerance(
    cache: PagedKVCache, which: str, want: torch.Tensor, expected: PagedKVCache
) -> torch.Tensor:
    """How far a backend's stored value may sit from the reference's: one quantization step
    (rounding may legitimately differ), per element of ``want`` [num_slots, Hkv, D]."""
    fmt = KV_CACHE_DTYPES[cache.kv_cache_dtype]
    kind = getattr(fmt, f"{which}_scale")
    plane = getattr(expected, which)
    if kind == "tensor":  # fp8: one ulp relative, plus the smallest subnormal
        fp8 = plane.dtype
        mant = 3 if fp8 == torch.float8_e4m3fn else 2
        tiny = float(torch.finfo(fp8).smallest_normal) * 2.0**-mant
        scale = abs(float(getattr(expected, f"{which}_scale").to("cpu")))  # may be negative
        return 2.0**-mant * want.abs() + scale * tiny
    # int8: one step of the (reference's) scale
    if kind == "slot":
        per_slot = expected.slot_scale_nhd(f"{which}_scale")
        assert per_slot is not None
        step = per_slot.to("cpu", torch.float64).reshape(cache.num_slots, -1)[..., None]
    else:
        step = getattr(expected, f"{which}_scale").to("cpu", torch.float64)[None]
    return 1.01 * step + 1e-3 * want.abs()


def cache_differences(
    actual: PagedKVCache, expected: PagedKVCache, written: torch.Tensor
) -> list[str]:
    """What differs between ``actual`` and ``expected`` (e.g. ``cache_after_write`` of a clone
    taken before the call), one sentence per problem; empty when they agree. ``written``: the
    slots the call had to write ([n] int, -1 entries ignored).

    Slots not written must be byte-identical. Written slots must be byte-identical for
    unquantized caches; for quantized ones, their dequantized values must agree within one
    quantization step. Engine-owned scales must not change.
    """
    problems: list[str] = []
    actual, expected = actual.unpacked(), expected.unpacked()  # packed blocks: compared logically
    fmt = KV_CACHE_DTYPES[expected.kv_cache_dtype]
    is_written = torch.zeros(actual.num_slots, dtype=torch.bool)
    w = written.to("cpu").long()
    is_written[w[w >= 0]] = True
    for name in actual.planes():
        a, e = _slot_bytes(actual, name), _slot_bytes(expected, name)
        differs = (a != e).any(dim=1)
        untouched = (differs & ~is_written).nonzero()[:, 0].tolist()
        if untouched:
            problems.append(
                f"{name} changed in slots this call must not write: "
                + _describe_slots(actual, untouched)
            )
        wrong = (differs & is_written).nonzero()[:, 0].tolist()
        if wrong and not fmt.is_quantized:
            problems.append(
                f"{name} holds other values than were written, in slots "
                + _describe_slots(actual, wrong)
            )
    for which in ("key_scale", "value_scale"):  # engine-owned static scales
        kind = getattr(fmt, which)
        if kind in ("tensor", "channel") and not torch.equal(
            getattr(actual, which).to("cpu"), getattr(expected, which).to("cpu")
        ):
            problems.append(f"the engine-owned {kind} {which} was modified")
    if fmt.is_quantized and is_written.any():
        everything = torch.arange(actual.num_blocks)
        got_k, got_v = reference.read_sequence(actual, everything, actual.num_slots)
        want_k, want_v = reference.read_sequence(expected, everything, actual.num_slots)
        for which, got, want in (("key", got_k, want_k), ("value", got_v, want_v)):
            if getattr(fmt, f"{which}_scale") == "none":
                continue
            tol = _dequantized_tolerance(actual, which, want, expected)
            bad = (((got - want).abs() > tol) | torch.isnan(got)).flatten(1).any(1) & is_written
            slots = bad.nonzero()[:, 0].tolist()
            if slots:
                s = slots[0]
                err = float((got[s] - want[s]).abs().max())
                problems.append(
                    f"dequantized {which} differs from the reference's quantization by more than "
                    f"one step in slots {_describe_slots(actual, slots)} (slot {s}: max |diff| "
                    f"{err:.4g})"
                )
    return problems


# --- the one-pass check of the usual layer call ----------------------------------------------


def call_outcome(fn: Callable[[], object]) -> tuple[str, str]:
    """``("ok", result shape)`` or ``(exception type, message)``: what a call did, to compare
    two ways of making it."""
    try:
        result = fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", "" if not isinstance(result, torch.Tensor) else str(tuple(result.shape))


def checked_in_full(impl: AttentionImpl, call: Callable[[], object]) -> object:
    """``call`` with ``AttentionImpl``'s one-pass reading of the rules switched off on this
    instance: every rule is read one by one (``Rules.explain``; ``AttentionImpl._usual_call``)."""
    impl._usual_call = lambda *args: False
    impl._usual_step = lambda *args: False
    impl._usual_write = lambda *args: False
    try:
        return call()
    finally:
        del impl._usual_call, impl._usual_step, impl._usual_write


def strided_last_dim(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a view whose last dimension has stride 2 (every other element of a
    tensor twice as wide)."""
    return torch.stack([t, t], dim=-1).flatten(-2)[..., ::2]


def bad_layer_calls(
    backend: AttentionBackend, call: dict[str, Any]
) -> dict[str, dict[str, Any]]:  # name -> forward arguments
    """A good layer call's arguments (``query, key, value, cache, meta, output``, a step of
    ``backend`` with at least 2 query heads and tokens) made wrong in one way each, by name:
    every one must be refused, with the same error whichever path checks it."""
    from attnhub.backend import AttentionMetadata  # attnhub.backend needs no testing helper

    q, k, v, cache, meta = call["query"], call["key"], call["value"], call["cache"], call["meta"]
    T, D, n = q.shape[0], q.shape[-1], meta.batch.num_actual_tokens
    spec = backend.spec
    Dv = spec.head_size_v
    out = q.new_empty(T, spec.num_heads, Dv)  # a good output buffer's shape
    narrow = replace(spec, num_heads=spec.num_heads // spec.num_kv_heads, num_kv_heads=1)
    other = type(backend)(narrow, backend.device, emulate=backend.emulated)
    return {
        "foreign meta": {**call, "meta": AttentionMetadata(batch=meta.batch)},
        "not a meta": {**call, "meta": object()},
        "meta without extents": {**call, "meta": replace(meta, extents=None)},
        "meta of another spec": {**call, "meta": other.metadata_builder().build(meta.batch)},
        "query float16": {**call, "query": q.half()},
        "query heads": {**call, "query": q[:, :1]},
        "query head size": {**call, "query": q[..., : D // 2]},
        "query 2-D": {**call, "query": q.flatten(1)},
        "query short": {**call, "query": q[: n - 1]},
        "query a list": {**call, "query": q.tolist()},
        "key without value": {**call, "value": None},
        "value without key": {**call, "key": None},
        "key heads": {**call, "key": torch.cat([k, k], dim=1)},
        "value head size": {**call, "value": v[..., : Dv // 2]},
        "key short": {**call, "key": k[: T - 1], "value": v[: T - 1]},
        "key and value rows differ": {**call, "value": torch.cat([v, v[:1]])},
        "key float16": {**call, "key": k.half()},
        "value a list": {**call, "value": v.tolist()},
        "output shape": {**call, "output": out[: T - 1]},
        "output dtype": {**call, "output": torch.empty_like(out, dtype=torch.float16)},
        "output a list": {**call, "output": []},
        "query last dimension strided": {**call, "query": strided_last_dim(q)},
        "key last dimension strided": {**call, "key": strided_last_dim(k)},
        "value last dimension strided": {**call, "value": strided_last_dim(v)},
        "output last dimension strided": {**call, "output": strided_last_dim(out)},
        "cache too small": {**call, "cache": backend.allocate_kv_cache(2)},
        "cache of another geometry": {**call, "cache": other.allocate_kv_cache(40)},
        "cache not a cache": {**call, "cache": object()},
        "cache of another dtype": {
            **call,
            "cache": replace(cache, key=cache.key.half(), value=cache.value.half()),
        },
        **(
            {  # a spec whose values are not as wide as its keys: the key's width is refused
                "value as wide as the key": {**call, "value": v.new_zeros(*v.shape[:2], D)},
                "output as wide as the query": {**call, "output": torch.empty_like(q)},
            }
            if Dv != D
            else {}
        ),
    }
