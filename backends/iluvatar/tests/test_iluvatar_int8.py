"""The int8 caches (ixformer's quant modes 1 and 2, attnhub's ``int8`` and ``int8_k``):
translation rules on the recorded calls, and the outputs against ``attnhub.reference`` on the
same quantized inputs (the query as the kernels quantize it, the cache as stored)."""

from __future__ import annotations

from dataclasses import replace

import iluvatar_helpers as h
import pytest
import torch
from attnhub_iluvatar import IluvatarInt8Backend, emulator

from attnhub import AttentionSpec, PagedKVCache, reference, testing
from attnhub.errors import UnsupportedConfigurationError
from attnhub.quant import quantize_int8_dynamic
from attnhub.spec import AttentionType

QUANT = "inference.functions.scaled_int8_quant_for_attn"
WRITE_INT8 = "inference.functions.reshape_and_cache_flash_int8"
WRITE_MIX = "inference.functions.reshape_and_cache_flash_mix"
PAGED_INT8 = "inference.functions.vllm_paged_attention_int8"
PAGED_MIX = "inference.functions.vllm_paged_attention_mix"
VARLEN_INT8 = "contrib.vllm_flash_attn.flash_attn_varlen_int8_func"

MIXED = [(1, 40), (1, 9), (3, 30), (20, 50), (17, 17)]
DECODES = [(1, 40), (1, 9), (1, 33)]


def _step(requests: list[tuple[int, int]], kv: str, **changes: object) -> h.Step:
    return h.step(
        requests, h.spec(kv_cache_dtype=kv, **changes), padding=2, cls=IluvatarInt8Backend
    )


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
    q8, scale = quantize_int8_dynamic(st.query[:n], dim=-1)
    want, _ = reference.paged_attention(
        q8.double() * scale, st.cache, st.batch, st.backend.spec, alibi_slopes=st.alibi_slopes
    )
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
    assert w.args[2].shape == (st.batch.num_actual_tokens, 2)  # k_scale per (token, kv head)
    assert w.args[5] is st.cache.key_scale and w.args[7] == "int8"


def test_mode_1_prefill_query_scales_go_transposed() -> None:
    st = _step(MIXED, "int8")
    _, calls, _ = _run(st)
    pre = h.only(calls, VARLEN_INT8)
    # the 3-token decode, the chunked prefill and the fresh prefill: 40 tokens
    assert pre.args[3].shape == (4, 40)  # (H, T)
    assert pre.args[4] is st.cache.key_scale and pre.args[5] is st.cache.value_scale
    assert pre.kwargs["cu_seqlens_q"].tolist() == [0, 3, 23, 40]
    assert pre.kwargs["output_dtype"] == torch.bfloat16


def test_mode_1_multi_token_decodes_go_to_the_varlen_kernel() -> None:
    st = _step(MIXED, "int8")
    _, calls, _ = _run(st)
    dec = h.only(calls, PAGED_INT8)
    assert dec.args[1].shape == (2, 4, 64)  # the two one-token decodes only
    assert dec.kwargs["context_lens"].tolist() == [40, 9]
    assert dec.args[4].shape == (2, 4)  # query scale (T, H)


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
    b = IluvatarInt8Backend(h.spec(kv_cache_dtype="int8_k"), "cpu", emulate=True)
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


def test_mode_2_serves_every_query_token_as_its_own_paged_sequence() -> None:
    st = _step([(1, 20), (3, 18)], "int8_k")
    out, calls, expected = _run(st)
    assert _names(calls) == [QUANT, WRITE_MIX, QUANT, PAGED_MIX]
    dec = h.only(calls, PAGED_MIX)
    assert dec.kwargs["context_lens"].tolist() == [20, 16, 17, 18]  # each token's position + 1
    table = st.batch.block_table
    assert dec.kwargs["block_tables"].tolist() == [table[i].tolist() for i in (0, 1, 1, 1)]
    assert dec.kwargs["causal"] is True
    assert testing.cache_differences(st.cache, expected, st.batch.slot_mapping) == []
    _assert_matches_quantized_reference(st, out)


def test_mode_2_writes_values_unquantized() -> None:
    st = _step(MIXED, "int8_k")
    out, calls, _ = _run(st)
    w = h.only(calls, WRITE_MIX)
    n = st.batch.num_actual_tokens
    assert torch.equal(w.args[1], st.value[:n]) and w.args[4] is st.cache.value
    _assert_matches_quantized_reference(st, out)


