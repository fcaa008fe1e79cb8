"""What a backend does not declare, it refuses with a reason: never a wrong answer."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import attnhub
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub_conformance import harness
from attnhub_conformance.cases import Case


def _assert_reasons(case: Case, reasons: object, where: str) -> None:
    assert isinstance(reasons, list) and reasons, (
        f"{case.id}: {where} gave no reasons ({reasons!r})"
    )
    assert all(isinstance(r, str) and r.strip() for r in reasons), (
        f"{case.id}: {where} reasons must be sentences, got {reasons!r}"
    )


@pytest.mark.attnhub_cases("refusals")
def test_undeclared_capability_is_refused(
    case: Case, attnhub_record: Callable[[str], None]
) -> None:
    target = case.target
    assert case.config is not None
    if case.entry is None:  # a spec-level capability: refused before anything is built
        spec = case.config.spec()
        _assert_reasons(case, target.refusal(spec), "unsupported_reasons(spec)")
        with pytest.raises(UnsupportedConfigurationError) as refused:
            target.create(spec)
        _assert_reasons(case, refused.value.reasons, "the constructor's error")
        with pytest.raises(UnsupportedConfigurationError):
            attnhub.select_backend(spec, target.device, prefer=target.name, emulate=target.emulate)
        return
    step = harness.prepare(case)
    builder = step.builder
    if case.entry == "cascade":
        with pytest.raises(UnsupportedConfigurationError) as refused:
            builder.build(step.batch, common_prefix_len=step.common_prefix_len)
        _assert_reasons(case, refused.value.reasons, "build(common_prefix_len=...)")
    elif case.entry == "graph_capture":
        with pytest.raises(UnsupportedConfigurationError) as refused:
            builder.build_for_graph_capture(step.batch)
        _assert_reasons(case, refused.value.reasons, "build_for_graph_capture")
    else:  # an undeclared batch kind: refused with a reason, or computed correctly
        layer = step.layers[0]
        before = layer.cache.clone()
        try:
            out = step.forward(layer)
        except (UnsupportedConfigurationError, InvalidInputError) as exc:
            assert str(exc).strip(), f"{case.id}: refused without a reason"
            assert layer.cache.equal(before), f"{case.id}: the refusal changed the KV cache"
            attnhub_record("not supported")
            return
        harness.assert_matches_reference(step, layer, out, f"undeclared {case.entry} batch")
