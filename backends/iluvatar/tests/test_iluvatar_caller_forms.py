"""Every call form Iluvatar's vLLM fork makes to an op attnhub emulates, replayed against the
emulator in the fork's exact form: its keywords (nothing positional where it passes keywords),
its shapes (padded step tensors, ``(T, 1, H, D)`` decode queries, column-sliced tables and query
scales), its values (``kv_cache_dtype=""``, ``max_seqlen_k=max_query_len``, ``v_scale=None``).

The evidence is ``shared/callers/iluvatar-vllm-flash-attention-backend.txt`` ("the fork"): the
one hardware-proven caller of ixformer, so every one of these calls must pass. Each replay is
checked against ``attnhub.reference`` (over the cache as the replayed write left it, which is
checked against the reference write), or against the math the op documents."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import iluvatar_helpers as h
import pytest
import torch
from attnhub_iluvatar import emulator

from attnhub import reference, testing
from attnhub.capabilities import Tolerance
from attnhub.kv_cache import PagedKVCache

FA = emulator.contrib.vllm_flash_attn
FN = emulator.inference.functions
SENTINEL = 7.0  # graph-padding rows of the output: no op may touch them

#: The keywords of each call, exactly as the fork passes them (sets: the fork's order differs
#: from call to call and does not matter for keywords).
VARLEN_PREFILL = {
    "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
    "softmax_scale", "causal", "window_size", "alibi_slopes", "softcap", "sqrt_alibi", "sinks",
    "out", "block_table",
}  # fmt: skip
KVCACHE_DECODE = {
    "q", "k_cache", "v_cache", "block_table", "cache_seqlens", "max_query_len", "cu_query_lens",
    "softmax_scale", "causal", "window_size", "alibi_slopes", "softcap", "use_sqrt_alibi",
    "sinks", "out", "use_cuda_graph", "max_context_len",
}  # fmt: skip
VARLEN_INT8 = {
    "q", "k", "v", "q_scale", "k_scale", "v_scale", "cu_seqlens_q", "cu_seqlens_k",
    "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "window_size", "alibi_slopes",
    "softcap", "sqrt_alibi", "out", "block_table", "output_dtype",
}  # fmt: skip
PAGED = {
    "output", "query", "key_cache", "query_scale", "key_scale_cache", "num_kv_heads", "scale",
    "block_tables", "context_lens", "block_size", "softcap", "alibi_slopes", "causal",
    "window_left", "window_right", "use_sqrt_alibi", "use_cuda_graph", "max_context_len",
    "cu_query_lens", "max_query_len", "value_cache",
}  # fmt: skip
SAVES = {"save_key", "save_value", "save_key_scale"}
WRITE_INT8 = {
    "key", "value", "k_scale", "key_cache", "value_cache", "key_scale_cache", "slot_mapping",
    "kv_cache_dtype",
}  # fmt: skip


@dataclass
class Fork:
    """The fork's view of one step and one layer: its metadata fields and layer attributes."""

    st: h.Step
    query: torch.Tensor  # [T + padding, H, D]: views of one fused qkv tensor, as vLLM's
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor  # [T + padding, H, D], padding rows SENTINEL
    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    max_query_len: int
    slot_mapping: torch.Tensor
    # decode metadata
    decode_block_table: torch.Tensor
    decode_query_start_loc: torch.Tensor
    decode_seq_lens: torch.Tensor
    decode_max_query_len: int
    max_decode_seq_len: int
    # prefill metadata
    prefill_block_table: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    prefill_key_start_loc: torch.Tensor
    # the layer
    scale: float
    window_size: tuple[int, int]
    alibi_slopes: torch.Tensor | None
    logits_soft_cap: float
    sinks: torch.Tensor | None


