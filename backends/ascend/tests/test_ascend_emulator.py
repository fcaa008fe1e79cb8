"""The emulator follows the vendor's conventions and rejects what the vendor op rejects."""

from __future__ import annotations

import inspect
import math
from typing import Any

import pytest
import torch
from attnhub_ascend import emulator, emulator_atb
from attnhub_ascend.emulator import NotEmulatedError, NpuOpError

from attnhub import emulation

FIA = emulator.npu_fused_infer_attention_score
FA = emulator.npu_fusion_attention
SCATTER = emulator.npu_scatter_pa_kv_cache
FA_MAX_T = emulator.FA_VARLEN_MAX_T
MASK = emulator.compressed_causal_mask()
BS = 128


def _paged(
    q_lens: list[int],
    kv_lens: list[int],
    *,
    heads: int = 4,
    kv_heads: int = 2,
    d: int = 64,
    seed: int = 0,
) -> dict[str, Any]:
    """FIA arguments for a TND batch over a paged cache (num_blocks, block_size, KV_N*D)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(n / BS) for n in kv_lens]
    nb = sum(blocks) + 1
    key = torch.randn(nb, BS, kv_heads * d, generator=g).to(torch.bfloat16)
    value = torch.randn(nb, BS, kv_heads * d, generator=g).to(torch.bfloat16)
    table = torch.zeros(len(kv_lens), max(blocks), dtype=torch.int32)
    nxt = 1
    for r, n in enumerate(blocks):
        table[r, :n] = torch.arange(nxt, nxt + n, dtype=torch.int32)
        nxt += n
    ends = torch.cumsum(torch.tensor(q_lens), 0).tolist()
    q = torch.randn(ends[-1], heads, d, generator=g).to(torch.bfloat16)
    return dict(
        query=q,
        key=key,
        value=value,
        actual_seq_lengths=ends,
        actual_seq_lengths_kv=kv_lens,
        block_table=table,
        block_size=BS,
        num_heads=heads,
        num_key_value_heads=kv_heads,
        scale=d**-0.5,
        input_layout="TND",
        sparse_mode=3,
        atten_mask=MASK,
    )


def _fia(args: dict[str, Any]) -> torch.Tensor:
    a = dict(args)
    return FIA(a.pop("query"), a.pop("key"), a.pop("value"), **a)[0]


def _dense(args: dict[str, Any], b: int, visible: torch.Tensor) -> torch.Tensor:
    """Request b by plain softmax over its gathered keys, with an explicit visibility."""
    ends = [0, *args["actual_seq_lengths"]]
    q = args["query"][ends[b] : ends[b + 1]].float()
    kv = args["actual_seq_lengths_kv"][b]
    rows = args["block_table"][b].long()
    pos = torch.arange(kv)
    slots = rows[pos // BS] * BS + pos % BS
    kvh = args["num_key_value_heads"]
    k = args["key"].view(-1, kvh, q.shape[2])[slots].float()
    v = args["value"].view(-1, kvh, q.shape[2])[slots].float()
    group = q.shape[1] // kvh
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("ihd,jhd->hij", q, k) * args["scale"]
    s = s.masked_fill(~visible, -math.inf)
    return torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v)


# --- geometry ------------------------------------------------------------------------------------


def test_sparse_mode_3_is_bottom_right_causal() -> None:
    args = _paged([5, 1], [20, 9])
    out = _fia(args)
    i, j = torch.arange(5)[:, None], torch.arange(20)[None, :]
    want = _dense(args, 0, j <= i + 15)
    torch.testing.assert_close(out[:5].float(), want, atol=1e-2, rtol=1e-2)


def test_band_pre_tokens_w_keeps_w_plus_1_keys() -> None:
    """The documented band: -pre <= (j - i) - (kv - q) <= next, so pre_tokens=W shows W+1."""
    args = _paged([4], [30]) | dict(sparse_mode=4, pre_tokens=6, next_tokens=0)
    out = _fia(args)
    i, j = torch.arange(4)[:, None], torch.arange(30)[None, :]
    d = (j - i) - 26
    want = _dense(args, 0, (d >= -6) & (d <= 0))  # 7 keys per row
    assert int(((d >= -6) & (d <= 0)).sum(1)[0]) == 7
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)


def test_decode_rows_ignore_sparse_mode_and_the_band() -> None:
    """One query token goes through the IFA branch: it sees every key of its sequence."""
    args = _paged([1], [30]) | dict(sparse_mode=4, pre_tokens=3, next_tokens=0)
    out = _fia(args)
    want = _dense(args, 0, torch.ones(1, 30, dtype=torch.bool))
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)


def test_no_mask_with_sparse_mode_0_is_full_attention() -> None:
    args = _paged([4], [9]) | dict(sparse_mode=0, atten_mask=None, pre_tokens=0)
    torch.testing.assert_close(
        _fia(args).float(),
        _dense(args, 0, torch.ones(4, 9, dtype=torch.bool)),
        atol=1e-2,
        rtol=1e-2,
    )


def test_lse_comes_back_only_with_the_flag() -> None:
    args = _paged([3, 1], [3, 7])
    a = dict(args)
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    _, lse = FIA(q, k, v, **a)
    assert lse.shape == (1,) and float(lse[0]) == 0
    _, lse = FIA(q, k, v, softmax_lse_flag=True, **a)
    assert lse.shape == (4, 4, 1) and lse.dtype == torch.float32


def test_out_takes_vllm_ascends_reserved_lse_in_the_query_dtype() -> None:
    """Without the LSE flag softmax_lse is a reserved output: vllm-ascend passes
    ``torch.empty(1, dtype=query.dtype)``. With the flag the op writes float32 (T, N, 1)."""
    a = _paged([3, 1], [3, 7])
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    buf = torch.empty_like(q)
    FIA.out(q, k, v, workspace=None, out=[buf, torch.empty(1, dtype=q.dtype)], **a)
    torch.testing.assert_close(buf, FIA(q, k, v, **a)[0])
    with pytest.raises(NpuOpError, match="float32"):
        FIA.out(q, k, v, softmax_lse_flag=True, out=[buf, torch.empty(4, 4, 1, dtype=q.dtype)], **a)


def test_out_overload_writes_the_given_buffers() -> None:
    a = _paged([3, 1], [3, 7])
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    buf, lse = torch.empty_like(q), torch.empty(1)
    res = FIA.out(q, k, v, workspace=None, out=[buf, lse], **a)
    assert res[0] is buf
    torch.testing.assert_close(buf, FIA(q, k, v, **a)[0])


def test_learnable_sink_joins_the_denominator() -> None:
    a = _paged([2], [5])
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    sink = torch.full((4,), 50.0, dtype=torch.bfloat16)  # a huge sink takes all the weight
    out, _ = emulator.npu_fused_infer_attention_score_v2(
        q,
        k,
        v,
        actual_seq_qlen=a["actual_seq_lengths"],
        actual_seq_kvlen=a["actual_seq_lengths_kv"],
        block_table=a["block_table"],
        learnable_sink=sink,
        num_query_heads=4,
        num_key_value_heads=2,
        softmax_scale=a["scale"],
        input_layout="TND",
        sparse_mode=3,
        atten_mask=MASK,
        block_size=BS,
    )
    assert float(out.float().abs().max()) < 1e-6


def test_reshape_and_cache_skips_negative_slots() -> None:
    kc, vc = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    k = torch.arange(3 * 16, dtype=torch.float32).view(3, 1, 16) + 1
    emulator._npu_reshape_and_cache(k, k, kc, vc, torch.tensor([5, -1, 0], dtype=torch.int32))
    assert torch.equal(kc.view(8, 1, 16)[5], k[0]) and torch.equal(kc.view(8, 1, 16)[0], k[2])
    assert int((kc.view(8, -1).abs().sum(1) > 0).sum()) == 2


def test_reshape_and_cache_takes_strided_inputs_as_the_wrapper_copies_them() -> None:
    """torch_npu's ATB wrapper makes every input contiguous before the op: strided key, value
    and slot_indices are valid calls; the caches (outputs) must be contiguous."""
    kc, vc = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    wide = torch.arange(3 * 32, dtype=torch.float32).view(3, 1, 32) + 1
    k = wide[..., :16]  # rows 32 apart
    slots = torch.tensor([5, 9, -1, 9, 0, 9], dtype=torch.int32)[::2]  # [5, -1, 0], stride 2
    emulator._npu_reshape_and_cache(k, k, kc, vc, slots)
    assert torch.equal(kc.view(8, 1, 16)[5], k[0]) and torch.equal(vc.view(8, 1, 16)[0], k[2])
    with pytest.raises(NpuOpError, match="contiguous"):
        emulator._npu_reshape_and_cache(k, k, torch.zeros(2, 4, 1, 32)[..., :16], vc, slots)


# --- strictness ----------------------------------------------------------------------------------


def test_int64_block_table_is_rejected() -> None:
    a = _paged([2], [5])
    a["block_table"] = a["block_table"].long()
    with pytest.raises(NpuOpError, match="block_table must be int32"):
        _fia(a)


def test_per_request_query_lengths_are_rejected() -> None:
    a = _paged([3, 2, 4], [9, 9, 9])
    a["actual_seq_lengths"] = [3, 2, 4]
    with pytest.raises(NpuOpError, match="cumulative"):
        _fia(a)


def test_cumulative_kv_lengths_with_a_paged_cache_are_rejected() -> None:
    a = _paged([1, 1], [100, 100])
    a["actual_seq_lengths_kv"] = [100, 200]
    with pytest.raises(NpuOpError, match="per-sequence"):
        _fia(a)


def test_kv_lengths_of_the_wrong_count_are_rejected() -> None:
    a = _paged([1, 1], [10, 10])
    a["actual_seq_lengths_kv"] = [10]
    with pytest.raises(NpuOpError, match="entries"):
        _fia(a)


def test_lengths_as_a_host_tensor_are_taken_as_vllm_ascend_passes_them() -> None:
    """vllm-ascend passes its CPU ``seq_lens`` tensor as ``actual_seq_kvlen``: the binding reads
    each element as an int."""
    a = _paged([1, 1], [10, 10])
    want = _fia(a)
    a["actual_seq_lengths_kv"] = torch.tensor([10, 10], dtype=torch.int32)
    torch.testing.assert_close(_fia(a), want)
    a["actual_seq_lengths_kv"] = torch.tensor([10.0, 10.0])
    with pytest.raises(NpuOpError, match="integer dtype"):
        _fia(a)
    a["actual_seq_lengths_kv"] = "10,10"
    with pytest.raises(NpuOpError, match="list of ints"):
        _fia(a)


@pytest.mark.parametrize(
    "mask",
    [torch.ones(16, 16, dtype=torch.int8), MASK.float(), 1 - MASK, torch.tril(MASK.T)],
    ids=["shape", "dtype", "polarity", "transposed"],
)
def test_a_wrong_compressed_mask_is_rejected(mask: torch.Tensor) -> None:
    with pytest.raises(NpuOpError, match="atten_mask"):
        _fia(_paged([3], [3]) | dict(atten_mask=mask))


def test_missing_mask_for_causal_is_rejected() -> None:
    with pytest.raises(NpuOpError, match="needs the compressed"):
        _fia(_paged([3], [3]) | dict(atten_mask=None))


def test_prefill_block_size_must_be_a_multiple_of_128() -> None:
    a = _paged([3], [3])
    nb = a["key"].shape[0]
    a |= dict(
        key=a["key"].view(nb * 2, 64, -1), value=a["value"].view(nb * 2, 64, -1), block_size=64
    )
    with pytest.raises(NpuOpError, match="multiple of 128"):
        _fia(a)


def test_layouts_outside_tnd_are_valid_but_not_emulated() -> None:
    with pytest.raises(NotEmulatedError):
        _fia(_paged([3], [3]) | dict(input_layout="BSH"))
    with pytest.raises(NpuOpError):
        _fia(_paged([3], [3]) | dict(input_layout="THD"))


def test_vendor_keyword_spellings_are_enforced() -> None:
    a = _paged([3], [3])
    a.pop("scale")
    with pytest.raises(TypeError, match="scale_value"):
        _fia(a | dict(scale_value=0.1))  # that is npu_incre_flash_attention's keyword
    q = torch.zeros(4, 2, 16, dtype=torch.float16)
    with pytest.raises(TypeError, match="pre_tokens"):
        FA(q, q, q, 2, "TND", actual_seq_qlen=[4], actual_seq_kvlen=[4], pre_tokens=1)
    with pytest.raises(TypeError):
        FIA(q, q, q, None)  # everything after value is keyword-only


def test_fusion_attention_takes_cumulative_lengths_and_returns_seven_outputs() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(7, 2, 16, generator=g).to(torch.float16)
    res = FA(q, q, q, 2, "TND", scale=0.25, actual_seq_qlen=[3, 7], actual_seq_kvlen=[3, 7])
    assert len(res) == 7 and res[0].shape == q.shape and res[4:] == (0, 0, 0)
    with pytest.raises(NpuOpError, match="cumulative"):
        FA(q, q, q, 2, "TND", actual_seq_qlen=[3, 4], actual_seq_kvlen=[3, 4])


def test_reshape_and_cache_needs_int32_slots() -> None:
    kc = torch.zeros(2, 4, 1, 16)
    k = torch.ones(1, 1, 16)
    with pytest.raises(NpuOpError, match="int32"):
        emulator._npu_reshape_and_cache(k, k, kc, kc.clone(), torch.tensor([1]))


def test_every_call_is_counted_under_its_overload() -> None:
    a = _paged([3], [3])
    _fia(a)
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    FIA.out(q, k, v, out=[torch.empty_like(q), torch.empty(1)], **a)
    assert emulator.call_counts == {
        "npu_fused_infer_attention_score": 1,
        "npu_fused_infer_attention_score.out": 1,
    }


def test_the_emulator_never_uses_attnhubs_reference() -> None:
    # The one attnhub name it may use is the kit's emulation (the null-kernel switch: no math).
    for module in (emulator, emulator_atb):
        source = inspect.getsource(module).replace("from attnhub.kit import emulation\n", "", 1)
        source = source.replace("from attnhub_ascend.emulator import", "", 1)  # its sibling
        assert "import attnhub" not in source and "from attnhub" not in source, module


def test_a_compressed_mask_made_under_inference_mode_is_accepted():
    # Regression: engines (vLLM) run steps under torch.inference_mode; tensors made there have
    # no version counter, which the emulator's once-per-mask check used to read and crash on.
    with torch.inference_mode():
        mask = torch.triu(torch.ones(2048, 2048, dtype=torch.int8), 1)
        emulator._check_compressed_mask("npu_fused_infer_attention_score", mask, 3, mask.device)


# --- limits from the vendor docs ------------------------------------------------------------------


def test_fia_tnd_takes_at_most_4096_requests() -> None:
    def call(requests: int) -> None:
        q = torch.randn(requests, 2, 16).to(torch.bfloat16)  # one token per request
        ends = list(range(1, requests + 1))
        lengths = dict(actual_seq_lengths=ends, actual_seq_lengths_kv=ends)
        FIA(q, q, q, num_heads=2, input_layout="TND", **lengths)

    call(4096)
    with pytest.raises(NpuOpError, match=r"4097 requests.*at most 4096"):
        call(4097)


def test_fia_v1_takes_sparse_modes_0_to_4_only() -> None:
    a = _paged([2], [5]) | dict(sparse_mode=9)
    with pytest.raises(NpuOpError, match="sparse_mode=9 is not one of 0, 1, 2, 3, 4"):
        _fia(a)


def test_fia_tnd_head_size_512_needs_rope() -> None:
    with pytest.raises(NpuOpError, match="D=512 needs query_rope and key_rope"):
        _fia(_paged([2], [5], heads=2, kv_heads=1, d=512))


def test_fusion_attention_varlen_takes_at_most_1m_tokens() -> None:
    q = torch.zeros(FA_MAX_T + 1, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(NpuOpError, match="T = 1048577"):
        FA(q, q, q, 1, "TND", actual_seq_qlen=[FA_MAX_T + 1], actual_seq_kvlen=[FA_MAX_T + 1])


@pytest.mark.parametrize("shape", [(1, 2048, 2048), (1, 1, 2048, 2048)])
def test_fusion_attention_varlen_takes_only_a_two_dimensional_mask(shape: tuple[int, ...]) -> None:
    q = torch.randn(6, 2, 16).to(torch.bfloat16)
    mask = emulator.compressed_causal_mask(dtype=torch.bool)
    args = dict(actual_seq_qlen=[6], actual_seq_kvlen=[6], sparse_mode=3)
    with pytest.raises(NpuOpError, match="shape"):
        FA(q, q, q, 2, "TND", atten_mask=mask.view(shape), **args)
    FA(q, q, q, 2, "TND", atten_mask=mask, **args)


def test_fusion_attention_takes_uint8_and_bool_masks_not_int8() -> None:
    q = torch.randn(6, 2, 16).to(torch.bfloat16)
    args = dict(actual_seq_qlen=[6], actual_seq_kvlen=[6], sparse_mode=3)
    for dtype in (torch.bool, torch.uint8):
        FA(q, q, q, 2, "TND", atten_mask=emulator.compressed_causal_mask(dtype=dtype), **args)
    with pytest.raises(NpuOpError, match=r"one of bool, uint8, got torch\.int8"):
        FA(q, q, q, 2, "TND", atten_mask=MASK, **args)


def test_fusion_attention_trailing_zero_batches_take_no_part() -> None:
    """The doc's example: real lengths [2, 3, 4, 5, 6] with the last two left out is
    ``actual_seq_qlen=[2, 5, 9, 0, 0]``."""
    q = torch.randn(9, 2, 16).to(torch.bfloat16)
    out = FA(q, q, q, 2, "TND", actual_seq_qlen=[2, 5, 9, 0, 0], actual_seq_kvlen=[2, 5, 9, 0, 0])
    want = FA(q, q, q, 2, "TND", actual_seq_qlen=[2, 5, 9], actual_seq_kvlen=[2, 5, 9])
    torch.testing.assert_close(out[0], want[0])
    with pytest.raises(NpuOpError, match="cumulative"):  # a zero inside stays an error
        FA(q, q, q, 2, "TND", actual_seq_qlen=[2, 0, 9], actual_seq_kvlen=[2, 5, 9])


# --- fully masked rows ----------------------------------------------------------------------------


def _band_with_an_empty_first_row(**extra: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A band (pre 1, next -1) that shows query 0 of a 4 x 4 request no key."""
    a = _paged([4], [4]) | dict(sparse_mode=4, pre_tokens=1, next_tokens=-1) | extra
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    return FIA(q, k, v, softmax_lse_flag=True, **a)


