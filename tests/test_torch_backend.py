"""The built-in torch backend agrees with the float64 reference, writes exactly what it should,
and behaves like a backend must (output buffers, padding, reuse, determinism, batch invariance).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from attnhub import AttentionSpec, BatchMetadata, PagedKVCache, Tolerance, reference
from attnhub.testing import (
    alibi_slopes,
    assert_within,
    fill_cache_random,
    generator,
    make_batch,
    poison_unused_slots,
    random_qkv,
    random_sinks,
    reference_after_write,
    seed_of,
)
from attnhub.torch_backend import TorchBackend

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def tol(dtype: torch.dtype) -> Tolerance:
    return TorchBackend.capabilities.tolerance(dtype)


def _many() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """70 requests, mostly decodes, some short prefills, seq lens 1..60 (deterministic)."""
    r = random.Random(0)
    q = [1] * 56 + [r.randint(2, 6) for _ in range(14)]
    r.shuffle(q)
    return tuple(q), tuple(max(x, r.randint(1, 60)) for x in q)


# (query_lens, seq_lens) per batch mix
MIXES = {
    "decode": ((1, 1, 1, 1, 1, 1), (17, 5, 33, 1, 64, 16)),
    "prefill": ((7, 20, 3), (7, 20, 3)),
    "chunked": ((5, 24, 40), (21, 40, 95)),
    "mixed": ((1, 1, 6, 1, 12), (30, 9, 6, 50, 40)),
    "mtd": ((3, 2, 3, 4, 2, 3), (20, 15, 33, 8, 2, 3)),  # multi-token decode, ragged
    "one": ((4,), (37,)),
    "many": _many(),
    "len1": ((1, 1, 1), (1, 1, 1)),
    # runs of equal multi-token query lens with ragged seq lens: they share decode chunks
    "runs": ((2, 2, 2, 3, 3, 1, 1), (5, 19, 2, 40, 3, 7, 30)),
    # a long chunk after context (the eager path tiles queries by 256) next to a decode
    "long": ((300, 1), (333, 290)),
}


@dataclass(frozen=True)
class Case:
    mix: str
    heads: tuple[int, int] = (8, 2)  # (num_heads, num_kv_heads)
    head_size: int = 64
    block_size: int = 16
    dtype: torch.dtype = F32
    kv: str = "auto"
    attn_type: str = "decoder"
    sliding_window: int | None = None
    softcap: float | None = None
    alibi: bool = False
    sinks: bool = False
    batch_causal: bool = True

    @property
    def id(self) -> str:
        parts = [
            self.mix,
            f"gqa{self.heads[0] // self.heads[1]}",
            f"d{self.head_size}",
            f"bs{self.block_size}",
            str(self.dtype).removeprefix("torch."),
        ]
        if self.kv != "auto":
            parts.append(self.kv)
        if self.attn_type != "decoder":
            parts.append(self.attn_type)
        if self.sliding_window:
            parts.append(f"window{self.sliding_window}")
        if self.softcap:
            parts.append("softcap")
        if self.alibi:
            parts.append("alibi")
        if self.sinks:
            parts.append("sinks")
        if not self.batch_causal:
            parts.append("batch_non_causal")
        return "-".join(parts)

    def spec(self) -> AttentionSpec:
        return AttentionSpec(
            num_heads=self.heads[0],
            num_kv_heads=self.heads[1],
            head_size=self.head_size,
            dtype=self.dtype,
            block_size=self.block_size,
            kv_cache_dtype=self.kv,
            attn_type=self.attn_type,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.softcap,
            use_alibi=self.alibi,
            use_sinks=self.sinks,
        )


# Pairwise-ish: every batch mix, GQA ratio, head size, block size and dtype meet each other
# somewhere; each feature / cache format / attention type runs under several dtypes and mixes.
CASES = [
    # shapes x batch mixes
    Case("decode", (4, 4), 64, 16, F32),
    Case("decode", (16, 2), 128, 1, BF16),
    Case("decode", (8, 2), 256, 32, F16),
    Case("prefill", (8, 2), 128, 32, F16),
    Case("prefill", (4, 4), 256, 1, F32),
    Case("prefill", (16, 2), 64, 16, BF16),
    Case("chunked", (16, 2), 256, 16, BF16),
    Case("chunked", (4, 4), 128, 32, F32),
    Case("chunked", (8, 2), 64, 1, F16),
    Case("mixed", (8, 2), 64, 1, F32),
    Case("mixed", (16, 2), 128, 16, F16),
    Case("mixed", (4, 4), 256, 32, BF16),
    Case("mtd", (8, 2), 128, 16, F32),
    Case("mtd", (16, 2), 64, 32, BF16),
    Case("mtd", (4, 4), 64, 1, F16),
    Case("one", (4, 4), 64, 16, F16),
    Case("one", (16, 2), 256, 32, F32),
    Case("many", (8, 2), 64, 16, F32),
    Case("many", (16, 2), 128, 32, BF16),
    Case("len1", (8, 2), 64, 16, F32),
    Case("len1", (4, 4), 128, 1, BF16),
    # features
    Case("mixed", sliding_window=8, dtype=F32),
    Case("chunked", sliding_window=1, dtype=BF16, block_size=32),
    Case("mtd", (16, 2), sliding_window=5, dtype=F16, block_size=1),
    Case("decode", sliding_window=20, dtype=F16),
    Case("mixed", softcap=2.0, dtype=F32),
    Case("chunked", (16, 2), 128, softcap=5.0, dtype=BF16),
    Case("decode", (4, 4), softcap=1.0, dtype=F16, block_size=1),
    Case("mixed", alibi=True, dtype=F16),
    Case("prefill", (16, 2), alibi=True, dtype=F32, block_size=32),
    Case("mtd", alibi=True, dtype=BF16),
    Case("mixed", sinks=True, dtype=BF16),
    Case("decode", (16, 2), 128, sinks=True, dtype=F32),
    Case("chunked", (4, 4), sinks=True, dtype=F16, block_size=1),
    Case("mixed", sliding_window=6, softcap=3.0, alibi=True, sinks=True, dtype=F32),
    Case("many", sliding_window=16, alibi=True, sinks=True, dtype=BF16),
    # quantized caches
    Case("mixed", kv="fp8_e4m3", dtype=F16),
    Case("decode", (16, 2), 128, 32, kv="fp8_e4m3", dtype=BF16),
    Case("chunked", (4, 4), kv="fp8_e4m3", dtype=F32, block_size=1),
    Case("mtd", kv="fp8_e5m2", dtype=F32),
    Case("prefill", (16, 2), kv="fp8_e5m2", dtype=BF16, block_size=32),
    Case("mixed", kv="fp8_e4m3", sliding_window=8, sinks=True, dtype=F16),
    # non-causal attention
    Case("prefill", attn_type="encoder_only", dtype=F32),
    Case("prefill", (16, 2), 128, 1, attn_type="encoder_only", dtype=BF16, sliding_window=5),
    Case("prefill", (4, 4), attn_type="encoder", dtype=F16, block_size=32),
    Case("len1", attn_type="encoder", dtype=F32),
    Case("prefill", attn_type="encoder_only", alibi=True, softcap=4.0, dtype=F32),
    Case("chunked", attn_type="encoder_only", dtype=F16),  # non-causal over cached context
    Case("mixed", batch_causal=False, dtype=F32),
    Case("mtd", (16, 2), batch_causal=False, dtype=BF16, block_size=1),
    # shared chunks of multi-token queries
    Case("runs", (8, 2), 64, 16, F32),
    Case("runs", (16, 2), 128, 1, BF16, sliding_window=3),
    Case("runs", (4, 4), batch_causal=False, dtype=BF16),
    Case("runs", (8, 2), batch_causal=False, dtype=F32),
    Case("runs", (8, 2), batch_causal=False, sliding_window=4, dtype=F32),
    Case("runs", (16, 2), 128, attn_type="encoder_only", dtype=F16),
    Case("runs", attn_type="encoder_only", alibi=True, dtype=F32),
    # long chunks
    Case("long", (8, 2), 128, 16, BF16),
    Case("long", alibi=True, softcap=8.0, dtype=F32),
    Case("long", (4, 4), sliding_window=64, sinks=True, dtype=F16, block_size=32),
]


def per_head_weights(spec: AttentionSpec, seed: int) -> dict[str, torch.Tensor]:
    w = {}
    if spec.use_alibi:
        w["alibi_slopes"] = alibi_slopes(spec.num_heads)
    if spec.use_sinks:
        w["sinks"] = random_sinks(spec.num_heads, generator(seed))
    return w


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward_matches_reference(case: Case) -> None:
    seed = seed_of(case.id)
    spec = case.spec()
    q_lens, s_lens = MIXES[case.mix]
    batch, nblk = make_batch(q_lens, s_lens, case.block_size, seed=seed, causal=case.batch_causal)
    backend = TorchBackend(spec, "cpu")
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(seed + 1))
    q, k, v = random_qkv(
        spec, batch.num_tokens, generator(seed + 2), q_gain=3.0 if case.softcap else 1.0
    )
    weights = per_head_weights(spec, seed + 3)
    expected_cache, expected = reference_after_write(
        spec,
        cache,
        batch,
        q,
        k,
        v,
        alibi_slopes=weights.get("alibi_slopes"),
        sinks=weights.get("sinks"),
    )

    meta = backend.metadata_builder().build(batch)
    out = backend.impl(**weights).forward(q, k, v, cache, meta)

    assert out.dtype == spec.dtype and out.shape == q.shape
    assert cache.equal(expected_cache), "the cache does not hold exactly the written tokens"
    assert_within(out, expected, tol(spec.dtype), case.id)


def test_matrix_covers_the_required_axes() -> None:
    assert {c.mix for c in CASES} == set(MIXES)
    assert {c.heads[0] // c.heads[1] for c in CASES} >= {1, 4, 8}
    assert {c.head_size for c in CASES} >= {64, 128, 256}
    assert {c.block_size for c in CASES} >= {1, 16, 32}
    assert {c.dtype for c in CASES} == {F32, F16, BF16}
    assert {c.kv for c in CASES} == {"auto", "fp8_e4m3", "fp8_e5m2"}
    assert {c.attn_type for c in CASES} >= {"decoder", "encoder", "encoder_only"}
    assert len(MIXES["many"][0]) >= 64
    assert any(s % 16 for s in MIXES["mixed"][1])
    assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


# --- cross attention ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_cross_attention_reuses_encoder_kv_with_key_none(dtype: torch.dtype) -> None:
    spec = AttentionSpec(
        num_heads=8,
        num_kv_heads=2,
        head_size=64,
        dtype=dtype,
        block_size=16,
        attn_type="encoder_decoder",
    )
    enc_lens = (7, 30, 16)
    backend = TorchBackend(spec, "cpu")
    impl = backend.impl()
    enc_batch, nblk = make_batch(enc_lens, enc_lens, 16, seed=21)
    cache = backend.allocate_kv_cache(nblk)
    _, k_enc, v_enc = random_qkv(spec, enc_batch.num_tokens, generator(22))
    impl.write_kv(k_enc, v_enc, cache, enc_batch.slot_mapping)  # once, from the encoder output
    builder = backend.metadata_builder()
    for step, dec_lens in enumerate([(3, 1, 5), (1, 1, 1)]):
        # decoder queries attend over all encoder keys; nothing new is written
        batch = BatchMetadata.from_lengths(dec_lens, enc_lens, enc_batch.block_table, 16)
        q, _, _ = random_qkv(spec, batch.num_tokens, generator(23 + step))
        before = cache.clone()
        out = impl.forward(q, None, None, cache, builder.build(batch))
        assert cache.equal(before)
        expected, _ = reference.paged_attention(q, cache, batch, spec)
        assert_within(out, expected, tol(dtype), f"cross attention step {step}")


def test_cross_attention_with_equal_multi_token_queries_over_ragged_encoders() -> None:
    spec = AttentionSpec(
        num_heads=8, num_kv_heads=2, head_size=64, dtype=F32, attn_type="encoder_decoder"
    )
    enc_lens = (7, 30)
    backend = TorchBackend(spec, "cpu")
    enc_batch, nblk = make_batch(enc_lens, enc_lens, 16, seed=24)
    cache = backend.allocate_kv_cache(nblk)
    _, k_enc, v_enc = random_qkv(spec, enc_batch.num_tokens, generator(25))
    backend.impl().write_kv(k_enc, v_enc, cache, enc_batch.slot_mapping)
    batch = BatchMetadata.from_lengths((2, 2), enc_lens, enc_batch.block_table, 16)
    q, _, _ = random_qkv(spec, batch.num_tokens, generator(26))
    out = backend.impl().forward(q, None, None, cache, backend.metadata_builder().build(batch))
    expected, _ = reference.paged_attention(q, cache, batch, spec)
    assert_within(out, expected, tol(F32), "cross attention, 2 queries per request")


# --- the KV write ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_write_kv_puts_exactly_the_written_tokens_in_their_slots(kv: str) -> None:
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_size=32, dtype=BF16, block_size=4, kv_cache_dtype=kv
    )
    backend = TorchBackend(spec, "cpu")
    cache = backend.allocate_kv_cache(12)
    fill_cache_random(cache, generator(31))
    _, k, v = random_qkv(spec, 7, generator(32))
    slots = torch.tensor([5, -1, 17, 0, -1, 46, 9])  # padding anywhere, not only at the end
    expected = cache.clone()
    reference.write_kv(expected, k, v, slots)
    backend.impl().write_kv(k, v, cache, slots)
    assert cache.equal(expected)


def test_write_kv_changes_nothing_but_the_written_slots() -> None:
    spec = AttentionSpec(num_heads=2, num_kv_heads=2, head_size=8, dtype=F32, block_size=4)
    backend = TorchBackend(spec, "cpu")
    cache = backend.allocate_kv_cache(4)
    cache.key.fill_(7.0)
    cache.value.fill_(7.0)
    _, k, v = random_qkv(spec, 2, generator(33))
    backend.impl().write_kv(k, v, cache, torch.tensor([6, -1], dtype=torch.int32))
    flat_k, flat_v = cache.key.reshape(16, 2, 8), cache.value.reshape(16, 2, 8)
    assert torch.equal(flat_k[6], k[0]) and torch.equal(flat_v[6], v[0])
    others = [s for s in range(16) if s != 6]
    assert (flat_k[others] == 7).all() and (flat_v[others] == 7).all()


def test_write_kv_with_fewer_slots_than_tokens_writes_the_first_ones() -> None:
    spec = AttentionSpec(num_heads=2, num_kv_heads=2, head_size=8, dtype=F32, block_size=4)
    backend = TorchBackend(spec, "cpu")
    cache = backend.allocate_kv_cache(4)
    _, k, v = random_qkv(spec, 5, generator(34))
    expected = cache.clone()
    reference.write_kv(expected, k, v, torch.tensor([3, 2]))
    backend.impl().write_kv(k, v, cache, torch.tensor([3, 2]))
    assert cache.equal(expected)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_scales_the_engine_attaches_after_a_step_are_the_ones_written_with(kv: str) -> None:
    """The engine owns an fp8 cache's scales and may attach its own tensors to the cache
    (``cache.key_scale = ...``) after the layer has run a step (a profiling run, a recalibration):
    the next write quantizes with the scales the cache holds then, as the read dequantizes
    with them. (The impl's remembered write targets kept the first scales: every later value
    was stored under the old scale, read under the new, with no error.)"""
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_size=16, dtype=F32, block_size=4, kv_cache_dtype=kv
    )
    backend = TorchBackend(spec, "cpu")
    impl = backend.impl()
    batch, nblk = make_batch([3, 1], [5, 2], 4, seed=161)
    cache = backend.allocate_kv_cache(nblk)
    q, k, v = random_qkv(spec, batch.num_tokens, generator(162))
    meta = backend.metadata_builder().build(batch)
    impl.forward(q, k, v, cache, meta)  # a first step, with the scales allocated (1.0)
    cache.key_scale, cache.value_scale = torch.tensor(0.05), torch.tensor(0.04)
    expected_cache, expected = reference_after_write(spec, cache, batch, q, k, v)
    out = impl.forward(q, k, v, cache, meta)
    assert cache.equal(expected_cache)
    assert_within(out, expected, tol(F32), "fp8 scales attached after a step")
    again = cache.clone()  # write_kv alone, by its own slots, and by the step's
    cache.key_scale, cache.value_scale = torch.tensor(0.03), torch.tensor(0.02)
    for write in (lambda: impl.write_kv(k, v, cache, batch.slot_mapping),
                  lambda: impl.write_kv(k, v, cache, meta=meta)):  # fmt: skip
        want = cache.clone()
        reference.write_kv(want, k, v, batch.slot_mapping)
        write()
        assert cache.equal(want) and not cache.equal(again)


Tensor = torch.Tensor
Setup = tuple[AttentionSpec, BatchMetadata, TorchBackend, PagedKVCache, Tensor, Tensor, Tensor]


def padded_setup(dtype: torch.dtype = F32, kv: str = "auto") -> Setup:
    spec = AttentionSpec(
        num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype, block_size=16, kv_cache_dtype=kv
    )
    batch, nblk = make_batch((1, 5, 1), (20, 9, 33), 16, seed=41, num_tokens=12)
    backend = TorchBackend(spec, "cpu")
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(42))
    q, k, v = random_qkv(spec, 12, generator(43))
    return spec, batch, backend, cache, q, k, v


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_forward_skips_padding_slots(kv: str) -> None:
    spec, batch, backend, cache, q, k, v = padded_setup(kv=kv)
    assert batch.slot_mapping[batch.num_actual_tokens :].eq(-1).all()
    expected_cache, _ = reference_after_write(spec, cache, batch, q, k, v)
    backend.impl().forward(q, k, v, cache, backend.metadata_builder().build(batch))
    assert cache.equal(expected_cache)


def test_rows_past_num_actual_tokens_are_zero() -> None:
    spec, batch, backend, cache, q, k, v = padded_setup()
    out = backend.impl().forward(q, k, v, cache, backend.metadata_builder().build(batch))
    n = batch.num_actual_tokens
    assert out.shape == (12, 8, 64)
    assert (out[n:] == 0).all()
    _, expected = reference_after_write(spec, cache.clone(), batch, q, k, v)
    # the cache now already holds this step's keys: the reference reads the same thing
    assert_within(out[:n], expected, tol(F32), "padded batch")


def test_output_buffer_is_written_and_returned() -> None:
    spec, batch, backend, cache, q, k, v = padded_setup(dtype=F16)
    ref_cache = cache.clone()
    buf = torch.full_like(q, float("nan"))
    out = backend.impl().forward(
        q, k, v, cache, backend.metadata_builder().build(batch), output=buf
    )
    assert out is buf
    n = batch.num_actual_tokens
    assert (buf[n:] == 0).all()
    _, expected = reference_after_write(spec, ref_cache, batch, q, k, v)
    assert_within(buf[:n], expected, tol(F16), "output buffer")


def test_forward_returns_a_fresh_tensor_in_spec_dtype_without_output() -> None:
    _, batch, backend, cache, q, k, v = padded_setup(dtype=BF16)
    out = backend.impl().forward(q, k, v, cache, backend.metadata_builder().build(batch))
    assert out.dtype == BF16
    assert out.data_ptr() not in (q.data_ptr(), k.data_ptr(), v.data_ptr())


# --- reuse, determinism, invariance ----------------------------------------------------------


def test_metadata_built_once_serves_every_layer() -> None:
    spec = AttentionSpec(
        num_heads=8,
        num_kv_heads=2,
        head_size=64,
        dtype=F32,
        block_size=16,
        sliding_window=12,
        use_sinks=True,
    )
    q_lens, s_lens = MIXES["mixed"]
    batch, nblk = make_batch(q_lens, s_lens, 16, seed=51)
    backend = TorchBackend(spec, "cpu")
    builder = backend.metadata_builder()
    layers = []
    for layer in range(3):
        cache = backend.allocate_kv_cache(nblk)
        fill_cache_random(cache, generator(60 + layer))
        sinks = random_sinks(8, generator(70 + layer))
        layers.append((cache, sinks, *random_qkv(spec, batch.num_tokens, generator(80 + layer))))

    shared = builder.build(batch)
    once = []
    for cache, sinks, q, k, v in layers:
        once.append(backend.impl(sinks=sinks).forward(q, k, v, cache.clone(), shared))
    for (cache, sinks, q, k, v), got in zip(layers, once, strict=True):
        fresh_meta = backend.metadata_builder().build(batch)
        per_layer = backend.impl(sinks=sinks).forward(q, k, v, cache.clone(), fresh_meta)
        assert torch.equal(got, per_layer)


@pytest.mark.parametrize(
    "features", [{}, {"use_alibi": True, "logits_soft_cap": 3.0}], ids=["sdpa", "eager"]
)
def test_forward_is_deterministic(features: dict) -> None:
    spec = AttentionSpec(
        num_heads=8, num_kv_heads=2, head_size=64, dtype=BF16, block_size=16, **features
    )
    batch, nblk = make_batch(*MIXES["mixed"], 16, seed=91)
    backend = TorchBackend(spec, "cpu")
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(92))
    q, k, v = random_qkv(spec, batch.num_tokens, generator(93))
    weights = per_head_weights(spec, 94)
    outs, caches = [], []
    for _ in range(2):
        c = cache.clone()
        meta = backend.metadata_builder().build(batch)
        outs.append(backend.impl(**weights).forward(q, k, v, c, meta))
        caches.append(c)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert caches[0].equal(caches[1])


@pytest.mark.parametrize(
    ("target_q", "target_s"), [(1, 40), (7, 30), (3, 12)], ids=["decode", "prefill", "mtd"]
)
def test_request_output_is_batch_invariant(target_q: int, target_s: int) -> None:
    """A request computes the same alone as inside a bigger batch (other requests around it)."""
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, dtype=BF16, block_size=16)
    backend = TorchBackend(spec, "cpu")
    q_lens = (1, 1, target_q, 1, 4, target_q)
    s_lens = (9, 70, target_s, 3, 20, 25)
    big, nblk = make_batch(q_lens, s_lens, 16, seed=101)
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(102))
    q, k, v = random_qkv(spec, big.num_tokens, generator(103))
    rows = slice(int(big.query_start_loc_cpu[2]), int(big.query_start_loc_cpu[3]))

    out_big = backend.impl().forward(q, k, v, cache.clone(), backend.metadata_builder().build(big))
    alone = BatchMetadata.from_lengths([target_q], [target_s], big.block_table[2:3], 16)
    out_alone = backend.impl().forward(
        q[rows], k[rows], v[rows], cache.clone(), backend.metadata_builder().build(alone)
    )
    assert_within(out_big[rows], out_alone.double(), tol(BF16), "alone vs in a batch")


# --- robustness to what a cache holds outside the batch's sequences ---------------------------


@pytest.mark.parametrize(
    "mix",
    [
        "decode",
        "mtd",
        "mixed",
        "many",
        "runs",
    ],
)
def test_stale_nan_outside_the_sequences_does_not_leak(mix: str) -> None:
    """Slots no sequence covers (block 0 that padded table entries point at, the tail of a
    partly used block, freed blocks) may hold anything, even NaN (fp8 garbage bytes, a cache
    allocated with torch.empty); a backend must not let them reach the output."""
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, dtype=F32, block_size=16)
    batch, nblk = make_batch(*MIXES[mix], 16, seed=111)
    backend = TorchBackend(spec, "cpu")
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(112))
    poison_unused_slots(cache, batch)
    q, k, v = random_qkv(spec, batch.num_tokens, generator(113))
    _, expected = reference_after_write(spec, cache, batch, q, k, v)
    out = backend.impl().forward(q, k, v, cache, backend.metadata_builder().build(batch))
    assert_within(out, expected, tol(F32), "with NaN in unused slots")


@pytest.mark.parametrize("mix", ["decode", "mixed", "runs"])
def test_block_table_entries_past_a_sequence_are_ignored(mix: str) -> None:
    """Only the first ceil(seq_len / block_size) entries of a row are read (validation checks
    only those); the rest may be stale ids, e.g. -1 from an engine's padded table."""
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, dtype=F32, block_size=16)
    batch, nblk = make_batch(*MIXES[mix], 16, seed=121, pad_value=-1)
    assert (batch.block_table == -1).any()
    backend = TorchBackend(spec, "cpu")
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(122))
    q, k, v = random_qkv(spec, batch.num_tokens, generator(123))
    _, expected = reference_after_write(spec, cache, batch, q, k, v)
    out = backend.impl().forward(q, k, v, cache, backend.metadata_builder().build(batch))
    assert_within(out, expected, tol(F32), "with -1 past each sequence's blocks")


