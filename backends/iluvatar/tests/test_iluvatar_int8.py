"""The int8 caches (ixformer's quant modes 1 and 2, attnhub's ``int8`` and ``int8_k``):
translation rules on the recorded calls, the outputs against ``attnhub.reference`` on the
same quantized inputs (the query as the kernels quantize it, the cache as stored) and against
attention over the unquantized inputs within the declared accuracy, mode 2's packed storage."""

from __future__ import annotations

from dataclasses import replace

import iluvatar_helpers as h
import pytest
import torch
from attnhub_iluvatar import IluvatarBackend, emulator

import attnhub
from attnhub import PagedKVCache, reference, testing
from attnhub.errors import InvalidInputError
from attnhub.spec import AttentionType

QUANT = "inference.functions.scaled_int8_quant_for_attn"
WRITE_INT8 = "inference.functions.reshape_and_cache_flash_int8"
WRITE_MIX = "inference.functions.reshape_and_cache_flash_mix"
PAGED_INT8 = "inference.functions.vllm_paged_attention_int8"
PAGED_MIX = "inference.functions.vllm_paged_attention_mix"
VARLEN_INT8 = "contrib.vllm_flash_attn.flash_attn_varlen_int8_func"
MERGE = "contrib.vllm_flash_attn.merge_attn_states"

MIXED = [(1, 40), (1, 9), (3, 30), (20, 50), (17, 17)]
DECODES = [(1, 40), (1, 9), (1, 33)]


def _step(requests: list[tuple[int, int]], kv: str, **changes: object) -> h.Step:
    return h.step(requests, h.spec(kv_cache_dtype=kv, **changes), padding=2)


def _run(st: h.Step, meta: object = None) -> tuple[torch.Tensor, list[emulator.Call], PagedKVCache]:
    """forward, its calls, and the cache the reference write gives."""
    expected = testing.cache_after_write(st.cache, st.key, st.value, st.batch.slot_mapping)
    meta = meta or st.backend.metadata_builder().build(st.batch)
    with emulator.record_calls() as calls:
        out = st.backend.impl(alibi_slopes=st.alibi_slopes).forward(
            st.query, st.key, st.value, st.cache, meta
        )
    return out, calls, expected


def _assert_matches_quantized_reference(st: h.Step, out: torch.Tensor) -> None:
    """The reference over the cache as stored, for the query as the kernels quantize it (per
    token and head, amax / 127)."""
    n = st.batch.num_actual_tokens
    spec = st.backend.spec
    q = testing.quantized_query(st.query[:n], st.backend.capabilities, spec.kv_cache_dtype)
    assert not torch.equal(q, st.query[:n].double())  # the kernels' query is quantized
    want, _ = reference.paged_attention(q, st.cache, st.batch, spec, alibi_slopes=st.alibi_slopes)
    tol = st.backend.capabilities.tolerance(st.backend.spec.dtype)
    testing.assert_within(out[:n], want, tol, f"{st.backend.spec.kv_cache_dtype}", batch=st.batch)
    assert (out[n:] == 0).all()


def _names(calls: list[emulator.Call]) -> list[str]:
    return [c.name for c in calls]


# --- mode 1: int8 Q, K, V ------------------------------------------------------------------------


def test_mode_1_mixed_step_quantizes_writes_then_decodes_and_prefills() -> None:
    st = _step(MIXED, "int8")
    out, calls, expected = _run(st)
    assert _names(calls) == [QUANT, QUANT, WRITE_INT8, QUANT, PAGED_INT8, QUANT, VARLEN_INT8]
    assert testing.cache_differences(st.cache, expected, st.batch.slot_mapping) == []
    _assert_matches_quantized_reference(st, out)


