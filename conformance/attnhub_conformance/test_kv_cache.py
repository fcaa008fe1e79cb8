"""The KV cache holds exactly what was written; every other slot is byte-identical.

The expectation is ``attnhub.reference.write_kv`` applied to a clone taken before the call.
Unquantized caches must match it byte for byte; quantized ones byte for byte outside the written
slots and within one quantization step inside them (rounding may legitimately differ).
"""

from __future__ import annotations

import pytest
import torch

from attnhub import testing
from attnhub_conformance import harness
from attnhub_conformance.cases import Case


@pytest.mark.attnhub_cases("kv_cache")
def test_writes_exactly_the_new_slots(case: Case) -> None:
    step = harness.prepare(case)
    layer = step.layers[0]
    slots = step.batch.slot_mapping  # real tokens, then -1 padding rows
    before = layer.cache.clone()
    if case.entry == "forward":
        step.forward(layer)
    elif case.entry == "write_kv_step":  # the step's own slots, as planned by the builder
        layer.impl.write_kv(layer.key, layer.value, layer.cache, meta=step.build())
    else:  # write_kv alone, with padding slots between real ones too
        slots = slots.clone()
        slots[torch.arange(0, step.n, 3, device=slots.device)] = -1
        layer.impl.write_kv(layer.key, layer.value, layer.cache, slots)
    expected = testing.cache_after_write(before, layer.key, layer.value, slots)
    problems = testing.cache_differences(layer.cache, expected, slots)
    assert not problems, f"{case.id}: {case.entry} left the cache wrong: " + "; ".join(problems)
