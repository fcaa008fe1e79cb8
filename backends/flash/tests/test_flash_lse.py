"""The LSE each FlashAttention function returns, op by op, against ``attnhub.reference``.

What the protocol will declare per provider (docs/backends/flash.md, "LSE"): how the LSE is asked
for, its shape, dtype, base (natural log), and the value of a row that sees no key (+inf on FA2
and vLLM's ``fa_version=2``, -inf on FA3 and FA4). Every form the backend calls is checked on
random inputs with GQA, decode and prefill rows mixed, paged (and packed where the function takes
it), and two halves of the keys merged by their LSEs equal the call over all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from attnhub_flash import emulator

from attnhub import reference, testing
from attnhub.lse import merge_attn_states

H, HK, D = 4, 2, 64
SCALE = D**-0.5
#: the page size each form is called with (FA2 paged: multiples of 256)
PAGE = {"fa2-varlen": 256, "fa2-kvcache": 256}
#: the LSE of a row that sees no key, per provider [source: FA2 flash_api.cpp / softmax.h;
#: hopper softmax.h, epilogue_fwd.hpp; FA4 interface.py and flash_fwd_sm100.py]
EMPTY = {
    "vllm": math.inf,
    "vllm-packed": math.inf,
    "vllm-fa3": -math.inf,
    "fa2-varlen": math.inf,
    "fa2-kvcache": math.inf,
    "fa3-kvcache": -math.inf,
    "fa3-varlen-q": -math.inf,
    "fa4": -math.inf,
}
FORMS = tuple(EMPTY)
#: forms whose q is a padded batch (B, Sq, H, D): every request has the same query length
PADDED = ("fa2-kvcache", "fa3-kvcache")


class Case:
    """Random K/V sequences per request, in a paged NHD cache (pages in a shuffled order) and
    packed, and a random query of the requests' last ``q_len`` positions."""

    def __init__(self, q_lens: list[int], kv_lens: list[int], page: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.q_lens, self.kv_lens, self.page = q_lens, kv_lens, page
        dt = torch.float16
        self.seqs = [
            (torch.randn(n, HK, D, generator=g).to(dt), torch.randn(n, HK, D, generator=g).to(dt))
            for n in kv_lens
        ]
        self.q = torch.randn(sum(q_lens), H, D, generator=g).to(dt)
        blocks = [max(1, math.ceil(n / page)) for n in kv_lens]
        order = torch.randperm(sum(blocks), generator=g).tolist()
        self.k = torch.randn(sum(blocks), page, HK, D, generator=g).to(dt)  # unused slots: noise
        self.v = torch.randn(sum(blocks), page, HK, D, generator=g).to(dt)
        self.table = torch.zeros(len(kv_lens), max(blocks), dtype=torch.int32)
        nxt = 0
        for b, (ks, vs) in enumerate(self.seqs):
            for i in range(blocks[b]):
                blk = order[nxt]
                nxt += 1
                self.table[b, i] = blk
                rows = ks[i * page : (i + 1) * page]
                self.k[blk, : rows.shape[0]] = rows
                self.v[blk, : rows.shape[0]] = vs[i * page : (i + 1) * page]

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, H, D], lse [H, T] (ln)
        outs, lses, start = [], [], 0
        for (ks, vs), q_len in zip(self.seqs, self.q_lens, strict=True):
            q = self.q[start : start + q_len]
            start += q_len
            if ks.shape[0] < q_len:  # rows before the first key see nothing
                o, l_ = _short(q, ks, vs)
            else:
                o, l_ = reference.attention(q, ks, vs, scale=SCALE)
            outs.append(o)
            lses.append(l_)
        return torch.cat(outs), torch.cat(lses, dim=1)


