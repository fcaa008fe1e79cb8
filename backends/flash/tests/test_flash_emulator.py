"""The emulator follows FlashAttention's conventions and rejects what the libraries reject.

The math is checked on inputs whose answer is plain arithmetic: a zero query gives every visible
key the same weight, so the output is the mean of the visible values and the LSE is the log of
how many keys are visible.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from attnhub_flash import emulator
from attnhub_flash.emulator import FlashOpError, NotEmulatedError

from attnhub import emulation

H, HK, D = 2, 1, 8
#: FA4 reads a paged cache of head size 8 (not a multiple of 16) only at its key tile's page
#: size, 128 on SM100 ("Paged KV does not support irregular head dim")
FA4_PAGE = 128


def _cache(kv_lens: list[int], page: int, *, dtype: torch.dtype = torch.float16) -> dict[str, Any]:
    """A paged cache whose value at sequence position j is j (every head and channel), blocks
    laid out in reverse so a wrong block lookup shows, and its block table."""
    blocks = [max(1, math.ceil(n / page)) for n in kv_lens]
    total = sum(blocks) + 1
    k = torch.randn(total, page, HK, D).to(dtype)
    v = torch.full((total, page, HK, D), -100.0, dtype=dtype)
    table = torch.zeros(len(kv_lens), max(blocks), dtype=torch.int32)
    nxt = total - 1
    for b in range(len(kv_lens)):
        for i in range(blocks[b]):
            table[b, i] = nxt
            pos = torch.arange(i * page, (i + 1) * page, dtype=torch.float32)
            v[nxt] = pos.to(dtype)[:, None, None].expand(page, HK, D)
            nxt -= 1
    return dict(k=k, v=v, block_table=table)


def _zero_q(q_lens: list[int], dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.zeros(sum(q_lens), H, D, dtype=dtype)


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _vllm(q_lens: list[int], kv_lens: list[int], page: int = 16, **kw: Any) -> Any:
    c = _cache(kv_lens, page)
    args: dict[str, Any] = dict(
        q=_zero_q(q_lens),
        k=c["k"],
        v=c["v"],
        cu_seqlens_q=_cu(q_lens),
        max_seqlen_q=max(q_lens),
        seqused_k=torch.tensor(kv_lens, dtype=torch.int32),
        max_seqlen_k=max(kv_lens),
        block_table=c["block_table"],
        causal=True,
        return_softmax_lse=True,
    )
    args.update(kw)
    return emulator.VLLM.flash_attn_varlen_func(**args)


# --- the conventions --------------------------------------------------------------------------


def test_causal_is_bottom_right_aligned_as_the_docstring_draws_it() -> None:
    # seqlen_q = 2, seqlen_k = 5: row 0 keeps keys 0..3, row 1 keeps 0..4 [doc]
    out, lse = _vllm([2], [5])
    assert out[:, 0, 0].tolist() == [1.5, 2.0]  # mean of 0..3, mean of 0..4
    assert torch.allclose(lse[0], torch.tensor([math.log(4), math.log(5)]))


def test_fully_masked_rows_give_zero_output_and_plus_infinite_lse() -> None:
    # seqlen_q = 5, seqlen_k = 2: rows 0..2 see nothing [doc: "the output will be zero"]
    out, lse = _vllm([5], [2])
    assert torch.all(out[:3] == 0) and out[3, 0, 0] == 0.0 and out[4, 0, 0] == 0.5
    assert torch.all(torch.isposinf(lse[:, :3])) and torch.isfinite(lse[:, 3:]).all()


def test_fa4_reports_empty_rows_with_minus_infinite_lse() -> None:
    c = _cache([2], FA4_PAGE)
    out, lse = emulator.FA4.flash_attn_varlen_func(
        _zero_q([5]),
        c["k"],
        c["v"],
        cu_seqlens_q=_cu([5]),
        seqused_k=torch.tensor([2], dtype=torch.int32),
        page_table=c["block_table"],
        causal=True,
        return_lse=True,
    )
    assert torch.all(out[:3] == 0) and torch.all(torch.isneginf(lse[:, :3]))


def test_window_left_keeps_left_plus_one_keys_ending_at_the_aligned_position() -> None:
    out, lse = _vllm([2], [9], window_size=(2, 0))  # row 0 at position 7: keys 5..7
    assert out[:, 0, 0].tolist() == [6.0, 7.0]
    assert torch.allclose(lse, torch.full_like(lse, math.log(3)))


def test_lse_is_natural_log_float32_heads_by_tokens_for_varlen() -> None:
    out, lse = _vllm([1, 3], [20, 33])
    assert lse.shape == (H, 4) and lse.dtype == torch.float32
    assert torch.allclose(lse[0], torch.tensor([20.0, 31.0, 32.0, 33.0]).log())
    assert out.dtype == torch.float16 and out.shape == (4, H, D)


def test_the_kvcache_functions_return_lse_batch_heads_seqlen() -> None:
    c = _cache([7, 12], 256)
    q = torch.zeros(2, 1, H, D, dtype=torch.float16)
    out, lse = emulator.FA2.flash_attn_with_kvcache(
        q,
        c["k"],
        c["v"],
        cache_seqlens=torch.tensor([7, 12], dtype=torch.int32),
        block_table=c["block_table"],
        causal=True,
        return_softmax_lse=True,
    )
    assert out.shape == (2, 1, H, D) and out[:, 0, 0, 0].tolist() == [3.0, 5.5]
    assert lse.shape == (2, H, 1)
    assert torch.allclose(lse[:, 0, 0], torch.tensor([7.0, 12.0]).log())


def test_fa3_returns_more_than_out_and_lse_with_the_lse_as_its_interface_does() -> None:
    c = _cache([5], 16)
    result = emulator.FA3.flash_attn_with_kvcache(
        _zero_q([2]),
        c["k"],
        c["v"],
        cache_seqlens=torch.tensor([5], dtype=torch.int32),
        page_table=c["block_table"],
        cu_seqlens_q=_cu([2]),
        max_seqlen_q=2,
        causal=True,
        return_softmax_lse=True,
    )
    assert len(result) > 2  # (out, softmax_lse, *rest)
    out, lse = result[:2]
    assert out[:, 0, 0].tolist() == [1.5, 2.0] and lse.shape == (H, 2)


def test_a_sink_joins_the_denominator_without_a_value() -> None:
    c = _cache([4], FA4_PAGE)
    sink = torch.tensor([0.0, math.log(4.0)])  # head 1: a sink weighing as much as 4 keys
    out, lse = emulator.FA4.flash_attn_varlen_func(
        _zero_q([1]),
        c["k"],
        c["v"],
        cu_seqlens_q=_cu([1]),
        seqused_k=torch.tensor([4], dtype=torch.int32),
        page_table=c["block_table"],
        causal=True,
        learnable_sink=sink,
        return_lse=True,
    )
    assert out[0, 0, 0] == 6 / 5 and out[0, 1, 0] == 6 / 8  # (0+1+2+3) / (4 + e^sink)
    assert torch.allclose(lse[:, 0], torch.tensor([math.log(5), math.log(8)]))


def test_alibi_biases_by_distance_from_the_aligned_position() -> None:
    slopes = torch.tensor([math.log(2.0), 0.0])  # head 0: weight halves per step back
    out, _ = _vllm([1], [3], alibi_slopes=slopes)
    w = torch.tensor([0.25, 0.5, 1.0])
    assert torch.isclose(out[0, 0, 0].float(), (w * torch.arange(3.0)).sum() / w.sum(), atol=1e-3)
    assert out[0, 1, 0] == 1.0  # slope 0: plain mean


def test_softcap_bounds_the_scores() -> None:
    c = _cache([2], 16)
    c["k"][:] = 0
    key_rows = c["block_table"][0, 0]
    c["k"][key_rows, 1] = 50.0  # key 1 scores 50 * sum(q) * scale: huge, capped at 1
    q = torch.ones(1, H, D, dtype=torch.float16)
    out, lse = _vllm([1], [2], q=q, k=c["k"], softcap=1.0, softmax_scale=1.0)
    e = math.exp(math.tanh(400.0))  # cap * tanh(s / cap) with s = 400, cap = 1
    assert torch.isclose(out[0, 0, 0].float(), torch.tensor(e / (1 + e)), atol=1e-3)
    assert torch.allclose(lse[:, 0], torch.tensor(math.log(1 + e)))


def test_out_is_written_in_place() -> None:
    buf = torch.full((3, H, D), 9.0, dtype=torch.float16)
    got, _ = _vllm([3], [3], out=buf)
    assert got is buf and buf[:, 0, 0].tolist() == [0.0, 0.5, 1.0]


def test_reshape_and_cache_flash_skips_negative_slots_and_writes_only_slot_mapping_rows() -> None:
    kc = torch.zeros(2, 16, HK, D, dtype=torch.float16)
    vc = torch.zeros_like(kc)
    key = torch.arange(1.0, 5.0)[:, None, None].expand(4, HK, D).to(torch.float16)
    one = torch.ones(1)
    slots = torch.tensor([3, -1, 20], dtype=torch.int64)  # key row 3 is padding
    emulator.VLLM_CACHE_OPS.reshape_and_cache_flash(key, key, kc, vc, slots, "auto", one, one)
    flat = kc.view(32, HK, D)
    assert flat[3, 0, 0] == 1 and flat[20, 0, 0] == 3
    assert int((flat != 0).any(-1).any(-1).sum()) == 2


def test_reshape_and_cache_flash_writes_strided_planes_in_place() -> None:
    """vLLM's per-layer tensor: a slot's key and value side by side in the last dim; the op
    addresses both planes through key_cache's strides."""
    both = torch.zeros(2, 16, HK, 2 * D, dtype=torch.float16)
    kc, vc = both[..., :D], both[..., D:]
    key = torch.arange(1.0, 4.0)[:, None, None].expand(3, HK, D).to(torch.float16)
    one = torch.ones(1)
    slots = torch.tensor([3, -1, 20], dtype=torch.int64)
    emulator.VLLM_CACHE_OPS.reshape_and_cache_flash(key, -key, kc, vc, slots, "auto", one, one)
    flat = both.view(32, HK, 2 * D)
    assert flat[3, 0, 0] == 1 and flat[3, 0, D] == -1 and flat[20, 0, 0] == 3
    assert flat[20, 0, D] == -3 and int((flat != 0).any(-1).any(-1).sum()) == 2


