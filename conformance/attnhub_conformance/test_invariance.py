"""Results depend on the inputs only: not on the run, not on the neighbours in the batch, not
on how many layers already used the step's metadata."""

from __future__ import annotations

import dataclasses
import enum
import threading
from typing import Any

import numpy as np
import pytest
import torch

from attnhub import PagedKVCache, testing
from attnhub.backend import is_scratch
from attnhub_conformance import harness
from attnhub_conformance.cases import Case


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.attnhub_cases("determinism")
def test_same_inputs_give_the_same_bits(case: Case) -> None:
    step = harness.prepare(case)
    layer = step.layers[0]
    start = layer.cache.clone()
    first = step.forward(layer, cache=start.clone())
    second_cache = start.clone()
    second = step.forward(layer, cache=second_cache)
    assert torch.equal(_bits(first), _bits(second)), (
        f"{case.id}: two forwards of the same inputs differ in "
        f"{int((first != second).sum())} output elements"
    )
    third_cache = start.clone()
    step.forward(layer, cache=third_cache)
    assert second_cache.equal(third_cache), f"{case.id}: the same write left different caches"


@pytest.mark.attnhub_cases("batch_invariance")
def test_output_does_not_depend_on_neighbours(case: Case) -> None:
    step = harness.prepare(case)
    layer = step.layers[0]
    start = layer.cache.clone()
    full = step.forward(layer, cache=start.clone())[: step.n]
    tol = harness.tolerance(step)
    num_reqs = step.batch.num_reqs
    threshold = step.builder.reorder_batch_threshold
    reversed_order = list(reversed(range(num_reqs)))
    if threshold is not None:
        reversed_order = sorted(reversed_order, key=lambda r: step.plan.requests[r][0] > threshold)
    orders = {"reversed": reversed_order}
    orders |= {f"alone (request {r})": [r] for r in range(num_reqs)}
    for what, order in orders.items():
        batch, q, k, v, rows = harness.sub_batch(step, layer, order)
        meta = step.builder.build(batch)
        cache = start.clone()
        new_kv = step.plan.new_kv
        out = layer.impl.forward(q, k if new_kv else None, v if new_kv else None, cache, meta)
        why = testing.mismatch(out, full[rows.to(full.device)].to("cpu", torch.float64), tol, batch)
        assert why is None, (
            f"{case.id}: requests {order} {what} differ from the same requests in the full "
            f"batch: {why}"
        )


@pytest.mark.attnhub_cases("metadata_reuse")
def test_metadata_built_once_serves_every_layer(case: Case) -> None:
    step = harness.prepare(case)
    for _ in range(2):
        step.add_layer()
    meta = step.build()
    outs = []
    for i, layer in enumerate(step.layers):
        out = step.forward(layer, meta)
        harness.assert_matches_reference(step, layer, out, f"layer {i} (shared metadata)")
        outs.append(out.clone())
    again = step.forward(step.layers[0], meta)
    assert torch.equal(_bits(again), _bits(outs[0])), (
        f"{case.id}: layer 0 run again with the same metadata after the other layers gives "
        "different bits: forward changed the metadata"
    )


