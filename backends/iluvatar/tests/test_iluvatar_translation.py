"""One test per translation rule: what the backend passes to ixformer, checked on the emulated
calls it records."""

from __future__ import annotations

from dataclasses import replace

import iluvatar_helpers as h
import pytest
import torch
from attnhub_iluvatar import emulator
from iluvatar_helpers import KVCACHE, MERGE, VARLEN, WRITE

from attnhub import testing
from attnhub.backend import AttentionMetadata
from attnhub.errors import InvalidInputError
from attnhub.spec import AttentionType

#: two decodes, then a multi-token decode, a chunked prefill and a fresh prefill (the decode
#: threshold is 1, the fork's: the multi-token decode goes with the prefills)
MIXED = [(1, 40), (1, 9), (3, 30), (20, 50), (17, 17)]


def _names(calls: list[emulator.Call]) -> list[str]:
    return [c.name for c in calls]


# --- the split -----------------------------------------------------------------------------------


def test_a_mixed_step_is_one_write_one_decode_call_and_one_prefill_call() -> None:
    st = h.step(MIXED, padding=3)
    out, calls = h.calls_of(st)
    assert _names(calls) == [WRITE, KVCACHE, VARLEN]
    h.assert_matches_reference(st, out)
    assert (out[st.batch.num_actual_tokens :] == 0).all()


def test_decodes_pass_q_as_tokens_by_one_with_query_offsets_as_the_fork() -> None:
    st = h.step([(1, 40), (1, 9), (1, 33)], padding=2)
    out, calls = h.calls_of(st)
    assert VARLEN not in _names(calls)
    dec = h.only(calls, KVCACHE)
    assert dec.args == ()  # every argument by keyword, as the fork passes them
    assert dec.kwargs["q"].shape == (3, 1, 4, 64)
    assert dec.kwargs["k_cache"] is st.cache.key and dec.kwargs["v_cache"] is st.cache.value
    assert dec.kwargs["cu_query_lens"].tolist() == [0, 1, 2, 3]
    assert dec.kwargs["cu_query_lens"].dtype == torch.int32
    assert dec.kwargs["max_query_len"] == 1
    assert dec.kwargs["use_cuda_graph"] is False and dec.kwargs["sinks"] is None
    assert dec.kwargs["cache_seqlens"].tolist() == [40, 9, 33]
    assert dec.kwargs["cache_seqlens"].dtype == torch.int32
    assert dec.kwargs["max_context_len"] == 40
    assert dec.kwargs["causal"] is True and dec.kwargs["use_sqrt_alibi"] is False
    assert dec.kwargs["out"].shape == (3, 1, 4, 64)
    h.assert_matches_reference(st, out)


def test_multi_token_decodes_go_to_the_varlen_call_past_the_forks_threshold() -> None:
    st = h.step([(1, 40), (3, 9), (2, 33)])
    out, calls = h.calls_of(st)
    dec, pre = h.only(calls, KVCACHE), h.only(calls, VARLEN)
    assert dec.kwargs["q"].shape == (1, 1, 4, 64)
    assert dec.kwargs["cu_query_lens"].tolist() == [0, 1]
    assert pre.kwargs["cu_seqlens_q"].tolist() == [0, 3, 5]
    assert pre.kwargs["cu_seqlens_k"].tolist() == [0, 9, 42]
    h.assert_matches_reference(st, out)


def test_prefill_offsets_are_rebased_to_zero_after_the_decodes() -> None:
    st = h.step(MIXED)
    out, calls = h.calls_of(st)
    dec, pre = h.only(calls, KVCACHE), h.only(calls, VARLEN)
    assert dec.kwargs["cache_seqlens"].tolist() == [40, 9]
    assert dec.kwargs["block_table"].tolist() == st.batch.block_table[:2].tolist()
    assert pre.args == ()  # every argument by keyword, as the fork passes them
    assert pre.kwargs["q"].shape[0] == 40  # rows 2.. of the step
    assert pre.kwargs["cu_seqlens_q"].tolist() == [0, 3, 23, 40]
    assert pre.kwargs["cu_seqlens_k"].tolist() == [0, 30, 80, 97]  # cumulative, paged cache
    assert (pre.kwargs["max_seqlen_q"], pre.kwargs["max_seqlen_k"]) == (20, 50)
    assert pre.kwargs["block_table"].tolist() == st.batch.block_table[2:].tolist()
    assert pre.kwargs["block_table"].dtype == torch.int32
    assert pre.kwargs["causal"] is True and pre.kwargs["sqrt_alibi"] is False
    # both calls write into the forward's output buffer, each at its own rows
    assert pre.kwargs["out"].data_ptr() == out[2:].data_ptr()
    assert dec.kwargs["out"].data_ptr() == out.data_ptr()