def _short(
    q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference for a request with fewer keys than query rows: row i (bottom-right
    aligned) sees keys 0 .. i - pad; the first ``pad`` rows see none (output 0, LSE +inf)."""
    q_len, pad = q.shape[0], q.shape[0] - ks.shape[0]
    out = torch.zeros(q_len, H, D, dtype=torch.float64)
    lse = torch.full((H, q_len), math.inf, dtype=torch.float64)
    for i in range(pad, q_len):
        n = i - pad + 1
        oi, li = reference.attention(q[i : i + 1], ks[:n], vs[:n], scale=SCALE)
        out[i], lse[:, i] = oi[0], li[:, 0]
    return out, lse


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _i32(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


def call(
    form: str,
    c: Case,
    *,
    kv_lens: list[int] | None = None,
    table: torch.Tensor | None = None,
    causal: bool = True,
    **layer: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One call of ``form`` asking for the LSE: (out [T, H, D], lse [H, T], the LSE as the
    function returned it). ``kv_lens`` / ``table``: the keys to read (default: the case's);
    ``layer``: more keyword arguments (``alibi_slopes``, ``window_size``)."""
    kv = c.kv_lens if kv_lens is None else kv_lens
    tab = c.table if table is None else table
    q_lens, B = c.q_lens, len(c.q_lens)
    common: dict[str, Any] = dict(softmax_scale=SCALE, causal=causal, **layer)
    if form in ("vllm", "vllm-fa3"):
        out, lse = emulator.VLLM.flash_attn_varlen_func(
            q=c.q, k=c.k, v=c.v, cu_seqlens_q=_cu(q_lens), max_seqlen_q=max(q_lens),
            seqused_k=_i32(kv), max_seqlen_k=max(kv), block_table=tab,
            fa_version=3 if form == "vllm-fa3" else 2, return_softmax_lse=True, **common,
        )  # fmt: skip
        return out, lse, lse
    if form == "vllm-packed":
        ks = torch.cat([_read(c, tab, b, n)[0] for b, n in enumerate(kv)])
        vs = torch.cat([_read(c, tab, b, n)[1] for b, n in enumerate(kv)])
        out, lse = emulator.VLLM.flash_attn_varlen_func(
            q=c.q, k=ks, v=vs, cu_seqlens_q=_cu(q_lens), max_seqlen_q=max(q_lens),
            cu_seqlens_k=_cu(kv), max_seqlen_k=max(kv), return_softmax_lse=True, **common,
        )  # fmt: skip
        return out, lse, lse
    if form == "fa2-varlen":
        out, lse, s_dmask = emulator.FA2.flash_attn_varlen_func(
            c.q, c.k, c.v, _cu(q_lens), _cu(kv), max(q_lens), max(kv),
            block_table=tab, return_attn_probs=True, **common,
        )  # fmt: skip
        assert s_dmask.numel() == 0
        return out, lse, lse
    if form in PADDED:
        sq = q_lens[0]
        q4 = c.q.view(B, sq, H, D)
        table_kw = {"block_table": tab} if form == "fa2-kvcache" else {"page_table": tab}
        fn = emulator.FA2 if form == "fa2-kvcache" else emulator.FA3
        out, lse, *_ = fn.flash_attn_with_kvcache(
            q4, c.k, c.v, cache_seqlens=_i32(kv), return_softmax_lse=True, **table_kw, **common
        )
        assert lse.shape == (B, H, sq)  # (batch, nheads, seqlen_q)
        return out.reshape(-1, H, D), lse.permute(1, 0, 2).reshape(H, B * sq), lse
    if form == "fa3-varlen-q":
        out, lse, *_ = emulator.FA3.flash_attn_with_kvcache(
            c.q, c.k, c.v, cache_seqlens=_i32(kv), page_table=tab, cu_seqlens_q=_cu(q_lens),
            max_seqlen_q=max(q_lens), return_softmax_lse=True, **common,
        )  # fmt: skip
        return out, lse, lse
    assert form == "fa4"
    out, lse = emulator.FA4.flash_attn_varlen_func(
        c.q, c.k, c.v, cu_seqlens_q=_cu(q_lens), seqused_k=_i32(kv), page_table=tab,
        return_lse=True, **common,
    )  # fmt: skip
    return out, lse, lse


def _read(c: Case, table: torch.Tensor, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = table[b].long()
    k = c.k[ids].reshape(-1, HK, D)[:n]
    v = c.v[ids].reshape(-1, HK, D)[:n]
    return k, v


def _lens(form: str) -> tuple[list[int], list[int]]:
    """Decode and prefill rows mixed (a uniform query length for the padded-batch forms)."""
    if form in PADDED:
        return [2, 2, 2], [40, 2, 71]
    return [1, 5, 1, 3], [40, 5, 71, 90]


@pytest.fixture(autouse=True)
def _sm100(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLASH_ATTENTION_ARCH", raising=False)


@pytest.mark.parametrize("form", FORMS)
def test_lse_is_the_natural_log_float32_of_each_query_row(form: str) -> None:
    q_lens, kv_lens = _lens(form)
    c = Case(q_lens, kv_lens, PAGE.get(form, 16))
    out, lse, raw = call(form, c)
    want_out, want_lse = c.reference()
    assert raw.dtype == torch.float32
    if form not in PADDED:
        assert raw.shape == (H, sum(q_lens))  # (nheads, total_q) for varlen
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(out.double(), want_out, atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("form", [f for f in FORMS if f not in PADDED])
def test_rows_that_see_no_key_give_zero_and_the_providers_infinity(form: str) -> None:
    """A request with fewer keys than query rows: its first rows (bottom-right aligned) see
    nothing: output 0 and +inf (FA2) or -inf (FA3, FA4); the others match the reference."""
    c = Case([4, 1], [2, 9], PAGE.get(form, 16))
    out, lse, _ = call(form, c)
    want_out, want_lse = c.reference()
    assert torch.all(out[:2] == 0)
    assert torch.all(lse[:, :2] == EMPTY[form])
    torch.testing.assert_close(lse[:, 2:].double(), want_lse[:, 2:], atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(out.double(), want_out, atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("form", FORMS)
def test_two_halves_of_the_keys_merged_by_their_lse_equal_the_whole(form: str) -> None:
    """Keys [0, m) for every query row (non-causal) and keys [m, n) causally (bottom-right),
    merged by ``attnhub.lse``: the output and LSE of one causal call over [0, n) (a cascade's
    prefix and suffix, a context-parallel rank's shard and the rest)."""
    page = PAGE.get(form, 16)
    q_lens, _ = _lens(form)
    m = page  # a whole page, so the second half's table is the first's minus its first column
    kv_lens = [m + 40, m + 3, m + 2] if form in PADDED else [m + 40, m + 5, m + 1, m + 30]
    c = Case(q_lens, kv_lens, page, seed=1)
    whole_out, whole_lse, _ = call(form, c)
    a_out, a_lse, _ = call(form, c, kv_lens=[m] * len(kv_lens), causal=False)
    rest = [n - m for n in kv_lens]
    b_out, b_lse, _ = call(form, c, kv_lens=rest, table=c.table[:, 1:].contiguous())
    merged, merged_lse = merge_attn_states(a_out, a_lse, b_out, b_lse)
    torch.testing.assert_close(merged_lse, whole_lse, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(merged, whole_out.float(), atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("form", ["vllm", "vllm-fa3", "fa4"])
def test_an_empty_part_weighs_nothing_in_the_merge(form: str) -> None:
    """A part whose rows see no key (a rank holding none of a request's keys) returns the
    provider's infinite LSE; merged with the other part it contributes nothing, never NaN."""
    c = Case([1, 1], [0, 0], 16)
    empty_out, empty_lse, _ = call(form, c)
    assert torch.all(empty_lse == EMPTY[form]) and torch.all(empty_out == 0)
    full = Case([1, 1], [7, 30], 16, seed=2)
    out, lse, _ = call(form, full)
    merged, merged_lse = merge_attn_states(empty_out, empty_lse, out, lse)
    torch.testing.assert_close(merged_lse, lse)
    torch.testing.assert_close(merged, out.float())


def test_the_lse_is_not_returned_unless_asked() -> None:
    c = Case([1, 2], [9, 20], 16)
    common: dict[str, Any] = dict(
        q=c.q, k=c.k, v=c.v, cu_seqlens_q=_cu(c.q_lens), max_seqlen_q=2,
        seqused_k=_i32(c.kv_lens), max_seqlen_k=20, block_table=c.table, causal=True,
    )  # fmt: skip
    assert isinstance(emulator.VLLM.flash_attn_varlen_func(**common), torch.Tensor)
    fa4: Callable[..., Any] = emulator.FA4.flash_attn_varlen_func
    _, lse = fa4(
        c.q, c.k, c.v, cu_seqlens_q=_cu(c.q_lens), seqused_k=_i32(c.kv_lens), page_table=c.table
    )
    assert lse is None


#: The forms that run FA2's kernels (upstream, and vLLM's fork with fa_version=2).
FA2_KERNELS = ("vllm", "vllm-packed", "fa2-varlen", "fa2-kvcache")


@pytest.mark.parametrize("form", FA2_KERNELS)
@pytest.mark.parametrize("window", [(-1, -1), (7, 0), (95, 0)])
def test_fa2_kernels_causal_alibi_lse_is_higher_by_slope_times_the_query_position(
    form: str, window: tuple[int, int]
) -> None:
    """FA2's causal branch biases the scores by ``+slope * j`` ("we add the same bias vector to
    all rows"): the output is the reference's (the same softmax), the LSE higher by
    ``slope * (i + Sk - Sq)`` [source: csrc/flash_attn/src/mask.h]. The branch runs where the
    window, once a side at or past ``seqlen_k`` is unbounded, is (-1, 0): the varlen calls'
    ``max_seqlen_k`` (90 here), kvcache's table capacity (one 256-key page); any other window
    runs the local branch with the bias ``-slope * |i + Sk - Sq - j|``."""
    q_lens, kv_lens = _lens(form)
    c = Case(q_lens, kv_lens, PAGE.get(form, 16))
    slopes = testing.alibi_slopes(H)
    out, lse, _ = call(form, c, alibi_slopes=slopes, window_size=window)
    outs, lses, positions = [], [], []
    for (ks, vs), q_len, start in zip(c.seqs, q_lens, _cu(q_lens).tolist(), strict=False):
        q = c.q[start : start + q_len]
        o, l_ = reference.attention(q, ks, vs, scale=SCALE, window=window, alibi_slopes=slopes)
        outs.append(o)
        lses.append(l_)
        positions += range(ks.shape[0] - q_len, ks.shape[0])
    want_lse = torch.cat(lses, dim=1)
    seqlen_k = c.table.shape[1] * c.page if form == "fa2-kvcache" else max(kv_lens)
    if window[0] < 0 or window[0] >= seqlen_k:  # the causal branch
        want_lse = want_lse + slopes.double()[:, None] * torch.tensor(positions).double()[None]
    torch.testing.assert_close(out.double(), torch.cat(outs), atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-4, rtol=1e-5)
