"""``forward(..., return_lse=True)`` on every provider: the LSE from the attention call itself
(no second call), in attnhub's ``[tokens, heads]`` natural log with +inf padding rows, on the
varlen, decode-only and cascade paths; each provider's empty-row infinity made attnhub's."""

from __future__ import annotations

import math

import flash_helpers as h
import pytest
import torch
from attnhub_flash import emulator, providers

from attnhub import reference, testing

WRITES = ("vllm._custom_ops.reshape_and_cache_flash",)
MIXED = [(1, 37), (1, 20), (6, 40), (3, 3)]  # decodes, a chunked prefill, a prefill


def _requests(provider: str, requests: list[tuple[int, int]]) -> list[tuple[int, int]]:
    if provider != "fa2":
        return requests
    return [(q, s + 512) for q, s in requests]  # FA2's 256-key blocks: several per request


def _spec(provider: str, **changes: object):  # type: ignore[no-untyped-def]
    sinks = provider in ("vllm-fa3", "fa4")  # the providers that take sinks
    return h.spec(provider, use_sinks=sinks, **changes)


def _run(st: h.Step, common_prefix_len: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    meta = st.backend.metadata_builder().build(st.batch, common_prefix_len=common_prefix_len)
    impl = st.backend.impl(sinks=st.sinks, alibi_slopes=st.alibi)
    with emulator.record_calls() as calls:
        out, lse = impl.forward(st.query, st.key, st.value, st.cache, meta, return_lse=True)
    return out, lse, [c.name for c in calls if c.name not in WRITES]


def _assert_lse(st: h.Step, out: torch.Tensor, lse: torch.Tensor) -> None:
    n = st.batch.num_actual_tokens
    h.assert_matches_reference(st, out)
    _, want = reference.paged_attention(
        st.query[:n], st.cache, st.batch, st.backend.spec, sinks=st.sinks, alibi_slopes=st.alibi
    )
    assert lse.shape == (st.query.shape[0], st.backend.spec.num_heads)
    assert lse.dtype == torch.float32
    tol = st.backend.capabilities.tolerance(st.backend.spec.dtype)
    why = testing.mismatch(lse[:n], want.t(), tol)
    assert why is None, f"{st.backend.provider}: {why}"
    assert bool(torch.isposinf(lse[n:]).all()), lse[n:]


@pytest.mark.parametrize("provider", h.PROVIDERS)
def test_a_mixed_step_returns_the_reference_lse_from_its_one_call(provider: str) -> None:
    st = h.step(_requests(provider, MIXED), provider, _spec(provider), padding=2)
    out, lse, calls = _run(st)
    assert len(calls) == 1, calls
    _assert_lse(st, out, lse)


@pytest.mark.parametrize("provider", h.PROVIDERS)
def test_a_decode_only_step_keeps_its_kernel_and_returns_its_lse(provider: str) -> None:
    """FA2 and FA3 decode through their padded-batch call (q (B, 1, H, D)) with or without
    the LSE: its (batch, heads, 1) LSE is transposed into attnhub's rows."""
    st = h.step(_requests(provider, [(1, 37), (1, 20), (1, 5)]), provider, _spec(provider))
    meta = st.backend.metadata_builder().build(st.batch)
    impl = st.backend.impl(sinks=st.sinks)
    with emulator.record_calls() as plain:
        impl.forward(st.query, st.key, st.value, st.cache, meta)
    out, lse, calls = _run(st)
    assert calls == [c.name for c in plain if c.name not in WRITES]
    assert len(calls) == 1
    _assert_lse(st, out, lse)


@pytest.mark.parametrize("provider", h.PROVIDERS)
def test_a_cascade_returns_the_merged_lse_with_the_sink_counted_once(provider: str) -> None:
    requests = [(1, 45), (1, 61), (1, 33), (5, 50)]
    if provider == "fa2":
        requests = [(1, 600), (1, 530), (1, 513), (5, 700)]
    st = h.step(requests, provider, _spec(provider), padding=1, shared_prefix_blocks=2)
    out, lse, calls = _run(st, common_prefix_len=2 * st.backend.spec.block_size)
    assert len(calls) == 2, calls  # the prefix and the suffix, as without the LSE
    _assert_lse(st, out, lse)


@pytest.mark.parametrize("provider", h.PROVIDERS)
def test_an_empty_row_is_plus_inf_or_the_sink_alone_whatever_the_kernel_gives(
    provider: str,
) -> None:
    """FA2 writes +inf for a row that sees no key, FA3 and FA4 -inf (with a sink, the fork's
    FA3 gives the sink alone only inside a sequence that has keys): attnhub's row is +inf
    without a sink and the sink with one (the reference's ``log exp(sink)``)."""
    kernels = providers.PROVIDERS[provider]
    empty = kernels.empty_lse
    kernel_lse = torch.tensor([[0.5, empty], [1.5, empty]])  # [H=2, n=2]: token 1 empty
    rows = torch.empty(2, 2)
    kernels.store_lse(rows, kernel_lse, None)
    assert rows.tolist() == [[0.5, 1.5], [math.inf, math.inf]]
    if empty == math.inf:
        return  # FA2 takes no sinks
    sinks = torch.tensor([-0.25, 2.0], dtype=torch.bfloat16)
    kernels.store_lse(rows, kernel_lse, sinks)
    assert rows.tolist() == [[0.5, 1.5], [-0.25, 2.0]]


@pytest.mark.parametrize("provider", ["vllm", "fa2"])
@pytest.mark.parametrize("sliding_window", [None, 8, 1000])
@pytest.mark.parametrize("requests", [MIXED, [(1, 37), (1, 20), (1, 5)]], ids=["mixed", "decodes"])
def test_an_alibi_layer_returns_the_reference_lse_where_fa2_biases_its_own(
    provider: str, sliding_window: int | None, requests: list[tuple[int, int]]
) -> None:
    """FA2's kernels (the fork's fa_version=2, upstream FA2) bias ALiBi scores by ``+slope * j``
    on their causal branch, their LSE higher by ``slope`` times the query's position
    [source: csrc/flash_attn/src/mask.h]: attnhub's LSE is the reference's on that branch (no
    window, or one at or past the call's ``seqlen_k``) and on the local one (a window that
    cuts), varlen and decode-only calls alike."""
    spec = _spec(provider, use_alibi=True, sliding_window=sliding_window)
    st = h.step(_requests(provider, requests), provider, spec, padding=2)
    out, lse, calls = _run(st)
    assert len(calls) == 1, calls
    _assert_lse(st, out, lse)
