"""One test per translation rule: what the backend passes to each provider, checked on the
calls the emulator records."""

from __future__ import annotations

import dataclasses

import flash_helpers as h
import pytest
import torch
from attnhub_flash import emulator

from attnhub import testing
from attnhub.errors import InvalidInputError
from attnhub.spec import AttentionType

VLLM = "vllm.vllm_flash_attn.flash_attn_varlen_func"
WRITE = "vllm._custom_ops.reshape_and_cache_flash"
SCHEDULE = "vllm.vllm_flash_attn.get_scheduler_metadata"
FA2 = "flash_attn.flash_attn_varlen_func"
FA2_DECODE = "flash_attn.flash_attn_with_kvcache"
FA3 = "flash_attn_interface.flash_attn_with_kvcache"
FA4 = "flash_attn.cute.flash_attn_varlen_func"
ATTENTION = {
    "vllm": VLLM,
    "vllm-fa3": VLLM,
    "vllm-flashmla": VLLM,
    "fa2": FA2,
    "fa3": FA3,
    "fa4": FA4,
}

#: decodes, a multi-token decode, a chunked prefill, a fresh prefill: every kind in one step
MIXED = [(1, 40), (3, 35), (1, 9), (20, 70), (33, 33)]


def _mixed(provider: str) -> list[tuple[int, int]]:
    """MIXED scaled to the provider's block size (FA2's paged blocks hold 256 keys)."""
    if provider != "fa2":
        return MIXED
    return [(1, 300), (3, 280), (1, 9), (20, 600), (33, 33)]


def _calls(st: h.Step) -> tuple[torch.Tensor, list[emulator.Call]]:
    with emulator.record_calls() as calls:
        out = h.forward(st)
    return out, calls


def _only(calls: list[emulator.Call], name: str) -> emulator.Call:
    found = [c for c in calls if c.name == name]
    assert len(found) == 1, f"{name} called {len(found)} times: {[c.name for c in calls]}"
    return found[0]


# --- one call per layer ---------------------------------------------------------------------


@pytest.mark.parametrize("provider", h.PROVIDERS)
def test_a_mixed_batch_is_one_attention_call(provider: str) -> None:
    st = h.step(_mixed(provider), provider, padding=3)
    out = h.forward(st)
    expected = {ATTENTION[provider]: 1}
    if provider.startswith("vllm"):
        expected[WRITE] = 1
    if provider in ("vllm-fa3", "vllm-flashmla"):  # FA3's schedule, planned by the builder
        expected[SCHEDULE] = 1
    assert dict(emulator.call_counts) == expected
    h.assert_matches_reference(st, out)


def test_layers_share_the_step_plan() -> None:
    st = h.step(MIXED)
    meta = st.backend.metadata_builder().build(st.batch)
    with emulator.record_calls() as calls:
        for _ in range(3):
            st.backend.impl().forward(st.query, st.key, st.value, st.cache, meta)
    attn = [c for c in calls if c.name == VLLM]
    assert len(attn) == 3
    # the same int32 tensors every layer: converted once per step, not per layer
    assert meta.main is not None
    assert all(c.kwargs["block_table"] is meta.main.block_table for c in attn)
    assert all(c.kwargs["seqused_k"] is meta.main.seq_lens for c in attn)
    assert all(c.kwargs["cu_seqlens_q"] is meta.main.query_start_loc for c in attn)


def test_layers_keep_their_own_weights_beside_the_steps_shared_arguments() -> None:
    """The fork's arguments that are the same for every layer are made once per step; each
    layer still passes its own ALiBi slopes, and a new step passes its own lengths."""
    st = h.step(MIXED, s=h.spec(use_alibi=True))
    meta = st.backend.metadata_builder().build(st.batch)
    slopes = [testing.alibi_slopes(4), testing.alibi_slopes(4) * 0.5]
    impls = [st.backend.impl(alibi_slopes=a) for a in slopes]
    with emulator.record_calls() as calls:
        outs = [impl.forward(st.query, st.key, st.value, st.cache, meta) for impl in impls]
    attn = [c for c in calls if c.name == VLLM]
    assert len(attn) == 2
    assert all(c.kwargs["alibi_slopes"] is i.alibi_slopes for c, i in zip(attn, impls, strict=True))
    assert attn[0].kwargs["block_table"] is attn[1].kwargs["block_table"]
    for a, out in zip(slopes, outs, strict=True):
        h.assert_matches_reference(dataclasses.replace(st, alibi=a), out)
    # another step, the same layers: that step's lengths, not the first step's
    st2 = h.step([(1, 20), (1, 3)], s=st.backend.spec)
    meta2 = st.backend.metadata_builder().build(st2.batch)
    with emulator.record_calls() as calls:
        impls[0].forward(st2.query, st2.key, st2.value, st2.cache, meta2)
    c = _only(calls, VLLM)
    assert c.kwargs["seqused_k"].tolist() == [20, 3] and c.kwargs["max_seqlen_k"] == 20