def _fork(
    requests: list[tuple[int, int]], padding: int = 3, threshold: int = 1, **changes: Any
) -> Fork:
    """The fork's metadata for ``requests`` (decodes: the leading requests with query_len <=
    ``threshold``, the fork's ``reorder_batch_threshold``, 1 + speculative tokens)."""
    st = h.step(requests, h.spec(**changes), padding=padding)
    b, spec = st.batch, st.backend.spec
    q_lens = [q for q, _ in requests]
    nd = next((i for i, q in enumerate(q_lens) if q > threshold), len(q_lens))
    qsl, seq_lens = b.query_start_loc, b.seq_lens
    key_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int32)
    key_start_loc[1:] = torch.cumsum(b.seq_lens_cpu, 0)
    # vLLM's q, k and v are views of the fused QKV projection: strided rows, contiguous heads
    t = st.query.shape[0]
    hd, kd = spec.num_heads * spec.head_size, spec.num_kv_heads * spec.head_size
    qkv = torch.cat([st.query.reshape(t, hd), st.key.reshape(t, kd), st.value.reshape(t, kd)], 1)
    query = qkv[:, :hd].view(t, spec.num_heads, spec.head_size)
    key = qkv[:, hd : hd + kd].view(t, spec.num_kv_heads, spec.head_size)
    value = qkv[:, hd + kd :].view(t, spec.num_kv_heads, spec.head_size)
    assert not query.is_contiguous() and not value.is_contiguous()
    w = spec.sliding_window
    n = b.num_actual_tokens
    return Fork(
        st=st,
        query=query,
        key=key,
        value=value,
        output=torch.full_like(st.query, SENTINEL),
        num_actual_tokens=n,
        num_decodes=nd,
        num_decode_tokens=sum(q_lens[:nd]),
        max_query_len=b.max_query_len,
        slot_mapping=b.slot_mapping[:n],
        decode_block_table=b.block_table[:nd, ...],
        decode_query_start_loc=qsl[: nd + 1],
        decode_seq_lens=seq_lens[:nd],
        decode_max_query_len=max(q_lens[:nd], default=0),
        max_decode_seq_len=int(b.seq_lens_cpu[:nd].max()) if nd else 0,
        prefill_block_table=b.block_table[nd:, ...],
        prefill_query_start_loc=qsl[nd:] - qsl[nd],
        prefill_key_start_loc=key_start_loc[nd:] - key_start_loc[nd],
        scale=float(spec.scale),
        window_size=(w - 1, 0) if w else (-1, -1),
        alibi_slopes=st.alibi_slopes,
        logits_soft_cap=spec.logits_soft_cap or 0,  # "setting logits_soft_cap as 0 means no"
        sinks=st.sinks,
    )


def _tolerance(f: Fork) -> Tolerance:
    return f.st.backend.capabilities.tolerance(f.st.backend.spec.dtype)


def _assert_close(got: torch.Tensor, want: torch.Tensor, tol: Tolerance, what: str) -> None:
    err = (got.double() - want.double()).abs() - tol.rtol * want.double().abs()
    assert float(err.max()) <= tol.atol, f"{what}: off by {float(err.max())} past rtol"


def _check_output(f: Fork, query_for_reference: torch.Tensor | None = None) -> None:
    """The output's real rows against the reference over the cache as it now is; its padding
    rows untouched."""
    n, st = f.num_actual_tokens, f.st
    q = st.query[:n] if query_for_reference is None else query_for_reference
    want, _ = reference.paged_attention(
        q, st.cache, st.batch, st.backend.spec, alibi_slopes=st.alibi_slopes, sinks=st.sinks
    )
    _assert_close(f.output[:n], want, _tolerance(f), "fork replay")
    assert (f.output[n:] == SENTINEL).all(), "a graph-padding row was written"


def _expected_cache(f: Fork) -> PagedKVCache:
    return testing.cache_after_write(f.st.cache, f.st.key, f.st.value, f.slot_mapping)


# --- mode 0 (VLLM_ATTN_OPT_LEVEL 0) -----------------------------------------------------------


