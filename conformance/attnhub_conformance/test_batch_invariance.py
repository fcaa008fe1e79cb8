"""Bitwise batch invariance where declared (``Capabilities.batch_invariant``), the same
placements within tolerance elsewhere, and determinism through fresh objects
(``attnhub_conformance.batch_invariance`` makes the cases)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import attnhub
from attnhub import testing
from attnhub.errors import UnsupportedConfigurationError
from attnhub_conformance import harness
from attnhub_conformance.batch_invariance import (
    describe,
    engine_ordered,
    placement_batch,
    probe_rows,
    step_index,
    universe,
)
from attnhub_conformance.cases import Case


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _refused(case: Case) -> None:
    assert case.config is not None
    spec = case.config.spec()
    target = case.target
    reasons = target.refusal(spec)
    assert any("batch_invariant" in r for r in reasons), (
        f"{case.id}: unsupported_reasons(spec) of a spec asking for batch invariance names no "
        f"batch_invariant reason: {reasons!r}"
    )
    with pytest.raises(UnsupportedConfigurationError) as refused:
        target.create(spec)
    assert any("batch_invariant" in r for r in refused.value.reasons), (
        f"{case.id}: the constructor's refusal does not say why: {refused.value.reasons!r}"
    )
    with pytest.raises(UnsupportedConfigurationError):
        attnhub.select_backend(spec, target.device, prefer=target.name, emulate=target.emulate)


@pytest.mark.attnhub_cases("placements")
def test_a_request_gives_the_same_output_wherever_it_sits(
    case: Case, attnhub_record: Callable[[str], None]
) -> None:
    """Each probe request alone, first, last, among its own query length, among decodes,
    prefills and chunked prefills, and in a crowd: bit for bit where the backend declares
    batch invariance for the spec, within its tolerance elsewhere."""
    if case.entry == "refused":
        _refused(case)
        attnhub_record("not supported")
        return
    assert case.config is not None
    step = harness.prepare(case)
    layer = step.layers[0]
    caps = step.backend.capabilities
    world = universe(step.spec.block_size, caps.multi_token_decode, caps.chunked_prefill)
    index = step_index(step, world.plan)
    start = layer.cache.clone()
    new_kv = step.plan.new_kv
    bitwise = case.entry == "bitwise"
    # where the LSE is declared too, a bitwise backend's LSE (and the output of a call that
    # asks for it, which may take another path) must not move either
    with_lse = bitwise and caps.lse.refusal(step.spec) is None
    tol = harness.tolerance(step)
    alone: dict[tuple[int, str], torch.Tensor] = {}
    for placement in world.placements:
        probe = index[placement.probe]
        order = engine_ordered(step, [index[r] for r in placement.requests])
        batch, q, k, v = placement_batch(step, layer, order)
        meta = step.builder.build(batch)
        key, value = (k, v) if new_kv else (None, None)
        at = probe_rows(step, order, probe)
        got = {"output": layer.impl.forward(q, key, value, start.clone(), meta)[at]}
        if with_lse:
            out, lse = layer.impl.forward(q, key, value, start.clone(), meta, return_lse=True)
            got |= {"output (return_lse=True)": out[at], "LSE": lse[at]}
        for what, rows in got.items():
            rows = rows.detach().to("cpu")
            if placement.name == "alone":
                alone[probe, what] = rows.clone()
                continue
            want = alone[probe, what]
            where = (
                f"{case.id}: the {world.probes[placement.probe].name} "
                f"{describe(step, order, probe)}, {placement.name}"
            )
            if bitwise:
                if not torch.equal(_bits(rows), _bits(want)):
                    differ = int((rows != want).sum())
                    worst = float((rows.double() - want.double()).abs().max())
                    raise AssertionError(
                        f"{where}, differs from the same request alone in {differ} of "
                        f"{rows.numel()} elements of its {what} (largest difference "
                        f"{worst:.3g}); the backend declares bitwise batch invariance for this "
                        "spec (Capabilities.batch_invariant)"
                    )
            else:
                why = testing.mismatch(rows, want.to(torch.float64), tol)
                assert why is None, f"{where}, differs from the same request alone: {why}"


@pytest.mark.attnhub_cases("determinism_again")
def test_the_same_step_gives_the_same_bits_again(case: Case) -> None:
    """The step, then steps of other shapes through the same builder and impl (scratch
    buffers grown, a planner's caches filled), then the step again, then the step through a
    fresh backend instance, builder and impl (same per-layer weights): the same output bits
    and the same cache bytes every time."""
    step = harness.prepare(case)
    layer = step.layers[0]
    start = layer.cache.clone()
    new_kv = step.plan.new_kv
    key, value = (layer.key, layer.value) if new_kv else (None, None)
    first_cache = start.clone()
    first = step.forward(layer, cache=first_cache).clone()
    num_reqs = step.batch.num_reqs
    for order in ([num_reqs - 1], list(range(num_reqs))[::2] or [0]):  # other shapes between
        batch, q, k, v, _ = harness.sub_batch(step, layer, engine_ordered(step, order))
        meta = step.builder.build(batch)
        layer.impl.forward(q, k if new_kv else None, v if new_kv else None, start.clone(), meta)
    again_cache = start.clone()
    again = step.forward(layer, cache=again_cache)
    assert torch.equal(_bits(again), _bits(first)), (
        f"{case.id}: the step run again after steps of other shapes through the same builder "
        f"and impl differs in {int((again != first).sum())} output elements"
    )
    assert again_cache.equal(first_cache), f"{case.id}: the same write left different caches"
    backend = step.target.create(step.spec)
    impl = backend.impl(alibi_slopes=layer.alibi_slopes, sinks=layer.sinks)
    fresh_cache = start.clone()
    meta = backend.metadata_builder().build(step.batch, common_prefix_len=step.common_prefix_len)
    fresh = impl.forward(layer.query, key, value, fresh_cache, meta)
    assert torch.equal(_bits(fresh), _bits(first)), (
        f"{case.id}: the step through a fresh backend instance, builder and impl differs in "
        f"{int((fresh != first).sum())} output elements"
    )
    assert fresh_cache.equal(first_cache), (
        f"{case.id}: the same write through a fresh backend instance left a different cache"
    )