def test_mode_1_keys_are_quantized_per_token_and_values_with_the_static_scale() -> None:
    st = _step(MIXED, "int8")
    _, calls, _ = _run(st)
    key_q, value_q = [c for c in calls if c.name == QUANT][:2]
    assert key_q.args[1] == 2 and "scale" not in key_q.kwargs
    assert value_q.args[1] == 0 and value_q.kwargs["scale"] is st.cache.value_scale
    w = h.only(calls, WRITE_INT8)
    assert w.args == ()  # by keyword, as the fork writes
    n = st.batch.num_actual_tokens
    assert w.kwargs["k_scale"].shape == (n, 2)  # k_scale per (token, kv head)
    assert w.kwargs["key_scale_cache"] is st.cache.key_scale
    assert w.kwargs["kv_cache_dtype"] == ""  # the fork's value


def test_mode_1_prefill_query_scales_go_transposed() -> None:
    st = _step(MIXED, "int8")
    _, calls, _ = _run(st)
    pre = h.only(calls, VARLEN_INT8)
    # the 3-token decode, the chunked prefill and the fresh prefill: 40 tokens
    assert pre.args == ()  # by keyword, as the fork calls it
    assert pre.kwargs["q_scale"].shape == (4, 40)  # (H, T)
    assert pre.kwargs["k_scale"] is st.cache.key_scale
    assert pre.kwargs["v_scale"] is st.cache.value_scale
    assert pre.kwargs["cu_seqlens_q"].tolist() == [0, 3, 23, 40]
    assert pre.kwargs["output_dtype"] == torch.bfloat16


def test_mode_1_multi_token_decodes_go_to_the_varlen_kernel() -> None:
    st = _step(MIXED, "int8")
    _, calls, _ = _run(st)
    dec = h.only(calls, PAGED_INT8)
    assert dec.args == ()  # every argument by keyword, as the fork passes them
    assert dec.kwargs["query"].shape == (2, 4, 64)  # the two one-token decodes only
    assert dec.kwargs["context_lens"].tolist() == [40, 9]
    assert dec.kwargs["query_scale"].shape == (2, 4)  # query scale (T, H)
    assert dec.kwargs["cu_query_lens"].tolist() == [0, 1, 2]
    assert dec.kwargs["max_query_len"] == 1 and dec.kwargs["max_context_len"] == 40
    assert dec.kwargs["use_cuda_graph"] is False and dec.kwargs["use_sqrt_alibi"] is False
    assert "enable_cuda_graph" not in dec.kwargs


def test_mode_1_decode_only_steps_fuse_the_write_into_the_paged_kernel() -> None:
    st = _step(DECODES, "int8")
    out, calls, expected = _run(st)
    assert _names(calls) == [QUANT, QUANT, QUANT, PAGED_INT8]
    dec = h.only(calls, PAGED_INT8)
    assert dec.kwargs["save_key"].dtype == torch.int8 and dec.kwargs["save_key"].shape == (3, 2, 64)
    assert dec.kwargs["save_value"].dtype == torch.int8
    assert dec.kwargs["save_key_scale"].shape == (3, 2)
    assert testing.cache_differences(st.cache, expected, st.batch.slot_mapping) == []
    _assert_matches_quantized_reference(st, out)


def test_write_kv_with_the_steps_metadata_writes_through_the_separate_op() -> None:
    st = _step(DECODES, "int8")
    meta = st.backend.metadata_builder().build(st.batch)
    assert meta.fused_write
    with emulator.record_calls() as calls:
        st.backend.impl().write_kv(st.key, st.value, st.cache, meta=meta)
    assert WRITE_INT8 in _names(calls)


def test_slots_other_than_the_derived_positions_are_not_fused() -> None:
    st = _step(DECODES, "int8")
    free = int(st.cache.num_slots - 1)  # the last block is never in the table
    slots = st.batch.slot_mapping.clone()
    slots[1] = free
    st = replace(st, batch=replace(st.batch, slot_mapping=slots))
    meta = st.backend.metadata_builder().build(st.batch)
    assert not meta.fused_write
    out, calls, expected = _run(st, meta)
    assert WRITE_INT8 in _names(calls)
    assert testing.cache_differences(st.cache, expected, slots) == []
    _assert_matches_quantized_reference(st, out)


