"""The emulator computes the ops' math (checked on small hand-made cases) and rejects what the
vendor ops reject."""

from __future__ import annotations

import inspect
import math
from typing import Any

import pytest
import torch
from attnhub_iluvatar import emulator, ops
from attnhub_iluvatar.emulator import IxformerOpError, NotEmulatedError

from attnhub import emulation

FA = emulator.contrib.vllm_flash_attn
FN = emulator.inference.functions
BS = 16
D = 32


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _cache(keys: torch.Tensor, values: torch.Tensor, num_blocks: int = 3) -> tuple[Any, Any]:
    """HND caches holding ``keys``/``values`` ([S, Hkv, D], S <= 16) at block 1, offsets 0.."""
    s, hkv, d = keys.shape
    kc = torch.zeros(num_blocks, hkv, BS, d, dtype=torch.float16)
    vc = torch.zeros_like(kc)
    kc[1, :, :s] = keys.transpose(0, 1).to(torch.float16)
    vc[1, :, :s] = values.transpose(0, 1).to(torch.float16)
    return kc, vc


def _one_hot_values(n: int) -> torch.Tensor:  # [n, 1, D]: value j is e_j, so out = probabilities
    v = torch.zeros(n, 1, D)
    v[torch.arange(n), 0, torch.arange(n)] = 1.0
    return v


