"""The LSE ixformer's ops return, op by op, against ``attnhub.reference``.

What the protocol will declare (docs/backends/iluvatar.md, "LSE"): ``flash_attn_varlen_func``
(packed or over the paged HND cache) and ``flash_attn_with_kvcache`` return, with
``return_softmax_lse=True``, the LSE as float32 ``(num_heads, num_tokens)`` [callers: "FA returns
LSE in shape [ H, B ]"] in the natural log [callers: the fork's DCP path feeds it to vLLM's
natural-log ``cp_lse_ag_out_rs`` and its cascade to ``merge_attn_states``, so a base-2 LSE would
merge wrongly on the hardware]. Checked on random inputs with GQA, decode and prefill rows,
packed and paged, rows past the last query end, and two halves of the keys merged by their
LSEs (attnhub's merge and ixformer's own) equal to the call over all of them.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from attnhub_iluvatar import emulator

from attnhub import reference
from attnhub.lse import merge_attn_states

FA = emulator.contrib.vllm_flash_attn
H, HK, D, BS = 4, 2, 64, 16
SCALE = D**-0.5


class Case:
    """Random K/V sequences per request, packed and in a paged HND cache
    ``(num_blocks, HK, BS, D)`` (blocks in a shuffled order), and a random query of each
    request's last ``q_len`` positions."""

    def __init__(self, q_lens: list[int], kv_lens: list[int], seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.q_lens, self.kv_lens = q_lens, kv_lens
        dt = torch.float16
        self.seqs = [
            (torch.randn(n, HK, D, generator=g).to(dt), torch.randn(n, HK, D, generator=g).to(dt))
            for n in kv_lens
        ]
        self.q = torch.randn(sum(q_lens), H, D, generator=g).to(dt)
        blocks = [max(1, math.ceil(n / BS)) for n in kv_lens]
        order = torch.randperm(sum(blocks), generator=g).tolist()
        self.kc = torch.randn(sum(blocks), HK, BS, D, generator=g).to(dt)
        self.vc = torch.randn(sum(blocks), HK, BS, D, generator=g).to(dt)
        self.table = torch.zeros(len(kv_lens), max(blocks), dtype=torch.int32)
        nxt = 0
        for b, (ks, vs) in enumerate(self.seqs):
            for i in range(blocks[b]):
                blk = order[nxt]
                nxt += 1
                self.table[b, i] = blk
                rows = ks[i * BS : (i + 1) * BS]
                self.kc[blk, :, : rows.shape[0]] = rows.transpose(0, 1)
                self.vc[blk, :, : rows.shape[0]] = vs[i * BS : (i + 1) * BS].transpose(0, 1)

    def reference(self, *, causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        outs, lses, start = [], [], 0
        for (ks, vs), q_len in zip(self.seqs, self.q_lens, strict=True):
            o, l_ = reference.attention(
                self.q[start : start + q_len], ks, vs, scale=SCALE, causal=causal
            )
            start += q_len
            outs.append(o)
            lses.append(l_)
        return torch.cat(outs), torch.cat(lses, dim=1)


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def varlen(
    c: Case,
    *,
    paged: bool = True,
    q: torch.Tensor | None = None,
    kv_lens: list[int] | None = None,
    table: torch.Tensor | None = None,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    kv = c.kv_lens if kv_lens is None else kv_lens
    kw: dict[str, Any] = dict(
        q=c.q if q is None else q,
        cu_seqlens_q=_cu(c.q_lens),
        cu_seqlens_k=_cu(kv),  # cumulative, also over the paged cache [callers]
        max_seqlen_q=max(c.q_lens),
        max_seqlen_k=max(kv),
        softmax_scale=SCALE,
        causal=causal,
        return_softmax_lse=True,
    )
    if paged:
        kw |= dict(k=c.kc, v=c.vc, block_table=c.table if table is None else table)
    else:
        kw |= dict(k=torch.cat([k for k, _ in c.seqs]), v=torch.cat([v for _, v in c.seqs]))
    out, lse = FA.flash_attn_varlen_func(**kw)
    return out, lse


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "packed"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_varlen_lse_is_the_natural_log_float32_heads_by_tokens(paged: bool, causal: bool) -> None:
    c = Case([1, 5, 1, 3], [40, 5, 71, 90])
    out, lse = varlen(c, paged=paged, causal=causal)
    want_out, want_lse = c.reference(causal=causal)
    assert lse.dtype == torch.float32 and lse.shape == (H, 10)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(out.double(), want_out, atol=2e-3, rtol=1e-2)


def test_the_decode_forms_lse_has_the_same_layout() -> None:
    """``flash_attn_with_kvcache`` as the fork calls it (q (T, 1, H, D) with cu_query_lens),
    asked for the LSE: (H, T) like the varlen op [inferred: the fork's decodes never ask]."""
    c = Case([1, 1, 1], [40, 5, 71])
    out, lse = FA.flash_attn_with_kvcache(
        q=c.q.unsqueeze(1), k_cache=c.kc, v_cache=c.vc,
        cache_seqlens=torch.tensor(c.kv_lens, dtype=torch.int32), block_table=c.table,
        cu_query_lens=_cu(c.q_lens), max_query_len=1, max_context_len=71,
        softmax_scale=SCALE, causal=True, return_softmax_lse=True,
    )  # fmt: skip
    want_out, want_lse = c.reference()
    assert lse.dtype == torch.float32 and lse.shape == (H, 3)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(out[:, 0].double(), want_out, atol=2e-3, rtol=1e-2)


def test_rows_past_the_last_query_end_hold_no_lse() -> None:
    """A q longer than cu_seqlens_q[-1] (graph padding): nothing computes those rows, so their
    LSE is NaN (a caller must not read it), not +inf (which a merge would take for an empty,
    valid part); the rows before are unchanged."""
    c = Case([1, 3], [20, 40])
    padded = torch.cat([c.q, torch.randn(2, H, D).to(c.q.dtype)])
    _, lse = varlen(c, q=padded)
    assert lse.shape == (H, 6) and torch.isnan(lse[:, 4:]).all()
    _, whole = varlen(c)
    torch.testing.assert_close(lse[:, :4], whole)


@pytest.mark.parametrize("merge", ["attnhub", "ixformer"])
def test_two_halves_of_the_keys_merged_by_their_lse_equal_the_whole(merge: str) -> None:
    """Keys [0, BS) for every query row (non-causal) and keys [BS, n) causally, merged by
    ``attnhub.lse`` or ixformer's ``merge_attn_states`` (output positional, as the fork
    calls it): the output and LSE of one causal call over all keys (the fork's cascade and
    its DCP context/query split)."""
    kv_lens = [BS + 40, BS + 5, BS + 1, BS + 30]
    c = Case([1, 5, 1, 3], kv_lens, seed=1)
    whole_out, whole_lse = varlen(c)
    a_out, a_lse = varlen(c, kv_lens=[BS] * 4, causal=False)
    rest = [n - BS for n in kv_lens]
    b_out, b_lse = varlen(c, kv_lens=rest, table=c.table[:, 1:].contiguous())
    if merge == "attnhub":
        merged, merged_lse = merge_attn_states(a_out, a_lse, b_out, b_lse)
        torch.testing.assert_close(merged_lse, whole_lse, atol=1e-4, rtol=1e-5)
    else:
        merged = torch.empty_like(whole_out)
        FA.merge_attn_states(a_out, a_lse, b_out, b_lse, merged)
    torch.testing.assert_close(merged.float(), whole_out.float(), atol=2e-3, rtol=1e-2)


def test_an_empty_part_weighs_nothing_in_the_merge() -> None:
    """A sequence with no keys (a DCP rank holding none of a request's context) gives output
    0 and LSE +inf [inferred]; merged with the other part it contributes nothing."""
    c = Case([1, 2], [0, 0])
    empty_out, empty_lse = varlen(c, causal=False)
    assert torch.all(empty_out == 0) and torch.all(torch.isposinf(empty_lse))
    full = Case([1, 2], [7, 30], seed=2)
    full.q = c.q
    out, lse = varlen(full)
    merged, merged_lse = merge_attn_states(empty_out, empty_lse, out, lse)
    torch.testing.assert_close(merged_lse, lse)
    torch.testing.assert_close(merged, out.float())