def test_vllm_fa3_plans_its_scheduler_metadata_once_per_step() -> None:
    """As vLLM's builder does with fa_version=3: FA3's tile schedule is computed once per step
    (get_scheduler_metadata) and every layer's call takes it, with num_splits=0 in both."""
    st = h.step(MIXED, "vllm-fa3")
    with emulator.record_calls() as calls:
        meta = st.backend.metadata_builder().build(st.batch)
        for _ in range(3):
            st.backend.impl().forward(st.query, st.key, st.value, st.cache, meta)
    schedule = [c for c in calls if c.name == SCHEDULE]
    attn = [c for c in calls if c.name == VLLM]
    assert len(schedule) == 1 and len(attn) == 3
    assert meta.main is not None and meta.main.scheduler_metadata is not None
    for c in attn:
        assert c.kwargs["scheduler_metadata"] is meta.main.scheduler_metadata
        assert c.kwargs["num_splits"] == 0 and c.kwargs["fa_version"] == 3
    planned = schedule[0].kwargs
    assert planned["cache_seqlens"] is meta.main.seq_lens
    assert planned["cu_seqlens_q"] is meta.main.query_start_loc
    assert (planned["batch_size"], planned["max_seqlen_q"], planned["max_seqlen_k"]) == (5, 33, 70)
    assert planned["causal"] is True and planned["page_size"] == 16
    assert planned["num_splits"] == 0 and planned["window_size"] == (-1, -1)


def test_vllm_fa2_plans_no_scheduler_metadata() -> None:
    st = h.step(MIXED, "vllm")
    meta = st.backend.metadata_builder().build(st.batch)
    assert meta.main is not None and meta.main.scheduler_metadata is None


# --- vLLM's fork ------------------------------------------------------------------------------


def test_vllm_is_called_with_keywords_only_and_seqused_k_with_the_block_table() -> None:
    _, calls = _calls(h.step(MIXED))
    c = _only(calls, VLLM)
    assert c.args == ()  # its positional order differs from upstream's
    assert c.kwargs["seqused_k"].tolist() == [40, 35, 9, 70, 33]
    assert c.kwargs["cu_seqlens_q"].tolist() == [0, 1, 4, 5, 25, 58]
    assert c.kwargs["block_table"].dtype == torch.int32
    assert c.kwargs["max_seqlen_q"] == 33 and c.kwargs["max_seqlen_k"] == 70
    assert c.kwargs["fa_version"] == 2 and c.kwargs["causal"] is True
    assert "cu_seqlens_k" not in c.kwargs


def test_vllm_writes_into_the_output_buffer() -> None:
    st = h.step(MIXED, padding=2)
    meta = st.backend.metadata_builder().build(st.batch)
    buf = torch.full_like(st.query, 7.0)
    with emulator.record_calls() as calls:
        out = st.backend.impl().forward(st.query, st.key, st.value, st.cache, meta, output=buf)
    c = _only(calls, VLLM)
    assert out is buf and c.kwargs["out"].data_ptr() == buf.data_ptr()
    assert torch.all(buf[58:] == 0)  # padding rows zeroed
    h.assert_matches_reference(st, buf)


def test_vllm_writes_kv_through_reshape_and_cache_flash_with_the_whole_slot_mapping() -> None:
    st = h.step(MIXED, padding=3)
    _, calls = _calls(st)
    w = _only(calls, WRITE)
    key, _, key_cache, _, slots, kv_dtype, k_scale, _ = w.args
    assert key is st.key  # padded rows too: the op writes slots.size(0) tokens
    assert key_cache is st.cache.key and kv_dtype == "auto"
    assert slots.dtype == torch.int64 and slots.shape[0] == st.batch.num_tokens
    assert slots[-3:].tolist() == [-1, -1, -1]  # the op skips them
    assert k_scale.dtype == torch.float32 and k_scale.numel() == 1


