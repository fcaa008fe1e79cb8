"""One test per translation rule: what the backend passes to torch_npu, checked on the emulated
calls it records."""

from __future__ import annotations

import ascend_helpers as h
import pytest
import torch
from attnhub_ascend import AscendBackend, emulator
from attnhub_ascend.backend import (
    INT_MAX,
    RESHAPE_AND_CACHE,
    AscendMetadataBuilder,
    compressed_causal_mask,
)

from attnhub import reference, testing
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.spec import AttentionSpec, AttentionType

FIA = "npu_fused_infer_attention_score.out"
FIA_V2 = "npu_fused_infer_attention_score_v2.out"
FA = "npu_fusion_attention"
WRITE = "npu_scatter_pa_kv_cache"  # the 910B default
ATB_WRITE = "_npu_reshape_and_cache"  # the 310P path

#: decodes, a multi-token decode, a chunked prefill, a fresh prefill: every kind in one step
MIXED = [(1, 300), (3, 140), (1, 9), (40, 300), (130, 130)]


def _calls(st: h.Step) -> tuple[torch.Tensor, list[emulator.Call]]:
    with emulator.record_calls() as calls:
        out = h.forward(st)
    return out, calls


def _only(calls: list[emulator.Call], name: str) -> emulator.Call:
    found = [c for c in calls if c.name == name]
    assert len(found) == 1, f"{name} called {len(found)} times: {[c.name for c in calls]}"
    return found[0]


# --- one fused call ------------------------------------------------------------------------------


def test_a_mixed_batch_is_one_fused_attention_call_and_one_kv_write() -> None:
    st = h.step(MIXED, padding=3)
    out = h.forward(st)
    assert dict(emulator.call_counts) == {FIA: 1, WRITE: 1}
    h.assert_matches_reference(st, out)


@pytest.mark.parametrize(
    "requests",
    [[(1, 5), (1, 260), (1, 129)], [(7, 7), (130, 130)], [(2, 200), (4, 20), (3, 3)]],
    ids=["decode_only", "prefill_no_cache", "multi_token_decode"],
)
def test_every_kind_of_step_is_one_fused_call(requests: list[tuple[int, int]]) -> None:
    h.forward(h.step(requests))
    assert dict(emulator.call_counts) == {FIA: 1, WRITE: 1}


def test_layers_share_the_step_plan_and_make_one_call_each() -> None:
    st = h.step(MIXED)
    meta = st.backend.metadata_builder().build(st.batch)
    with emulator.record_calls() as calls:
        for _ in range(3):
            st.backend.impl().forward(st.query, st.key, st.value, st.cache, meta)
    fia = [c for c in calls if c.name == FIA]
    assert len(fia) == 3
    # the same host lists and int32 tensors every layer: converted once per step, not per layer
    assert all(c.kwargs["block_table"] is meta.block_table for c in fia)
    assert all(c.kwargs["actual_seq_lengths"] is meta.query_ends for c in fia)
    writes = [c for c in calls if c.name == WRITE]
    assert all(c.kwargs["slot_mapping"] is meta.slot_mapping for c in writes)


# --- lengths -------------------------------------------------------------------------------------


def test_query_lengths_are_cumulative_ends() -> None:
    st = h.step(MIXED)
    _, calls = _calls(st)
    fia = _only(calls, FIA)
    assert fia.kwargs["input_layout"] == "TND"
    assert fia.kwargs["actual_seq_lengths"] == (1, 4, 5, 45, 175)  # query_start_loc[1:]
    assert fia.args[0].shape[0] == 175  # the TND query holds exactly the real tokens


def test_kv_lengths_are_per_sequence_with_the_paged_cache() -> None:
    st = h.step(MIXED)
    _, calls = _calls(st)
    assert _only(calls, FIA).kwargs["actual_seq_lengths_kv"] == (300, 140, 9, 300, 130)