@pytest.mark.parametrize(
    ("value_cache", "match"),
    [
        (torch.zeros(2, 17, HK, D, dtype=torch.float16)[:, :16], r"stride\(0\)"),
        (torch.zeros(2, HK, 16, D, dtype=torch.float16).transpose(1, 2), "key_cache's strides"),
    ],
)
def test_reshape_and_cache_flash_refuses_value_planes_laid_out_unlike_the_key_plane(
    value_cache: torch.Tensor, match: str
) -> None:
    kc = torch.zeros(2, 16, HK, D, dtype=torch.float16)
    key = torch.ones(1, HK, D, dtype=torch.float16)
    one = torch.ones(1)
    slots = torch.tensor([3], dtype=torch.int64)
    with pytest.raises(FlashOpError, match=match):
        emulator.VLLM_CACHE_OPS.reshape_and_cache_flash(
            key, key, kc, value_cache, slots, "auto", one, one
        )
    assert not kc.any() and not value_cache.any()


def _schedule(q_lens: list[int], kv_lens: list[int], **kw: Any) -> torch.Tensor:
    args: dict[str, Any] = dict(
        batch_size=len(q_lens),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(kv_lens),
        num_heads_q=H,
        num_heads_kv=HK,
        headdim=D,
        cache_seqlens=torch.tensor(kv_lens, dtype=torch.int32),
        qkv_dtype=torch.float16,
        cu_seqlens_q=_cu(q_lens),
        page_size=16,
        causal=True,
    )
    args.update(kw)
    return emulator.VLLM.get_scheduler_metadata(**args)