def test_window_softcap_and_alibi_are_passed_in_the_kernels_spelling() -> None:
    s = h.spec(sliding_window=8, logits_soft_cap=30.0, use_alibi=True)
    st = h.step(MIXED, s=s)
    out, calls = _calls(st)
    c = _only(calls, VLLM)
    assert tuple(c.kwargs["window_size"]) == (7, 0)  # W keys incl. self: (W - 1, 0)
    assert c.kwargs["softcap"] == 30.0
    assert c.kwargs["alibi_slopes"].dtype == torch.float32
    assert c.kwargs["alibi_slopes"].shape == (4,)
    h.assert_matches_reference(st, out)


def test_no_window_and_no_softcap_are_minus_one_and_zero() -> None:
    _, calls = _calls(h.step(MIXED))
    c = _only(calls, VLLM)
    assert tuple(c.kwargs["window_size"]) == (-1, -1) and c.kwargs["softcap"] == 0.0
    assert c.kwargs["alibi_slopes"] is None


@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER_ONLY, AttentionType.ENCODER_DECODER])
def test_non_causal_types_read_their_keys_from_the_cache(attn_type: AttentionType) -> None:
    s = h.spec(attn_type=attn_type)
    requests = (
        [(5, 5), (3, 3), (9, 9)]
        if attn_type is AttentionType.ENCODER_ONLY
        else [
            (1, 23),
            (5, 21),
        ]
    )
    st = h.step(requests, s=s, padding=2)
    if attn_type is AttentionType.ENCODER_DECODER:  # the encoder's keys are cached already
        st.key = st.value = None  # type: ignore[assignment]
    out, calls = _calls(st)
    c = _only(calls, VLLM)
    assert c.kwargs["causal"] is False and c.kwargs["block_table"] is not None
    h.assert_matches_reference(st, out)


def test_vllm_fa3_passes_sinks_as_s_aux_with_fa_version_3() -> None:
    st = h.step(MIXED, "vllm-fa3", h.spec("vllm-fa3", use_sinks=True))
    out, calls = _calls(st)
    c = _only(calls, VLLM)
    assert c.kwargs["fa_version"] == 3 and c.kwargs["alibi_slopes"] is None
    # as the fork's FA3 takes them: bf16, contiguous [source: hopper/flash_api.cpp]
    s_aux = c.kwargs["s_aux"]
    assert s_aux.dtype == torch.bfloat16 and s_aux.is_contiguous()
    assert st.sinks is not None and torch.equal(s_aux, st.sinks.to(torch.bfloat16))
    h.assert_matches_reference(st, out)


def test_vllm_fa2_path_passes_no_s_aux() -> None:
    _, calls = _calls(h.step(MIXED))
    assert _only(calls, VLLM).kwargs["s_aux"] is None


# --- upstream FA2 -----------------------------------------------------------------------------


def test_fa2_varlen_takes_cumulative_kv_lengths_positionally() -> None:
    st = h.step(_mixed("fa2"), "fa2")
    _, calls = _calls(st)
    c = _only(calls, FA2)
    q, k, v, cu_q, cu_k, max_q, max_k = c.args
    assert q.shape == (58, 4, 64)
    assert k is st.cache.key and v is st.cache.value
    assert cu_q.tolist() == [0, 1, 4, 5, 25, 58]
    assert cu_k.tolist() == [0, 300, 580, 589, 1189, 1222]  # cumulative, with the paged cache
    assert (max_q, max_k) == (33, 600) and cu_k.dtype == torch.int32
    assert c.kwargs["block_table"].dtype == torch.int32


def test_fa2_decode_only_steps_take_the_kvcache_kernel() -> None:
    st = h.step([(1, 300), (1, 9), (1, 513)], "fa2", padding=2)
    out, calls = _calls(st)
    c = _only(calls, FA2_DECODE)
    assert c.args[0].shape == (3, 1, 4, 64)  # q as (batch, 1, heads, head_size)
    assert c.kwargs["cache_seqlens"].tolist() == [300, 9, 513]
    assert FA2 not in emulator.call_counts
    h.assert_matches_reference(st, out)


def test_fa2_writes_kv_with_one_scatter_skipping_padding() -> None:
    st = h.step(_mixed("fa2"), "fa2", padding=3)
    meta = st.backend.metadata_builder().build(st.batch)
    assert meta.write_rows is not None and meta.write_slots is not None
    assert meta.write_rows.tolist() == list(range(58))  # padding rows dropped, once per step
    before = st.cache.key.clone()
    st.backend.impl().write_kv(st.key, st.value, st.cache, meta=meta)
    flat = st.cache.key.view(-1, 2, 64)
    assert torch.equal(flat[meta.write_slots], st.key[:58])
    changed = (st.cache.key != before).any(-1).any(-1).flatten().nonzero().flatten()
    assert set(changed.tolist()) <= set(meta.write_slots.tolist())