def test_batch_with_no_requests_gives_zero_padding_rows() -> None:
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype=F32, block_size=16)
    backend = TorchBackend(spec, "cpu")
    cache = backend.allocate_kv_cache(2)
    before = cache.clone()
    batch = BatchMetadata.from_lengths([], [], [], 16, num_tokens=4)
    q, k, v = random_qkv(spec, 4, generator(131))
    out = backend.impl().forward(q, k, v, cache, backend.metadata_builder().build(batch))
    assert (out == 0).all()
    assert cache.equal(before)


def test_non_contiguous_query_is_accepted() -> None:
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, dtype=F32, block_size=16)
    batch, nblk = make_batch(*MIXES["mixed"], 16, seed=141)
    backend = TorchBackend(spec, "cpu")
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(142))
    _, k, v = random_qkv(spec, batch.num_tokens, generator(143))
    qkv = torch.randn(batch.num_tokens, 8, 3 * 64, generator=generator(144))
    q = qkv[..., :64]  # a view into a fused projection, as engines pass it
    _, expected = reference_after_write(spec, cache, batch, q, k, v)
    out = backend.impl().forward(q, k, v, cache, backend.metadata_builder().build(batch))
    assert_within(out, expected, tol(F32), "non-contiguous query")


# --- random batches and features ---------------------------------------------------------------


