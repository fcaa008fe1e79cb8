"""Inputs as engines pass them: q, k and v as views of one fused QKV projection (strided rows,
dense channels), the output a strided view of a larger buffer. A backend computes the same
answer through them (compacting what its kernels need dense itself) or refuses them with a
typed error, the cache untouched; it never writes outside the output view, nor into its
inputs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from attnhub import testing
from attnhub.errors import AttnhubError
from attnhub_conformance import harness, stress
from attnhub_conformance.cases import Case


@pytest.mark.attnhub_cases("noncontiguous")
def test_fused_qkv_views_and_strided_output(
    case: Case, attnhub_record: Callable[[str], None]
) -> None:
    step = harness.prepare(case)
    layer = step.layers[0]
    qkv, q, k, v = stress.fused_qkv(layer)
    assert not q.is_contiguous() and q.stride(-1) == 1  # what the case is about
    fused_before = qkv.clone()
    buffer, out_view = stress.strided_output(layer.query)
    cache_before = layer.cache.clone()
    key, value = (k, v) if step.plan.new_kv else (None, None)
    meta = step.build()
    try:
        returned = layer.impl.forward(q, key, value, layer.cache, meta, output=out_view)
    except AttnhubError as exc:
        nothing = cache_before.key.new_empty(0).long()
        diff = testing.cache_differences(layer.cache, cache_before, nothing)
        assert not diff, f"{case.id}: refused ({exc}) after changing the KV cache: {diff}"
        assert str(exc).strip(), f"{case.id}: refused with an empty reason"
        attnhub_record("not supported")
        return
    assert returned.data_ptr() == out_view.data_ptr() and returned.stride() == out_view.stride(), (
        f"{case.id}: forward(..., output=view) returned another tensor than the strided view"
    )
    assert torch.equal(qkv.view(torch.uint8), fused_before.view(torch.uint8)), (
        f"{case.id}: forward wrote into its fused QKV input"
    )
    _, h, d = layer.query.shape
    outside = torch.cat([buffer[:, : h * d + 3], buffer[:, 2 * h * d + 3 :]], dim=1)
    assert bool(outside.isnan().all()), (
        f"{case.id}: forward wrote outside the strided output view (into the rest of the "
        "larger buffer it is a view of)"
    )
    if step.plan.new_kv:  # the reference reads the cache: it must hold the keys given
        slots = step.batch.slot_mapping
        expected = testing.cache_after_write(cache_before, layer.key, layer.value, slots)
        problems = testing.cache_differences(layer.cache, expected, slots)
        assert not problems, (
            f"{case.id}: forward through fused-QKV views left the cache wrong: "
            + "; ".join(problems)
        )
    harness.assert_matches_reference(step, layer, out_view, "forward(fused QKV views, output=view)")