def test_encoder_kv_lengths_are_cumulative_ends_of_the_packed_keys() -> None:
    s = h.spec(attn_type=AttentionType.ENCODER_ONLY)
    st = h.step([(5, 5), (3, 3), (9, 9)], s, padding=2)
    out, calls = _calls(st)
    fa = _only(calls, FA)
    assert fa.args[3:5] == (4, "TND")  # head_num, input_layout: positional, as documented
    assert fa.kwargs["actual_seq_qlen"] == (5, 8, 17)
    assert fa.kwargs["actual_seq_kvlen"] == (5, 8, 17)
    assert fa.args[1].shape[0] == 17  # this step's keys, packed, padding rows dropped
    assert fa.kwargs["sparse_mode"] == 0 and fa.kwargs["atten_mask"] is None
    assert FIA not in emulator.call_counts
    h.assert_matches_reference(st, out)


# --- masks and windows ---------------------------------------------------------------------------


def test_causal_is_sparse_mode_3_with_the_compressed_mask() -> None:
    _, calls = _calls(h.step(MIXED))
    fia = _only(calls, FIA)
    assert fia.kwargs["sparse_mode"] == 3
    mask = fia.kwargs["atten_mask"]
    assert mask.shape == (2048, 2048) and mask.dtype == torch.int8
    assert torch.equal(mask, torch.triu(torch.ones(2048, 2048, dtype=torch.int8), 1))  # 1=masked


def test_the_mask_is_allocated_once_per_device() -> None:
    causal, windowed = h.step([(3, 3)]), h.step([(1, 9)], h.spec(sliding_window=7))
    masks = [
        st.backend.metadata_builder().build(st.batch).atten_mask
        for st in (causal, windowed, causal)
    ]
    assert masks[0] is masks[1] is masks[2] is compressed_causal_mask(torch.device("cpu"))


def test_window_is_band_mode_with_pre_tokens_w_minus_1_and_next_tokens_0() -> None:
    s = h.spec(sliding_window=40)
    st = h.step([(60, 60), (5, 200)], s)
    out, calls = _calls(st)
    fia = _only(calls, FIA)
    # the documented band keeps pre_tokens + 1 keys: W keys need pre_tokens = W - 1
    assert fia.kwargs["sparse_mode"] == 4
    assert fia.kwargs["pre_tokens"] == 39 and fia.kwargs["next_tokens"] == 0
    h.assert_matches_reference(st, out)


def test_window_decode_rows_get_a_padding_row_so_the_band_applies() -> None:
    s = h.spec(sliding_window=40)
    # a decode the window cuts (seq 200 > 40), one it does not (seq 30), a prefill
    st = h.step([(1, 200), (1, 30), (6, 100)], s, padding=2)
    meta = st.backend.metadata_builder().build(st.batch)
    assert meta.kernel_tokens == 9 and meta.query_ends == (2, 3, 9)
    assert meta.query_rows is not None and meta.output_rows is not None
    assert meta.query_rows.tolist() == [0, 0, 1, 2, 3, 4, 5, 6, 7]
    assert meta.output_rows.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    out = st.backend.impl().forward(st.query, st.key, st.value, st.cache, meta)
    h.assert_matches_reference(st, out)
    assert dict(emulator.call_counts) == {FIA: 1, WRITE: 1}


class _UnpaddedBuilder(AscendMetadataBuilder):
    pad_window_decodes = False


def _windowed_decodes() -> h.Step:
    return h.step([(1, 200), (1, 30), (6, 100)], h.spec(sliding_window=40))