def _mode_0_forward(f: Fork, *, use_graph: bool = False) -> list[emulator.Call]:
    """The fork's forward for quant_type 0, not cascade, dcp_world_size 1."""
    cache = f.st.cache
    key_cache, value_cache = cache.key, cache.value
    nd = f.num_decode_tokens
    decode_q, prefill_q = f.query[:nd], f.query[nd:]
    prefill_output, decode_output = f.output[nd:], f.output[:nd]
    with emulator.record_calls() as calls:
        # vllm._custom_ops.reshape_and_cache_flash(key, value, key_cache, value_cache,
        # slot_mapping, kv_cache_dtype, k_scale, v_scale) -> ixformer's, scales 1.0
        FN.reshape_and_cache_flash(
            f.key, f.value, key_cache, value_cache, f.slot_mapping, "auto", 1.0, 1.0
        )
        if f.num_decodes < len(f.st.batch.seq_lens_cpu):
            FA.flash_attn_varlen_func(
                q=prefill_q,
                k=key_cache,
                v=value_cache,
                cu_seqlens_q=f.prefill_query_start_loc,
                cu_seqlens_k=f.prefill_key_start_loc,
                max_seqlen_q=f.max_query_len,
                max_seqlen_k=f.max_query_len,
                softmax_scale=f.scale,
                causal=True,
                window_size=f.window_size,
                alibi_slopes=f.alibi_slopes,
                softcap=f.logits_soft_cap,
                sqrt_alibi=False,
                sinks=f.sinks,
                out=prefill_output,
                block_table=f.prefill_block_table,
            )
        if f.num_decodes:
            FA.flash_attn_with_kvcache(
                q=decode_q.unsqueeze(1),
                k_cache=key_cache,
                v_cache=value_cache,
                block_table=f.decode_block_table,
                cache_seqlens=f.decode_seq_lens,
                max_query_len=f.decode_max_query_len,
                cu_query_lens=f.decode_query_start_loc,
                softmax_scale=f.scale,
                causal=True,
                window_size=f.window_size,
                alibi_slopes=f.alibi_slopes,
                softcap=f.logits_soft_cap,
                use_sqrt_alibi=False,
                sinks=f.sinks,
                out=decode_output.unsqueeze(1),
                use_cuda_graph=use_graph,
                max_context_len=f.max_decode_seq_len,
            )
    return calls


MIXED = [(1, 40), (1, 9), (3, 30), (20, 50), (17, 17)]
FEATURES = {
    "plain": {},
    "window_softcap_alibi": dict(sliding_window=9, logits_soft_cap=20.0, use_alibi=True),
    "sinks": dict(use_sinks=True),
    "sinks_window": dict(use_sinks=True, sliding_window=12),
}


