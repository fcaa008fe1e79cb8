"""The ascend backend's MLA layers: FIA's MLA form in the emulator (what the FIA doc allows with
query_rope / key_rope, refused where the doc refuses it) and the backend's one write and one
FIA call per layer, each checked against ``attnhub.reference``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from attnhub_ascend import AscendBackend, emulator
from attnhub_ascend.backend import RESHAPE_AND_CACHE
from attnhub_ascend.emulator import NotEmulatedError, NpuOpError

from attnhub import BatchMetadata, LatentKVCache, MLASpec, reference, testing
from attnhub.capabilities import Tolerance
from attnhub.errors import UnsupportedConfigurationError
from attnhub.graphs import GraphRunner

FIA = emulator.npu_fused_infer_attention_score
N, R, P, NB = 32, 512, 64, 6
TOL = Tolerance(atol=2e-2, rtol=2e-2)


def mla_spec(**changes: Any) -> MLASpec:
    fields: dict[str, Any] = dict(
        num_heads=N,
        kv_lora_rank=R,
        qk_rope_head_dim=P,
        qk_nope_head_dim=128,
        v_head_dim=128,
        dtype=torch.bfloat16,
        block_size=16,
    )
    fields.update(changes)
    return MLASpec(**fields)


class Call:
    """One FIA MLA-form call over random planes: the keyword arguments a test may change."""

    def __init__(self, query_lens: list[int], seq_lens: list[int], bs: int = 16) -> None:
        g = testing.generator(5)
        self.bs = bs
        self.k_nope = torch.randn(NB, 1, bs, R, generator=g).bfloat16()
        self.k_pe = torch.randn(NB, 1, bs, P, generator=g).bfloat16()
        T = sum(query_lens)
        self.q_nope = torch.randn(T, N, R, generator=g).bfloat16()
        self.q_pe = torch.randn(T, N, P, generator=g).bfloat16()
        blocks = -(-max(seq_lens) // bs)
        perm = torch.randperm(NB, generator=g)[:blocks].to(torch.int32)
        self.table = torch.stack([perm.roll(i) for i in range(len(seq_lens))])
        self.query_lens, self.seq_lens = query_lens, seq_lens
        longer = max(query_lens) > 1
        self.kwargs: dict[str, Any] = dict(
            query_rope=self.q_pe,
            key_rope=self.k_pe,
            num_heads=N,
            num_key_value_heads=1,
            input_layout="TND",
            atten_mask=emulator.compressed_causal_mask() if longer else None,
            sparse_mode=3 if longer else 0,
            scale=0.07,
            block_table=self.table,
            block_size=bs,
            actual_seq_lengths=torch.tensor(query_lens).cumsum(0).tolist(),
            actual_seq_lengths_kv=seq_lens,
        )

    def run(self, **changes: Any) -> tuple[torch.Tensor, torch.Tensor]:
        kwargs = {**self.kwargs, **changes}
        value = kwargs.pop("value", self.k_nope)
        return FIA(kwargs.pop("query", self.q_nope), self.k_nope, value, **kwargs)  # type: ignore[no-any-return]

    def expected(self) -> torch.Tensor:
        spec = mla_spec(block_size=self.bs, scale=0.07)
        cache = LatentKVCache(
            kv_c=self.k_nope.view(NB, self.bs, R),
            k_pe=self.k_pe.view(NB, self.bs, P),
            block_size=self.bs,
            layout="split",
        )
        batch = BatchMetadata.from_lengths(self.query_lens, self.seq_lens, self.table, self.bs)
        query = torch.cat([self.q_nope, self.q_pe], dim=-1)
        return reference.paged_mla_absorbed(query, cache, batch, spec)[0]


# --- the emulator's MLA form ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "bs"),
    [([1, 1, 1], [17, 3, 40], 16), ([2, 1, 16], [20, 9, 33], 16), ([1, 3], [130, 200], 128)],
    ids=["decodes-sparse0", "multi-token-sparse3", "block128"],
)
def test_the_mla_form_computes_q_nope_k_nope_plus_q_rope_k_rope_over_the_nope_values(
    query_lens: list[int], seq_lens: list[int], bs: int
) -> None:
    call = Call(query_lens, seq_lens, bs)
    out, lse = call.run()
    assert out.shape == call.q_nope.shape and out.dtype == torch.bfloat16
    assert testing.mismatch(out, call.expected(), TOL) is None
    assert lse.shape == (1,)  # no LSE flag: the reserved [1] zero


def test_the_mla_form_reads_the_rope_part() -> None:
    call = Call([1, 2], [9, 30])
    out, _ = call.run()
    zero_rope, _ = call.run(query_rope=torch.zeros_like(call.q_pe))
    assert not torch.allclose(out.float(), zero_rope.float(), atol=1e-2)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"softmax_lse_flag": True}, "returns no LSE"),
        ({"key_rope": None}, "together"),
        ({"num_key_value_heads": 0}, "key N 1"),
        ({"block_size": 32}, "16 or 128"),
        ({"sparse_mode": 3}, "sparse_mode=0 without atten_mask"),
        ({"atten_mask": "mask"}, "sparse_mode=0 without atten_mask"),
        ({"query_rope": "wrong_width"}, "query_rope must be"),
        ({"query_rope": "fp16"}, "query_rope must be"),
        ({"block_table": None}, "page attention"),
        ({"actual_seq_lengths_kv": [9, 99]}, "per-sequence length"),
    ],
    ids=lambda v: v if isinstance(v, str) else next(iter(v)),
)
def test_the_mla_form_refuses_what_the_doc_refuses(changes: dict[str, Any], match: str) -> None:
    call = Call([1, 1], [9, 30])
    if changes.get("atten_mask") == "mask":
        changes = {"atten_mask": emulator.compressed_causal_mask()}
    if changes.get("query_rope") == "wrong_width":
        changes = {"query_rope": torch.zeros(2, N, 32, dtype=torch.bfloat16)}
    if changes.get("query_rope") == "fp16":
        changes = {"query_rope": call.q_pe.half()}
    with pytest.raises(NpuOpError, match=match):
        call.run(**changes)


def test_the_mla_form_with_longer_queries_needs_sparse_mode_3_with_the_mask() -> None:
    call = Call([2, 1], [9, 30])
    with pytest.raises(NpuOpError, match="sparse_mode=3"):
        call.run(sparse_mode=0, atten_mask=None)


def test_the_mla_form_takes_at_most_16_query_tokens_per_request() -> None:
    call = Call([17, 1], [20, 30], bs=16)
    with pytest.raises(NpuOpError, match="1-16"):
        call.run()


def test_the_mla_form_takes_32_64_or_128_query_heads() -> None:
    call = Call([1], [9])
    q = call.q_nope[:, :8].contiguous()
    with pytest.raises(NpuOpError, match="32, 64 or 128"):
        call.run(query=q, query_rope=call.q_pe[:, :8].contiguous(), num_heads=8)


def test_a_value_other_than_the_nope_plane_is_not_emulated() -> None:
    call = Call([1], [9])
    with pytest.raises(NotEmulatedError, match="value other than key"):
        call.run(value=call.k_nope.clone())


def test_the_d128_mla_form_is_valid_but_not_emulated() -> None:
    call = Call([1], [9])
    with pytest.raises(NotEmulatedError, match="D=128"):
        call.run(
            query=torch.zeros(1, N, 128, dtype=torch.bfloat16),
            query_rope=torch.zeros(1, N, 64, dtype=torch.bfloat16),
        )


# --- the backend ---------------------------------------------------------------------------------


class ReshapeAndCacheBackend(AscendBackend):
    kv_write_op = RESHAPE_AND_CACHE


def _step(
    requests: list[tuple[int, int]], backend_type: type[AscendBackend] = AscendBackend
) -> tuple[Any, ...]:
    spec = mla_spec()
    backend = backend_type(spec, "cpu", emulate=True)
    g = testing.generator(9)
    batch, nb = testing.make_batch(
        [q for q, _ in requests],
        [s for _, s in requests],
        spec.block_size,
        seed=g,
        num_tokens=sum(q for q, _ in requests) + 2,
    )
    cache = backend.allocate_kv_cache(nb + 1)
    assert isinstance(cache, LatentKVCache) and cache.layout == "split"
    testing.fill_latent_cache_random(cache, g)
    kv_c, k_pe = testing.random_latent_kv(spec, batch.num_tokens, g)
    query = testing.random_mla_query(spec, batch.num_tokens, g)
    return spec, backend, batch, cache, query, kv_c, k_pe


@pytest.mark.parametrize("backend_type", [AscendBackend, ReshapeAndCacheBackend])
@pytest.mark.parametrize(
    ("requests", "sparse_mode"),
    [([(1, 17), (1, 3), (1, 40)], 0), ([(3, 20), (1, 9), (16, 16)], 3)],
    ids=["decodes", "multi-token"],
)
def test_a_layer_makes_one_write_and_one_fia_call(
    requests: list[tuple[int, int]], sparse_mode: int, backend_type: type[AscendBackend]
) -> None:
    spec, backend, batch, cache, query, kv_c, k_pe = _step(requests, backend_type)
    want_cache = cache.clone()
    reference.write_latent_kv(want_cache, kv_c, k_pe, batch.slot_mapping)
    meta = backend.metadata_builder().build(batch)
    with emulator.record_calls() as calls:
        out = backend.impl().forward(query, kv_c, k_pe, cache, meta)
    assert [c.name for c in calls] == [backend.kv_write_op, "npu_fused_infer_attention_score.out"]
    fia = calls[1].kwargs
    assert fia["sparse_mode"] == sparse_mode and fia["query_rope"] is not None
    assert (fia["atten_mask"] is None) == (sparse_mode == 0)
    assert cache.equal(want_cache)
    want, _ = reference.paged_mla_absorbed(query, cache, batch, spec)
    n = batch.num_actual_tokens
    assert testing.mismatch(out[:n], want, TOL) is None
    assert bool((out[n:] == 0).all())


def test_write_kv_alone_skips_padding_slots() -> None:
    _, backend, batch, cache, _, kv_c, k_pe = _step([(2, 5), (1, 9)])
    slots = batch.slot_mapping.clone()
    slots[1] = -1  # a real token's write skipped, as padding rows are
    want = cache.clone()
    reference.write_latent_kv(want, kv_c, k_pe, slots)
    backend.impl().write_kv(kv_c, k_pe, cache, slots)
    assert cache.equal(want)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_heads": 8}, "mla.num_heads"),
        ({"block_size": 64}, "mla.block_size"),
        ({"kv_lora_rank": 256}, "mla.latent_size"),
        ({"dtype": torch.float32}, "mla.dtype"),
    ],
)
def test_what_fias_mla_form_does_not_take_is_refused_with_its_reason(
    changes: dict[str, Any], field: str
) -> None:
    reasons = AscendBackend.unsupported_reasons(mla_spec(**changes))
    assert [r.field for r in reasons] == [field]
    with pytest.raises(UnsupportedConfigurationError, match="FIA's MLA form"):
        AscendBackend(mla_spec(**changes), "cpu", emulate=True)


def test_the_lse_is_refused_before_anything_is_written() -> None:
    _, backend, batch, cache, query, kv_c, k_pe = _step([(1, 9)])
    before = cache.clone()
    meta = backend.metadata_builder().build(batch)
    with pytest.raises(UnsupportedConfigurationError, match="softmax_lse_flag"):
        backend.impl().forward(query, kv_c, k_pe, cache, meta, return_lse=True)
    assert cache.equal(before)


class MLAModel:
    """Two MLA layers over their own latent caches on one emulated backend."""

    def __init__(self, backend_type: type[AscendBackend]) -> None:
        self.spec = mla_spec()
        self.backend = backend_type(self.spec, "cpu", emulate=True)
        self.impl = self.backend.impl()
        g = testing.generator(3)
        self.caches = [self.backend.allocate_kv_cache(40) for _ in range(2)]
        for c in self.caches:
            assert isinstance(c, LatentKVCache)
            testing.fill_latent_cache_random(c, g)

    def step(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, meta: Any) -> Any:
        out = q
        for cache in self.caches:
            out = self.impl.forward(q, kv_c, k_pe, cache, meta)
        return out


@pytest.mark.parametrize("backend_type", [AscendBackend, ReshapeAndCacheBackend])
@pytest.mark.parametrize("query_len", [1, 2])
def test_captured_mla_steps_replay_with_each_steps_lengths(
    backend_type: type[AscendBackend], query_len: int
) -> None:
    model = MLAModel(backend_type)
    runner = GraphRunner(
        model.backend,
        model.step,
        capture_sizes=[8],
        max_blocks_per_req=8,
        kv_caches=model.caches,  # type: ignore[arg-type]
    )
    table = testing.shuffled_block_table([8 * 16] * 3, 16, 40, testing.generator(1))
    seqs = [20, 57, query_len]
    for i in range(4):  # every sequence grows by query_len tokens each step: one descriptor
        batch = BatchMetadata.from_lengths([query_len] * 3, seqs, table, 16)
        g = testing.generator(10 + i)
        kv_c, k_pe = testing.random_latent_kv(model.spec, batch.num_tokens, g)
        q = testing.random_mla_query(model.spec, batch.num_tokens, g)
        want_cache = model.caches[1].clone()
        reference.write_latent_kv(want_cache, kv_c, k_pe, batch.slot_mapping)
        out = runner.run(batch, q, kv_c, k_pe).clone()
        assert model.caches[1].equal(want_cache), f"step {i}: the write"
        want, _ = reference.paged_mla_absorbed(q, model.caches[1], batch, model.spec)
        assert testing.mismatch(out, want, TOL) is None, f"step {i}"
        seqs = [n + query_len for n in seqs]
    assert runner.stats == {"captures": 1, "replays": 4}


def test_a_captured_mla_replay_whose_update_is_skipped_answers_for_the_captured_lengths() -> None:
    model = MLAModel(AscendBackend)
    runner = GraphRunner(
        model.backend,
        model.step,
        capture_sizes=[4],
        max_blocks_per_req=8,
        kv_caches=model.caches,  # type: ignore[arg-type]
    )
    table = testing.shuffled_block_table([8 * 16] * 2, 16, 40, testing.generator(1))
    g = testing.generator(4)

    def run(seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor, BatchMetadata]:
        batch = BatchMetadata.from_lengths([1, 1], seqs, table, 16)
        kv_c, k_pe = testing.random_latent_kv(model.spec, 2, g)
        q = testing.random_mla_query(model.spec, 2, g)
        return runner.run(batch, q, kv_c, k_pe).clone(), q, batch

    run([30, 40])

    def events_only(graph_meta: Any, batch: BatchMetadata, stream: Any) -> None:
        for task in graph_meta.graph.tasks:  # the ordering, without the task update
            task.event.record(stream)

    runner.builder.update_graph_params = events_only  # type: ignore[method-assign]
    stale, q, grown = run([31, 41])
    want, _ = reference.paged_mla_absorbed(q, model.caches[1], grown, model.spec)
    assert testing.mismatch(stale, want, TOL) is not None  # the new keys are not attended
    captured = BatchMetadata.from_lengths([1, 1], [30, 40], table, 16)
    want, _ = reference.paged_mla_absorbed(q, model.caches[1], captured, model.spec)
    assert testing.mismatch(stale, want, TOL) is None