@st.composite
def random_setups(draw: st.DrawFn) -> dict:
    n = draw(st.integers(1, 9))
    # query lens from a small set, so runs of equal lengths (shared decode chunks) are common
    q = draw(st.lists(st.sampled_from([1, 1, 1, 2, 3, 17]), min_size=n, max_size=n))
    ctx = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    return {
        "query_lens": q,
        "seq_lens": [a + b for a, b in zip(q, ctx, strict=True)],
        "heads": draw(st.sampled_from([(4, 4), (4, 1), (8, 2)])),
        "head_size": draw(st.sampled_from([16, 32])),
        "block_size": draw(st.sampled_from([1, 4, 16])),
        "dtype": draw(st.sampled_from([F32, BF16])),
        "kv": draw(st.sampled_from(["auto", "auto", "fp8_e4m3"])),
        "attn_type": draw(st.sampled_from(["decoder", "decoder", "encoder_only"])),
        "sliding_window": draw(st.one_of(st.none(), st.integers(1, 24))),
        "softcap": draw(st.sampled_from([None, None, 2.5])),
        "alibi": draw(st.booleans()),
        "sinks": draw(st.booleans()),
        "batch_causal": draw(st.sampled_from([True, True, False])),
        "seed": draw(st.integers(0, 2**16)),
        # small budgets cut decode runs into several chunks (the batched planning of ragged
        # decode chunks), as large batches are cut in an engine
        "budget": draw(st.sampled_from([4 << 20, 1, 3000, 20000])),
    }


