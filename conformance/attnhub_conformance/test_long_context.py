"""Long cached contexts: past each backend's split threshold (quick scope), over 32k keys in
every dtype and near 128k keys (full scope), with needle keys early, past 16k keys and at the
end; the reference computed in chunks."""

from __future__ import annotations

import pytest

from attnhub_conformance import harness, stress
from attnhub_conformance.cases import Case


@pytest.mark.attnhub_cases("long_context")
def test_long_context_matches_reference(case: Case) -> None:
    step = harness.prepare(case)
    layer = step.layers[0]
    stress.plant_needles(step, layer)
    out = step.forward(layer)
    stress.assert_long_matches(step, layer, out)