def test_fully_masked_rows_are_undefined_without_inner_precise_2_or_3() -> None:
    out, lse = _band_with_an_empty_first_row()
    assert out[0].float().isnan().all() and lse[0].isnan().all()
    assert out[1:].float().isfinite().all()


@pytest.mark.parametrize("inner_precise", [2, 3])
def test_inner_precise_2_or_3_corrects_fully_masked_rows_to_zero(inner_precise: int) -> None:
    out, lse = _band_with_an_empty_first_row(inner_precise=inner_precise)
    assert float(out[0].float().abs().max()) == 0 and torch.isposinf(lse[0]).all()


def test_the_op_corrects_rows_it_detects_itself_causal_with_more_queries_than_keys() -> None:
    """sparse_mode 3 with Q_S > KV_S: the doc's example of a case the op detects."""
    a = _paged([4], [2])  # 4 query rows over 2 keys: rows 0 and 1 see none
    out = _fia(a)
    assert float(out[:2].float().abs().max()) == 0 and out[2:].float().isfinite().all()


def test_inner_precise_2_is_refused_when_every_request_has_one_query_token() -> None:
    with pytest.raises(NpuOpError, match="Q_S = 1 only 0 and 1"):
        _fia(_paged([1, 1], [5, 9]) | dict(inner_precise=2))
    _fia(_paged([1, 3], [5, 9]) | dict(inner_precise=2))