@pytest.mark.parametrize(
    "changes",
    [dict(sliding_window=7), dict(logits_soft_cap=5.0, use_alibi=True)],
    ids=["window", "softcap_alibi"],
)
def test_mode_1_features_reach_both_kernels(changes: dict[str, object]) -> None:
    st = _step(MIXED, "int8", **changes)
    out, calls, _ = _run(st)
    dec, pre = h.only(calls, PAGED_INT8), h.only(calls, VARLEN_INT8)
    if "sliding_window" in changes:
        assert (dec.kwargs["window_left"], dec.kwargs["window_right"]) == (6, 0)
        assert pre.kwargs["window_size"] == (6, 0)
    else:
        assert dec.kwargs["softcap"] == 5.0 and pre.kwargs["softcap"] == 5.0
    _assert_matches_quantized_reference(st, out)


def test_mode_1_non_causal_steps_are_one_varlen_call() -> None:
    st = _step([(3, 9), (5, 5)], "int8", attn_type=AttentionType.ENCODER)
    out, calls, _ = _run(st)
    assert PAGED_INT8 not in _names(calls)
    assert h.only(calls, VARLEN_INT8).kwargs["causal"] is False
    _assert_matches_quantized_reference(st, out)


# --- mode 2: int8 Q and K, V in the model dtype -------------------------------------------------


def test_mode_2_cache_is_one_packed_int8_storage_with_v_in_planes_1_and_2() -> None:
    b = h.backend(h.spec(kv_cache_dtype="int8_k"))
    cache = b.allocate_kv_cache(4)
    shape = (4, 2, 16, 64)
    assert cache.key.dtype == torch.int8 and tuple(cache.key.shape) == shape
    assert cache.value.dtype == torch.bfloat16 and tuple(cache.value.shape) == shape
    storage = cache.key.untyped_storage()
    assert storage.data_ptr() == cache.value.untyped_storage().data_ptr()
    assert storage.nbytes() == 3 * 4 * 2 * 16 * 64  # (3, num_blocks, Hkv, block_size, D) int8
    assert cache.value.data_ptr() == storage.data_ptr() + 4 * 2 * 16 * 64  # plane 1 onwards
    packed = torch.empty(0, dtype=torch.int8).set_(storage).view(3, *shape)
    cache.value[1, 0, 3, 5] = 1.5
    want = torch.tensor([1.5], dtype=torch.bfloat16).view(torch.int8)
    flat = packed[1:].reshape(-1)
    at = ((1 * 2 + 0) * 16 + 3) * 64 + 5  # element index of value[1, 0, 3, 5]
    assert torch.equal(flat[2 * at : 2 * at + 2], want)
    assert cache.key_scale is not None and tuple(cache.key_scale.shape) == shape[:3]


def test_mode_2_prefills_go_to_the_varlen_int8_kernel_with_the_16_bit_values() -> None:
    """The fork runs mode 2's prefills through flash_attn_varlen_int8_func with its 16-bit value
    cache and v_scale=None [callers], its decodes through vllm_paged_attention_mix."""
    st = _step([(1, 20), (3, 18)], "int8_k")
    out, calls, expected = _run(st)
    assert _names(calls) == [QUANT, WRITE_MIX, QUANT, PAGED_MIX, QUANT, VARLEN_INT8]
    dec, pre = h.only(calls, PAGED_MIX), h.only(calls, VARLEN_INT8)
    assert dec.kwargs["context_lens"].tolist() == [20]
    assert "value_scale_cache" not in dec.kwargs and dec.kwargs["value_cache"] is st.cache.value
    assert pre.kwargs["v"] is st.cache.value and pre.kwargs["v_scale"] is None
    assert pre.kwargs["cu_seqlens_q"].tolist() == [0, 3]
    assert pre.kwargs["cu_seqlens_k"].tolist() == [0, 18]
    assert testing.cache_differences(st.cache, expected, st.batch.slot_mapping) == []
    _assert_matches_quantized_reference(st, out)