@pytest.mark.attnhub_cases("threads")
def test_two_threads_through_one_builder_and_impl_compute_what_one_thread_does(
    case: Case,
) -> None:
    """Thread 0 runs the step, thread 1 its first request alone (another shape to plan), each
    into a cache of its own, several times, through the step's one builder and one impl: as
    an engine serving two models through one backend would. Every output and cache must have
    the bits the same calls give in one thread."""
    step = harness.prepare(case)
    layer = step.layers[0]
    start = layer.cache.clone()
    new_kv = step.plan.new_kv
    alone = harness.sub_batch(step, layer, [0])
    work = [
        (step.batch, layer.query, layer.key, layer.value),
        (alone[0], alone[1], alone[2], alone[3]),
    ]

    def run(i: int) -> list[tuple[torch.Tensor, PagedKVCache]]:
        batch, q, k, v = work[i]
        results: list[tuple[torch.Tensor, PagedKVCache]] = []
        for _ in range(4):
            cache = start.clone()
            meta = step.builder.build(batch, common_prefix_len=0)
            out = layer.impl.forward(q, k if new_kv else None, v if new_kv else None, cache, meta)
            results.append((_bits(out).clone(), cache))
        return results

    expected = [run(0), run(1)]
    got: list[list[tuple[torch.Tensor, PagedKVCache]]] = [[], []]
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def thread(i: int) -> None:
        try:
            barrier.wait(timeout=60)
            got[i] = run(i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=thread, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, f"{case.id}: a thread raised {errors[0]!r}"
    for i, (mine, want) in enumerate(zip(got, expected, strict=True)):
        for (out, cache), (want_out, want_cache) in zip(mine, want, strict=True):
            assert torch.equal(out, want_out), f"{case.id}: thread {i}'s output differs"
            assert cache.equal(want_cache), f"{case.id}: thread {i}'s cache differs"


# --- the plan is complete when build returns ------------------------------------------------
_PLAIN = (int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum, type)


@dataclasses.dataclass(frozen=True)
class _Held:
    """What one value of a metadata held when ``build`` returned: the object itself (to compare
    identity), and its content (tensors: their bytes; containers and dataclasses: what each
    element held; anything else: identity alone)."""

    obj: Any
    content: Any = None
    attrs: frozenset[str] | None = None  # a dataclass's instance attributes (cached values)


def _held(x: Any) -> _Held:
    if isinstance(x, torch.Tensor):
        return _Held(x, (x.shape, x.dtype, _bits(x).clone()))
    if isinstance(x, np.ndarray):
        return _Held(x, x.copy())
    if isinstance(x, _PLAIN):
        return _Held(x, x)
    if isinstance(x, dict):
        return _Held(x, {k: _held(v) for k, v in x.items()})
    if isinstance(x, (list, tuple)):
        return _Held(x, [_held(v) for v in x])
    if isinstance(x, (set, frozenset)):
        return _Held(x, frozenset(x))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = {
            f.name: _held(getattr(x, f.name)) for f in dataclasses.fields(x) if not is_scratch(f)
        }
        attrs = frozenset(vars(x)) if hasattr(x, "__dict__") else None
        return _Held(x, fields, attrs)
    return _Held(x)  # a backend, a module, a function: identity only


def _changes(held: _Held, x: Any, path: str) -> list[str]:
    """Where ``x`` (at ``path``) no longer is what ``held`` recorded."""
    if x is not held.obj:
        return [f"{path} was replaced ({type(held.obj).__name__} -> {type(x).__name__})"]
    content = held.content
    if isinstance(x, torch.Tensor):
        shape, dtype, bits = content
        if x.shape != shape or x.dtype != dtype or not torch.equal(_bits(x), bits):
            return [f"{path} (a tensor) was written to"]
        return []
    if isinstance(x, np.ndarray):
        return [] if np.array_equal(x, content, equal_nan=True) else [f"{path} was written to"]
    if isinstance(x, dict):
        if x.keys() != content.keys():
            added, gone = (
                sorted(map(str, x.keys() - content.keys())),
                sorted(map(str, content.keys() - x.keys())),
            )
            return [f"{path} (a dict) gained keys {added} and lost {gone}"]
        return [c for k, h in content.items() for c in _changes(h, x[k], f"{path}[{k!r}]")]
    if isinstance(x, (list, tuple)):
        if len(x) != len(content):
            return [f"{path} went from {len(content)} to {len(x)} items"]
        return [c for i, h in enumerate(content) for c in _changes(h, x[i], f"{path}[{i}]")]
    if isinstance(x, (set, frozenset)):
        return [] if frozenset(x) == content else [f"{path} (a set) changed"]
    if isinstance(content, dict):  # a dataclass
        out = [
            c
            for name, h in content.items()
            for c in _changes(h, getattr(x, name), f"{path}.{name}")
        ]
        if held.attrs is not None and frozenset(vars(x)) != held.attrs:
            added = sorted(frozenset(vars(x)) - held.attrs)
            out.append(f"{path} gained attributes {added} (a value cached on it after build)")
        return out
    return []


@pytest.mark.attnhub_cases("metadata_reuse")
def test_the_plan_is_complete_when_build_returns(case: Case) -> None:
    """Every field of the metadata but those declared scratch (``attnhub.scratch_field``) is
    made by ``build``: forwards on several layers, and ``write_kv(meta=)``, leave each the same
    object holding the same values (tensors: the same bytes; containers: deeply). A plan that
    the first layer completes (a per-layer memo in the metadata) is refused here."""
    step = harness.prepare(case)
    for _ in range(2):
        step.add_layer()
    meta = step.build()
    held = _held(meta)
    for i, layer in enumerate(step.layers):
        if step.plan.new_kv:
            layer.impl.write_kv(layer.key, layer.value, layer.cache, meta=meta)
        step.forward(layer, meta)
        changed = _changes(held, meta, "meta")
        assert not changed, (
            f"{case.id}: layer {i}'s write_kv(meta=) and forward changed the metadata build "
            f"returned: {'; '.join(changed[:5])} (the plan must be complete when build returns; "
            "declare a buffer layers write into with attnhub.scratch_field)"
        )