def _scores_case(scores: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One query and len(scores) keys whose q.k equal ``scores`` (scale 1): q = e_0,
    k_j = scores[j] * e_0; values one-hot so the output row is the probabilities."""
    n = len(scores)
    q = torch.zeros(1, 1, D)
    q[0, 0, 0] = 1.0
    k = torch.zeros(n, 1, D)
    k[:, 0, 0] = torch.tensor(scores)
    return q.to(torch.float16), k, _one_hot_values(n)


def _varlen(q: torch.Tensor, kc: Any, vc: Any, q_lens: list[int], k_lens: list[int], **kw: Any):
    cq = [0]
    for n in q_lens:
        cq.append(cq[-1] + n)
    ck = [0]
    for n in k_lens:
        ck.append(ck[-1] + n)
    kw.setdefault("block_table", _i32([[1]] * len(q_lens)))
    kw.setdefault("softmax_scale", 1.0)
    return FA.flash_attn_varlen_func(q, kc, vc, _i32(cq), _i32(ck), max(q_lens), max(k_lens), **kw)


# --- math ----------------------------------------------------------------------------------------


def test_softmax_over_the_paged_keys_and_the_lse_in_natural_log() -> None:
    q, k, v = _scores_case([1.0, 2.0, 0.0])
    kc, vc = _cache(k, v)
    out, lse = _varlen(q, kc, vc, [1], [3], return_softmax_lse=True)
    e = [math.exp(1.0), math.exp(2.0), 1.0]
    probs = torch.tensor([x / sum(e) for x in e])
    assert torch.allclose(out[0, 0, :3].float(), probs, atol=1e-3)
    assert lse.shape == (1, 1) and lse.dtype == torch.float32
    assert lse.item() == pytest.approx(math.log(sum(e)), abs=1e-5)


def test_gqa_query_head_h_reads_kv_head_h_over_the_group() -> None:
    keys = torch.zeros(2, 2, D)
    values = torch.zeros(2, 2, D)
    values[:, 0, 0] = 1.0  # kv head 0 holds 1 in channel 0, kv head 1 holds 2 in channel 1
    values[:, 1, 1] = 2.0
    kc, vc = _cache(keys, values)
    q = torch.zeros(1, 4, D, dtype=torch.float16)
    out = _varlen(q, kc, vc, [1], [2])
    assert out[0, :2, 0].tolist() == [1.0, 1.0] and out[0, 2:, 1].tolist() == [2.0, 2.0]


def test_causal_is_bottom_right_aligned() -> None:
    # 2 queries over 3 keys: query 0 sits at position 1 and sees keys 0..1
    q = torch.zeros(2, 1, D, dtype=torch.float16)
    kc, vc = _cache(torch.zeros(3, 1, D), _one_hot_values(3))
    out = _varlen(q, kc, vc, [2], [3], causal=True)
    assert out[0, 0, :3].tolist() == [0.5, 0.5, 0.0]
    assert out[1, 0, :3].float().tolist() == pytest.approx([1 / 3] * 3, abs=1e-3)


def test_window_left_w_minus_1_keeps_w_keys() -> None:
    q = torch.zeros(1, 1, D, dtype=torch.float16)
    kc, vc = _cache(torch.zeros(5, 1, D), _one_hot_values(5))
    out = _varlen(q, kc, vc, [1], [5], causal=True, window_size=(1, 0))
    assert out[0, 0, :5].tolist() == [0.0, 0.0, 0.0, 0.5, 0.5]


def test_softcap_applies_cap_tanh_after_scaling() -> None:
    q, k, v = _scores_case([4.0, 0.0])
    kc, vc = _cache(k, v)
    out = _varlen(q, kc, vc, [1], [2], softmax_scale=0.5, softcap=1.5)
    s0 = 1.5 * math.tanh(2.0 / 1.5)
    p0 = math.exp(s0) / (math.exp(s0) + 1.0)
    assert out[0, 0, 0].item() == pytest.approx(p0, abs=1e-3)


def test_alibi_subtracts_slope_times_distance() -> None:
    q = torch.zeros(1, 1, D, dtype=torch.float16)
    kc, vc = _cache(torch.zeros(3, 1, D), _one_hot_values(3))
    out = _varlen(q, kc, vc, [1], [3], causal=True, alibi_slopes=torch.tensor([math.log(2.0)]))
    # biases -2 ln2, -ln2, 0: weights 1/4, 1/2, 1
    assert out[0, 0, :3].float().tolist() == pytest.approx([1 / 7, 2 / 7, 4 / 7], abs=1e-3)


def test_a_row_that_sees_no_key_gives_zero_and_lse_plus_inf() -> None:
    q = torch.ones(2, 1, D, dtype=torch.float16)
    kc, vc = _cache(torch.ones(1, 1, D), torch.ones(1, 1, D))
    # the second sequence has no keys at all
    out, lse = _varlen(q, kc, vc, [1, 1], [1, 0], return_softmax_lse=True)
    assert (out[1] == 0).all() and math.isinf(lse[0, 1].item()) and lse[0, 1] > 0
    assert out[0, 0, 0].item() == 1.0


def test_decode_with_one_token_per_sequence_takes_batch_by_one_queries() -> None:
    q, k, v = _scores_case([1.0, 2.0, 0.0])
    kc, vc = _cache(k, v)
    q4 = q.view(1, 1, 1, D)
    out = FA.flash_attn_with_kvcache(
        q4, kc, vc, cache_seqlens=_i32([3]), block_table=_i32([[1]]), softmax_scale=1.0
    )
    want = _varlen(q, kc, vc, [1], [3])
    assert out.shape == (1, 1, 1, D) and torch.equal(out.view(1, 1, D), want)


def test_multi_token_decode_reads_cumulative_query_lens() -> None:
    q = torch.zeros(3, 1, 1, D, dtype=torch.float16)  # (T, 1, H, D), as the fork passes it
    kc, vc = _cache(torch.zeros(4, 1, D), _one_hot_values(4))
    out = FA.flash_attn_with_kvcache(
        q,
        kc,
        vc,
        cache_seqlens=_i32([2, 4]),
        block_table=_i32([[1], [1]]),
        causal=True,
        max_query_len=2,
        cu_query_lens=_i32([0, 1, 3]),
    )
    assert out.shape == (3, 1, 1, D)
    out = out[:, 0]
    assert out[0, 0, :4].tolist() == [0.5, 0.5, 0.0, 0.0]  # 1 query over 2 keys
    assert out[1, 0, :4].float().tolist() == pytest.approx([1 / 3] * 3 + [0.0], abs=1e-3)
    assert out[2, 0, :4].tolist() == [0.25] * 4


def test_decode_takes_q_four_dimensional_only() -> None:
    """flash-attn documents q as (batch, seqlen, heads, dim); the fork always passes 4-D."""
    q, k, v = _scores_case([1.0])
    kc, vc = _cache(k, v)
    with pytest.raises(IxformerOpError, match="q must be 4-D"):
        FA.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=_i32([1]), block_table=_i32([[1]]),
            cu_query_lens=_i32([0, 1]), max_query_len=1,
        )  # fmt: skip


def test_out_is_written_in_place_and_returned() -> None:
    q, k, v = _scores_case([1.0, 0.0])
    kc, vc = _cache(k, v)
    buf = torch.full((1, 1, D), 7.0, dtype=torch.float16)
    got = _varlen(q, kc, vc, [1], [2], out=buf)
    assert got is buf and buf[0, 0, 0].item() == pytest.approx(math.e / (math.e + 1), abs=1e-3)


def test_merge_weighs_by_exp_of_the_lse() -> None:
    a = torch.full((1, 1, D), 1.0, dtype=torch.float16)
    b = torch.full((1, 1, D), 4.0, dtype=torch.float16)
    # natural log: lse 0 and ln 3 weigh 1 and 3, so the merge is (1*1 + 3*4) / 4 = 3.25
    out = torch.empty_like(a)
    FA.merge_attn_states(a, torch.tensor([[0.0]]), b, torch.tensor([[math.log(3.0)]]), out)
    assert out[0, 0, 0].item() == 3.25


def test_merge_treats_plus_inf_as_empty_and_both_empty_as_zero() -> None:
    a = torch.full((2, 1, D), 1.0, dtype=torch.float16)
    b = torch.full((2, 1, D), 4.0, dtype=torch.float16)
    inf = math.inf
    out = torch.empty_like(a)
    got = FA.merge_attn_states(a, torch.tensor([[inf, inf]]), b, torch.tensor([[0.5, inf]]), out)
    assert got is out
    assert out[0, 0, 0].item() == 4.0 and (out[1] == 0).all()


def test_reshape_and_cache_flash_writes_hnd_and_skips_negative_slots() -> None:
    kc = torch.zeros(3, 2, BS, D, dtype=torch.float16)
    vc = torch.zeros_like(kc)
    key = torch.randn(3, 2, D).to(torch.float16)
    value = torch.randn(3, 2, D).to(torch.float16)
    FN.reshape_and_cache_flash(key, value, kc, vc, torch.tensor([17, -1, 5]), "auto", 1.0, 1.0)
    assert torch.equal(kc[1, :, 1], key[0]) and torch.equal(vc[0, :, 5], value[2])
    assert int((kc != 0).any(dim=-1).sum()) == 4  # 2 tokens x 2 heads, nothing else


# --- refusals ------------------------------------------------------------------------------------


def _valid() -> dict[str, Any]:
    q, k, v = _scores_case([1.0, 2.0])
    kc, vc = _cache(k, v)
    return dict(
        q=q,
        k=kc,
        v=vc,
        cu_seqlens_q=_i32([0, 1]),
        cu_seqlens_k=_i32([0, 2]),
        max_seqlen_q=1,
        max_seqlen_k=2,
        block_table=_i32([[1]]),
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(block_table=torch.tensor([[1]])), "block_table must be int32"),
        (dict(cu_seqlens_k=torch.tensor([0, 2])), "cu_seqlens_k must be int32"),
        (dict(cu_seqlens_k=_i32([0, 2, 1])), "expected batch"),
        (dict(cu_seqlens_q=_i32([1, 1])), "cumulative from 0"),
        (dict(max_seqlen_q=0), "below the longest"),
        (dict(q=torch.zeros(1, 1, D)), "float16 or bfloat16"),
        (dict(q=torch.zeros(1, 1, 36, dtype=torch.float16)), "head_size 36"),
        (dict(q=torch.zeros(1, 1, 264, dtype=torch.float16)), "head_size 264"),
        (dict(block_table=_i32([[1, 0, 2, 0]])[:, ::2]), "contiguous last dimension"),
        (dict(q=torch.zeros(0, 1, D, dtype=torch.float16)), "q has only 0 tokens"),
        (dict(sinks=torch.zeros(2)), "sinks must be a float [num_heads=1]"),
        (dict(block_table=_i32([[9]])), "block id 9 is outside"),
        (dict(window_size=(-2, 0)), "window_size"),
        (dict(alibi_slopes=torch.ones(2)), "alibi_slopes must be float32 [num_heads=1]"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_varlen_rejects_what_the_vendor_op_rejects(change: dict[str, Any], message: str) -> None:
    args = {**_valid(), **change}
    with pytest.raises(IxformerOpError, match=message.replace("[", r"\[").replace("]", r"\]")):
        FA.flash_attn_varlen_func(**args)


def test_a_cache_whose_block_size_is_not_a_multiple_of_16_is_rejected() -> None:
    args = _valid()
    args["k"] = torch.zeros(3, 1, 24, D, dtype=torch.float16)
    args["v"] = torch.zeros(3, 1, 24, D, dtype=torch.float16)
    with pytest.raises(IxformerOpError, match="not a multiple of 16"):
        FA.flash_attn_varlen_func(**args)


def test_an_nhd_cache_is_rejected_by_the_write() -> None:
    nhd = torch.zeros(3, BS, 2, D, dtype=torch.float16)  # (blocks, block_size, heads, D)
    key = torch.zeros(1, 2, D, dtype=torch.float16)
    with pytest.raises(IxformerOpError, match="HND"):
        FN.reshape_and_cache_flash(key, key, nhd, nhd.clone(), torch.tensor([0]), "auto", 1.0, 1.0)


def test_non_contiguous_caches_are_rejected() -> None:
    args = _valid()
    wide = torch.zeros(3, 1, BS, 2 * D, dtype=torch.float16)
    args["k"], args["v"] = wide[..., :D], wide[..., D:]
    with pytest.raises(IxformerOpError, match="contiguous"):
        FA.flash_attn_varlen_func(**args)


def test_float_slots_are_rejected() -> None:
    kc = torch.zeros(3, 1, BS, D, dtype=torch.float16)
    key = torch.zeros(1, 1, D, dtype=torch.float16)
    with pytest.raises(IxformerOpError, match="int32 or int64"):
        FN.reshape_and_cache_flash(key, key, kc, kc.clone(), torch.tensor([0.0]), "auto", 1.0, 1.0)


def test_multi_token_decode_needs_max_query_len() -> None:
    q, k, v = _scores_case([1.0])
    kc, vc = _cache(k, v)
    with pytest.raises(IxformerOpError, match="max_query_len"):
        FA.flash_attn_with_kvcache(
            q.unsqueeze(1),
            kc,
            vc,
            cache_seqlens=_i32([1]),
            block_table=_i32([[1]]),
            cu_query_lens=_i32([0, 1]),
        )


@pytest.mark.parametrize(
    "change", [dict(sqrt_alibi=True), dict(dropout_p=0.1), dict(return_attn_probs=True)]
)
def test_valid_vendor_options_outside_the_emulation_say_so(change: dict[str, Any]) -> None:
    with pytest.raises(NotEmulatedError, match="not emulated"):
        FA.flash_attn_varlen_func(**_valid(), **change)


def test_unknown_keywords_fail_as_the_vendor_binding_does() -> None:
    with pytest.raises(TypeError, match="flash_attn_varlen_func"):
        FA.flash_attn_varlen_func(**_valid(), seqused_k=_i32([2]))


def test_calls_are_recorded_under_their_module_path() -> None:
    with emulator.record_calls() as calls:
        FA.flash_attn_varlen_func(**_valid())
    assert [c.name for c in calls] == ["contrib.vllm_flash_attn.flash_attn_varlen_func"]


def test_the_namespace_has_the_attribute_paths_of_ixformer() -> None:
    ns = ops.namespace("cpu", emulate=True)
    assert ns is emulator
    modules = {
        "contrib.vllm_flash_attn": emulator.contrib.vllm_flash_attn,
        "inference.functions": emulator.inference.functions,
    }
    for mod, fns in modules.items():
        obj: Any = ns
        for part in mod.split("."):
            obj = getattr(obj, part)
        assert obj is fns
        assert vars(fns) and all(callable(getattr(obj, name)) for name in vars(fns))
    assert set(ops.MODULES) == {f"ixformer.{mod}" for mod in modules}


def test_the_emulator_never_uses_attnhubs_reference() -> None:
    # The attnhub names it may use: the kit's emulation (the null-kernel switch: no math), its
    # graph-capture hooks (an op as one tape entry: no math) and the kit's LSE merge
    # (merge_attn_states' math, shared with backends; not the reference's).
    source = inspect.getsource(emulator)
    for line in (
        "from attnhub.kit import emulation, kernel_call, recording_tape\n",
        "from attnhub.kit import merge_attn_states as kit_merge_attn_states\n",
    ):
        source = source.replace(line, "", 1)
    assert "import attnhub" not in source and "from attnhub" not in source
    assert emulator.__attnhub_device_code__ is True


# --- int8 ops ------------------------------------------------------------------------------------


def test_per_token_head_quantization_is_amax_over_127_rounded_half_to_even() -> None:
    x = torch.zeros(2, 1, D, dtype=torch.float16)
    x[0, 0, :3] = torch.tensor([127.0, -63.5, 0.5])
    x[1, 0, 0] = -2.54
    q, scale = FN.scaled_int8_quant_for_attn(x, 2, transpose_scale=False)
    assert scale.shape == (2, 1) and scale[0, 0].item() == 1.0
    assert q[0, 0, :3].tolist() == [127, -64, 0]
    assert q[1, 0, 0].item() == -127
    _, transposed = FN.scaled_int8_quant_for_attn(x, 2, transpose_scale=True)
    assert transposed.shape == (1, 2) and torch.equal(transposed.t(), scale)
    assert torch.equal(
        FN.scaled_int8_quant_for_attn(torch.zeros_like(x), 2)[0], torch.zeros_like(q)
    )


def test_static_per_channel_quantization_uses_the_given_scale() -> None:
    x = torch.full((1, 1, D), 3.0, dtype=torch.float16)
    scale = torch.full((1, D), 0.5)
    q, s = FN.scaled_int8_quant_for_attn(x, 0, scale=scale)
    assert s is scale and (q == 6).all()
    with pytest.raises(IxformerOpError, match="float32"):
        FN.scaled_int8_quant_for_attn(x, 0, scale=scale.double())


def test_per_channel_quantization_without_a_scale_reduces_over_the_tokens() -> None:
    """The fork's calibration call, ``scaled_int8_quant_for_attn(value, 0,
    transpose_scale=False)``: a scale per (head, channel), amax / 127 over the tokens."""
    x = torch.zeros(3, 2, D, dtype=torch.float16)
    x[0, 0, 0], x[2, 0, 0], x[1, 1, 5] = 2.54, -12.7, 1.27
    q, s = FN.scaled_int8_quant_for_attn(x, 0, transpose_scale=False)
    assert s.shape == (2, D) and s.dtype == torch.float32
    assert s[0, 0].item() == pytest.approx(0.1, rel=1e-3)
    assert s[1, 5].item() == pytest.approx(0.01, rel=1e-3)
    assert s[0, 1].item() == 0.0 and (q[:, 0, 1] == 0).all()
    assert q[:, 0, 0].tolist() == [25, 0, -127] and q[1, 1, 5].item() == 127


def _int8_cache(num_blocks: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kc = torch.zeros(num_blocks, 1, BS, D, dtype=torch.int8)
    return kc, torch.zeros_like(kc), torch.zeros(num_blocks, 1, BS)


def _paged(
    out: torch.Tensor,
    q: torch.Tensor,
    kc: torch.Tensor,
    q_scale: torch.Tensor,
    ks: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    max_len: int,
) -> dict[str, Any]:
    """A paged int8 kernel's keywords (one kv head, scale 1), one query row per sequence."""
    return dict(
        output=out, query=q, key_cache=kc, query_scale=q_scale, key_scale_cache=ks,
        num_kv_heads=1, scale=1.0, block_tables=tables, context_lens=lens, block_size=BS,
        max_context_len=max_len, cu_query_lens=_i32(list(range(len(lens) + 1))),
        max_query_len=1,
    )  # fmt: skip


