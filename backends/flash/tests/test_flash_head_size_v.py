"""A value head size other than the key's (``spec.head_size_v``: MLA's expanded prefill, keys
192 and values 128 in DeepSeek): what each provider's kernels take, as the emulator checks it
and the backend declares it, and the math over two planes of two widths.

The emulator's math is checked on inputs whose answer is plain arithmetic (a zero query gives
every visible key the same weight: the output is the mean of the visible values, whose value
at position j is j); the backend's against ``attnhub.reference``.
"""

from __future__ import annotations

import math
from typing import Any

import flash_helpers as fh
import pytest
import torch
from attnhub_flash import BACKENDS, emulator
from attnhub_flash.emulator import FlashOpError, NotEmulatedError

H, HK = 2, 1


def _planes(kv_len: int, page: int, d: int, dv: int, dtype: torch.dtype = torch.float16) -> Any:
    """A paged cache of one sequence: keys ``d`` wide (random), values ``dv`` wide holding
    their position, the blocks in reverse order; and its block table."""
    blocks = max(1, math.ceil(kv_len / page))
    k = torch.randn(blocks, page, HK, d).to(dtype)
    pos = torch.arange(blocks * page, dtype=torch.float32).view(blocks, page, 1, 1)
    v = pos.expand(blocks, page, HK, dv).to(dtype).flip(0).contiguous()
    table = torch.arange(blocks - 1, -1, -1, dtype=torch.int32).view(1, blocks)
    return k, v, table


def _fork(d: int, dv: int, *, q_len: int = 2, kv_len: int = 5, **kw: Any) -> Any:
    k, v, table = _planes(kv_len, 16, d, dv, kw.pop("dtype", torch.float16))
    args: dict[str, Any] = dict(
        q=torch.zeros(q_len, H, d, dtype=k.dtype),
        k=k,
        v=v,
        cu_seqlens_q=torch.tensor([0, q_len], dtype=torch.int32),
        max_seqlen_q=q_len,
        seqused_k=torch.tensor([kv_len], dtype=torch.int32),
        max_seqlen_k=kv_len,
        block_table=table,
        causal=True,
        return_softmax_lse=True,
        fa_version=3,
    )
    args.update(kw)
    return emulator.VLLM.flash_attn_varlen_func(**args)


def _causal_means(q_len: int, kv_len: int) -> list[float]:
    """Row i of a bottom-right causal call sees keys 0 .. i + kv_len - q_len: their mean."""
    return [(i + kv_len - q_len) / 2 for i in range(q_len)]


# --- the emulator: FA3 (vLLM's fork and upstream hopper) -------------------------------------


@pytest.mark.parametrize(("d", "dv"), [(192, 128), (64, 32), (32, 64), (64, 256), (64, 512)])
def test_fork_fa3_attends_over_values_of_their_own_width(d: int, dv: int) -> None:
    out, lse = _fork(d, dv)
    assert out.shape == (2, H, dv)
    assert out[:, 0, 0].tolist() == _causal_means(2, 5)
    assert torch.equal(out[:, :, :1].expand(-1, -1, dv), out)
    assert torch.allclose(lse[0], torch.tensor([math.log(4), math.log(5)]))


def test_fork_fa3_writes_out_at_the_value_head_size() -> None:
    out = torch.empty(2, H, 128, dtype=torch.float16)
    res, _ = _fork(192, 128, out=out)
    assert res is out and out[:, 0, 0].tolist() == _causal_means(2, 5)
    with pytest.raises(FlashOpError, match="out must be"):
        _fork(192, 128, out=torch.empty(2, H, 192, dtype=torch.float16))


def test_upstream_fa3_takes_the_pair_in_its_varlen_and_padded_calls() -> None:
    k, v, table = _planes(5, 16, 192, 128)
    fa3 = emulator.FA3.flash_attn_with_kvcache
    out, _lse, *_ = fa3(
        torch.zeros(2, H, 192, dtype=torch.float16),
        k,
        v,
        cache_seqlens=torch.tensor([5], dtype=torch.int32),
        page_table=table,
        cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32),
        max_seqlen_q=2,
        causal=True,
        return_softmax_lse=True,
    )
    assert out.shape == (2, H, 128) and out[:, 0, 0].tolist() == _causal_means(2, 5)
    padded = fa3(
        torch.zeros(1, 1, H, 192, dtype=torch.float16),
        k,
        v,
        cache_seqlens=torch.tensor([5], dtype=torch.int32),
        page_table=table,
        causal=True,
    )
    assert padded.shape == (1, 1, H, 128) and padded[0, 0, 0, 0].item() == 2.0


@pytest.mark.parametrize(("d", "dv"), [(128, 64), (128, 96), (192, 96), (256, 128), (96, 64)])
def test_fa3_refuses_pairs_outside_its_hdimdiff_kernels(d: int, dv: int) -> None:
    with pytest.raises(FlashOpError, match="If V headdim is different from Q/K dim"):
        _fork(d, dv)