@settings(max_examples=30, deadline=None)
@given(random_setups())
def test_forward_matches_reference_on_random_batches(setup: dict) -> None:
    s = dict(setup)
    q_lens, s_lens, seed = s.pop("query_lens"), s.pop("seq_lens"), s.pop("seed")
    budget = s.pop("budget")
    case = Case("random", **s)
    spec = case.spec()
    batch, nblk = make_batch(q_lens, s_lens, case.block_size, seed=seed, causal=case.batch_causal)
    backend = TorchBackend(spec, "cpu")
    backend.gather_budget_bytes = budget
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(seed + 1))
    poison_unused_slots(cache, batch)  # what a padded row would let through: NaN
    q, k, v = random_qkv(spec, batch.num_tokens, generator(seed + 2))
    weights = per_head_weights(spec, seed + 3)
    expected_cache, expected = reference_after_write(
        spec,
        cache,
        batch,
        q,
        k,
        v,
        alibi_slopes=weights.get("alibi_slopes"),
        sinks=weights.get("sinks"),
    )
    out = backend.impl(**weights).forward(q, k, v, cache, backend.metadata_builder().build(batch))
    assert cache.equal(expected_cache)
    assert_within(out, expected, tol(spec.dtype), f"{case.id} {q_lens=} {s_lens=}")


