"""The KV cache holds exactly what was written; every other slot is byte-identical.

The expectation is ``attnhub.reference.write_kv`` applied to a clone taken before the call.
Unquantized caches must match it byte for byte; quantized ones byte for byte outside the written
slots and within one quantization step inside them (rounding may legitimately differ).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from attnhub import BatchMetadata, PagedKVCache, testing
from attnhub.errors import InvalidInputError
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
    elif case.entry == "forward_strided_slots":  # a view of every other entry of a buffer
        strided_batch = dataclasses.replace(step.batch, **strided_slots(step.batch))
        step.forward(layer, meta=step.build(strided_batch))
    elif case.entry == "write_kv_strided_slots":
        slots = strided_slots(step.batch)["slot_mapping"][: step.n]
        layer.impl.write_kv(layer.key, layer.value, layer.cache, slots)
    else:  # write_kv alone, with padding slots between real ones too
        slots = slots.clone()
        slots[torch.arange(0, step.n, 3, device=slots.device)] = -1
        layer.impl.write_kv(layer.key, layer.value, layer.cache, slots)
    expected = testing.cache_after_write(before, layer.key, layer.value, slots)
    problems = testing.cache_differences(layer.cache, expected, slots)
    assert not problems, f"{case.id}: {case.entry} left the cache wrong: " + "; ".join(problems)


def strided_slots(batch: BatchMetadata) -> dict[str, Any]:
    """The batch's slot mapping (and its host copy, where it has one) as views of every other
    entry of a buffer twice as long, whose other entries are slots the step must not write."""
    out = {}
    for name in ("slot_mapping", "slot_mapping_cpu"):
        t = getattr(batch, name)
        if t is None:
            continue
        buf = torch.zeros(2 * t.shape[0], dtype=t.dtype, device=t.device)
        buf[0::2] = t
        buf[1::2] = torch.where(t >= 0, (t + 1) % max(int(t.max()) + 1, 1), t)  # wrong slots
        out[name] = buf[0::2]
        assert not out[name].is_contiguous() or t.shape[0] < 2
    return out


def strided_copy(cache: PagedKVCache) -> PagedKVCache:
    """The same cache with K/V planes that are strided views: one tensor holding each slot's
    key and value side by side in the last dim (how vLLM allocates a layer's cache); planes of
    different dtypes get a buffer of both widths each. Values of another head size than keys
    (``head_size_v``) take the last ``head_size_v`` channels of the slot (vLLM's
    ``[..., head_size + head_size_v]``). Scale planes are shared. A cache whose blocks are
    packed is copied as its logical K/V (strided views of packed storage would be neither)."""
    cache = cache.unpacked()
    d, dv = cache.key.shape[-1], cache.value.shape[-1]
    if cache.key.dtype == cache.value.dtype:
        both = torch.empty((*cache.key.shape[:-1], d + dv), dtype=cache.key.dtype)
        both = both.to(cache.key.device)
        key, value = both[..., :d], both[..., d:]
    else:
        key = torch.empty((*cache.key.shape[:-1], d + dv), dtype=cache.key.dtype)[..., :d]
        value = torch.empty((*cache.value.shape[:-1], d + dv), dtype=cache.value.dtype)[..., :dv]
        key, value = key.to(cache.key.device), value.to(cache.value.device)
    for dst, src in ((key, cache.key), (value, cache.value)):
        copyable(dst).copy_(copyable(src))
    assert not key.is_contiguous()
    return dataclasses.replace(cache, key=key, value=value)


def copyable(t: torch.Tensor) -> torch.Tensor:
    """A view ``copy_`` accepts for every storage dtype (fp8 copied as its bytes)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.attnhub_cases("strided_cache")
def test_strided_kv_planes_work_where_declared_and_are_refused_elsewhere(case: Case) -> None:
    step = harness.prepare(case)
    layer = step.layers[0]
    layer.cache = strided_copy(layer.cache)
    if case.entry == "views":
        before = layer.cache.clone()
        out = step.forward(layer)
        harness.assert_matches_reference(step, layer, out, "forward over strided K/V planes")
        if step.plan.new_kv:
            slots = step.batch.slot_mapping
            expected = testing.cache_after_write(before, layer.key, layer.value, slots)
            problems = testing.cache_differences(layer.cache, expected, slots)
            assert not problems, f"{case.id}: the write through strided planes: " + "; ".join(
                problems
            )
        return
    before = layer.cache.clone()
    with pytest.raises(InvalidInputError) as info:
        step.forward(layer)
    assert "contiguous" in str(info.value), f"{case.id}: {info.value}"
    assert layer.cache.equal(before), f"{case.id}: the refused call changed the cache"