def test_fusion_attention_varlen_refuses_rows_that_see_no_key() -> None:
    q = torch.randn(4, 2, 16).to(torch.bfloat16)
    mask = emulator.compressed_causal_mask(dtype=torch.bool)
    with pytest.raises(NpuOpError, match="sees no key"):
        FA(
            q,
            q,
            q,
            2,
            "TND",
            atten_mask=mask,
            actual_seq_qlen=[4],
            actual_seq_kvlen=[4],
            sparse_mode=4,
            pre_tockens=1,
            next_tockens=-1,
        )


# --- one-token requests and the band --------------------------------------------------------------


def test_under_the_other_reading_one_token_requests_keep_the_band(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(emulator, "SINGLE_TOKEN_IGNORES_SPARSE", False)
    args = _paged([1], [30]) | dict(sparse_mode=4, pre_tokens=3, next_tokens=0)
    want = _dense(args, 0, torch.arange(30)[None, :] >= 26)
    torch.testing.assert_close(_fia(args).float(), want, atol=1e-2, rtol=1e-2)


# --- KV writes ------------------------------------------------------------------------------------


def test_reshape_and_cache_takes_different_k_and_v_head_sizes() -> None:
    kc, vc = torch.zeros(2, 4, 1, 32), torch.zeros(2, 4, 1, 16)
    k, v = torch.randn(3, 1, 32), torch.randn(3, 1, 16)
    emulator._npu_reshape_and_cache(k, v, kc, vc, torch.tensor([5, 0, 7], dtype=torch.int32))
    assert torch.equal(kc.view(8, 1, 32)[7], k[2]) and torch.equal(vc.view(8, 1, 16)[7], v[2])


def test_scatter_pa_kv_cache_norm_writes_nd_caches() -> None:
    kc, vc = torch.zeros(2, 4, 2, 32), torch.zeros(2, 4, 2, 16)
    k, v = torch.randn(3, 2, 32), torch.randn(3, 2, 16)
    SCATTER(k, v, kc, vc, torch.tensor([5, 0, 7]), cache_mode="Norm")
    assert torch.equal(kc.view(8, 2, 32)[5], k[0]) and torch.equal(vc.view(8, 2, 16)[0], v[1])
    assert int((kc.view(8, -1).abs().sum(1) > 0).sum()) == 3


def test_scatter_pa_kv_cache_has_no_padding_slot() -> None:
    kc = torch.zeros(2, 4, 1, 16)
    k = torch.randn(2, 1, 16)
    with pytest.raises(NpuOpError, match=r"slot_mapping\[1\] = -1 is outside \[0, 7\]"):
        SCATTER(k, k, kc, kc.clone(), torch.tensor([3, -1], dtype=torch.int32), cache_mode="Norm")


def test_scatter_pa_kv_cache_nz_and_compression_are_valid_but_not_emulated() -> None:
    kc = torch.zeros(2, 4, 1, 16)
    k = torch.randn(2, 1, 16)
    slots = torch.tensor([3, 1], dtype=torch.int32)
    with pytest.raises(NotEmulatedError, match="PA_NZ"):
        SCATTER(k, k, kc, kc.clone(), slots)  # the default cache_mode is 'PA_NZ'
    with pytest.raises(NotEmulatedError, match="seq_lens"):
        SCATTER(k, k, kc, kc.clone(), slots, seq_lens=slots, cache_mode="Norm")


def test_v2_tree_mask_mode_9_needs_the_mla_form() -> None:
    a = _paged([2], [5]) | dict(sparse_mode=9)
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    args = dict(
        actual_seq_qlen=a.pop("actual_seq_lengths"),
        actual_seq_kvlen=a.pop("actual_seq_lengths_kv"),
        num_query_heads=a.pop("num_heads"),
        softmax_scale=a.pop("scale"),
    )
    with pytest.raises(NpuOpError, match="sparse_mode=9 needs query_rope"):
        emulator.npu_fused_infer_attention_score_v2(q, k, v, **a, **args)


def test_fusion_attention_takes_a_value_head_size_up_to_the_keys() -> None:
    """ "Dq=Dk和Dk≥Dv": the output has the value's head size; a larger Dv is refused."""
    q = torch.randn(6, 2, 32).to(torch.bfloat16)
    v = torch.randn(6, 2, 16).to(torch.bfloat16)
    lengths = dict(actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 6])
    out = FA(q, q, v, 2, "TND", scale=0.2, **lengths)[0]
    assert out.shape == (6, 2, 16)
    wide = FA(q, q, torch.cat([v, torch.zeros_like(v)], -1), 2, "TND", scale=0.2, **lengths)[0]
    torch.testing.assert_close(out, wide[..., :16])  # the same weights over the same values
    with pytest.raises(NpuOpError, match="Dv <= 32"):
        FA(q, q, torch.randn(6, 2, 48).to(torch.bfloat16), 2, "TND", **lengths)