# --- planning: chunks --------------------------------------------------------------------------


def _greedy_spans(qlens: list[int], seqs: list[int], decode_len: int, budget: int) -> list:
    """The chunking rule written plainly, request by request: (first, end, longest)."""
    spans, r = [], 0
    while r < len(qlens):
        end = r + 1
        if qlens[r] <= decode_len:
            longest = seqs[r]
            while end < len(qlens) and qlens[end] == qlens[r]:
                longest = max(longest, seqs[end])
                if (end - r + 1) * longest > budget:
                    break
                end += 1
        spans.append((r, end, max(seqs[r:end])))
        r = end
    return spans


@settings(max_examples=200, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(st.sampled_from([1, 1, 1, 2, 3, 40]), st.integers(1, 300)),
        min_size=1,
        max_size=40,
    ),
    budget=st.integers(1, 2000),
)
def test_chunk_spans_follow_the_greedy_rule(reqs: list[tuple[int, int]], budget: int) -> None:
    import numpy as np

    from attnhub.torch_backend.plan import chunk_spans

    qlens = [q for q, _ in reqs]
    seqs = [max(q, s) for q, s in reqs]
    extremes = (min(qlens), max(qlens), max(seqs))
    got = chunk_spans(np.array(qlens), seqs, 16, budget, extremes)
    assert got == _greedy_spans(qlens, seqs, 16, budget)


def _planner(spec: AttentionSpec, budget: int = 1000) -> Any:
    from attnhub.torch_backend.plan import Planner

    eager = bool({"softcap", "alibi", "sinks"} & spec.features())
    return Planner(
        spec, decode_threshold=16, gather_budget_tokens=budget, eager=eager,
        device=torch.device("cpu"),
    )  # fmt: skip


@settings(max_examples=100, deadline=None)
@given(
    # a cached context (none: SDPA's own is_causal, no mask) and a query of 2 tokens or more
    steps=st.lists(st.tuples(st.integers(1, 300), st.integers(2, 300)), min_size=1, max_size=6),
    block_size=st.sampled_from([1, 16]),
)
def test_staircase_masks_equal_the_masks_compared_from_positions(
    steps: list[tuple[int, int]], block_size: int
) -> None:
    """A chunked prefill's mask (one request, causal, no window) is read off one staircase
    array (the fast path) instead of compared from positions (the planner's plain path): the
    same mask, for any context and query length; masks made earlier stay right when a longer
    one grows the array."""
    import numpy as np

    planner = _planner(Case("plan", block_size=block_size).spec())
    made = []
    for context, Q in steps:
        batch, _ = make_batch([Q], [context + Q], block_size, seed=context)
        facts = planner.facts(batch, None)
        (shape,), _ = planner.shapes(facts)
        assert planner.staircase(facts, shape)
        got, _ = planner._pattern(facts, shape, None)
        want, _ = planner._positions(facts, shape)
        made.append((got, want))
    for got, want in made:
        assert got.shape == want.shape
        assert np.array_equal(got, want)