def test_mode_2_writes_values_unquantized() -> None:
    st = _step(MIXED, "int8_k")
    out, calls, _ = _run(st)
    w = h.only(calls, WRITE_MIX)
    n = st.batch.num_actual_tokens
    assert torch.equal(w.kwargs["value"], st.value[:n])
    assert w.kwargs["value_cache"] is st.cache.value and w.kwargs["kv_cache_dtype"] == ""
    _assert_matches_quantized_reference(st, out)


def test_mode_2_decode_only_steps_fuse_the_write() -> None:
    st = _step(DECODES, "int8_k", sliding_window=9)
    out, calls, expected = _run(st)
    assert _names(calls) == [QUANT, QUANT, PAGED_MIX]
    save_value = h.only(calls, PAGED_MIX).kwargs["save_value"]
    assert save_value.dtype == torch.bfloat16 and save_value.is_contiguous()  # as the fork's
    assert testing.cache_differences(st.cache, expected, st.batch.slot_mapping) == []
    _assert_matches_quantized_reference(st, out)


@pytest.mark.parametrize(
    "changes", [dict(), dict(sliding_window=5, use_alibi=True)], ids=["plain", "window_alibi"]
)
def test_mode_2_non_causal_steps_are_one_varlen_call_with_windows_and_alibi(
    changes: dict[str, object],
) -> None:
    """Mode 2 has the varlen kernel (the fork calls it with the 16-bit values), so non-causal
    layers keep their window and ALiBi, as in mode 1."""
    s = h.spec(kv_cache_dtype="int8_k", attn_type=AttentionType.ENCODER_ONLY, **changes)
    assert IluvatarBackend.unsupported_reasons(s) == []
    st = h.step([(3, 9), (5, 5)], s, padding=2)
    out, calls, _ = _run(st)
    assert PAGED_MIX not in _names(calls)
    pre = h.only(calls, VARLEN_INT8)
    assert pre.kwargs["causal"] is False and pre.kwargs["v_scale"] is None
    _assert_matches_quantized_reference(st, out)


# --- both modes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kv", ["int8", "int8_k"])
def test_shared_prefixes_take_the_regular_path(kv: str) -> None:
    """No int8 kernel returns an LSE (flash_attn_varlen_int8_func and the paged kernels take
    no return_softmax_lse [callers]), so there is nothing to merge: a step built with a shared
    prefix is served by the regular int8 calls, which compute the same attention."""
    table = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 6]], dtype=torch.int32)  # 2 blocks shared
    st = h.step([(1, 40), (2, 50)], h.spec(kv_cache_dtype=kv), padding=2, table=table)
    meta = st.backend.metadata_builder().build(st.batch, common_prefix_len=32)
    assert meta.cascade is None
    out, calls, expected = _run(st, meta)
    assert MERGE not in _names(calls)
    assert testing.cache_differences(st.cache, expected, st.batch.slot_mapping) == []
    _assert_matches_quantized_reference(st, out)


@pytest.mark.parametrize("kv", ["int8", "int8_k"])
def test_accuracy_against_unquantized_attention(kv: str) -> None:
    """Fresh prefills (every key written by this step) against float64 attention over the
    unquantized q, k, v: the int8 rounding of Q, K (and V) stays within the declared bound."""
    s = h.spec(kv_cache_dtype=kv, dtype=torch.float16)
    b = h.backend(s)
    bound = b.capabilities.accuracy_bound(kv)
    g = testing.generator(5)
    batch, nb = testing.make_batch([9, 40], [9, 40], 16, seed=g)
    q, k, v = testing.random_qkv(s, batch.num_tokens, g)
    cache = b.allocate_kv_cache(nb)
    if kv == "int8":  # the static value scale an engine loads: amax / 127 per channel
        assert cache.value_scale is not None
        cache.value_scale.copy_(v.float().abs().amax(dim=0) / 127)
    out = b.impl().forward(q, k, v, cache, b.metadata_builder().build(batch))
    want = torch.cat(
        [
            reference.attention(q[a:e], k[a:e], v[a:e], scale=s.scale)[0]
            for a, e in zip(
                batch.query_start_loc_cpu[:-1].tolist(),
                batch.query_start_loc_cpu[1:].tolist(),
                strict=True,
            )
        ]
    )
    why = testing.accuracy_mismatch(out, want, bound, batch)
    assert why is None, f"{kv}: {why}"
    err, cos = testing.accuracy(out, want)
    assert err > 0 and cos < 1  # quantization shows: the comparison is not vacuous