def test_paged_int8_attention_dequantizes_q_k_and_v_with_their_scales() -> None:
    kc, vc, ks = _int8_cache()
    # keys at block 2, offsets 0 and 1: q.k = (2 * 0.5) * (10 * 0.1) = 1 and 0
    kc[2, 0, 0, 0] = 10
    ks[2, 0, 0] = 0.1
    vc[2, 0, 0, 0], vc[2, 0, 1, 0] = 4, 8
    v_scale = torch.full((1, D), 0.25)  # values 1 and 2
    out = torch.zeros(1, 1, D, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, D, dtype=torch.int8)
    q[0, 0, 0] = 2
    FN.vllm_paged_attention_int8(
        **_paged(out, q, kc, torch.tensor([[0.5]]), ks, _i32([[2]]), _i32([2]), 2),
        value_cache=vc, value_scale_cache=v_scale,
    )  # fmt: skip
    p = math.e / (math.e + 1)
    assert out[0, 0, 0].item() == pytest.approx(p * 1 + (1 - p) * 2, abs=1e-2)


def test_paged_kernels_save_the_new_token_at_position_context_len_minus_1() -> None:
    kc, _, ks = _int8_cache()
    vc16 = torch.zeros(3, 1, BS, D, dtype=torch.float16)
    out = torch.zeros(1, 1, D, dtype=torch.float16)
    q = torch.zeros(1, 1, D, dtype=torch.int8)
    save_key = torch.full((1, 1, D), 7, dtype=torch.int8)
    save_value = torch.full((1, 1, D), 1.5, dtype=torch.float16)
    FN.vllm_paged_attention_mix(
        **_paged(out, q, kc, torch.ones(1, 1), ks, _i32([[2, 1]]), _i32([18]), 18),
        value_cache=vc16, save_key=save_key, save_value=save_value,
        save_key_scale=torch.tensor([[0.25]]),
    )  # fmt: skip
    # position 17 is block 1 (the table's second entry), offset 1
    assert (kc[1, 0, 1] == 7).all() and (vc16[1, 0, 1] == 1.5).all() and ks[1, 0, 1] == 0.25
    assert int((kc != 0).sum()) == D


