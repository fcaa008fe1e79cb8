"""A backend that runs off the CPU does no device-to-host sync per layer.

On a CPU nothing syncs, so every device-side tensor forward and write_kv(meta=) receive (the
metadata's, q/k/v, the cache's) is wrapped in a tensor that raises on host reads (see
``hostsync``). Every check stays on: the value checks ran once, in build, on host copies.
"""

from __future__ import annotations

import pytest

from attnhub import GraphSupport
from attnhub_conformance import harness
from attnhub_conformance.cases import Case
from attnhub_conformance.hostsync import (
    HostSyncError,
    guard,
    guard_cache,
    guard_tree,
    unguard,
    where,
)


@pytest.mark.attnhub_cases("host_sync")
def test_forward_does_not_sync_with_the_host(case: Case) -> None:
    step = harness.prepare(case)
    layer = step.layers[0]
    if step.backend.capabilities.graph_capture == GraphSupport.NEVER:
        meta = step.build()
    else:
        meta = step.builder.build_for_graph_capture(step.batch)
    guarded_meta = guard_tree(meta, "meta")
    key = guard(layer.key, "the key input") if step.plan.new_kv else None
    value = guard(layer.value, "the value input") if step.plan.new_kv else None
    try:
        if key is not None and value is not None:  # the engine's separate write, then forward
            layer.impl.write_kv(key, value, guard_cache(layer.cache), meta=guarded_meta)
        out = layer.impl.forward(
            guard(layer.query, "the query input"),
            key,
            value,
            guard_cache(layer.cache),
            guarded_meta,
        )
    except HostSyncError as exc:
        raise HostSyncError(f"{case.id}: {exc} (at {where(exc)})") from None
    harness.assert_matches_reference(step, layer, unguard(out), "forward under graph rules")