def test_write_kv_without_a_step_skips_padding_slots() -> None:
    st = h.step(MIXED, "fa4")
    slots = torch.tensor([5, -1, 17], dtype=torch.int64)
    before = st.cache.value.clone()
    st.backend.impl().write_kv(st.key[:3], st.value[:3], st.cache, slots)
    flat, old = st.cache.value.view(-1, 2, 64), before.view(-1, 2, 64)
    assert torch.equal(flat[5], st.value[0]) and torch.equal(flat[17], st.value[2])
    others = [i for i in range(flat.shape[0]) if i not in (5, 17)]
    assert torch.equal(flat[others], old[others])


# --- FA3 and FA4 ------------------------------------------------------------------------------


def test_fa3_mixed_batch_is_varlen_q_over_the_page_table() -> None:
    st = h.step(MIXED, "fa3")
    _, calls = _calls(st)
    c = _only(calls, FA3)
    assert c.args[0].shape == (58, 4, 64)
    assert c.kwargs["cu_seqlens_q"].tolist() == [0, 1, 4, 5, 25, 58]
    assert c.kwargs["max_seqlen_q"] == 33
    assert c.kwargs["cache_seqlens"].tolist() == [40, 35, 9, 70, 33]
    assert c.kwargs["page_table"].dtype == torch.int32 and "block_table" not in c.kwargs


def test_fa3_decode_only_steps_take_the_batched_path() -> None:
    st = h.step([(1, 40), (1, 3)], "fa3")
    out, calls = _calls(st)
    c = _only(calls, FA3)
    assert c.args[0].shape == (2, 1, 4, 64) and "cu_seqlens_q" not in c.kwargs
    h.assert_matches_reference(st, out)


def test_fa4_no_window_is_none_none_and_a_window_keeps_w_keys() -> None:
    _, calls = _calls(h.step(MIXED, "fa4"))
    assert _only(calls, FA4).kwargs["window_size"] == (None, None)
    emulator.reset_call_counts()
    st = h.step(MIXED, "fa4", h.spec("fa4", sliding_window=8))
    out, calls = _calls(st)
    c = _only(calls, FA4)
    assert c.kwargs["window_size"] == (7, 0)
    assert c.kwargs["page_table"] is not None and "cu_seqlens_k" not in c.kwargs
    assert c.kwargs["seqused_k"].tolist() == [40, 35, 9, 70, 33]
    h.assert_matches_reference(st, out)


def test_fa4_sinks_go_in_as_learnable_sink() -> None:
    st = h.step(MIXED, "fa4", h.spec("fa4", use_sinks=True))
    out, calls = _calls(st)
    sink = _only(calls, FA4).kwargs["learnable_sink"]
    assert sink.shape == (4,) and sink.dtype == torch.float32
    assert st.sinks is not None and torch.equal(sink, st.sinks)
    h.assert_matches_reference(st, out)


# --- no host reads in forward -----------------------------------------------------------------


@pytest.mark.parametrize("provider", h.PROVIDERS)
def test_forward_and_write_kv_read_no_device_tensor_on_the_host(provider: str) -> None:
    """With every check on: the step's values were checked by build, on host copies. The
    emulated functions are the device (emulator.py is marked ``__attnhub_device_code__``)."""
    hostsync = pytest.importorskip("attnhub_conformance.hostsync")
    sinks = dict(use_sinks=True)
    features = {"fa4": sinks, "vllm-fa3": sinks, "vllm-flashmla": sinks, "fa3": {}}.get(
        provider, dict(use_alibi=True)
    )
    for s in (h.spec(provider), h.spec(provider, sliding_window=40, **features)):
        for requests in (_mixed(provider), [(1, 30), (1, 7)]):
            st = h.step(requests, provider, s, padding=2)
            meta = st.backend.metadata_builder().build(st.batch)
            impl = st.backend.impl(sinks=st.sinks, alibi_slopes=st.alibi)
            out = hostsync.run_layer_guarded(impl, st.query, st.key, st.value, st.cache, meta)
            h.assert_matches_reference(st, out)


# --- bad input ----------------------------------------------------------------------------------


def test_metadata_of_another_provider_is_refused_before_anything_is_written() -> None:
    st = h.step(MIXED, "fa3")
    other = h.backend("fa4", h.spec("fa4"))
    meta = other.metadata_builder().build(st.batch)
    before = st.cache.clone()
    with pytest.raises(InvalidInputError, match="provider fa3"):
        st.backend.impl().forward(st.query, st.key, st.value, st.cache, meta)
    assert st.cache.equal(before)


