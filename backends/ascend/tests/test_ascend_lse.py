"""The LSE each Ascend op returns, op by op, against ``attnhub.reference``.

What the protocol will declare (docs/backends/ascend.md, "LSE"): FIA v1 and v2 (and their
``.out`` overloads, the forms the backend calls) return the natural-log LSE, float32, (T, N, 1)
for TND, only with ``softmax_lse_flag`` / ``return_softmax_lse``; ``npu_fusion_attention`` (the
non-causal path) returns no LSE but ``softmax_max`` and ``softmax_sum``, whose
``max + log(sum)`` is it. Checked on random inputs with GQA, decode and prefill rows mixed, a
paged cache, sinks, rows that see no key, rows past the last query end, and two halves of the
keys merged by their LSEs equal to the call over all of them.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from attnhub_ascend import emulator

from attnhub import reference
from attnhub.lse import merge_attn_states

FIA = emulator.npu_fused_infer_attention_score
FIA2 = emulator.npu_fused_infer_attention_score_v2
MASK = emulator.compressed_causal_mask()
N, KV_N, D, BS = 4, 2, 64, 128
SCALE = D**-0.5
FORMS = ("v1", "v1.out", "v2", "v2.out")


class Case:
    """Random K/V sequences per request in a paged cache ``(num_blocks, BS, KV_N * D)`` (blocks
    in a shuffled order) and a random TND query of each request's last ``q_len`` positions."""

    def __init__(self, q_lens: list[int], kv_lens: list[int], seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.q_lens, self.kv_lens = q_lens, kv_lens
        dt = torch.bfloat16
        self.seqs = [
            (
                torch.randn(n, KV_N, D, generator=g).to(dt),
                torch.randn(n, KV_N, D, generator=g).to(dt),
            )
            for n in kv_lens
        ]
        self.q = torch.randn(sum(q_lens), N, D, generator=g).to(dt)
        blocks = [max(1, math.ceil(n / BS)) for n in kv_lens]
        order = torch.randperm(sum(blocks), generator=g).tolist()
        self.key = torch.randn(sum(blocks), BS, KV_N * D, generator=g).to(dt)
        self.value = torch.randn(sum(blocks), BS, KV_N * D, generator=g).to(dt)
        self.table = torch.zeros(len(kv_lens), max(blocks), dtype=torch.int32)
        nxt = 0
        for b, (ks, vs) in enumerate(self.seqs):
            for i in range(blocks[b]):
                blk = order[nxt]
                nxt += 1
                self.table[b, i] = blk
                rows = ks[i * BS : (i + 1) * BS].reshape(-1, KV_N * D)
                self.key[blk, : rows.shape[0]] = rows
                self.value[blk, : rows.shape[0]] = vs[i * BS : (i + 1) * BS].reshape(-1, KV_N * D)

    def reference(
        self, *, causal: bool = True, sinks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, N, D] f64, lse [N, T] f64 (ln)
        outs, lses, start = [], [], 0
        for (ks, vs), q_len in zip(self.seqs, self.q_lens, strict=True):
            q = self.q[start : start + q_len]
            start += q_len
            if ks.shape[0] < q_len:  # sparse_mode 3 rows before the first key: none visible
                o, l_ = _short(q, ks, vs)
            else:
                o, l_ = reference.attention(q, ks, vs, scale=SCALE, causal=causal, sinks=sinks)
            outs.append(o)
            lses.append(l_)
        return torch.cat(outs), torch.cat(lses, dim=1)


def _short(
    q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fewer keys than query rows: row i (bottom-right) sees keys 0 .. i - pad, the first
    ``pad`` rows none (output 0, LSE +inf)."""
    q_len, pad = q.shape[0], q.shape[0] - ks.shape[0]
    out = torch.zeros(q_len, N, D, dtype=torch.float64)
    lse = torch.full((N, q_len), math.inf, dtype=torch.float64)
    for i in range(pad, q_len):
        oi, li = reference.attention(
            q[i : i + 1], ks[: i - pad + 1], vs[: i - pad + 1], scale=SCALE
        )
        out[i], lse[:, i] = oi[0], li[:, 0]
    return out, lse


def _ends(lens: list[int]) -> list[int]:
    return torch.tensor(lens).cumsum(0).tolist()


def call(
    form: str,
    c: Case,
    *,
    q: torch.Tensor | None = None,
    kv_lens: list[int] | None = None,
    table: torch.Tensor | None = None,
    causal: bool = True,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One FIA call in ``form`` with the LSE flag: (attention_out [T, N, D], softmax_lse as
    returned: float32 (T, N, 1))."""
    qq = c.q if q is None else q
    v2 = form.startswith("v2")
    mask: dict[str, Any] = (
        dict(sparse_mode=3, atten_mask=MASK) if causal else dict(sparse_mode=0, atten_mask=None)
    )
    kw: dict[str, Any] = dict(
        block_table=c.table if table is None else table,
        num_key_value_heads=KV_N,
        input_layout="TND",
        block_size=BS,
        **mask,
    )
    q_ends, kv = _ends(c.q_lens), c.kv_lens if kv_lens is None else kv_lens
    if v2:
        kw |= dict(actual_seq_qlen=q_ends, actual_seq_kvlen=kv, num_query_heads=N)
        kw |= dict(softmax_scale=SCALE, return_softmax_lse=True, learnable_sink=sink)
    else:
        assert sink is None
        kw |= dict(actual_seq_lengths=q_ends, actual_seq_lengths_kv=kv, num_heads=N, scale=SCALE)
        kw |= dict(softmax_lse_flag=True)
    op = FIA2 if v2 else FIA
    if not form.endswith(".out"):
        out, lse = op(qq, c.key, c.value, **kw)
        return out, lse
    buf = torch.empty_like(qq)
    lse_buf = torch.empty(qq.shape[0], N, 1, dtype=torch.float32)
    got = op.out(qq, c.key, c.value, **kw, workspace=None, out=[buf, lse_buf])
    assert got[0] is buf and got[1] is lse_buf
    return buf, lse_buf


def _as_reference(lse: torch.Tensor) -> torch.Tensor:  # (T, N, 1) -> [N, T]
    assert lse.dim() == 3 and lse.shape[2] == 1
    return lse[:, :, 0].t()


@pytest.mark.parametrize("form", FORMS)
def test_fia_lse_is_the_natural_log_float32_t_n_1(form: str) -> None:
    c = Case([1, 5, 1, 3], [40, 5, 300, 190])
    out, lse = call(form, c)
    want_out, want_lse = c.reference()
    assert lse.dtype == torch.float32 and lse.shape == (10, N, 1)
    torch.testing.assert_close(_as_reference(lse).double(), want_lse, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(out.double(), want_out, atol=2e-2, rtol=2e-2)


def test_without_the_flag_there_is_no_lse() -> None:
    """A [1] zero tensor in its place (the wheel's docs)."""
    c = Case([1, 2], [9, 20])
    kw: dict[str, Any] = dict(
        actual_seq_lengths=_ends(c.q_lens), actual_seq_lengths_kv=c.kv_lens,
        block_table=c.table, num_heads=N, num_key_value_heads=KV_N, scale=SCALE,
        input_layout="TND", block_size=BS, sparse_mode=3, atten_mask=MASK,
    )  # fmt: skip
    _, lse = FIA(c.q, c.key, c.value, **kw)
    assert lse.shape == (1,) and float(lse[0]) == 0


@pytest.mark.parametrize("form", ["v2", "v2.out"])
def test_v2s_lse_counts_the_learnable_sink(form: str) -> None:
    """With ``learnable_sink`` the sink joins the denominator, so it is in the LSE."""
    c = Case([1, 4], [33, 70])
    sink = torch.tensor([0.0, 2.0, -1.5, 4.0]).to(torch.bfloat16)
    out, lse = call(form, c, sink=sink)
    want_out, want_lse = c.reference(sinks=sink.double())
    torch.testing.assert_close(_as_reference(lse).double(), want_lse, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(out.double(), want_out, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("form", ("v1", "v2.out"))
def test_rows_that_see_no_key_give_zero_and_plus_infinity(form: str) -> None:
    """sparse_mode 3 with Q_S > KV_S: the op detects the rows before the first key and
    corrects them (output 0; LSE +inf [inferred]), so a merge reads them as empty."""
    c = Case([4, 1], [2, 9])
    out, lse = call(form, c)
    want_out, want_lse = c.reference()
    assert torch.all(out[:2] == 0) and torch.all(torch.isposinf(lse[:2]))
    torch.testing.assert_close(_as_reference(lse).double(), want_lse, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(out.double(), want_out, atol=2e-2, rtol=2e-2)


def test_rows_past_the_last_query_end_hold_no_lse() -> None:
    """A query longer than its last end (vllm-ascend pads to the graph's size): the doc says
    nothing of those rows, so the emulator gives NaN there; the LSE of the rows before is
    unchanged."""
    c = Case([1, 3], [20, 40])
    padded = torch.cat([c.q, torch.randn(2, N, D).to(c.q.dtype)])
    _, lse = call("v1.out", c, q=padded)
    assert lse.shape == (6, N, 1) and torch.isnan(lse[4:]).all()
    _, whole = call("v1", c)
    torch.testing.assert_close(lse[:4], whole)


@pytest.mark.parametrize("form", FORMS)
def test_two_halves_of_the_keys_merged_by_their_lse_equal_the_whole(form: str) -> None:
    """Keys [0, BS) for every query row (sparse_mode 0, no mask) and keys [BS, n) causally
    (sparse_mode 3), merged by ``attnhub.lse``: the output and LSE of one causal call."""
    kv_lens = [BS + 40, BS + 5, BS + 1, BS + 130]
    c = Case([1, 5, 1, 3], kv_lens, seed=1)
    whole_out, whole_lse = call(form, c)
    a_out, a_lse = call(form, c, kv_lens=[BS] * 4, causal=False)
    rest = [n - BS for n in kv_lens]
    b_out, b_lse = call(form, c, kv_lens=rest, table=c.table[:, 1:].contiguous())
    merged, merged_lse = merge_attn_states(a_out, _as_reference(a_lse), b_out, _as_reference(b_lse))
    torch.testing.assert_close(merged_lse, _as_reference(whole_lse), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(merged, whole_out.float(), atol=2e-2, rtol=2e-2)


def test_an_empty_part_weighs_nothing_in_the_merge() -> None:
    """A part whose rows see no key (inner_precise 2, which FIA takes only for Q_S > 1:
    corrected, LSE +inf) merged with a part
    that has keys contributes nothing, never NaN."""
    c = Case([2, 3], [0, 0])
    kw: dict[str, Any] = dict(
        actual_seq_lengths=[2, 5], actual_seq_lengths_kv=[0, 0], block_table=c.table,
        num_heads=N, num_key_value_heads=KV_N, scale=SCALE, input_layout="TND",
        block_size=BS, sparse_mode=0, inner_precise=2, softmax_lse_flag=True,
    )  # fmt: skip
    empty_out, empty_lse = FIA(c.q, c.key, c.value, **kw)
    assert torch.all(empty_out == 0) and torch.all(torch.isposinf(empty_lse))
    full = Case([2, 3], [7, 30], seed=2)
    full.q = c.q
    out, lse = call("v1", full)
    merged, merged_lse = merge_attn_states(
        empty_out, _as_reference(empty_lse), out, _as_reference(lse)
    )
    torch.testing.assert_close(merged_lse, _as_reference(lse))
    torch.testing.assert_close(merged, out.float())


def test_fusion_attentions_max_and_sum_give_the_lse() -> None:
    """npu_fusion_attention (the backend's non-causal path) has no LSE output: its
    ``softmax_max`` and ``softmax_sum`` (8 copies per row [inferred]; [N, T, 8] by default)
    give it as ``max + log(sum)``, natural log, the sink counted."""
    c = Case([3, 2], [5, 9])
    ks = torch.cat([k for k, _ in c.seqs])
    vs = torch.cat([v for _, v in c.seqs])
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, row_max, row_sum, *_ = emulator.npu_fusion_attention(
        c.q, ks, vs, N, "TND", scale=SCALE, sparse_mode=0,
        actual_seq_qlen=_ends(c.q_lens), actual_seq_kvlen=_ends(c.kv_lens), sink=sink,
    )  # fmt: skip
    assert row_max.shape == row_sum.shape == (N, 5, 8) and row_max.dtype == torch.float32
    lse = row_max[..., 0] + torch.log(row_sum[..., 0])
    want_out, want_lse = c.reference(causal=False, sinks=sink.double())
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(out.double(), want_out, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("sparse", "empty"),
    [
        (dict(sparse_mode=3, atten_mask=MASK), math.inf),  # detected (Q_S > KV_S): corrected
        (dict(sparse_mode=0, atten_mask=None), math.nan),  # vllm-ascend's DCP form: not
    ],
    ids=["sparse_mode_3", "sparse_mode_0"],
)
def test_a_decode_row_over_no_keys(sparse: dict[str, Any], empty: float) -> None:
    """A context-parallel rank holding none of a request's keys: one query token over
    ``actual_seq_lengths_kv`` 0. With sparse_mode 3 the op detects Q_S > KV_S and corrects the
    row (output 0, LSE +inf); in vllm-ascend's DCP call form (no mask, inner_precise 0) the doc
    promises nothing, so the emulator gives NaN, which a merge must take as empty."""
    c = Case([1, 1], [0, 9])
    kw: dict[str, Any] = dict(
        actual_seq_lengths=[1, 2], actual_seq_lengths_kv=[0, 9], block_table=c.table,
        num_heads=N, num_key_value_heads=KV_N, scale=SCALE, input_layout="TND",
        block_size=BS, softmax_lse_flag=True, **sparse,
    )  # fmt: skip
    out, lse = FIA(c.q, c.key, c.value, **kw)
    if math.isnan(empty):
        assert torch.isnan(lse[0]).all() and torch.isnan(out[0].float()).all()
    else:
        assert torch.all(lse[0] == empty) and torch.all(out[0] == 0)
    _, want_lse = reference.attention(c.q[1:], *c.seqs[1], scale=SCALE)
    torch.testing.assert_close(lse[1:, :, 0].t().double(), want_lse, atol=2e-4, rtol=1e-5)