@pytest.mark.parametrize("requests", [MIXED, DECODES], ids=["mixed", "decode_only"])
@pytest.mark.parametrize("kv", ["int8", "int8_k"])
def test_forward_and_write_kv_read_no_device_tensor_on_the_host(
    kv: str, requests: list[tuple[int, int]]
) -> None:
    """A step after the first: mode 1's static value scale is read on the host once, when the
    layer first sees it (an engine's first or profiling step), and never again until it
    changes."""
    hostsync = pytest.importorskip("attnhub_conformance.hostsync")
    st = _step(requests, kv)
    meta = st.backend.metadata_builder().build(st.batch)
    impl = st.backend.impl()
    impl.forward(st.query, st.key, st.value, st.cache, meta)  # the first step
    out = hostsync.run_layer_guarded(impl, st.query, st.key, st.value, st.cache, meta)
    _assert_matches_quantized_reference(st, out)


def test_a_changed_value_scale_is_checked_again() -> None:
    hostsync = pytest.importorskip("attnhub_conformance.hostsync")
    st = _step(DECODES, "int8")
    meta = st.backend.metadata_builder().build(st.batch)
    impl = st.backend.impl()
    impl.forward(st.query, st.key, st.value, st.cache, meta)
    assert st.cache.value_scale is not None
    st.cache.value_scale.mul_(1.5)  # the engine reloads its weights
    with pytest.raises(hostsync.HostSyncError):  # the new values are read once more
        hostsync.run_layer_guarded(impl, st.query, st.key, st.value, st.cache, meta)
    st.cache.value_scale[1, 7] = float("inf")
    before = st.cache.clone()
    with pytest.raises(InvalidInputError, match=r"value_scale\[1, 7\] = inf"):
        impl.forward(st.query, st.key, st.value, st.cache, meta)
    assert st.cache.equal(before)


def test_an_impl_serving_two_layers_reads_each_value_scale_once() -> None:
    # Regression: the impl remembered the last cache's value scale only, so one impl called
    # with two layers' caches in turn read a value scale on the host at every call
    hostsync = pytest.importorskip("attnhub_conformance.hostsync")
    st, other = _step(DECODES, "int8"), _step(DECODES, "int8")
    meta = st.backend.metadata_builder().build(st.batch)
    impl = st.backend.impl()
    impl.forward(st.query, st.key, st.value, st.cache, meta)  # each cache's first sight
    impl.forward(st.query, st.key, st.value, other.cache, meta)
    for cache in (st.cache, other.cache, st.cache):
        hostsync.run_layer_guarded(impl, st.query, st.key, st.value, cache, meta)


def test_a_value_scale_made_under_inference_mode_is_served_and_checked() -> None:
    # Regression: engines run steps under torch.inference_mode, and a value scale made there
    # is an inference tensor, with no version counter: the once-per-change check read it and
    # failed with torch's RuntimeError instead of serving the step.
    with torch.inference_mode():
        st = _step(DECODES, "int8")
        assert st.cache.value_scale is not None and st.cache.value_scale.is_inference()
        meta = st.backend.metadata_builder().build(st.batch)
        out, _, expected = _run(st, meta)
        _assert_matches_quantized_reference(st, out)
        assert st.cache.equal(expected)
        bad = st.cache.value_scale.clone()
        bad[0, 5] = float("nan")
        cache = replace(st.cache, value_scale=bad)  # another tensor: its values are read
        before = cache.clone()
        with pytest.raises(InvalidInputError, match=r"value_scale\[0, 5\] = nan"):
            st.backend.impl().forward(st.query, st.key, st.value, cache, meta)
        assert cache.equal(before)


# --- bad input to the int8 paths: a typed error naming the value, the cache untouched --------