def test_mode_2_decode_only_steps_fuse_the_write() -> None:
    st = _step(DECODES, "int8_k", sliding_window=9)
    out, calls, expected = _run(st)
    assert _names(calls) == [QUANT, QUANT, PAGED_MIX]
    assert h.only(calls, PAGED_MIX).kwargs["save_value"].dtype == torch.bfloat16
    assert testing.cache_differences(st.cache, expected, st.batch.slot_mapping) == []
    _assert_matches_quantized_reference(st, out)


def test_mode_2_non_causal_tokens_see_their_whole_sequence() -> None:
    st = _step([(3, 9), (5, 5)], "int8_k", attn_type=AttentionType.ENCODER)
    out, calls, _ = _run(st)
    assert h.only(calls, PAGED_MIX).kwargs["context_lens"].tolist() == [9] * 3 + [5] * 5
    _assert_matches_quantized_reference(st, out)


def test_mode_2_refuses_a_non_causal_window_with_the_reason() -> None:
    s = h.spec(kv_cache_dtype="int8_k", attn_type=AttentionType.ENCODER_ONLY, sliding_window=5)
    reasons = IluvatarInt8Backend.unsupported_reasons(s)
    assert any("single-query paged kernel" in r for r in reasons)
    with pytest.raises(UnsupportedConfigurationError):
        IluvatarInt8Backend(s, "cpu", emulate=True)


# --- both modes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kv", ["int8", "int8_k"])
def test_shared_prefixes_take_the_regular_path(kv: str) -> None:
    st = _step([(1, 40), (2, 50)], kv)
    meta = st.backend.metadata_builder().build(st.batch, common_prefix_len=32)
    assert meta.cascade is None


@pytest.mark.parametrize(("kv", "bound"), [("int8", 0.05), ("int8_k", 0.04)])
def test_accuracy_against_unquantized_attention(kv: str, bound: float) -> None:
    """Fresh prefills (every key written by this step) against float64 attention over the
    unquantized q, k, v: the int8 rounding of Q, K (and V) stays within ``bound``."""
    s = h.spec(kv_cache_dtype=kv, dtype=torch.float16)
    b = IluvatarInt8Backend(s, "cpu", emulate=True)
    g = testing.generator(5)
    batch, nb = testing.make_batch([9, 40], [9, 40], 16, seed=g)
    q, k, v = testing.random_qkv(s, batch.num_tokens, g)
    cache = b.allocate_kv_cache(nb)
    if kv == "int8":  # the static value scale an engine loads: amax / 127 per channel
        assert cache.value_scale is not None
        cache.value_scale.copy_(v.float().abs().amax(dim=0) / 127)
    out = b.impl().forward(q, k, v, cache, b.metadata_builder().build(batch))
    qsl = batch.query_start_loc_cpu.tolist()
    for r in range(batch.num_reqs):
        rows = slice(qsl[r], qsl[r + 1])
        want, _ = reference.attention(q[rows], k[rows], v[rows], scale=s.scale)
        err = float((out[rows].double() - want).abs().max())
        assert err < bound, f"request {r}: {kv} differs from unquantized attention by {err}"


@pytest.mark.parametrize("requests", [MIXED, DECODES], ids=["mixed", "decode_only"])
@pytest.mark.parametrize("kv", ["int8", "int8_k"])
def test_forward_and_write_kv_read_no_device_tensor_on_the_host(
    kv: str, requests: list[tuple[int, int]]
) -> None:
    hostsync = pytest.importorskip("attnhub_conformance.hostsync")
    st = _step(requests, kv)
    meta = st.backend.metadata_builder().build(st.batch)
    impl = st.backend.impl()
    out = hostsync.run_layer_guarded(impl, st.query, st.key, st.value, st.cache, meta)
    _assert_matches_quantized_reference(st, out)


def test_the_registered_backend_refuses_the_int8_caches_with_the_reason() -> None:
    s: AttentionSpec = h.spec(kv_cache_dtype="int8")
    reasons = h.backend().unsupported_reasons(s)
    assert any("IluvatarInt8Backend" in r for r in reasons)