@pytest.mark.parametrize("mix", ["decode", "mixed", "chunked", "mtd"])
def test_sdpa_outputs_laid_out_heads_last_as_cuda_returns_them_are_read_right(
    mix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SDPA's CUDA kernels (flash, memory-efficient) return the output [B, H, L, D] laid out
    [B, L, H, D]; the CPU's return it dense. A decode chunk's output [C, Hkv, group, Dv] was
    read through ``view(C, H, Dv)``, which such a layout cannot give: every GQA decode step on
    CUDA raised RuntimeError after its KV write (found on an H100 by a differential fuzz). Here
    SDPA returns the same values in that layout."""
    import attnhub.torch_backend.kernels as kernels

    sdpa = kernels.F.scaled_dot_product_attention

    def heads_last(*args: Any, **kwargs: Any) -> torch.Tensor:
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", heads_last)
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=32, dtype=F32, block_size=16)
    batch, nblk = make_batch(*MIXES[mix], 16, seed=171)
    backend = TorchBackend(spec, "cpu")
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(172))
    q, k, v = random_qkv(spec, batch.num_tokens, generator(173))
    expected_cache, expected = reference_after_write(spec, cache, batch, q, k, v)
    out = backend.impl().forward(q, k, v, cache, backend.metadata_builder().build(batch))
    assert cache.equal(expected_cache)
    assert_within(out, expected, tol(F32), f"{mix}: SDPA output laid out heads last")


@pytest.mark.parametrize("extras", [{}, {"use_sinks": True}])
def test_one_token_query_under_a_non_causal_window_of_no_right_keys(extras: dict) -> None:
    """A non-causal layer's window (-1, 0) (every key up to the query's position) makes a
    one-request chunk's mask read off the staircase, a one-token query too: its mask is a
    valid tensor (a staircase view's negative stride on the query axis of one reached
    ``torch.from_numpy``, which raised ValueError: found by a differential fuzz)."""
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_size=32, dtype=F32, block_size=4,
        attn_type="encoder_only", window=(-1, 0), **extras,
    )  # fmt: skip
    batch, nblk = make_batch([1, 3, 1], [1, 9, 6], 4, seed=151)
    backend = TorchBackend(spec, "cpu")
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(152))
    poison_unused_slots(cache, batch)
    q, k, v = random_qkv(spec, batch.num_tokens, generator(153))
    weights = per_head_weights(spec, 154)
    expected_cache, expected = reference_after_write(spec, cache, batch, q, k, v, **weights)
    out = backend.impl(**weights).forward(q, k, v, cache, backend.metadata_builder().build(batch))
    assert cache.equal(expected_cache)
    assert_within(out, expected, tol(F32), "window (-1, 0), non-causal, one-token queries")


def _same_chunks(got: tuple, want: tuple) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for name in g._fields:
            a, b = getattr(g, name), getattr(w, name)
            if isinstance(b, torch.Tensor):
                assert isinstance(a, torch.Tensor), (i, name)
                assert (a.shape, a.dtype) == (b.shape, b.dtype), (i, name)
                assert torch.equal(a, b), (i, name)
            else:
                assert a == b, (i, name, a, b)


def _planned_one_by_one(planner: Any, batch: BatchMetadata, step: Any) -> Any:
    """The step's plan with every chunk planned on its own by the planner's plain path
    (``Planner.chunks``), none by the batched ragged-decode pass."""
    from attnhub.torch_backend.plan import StepPlan

    facts = planner.facts(batch, step)
    shapes, max_gather = planner.shapes(facts)
    plan = planner.plan(batch, step)
    chunks = tuple(planner.chunks(facts, shapes))
    return StepPlan(chunks=chunks, max_gather_blocks=max_gather, write=plan.write)


def _assert_forward_equal(backend: TorchBackend, spec: AttentionSpec, batch: BatchMetadata,
                          nblk: int, meta: Any, want: Any) -> None:  # fmt: skip
    """forward with the planned metadata and with ``want`` as its plan: bitwise equal."""
    import copy

    alone = copy.copy(meta)
    object.__setattr__(alone, "plan", want)
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(7))
    poison_unused_slots(cache, batch)  # padding rows let through would give NaN
    q, k, v = random_qkv(spec, batch.num_tokens, generator(8))
    impl = backend.impl(**per_head_weights(spec, 9))
    got, expected = impl.forward(q, k, v, cache, meta), impl.forward(q, k, v, cache, alone)
    assert torch.equal(got, expected)
    assert not got.isnan().any()


@settings(max_examples=150, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(st.sampled_from([1, 1, 1, 1, 2, 40]), st.integers(0, 90)),
        min_size=1,
        max_size=40,
    ),
    budget=st.sampled_from([1, 50, 200, 700, 100000]),
    block_size=st.sampled_from([1, 4, 16]),
    features=st.sampled_from([{}, {"softcap": 2.5}, {"sliding_window": 20}, {"alibi": True}]),
    dtype=st.sampled_from([F32, F16, BF16]),
    batch_causal=st.booleans(),
    spread=st.booleans(),
)
# an engine's decode step: ragged lengths in one block range (every chunk as wide), cut into
# several ragged chunks; and the same with a prefill between two runs of decodes
@example(
    reqs=[(1, 32 + (7 * i) % 16) for i in range(20)],
    budget=200,
    block_size=16,
    features={},
    dtype=BF16,
    batch_causal=True,
    spread=False,
)
@example(
    reqs=[(1, 32 + (7 * i) % 16) for i in range(9)]
    + [(40, 10)]
    + [(1, 32 + (5 * i) % 16) for i in range(11)],
    budget=200,
    block_size=16,
    features={"softcap": 2.5},
    dtype=F16,
    batch_causal=True,
    spread=True,
)
def test_batched_planning_of_ragged_decodes_equals_planning_each_chunk(
    reqs: list[tuple[int, int]],
    budget: int,
    block_size: int,
    features: dict,
    dtype: torch.dtype,
    batch_causal: bool,
    spread: bool,
) -> None:
    """The planner plans every ragged decode chunk of a step at once (``ragged_decodes``);
    its plain per-chunk planning of each is the specification: same chunks, ids, padding
    rows, masks, with the step's checked facts and without them (structural checks)."""

    q_lens = [q for q, _ in reqs]
    s_lens = [q + c for q, c in reqs]
    _, batch, _, backend, planner = _planning_case(
        q_lens, s_lens, budget, block_size, features, dtype, batch_causal, spread, seed=len(reqs)
    )
    builder = backend.metadata_builder()
    facts = builder.check_step(batch).facts  # what the step's checks read
    for step in (facts, None):
        got = planner.plan(batch, step)
        want = _planned_one_by_one(planner, batch, step)
        _same_chunks(got.chunks, want.chunks)
        assert got.max_gather_blocks == want.max_gather_blocks


def _planning_case(
    q_lens: list[int],
    s_lens: list[int],
    budget: int,
    block_size: int,
    features: dict,
    dtype: torch.dtype,
    batch_causal: bool,
    spread: bool,
    seed: int,
) -> tuple[AttentionSpec, BatchMetadata, int, TorchBackend, Any]:
    """A step, its backend and a planner with the given gather budget (tokens). ``spread``: a
    table wider than needed (-1 past each row's blocks)."""
    spec = Case("plan", dtype=dtype, block_size=block_size, **features).spec()
    batch, nblk = make_batch(q_lens, s_lens, block_size, seed=seed, causal=batch_causal)
    if spread:
        wide = torch.full((batch.num_reqs, batch.block_table.shape[1] + 3), -1, dtype=torch.int32)
        wide[:, : batch.block_table.shape[1]] = batch.block_table
        batch = dataclasses.replace(batch, block_table=wide, block_table_cpu=None)
    return spec, batch, nblk, TorchBackend(spec, "cpu"), _planner(spec, budget)