# --- null-kernel mode (attnhub.emulation: host-overhead benchmarks) -------------------------------


def test_null_kernels_keep_every_check() -> None:
    a = _paged([3, 2, 4], [9, 9, 9])
    a["actual_seq_lengths"] = [3, 2, 4]
    with emulation.null_kernels(), pytest.raises(NpuOpError, match="cumulative"):
        _fia(a)
    a = _paged([2], [5])
    a["block_table"] = a["block_table"].long()
    with emulation.null_kernels(), pytest.raises(NpuOpError, match="block_table must be int32"):
        _fia(a)
    kc = torch.zeros(2, 4, 1, 16)
    k = torch.ones(1, 1, 16)
    with emulation.null_kernels(), pytest.raises(NpuOpError, match="outside"):
        SCATTER(k, k, kc, kc.clone(), torch.tensor([8]), cache_mode="Norm")


def test_null_kernels_skip_the_math_and_return_outputs_of_the_right_shapes() -> None:
    a = _paged([2, 1], [130, 7])
    with emulation.null_kernels() as ops:
        out = _fia(a)
        q = torch.randn(7, 2, 16).to(torch.float16)
        res = FA(q, q, q, 2, "TND", scale=0.25, actual_seq_qlen=[3, 7], actual_seq_kvlen=[3, 7])
        kc, vc = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
        k = torch.ones(3, 1, 16)
        emulator._npu_reshape_and_cache(k, k, kc, vc, torch.tensor([5, -1, 0], dtype=torch.int32))
        SCATTER(k, k, kc, vc, torch.tensor([1, 2, 3]), cache_mode="Norm")
    assert out.shape == a["query"].shape and out.dtype == a["query"].dtype
    assert len(res) == 7 and res[0].shape == q.shape and res[1].shape == (2, 7, 8)
    assert not kc.any() and not vc.any()  # the writes wrote nothing
    assert ops.calls == 4 and ops.seconds > 0
    assert torch.isfinite(_fia(a)).all()  # outside: the math again