def _bad_scale_cases() -> list[object]:
    def missing_v(c: PagedKVCache) -> PagedKVCache:
        return replace(c, value_scale=None)

    def v_shape(c: PagedKVCache) -> PagedKVCache:
        return replace(c, value_scale=torch.ones(2, 65))

    def v_per_head(c: PagedKVCache) -> PagedKVCache:
        return replace(c, value_scale=torch.ones(2))

    def v_dtype(c: PagedKVCache) -> PagedKVCache:
        assert c.value_scale is not None
        return replace(c, value_scale=c.value_scale.to(torch.float16))

    def v_nan(c: PagedKVCache) -> PagedKVCache:
        assert c.value_scale is not None
        c.value_scale[0, 3] = float("nan")
        return c

    def v_strided(c: PagedKVCache) -> PagedKVCache:
        assert c.value_scale is not None
        return replace(c, value_scale=c.value_scale.t().contiguous().t())

    def k_missing(c: PagedKVCache) -> PagedKVCache:
        return replace(c, key_scale=None)

    def k_shape(c: PagedKVCache) -> PagedKVCache:
        assert c.key_scale is not None
        return replace(c, key_scale=c.key_scale[:, :, :8].contiguous())

    def k_nhd(c: PagedKVCache) -> PagedKVCache:  # the NHD layout of the same plane
        assert c.key_scale is not None
        return replace(c, key_scale=c.key_scale.transpose(1, 2).contiguous())

    return [
        pytest.param("int8", missing_v, "value_scale, which is None", id="int8-v_scale_missing"),
        pytest.param("int8", v_shape, r"value_scale must be float32 \(2, 64\)", id="int8-v_shape"),
        pytest.param("int8", v_per_head, r"got torch.float32 \(2,\)", id="int8-v_per_head"),
        pytest.param("int8", v_dtype, "got torch.float16", id="int8-v_scale_dtype"),
        pytest.param("int8", v_nan, r"value_scale\[0, 3\] = nan", id="int8-v_scale_nan"),
        pytest.param("int8", v_strided, "value_scale must be contiguous", id="int8-v_strided"),
        pytest.param("int8", k_missing, "key_scale, which is None", id="int8-k_scale_missing"),
        pytest.param("int8_k", k_missing, "key_scale, which is None", id="int8_k-k_missing"),
        pytest.param(
            "int8",
            k_shape,
            r"key_scale must be float32 \(\d+, 2, 16\).*got torch.float32 \(\d+, 2, 8\)",
            id="int8-k_shape",
        ),
        pytest.param("int8_k", k_nhd, r"got torch.float32 \(\d+, 16, 2\)", id="int8_k-k_nhd"),
    ]


@pytest.mark.parametrize("entry", ["forward", "write_kv", "write_kv_step", "decode_fused"])
@pytest.mark.parametrize(("kv", "break_cache", "words"), _bad_scale_cases())
def test_bad_scales_are_refused_naming_the_value_and_the_cache_is_untouched(
    kv: str, break_cache: object, words: str, entry: str
) -> None:
    st = _step(DECODES if entry == "decode_fused" else MIXED, kv)
    cache = break_cache(st.cache)  # type: ignore[operator]
    before = cache.clone()
    impl = st.backend.impl()
    meta = st.backend.metadata_builder().build(st.batch)
    assert meta.fused_write == (entry == "decode_fused")
    with emulator.record_calls() as calls, pytest.raises(InvalidInputError, match=words):
        if entry == "write_kv":
            impl.write_kv(st.key, st.value, cache, st.batch.slot_mapping)
        elif entry == "write_kv_step":
            impl.write_kv(st.key, st.value, cache, meta=meta)
        else:
            impl.forward(st.query, st.key, st.value, cache, meta)
    assert calls == []  # refused before any vendor op ran
    assert cache.equal(before)


MODES = ("auto", "int8", "int8_k")