@settings(max_examples=100, deadline=None)
@given(
    # runs of requests of one length: some chunks ragged, some not; lengths over several
    # block counts, so that chunks gather different numbers of blocks
    runs=st.lists(st.tuples(st.integers(1, 90), st.integers(1, 6)), min_size=1, max_size=20),
    budget=st.sampled_from([1, 50, 200, 700, 100000]),
    block_size=st.sampled_from([1, 4, 16]),
    features=st.sampled_from([{}, {"softcap": 2.5}, {"sinks": True}]),
    dtype=st.sampled_from([F32, F16, BF16]),
    batch_causal=st.booleans(),
    spread=st.booleans(),
)
# the host-overhead bench's steps (docs/performance.md): ragged lengths of one block count
@example(
    runs=[(300 - (17 * r) % 41, 1) for r in range(40)],
    budget=2000,
    block_size=128,
    features={},
    dtype=BF16,
    batch_causal=True,
    spread=False,
)
# the shortest request ends where a block ends: its last column is another request's block
@example(
    runs=[(32, 1), (33, 2)],
    budget=100000,
    block_size=16,
    features={},
    dtype=F32,
    batch_causal=True,
    spread=True,
)
def test_decode_steps_planned_as_each_chunk_alone_and_forward_bitwise_equal(
    runs: list[tuple[int, int]],
    budget: int,
    block_size: int,
    features: dict,
    dtype: torch.dtype,
    batch_causal: bool,
    spread: bool,
) -> None:
    """A step of one-token decodes (the usual step, planned by the fast path
    ``Planner.decodes``: plain chunks of equal lengths, ragged ones planned all at once)
    through ``build``: the chunks each chunk's plain planning
    gives, and ``forward`` with either plan gives bitwise-equal outputs."""
    s_lens = [s for s, k in runs for _ in range(k)]
    q_lens = [1] * len(s_lens)
    spec, batch, nblk, backend, planner = _planning_case(
        q_lens, s_lens, budget, block_size, features, dtype, batch_causal, spread, len(s_lens)
    )
    builder = backend.metadata_builder()
    builder._planner = planner
    meta = builder.build(batch)
    facts = builder.check_step(batch).facts
    want = _planned_one_by_one(planner, batch, facts)
    _same_chunks(meta.plan.chunks, want.chunks)
    assert meta.plan.max_gather_blocks == want.max_gather_blocks
    for step in (facts, None):
        _same_chunks(planner.plan(batch, step).chunks, want.chunks)
    _assert_forward_equal(backend, spec, batch, nblk, meta, want)


@pytest.mark.parametrize(
    "features", [{}, {"softcap": 2.5}, {"sliding_window": 20}, {"alibi": True}]
)
def test_a_plan_for_another_device_has_every_array_there(features: dict) -> None:
    """Planned for an accelerator, each chunk's arrays are made on the host and sent there
    (one transfer per kind of array, views of it per chunk): the same records as the CPU
    plan, every tensor on the device. The ``meta`` device stands in for an accelerator
    (shapes and dtypes, no data), so the path runs on any machine."""
    from attnhub.torch_backend.plan import Planner

    spec = Case("plan", block_size=4, **features).spec()
    batch, _ = make_batch([1, 1, 1, 5, 40, 1, 1], [9, 20, 30, 10, 60, 3, 7], 4, seed=1)
    eager = bool({"softcap", "alibi", "sinks"} & spec.features())
    kw: dict[str, Any] = dict(decode_threshold=16, gather_budget_tokens=60, eager=eager)
    on_cpu = Planner(spec, device=torch.device("cpu"), **kw).plan(batch)
    on_meta = Planner(spec, device=torch.device("meta"), **kw).plan(batch)
    assert len(on_cpu.chunks) == len(on_meta.chunks) > 2
    for c, m in zip(on_cpu.chunks, on_meta.chunks, strict=True):
        for name in c._fields:
            a, b = getattr(c, name), getattr(m, name)
            if isinstance(a, torch.Tensor):
                assert isinstance(b, torch.Tensor) and b.device.type == "meta", name
                assert (a.shape, a.dtype) == (b.shape, b.dtype), name
            else:
                assert a == b, (name, a, b)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_decode_chunk_masks_planned_for_an_accelerator_start_16_byte_aligned(
    dtype: torch.dtype,
) -> None:
    """The ragged decode chunks' additive SDPA masks are made in one array and sent to the
    device at once; each chunk's mask, a view of it, goes to SDPA as it is. Its CUDA kernels
    read a mask with 16-byte loads from its first element: a view starting elsewhere failed
    (cuDNN: ``mha_graph.execute ... is_good()``; memory-efficient: misaligned address, which
    poisons the CUDA context), found on an H100 by a differential fuzz. The ``meta`` device
    stands in for the accelerator."""
    from attnhub.torch_backend.plan import Planner

    spec = Case("plan", block_size=4, dtype=dtype).spec()
    # three runs of decodes of ragged lengths (the prefills between them split the runs),
    # cut further by the budget: several chunks whose masks are views of one array
    q_lens = [1, 1, 1, 3, 1, 1, 1, 1, 3, 1, 1]
    s_lens = [83, 25, 47, 12, 37, 38, 75, 31, 9, 13, 5]
    batch, _ = make_batch(q_lens, s_lens, 4, seed=3)
    planner = Planner(
        spec, decode_threshold=16, gather_budget_tokens=150, eager=False,
        device=torch.device("meta"),
    )  # fmt: skip
    chunks = planner.plan(batch).chunks
    masks = [c.mask for c in chunks if c.query_len == 1 and c.mask is not None]
    assert len(masks) > 3
    for m in masks:
        assert m.dtype == dtype and m.device.type == "meta"
        assert m.storage_offset() * m.element_size() % 16 == 0, (m.shape, m.storage_offset())


def test_structural_checks_plan_the_same_gather_as_full_checks() -> None:
    """Under structural checks the step's lengths are not read by the checks: the plan reads
    them itself, and must not take the unread extents' defaults for the shortest context (a
    sliding window then gathered every block of the sequence instead of the window's)."""
    spec = AttentionSpec(
        num_heads=2,
        num_kv_heads=1,
        head_size=16,
        dtype=torch.float32,
        block_size=4,
        sliding_window=8,
    )
    backend = TorchBackend(spec, "cpu")
    batch = BatchMetadata.from_lengths(
        query_lens=[2, 2],
        seq_lens=[100, 100],
        block_table=[list(range(25)), list(range(25, 50))],
        block_size=4,
    )
    full = backend.metadata_builder().build(batch)
    structural_builder = backend.metadata_builder()
    structural_builder.checks = "structural"
    structural = structural_builder.build(batch)
    assert full.plan is not None and structural.plan is not None
    assert structural.plan.max_gather_blocks == full.plan.max_gather_blocks


