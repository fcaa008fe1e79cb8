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
from attnhub_conformance.hostsync import HostSyncError, run_layer_guarded, where


@pytest.mark.attnhub_cases("host_sync")
def test_forward_does_not_sync_with_the_host(case: Case) -> None:
    step = harness.prepare(case)
    layer = step.layers[0]
    if step.builder.graph_support == GraphSupport.NEVER:  # the builder's word, per spec
        meta = step.build()
    else:
        meta = step.builder.build_for_graph_capture(step.batch)
    key, value = (layer.key, layer.value) if step.plan.new_kv else (None, None)
    try:
        out = run_layer_guarded(layer.impl, layer.query, key, value, layer.cache, meta)
    except HostSyncError as exc:
        raise HostSyncError(f"{case.id}: {exc} (at {where(exc)})") from None
    harness.assert_matches_reference(step, layer, out, "forward under graph rules")