def test_a_decode_after_a_prefill_is_served_by_the_prefill_call() -> None:
    st = h.step([(1, 40), (20, 50), (1, 9)])
    meta = st.backend.metadata_builder().build(st.batch)
    assert meta.decode is not None and meta.decode.num_reqs == 1
    assert meta.prefill is not None and meta.prefill.num_reqs == 2
    out, _ = h.calls_of(st)
    h.assert_matches_reference(st, out)


def test_prefills_only_make_no_decode_call() -> None:
    _, calls = h.calls_of(h.step([(20, 20), (17, 40)]))
    assert _names(calls) == [WRITE, VARLEN]


# --- masks and features --------------------------------------------------------------------------


def test_sliding_window_w_is_window_size_w_minus_1_and_0_in_both_calls() -> None:
    st = h.step(MIXED, h.spec(sliding_window=7))
    out, calls = h.calls_of(st)
    assert h.only(calls, KVCACHE).kwargs["window_size"] == (6, 0)
    assert h.only(calls, VARLEN).kwargs["window_size"] == (6, 0)
    h.assert_matches_reference(st, out)


def test_no_window_is_minus_1_on_both_sides() -> None:
    _, calls = h.calls_of(h.step(MIXED))
    assert h.only(calls, VARLEN).kwargs["window_size"] == (-1, -1)


def test_softcap_scale_and_alibi_slopes_reach_both_calls() -> None:
    s = h.spec(logits_soft_cap=20.0, use_alibi=True, scale=0.1)
    st = h.step(MIXED, s)
    out, calls = h.calls_of(st)
    for c in (h.only(calls, KVCACHE), h.only(calls, VARLEN)):
        assert c.kwargs["softcap"] == 20.0 and c.kwargs["softmax_scale"] == 0.1
        assert torch.equal(c.kwargs["alibi_slopes"], st.alibi_slopes)
        assert c.kwargs["alibi_slopes"].dtype == torch.float32
    h.assert_matches_reference(st, out)


def test_sinks_reach_both_calls_as_the_forks_sinks_keyword() -> None:
    st = h.step(MIXED, h.spec(use_sinks=True, sliding_window=9), padding=2)
    out, calls = h.calls_of(st)
    for c in (h.only(calls, KVCACHE), h.only(calls, VARLEN)):
        assert torch.equal(c.kwargs["sinks"], st.sinks)
    h.assert_matches_reference(st, out)


@pytest.mark.parametrize(
    "attn_type", [AttentionType.ENCODER_ONLY, AttentionType.ENCODER, AttentionType.ENCODER_DECODER]
)
def test_non_causal_steps_are_one_varlen_call_with_causal_false(attn_type: AttentionType) -> None:
    st = h.step([(1, 9), (5, 5), (3, 20)], h.spec(attn_type=attn_type, sliding_window=5))
    out, calls = h.calls_of(st)
    assert _names(calls) == [WRITE, VARLEN]
    pre = h.only(calls, VARLEN)
    assert pre.kwargs["causal"] is False
    assert pre.kwargs["window_size"] == (4, 4)
    assert pre.kwargs["cu_seqlens_q"].tolist() == [0, 1, 6, 9]
    h.assert_matches_reference(st, out)


def test_cross_attention_without_new_keys_only_reads_the_cache() -> None:
    st = h.step([(1, 23), (5, 33)], h.spec(attn_type=AttentionType.ENCODER_DECODER))
    meta = st.backend.metadata_builder().build(st.batch)
    with emulator.record_calls() as calls:
        out = st.backend.impl().forward(st.query, None, None, st.cache, meta)
    assert _names(calls) == [VARLEN]
    h.assert_matches_reference(st, out)