def test_the_int8_write_stores_the_key_scale_per_slot() -> None:
    kc, vc, ks = _int8_cache()
    key = torch.full((2, 1, D), 3, dtype=torch.int8)
    FN.reshape_and_cache_flash_int8(
        key=key, value=key.clone(), k_scale=torch.tensor([[0.5], [0.25]]), key_cache=kc,
        value_cache=vc, key_scale_cache=ks, slot_mapping=torch.tensor([-1, 33]), kv_cache_dtype="",
    )  # fmt: skip
    assert ks[2, 0, 1] == 0.25 and int((ks != 0).sum()) == 1
    assert (kc[2, 0, 1] == 3).all() and (vc[2, 0, 1] == 3).all()


def test_mode_1_ops_reject_a_16_bit_value_cache_and_mode_2_an_int8_one() -> None:
    kc, vc, ks = _int8_cache()
    key = torch.zeros(1, 1, D, dtype=torch.int8)
    common = dict(key=key, value=key, k_scale=torch.ones(1, 1), key_cache=kc, key_scale_cache=ks)
    with pytest.raises(IxformerOpError, match="value_cache must be int8"):
        FN.reshape_and_cache_flash_int8(
            **common, value_cache=vc.half(), slot_mapping=torch.tensor([0]), kv_cache_dtype=""
        )
    with pytest.raises(IxformerOpError, match="float16 or bfloat16"):
        FN.reshape_and_cache_flash_mix(
            **common, value_cache=vc, slot_mapping=torch.tensor([0]), kv_cache_dtype=""
        )