# --- the LSE (forward(..., return_lse=True)) --------------------------------------------------


def lse_tolerance(dtype: torch.dtype) -> Tolerance:
    """The LSE is a float32 sum over float32 scores of the model-dtype inputs: its error is
    that of the output's softmax denominator, within the dtype's declared tolerance."""
    return tol(dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_lse_matches_the_reference_in_natural_log(case: Case) -> None:
    seed = seed_of(case.id)
    spec = case.spec()
    q_lens, s_lens = MIXES[case.mix]
    batch, nblk = make_batch(q_lens, s_lens, case.block_size, seed=seed, causal=case.batch_causal)
    backend = TorchBackend(spec, "cpu")
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(seed + 1))
    q, k, v = random_qkv(
        spec, batch.num_tokens, generator(seed + 2), q_gain=3.0 if case.softcap else 1.0
    )
    weights = per_head_weights(spec, seed + 3)
    impl = backend.impl(**weights)
    meta = backend.metadata_builder().build(batch)
    out, lse = impl.forward(q, k, v, cache, meta, return_lse=True)
    expected, expected_lse = reference.paged_attention(q, cache, batch, spec, **weights)

    assert lse.dtype == F32 and lse.shape == (batch.num_tokens, spec.num_heads)
    assert_within(out, expected, tol(spec.dtype), case.id)
    assert_within(lse, expected_lse.t(), lse_tolerance(spec.dtype), f"{case.id} lse")
    # the same call without the LSE gives the output to within the dtype's tolerance
    again = impl.forward(q, None, None, cache, meta)
    assert_within(again, expected, tol(spec.dtype), f"{case.id} without lse")


def test_lse_with_sinks_is_the_denominator_with_the_sink_term() -> None:
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_size=64, dtype=F32, block_size=16, use_sinks=True
    )
    plain = dataclasses.replace(spec, use_sinks=False)
    batch, nblk = make_batch((1, 3), (9, 20), 16, seed=5)
    q, k, v = random_qkv(spec, batch.num_tokens, generator(6))
    sinks = random_sinks(4, generator(7), mean=2.0)
    lses = []
    for s, weights in ((spec, {"sinks": sinks}), (plain, {})):
        backend = TorchBackend(s, "cpu")
        cache = backend.allocate_kv_cache(nblk)
        fill_cache_random(cache, generator(8))
        meta = backend.metadata_builder().build(batch)
        lses.append(backend.impl(**weights).forward(q, k, v, cache, meta, return_lse=True)[1])
    with_sinks, without = lses
    # log(sum_j exp(s_j) + exp(sink)): the sink enters the denominator (as the reference's)
    assert torch.allclose(with_sinks, torch.logaddexp(without, sinks[None, :]), atol=1e-5)


def test_lse_rows_past_num_actual_tokens_are_plus_inf_and_the_buffer_is_returned() -> None:
    spec, batch, backend, cache, q, k, v = padded_setup(dtype=BF16)
    ref_cache = cache.clone()
    buf = torch.full((12, 8), float("nan"))
    out, lse = backend.impl().forward(
        q, k, v, cache, backend.metadata_builder().build(batch), return_lse=True, lse=buf
    )
    n = batch.num_actual_tokens
    assert lse is buf
    assert torch.isposinf(lse[n:]).all() and (out[n:] == 0).all()
    expected_cache, _ = reference_after_write(spec, ref_cache, batch, q, k, v)
    _, expected_lse = reference.paged_attention(q, expected_cache, batch, spec)
    assert_within(lse[:n], expected_lse.t(), tol(BF16), "lse buffer")


def test_lse_on_the_graph_path_matches_the_reference() -> None:
    spec = AttentionSpec(
        num_heads=8, num_kv_heads=2, head_size=64, dtype=F16, block_size=16, use_sinks=True
    )
    batch, nblk = make_batch((2, 2, 2), (5, 30, 17), 16, seed=11)
    backend = TorchBackend(spec, "cpu")
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(12))
    q, k, v = random_qkv(spec, batch.num_tokens, generator(13))
    sinks = random_sinks(8, generator(14))
    meta = backend.metadata_builder().build_for_graph_capture(batch)
    assert meta.graph is not None
    out, lse = backend.impl(sinks=sinks).forward(q, k, v, cache, meta, return_lse=True)
    expected, expected_lse = reference.paged_attention(q, cache, batch, spec, sinks=sinks)
    assert_within(out, expected, tol(F16), "graph path")
    assert_within(lse, expected_lse.t(), tol(F16), "graph path lse")


def test_merging_the_context_and_the_new_tokens_by_their_lse_gives_the_whole() -> None:
    """A chunked prefill attended in two parts (the cached context alone, non-causal; the new
    tokens alone, causal), merged by their LSEs (attnhub.kit.merge_attn_states), equals the
    one call over both: what context parallelism and cascades rely on."""
    from attnhub.kit import merge_attn_states

    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, dtype=F32, block_size=16)
    backend = TorchBackend(spec, "cpu")
    ctx, new = 48, 7  # the context fills 3 blocks; the new tokens start the 4th
    whole, nblk = make_batch((new,), (ctx + new,), 16, seed=21)
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(22))
    q, _, _ = random_qkv(spec, new, generator(23))
    impl = backend.impl()
    build = backend.metadata_builder().build
    out, lse = impl.forward(q, None, None, cache, build(whole), return_lse=True)
    table = whole.block_table[:, :4]

    def part(q_len: int, seq_len: int, blocks: torch.Tensor, causal: bool) -> BatchMetadata:
        return BatchMetadata.from_lengths([q_len], [seq_len], blocks, 16, causal=causal)

    # the context alone: every new row sees every context key; the new tokens alone: causal
    context = part(new, ctx, table[:, :3], causal=False)
    a, a_lse = impl.forward(q, None, None, cache, build(context), return_lse=True)
    b, b_lse = impl.forward(
        q, None, None, cache, build(part(new, new, table[:, 3:], True)), return_lse=True
    )
    merged, merged_lse = merge_attn_states(a, a_lse.t(), b, b_lse.t())
    assert torch.allclose(merged, out, atol=1e-5, rtol=1e-5)
    assert torch.allclose(merged_lse.t(), lse, atol=1e-5, rtol=1e-5)