@pytest.mark.parametrize("dv", [72, 128, 192])
def test_fa3_does_not_emulate_the_pairs_whose_host_tiles_are_another_kernels(dv: int) -> None:
    # keys <= 64 with values in (64, 192]: mha_fwd's check passes, run_mha_fwd runs the
    # 64 x 256 kernel, the host plans hdimv 128 / 192 tiles
    with pytest.raises(NotEmulatedError, match="host plans the tiles"):
        _fork(64, dv)


def test_fa3_value_head_size_alignment_and_fp8_limits() -> None:
    with pytest.raises(FlashOpError, match="head_size_v should be a multiple of 8"):
        _fork(64, 36)
    fp8 = dict(dtype=torch.float8_e4m3fn)
    with pytest.raises(FlashOpError, match="HeaddimV > 256 requires fp16 and bf16"):
        _fork(64, 384, **fp8)
    with pytest.raises(NotEmulatedError, match="fp8 hdim-64 kernels for hdimv 64 only"):
        _fork(64, 256, **fp8)
    with pytest.raises(FlashOpError, match="head_size_v should be a multiple of 16"):
        _fork(64, 40, **fp8)


def test_fork_fa3_refuses_s_aux_with_a_value_head_size_of_its_own() -> None:
    sinks = torch.zeros(H, dtype=torch.bfloat16)
    with pytest.raises(FlashOpError, match="S aux with hdim != hdim_v"):
        _fork(192, 128, dtype=torch.bfloat16, s_aux=sinks)


@pytest.mark.parametrize("fa_version", [2])
def test_fa2_kernels_take_one_head_size(fa_version: int) -> None:
    with pytest.raises(FlashOpError, match="must have the same shape"):
        _fork(192, 128, fa_version=fa_version)
    k, v, table = _planes(5, 256, 192, 128)
    with pytest.raises(FlashOpError, match="must have the same shape"):
        emulator.FA2.flash_attn_varlen_func(
            torch.zeros(2, H, 192, dtype=torch.float16),
            k,
            v,
            torch.tensor([0, 2], dtype=torch.int32),
            torch.tensor([0, 5], dtype=torch.int32),
            2,
            5,
            block_table=table,
        )


# --- the emulator: FA4 -----------------------------------------------------------------------


def _fa4(d: int, dv: int, page: int = 128) -> Any:
    k, v, table = _planes(5, page, d, dv)
    return emulator.FA4.flash_attn_varlen_func(
        torch.zeros(2, H, d, dtype=torch.float16),
        k,
        v,
        cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32),
        seqused_k=torch.tensor([5], dtype=torch.int32),
        page_table=table,
        causal=True,
        return_lse=True,
    )


@pytest.mark.parametrize(
    ("arch", "d", "dv"),
    [("sm_90a", 192, 256), ("sm_90a", 256, 64), ("sm_100a", 192, 128), ("sm_100a", 64, 128)],
)
def test_fa4_attends_over_the_pairs_validate_head_dims_takes(
    monkeypatch: pytest.MonkeyPatch, arch: str, d: int, dv: int
) -> None:
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", arch)
    out, _ = _fa4(d, dv)
    assert out.shape == (2, H, dv) and out[:, 0, 0].tolist() == _causal_means(2, 5)


def test_fa4_refuses_on_blackwell_what_it_takes_on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_100a")
    with pytest.raises(FlashOpError, match=r"\(head_dim, head_dim_v\)=\(192, 256\)"):
        _fa4(192, 256)
    with pytest.raises(NotEmulatedError, match="head_dim_v 512 without qv"):
        _fa4(64, 512)


def test_fa4_pages_an_irregular_value_head_size_only_at_its_key_tile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_90a")
    with pytest.raises(AssertionError, match="irregular head dim"):
        _fa4(64, 72, page=16)
    out, _ = _fa4(64, 72, page=128)  # the SM90 key tile of hdim 64
    assert out.shape == (2, H, 72)


# --- the emulator: vLLM's KV write over planes of two widths ----------------------------------


def test_reshape_and_cache_flash_writes_each_plane_at_its_width() -> None:
    # two views of one [..., head_size + head_size_v] tensor, as vLLM splits a layer's cache
    joint = torch.zeros(2, 16, HK, 192 + 128, dtype=torch.float16)
    kc, vc = joint.split([192, 128], dim=-1)
    key = torch.randn(3, HK, 192).half()
    value = torch.randn(3, HK, 128).half()
    one = torch.ones(1)
    slots = torch.tensor([17, -1, 3])
    emulator.VLLM_CACHE_OPS.reshape_and_cache_flash(key, value, kc, vc, slots, "auto", one, one)
    assert torch.equal(kc[1, 1], key[0]) and torch.equal(vc[1, 1], value[0])
    assert torch.equal(kc[0, 3], key[2]) and torch.equal(vc[0, 3], value[2])
    assert int(joint.count_nonzero()) == int(
        key[[0, 2]].count_nonzero() + value[[0, 2]].count_nonzero()
    )
    with pytest.raises(FlashOpError, match="does not fit the cache"):
        emulator.VLLM_CACHE_OPS.reshape_and_cache_flash(key, key, kc, vc, slots, "auto", one, one)


