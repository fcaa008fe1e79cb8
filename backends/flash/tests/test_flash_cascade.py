"""Cascade attention: a shared prefix as one call of every query token over the prefix blocks,
a per-request call over the rest, and an LSE merge (vLLM's ``cascade_attention``)."""

from __future__ import annotations

import math

import flash_helpers as h
import pytest
import torch
from attnhub_flash import emulator
from attnhub_flash.backend import FlashAttentionMetadata, use_cascade

from attnhub.errors import InvalidInputError
from attnhub.kit import merge_attn_states

WRITE = "vllm._custom_ops.reshape_and_cache_flash"
#: three decodes and a chunked prefill over 2 shared blocks of 16 (32 keys) and their own
REQUESTS = [(1, 45), (1, 61), (1, 33), (5, 50)]
ATTENTION = {
    "vllm": "vllm.vllm_flash_attn.flash_attn_varlen_func",
    "vllm-fa3": "vllm.vllm_flash_attn.flash_attn_varlen_func",
    "vllm-flashmla": "vllm.vllm_flash_attn.flash_attn_varlen_func",
    "fa2": "flash_attn.flash_attn_varlen_func",
    "fa3": "flash_attn_interface.flash_attn_with_kvcache",
    "fa4": "flash_attn.cute.flash_attn_varlen_func",
}


def _requests(provider: str) -> list[tuple[int, int]]:
    if provider != "fa2":
        return REQUESTS
    return [(1, 600), (1, 530), (1, 513), (5, 700)]  # 256-key blocks


def _build(st: h.Step, prefix_blocks: int = 2) -> FlashAttentionMetadata:
    bs = st.backend.spec.block_size
    meta = st.backend.metadata_builder().build(st.batch, common_prefix_len=prefix_blocks * bs)
    assert isinstance(meta, FlashAttentionMetadata)
    return meta


def _forward(st: h.Step, meta: FlashAttentionMetadata) -> torch.Tensor:
    impl = st.backend.impl(sinks=st.sinks, alibi_slopes=st.alibi)
    return impl.forward(st.query, st.key, st.value, st.cache, meta)


@pytest.mark.parametrize("provider", h.PROVIDERS)
def test_a_shared_prefix_is_two_calls_merged_and_matches_the_reference(provider: str) -> None:
    st = h.step(_requests(provider), provider, padding=2, shared_prefix_blocks=2)
    meta = _build(st)
    assert meta.cascade
    with emulator.record_calls() as calls:
        out = _forward(st, meta)
    assert [c.name for c in calls if c.name != WRITE] == [ATTENTION[provider]] * 2
    h.assert_matches_reference(st, out)


def test_the_prefix_call_is_every_token_over_the_shared_blocks_non_causal() -> None:
    st = h.step(REQUESTS, shared_prefix_blocks=2)
    meta = _build(st)
    with emulator.record_calls() as calls:
        _forward(st, meta)
    prefix, suffix = (c.kwargs for c in calls if c.name == ATTENTION["vllm"])
    assert prefix["cu_seqlens_q"].tolist() == [0, 8] and prefix["max_seqlen_q"] == 8
    assert prefix["seqused_k"].tolist() == [32] and prefix["causal"] is False
    assert torch.equal(prefix["block_table"], st.batch.block_table[:1, :2])
    assert prefix["return_softmax_lse"] is True and prefix["out"] is None
    assert suffix["seqused_k"].tolist() == [13, 29, 1, 18] and suffix["causal"] is True
    assert torch.equal(suffix["block_table"], st.batch.block_table[:, 2:])
    assert suffix["max_seqlen_k"] == 29


def test_fa4_sinks_join_the_denominator_once_in_the_suffix_call() -> None:
    st = h.step(REQUESTS, "fa4", h.spec("fa4", use_sinks=True), shared_prefix_blocks=2)
    meta = _build(st)
    with emulator.record_calls() as calls:
        out = _forward(st, meta)
    prefix, suffix = (c.kwargs for c in calls)
    assert prefix["learnable_sink"] is None and suffix["learnable_sink"] is not None
    h.assert_matches_reference(st, out)


