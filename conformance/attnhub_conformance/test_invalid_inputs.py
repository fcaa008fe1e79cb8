"""Invalid input raises a typed attnhub error and leaves the KV cache byte-identical."""

from __future__ import annotations

import pytest

from attnhub import testing
from attnhub_conformance import harness
from attnhub_conformance.cases import Case
from attnhub_conformance.catalogue import CATALOGUE


@pytest.mark.attnhub_cases("invalid_inputs")
def test_rejects_invalid_input(case: Case) -> None:
    assert case.entry is not None
    entry = CATALOGUE[case.entry]
    step = harness.prepare(case)
    layer = step.layers[0]
    before = layer.cache.clone()
    raised: BaseException | None = None
    try:
        entry.provoke(step, layer)
    except Exception as exc:
        raised = exc
    problems = []
    if raised is None:
        problems.append(f"no error was raised (expected {entry.error.__name__})")
    elif not isinstance(raised, entry.error):
        problems.append(
            f"raised {type(raised).__name__}({raised}), expected attnhub.errors."
            f"{entry.error.__name__}"
        )
    elif not str(raised).strip():
        problems.append(f"{type(raised).__name__} was raised without a message")
    if not layer.cache.equal(before):
        diff = testing.cache_differences(layer.cache, before, before.key.new_empty(0).long())
        problems.append("the KV cache changed: " + "; ".join(diff or ["bytes differ"]))
    assert not problems, f"{case.id}: {entry.proves}: " + "; ".join(problems)