@pytest.mark.parametrize("single_token_ignores_band", [True, False])
def test_padded_window_decodes_are_right_under_either_reading(
    single_token_ignores_band: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(emulator, "SINGLE_TOKEN_IGNORES_SPARSE", single_token_ignores_band)
    st = _windowed_decodes()
    h.assert_matches_reference(st, h.forward(st))


def test_without_the_padding_a_decode_sees_its_whole_context_under_the_strict_reading() -> None:
    """pad_window_decodes = False is only right once hardware shows the band applies to
    one-token requests: under the emulated (strict) reading the decode sees all 200 keys."""
    st = _windowed_decodes()
    meta = _UnpaddedBuilder(st.backend).build(st.batch)
    assert meta.query_rows is None and meta.kernel_tokens == 8
    out = st.backend.impl().forward(st.query, st.key, st.value, st.cache, meta)
    unwindowed = h.step([(1, 200), (1, 30), (6, 100)])  # same seed: same cache and queries
    want = h.forward(unwindowed)
    torch.testing.assert_close(out[0], want[0], atol=2e-2, rtol=2e-2)
    with pytest.raises(AssertionError):
        h.assert_matches_reference(st, out)


def test_without_the_padding_decodes_keep_the_window_under_the_other_reading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(emulator, "SINGLE_TOKEN_IGNORES_SPARSE", False)
    st = _windowed_decodes()
    meta = _UnpaddedBuilder(st.backend).build(st.batch)
    assert meta.query_rows is None and meta.query_ends == (1, 2, 8)
    out = st.backend.impl().forward(st.query, st.key, st.value, st.cache, meta)
    h.assert_matches_reference(st, out)


def test_non_causal_window_is_a_two_sided_band() -> None:
    s = h.spec(attn_type=AttentionType.ENCODER, sliding_window=5)
    st = h.step([(20, 20), (9, 9)], s)
    out, calls = _calls(st)
    fa = _only(calls, FA)
    assert fa.kwargs["sparse_mode"] == 4
    assert fa.kwargs["pre_tockens"] == 4 and fa.kwargs["next_tockens"] == 4
    # npu_fusion_attention takes bool / uint8 masks only [doc]; FIA's int8 one would be refused
    mask = fa.kwargs["atten_mask"]
    assert mask.dtype == torch.bool
    assert mask is compressed_causal_mask(torch.device("cpu"), torch.bool)
    h.assert_matches_reference(st, out)


def test_npu_fusion_attention_refuses_the_int8_mask_fia_takes() -> None:
    s = h.spec(attn_type=AttentionType.ENCODER, sliding_window=5)
    q = torch.randn(20, 4, 64).to(torch.bfloat16)
    k = torch.randn(20, 2, 64).to(torch.bfloat16)
    args = dict(actual_seq_qlen=[20], actual_seq_kvlen=[20], sparse_mode=4, scale=s.scale)
    with pytest.raises(emulator.NpuOpError, match="atten_mask must be one of bool, uint8"):
        emulator.npu_fusion_attention(
            q, k, k, 4, "TND", atten_mask=compressed_causal_mask(torch.device("cpu")), **args
        )
    emulator.npu_fusion_attention(
        q,
        k,
        k,
        4,
        "TND",
        atten_mask=compressed_causal_mask(torch.device("cpu"), torch.bool),
        **args,
    )


# --- sinks ---------------------------------------------------------------------------------------


def test_sinks_go_through_v2_as_a_bfloat16_learnable_sink() -> None:
    st = h.step(MIXED, h.spec(use_sinks=True))
    out, calls = _calls(st)
    v2 = _only(calls, FIA_V2)
    sink = v2.kwargs["learnable_sink"]
    assert sink.dtype == torch.bfloat16 and sink.shape == (4,)
    assert v2.kwargs["actual_seq_qlen"] == (1, 4, 5, 45, 175)
    assert v2.kwargs["actual_seq_kvlen"] == (300, 140, 9, 300, 130)
    assert v2.kwargs["num_query_heads"] == 4 and "softmax_scale" in v2.kwargs
    assert FIA not in emulator.call_counts
    h.assert_matches_reference(st, out)


# --- int32 tensors and the KV write --------------------------------------------------------------


def test_block_table_is_int32_and_the_scatter_write_takes_the_engines_slots() -> None:
    st = h.step(MIXED, padding=4)
    st.batch.block_table = st.batch.block_table.long()  # an engine may hand int64 tables
    meta = st.backend.metadata_builder().build(st.batch)
    assert meta.block_table is not None and meta.block_table.dtype == torch.int32
    # npu_scatter_pa_kv_cache takes int32 or int64 slots [doc]: no conversion per step, the
    # engine's own slots cut to the real tokens (a view, nothing copied)
    assert st.batch.slot_mapping.dtype == torch.int64
    assert meta.slot_mapping is not None and meta.slot_mapping.dtype == torch.int64
    assert meta.slot_mapping.shape[0] == 175
    assert meta.slot_mapping.data_ptr() == st.batch.slot_mapping.data_ptr()
    with emulator.record_calls() as calls:
        st.backend.impl().forward(st.query, st.key, st.value, st.cache, meta)
    assert _only(calls, FIA).kwargs["block_table"].dtype == torch.int32
    assert _only(calls, WRITE).kwargs["slot_mapping"] is meta.slot_mapping


def test_a_strided_slot_mapping_is_made_contiguous_once_per_step() -> None:
    st = h.step(MIXED)
    wide = torch.full((2 * st.batch.num_tokens,), -7, dtype=torch.int64)
    wide[::2] = st.batch.slot_mapping
    st.batch.slot_mapping = wide[::2]  # same values, stride 2
    meta = st.backend.metadata_builder().build(st.batch)
    assert meta.slot_mapping is not None and meta.slot_mapping.is_contiguous()
    with emulator.record_calls() as calls:
        out = st.backend.impl().forward(st.query, st.key, st.value, st.cache, meta)
    assert _only(calls, WRITE).kwargs["slot_mapping"] is meta.slot_mapping
    h.assert_matches_reference(st, out)


def test_padding_rows_are_not_handed_to_the_kv_write() -> None:
    st = h.step(MIXED, padding=5)
    _, calls = _calls(st)
    write = _only(calls, WRITE)
    assert write.kwargs["key"].shape[0] == write.kwargs["slot_mapping"].shape[0] == 175
    assert bool((write.kwargs["slot_mapping"] >= 0).all())


def test_write_kv_converts_the_engines_slots_to_int32_and_skips_padding() -> None:
    st = h.step([(5, 5)])
    impl = st.backend.impl()
    before = st.cache.clone()
    slots = torch.tensor([3, -1, 130, -1, 7], dtype=torch.int64)
    with emulator.record_calls() as calls:
        impl.write_kv(st.key, st.value, st.cache, slots)
    write = _only(calls, WRITE)
    # npu_scatter_pa_kv_cache has no padding slot [doc]: the -1 rows are left out
    assert write.kwargs["slot_mapping"].tolist() == [3, 130, 7]
    assert write.kwargs["slot_mapping"].dtype == torch.int32
    assert write.kwargs["cache_mode"] == "Norm"
    flat_k = st.cache.key.view(-1, 2, 64)
    assert torch.equal(flat_k[3], st.key[0]) and torch.equal(flat_k[130], st.key[2])
    assert torch.equal(flat_k[7], st.key[4])
    changed = (st.cache.key != before.key).flatten(2).any(-1).view(-1).nonzero()[:, 0]
    assert set(changed.tolist()) <= {3, 130, 7}


def test_the_cache_is_read_per_call_never_remembered() -> None:
    """A reallocated cache is used, not a stale tensor kept on the impl (the seed's bug)."""
    st = h.step(MIXED)
    impl = st.backend.impl()
    meta = st.backend.metadata_builder().build(st.batch)
    impl.forward(st.query, st.key, st.value, st.cache, meta)
    fresh = st.cache.clone()
    fresh.key.copy_(torch.randn(fresh.key.shape).to(fresh.key.dtype))
    st.cache = fresh
    out = impl.forward(st.query, st.key, st.value, fresh, meta)
    h.assert_matches_reference(st, out)


# --- no host reads in forward --------------------------------------------------------------------


def test_forward_and_write_kv_read_no_device_tensor_on_the_host() -> None:
    """With every check on: the step's values were checked by build, on host copies. The
    emulated ops are the device (emulator.py is marked ``__attnhub_device_code__``)."""
    hostsync = pytest.importorskip("attnhub_conformance.hostsync")
    for s in (h.spec(), h.spec(sliding_window=40), h.spec(use_sinks=True)):
        st = h.step([(1, 200), (3, 140), (40, 300)], s, padding=2)
        meta = st.backend.metadata_builder().build(st.batch)
        impl = st.backend.impl(sinks=st.sinks)
        out = hostsync.run_layer_guarded(impl, st.query, st.key, st.value, st.cache, meta)
        h.assert_matches_reference(st, out)


# --- refusals at the step level ------------------------------------------------------------------


def test_non_causal_attention_over_cached_context_gathers_its_keys_once() -> None:
    s = h.spec(attn_type=AttentionType.ENCODER)
    st = h.step([(3, 9), (5, 5), (1, 130)], s, padding=1)
    meta = st.backend.metadata_builder().build(st.batch)
    assert meta.packed and meta.kv_slots is not None and meta.kv_slots.shape == (144,)
    with emulator.record_calls() as calls:
        out = st.backend.impl().forward(st.query, st.key, st.value, st.cache, meta)
    fa = _only(calls, FA)
    assert fa.kwargs["actual_seq_qlen"] == (3, 8, 9)
    assert fa.kwargs["actual_seq_kvlen"] == (9, 14, 144)  # cumulative, packed
    assert fa.args[1].shape[0] == 144
    h.assert_matches_reference(st, out)


def test_cross_attention_reads_the_encoder_keys_from_the_cache() -> None:
    s = h.spec(attn_type=AttentionType.ENCODER_DECODER)
    st = h.step([(1, 23), (5, 133), (3, 40)], s)
    meta = st.backend.metadata_builder().build(st.batch)
    with emulator.record_calls() as calls:
        out = st.backend.impl().forward(st.query, None, None, st.cache, meta)
    assert [c.name for c in calls] == [FA]  # no KV write: nothing new
    h.assert_matches_reference(st, out)


@pytest.mark.parametrize(
    ("spec_changes", "causal"),
    [(dict(attn_type=AttentionType.ENCODER_ONLY), None), (dict(), False)],
    ids=["encoder_only", "decoder step with causal=False"],
)
def test_forward_without_keys_after_write_kv_reads_a_non_causal_steps_keys_from_the_cache(
    spec_changes: dict[str, object], causal: bool | None
) -> None:
    # issue 23, item 6: this call was refused ("key and value must be given"); torch computes it
    st = h.step([(5, 5), (3, 3)], h.spec(**spec_changes), causal=causal)
    meta = st.backend.metadata_builder().build(st.batch)
    impl = st.backend.impl()
    impl.write_kv(st.key, st.value, st.cache, meta=meta)
    with emulator.record_calls() as calls:
        out = impl.forward(st.query, None, None, st.cache, meta)
    assert [c.name for c in calls] == [FA]  # the keys gathered back, no second write
    assert _only(calls, FA).args[1].shape[0] == 8
    h.assert_matches_reference(st, out)


@pytest.mark.parametrize(
    ("spec_changes", "causal", "requests"),
    [
        (dict(use_sinks=True), False, [(4, 4)]),  # issue 23, item 1's step
        (dict(use_sinks=True), False, [(3, 9), (1, 130), (5, 5)]),  # with context
        (dict(use_sinks=True, attn_type=AttentionType.ENCODER_ONLY), None, [(5, 5), (2, 2)]),
        (
            dict(use_sinks=True, attn_type=AttentionType.ENCODER_ONLY, dtype=torch.float16),
            None,
            [(5, 5)],
        ),
    ],
    ids=["decoder non-causal", "decoder non-causal with context", "encoder_only", "fp16 encoder"],
)
def test_sinks_of_a_non_causal_step_reach_npu_fusion_attention(
    spec_changes: dict[str, object], causal: bool | None, requests: list[tuple[int, int]]
) -> None:
    # issue 23, item 1: the sink was dropped on non-causal steps (error 0.99 vs the reference)
    st = h.step(requests, h.spec(**spec_changes), causal=causal)
    with emulator.record_calls() as calls:
        out = h.forward(st)
    sink = _only(calls, FA).kwargs["sink"]
    assert sink.dtype == torch.float32 and torch.equal(sink, st.sinks)
    h.assert_matches_reference(st, out)


def test_npu_fusion_attention_gets_no_sink_argument_without_sinks() -> None:
    # older torch_npu (before 7.3.0) has no `sink` parameter: it is passed only with sinks
    _, calls = _calls(h.step([(5, 5)], h.spec(attn_type=AttentionType.ENCODER_ONLY)))
    assert "sink" not in _only(calls, FA).kwargs


def test_pre_tokens_default_is_unbounded_without_a_window() -> None:
    _, calls = _calls(h.step([(3, 3)]))
    assert _only(calls, FIA).kwargs["pre_tokens"] == INT_MAX


def test_more_sequences_than_npu_fusion_attention_takes_are_refused_with_a_reason() -> None:
    st = h.step([(1, 1)] * 1025, h.spec(attn_type=AttentionType.ENCODER_ONLY))
    with pytest.raises(UnsupportedConfigurationError, match="at most 1024"):
        st.backend.metadata_builder().build(st.batch)


def test_step_writes_refuse_strided_caches_and_foreign_metadata() -> None:
    """write_kv(meta=) checks what forward checks before its kernels run: a cache the fused ops
    cannot take (strided K/V planes) and metadata of another kind raise InvalidInputError and
    leave the cache unchanged."""
    from dataclasses import replace

    from attnhub.backend import AttentionMetadata

    st = h.step([(1, 23), (5, 133)])
    meta = st.backend.metadata_builder().build(st.batch)
    impl = st.backend.impl()
    d = st.key.shape[-1]
    doubled = torch.zeros((*st.cache.key.shape[:-1], 2 * d), dtype=st.cache.key.dtype)
    strided = replace(st.cache, key=doubled[..., :d], value=doubled[..., d:])
    before = strided.clone()
    with pytest.raises(InvalidInputError, match="contiguous"):
        impl.write_kv(st.key, st.value, strided, meta=meta)
    assert strided.equal(before)
    before = st.cache.clone()
    with pytest.raises(InvalidInputError, match="must come from the ascend backend"):
        impl.write_kv(st.key, st.value, st.cache, meta=AttentionMetadata(batch=st.batch))
    assert st.cache.equal(before)


def test_a_padding_slot_among_a_steps_real_tokens_is_left_out_of_the_write() -> None:
    st = h.step([(3, 3), (2, 130)])
    st.batch.slot_mapping[1] = -1  # an engine may mark a real token's write as skipped
    meta = st.backend.metadata_builder().build(st.batch)
    assert meta.write_rows is not None and meta.write_rows.tolist() == [0, 2, 3, 4]
    with emulator.record_calls() as calls:
        st.backend.impl().write_kv(st.key, st.value, st.cache, meta=meta)
    write = _only(calls, WRITE)
    assert bool((write.kwargs["slot_mapping"] >= 0).all())
    assert torch.equal(write.kwargs["key"], st.key[[0, 2, 3, 4]])


class _AtbAscend(AscendBackend):
    kv_write_op = RESHAPE_AND_CACHE  # 310P: the ATB op is the only KV write


def test_the_atb_kv_write_is_a_class_switch_and_skips_padding_itself() -> None:
    b = _AtbAscend(h.spec(), "cpu", emulate=True)
    st = h.step([(1, 300), (5, 5)])
    st.batch.slot_mapping[2] = -1
    meta = b.metadata_builder().build(st.batch)
    assert meta.write_rows is None  # the op skips slots < 0 itself
    with emulator.record_calls() as calls:
        out = b.impl().forward(st.query, st.key, st.value, st.cache, meta)
    write = _only(calls, ATB_WRITE)
    assert write.kwargs["slot_indices"].dtype == torch.int32
    assert write.kwargs["slot_indices"].shape[0] == 6
    assert WRITE not in emulator.call_counts
    assert out.isfinite().all()


def test_an_unknown_kv_write_op_is_refused() -> None:
    class Odd(AscendBackend):
        kv_write_op = "npu_reshape_and_cache_magic"

    with pytest.raises(UnsupportedConfigurationError, match="kv_write_op"):
        Odd(h.spec(), "cpu", emulate=True)


def test_more_requests_than_fia_tnd_takes_are_refused_with_the_count() -> None:
    st = h.step([(1, 1)] * 4097)
    with pytest.raises(UnsupportedConfigurationError, match=r"4097 requests.*at most 4096"):
        st.backend.metadata_builder().build(st.batch)


@pytest.mark.parametrize(
    ("attn_type", "requests"),
    [
        (AttentionType.DECODER, MIXED),
        (AttentionType.ENCODER, [(20, 20), (1, 1), (9, 9)]),
        (AttentionType.ENCODER_DECODER, [(1, 23), (5, 133), (3, 3)]),
    ],
    ids=lambda x: getattr(x, "value", None),
)
def test_the_narrowest_window_builds_no_row_that_sees_no_key(
    attn_type: AttentionType, requests: list[tuple[int, int]]
) -> None:
    """The backend never passes inner_precise 2/3: every row it builds sees a key (its own
    bottom-right diagonal, as seq_len >= query_len), so no row needs the invalid-row correction.
    The emulator leaves uncorrected empty rows NaN, so a row that saw nothing would fail here."""
    st = h.step(requests, h.spec(attn_type=attn_type, sliding_window=1))
    meta = st.backend.metadata_builder().build(st.batch)
    key = None if attn_type is AttentionType.ENCODER_DECODER else st.key
    value = None if key is None else st.value
    with emulator.record_calls() as calls:
        out = st.backend.impl().forward(st.query, key, value, st.cache, meta)
    assert all(c.kwargs.get("inner_precise", 0) == 0 for c in calls)
    h.assert_matches_reference(st, out)


def test_write_kv_with_only_padding_slots_makes_no_write() -> None:
    st = h.step([(3, 3)])
    before = st.cache.clone()
    with emulator.record_calls() as calls:
        st.backend.impl().write_kv(st.key, st.value, st.cache, torch.full((3,), -1))
    assert calls == [] and st.cache.equal(before)


# --- values narrower than keys (head_size_v): FIA in TND without page attention -----------------


def _hv(**changes: object) -> AttentionSpec:
    return h.spec(head_size=192, head_size_v=128, **changes)


@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (4, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("requests", [MIXED, [(7, 7), (3, 3)]], ids=["mixed", "prefill"])
def test_values_narrower_than_keys_make_one_packed_fia_call(
    requests: list[tuple[int, int]], heads: tuple[int, int]
) -> None:
    """keys 192 / values 128: one write, one FIA call in TND without page attention over the
    step's keys at their own widths (K/V heads repeated to the query's), causal bottom-right;
    the output is the reference's."""
    st = h.step(requests, _hv(num_heads=heads[0], num_kv_heads=heads[1]), padding=2)
    out, calls = _calls(st)
    assert [c.name for c in calls] == [WRITE, FIA]
    fia = _only(calls, FIA)
    _, k, v = fia.args
    kw = fia.kwargs
    assert kw["block_table"] is None and kw["sparse_mode"] == 3 and kw["input_layout"] == "TND"
    assert kw["num_key_value_heads"] == heads[0] == k.shape[1] == v.shape[1]
    assert (k.shape[2], v.shape[2]) == (192, 128)
    seq = [s for _, s in requests]
    assert list(kw["actual_seq_lengths_kv"]) == torch.tensor(seq).cumsum(0).tolist()
    assert tuple(out.shape[1:]) == (heads[0], 128)
    h.assert_matches_reference(st, out)
    assert bool((out[st.batch.num_actual_tokens :] == 0).all())


def test_values_narrower_than_keys_return_the_lse_from_the_same_call() -> None:
    st = h.step(MIXED, _hv())
    meta = st.backend.metadata_builder().build(st.batch)
    with emulator.record_calls() as calls:
        out, lse = st.backend.impl().forward(
            st.query, st.key, st.value, st.cache, meta, return_lse=True
        )
    assert _only(calls, FIA).kwargs["softmax_lse_flag"] is True
    n = st.batch.num_actual_tokens
    want, want_lse = reference.paged_attention(st.query[:n], st.cache, st.batch, st.backend.spec)
    tol = st.backend.capabilities.tolerance(torch.bfloat16)
    assert testing.mismatch(out[:n], want, tol) is None
    assert testing.mismatch(lse[:n], want_lse.t(), tol) is None


def test_values_narrower_than_keys_read_the_keys_back_after_write_kv() -> None:
    """forward(q, None, None, ...) after write_kv: the keys come from the cache."""
    st = h.step([(5, 5), (2, 2)], _hv())
    meta = st.backend.metadata_builder().build(st.batch)
    impl = st.backend.impl()
    impl.write_kv(st.key, st.value, st.cache, meta=meta)
    out = impl.forward(st.query, None, None, st.cache, meta)
    h.assert_matches_reference(st, out)


def test_a_non_causal_step_of_such_a_spec_goes_to_npu_fusion_attention() -> None:
    """npu_fusion_attention takes Dk >= Dv ("Dq=Dk和Dk≥Dv") [doc]."""
    st = h.step([(4, 9), (3, 3)], _hv(), causal=False)
    out, calls = _calls(st)
    assert FA in [c.name for c in calls] and FIA not in [c.name for c in calls]
    n = st.batch.num_actual_tokens
    want, _ = reference.paged_attention(st.query[:n], st.cache, st.batch, st.backend.spec)
    tol = st.backend.capabilities.tolerance(torch.bfloat16)
    assert testing.mismatch(out[:n], want, tol) is None


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"dtype": torch.float16}, "head_size_v"),
        ({"head_size": 128, "head_size_v": 64}, "head_size_v"),
        ({"sliding_window": 8}, "sliding_window"),
        ({"use_sinks": True}, "sinks"),
    ],
)
def test_what_fias_differing_head_size_form_does_not_take_is_refused(
    changes: dict[str, object], field: str
) -> None:
    fields: dict[str, object] = {"head_size": 192, "head_size_v": 128, **changes}
    reasons = AscendBackend.unsupported_reasons(h.spec(**fields))
    assert field in [r.field for r in reasons], reasons


def test_such_a_spec_is_never_captured() -> None:
    from attnhub.capabilities import GraphSupport

    builder = h.backend(_hv()).metadata_builder()
    assert builder.graph_support is GraphSupport.NEVER


def test_more_requests_than_fia_takes_are_refused_on_every_causal_path() -> None:
    """One refusal for the paged and the packed FIA steps (and the MLA layers): the count, the
    op, the limit."""
    for s in (h.spec(), _hv()):
        st = h.step([(1, 1)] * 4097, s)
        with pytest.raises(UnsupportedConfigurationError, match=r"4097 requests.*FIA.*4096"):
            st.backend.metadata_builder().build(st.batch)
