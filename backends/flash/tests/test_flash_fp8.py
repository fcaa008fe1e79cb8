"""FA3's fp8 path in the emulator: what the kernels accept, and the math they do.

The math is checked against an independent float64 computation of FA3's algorithm
(hopper/softmax.h): scores scaled by ``softmax_scale * q_descale * k_descale``, probabilities
``2**8 * exp(s - m)`` rounded to e4m3 against the *running* maximum of the key tiles walked
last-first, an unrounded row sum, the output times ``v_descale``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from attnhub_flash import emulator
from attnhub_flash.emulator import FlashOpError, NotEmulatedError

from attnhub.quant import probability_error_bound, round_probabilities

FP8 = torch.float8_e4m3fn
H, HK, D = 4, 2, 64


def _inputs(kv_len: int, q_len: int = 1, *, page: int = 16, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    blocks = -(-kv_len // page)
    k = (torch.randn(blocks + 1, page, HK, D, generator=g) * 8).to(FP8)
    v = (torch.randn(blocks + 1, page, HK, D, generator=g) * 8).to(FP8)
    q = (torch.randn(q_len, H, D, generator=g) * 4).to(FP8)
    table = torch.arange(blocks, 0, -1, dtype=torch.int32)[None]  # reversed: block 0 unused
    descale = torch.tensor([[0.02, 0.05]], dtype=torch.float32)  # (batch 1, Hk)
    return dict(q=q, k=k, v=v, table=table, descale=descale, kv_len=kv_len)


def _fa3(x: dict[str, Any], **kw: Any) -> Any:
    d = x["descale"]
    q_len = x["q"].shape[0]
    args: dict[str, Any] = dict(
        cache_seqlens=torch.tensor([x["kv_len"]], dtype=torch.int32),
        page_table=x["table"],
        cu_seqlens_q=torch.tensor([0, q_len], dtype=torch.int32),
        max_seqlen_q=q_len,
        q_descale=d,
        k_descale=d * 2,
        v_descale=d * 3,
        causal=True,
        return_softmax_lse=True,
    )
    args.update(kw)
    return emulator.FA3.flash_attn_with_kvcache(x["q"], x["k"], x["v"], **args)


def _keys(x: dict[str, Any], plane: str) -> torch.Tensor:  # [kv_len, Hk, D] float64
    ids = x["table"][0].long()
    return x[plane][ids].reshape(-1, HK, D)[: x["kv_len"]].double()


def _fa3_in_float64(x: dict[str, Any], block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FA3's fp8 algorithm written out per row, in float64 (except the e4m3 rounding)."""
    d = x["descale"][0].double()
    qd, kd = d.repeat_interleave(H // HK), (d * 2).repeat_interleave(H // HK)
    vd = (d * 3).repeat_interleave(H // HK)
    k = _keys(x, "k").repeat_interleave(H // HK, dim=1)
    v = _keys(x, "v").repeat_interleave(H // HK, dim=1)
    q = x["q"].double()
    q_len, kv_len = q.shape[0], k.shape[0]
    out = torch.zeros(q_len, H, D, dtype=torch.float64)
    lse = torch.zeros(H, q_len, dtype=torch.float64)
    for h in range(H):
        for i in range(q_len):
            visible = kv_len - q_len + i + 1  # causal, bottom-right
            s = (k[:visible, h] @ q[i, h]) * D**-0.5 * qd[h] * kd[h]
            tiles = list(range(0, visible, block_n))[::-1]  # last tile first
            m, acc, total = -math.inf, torch.zeros(D, dtype=torch.float64), 0.0
            for start in tiles:
                t = s[start : start + block_n]
                new_m = max(m, float(t.max()))
                acc *= math.exp(m - new_m) if m > -math.inf else 0.0
                total *= math.exp(m - new_m) if m > -math.inf else 0.0
                p = 256.0 * torch.exp(t - new_m)
                total += float(p.sum())
                acc += p.float().to(FP8).double() @ v[start : start + len(t), h]
                m = new_m
            out[i, h] = acc / total * vd[h]
            lse[h, i] = m + math.log(total / 256.0)
    return out, lse


@pytest.mark.parametrize("kv_len", [5, 160, 700])  # one tile, exactly one, five tiles
def test_fp8_forward_is_fa3s_tiled_algorithm(kv_len: int) -> None:
    x = _inputs(kv_len, q_len=3)
    out, lse, *_ = _fa3(x)
    assert out.dtype == torch.bfloat16  # fp8 in, bf16 out [source]
    want, want_lse = _fa3_in_float64(x, block_n=160)  # head 64: kBlockN 160 (tile_size.h)
    # bf16 output rounding only: a different tile size (128) or the row maximum moves
    # results with several tiles by 2e-3..5e-3 here
    torch.testing.assert_close(out.double(), want, atol=1e-3, rtol=2**-8)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-5)


def test_rounding_against_a_running_maximum_stays_within_the_declared_bound() -> None:
    """Many tiles with the largest score early (so later-walked tiles round against a smaller
    running maximum): the kernel's result differs from the row-maximum model, by no more than
    ``probability_error_bound`` allows."""
    x = _inputs(1200, seed=3)
    out, _, *_ = _fa3(x, causal=False)
    d = x["descale"][0].double()
    group = H // HK
    k = _keys(x, "k").repeat_interleave(group, dim=1)
    v = _keys(x, "v").repeat_interleave(group, dim=1) * (d * 3).repeat_interleave(group)[:, None]
    q = x["q"].double()[0]
    s = torch.einsum("hd,jhd->hj", q, k) * D**-0.5 * (d * d * 2).repeat_interleave(group)[:, None]
    p = torch.softmax(s, dim=-1)
    exact = torch.einsum("hj,jhd->hd", p, v)
    model = torch.einsum("hj,jhd->hd", round_probabilities(p, "fp8_e4m3"), v)
    bound = torch.einsum("hj,jhd->hd", probability_error_bound(p, "fp8_e4m3"), v.abs())
    got = out[0].double()
    assert float((got - model).abs().max()) > 2e-3  # the tiles do round otherwise
    assert bool(((got - exact).abs() <= bound + 2e-2 * exact.abs() + 1e-3).all())


def test_descales_are_read_only_for_fp8_inputs() -> None:
    x = _inputs(40)
    bf = {n: x[n].to(torch.bfloat16) for n in ("q", "k", "v")}
    plain, _, *_ = _fa3({**x, **bf}, q_descale=None, k_descale=None, v_descale=None)
    ignored, _, *_ = _fa3({**x, **bf})  # descales given, bf16 inputs: ignored [source]
    assert torch.equal(plain, ignored)


def test_missing_descales_are_one() -> None:
    x = _inputs(40)
    ones = torch.ones(1, HK, dtype=torch.float32)
    a, _, *_ = _fa3(x, q_descale=None, k_descale=None, v_descale=None)
    b, _, *_ = _fa3(x, q_descale=ones, k_descale=ones, v_descale=ones)
    assert torch.equal(a, b)


def test_expanded_descales_are_accepted() -> None:
    x = _inputs(40)
    scale = torch.tensor(0.05, dtype=torch.float32)
    wide = scale.reshape(1, 1).expand(1, HK)  # stride 0, as vLLM passes layer._k_scale
    a, _, *_ = _fa3(x, q_descale=wide, k_descale=wide, v_descale=wide)
    full = torch.full((1, HK), 0.05, dtype=torch.float32)
    b, _, *_ = _fa3(x, q_descale=full, k_descale=full, v_descale=full)
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(q_descale=torch.ones(1, HK + 1)), r"q_descale must have shape \(1, 2\)"),
        (dict(k_descale=torch.ones(2, HK)), r"k_descale must have shape \(1, 2\)"),
        (dict(v_descale=torch.ones(1, HK, dtype=torch.float64)), "v_descale must have dtype"),
        (dict(out=torch.empty(3, H, D, dtype=torch.float16)), "out must be torch.bfloat16"),
    ],
)
def test_fp8_call_refusals(change: dict[str, Any], match: str) -> None:
    x = _inputs(40, q_len=3)
    if "out" in change:  # FA3's with_kvcache takes no out=: check through vLLM's fork
        _vllm_fp8(x, **change)
        return
    with pytest.raises(FlashOpError, match=match):
        _fa3(x, **change)


