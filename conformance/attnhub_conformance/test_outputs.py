"""forward computes what attnhub.reference computes, for every declared configuration; over a
quantized cache, also close to attention over the unquantized inputs, as declared."""

from __future__ import annotations

import pytest

from attnhub_conformance import harness
from attnhub_conformance.cases import Case


@pytest.mark.attnhub_cases("outputs")
def test_matches_reference(case: Case) -> None:
    step = harness.prepare(case)
    layer = step.layers[0]
    out = step.forward(layer)
    harness.assert_matches_reference(step, layer, out)


@pytest.mark.attnhub_cases("output_buffer")
def test_output_buffer_is_filled_and_returned(case: Case) -> None:
    step = harness.prepare(case)
    layer = step.layers[0]
    buf = layer.query.new_full(harness.output_shape(step, layer), float("nan"))
    out = step.forward(layer, output=buf)
    assert out.data_ptr() == buf.data_ptr() and out.shape == buf.shape, (
        f"{case.id}: forward(..., output=buf) returned a different tensor than buf"
    )
    harness.assert_matches_reference(step, layer, buf, "forward(..., output=buf)")


@pytest.mark.attnhub_cases("quantization_accuracy")
def test_quantized_cache_accuracy(case: Case) -> None:
    step = harness.prepare(case)
    layer = step.layers[0]
    out = step.forward(layer)
    harness.assert_matches_reference(step, layer, out)  # same inputs, tight tolerance
    harness.assert_accurate(step, layer, out)  # unquantized inputs, declared bound