def test_a_decoder_step_marked_non_causal_skips_the_decode_kernel() -> None:
    st = h.step([(1, 9), (5, 5)])
    st.batch = replace(st.batch, causal=False)
    out, calls = h.calls_of(st)
    assert _names(calls) == [WRITE, VARLEN]
    h.assert_matches_reference(st, out)


# --- KV writes -----------------------------------------------------------------------------------


def test_the_write_gets_the_hnd_planes_and_the_real_tokens_slots() -> None:
    st = h.step(MIXED, padding=3)
    _, calls = h.calls_of(st)
    w = h.only(calls, WRITE)
    key, value, key_cache, value_cache, slots, kv_dtype, k_scale, v_scale = w.args
    assert (k_scale, v_scale) == (1.0, 1.0)  # as the fork's vllm._custom_ops passes them
    assert value.shape == key.shape
    assert key_cache is st.cache.key and value_cache is st.cache.value
    assert st.cache.layout == "HND" and key_cache.shape[1:3] == (2, 16)
    n = st.batch.num_actual_tokens
    assert key.shape[0] == n and slots.shape == (n,) and slots.dtype == torch.int64
    assert torch.equal(slots, st.batch.slot_mapping[:n]) and kv_dtype == "auto"


def test_write_kv_passes_the_engines_slots_and_skips_padding() -> None:
    st = h.step([(3, 3)], padding=2)
    impl = st.backend.impl()
    slots = torch.tensor([17, -1, 40, -1, -1])
    expected = testing.cache_after_write(st.cache, st.key, st.value, slots)
    with emulator.record_calls() as calls:
        impl.write_kv(st.key, st.value, st.cache, slots)
    assert h.only(calls, WRITE).args[4] is slots
    assert testing.cache_differences(st.cache, expected, slots) == []


def test_layers_share_the_step_plan() -> None:
    st = h.step(MIXED)
    meta = st.backend.metadata_builder().build(st.batch)
    with emulator.record_calls() as calls:
        for _ in range(3):
            st.backend.impl().forward(st.query, st.key, st.value, st.cache, meta)
    assert meta.decode is not None and meta.prefill is not None
    decodes = [c for c in calls if c.name == KVCACHE]
    prefills = [c for c in calls if c.name == VARLEN]
    assert len(decodes) == len(prefills) == 3
    assert all(c.kwargs["block_table"] is meta.decode.block_table for c in decodes)
    assert all(c.kwargs["cu_seqlens_q"] is meta.prefill.cu_seqlens_q for c in prefills)
    assert all(c.args[4] is meta.slot_mapping for c in calls if c.name == WRITE)


def test_layers_keep_their_own_weights_beside_the_steps_shared_arguments() -> None:
    """Each call's arguments that are the same for every layer are made once per step; each
    layer still passes its own ALiBi slopes and output rows, and a new step its own lengths."""
    st = h.step(MIXED, h.spec(use_alibi=True), padding=2)
    meta = st.backend.metadata_builder().build(st.batch)
    slopes = [testing.alibi_slopes(4), testing.alibi_slopes(4) * 0.5]
    impls = [st.backend.impl(alibi_slopes=a) for a in slopes]
    with emulator.record_calls() as calls:
        outs = [impl.forward(st.query, st.key, st.value, st.cache, meta) for impl in impls]
    for name in (KVCACHE, VARLEN):
        made = [c for c in calls if c.name == name]
        assert len(made) == 2
        for c, impl, out in zip(made, impls, outs, strict=True):
            assert c.kwargs["alibi_slopes"] is impl.alibi_slopes
            assert c.kwargs["out"].untyped_storage().data_ptr() == out.data_ptr()
        assert made[0].kwargs["block_table"] is made[1].kwargs["block_table"]
    for a, out in zip(slopes, outs, strict=True):
        h.assert_matches_reference(replace(st, alibi_slopes=a), out)
    # another step, the same layer: that step's lengths
    st2 = h.step([(1, 20), (1, 3), (20, 20)], st.backend.spec)
    meta2 = st.backend.metadata_builder().build(st2.batch)
    with emulator.record_calls() as calls:
        impls[0].forward(st2.query, st2.key, st2.value, st2.cache, meta2)
    assert h.only(calls, KVCACHE).kwargs["cache_seqlens"].tolist() == [20, 3]
    assert h.only(calls, VARLEN).kwargs["cu_seqlens_k"].tolist() == [0, 20]