@pytest.mark.parametrize(
    ("q_lens", "kw", "size"),
    [
        # prepared seqlens + the head-swizzle vector (causal), round_up(3, 4) each, + semaphore
        ([3, 1, 5], {}, 1 + 4 * 2),
        ([3, 1, 5], {"causal": False}, 1 + 4 * 1),
        ([3, 1, 5], {"window_size": (4, 0)}, 1 + 4 * 2),  # local
        ([3, 1, 5], {"window_size": (40, 0)}, 1 + 4 * 2),  # a window covering all: causal
        ([3, 1, 5], {"num_splits": 4}, 1 + 4 * 3),  # + the dynamic-split vector
        ([1, 1, 1, 1, 1], {}, 1 + 8 * 1),  # one query each, head size <= 64: not causal
    ],
)
def test_fa3_scheduler_metadata_is_sized_as_the_fork_sizes_it(
    q_lens: list[int], kw: dict[str, Any], size: int
) -> None:
    kv_lens = [9, 4, 20, 3, 3][: len(q_lens)]
    got = _schedule(q_lens, kv_lens, **kw)
    assert got.dtype == torch.int32 and tuple(got.shape) == (size,)


def test_fa3_call_checks_the_scheduler_metadata_as_the_fork_does() -> None:
    q_lens, kv_lens = [3, 1, 5], [9, 4, 20]
    planned = _schedule(q_lens, kv_lens)
    out, lse = _vllm(q_lens, kv_lens, fa_version=3, scheduler_metadata=planned)
    want_out, want_lse = _vllm(q_lens, kv_lens, fa_version=3)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    # planned for 5 sequences (vectors of round_up(5, 4) = 8), or for a non-causal call
    other_batch = _schedule([3, 1, 5, 2, 2], [9, 4, 20, 2, 2])
    for stale in (other_batch, _schedule(q_lens, kv_lens, causal=False)):
        with pytest.raises(FlashOpError, match="invalid shape"):
            _vllm(q_lens, kv_lens, fa_version=3, scheduler_metadata=stale)
    with pytest.raises(FlashOpError, match="int32"):
        _vllm(q_lens, kv_lens, fa_version=3, scheduler_metadata=planned.long())
    with pytest.raises(FlashOpError, match="num_splits > 256"):
        _vllm(q_lens, kv_lens, fa_version=3, num_splits=300)
    # FA2 never passes it to its kernel [schema]: ignored, even when stale
    _vllm(q_lens, kv_lens, scheduler_metadata=_schedule([3], [9]))