def test_a_prefix_shorter_than_a_block_is_one_call() -> None:
    st = h.step(REQUESTS, shared_prefix_blocks=2)
    meta = st.backend.metadata_builder().build(st.batch, common_prefix_len=15)
    assert not meta.cascade and meta.common_prefix_len == 15
    with emulator.record_calls() as calls:
        out = _forward(st, meta)
    assert len([c for c in calls if c.name == ATTENTION["vllm"]]) == 1
    h.assert_matches_reference(st, out)


def test_a_prefix_of_partial_blocks_runs_its_whole_blocks_as_the_prefix() -> None:
    st = h.step(REQUESTS, shared_prefix_blocks=2)
    meta = st.backend.metadata_builder().build(st.batch, common_prefix_len=31)
    assert meta.prefix is not None and meta.prefix.seq_lens.tolist() == [16]
    h.assert_matches_reference(st, _forward(st, meta))


@pytest.mark.parametrize("changes", [dict(sliding_window=8), dict(use_alibi=True)])
def test_windows_and_alibi_are_one_call_as_in_vllm(changes: dict[str, object]) -> None:
    st = h.step(REQUESTS, s=h.spec(**changes), shared_prefix_blocks=2)
    meta = _build(st)
    assert not meta.cascade
    h.assert_matches_reference(st, _forward(st, meta))


def test_the_never_policy_keeps_one_call() -> None:
    st = h.step(REQUESTS, shared_prefix_blocks=2)
    builder = st.backend.metadata_builder()
    assert builder.cascade_policy == "always"  # emulated: the cascade path is what runs
    builder.cascade_policy = "never"
    assert not builder.build(st.batch, common_prefix_len=32).cascade


def test_an_unknown_policy_is_refused_by_build() -> None:
    st = h.step(REQUESTS, shared_prefix_blocks=2)
    builder = st.backend.metadata_builder()
    builder.cascade_policy = "sometimes"  # type: ignore[assignment]
    with pytest.raises(InvalidInputError, match="'sometimes'"):
        builder.build(st.batch, common_prefix_len=32)


def test_a_prefix_whose_blocks_differ_between_requests_is_refused() -> None:
    st = h.step(REQUESTS, shared_prefix_blocks=1)
    with pytest.raises(InvalidInputError, match=r"block_table\[1, :2\]"):
        _build(st, prefix_blocks=2)


@pytest.mark.parametrize(
    ("prefix", "query_lens", "kv_heads", "want"),
    [
        (255, [5] * 16, 8, False),  # too short a prefix
        (1024, [5] * 7, 8, False),  # too few requests
        (1024, [5] * 16, 8, True),  # not FlashDecoding: cascade
        (1024, [1] * 16, 8, False),  # FlashDecoding with 4 q per kv head: more CTAs
        (4096, [1] * 512, 8, True),  # many decodes: the prefix pass is cheaper
    ],
)
def test_vllms_heuristic(prefix: int, query_lens: list[int], kv_heads: int, want: bool) -> None:
    got = use_cascade(
        prefix,
        torch.tensor(query_lens),
        32,
        kv_heads,
        use_alibi=False,
        use_sliding_window=False,
        num_sms=132,
    )
    assert got is want


def test_merging_weighs_by_lse_and_an_empty_part_drops_out() -> None:
    o1 = torch.full((3, 1, 2), 1.0)
    o2 = torch.full((3, 1, 2), 4.0)
    lse1 = torch.tensor([[math.log(3.0), math.inf, -math.inf]])  # [H=1, n=3]
    lse2 = torch.tensor([[math.log(1.0), 0.5, math.inf]])
    out, _ = merge_attn_states(o1, lse1, o2, lse2)  # the kit's, which the backend calls
    assert out[:, 0, 0].tolist() == [(3 * 1 + 1 * 4) / 4, 4.0, 0.0]
