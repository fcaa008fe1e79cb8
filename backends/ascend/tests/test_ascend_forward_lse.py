"""``forward(..., return_lse=True)`` on the ascend backend: each path returns the LSE of its one
call in attnhub's ``[tokens, heads]`` natural log, +inf padding rows: FIA with its LSE flag
(v1 ``softmax_lse_flag``, v2 ``return_softmax_lse`` with the sink), written into the caller's
rows where they are the op's ``(T, N, 1)`` buffer; ``npu_fusion_attention``'s
``softmax_max + log(softmax_sum)``; window decode padding rows dropped; captured graphs too."""

from __future__ import annotations

from typing import Any

import ascend_helpers as h
import pytest
import torch
from attnhub_ascend import emulator

from attnhub import BatchMetadata, reference, testing
from attnhub.graphs import GraphRunner
from attnhub.spec import AttentionType

FIA = "npu_fused_infer_attention_score.out"
FIA_V2 = "npu_fused_infer_attention_score_v2.out"
FA = "npu_fusion_attention"
MIXED = [(1, 300), (1, 9), (3, 130), (20, 150), (17, 17)]


def _run(
    st: h.Step, lse: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    meta = st.backend.metadata_builder().build(st.batch)
    impl = st.backend.impl(sinks=st.sinks)
    with emulator.record_calls() as calls:
        out, got = impl.forward(
            st.query, st.key, st.value, st.cache, meta, return_lse=True, lse=lse
        )
    return out, got, [c for c in calls if c.name in (FIA, FIA_V2, FA)]


def _assert_lse(st: h.Step, out: torch.Tensor, lse: torch.Tensor) -> None:
    n = st.batch.num_actual_tokens
    h.assert_matches_reference(st, out)
    _, want = reference.paged_attention(
        st.query[:n], st.cache, st.batch, st.backend.spec, sinks=st.sinks
    )
    assert lse.shape == (st.query.shape[0], st.backend.spec.num_heads)
    assert lse.dtype == torch.float32
    why = testing.mismatch(
        lse[:n], want.t(), st.backend.capabilities.tolerance(st.backend.spec.dtype)
    )
    assert why is None, why
    assert bool(torch.isposinf(lse[n:]).all()), lse[n:]


@pytest.mark.parametrize("sinks", [False, True])
def test_fia_returns_the_lse_of_its_one_call_into_the_callers_rows(sinks: bool) -> None:
    st = h.step(MIXED, h.spec(use_sinks=sinks), padding=3)
    buffer = torch.full((st.query.shape[0], 4), 7.0)
    out, lse, calls = _run(st, buffer)
    assert lse is buffer
    (call,) = calls
    assert call.name == (FIA_V2 if sinks else FIA)
    flag = "return_softmax_lse" if sinks else "softmax_lse_flag"
    assert call.kwargs[flag] is True
    # the op's (T, N, 1) float32 buffer is a view of the caller's rows: no copy
    written = call.kwargs["out"][1]
    assert written.shape == (st.batch.num_actual_tokens, 4, 1)
    assert written.data_ptr() == buffer.data_ptr()
    _assert_lse(st, out, lse)


def test_without_the_lse_fia_gets_no_flag_and_its_reserved_output() -> None:
    st = h.step(MIXED)
    meta = st.backend.metadata_builder().build(st.batch)
    with emulator.record_calls() as calls:
        st.backend.impl().forward(st.query, st.key, st.value, st.cache, meta)
    (call,) = [c for c in calls if c.name == FIA]
    assert "softmax_lse_flag" not in call.kwargs
    assert call.kwargs["out"][1].numel() == 1


def test_a_strided_lse_buffer_is_filled_through_a_buffer_of_the_ops_shape() -> None:
    st = h.step(MIXED, padding=2)
    buffer = torch.empty(4, st.query.shape[0]).t()  # vLLM's [H, T] seen as [T, H]
    out, lse, calls = _run(st, buffer)
    assert lse is buffer and calls[0].kwargs["out"][1].data_ptr() != buffer.data_ptr()
    _assert_lse(st, out, lse)


def test_window_decode_padding_rows_lses_are_dropped_with_their_outputs() -> None:
    # one-token requests whose window cuts get a leading padding row (kernel rows > tokens)
    st = h.step([(1, 300), (1, 200), (4, 260)], h.spec(sliding_window=64), padding=1)
    out, lse, calls = _run(st)
    (call,) = calls
    assert call.args[0].shape[0] == 6 + 2  # two padded decodes
    _assert_lse(st, out, lse)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize(
    "kind", ["encoder_only", "causal_false_decoder"], ids=["encoder", "non-causal step"]
)
def test_the_non_causal_path_derives_it_from_softmax_max_and_sum(kind: str, sinks: bool) -> None:
    if kind == "encoder_only":
        s = h.spec(attn_type=AttentionType.ENCODER_ONLY, use_sinks=sinks)
        st = h.step([(5, 5), (17, 17), (1, 1)], s, padding=2)
    else:
        st = h.step([(3, 140), (1, 9), (5, 300)], h.spec(use_sinks=sinks), causal=False)
    out, lse, calls = _run(st)
    (call,) = calls
    assert call.name == FA and call.kwargs["softmax_layout"] == "TND"
    _assert_lse(st, out, lse)


def test_without_the_lse_npu_fusion_attention_is_called_as_before() -> None:
    st = h.step([(3, 140), (1, 9)], causal=False)
    meta = st.backend.metadata_builder().build(st.batch)
    with emulator.record_calls() as calls:
        st.backend.impl().forward(st.query, st.key, st.value, st.cache, meta)
    (call,) = [c for c in calls if c.name == FA]
    assert "softmax_layout" not in call.kwargs


def test_a_captured_decode_graph_returns_the_lse_of_each_replay() -> None:
    spec = h.spec(dtype=torch.float16)
    backend = h.backend(spec)
    g = testing.generator(3)
    cache = backend.allocate_kv_cache(24)
    testing.fill_cache_random(cache, g)
    impl = backend.impl()

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> Any:
        return impl.forward(q, k, v, cache, meta, return_lse=True)

    runner = GraphRunner(backend, step, capture_sizes=[4], max_blocks_per_req=4, kv_caches=[cache])
    table = testing.shuffled_block_table([4 * 128] * 3, 128, 24, g)
    seqs = [100, 250, 7]
    for i in range(3):
        batch = BatchMetadata.from_lengths([1, 1, 1], seqs, table, 128)
        q, k, v = testing.random_qkv(spec, 3, testing.generator(10 + i))
        out, lse = runner.run(batch, q, k, v)
        want_out, want_lse = reference.paged_attention(q, cache, batch, spec)
        tol = backend.capabilities.tolerance(spec.dtype)
        testing.assert_within(out, want_out, tol, f"replay {i}", batch=batch)
        assert testing.mismatch(lse, want_lse.t(), tol) is None, f"replay {i}"
        seqs = [s + 1 for s in seqs]
    assert runner.stats["replays"] >= 2