@pytest.mark.parametrize("features", FEATURES.values(), ids=FEATURES.keys())
def test_mode_0_mixed_step_in_the_forks_form(features: dict[str, Any]) -> None:
    f = _fork(MIXED, **features)
    expected = _expected_cache(f)
    calls = _mode_0_forward(f)
    names = [c.name.rsplit(".", 1)[1] for c in calls]
    assert names == ["reshape_and_cache_flash", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
    assert len(calls[0].args) == 8 and set(calls[1].kwargs) == VARLEN_PREFILL
    assert set(calls[2].kwargs) == KVCACHE_DECODE and calls[2].args == ()
    # the padded prefill query, and max_seqlen_k the step's max_query_len (below the 50 keys)
    assert calls[1].kwargs["q"].shape[0] > calls[1].kwargs["cu_seqlens_q"][-1]
    assert calls[1].kwargs["max_seqlen_k"] == 20 < 50
    assert testing.cache_differences(f.st.cache, expected, f.slot_mapping) == []
    _check_output(f)


def test_mode_0_decode_only_step_with_use_cuda_graph() -> None:
    f = _fork([(1, 40), (1, 9), (1, 33)], padding=5)
    calls = _mode_0_forward(f, use_graph=True)
    dec = calls[-1]
    assert dec.kwargs["q"].shape == (3, 1, 4, 64) and dec.kwargs["use_cuda_graph"] is True
    _check_output(f)


def test_mode_0_speculative_decodes_as_one_decode_call() -> None:
    """With speculative tokens the fork's threshold is 1 + k: q (T, 1, H, D) with T > B, the
    rows counted by cu_query_lens."""
    f = _fork([(2, 40), (2, 9), (2, 33)], threshold=2)
    calls = _mode_0_forward(f)
    dec = calls[-1]
    assert dec.kwargs["q"].shape == (6, 1, 4, 64) and dec.kwargs["max_query_len"] == 2
    assert dec.kwargs["cu_query_lens"].tolist() == [0, 2, 4, 6]
    _check_output(f)


def test_the_forks_cascade_with_a_column_sliced_suffix_table() -> None:
    """``cascade_attention``: the prefix over ``block_table[:1]``, the suffix over
    ``block_table[:, num_common_kv_blocks:]`` (not contiguous), both ``window_size`` as a list,
    then ``merge_attn_states`` from ixformer.contrib.vllm_flash_attn, output positional."""
    requests = [(1, 40), (2, 50), (9, 45)]
    width = 4
    table = torch.zeros(3, width, dtype=torch.int32)
    nxt = 3
    for r, (_, n) in enumerate(requests):
        table[r, :2] = torch.tensor([1, 2])
        own = -(-n // 16) - 2
        table[r, 2 : 2 + own] = torch.arange(nxt, nxt + own)
        nxt += own
    st = h.step(requests, h.spec(), padding=2, table=table)
    b = st.batch
    n = b.num_actual_tokens
    FN.reshape_and_cache_flash(
        st.key, st.value, st.cache.key, st.cache.value, b.slot_mapping[:n], "auto", 1.0, 1.0
    )
    common_prefix_len, block_size = 32, 16
    num_common_kv_blocks = common_prefix_len // block_size
    query = st.query[:n]
    output = torch.full_like(st.query, SENTINEL)[:n]
    suffix_kv_lens = b.seq_lens[:3] - common_prefix_len
    cu_suffix_kv_lens = torch.tensor([0, *suffix_kv_lens.tolist()], dtype=torch.int32)
    cu_suffix_kv_lens = cu_suffix_kv_lens.cumsum_(dim=0, dtype=torch.int32)
    suffix_table = b.block_table[:, num_common_kv_blocks:]
    assert not suffix_table.is_contiguous()
    with emulator.record_calls() as calls:
        prefix_output, prefix_lse = FA.flash_attn_varlen_func(
            q=query,
            k=st.cache.key,
            v=st.cache.value,
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
            cu_seqlens_k=torch.tensor([0, common_prefix_len], dtype=torch.int32),
            max_seqlen_q=n,
            max_seqlen_k=common_prefix_len,
            softmax_scale=st.backend.spec.scale,
            causal=False,
            window_size=[-1, -1],
            block_table=b.block_table[:1],
            softcap=0,
            return_softmax_lse=True,
        )
        suffix_output, suffix_lse = FA.flash_attn_varlen_func(
            q=query,
            k=st.cache.key,
            v=st.cache.value,
            cu_seqlens_q=b.query_start_loc,
            cu_seqlens_k=cu_suffix_kv_lens,
            max_seqlen_q=b.max_query_len,
            max_seqlen_k=b.max_seq_len - common_prefix_len,
            softmax_scale=st.backend.spec.scale,
            causal=True,
            window_size=[-1, -1],
            block_table=suffix_table,
            softcap=0,
            return_softmax_lse=True,
        )
        FA.merge_attn_states(prefix_output, prefix_lse, suffix_output, suffix_lse, output)
    assert calls[-1].name == "contrib.vllm_flash_attn.merge_attn_states"
    want, want_lse = reference.paged_attention(query, st.cache, b, st.backend.spec)
    tol = st.backend.capabilities.tolerance(st.backend.spec.dtype)
    _assert_close(output, want, tol, "cascade")
    # the prefix part's LSE is the natural log of its softmax denominator
    spec = st.backend.spec
    keys, values = reference.read_sequence(st.cache, b.block_table[0], 32)
    _, ref_prefix_lse = reference.attention(query, keys, values, scale=spec.scale, causal=False)
    assert torch.allclose(prefix_lse.double(), ref_prefix_lse, atol=2e-2)
    assert want_lse.shape == prefix_lse.shape


def test_the_forks_dcp_path_merges_ixformers_lses_into_full_attention() -> None:
    """``_forward_with_dcp`` at one rank: the context (the keys before each query) through the
    paged varlen call with ``out=None`` and ``return_softmax_lse=True``, the new tokens through
    the packed varlen call (``cu_seqlens_k=cu_seqlens_q``), then ``merge_attn_states``: the
    merged result is attention over the whole sequence only if both LSEs and the merge share a
    base (vLLM's ``cp_lse_ag_out_rs`` between them weighs by ``exp``)."""
    requests = [(1, 40), (3, 30), (20, 50)]
    st = h.step(requests, h.spec(), padding=0)
    b, spec = st.batch, st.backend.spec
    n = b.num_actual_tokens
    FN.reshape_and_cache_flash(
        st.key, st.value, st.cache.key, st.cache.value, b.slot_mapping[:n], "auto", 1.0, 1.0
    )
    query, key, value = st.query.contiguous(), st.key[:n], st.value[:n]
    context = b.seq_lens - (b.query_start_loc[1:] - b.query_start_loc[:-1])
    zero = torch.tensor([0], dtype=torch.int32)
    cu_context = torch.cat([zero, context.cumsum(dim=0, dtype=torch.int32)])
    context_out, context_lse = FA.flash_attn_varlen_func(
        q=query,
        k=st.cache.key,
        v=st.cache.value,
        out=None,
        cu_seqlens_q=b.query_start_loc,
        cu_seqlens_k=cu_context,
        max_seqlen_q=b.max_query_len,
        max_seqlen_k=int(context.max()),
        softmax_scale=spec.scale,
        causal=False,
        alibi_slopes=None,
        window_size=[-1, -1],
        block_table=b.block_table,
        softcap=0,
        return_softmax_lse=True,
    )
    # vLLM's cp_lse_ag_out_rs at one rank hands (out, lse) back as they are
    context_lse = context_lse.transpose(0, 1).transpose(0, 1).contiguous()
    query_out, query_lse = FA.flash_attn_varlen_func(
        q=query,
        k=key,
        v=value,
        out=None,
        cu_seqlens_q=b.query_start_loc,
        max_seqlen_q=b.max_query_len,
        cu_seqlens_k=b.query_start_loc,
        max_seqlen_k=b.max_query_len,
        softmax_scale=spec.scale,
        causal=True,
        alibi_slopes=None,
        window_size=[-1, -1],
        softcap=0,
        return_softmax_lse=True,
    )
    assert context_out.shape == query_out.shape and context_lse.shape == query_lse.shape
    output = torch.empty_like(query)
    FA.merge_attn_states(context_out, context_lse, query_out, query_lse, output)
    want, want_lse = reference.paged_attention(query, st.cache, b, spec)
    _assert_close(output, want, st.backend.capabilities.tolerance(spec.dtype), "dcp merge")
    # vLLM's natural-log merge of the same parts gives the same
    merged, lse = reference.merge_attn_states(context_out, context_lse, query_out, query_lse)
    _assert_close(merged, want, st.backend.capabilities.tolerance(spec.dtype), "vLLM merge")
    assert torch.allclose(lse, want_lse, atol=2e-2)


@pytest.mark.parametrize("window", [None, 5])
def test_the_forks_encoder_attention_over_packed_keys(window: int | None) -> None:
    """``_forward_encoder_attention``: packed q/k/v, ``cu_seqlens_k=cu_seqlens_q``,
    ``causal=False``, ``window_size=list(self.sliding_window)`` ((W-1, W-1) encoder-only)."""
    requests = [(5, 5), (9, 9)]
    st = h.step(requests, h.spec(attn_type="encoder_only", sliding_window=window), padding=0)
    b, spec = st.batch, st.backend.spec
    output = torch.empty_like(st.query)
    FA.flash_attn_varlen_func(
        q=st.query,
        k=st.key,
        v=st.value,
        out=output,
        cu_seqlens_q=b.query_start_loc,
        cu_seqlens_k=b.query_start_loc,
        max_seqlen_q=b.max_query_len,
        max_seqlen_k=b.max_query_len,
        softmax_scale=spec.scale,
        causal=False,
        alibi_slopes=None,
        window_size=[window - 1, window - 1] if window else [-1, -1],
        softcap=0,
    )
    tol = st.backend.capabilities.tolerance(spec.dtype)
    for r, (a, z) in enumerate(
        zip(b.query_start_loc_cpu[:-1], b.query_start_loc_cpu[1:], strict=True)
    ):
        want, _ = reference.attention(
            st.query[a:z], st.key[a:z], st.value[a:z], scale=spec.scale, causal=False,
            window=spec.window,
        )  # fmt: skip
        _assert_close(output[a:z], want, tol, f"encoder sequence {r}")


# --- modes 1 and 2 (VLLM_ATTN_OPT_LEVEL 1 and 2) -----------------------------------------------


def _int8_forward(f: Fork, quant_type: int, decode_only: bool) -> list[emulator.Call]:
    """The fork's forward for quant_type 1 / 2 (not cascade, one rank)."""
    cache = f.st.cache
    i8_key_cache, key_scale_cache = cache.key, cache.key_scale
    num_blocks, num_kv_heads, block_size, head_size = i8_key_cache.shape
    if quant_type == 1:
        value_cache_info = (cache.value, cache.value_scale)
    else:  # the packed (3, ...) int8 tensor; V is planes 1-2 read as 16-bit
        kv_cache = torch.empty(0, dtype=torch.int8).set_(cache.key.untyped_storage())
        kv_cache = kv_cache.view(3, num_blocks, num_kv_heads, block_size, head_size)
        value_cache = (
            kv_cache[1:]
            .view(f.query.dtype)
            .reshape(num_blocks, num_kv_heads, block_size, head_size)
        )
        assert value_cache.data_ptr() == cache.value.data_ptr()
        value_cache_info = (value_cache, None)
    nd = f.num_decode_tokens
    has_prefill = not decode_only
    prefill_output, decode_output = f.output[nd:], f.output[:nd]
    q8 = FN.scaled_int8_quant_for_attn
    with emulator.record_calls() as calls:
        int8_query, query_scale = q8(f.query, 2, transpose_scale=not decode_only)
        i8_key, key_scale = q8(f.key, 2, transpose_scale=False)
        if quant_type == 1:
            i8_value, _ = q8(f.value, 0, transpose_scale=False, scale=value_cache_info[1])
        write = dict(
            key=i8_key,
            value=i8_value if quant_type == 1 else f.value,
            k_scale=key_scale,
            key_cache=i8_key_cache,
            value_cache=value_cache_info[0],
            key_scale_cache=key_scale_cache,
            slot_mapping=f.slot_mapping,
            kv_cache_dtype="",
        )
        if has_prefill:
            if quant_type == 1:
                FN.reshape_and_cache_flash_int8(**write)
            else:
                FN.reshape_and_cache_flash_mix(**write)
            FA.flash_attn_varlen_int8_func(
                q=int8_query[nd:],
                k=i8_key_cache,
                v=value_cache_info[0],
                q_scale=query_scale[:, nd:],
                k_scale=key_scale_cache,
                v_scale=value_cache_info[1],
                cu_seqlens_q=f.prefill_query_start_loc,
                cu_seqlens_k=f.prefill_key_start_loc,
                max_seqlen_q=f.max_query_len,
                max_seqlen_k=f.max_query_len,
                softmax_scale=f.scale,
                causal=True,
                window_size=f.window_size,
                alibi_slopes=f.alibi_slopes,
                softcap=f.logits_soft_cap,
                sqrt_alibi=False,
                out=prefill_output,
                block_table=f.prefill_block_table,
                output_dtype=f.query.dtype,
            )
        if f.num_decodes:
            para_dict: dict[str, Any] = dict(
                output=decode_output,
                query=int8_query[:nd],
                key_cache=i8_key_cache,
                query_scale=query_scale[:nd]
                if decode_only
                else query_scale[:, :nd].t().contiguous(),
                key_scale_cache=key_scale_cache,
                num_kv_heads=num_kv_heads,
                scale=f.scale,
                block_tables=f.decode_block_table,
                context_lens=f.decode_seq_lens,
                block_size=i8_key_cache.shape[-2],
                softcap=f.logits_soft_cap,
                alibi_slopes=f.alibi_slopes,
                causal=True,
                window_left=f.window_size[0],
                window_right=f.window_size[1],
                use_sqrt_alibi=False,
                use_cuda_graph=decode_only,
                max_context_len=f.max_decode_seq_len,
                cu_query_lens=f.decode_query_start_loc,
                max_query_len=f.decode_max_query_len,
            )
            if quant_type == 1:
                para_dict.update(
                    value_cache=value_cache_info[0], value_scale_cache=cache.value_scale
                )
                if decode_only:
                    para_dict.update(
                        save_key=i8_key[:nd],
                        save_value=i8_value[:nd],
                        save_key_scale=key_scale[:nd],
                    )
                FN.vllm_paged_attention_int8(**para_dict)
            else:
                para_dict.update(value_cache=value_cache_info[0])
                if decode_only:
                    para_dict.update(
                        save_key=i8_key[:nd],
                        save_value=f.value[:nd].contiguous(),
                        save_key_scale=key_scale[:nd],
                    )
                FN.vllm_paged_attention_mix(**para_dict)
    return calls


INT8_FEATURES = {
    "plain": {},
    "window_softcap_alibi": dict(sliding_window=9, logits_soft_cap=20.0, use_alibi=True),
}


@pytest.mark.parametrize("features", INT8_FEATURES.values(), ids=INT8_FEATURES.keys())
@pytest.mark.parametrize(
    ("quant_type", "requests", "decode_only"),
    [
        (1, MIXED, False),
        (1, [(1, 40), (1, 9), (1, 33)], True),
        (2, MIXED, False),
        (2, [(1, 40), (1, 9), (1, 33)], True),
    ],
    ids=["mode1-mixed", "mode1-decode-only", "mode2-mixed", "mode2-decode-only"],
)
def test_int8_modes_in_the_forks_form(
    quant_type: int,
    requests: list[tuple[int, int]],
    decode_only: bool,
    features: dict[str, Any],
) -> None:
    kv = "int8" if quant_type == 1 else "int8_k"
    f = _fork(requests, kv_cache_dtype=kv, **features)
    expected = _expected_cache(f)
    calls = _int8_forward(f, quant_type, decode_only)
    by_name = {c.name.rsplit(".", 1)[1]: c for c in calls}
    paged = by_name["vllm_paged_attention_int8" if quant_type == 1 else "vllm_paged_attention_mix"]
    keys = PAGED | ({"value_scale_cache"} if quant_type == 1 else set())
    assert set(paged.kwargs) == keys | (SAVES if decode_only else set()) and paged.args == ()
    if not decode_only:
        varlen = by_name["flash_attn_varlen_int8_func"]
        assert set(varlen.kwargs) == VARLEN_INT8 and varlen.args == ()
        assert not varlen.kwargs["q_scale"].is_contiguous()  # query_scale[:, nd:]
        assert (varlen.kwargs["v_scale"] is None) == (quant_type == 2)
        write = by_name[f"reshape_and_cache_flash_{'int8' if quant_type == 1 else 'mix'}"]
        assert set(write.kwargs) == WRITE_INT8 and write.kwargs["kv_cache_dtype"] == ""
    assert testing.cache_differences(f.st.cache, expected, f.slot_mapping) == []
    n = f.num_actual_tokens
    q = testing.quantized_query(f.st.query[:n], f.st.backend.capabilities, kv)
    _check_output(f, q)


def test_the_forks_value_calibration_call() -> None:
    """``scaled_int8_quant_for_attn(value, 0, transpose_scale=False)`` with no static scale (the
    fork's calibration, ``quant_manager.update_data(value_scale)``): a scale per (kv head,
    channel), amax / 127 over the tokens, the shape of the static value scale."""
    st = h.step(MIXED, h.spec(), padding=0)
    value = st.value
    i8_value, value_scale = FN.scaled_int8_quant_for_attn(value, 0, transpose_scale=False)
    amax = value.double().abs().amax(dim=0)
    assert value_scale.shape == (2, 64) and value_scale.dtype == torch.float32
    assert torch.allclose(value_scale.double(), amax / 127, rtol=1e-6)
    back = i8_value.double() * value_scale.double()
    assert float((back - value.double()).abs().max()) <= float(value_scale.max()) / 2 + 1e-6
    assert int(i8_value.abs().max()) == 127 and not math.isnan(float(value_scale.sum()))