def test_fa3_call_refuses_a_schedule_planned_for_other_lengths() -> None:
    """Same shape, other lengths (a captured graph replayed without planning it again): the
    kernel would run another step's tiles [inferred: undefined on the GPU, refused here]."""
    q_lens, kv_lens = [3, 1, 5], [9, 4, 20]
    for other_q, other_kv in (([3, 1, 5], [9, 5, 20]), ([2, 2, 5], [9, 4, 20])):
        stale = _schedule(other_q, other_kv, max_seqlen_q=5, max_seqlen_k=20)
        with pytest.raises(FlashOpError, match="planned for other sequence lengths"):
            _vllm(q_lens, kv_lens, fa_version=3, scheduler_metadata=stale)


def test_fa3_scheduler_metadata_refusals() -> None:
    with pytest.raises(FlashOpError, match="fp16, bf16"):
        _schedule([3], [9], qkv_dtype=torch.float32)
    with pytest.raises(FlashOpError, match="cache_seqlens"):
        _schedule([3, 1], [9, 4], batch_size=3)
    with pytest.raises(NotEmulatedError, match="cache_leftpad"):
        _schedule([3], [9], cache_leftpad=torch.zeros(1, dtype=torch.int32))


# --- what the libraries reject ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        (dict(cu_seqlens_k=_cu([3])), AssertionError, "cannot be provided at the same time"),
        (dict(seqused_k=None, cu_seqlens_k=None), AssertionError, "must be provided"),
        (dict(s_aux=torch.zeros(H)), NotImplementedError, "FA2 does not support s_aux"),
        (dict(fa_version=3, alibi_slopes=torch.zeros(H)), AssertionError, "Alibi"),
        (dict(max_seqlen_k=2), FlashOpError, "max_seqlen_k = 2"),
        (dict(dropout_p=0.1), NotEmulatedError, "dropout_p"),
    ],
)
def test_vllm_wrapper_refusals(kw: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        _vllm([3], [3], **kw)


def test_vllm_block_table_without_seqused_k_is_refused() -> None:
    c = _cache([3], 16)
    with pytest.raises(AssertionError, match="seqused_k must be provided"):
        emulator.VLLM.flash_attn_varlen_func(
            q=_zero_q([3]),
            k=c["k"],
            v=c["v"],
            cu_seqlens_q=_cu([3]),
            max_seqlen_q=3,
            cu_seqlens_k=_cu([3]),
            max_seqlen_k=3,
            block_table=c["block_table"],
        )


@pytest.mark.parametrize(("page", "ok"), [(16, True), (32, True), (8, False), (24, False)])
def test_vllm_paged_blocks_are_multiples_of_16(page: int, ok: bool) -> None:
    if ok:
        _vllm([1], [3], page=page)
        return
    with pytest.raises(FlashOpError, match="multiple of 16"):
        _vllm([1], [3], page=page)


def test_fa2_paged_blocks_are_multiples_of_256() -> None:
    c = _cache([3], 16)
    with pytest.raises(FlashOpError, match="multiple of 256"):
        emulator.FA2.flash_attn_varlen_func(
            _zero_q([3]), c["k"], c["v"], _cu([3]), _cu([3]), 3, 3, block_table=c["block_table"]
        )


def test_int64_block_tables_are_refused() -> None:
    c = _cache([3], 16)
    with pytest.raises(FlashOpError, match="int32"):
        _vllm([3], [3], block_table=c["block_table"].long())


def test_lengths_must_be_int32() -> None:
    with pytest.raises(FlashOpError, match="cu_seqlens_q must have dtype int32"):
        _vllm([3], [3], cu_seqlens_q=_cu([3]).long())


@pytest.mark.parametrize(
    ("q", "match"),
    [
        (torch.zeros(3, H, D, dtype=torch.float32), "fp16 and bf16"),
        (torch.zeros(3, H, D, dtype=torch.bfloat16), "same dtype"),
    ],
)
def test_dtypes_and_heads_are_checked(q: torch.Tensor, match: str) -> None:
    with pytest.raises(FlashOpError, match=match):
        _vllm([3], [3], q=q)


def test_query_heads_must_be_a_multiple_of_the_kv_heads() -> None:
    k = torch.zeros(3, 16, 2, D, dtype=torch.float16)
    with pytest.raises(FlashOpError, match="divisible by nheads_k"):
        _vllm([3], [3], q=torch.zeros(3, 3, D, dtype=torch.float16), k=k, v=k)


def test_head_sizes_follow_each_providers_rule() -> None:
    c = _cache([3], 16)
    k = torch.zeros(c["k"].shape[0], 16, HK, 12, dtype=torch.float16)
    with pytest.raises(FlashOpError, match="multiples of 8"):
        _vllm([3], [3], q=torch.zeros(3, H, 12, dtype=torch.float16), k=k, v=k)
    k = torch.zeros(c["k"].shape[0], 16, HK, 192, dtype=torch.float16)
    with pytest.raises(FlashOpError, match=r"8\.\.128"):
        emulator.FA4.flash_attn_varlen_func(
            torch.zeros(3, H, 192, dtype=torch.float16),
            k,
            k,
            cu_seqlens_q=_cu([3]),
            seqused_k=torch.tensor([3], dtype=torch.int32),
            page_table=c["block_table"],
        )


def test_fa4_page_table_with_cu_seqlens_k_is_refused() -> None:
    c = _cache([3], 16)
    with pytest.raises(AssertionError, match="page_table is not supported with cu_seqlens_k"):
        emulator.FA4.flash_attn_varlen_func(
            _zero_q([3]),
            c["k"],
            c["v"],
            cu_seqlens_q=_cu([3]),
            cu_seqlens_k=_cu([3]),
            page_table=c["block_table"],
        )


def test_fa4_cu_seqlens_q_that_is_not_a_tensor_is_refused_by_name() -> None:
    c = _cache([3], FA4_PAGE)
    with pytest.raises(FlashOpError, match="cu_seqlens_q must be a Tensor"):
        emulator.FA4.flash_attn_varlen_func(
            _zero_q([3]),
            c["k"],
            c["v"],
            cu_seqlens_q=[0, 3],
            seqused_k=torch.tensor([3], dtype=torch.int32),
            page_table=c["block_table"],
        )


def test_a_block_table_too_short_for_the_sequence_is_refused() -> None:
    with pytest.raises(FlashOpError, match="blocks"):
        _vllm([1], [40], block_table=torch.zeros(1, 1, dtype=torch.int32))


def test_fa3_varlen_q_needs_max_seqlen_q() -> None:
    c = _cache([3], 16)
    with pytest.raises(FlashOpError, match="max_seqlen_q"):
        emulator.FA3.flash_attn_with_kvcache(
            _zero_q([3]),
            c["k"],
            c["v"],
            cache_seqlens=torch.tensor([3], dtype=torch.int32),
            page_table=c["block_table"],
            cu_seqlens_q=_cu([3]),
        )


def test_unknown_keywords_are_refused_as_python_would() -> None:
    with pytest.raises(TypeError, match="page_table"):
        _vllm([3], [3], page_table=None)


# --- null-kernel mode (attnhub.emulation: host-overhead benchmarks) -------------------------------


def test_null_kernels_keep_every_check() -> None:
    with emulation.null_kernels(), pytest.raises(FlashOpError, match="blocks"):
        _vllm([1], [40], block_table=torch.zeros(1, 1, dtype=torch.int32))
    with emulation.null_kernels(), pytest.raises(FlashOpError, match="outside the cache"):
        _vllm([1], [3], block_table=torch.full((1, 1), 99, dtype=torch.int32))
    with emulation.null_kernels(), pytest.raises(FlashOpError, match="int32"):
        _vllm([1], [3], block_table=torch.zeros(1, 1, dtype=torch.int64))
    kc = torch.zeros(2, 16, HK, D, dtype=torch.float16)
    key = torch.ones(1, HK, D, dtype=torch.float16)
    one = torch.ones(1)
    with emulation.null_kernels(), pytest.raises(FlashOpError, match="outside the cache"):
        emulator.VLLM_CACHE_OPS.reshape_and_cache_flash(
            key, key, kc, kc.clone(), torch.tensor([32]), "auto", one, one
        )


def test_null_kernels_skip_the_math_and_return_outputs_of_the_right_shapes() -> None:
    c = _cache([7, 12], 256)
    kc = torch.zeros(2, 16, HK, D, dtype=torch.float16)
    key = torch.ones(2, HK, D, dtype=torch.float16)
    one = torch.ones(1)
    with emulation.null_kernels() as ops:
        out, lse = _vllm([2, 1], [5, 9])
        emulator.VLLM_CACHE_OPS.reshape_and_cache_flash(
            key, key, kc, kc.clone(), torch.tensor([0, 5]), "auto", one, one
        )
        out2, lse2 = emulator.FA2.flash_attn_with_kvcache(
            torch.zeros(2, 1, H, D, dtype=torch.float16),
            c["k"],
            c["v"],
            cache_seqlens=torch.tensor([7, 12], dtype=torch.int32),
            block_table=c["block_table"],
            return_softmax_lse=True,
        )
        c4 = _cache([7], FA4_PAGE)
        out4, _ = emulator.FA4.flash_attn_varlen_func(
            _zero_q([3]),
            c4["k"],
            c4["v"],
            cu_seqlens_q=_cu([3]),
            seqused_k=torch.tensor([7], dtype=torch.int32),
            page_table=c4["block_table"],
        )
    assert out.shape == (3, H, D) and out.dtype == torch.float16 and lse.shape == (H, 3)
    assert out2.shape == (2, 1, H, D) and lse2.shape == (2, H, 1)
    assert out4.shape == (3, H, D) and out4.dtype == torch.float16
    assert not kc.any()  # the write wrote nothing
    assert ops.calls == 4 and ops.seconds > 0
    out, _ = _vllm([3], [3])  # outside: the math again
    assert out[:, 0, 0].tolist() == [0.0, 0.5, 1.0]
