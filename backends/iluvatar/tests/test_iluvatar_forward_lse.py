"""``forward(..., return_lse=True)`` on the iluvatar backend: mode 0 returns the LSE of the
step's own calls (``flash_attn_varlen_func(return_softmax_lse=True)``, the decodes through the
varlen op), in attnhub's ``[tokens, heads]`` natural log with +inf padding rows, a cascade's
merged; the int8 modes and sinks are refused with the reason, the cache untouched."""

from __future__ import annotations

import iluvatar_helpers as h
import pytest
import torch
from attnhub_iluvatar import emulator
from iluvatar_helpers import KVCACHE, MERGE, VARLEN, WRITE

from attnhub import reference, testing
from attnhub.errors import UnsupportedConfigurationError

#: two decodes, then a multi-token decode, a chunked prefill and a fresh prefill
MIXED = [(1, 40), (1, 9), (3, 30), (20, 50), (17, 17)]
FEATURES = dict(sliding_window=24, logits_soft_cap=30.0, use_alibi=True)


def _run(
    st: h.Step, common_prefix_len: int = 0
) -> tuple[torch.Tensor, torch.Tensor, list[emulator.Call]]:
    meta = st.backend.metadata_builder().build(st.batch, common_prefix_len=common_prefix_len)
    impl = st.backend.impl(alibi_slopes=st.alibi_slopes, sinks=st.sinks)
    with emulator.record_calls() as calls:
        out, lse = impl.forward(st.query, st.key, st.value, st.cache, meta, return_lse=True)
    return out, lse, [c for c in calls if c.name != WRITE]


def _assert_lse(st: h.Step, out: torch.Tensor, lse: torch.Tensor) -> None:
    n = st.batch.num_actual_tokens
    h.assert_matches_reference(st, out)
    _, want = reference.paged_attention(
        st.query[:n], st.cache, st.batch, st.backend.spec, alibi_slopes=st.alibi_slopes
    )
    assert lse.shape == (st.query.shape[0], st.backend.spec.num_heads)
    assert lse.dtype == torch.float32
    why = testing.mismatch(
        lse[:n], want.t(), st.backend.capabilities.tolerance(st.backend.spec.dtype)
    )
    assert why is None, why
    assert bool(torch.isposinf(lse[n:]).all()), lse[n:]


@pytest.mark.parametrize("features", [{}, FEATURES], ids=["plain", "window+softcap+alibi"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_mixed_step_returns_the_reference_lse_from_its_two_calls(
    dtype: torch.dtype, features: dict[str, object]
) -> None:
    st = h.step(MIXED, h.spec(dtype=dtype, **features), padding=3)
    out, lse, calls = _run(st)
    # the decodes through the varlen op (its LSE is the callers'), then the prefills
    assert [c.name for c in calls] == [VARLEN, VARLEN]
    assert all(c.kwargs["return_softmax_lse"] is True for c in calls)
    assert calls[0].kwargs["cu_seqlens_k"].tolist() == [0, 40, 49]
    assert calls[0].kwargs["cu_seqlens_k"].dtype == torch.int32
    _assert_lse(st, out, lse)


def test_without_the_lse_the_decodes_keep_the_decode_op() -> None:
    st = h.step(MIXED)
    _, calls = h.calls_of(st)
    assert [c.name for c in calls if c.name != WRITE] == [KVCACHE, VARLEN]


def test_a_cascade_returns_the_merged_lse_of_its_two_calls() -> None:
    bs = 16
    table = torch.tensor([[0, 1, 2, 3], [0, 1, 4, 5], [0, 1, 6, 7], [0, 1, 8, 9]])
    st = h.step([(1, 45), (1, 61), (1, 33), (5, 50)], table=table, padding=2)
    out, lse, calls = _run(st, common_prefix_len=2 * bs)
    assert [c.name for c in calls] == [VARLEN, VARLEN]  # ixformer's merge returns no LSE
    assert MERGE not in [c.name for c in calls]
    assert calls[0].kwargs["cu_seqlens_q"].tolist() == [0, 8]  # the prefix: every query token
    assert calls[0].kwargs["causal"] is False
    _assert_lse(st, out, lse)


@pytest.mark.parametrize(
    "changes",
    [dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="int8_k"), dict(use_sinks=True)],
    ids=["int8", "int8_k", "sinks"],
)
def test_the_int8_modes_and_sinks_are_refused_before_any_write(changes: dict[str, object]) -> None:
    st = h.step(MIXED, h.spec(**changes))
    meta = st.backend.metadata_builder().build(st.batch)
    impl = st.backend.impl(alibi_slopes=st.alibi_slopes, sinks=st.sinks)
    before = st.cache.clone()
    with pytest.raises(UnsupportedConfigurationError, match="return_lse") as info:
        impl.forward(st.query, st.key, st.value, st.cache, meta, return_lse=True)
    assert "ixformer" in str(info.value)
    assert st.cache.equal(before)