# --- workspaces, sinks, full masks, numpy lists ----------------------------------------------


def _fia_out(kw: dict[str, Any], workspace: torch.Tensor | None) -> torch.Tensor:
    out = torch.full_like(kw["query"], 7.0)
    FIA.out(**kw, workspace=workspace, out=[out, torch.empty(1)])
    return out


def test_a_max_workspace_fits_every_length_up_to_the_block_tables_capacity() -> None:
    short = _paged([1, 1], [3, 5])
    workspace = emulator._npu_fused_infer_attention_score_get_max_workspace(**short)
    full = {**short, "actual_seq_lengths_kv": [BS, BS]}  # every request at the capacity
    assert torch.isfinite(_fia_out(full, workspace)).all()


def test_a_workspace_smaller_than_the_call_needs_is_refused_before_any_write() -> None:
    kw = _paged([1, 1], [300, 5])
    need = emulator._workspace_bytes(4, [300, 5])
    too_small = torch.empty(need - 1, dtype=torch.uint8)
    out = torch.full_like(kw["query"], 7.0)
    with pytest.raises(NpuOpError, match="workspace of"):
        FIA.out(**kw, workspace=too_small, out=[out, torch.empty(1)])
    assert (out == 7.0).all()
    assert torch.isfinite(_fia_out(kw, torch.empty(need, dtype=torch.uint8))).all()


