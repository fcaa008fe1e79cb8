"""The LSE through ``forward(..., return_lse=True)``, where a backend declares it
(``Capabilities.lse``): its value against the reference's (natural log), shape, dtype, padding
rows, and a merge of two halves of the keys equal to the whole; a typed refusal, the cache
untouched, where it does not."""

from __future__ import annotations

import pytest
import torch

from attnhub import BatchMetadata, reference, testing
from attnhub.errors import UnsupportedConfigurationError
from attnhub.kit import merge_attn_states
from attnhub_conformance import harness
from attnhub_conformance.cases import Case


def reference_lse(step: harness.Step, layer: harness.Layer, batch: BatchMetadata) -> torch.Tensor:
    """The reference's LSE ``[n, H]`` (float64, natural log) over the cache as stored, for the
    query as the backend's kernels use it."""
    caps, kv = step.backend.capabilities, step.spec.kv_cache_dtype
    query = testing.quantized_query(layer.query[: batch.num_actual_tokens], caps, kv)
    _, lse = reference.paged_attention(
        query, layer.cache, batch, step.spec, alibi_slopes=layer.alibi_slopes, sinks=layer.sinks
    )
    return lse.t()


def assert_lse_shape(step: harness.Step, lse: torch.Tensor, num_tokens: int) -> None:
    want = (num_tokens, step.spec.num_heads)
    assert isinstance(lse, torch.Tensor) and tuple(lse.shape) == want, (
        f"{step.label}: the LSE must be [num_tokens, num_heads] = {list(want)}, got "
        f"{getattr(lse, 'shape', type(lse).__name__)}"
    )
    assert lse.dtype == torch.float32, f"{step.label}: the LSE must be float32, got {lse.dtype}"
    assert lse.device.type == step.device.type, (
        f"{step.label}: the LSE is on {lse.device}, the layer on {step.device}"
    )


def assert_lse_matches(
    step: harness.Step, lse: torch.Tensor, want: torch.Tensor, what: str
) -> None:
    tol = harness.tolerance(step)
    why = testing.mismatch(lse.detach().to("cpu"), want, tol)
    assert why is None, (
        f"{step.label}: {what} differs from attnhub.reference's (the natural log of the softmax "
        f"denominator, a sink's term included; declared tolerance atol={tol.atol:g} "
        f"rtol={tol.rtol:g}): {why}"
    )


@pytest.mark.attnhub_cases("lse")
def test_lse(case: Case) -> None:
    step = harness.prepare(case)
    layer = step.layers[0]
    meta = step.build()
    key, value = (layer.key, layer.value) if step.plan.new_kv else (None, None)
    if case.entry == "refused":
        before = layer.cache.clone()
        with pytest.raises(UnsupportedConfigurationError):
            layer.impl.forward(layer.query, key, value, layer.cache, meta, return_lse=True)
        assert layer.cache.equal(before), (
            f"{step.label}: a refused return_lse=True changed the KV cache"
        )
        return
    out, lse = layer.impl.forward(layer.query, key, value, layer.cache, meta, return_lse=True)
    harness.assert_matches_reference(step, layer, out, "forward with return_lse=True")
    assert_lse_shape(step, lse, layer.query.shape[0])
    n = step.n
    assert_lse_matches(step, lse[:n], reference_lse(step, layer, step.batch), "the LSE")
    pad = lse[n:].detach().to("cpu")
    assert bool(torch.isposinf(pad).all()), (
        f"{step.label}: the LSE's padding rows {n}..{lse.shape[0] - 1} must be +inf, got "
        f"{pad.flatten()[:8].tolist()}"
    )
    if case.entry == "merge":
        merged, merged_lse = _merge_of_halves(step, layer)
        assert_lse_matches(
            step, merged_lse, reference_lse(step, layer, step.batch), "the merged LSE"
        )
        tol = harness.tolerance(step)
        why = testing.mismatch(merged.to("cpu"), harness.reference_output(step, layer), tol)
        assert why is None, (
            f"{step.label}: the merge of two halves' (out, LSE) differs from attention over "
            f"the whole (attnhub.reference; declared tolerance atol={tol.atol:g} "
            f"rtol={tol.rtol:g}): {why}"
        )


def _halves(step: harness.Step) -> tuple[BatchMetadata, BatchMetadata]:
    """Each request's keys split at a block boundary no later than its first query token: the
    first blocks (before every query token: seen whole, a non-causal step where the request
    has several query tokens), and the rest (its block table shifted; causal as the step,
    bottom-right aligned, so each query token sees the same keys as in the whole)."""
    bs, table = step.spec.block_size, step.block_table
    firsts, rests, rows = [], [], []
    for r, (q, seq) in enumerate(step.plan.requests):
        context = seq - q
        split = bs * max(1, (context // bs) // 2 if q == 1 else context // bs)
        firsts.append(split)
        rests.append(seq - split)
        rows.append(table[r, split // bs :])
    width = max(len(row) for row in rows)
    shifted = torch.zeros(len(rows), width, dtype=table.dtype)
    for r, row in enumerate(rows):
        shifted[r, : len(row)] = row
    q_lens = [q for q, _ in step.plan.requests]
    several = any(q > 1 for q in q_lens)
    make = BatchMetadata.from_lengths
    return (
        make(q_lens, firsts, table, bs, step.device, causal=step.spec.causal and not several),
        make(q_lens, rests, shifted, bs, step.device, causal=step.spec.causal),
    )


def _merge_of_halves(
    step: harness.Step, layer: harness.Layer
) -> tuple[torch.Tensor, torch.Tensor]:  # [n, H, D] float32, [n, H] float32
    n = step.n
    parts = []
    for batch in _halves(step):
        try:
            meta = step.builder.build(batch)
        except UnsupportedConfigurationError as exc:  # a refusal the backend may make
            pytest.skip(f"{step.label}: the backend refuses a part of the split step: {exc}")
        out, lse = layer.impl.forward(
            layer.query[:n], None, None, layer.cache, meta, return_lse=True
        )
        parts.append((out.float(), lse))
    (a, a_lse), (b, b_lse) = parts
    merged, merged_lse = merge_attn_states(a, a_lse.t(), b, b_lse.t())
    return merged, merged_lse.t()