def _vllm_fp8(x: dict[str, Any], *, match: str = "out must be torch.bfloat16", **kw: Any) -> None:
    q_len = x["q"].shape[0]
    with pytest.raises(FlashOpError, match=match):
        emulator.VLLM.flash_attn_varlen_func(
            q=x["q"],
            k=x["k"],
            v=x["v"],
            cu_seqlens_q=torch.tensor([0, q_len], dtype=torch.int32),
            max_seqlen_q=q_len,
            seqused_k=torch.tensor([x["kv_len"]], dtype=torch.int32),
            max_seqlen_k=x["kv_len"],
            block_table=x["table"],
            causal=True,
            fa_version=kw.pop("fa_version", 3),
            **kw,
        )


def test_fp8_inputs_need_fa3() -> None:
    x = _inputs(40)
    _vllm_fp8(x, fa_version=2, match="supports only fp16 and bf16")


def test_fp8_head_sizes_are_multiples_of_16() -> None:
    x = _inputs(40)
    for name in ("q", "k", "v"):
        x[name] = x[name][..., :24]
    with pytest.raises(FlashOpError, match="multiple of 16"):
        _fa3(x)


def test_q_k_v_share_one_dtype() -> None:
    x = _inputs(40)
    with pytest.raises(FlashOpError, match="same dtype"):
        _fa3({**x, "q": x["q"].to(torch.bfloat16)})