def test_length_lists_may_be_numpy_arrays_and_numpy_ints_but_not_floats() -> None:
    import numpy as np

    kw = _paged([1, 2], [5, 9])
    want = _fia_out(kw, None)
    as_numpy = {
        **kw,
        "actual_seq_lengths": [np.int64(1), np.int64(3)],
        "actual_seq_lengths_kv": np.array([5, 9], dtype=np.int32),
    }
    assert torch.equal(_fia_out(as_numpy, None), want)
    with pytest.raises(NpuOpError, match="integer dtype"):
        _fia_out({**kw, "actual_seq_lengths_kv": np.array([5.0, 9.0])}, None)


def _packed(q_lens: list[int], dtype: torch.dtype = torch.float16) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    t = sum(q_lens)
    ends = torch.cumsum(torch.tensor(q_lens), 0).tolist()
    return dict(
        query=torch.randn(t, 4, 64, generator=g).to(dtype),
        key=torch.randn(t, 2, 64, generator=g).to(dtype),
        value=torch.randn(t, 2, 64, generator=g).to(dtype),
        head_num=4,
        input_layout="TND",
        scale=0.125,
        actual_seq_qlen=ends,
        actual_seq_kvlen=ends,
    )


def test_npu_fusion_attentions_sink_is_float32_per_head() -> None:
    kw = _packed([3, 2])
    with pytest.raises(NpuOpError, match="float32"):
        FA(**kw, sink=torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(NpuOpError, match="head_num=4"):
        FA(**kw, sink=torch.zeros(2))
    plain = FA(**kw)[0].float()
    very_negative = FA(**kw, sink=torch.full((4,), -1e4))[0].float()
    assert torch.allclose(plain, very_negative)  # a sink of weight 0 changes nothing
    assert not torch.allclose(plain, FA(**kw, sink=torch.full((4,), 3.0))[0].float())


def test_a_full_mask_in_varlen_must_be_max_sq_by_max_skv() -> None:
    kw = _packed([3, 5])
    mask = torch.ones(5, 5, dtype=torch.bool).triu_(1)
    FA(**kw, atten_mask=mask, sparse_mode=0, next_tockens=0)
    with pytest.raises(NpuOpError, match="maxSq=5, maxSkv=5"):
        FA(**kw, atten_mask=torch.ones(6, 6, dtype=torch.bool).triu_(1), sparse_mode=0)
    with pytest.raises(NpuOpError, match="bool or uint8"):
        FA(**kw, atten_mask=mask.to(torch.int8), sparse_mode=0)