def _planes(st: h.Step, key: torch.Tensor, value: torch.Tensor) -> h.Step:
    """``st`` with its cache's contents copied into the planes ``key`` / ``value``."""
    key.copy_(st.cache.key)
    value.copy_(st.cache.value)
    cache = dataclasses.replace(st.cache, key=key, value=value)
    return dataclasses.replace(st, cache=cache)


@pytest.mark.parametrize("provider", h.PROVIDERS)
@pytest.mark.parametrize("layout", ["vllm", "padded blocks"])
def test_strided_cache_planes_are_written_and_read_in_place(provider: str, layout: str) -> None:
    """strided_kv_cache=True: K/V planes that are views with a contiguous last dim, as vLLM's
    per-layer tensor gives them (a slot's key and value side by side), or blocks with padding
    between them, are written and attended in place, with no copy of the cache."""
    st = h.step(_mixed(provider), provider, padding=3)
    nb, bs, hk, d = st.cache.key.shape
    if layout == "vllm":
        both = torch.empty(nb, bs, hk, 2 * d, dtype=st.cache.key.dtype)
        key, value = both[..., :d], both[..., d:]
    else:
        both = torch.empty(2, nb, bs + 1, hk, d, dtype=st.cache.key.dtype)
        key, value = both[0, :, :bs], both[1, :, :bs]
    assert not key.is_contiguous()
    st = _planes(st, key, value)
    before = st.cache.clone()
    out = h.forward(st)
    assert st.cache.key.data_ptr() == key.data_ptr()  # the very views, written in place
    expected = testing.cache_after_write(before, st.key, st.value, st.batch.slot_mapping)
    assert not testing.cache_differences(st.cache, expected, st.batch.slot_mapping)
    h.assert_matches_reference(st, out)


@pytest.mark.parametrize("provider", ["vllm", "fa3"])
def test_a_plane_without_a_contiguous_last_dim_is_refused(provider: str) -> None:
    st = h.step(MIXED, provider)
    meta = st.backend.metadata_builder().build(st.batch)
    nb, bs, hk, d = st.cache.key.shape
    key = torch.empty(nb, bs, d, hk, dtype=st.cache.key.dtype).transpose(2, 3)
    st = _planes(st, key, st.cache.value.clone())
    before = st.cache.clone()
    with pytest.raises(InvalidInputError, match="contiguous last dimension"):
        st.backend.impl().forward(st.query, st.key, st.value, st.cache, meta)
    with pytest.raises(InvalidInputError, match="contiguous last dimension"):
        st.backend.impl().write_kv(st.key, st.value, st.cache, st.batch.slot_mapping)
    assert st.cache.equal(before)


def test_planes_accepted_once_do_not_let_other_planes_through() -> None:
    """The impl remembers the last planes it accepted (by identity), not a verdict per cache:
    a layer that met good planes still refuses a cache holding other, bad ones."""
    st = h.step(MIXED, "fa3")
    meta = st.backend.metadata_builder().build(st.batch)
    impl = st.backend.impl()
    impl.forward(st.query, st.key, st.value, st.cache, meta)  # accepted, remembered
    nb, bs, hk, d = st.cache.key.shape
    key = torch.empty(nb, bs, d, hk, dtype=st.cache.key.dtype).transpose(2, 3)
    key.copy_(st.cache.key)
    st.cache.key = key  # the same cache object, another key plane
    before = st.cache.clone()
    with pytest.raises(InvalidInputError, match="contiguous last dimension"):
        impl.forward(st.query, st.key, st.value, st.cache, meta)
    assert st.cache.equal(before)


def test_vllm_write_refuses_planes_of_different_strides() -> None:
    """reshape_and_cache_flash addresses both planes with key_cache's strides: a value plane
    laid out differently is refused before anything is written (the emulator's op refuses it
    too, see test_flash_emulator)."""
    st = h.step(MIXED)
    meta = st.backend.metadata_builder().build(st.batch)
    nb, bs, hk, d = st.cache.key.shape
    key = torch.empty(nb, bs, hk, 2 * d, dtype=st.cache.key.dtype)[..., :d]
    st = _planes(st, key, st.cache.value.clone())
    before = st.cache.clone()
    with pytest.raises(InvalidInputError, match="strides"):
        st.backend.impl().forward(st.query, st.key, st.value, st.cache, meta)
    assert st.cache.equal(before)