def test_reshape_and_cache_flash_stores_fp8_of_x_over_the_scale_saturated() -> None:
    cache = torch.zeros(2, 16, HK, D, dtype=torch.uint8)  # vLLM allocates fp8 caches as bytes
    vcache = torch.zeros(2, 16, HK, D, dtype=FP8)
    key = torch.randn(3, HK, D, dtype=torch.bfloat16) * 10
    key[0, 0, 0] = 1e4  # saturates at 448 * scale
    value = torch.randn(3, HK, D, dtype=torch.bfloat16)
    slots = torch.tensor([17, -1, 3])
    k_scale, v_scale = torch.tensor([0.5]), torch.tensor([0.03])
    emulator.VLLM_CACHE_OPS.reshape_and_cache_flash(
        key, value, cache, vcache, slots, "fp8", k_scale, v_scale
    )
    stored = cache.view(FP8).float()
    assert stored[1, 1, 0, 0] == 448.0
    want = (key[2].float() / 0.5).to(FP8).float()
    assert torch.equal(stored[0, 3], want)
    assert torch.equal(
        vcache[1, 1].float(), (value[0].float() / 0.03).clamp(-448, 448).to(FP8).float()
    )
    assert int(cache.count_nonzero()) == int(
        cache[1, 1].count_nonzero() + cache[0, 3].count_nonzero()
    )


def test_reshape_and_cache_flash_fp8_refusals() -> None:
    key = torch.randn(1, HK, D, dtype=torch.bfloat16)
    bf_cache = torch.zeros(1, 16, HK, D, dtype=torch.bfloat16)
    one = torch.tensor([1.0])
    with pytest.raises(FlashOpError, match="must hold bytes"):
        emulator.VLLM_CACHE_OPS.reshape_and_cache_flash(
            key, key, bf_cache, bf_cache.clone(), torch.tensor([0]), "fp8", one, one
        )
    byte_cache = torch.zeros(1, 16, HK, D, dtype=torch.uint8)
    with pytest.raises(NotEmulatedError, match="fp8_e5m2"):
        emulator.VLLM_CACHE_OPS.reshape_and_cache_flash(
            key, key, byte_cache, byte_cache.clone(), torch.tensor([0]), "fp8_e5m2", one, one
        )


# --- the backend's descales ---------------------------------------------------------------------


@pytest.mark.parametrize("provider", ["vllm-fa3", "fa3"])
def test_the_backends_descales_follow_the_caches_scales_and_the_batch_size(provider: str) -> None:
    """The expanded descale views are remembered per layer, and made again when the cache's
    scale tensors or the batch size change; an in-place change of a scale reaches the kernel
    (the views read the scale tensors themselves)."""
    import dataclasses

    import flash_helpers as h

    from attnhub import BatchMetadata, testing

    st = h.step([(1, 40), (3, 35), (20, 70)], provider, h.spec(provider, kv_cache_dtype="fp8_e4m3"))
    impl = st.backend.impl()
    builder = st.backend.metadata_builder()

    def descales(cache: Any, batch: Any) -> dict[str, torch.Tensor]:
        meta = builder.build(batch)
        with emulator.record_calls() as calls:
            impl.forward(st.query[: batch.num_tokens], st.key[: batch.num_tokens],
                         st.value[: batch.num_tokens], cache, meta)  # fmt: skip
        (call,) = [c for c in calls if "descale" in " ".join(c.kwargs)]
        return {k: v for k, v in call.kwargs.items() if k.endswith("descale")}

    first = descales(st.cache, st.batch)
    assert {k: tuple(v.shape) for k, v in first.items()} == {
        "q_descale": (3, 2), "k_descale": (3, 2), "v_descale": (3, 2)
    }  # fmt: skip
    again = descales(st.cache, st.batch)
    assert all(again[k] is first[k] for k in first)  # remembered
    st.cache.key_scale.fill_(2.0)  # in place: the same views read it
    assert descales(st.cache, st.batch)["k_descale"].eq(2.0).all()
    # a new scale tensor: made again from it
    cache = dataclasses.replace(st.cache, value_scale=torch.full((1,), 0.5))
    swapped = descales(cache, st.batch)
    assert swapped["v_descale"] is not first["v_descale"] and swapped["v_descale"].eq(0.5).all()
    # another batch size: made again for it
    table = testing.shuffled_block_table([40, 35], 16, st.cache.num_blocks, testing.generator(1))
    two = BatchMetadata.from_lengths([1, 1], [40, 35], table, 16)
    assert {tuple(v.shape) for v in descales(cache, two).values()} == {(2, 2)}