def test_the_int8_prefill_wants_its_query_scales_transposed() -> None:
    kc, vc, ks = _int8_cache()
    q = torch.zeros(3, 2, D, dtype=torch.int8)
    with pytest.raises(IxformerOpError, match=r"q_scale must be float32 \(2, 3\)"):
        FA.flash_attn_varlen_int8_func(
            q=q, k=kc, v=vc, q_scale=torch.ones(3, 2), k_scale=ks, v_scale=torch.ones(1, D),
            cu_seqlens_q=_i32([0, 3]), cu_seqlens_k=_i32([0, 3]), max_seqlen_q=3, max_seqlen_k=3,
            block_table=_i32([[1]]),
        )  # fmt: skip


# --- null-kernel mode (attnhub.emulation: host-overhead benchmarks) -------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(block_table=torch.tensor([[1]])), "block_table must be int32"),
        (dict(cu_seqlens_q=_i32([1, 1])), "cumulative from 0"),
        (dict(block_table=_i32([[9]])), "block id 9 is outside"),
        (
            dict(
                cu_seqlens_q=_i32([0, 3]),
                q=torch.zeros(3, 1, D).half(),
                max_seqlen_q=3,
                causal=True,
            ),
            "causal",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_null_kernels_keep_every_check(change: dict[str, Any], message: str) -> None:
    args = {**_valid(), **change}
    with emulation.null_kernels(), pytest.raises(IxformerOpError, match=message):
        FA.flash_attn_varlen_func(**args)


def test_null_kernels_keep_the_checks_of_writes_and_paged_decode() -> None:
    key = torch.ones(1, 1, D, dtype=torch.float16)
    kc = torch.zeros(2, 1, BS, D, dtype=torch.float16)
    with emulation.null_kernels(), pytest.raises(IxformerOpError, match="outside the cache"):
        FN.reshape_and_cache_flash(key, key, kc, kc.clone(), torch.tensor([2 * BS]), "auto", 1, 1)
    kc8, vc8, ks = _int8_cache()
    out = torch.zeros(1, 1, D, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, D, dtype=torch.int8)
    with emulation.null_kernels(), pytest.raises(IxformerOpError, match="block id 7 is outside"):
        FN.vllm_paged_attention_int8(
            **_paged(out, q, kc8, torch.ones(1, 1), ks, _i32([[7]]), _i32([2]), 2),
            value_cache=vc8, value_scale_cache=torch.ones(1, D),
        )  # fmt: skip


def test_null_kernels_skip_the_math_and_return_outputs_of_the_right_shapes() -> None:
    args = _valid()
    kc, vc = args["k"], args["v"]
    before = kc.clone()
    key = torch.ones(2, 1, D, dtype=torch.float16)
    kc8, vc8, ks = _int8_cache()
    decoded = torch.zeros(1, 1, D, dtype=torch.bfloat16)
    q8 = torch.zeros(1, 1, D, dtype=torch.int8)
    x = torch.randn(3, 2, D).half()
    with emulation.null_kernels() as ops:
        out, lse = FA.flash_attn_varlen_func(**args, return_softmax_lse=True)
        FN.reshape_and_cache_flash(key, key, kc, vc, torch.tensor([0, 1]), "auto", 1.0, 1.0)
        merged = FA.merge_attn_states(x, torch.zeros(2, 3), x, torch.zeros(2, 3))
        qx, scale = FN.scaled_int8_quant_for_attn(x, 2, transpose_scale=True)
        FN.vllm_paged_attention_int8(
            **_paged(decoded, q8, kc8, torch.ones(1, 1), ks, _i32([[2]]), _i32([2]), 2),
            value_cache=vc8, value_scale_cache=torch.ones(1, D),
            save_key=torch.ones(1, 1, D, dtype=torch.int8),
            save_value=torch.ones(1, 1, D, dtype=torch.int8), save_key_scale=torch.ones(1, 1),
        )  # fmt: skip
    assert out.shape == (1, 1, D) and out.dtype == torch.float16
    assert lse.shape == (1, 1) and lse.dtype == torch.float32
    assert merged.shape == x.shape and merged.dtype == x.dtype
    assert qx.shape == x.shape and qx.dtype == torch.int8 and scale.shape == (2, 3)
    assert torch.equal(kc, before) and not kc8.any() and not ks.any()  # nothing was written
    assert not decoded.any()  # the paged kernel wrote nothing
    assert ops.calls == 5 and ops.seconds > 0
    out = FA.flash_attn_varlen_func(**args)  # outside: the math again
    assert torch.isfinite(out).all() and out.abs().sum() > 0