@pytest.mark.parametrize(("kv", "other"), [(a, b) for a in MODES for b in MODES if a != b])
def test_a_cache_of_another_mode_is_refused_naming_both(kv: str, other: str) -> None:
    st = _step(MIXED, kv)
    other_backend = h.backend(h.spec(kv_cache_dtype=other))
    cache = other_backend.allocate_kv_cache(st.cache.num_blocks)
    testing.fill_cache_random(cache, testing.generator(9))
    before = cache.clone()
    meta = st.backend.metadata_builder().build(st.batch)
    with pytest.raises(InvalidInputError, match=f"cache kv_cache_dtype is '{other}'.*'{kv}'"):
        st.backend.impl().forward(st.query, st.key, st.value, cache, meta)
    assert cache.equal(before)


def test_a_mode_1_cache_relabelled_as_mode_2_is_refused_by_its_storage() -> None:
    st = _step(MIXED, "int8_k")
    mode1 = h.backend(h.spec(kv_cache_dtype="int8")).allocate_kv_cache(st.cache.num_blocks)
    cache = replace(mode1, kv_cache_dtype="int8_k", value_scale=None)
    before = cache.clone()
    meta = st.backend.metadata_builder().build(st.batch)
    with pytest.raises(InvalidInputError, match=r"torch.int8/torch.int8.*'int8_k' needs"):
        st.backend.impl().forward(st.query, st.key, st.value, cache, meta)
    assert cache.equal(before)


def test_the_registered_backend_declares_the_int8_caches_with_their_query_quantization() -> None:
    caps = attnhub.get_backend("iluvatar").capabilities
    assert {"int8", "int8_k"} <= caps.kv_cache_dtypes
    assert caps.query_quantization == {
        "int8": "int8_per_token_head",
        "int8_k": "int8_per_token_head",
    }
    assert set(caps.quantization_accuracy) == {"int8", "int8_k"}


# --- mode 2's packed storage -----------------------------------------------------------------


def _packed(cache: PagedKVCache) -> torch.Tensor:  # the (3, nb, Hkv, bs, D) int8 storage
    n, hkv, bs, d = cache.key.shape
    storage = cache.key.untyped_storage()
    return torch.empty(0, dtype=torch.int8).set_(storage).view(3, n, hkv, bs, d)


def test_mode_2_packed_cache_round_trips_bit_exactly_through_the_views() -> None:
    """Every byte of the vendor's storage is reachable through attnhub's key / value views:
    read out through them and written back, the storage is bit-identical (16-bit NaN and
    subnormal patterns included)."""
    cache = h.backend(h.spec(kv_cache_dtype="int8_k")).allocate_kv_cache(5)
    packed = _packed(cache)
    raw = torch.randint(-128, 128, packed.shape, generator=testing.generator(3), dtype=torch.int8)
    packed.copy_(raw)
    assert torch.equal(cache.key, raw[0])
    assert torch.equal(cache.value.reshape(-1).view(torch.int8), raw[1:].reshape(-1))
    assert cache.key_scale is not None
    scale = torch.rand(cache.key_scale.shape, generator=testing.generator(4))
    cache.key_scale.copy_(scale)
    key, value, key_scale = cache.key.clone(), cache.value.clone(), cache.key_scale.clone()
    packed.zero_()
    cache.key_scale.zero_()
    cache.key.copy_(key)
    cache.value.copy_(value)
    cache.key_scale.copy_(key_scale)
    assert torch.equal(packed, raw)
    assert torch.equal(cache.key_scale.view(torch.int32), scale.view(torch.int32))


def test_mode_2_writes_land_in_the_packed_planes_as_the_views_say() -> None:
    """A step's write, read back from the raw storage: plane 0 holds the reference's int8
    keys, planes 1-2 the values' 16-bit patterns; nothing else changed."""
    st = _step(MIXED, "int8_k")
    before = _packed(st.cache).clone()
    _, _, expected = _run(st)
    packed = _packed(st.cache)
    assert torch.equal(packed[0], expected.key)
    assert torch.equal(packed[1:].reshape(-1), expected.value.reshape(-1).view(torch.int8))
    assert not torch.equal(packed, before)