# --- the backend: declarations and refusals ---------------------------------------------------


def _refused(provider: str, **changes: Any) -> list[str]:
    spec = fh.spec(provider, **changes)
    return [r.field for r in BACKENDS[provider].unsupported_reasons(spec)]


@pytest.mark.parametrize("provider", ["vllm", "fa2"])
def test_fa2_providers_refuse_a_value_head_size_of_its_own(provider: str) -> None:
    spec = fh.spec(provider, head_size=192, head_size_v=128)
    reasons = BACKENDS[provider].unsupported_reasons(spec)
    assert [r.field for r in reasons] == ["head_size_v"]
    assert "FlashAttention-2 takes one head size for q, k and v" in reasons[0]


@pytest.mark.parametrize("provider", ["vllm-fa3", "fa3"])
def test_fa3_providers_declare_the_pairs_of_their_kernels(provider: str) -> None:
    for d, dv in [(192, 128), (160, 104), (64, 32), (32, 64), (64, 256), (64, 512)]:
        assert _refused(provider, head_size=d, head_size_v=dv) == [], (d, dv)
    for d, dv in [(128, 64), (64, 128), (64, 192), (256, 128), (192, 136)]:
        assert _refused(provider, head_size=d, head_size_v=dv) == ["head_size_v"], (d, dv)
    assert _refused(provider, head_size=64, head_size_v=36) == ["head_size_v"]
    fp8 = dict(kv_cache_dtype="fp8_e4m3")
    assert _refused(provider, head_size=192, head_size_v=128, **fp8) == []
    assert _refused(provider, head_size=64, head_size_v=256, **fp8) == ["head_size_v"]
    assert _refused(provider, head_size=64, head_size_v=40, **fp8) == ["head_size_v"]


def test_vllm_fa3_refuses_sinks_with_a_value_head_size_of_its_own() -> None:
    spec = fh.spec("vllm-fa3", head_size=192, head_size_v=128, use_sinks=True)
    reasons = BACKENDS["vllm-fa3"].unsupported_reasons(spec)
    assert [r.field for r in reasons] == ["head_size_v"]
    assert "S aux with hdim != hdim_v" in reasons[0]


def test_fa4_declares_per_architecture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_90a")
    assert _refused("fa4", head_size=192, head_size_v=256) == []
    assert _refused("fa4", head_size=192, head_size_v=128) == []
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_100a")
    assert _refused("fa4", head_size=192, head_size_v=128) == []
    assert _refused("fa4", head_size=64, head_size_v=128) == []
    assert _refused("fa4", head_size=192, head_size_v=256) == ["head_size_v"]
    assert _refused("fa4", head_size=64, head_size_v=512) == ["head_size_v"]
    # an irregular value head size pages only at the key tile (128 on SM100)
    assert _refused("fa4", head_size=64, head_size_v=72) == ["block_size"]
    assert _refused("fa4", head_size=64, head_size_v=72, block_size=128) == []


# --- the backend: a step --------------------------------------------------------------------


@pytest.mark.parametrize("provider", ["vllm-fa3", "fa3", "fa4"])
def test_a_mixed_step_matches_the_reference(provider: str) -> None:
    s = fh.spec(provider, head_size=192, head_size_v=128)
    st = fh.step([(1, 9), (3, 20), (5, 5)], provider, s, padding=2)
    out = fh.forward(st)
    assert out.shape == (st.batch.num_tokens, s.num_heads, 128)
    fh.assert_matches_reference(st, out)


def test_vllm_fa3_plans_the_schedule_for_the_value_head_size_and_scatters_the_kv() -> None:
    # the fork's reshape_and_cache_flash addresses both planes with the key plane's strides,
    # which attnhub's two planes of two widths do not share: the scatter writes them
    s = fh.spec("vllm-fa3", head_size=192, head_size_v=128)
    st = fh.step([(2, 7), (1, 4)], "vllm-fa3", s)
    with emulator.record_calls() as calls:
        fh.forward(st)
    names = [c.name for c in calls]
    assert "_custom_ops.reshape_and_cache_flash" not in " ".join(names)
    (schedule,) = [c for c in calls if c.name.endswith("get_scheduler_metadata")]
    assert schedule.kwargs["headdim"] == 192 and schedule.kwargs["headdim_v"] == 128
    n = st.batch.num_actual_tokens
    slots = st.batch.slot_mapping[:n].long()
    bs = s.block_size
    assert torch.equal(st.cache.key[slots // bs, slots % bs], st.key[:n])
    assert torch.equal(st.cache.value[slots // bs, slots % bs], st.value[:n])