# --- cascade -------------------------------------------------------------------------------------


def _shared_prefix_table(requests: list[tuple[int, int]], shared_blocks: int) -> torch.Tensor:
    """Every request's first ``shared_blocks`` blocks are the same (1, 2, ...); the rest its own."""
    width = max(-(-n // 16) for _, n in requests)
    table = torch.zeros(len(requests), width, dtype=torch.int32)
    nxt = shared_blocks + 1
    for r, (_, n) in enumerate(requests):
        table[r, :shared_blocks] = torch.arange(1, shared_blocks + 1)
        own = -(-n // 16) - shared_blocks
        table[r, shared_blocks : shared_blocks + own] = torch.arange(nxt, nxt + own)
        nxt += own
    return table


CASCADE = [(1, 40), (2, 50), (9, 45)]


def test_cascade_is_a_prefix_call_a_suffix_call_and_ixformers_merge() -> None:
    st = h.step(CASCADE, table=_shared_prefix_table(CASCADE, 2))
    out, calls = h.calls_of(st, common_prefix_len=32)
    assert _names(calls) == [WRITE, VARLEN, VARLEN, MERGE]
    prefix, suffix = (c for c in calls if c.name == VARLEN)
    assert prefix.kwargs["cu_seqlens_q"].tolist() == [0, 12]  # every query, one sequence
    assert prefix.kwargs["cu_seqlens_k"].tolist() == [0, 32]
    assert prefix.kwargs["block_table"].tolist() == [[1, 2]]
    assert prefix.kwargs["causal"] is False and prefix.kwargs["return_softmax_lse"] is True
    assert suffix.kwargs["cu_seqlens_q"].tolist() == [0, 1, 3, 12]
    assert suffix.kwargs["cu_seqlens_k"].tolist() == [0, 8, 26, 39]  # seq_len - 32
    assert suffix.kwargs["block_table"].tolist() == st.batch.block_table[:, 2:].tolist()
    assert suffix.kwargs["causal"] is True and suffix.kwargs["return_softmax_lse"] is True
    merge = h.only(calls, MERGE)  # the fork's form: five positional arguments, output last
    assert merge.kwargs == {} and len(merge.args) == 5
    assert merge.args[4].data_ptr() == out.data_ptr()
    h.assert_matches_reference(st, out)


def test_a_prefix_that_ends_inside_a_block_is_rounded_down_to_whole_blocks() -> None:
    st = h.step(CASCADE, table=_shared_prefix_table(CASCADE, 2))
    meta = st.backend.metadata_builder().build(st.batch, common_prefix_len=31)
    assert meta.cascade is not None and meta.cascade.prefix_len == 16
    out = st.backend.impl().forward(st.query, st.key, st.value, st.cache, meta)
    h.assert_matches_reference(st, out)


@pytest.mark.parametrize(
    "changes",
    [dict(sliding_window=20), dict(use_alibi=True), dict(use_sinks=True)],
    ids=["window", "alibi", "sinks"],
)
def test_position_dependent_scores_take_the_regular_path_under_a_shared_prefix(
    changes: dict[str, object],
) -> None:
    st = h.step(CASCADE, h.spec(**changes), table=_shared_prefix_table(CASCADE, 2))
    out, calls = h.calls_of(st, common_prefix_len=32)
    assert MERGE not in _names(calls)
    h.assert_matches_reference(st, out)


# --- no host reads in forward --------------------------------------------------------------------


def test_forward_and_write_kv_read_no_device_tensor_on_the_host() -> None:
    """With every check on: the step's values were checked by build, on host copies. The
    emulated ops are the device (emulator.py is marked ``__attnhub_device_code__``)."""
    hostsync = pytest.importorskip("attnhub_conformance.hostsync")
    cases = [
        (h.spec(), MIXED, None, 0),
        (h.spec(sliding_window=9, logits_soft_cap=10.0), MIXED, None, 0),
        (h.spec(attn_type=AttentionType.ENCODER), [(3, 9), (5, 5)], None, 0),
        (h.spec(), CASCADE, _shared_prefix_table(CASCADE, 2), 32),
    ]
    for s, requests, table, prefix in cases:
        st = h.step(requests, s, padding=2, table=table)
        meta = st.backend.metadata_builder().build(st.batch, common_prefix_len=prefix)
        impl = st.backend.impl()
        out = hostsync.run_layer_guarded(impl, st.query, st.key, st.value, st.cache, meta)
        h.assert_matches_reference(st, out)


# --- bad input -----------------------------------------------------------------------------------


def test_metadata_of_another_kind_is_refused_before_anything_is_written() -> None:
    st = h.step(MIXED)
    before = st.cache.clone()
    with pytest.raises(InvalidInputError, match="must come from the iluvatar backend"):
        st.backend.impl().forward(
            st.query, st.key, st.value, st.cache, AttentionMetadata(batch=st.batch)
        )
    assert st.cache.equal(before)


def test_a_slot_outside_the_cache_is_refused_naming_it() -> None:
    st = h.step([(3, 3)])
    before = st.cache.clone()
    bad = st.cache.num_slots + 5
    with pytest.raises(InvalidInputError, match=str(bad)):
        st.backend.impl().write_kv(st.key, st.value, st.cache, torch.tensor([1, bad, 2]))
    assert st.cache.equal(before)


def test_an_nhd_cache_is_refused_naming_the_layout() -> None:
    st = h.step([(3, 3)])
    meta = st.backend.metadata_builder().build(st.batch)
    nhd = replace(
        st.cache,
        key=st.cache.key.transpose(1, 2).contiguous(),
        value=st.cache.value.transpose(1, 2).contiguous(),
        layout="NHD",
    )
    before = nhd.clone()
    with pytest.raises(InvalidInputError, match="'NHD'"):
        st.backend.impl().forward(st.query, st.key, st.value, nhd, meta)
    assert nhd.equal(before)


def test_strided_planes_are_refused_before_the_write() -> None:
    st = h.step([(1, 23), (5, 33)])
    meta = st.backend.metadata_builder().build(st.batch)
    d = st.key.shape[-1]
    doubled = torch.zeros((*st.cache.key.shape[:-1], 2 * d), dtype=st.cache.key.dtype)
    strided = replace(st.cache, key=doubled[..., :d], value=doubled[..., d:])
    before = strided.clone()
    with pytest.raises(InvalidInputError, match="contiguous"):
        st.backend.impl().write_kv(st.key, st.value, strided, meta=meta)
    assert strided.equal(before)


@pytest.mark.parametrize(
    "requests",
    [
        [(1, 30), (3, 40), (1, 9), (40, 60), (17, 17)],  # decodes, then prefills
        [(2, 9), (1, 50), (5, 5)],  # a multi-token decode among them
        [(20, 20), (1, 33)],  # a prefill first: everything through the prefill call
        [(1, 3), (1, 70)],  # decodes only
    ],
)
def test_the_plan_from_builds_lengths_is_the_plan_from_the_batch(
    requests: list[tuple[int, int]],
) -> None:
    """build hands its checks' host lengths to plan; planning the same batch from its own
    host copies (structural checks: no lengths read before) gives the same kernel arguments."""
    st = h.step(requests, padding=2)
    built = st.backend.metadata_builder().build(st.batch)
    structural = st.backend.metadata_builder()
    structural.checks = "structural"
    step = structural.check_step(st.batch)
    assert step.facts.query_lens is None
    direct = structural.plan(step)
    for part in ("decode", "prefill"):
        a, b = getattr(built, part), direct.get(part)
        assert (a is None) == (b is None), part
        if a is None:
            continue
        for name in a.__dataclass_fields__:
            x, y = getattr(a, name), getattr(b, name)
            if name == "kwargs":  # the call's keyword arguments, made of the fields above
                assert x.keys() == y.keys()
                for key, value in x.items():
                    same = torch.equal if isinstance(value, torch.Tensor) else (lambda u, v: u == v)
                    assert same(value, y[key]), (part, key)
            elif isinstance(x, torch.Tensor):
                assert isinstance(y, torch.Tensor)
                assert x.dtype == y.dtype == torch.int32 and torch.equal(x, y), (part, name)
            else:
                assert x == y, (part, name)
