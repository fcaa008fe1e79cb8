"""Extreme logits, per dtype: every score shifted by ~1e4, rows whose logits are all equal,
logits at the softcap limit, ALiBi biases near -1000. The math has no NaN or inf in any of them;
the output must not either, and must match the reference within its bounds."""

from __future__ import annotations

import pytest
import torch

from attnhub_conformance import harness, stress
from attnhub_conformance.cases import Case


@pytest.mark.attnhub_cases("extreme_logits")
def test_extreme_logits_match_reference(case: Case) -> None:
    step = harness.prepare(case)
    layer = step.layers[0]
    if case.entry == "large_scores":
        stress.shift_scores(step, layer, stress.SCORE_SHIFT)
    elif case.entry == "equal_logits":
        with torch.no_grad():
            layer.query[::2] = 0  # every other token: all its logits are 0
    elif case.entry == "softcap_limit":
        with torch.no_grad():
            layer.query.mul_(stress.softcap_gain(step, layer))
    out = step.forward(layer)
    allowance = None  # over the cache as forward left it (the new keys written)
    if case.entry == "large_scores":
        allowance = stress.score_rounding_allowance(step, layer)
    stress.assert_extreme_matches(step, layer, out, allowance)
