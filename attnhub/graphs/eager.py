"""EagerAdaptor: "graphs" on any device, as a recorded tape of aten ops (see ``tape``).

Truthful about what a device graph freezes: the capture runs the step once eagerly (the warm-up
a device adaptor runs too), then once under a recorder;
replay re-executes the recorded ops with their captured host values (Python ints, lists,
shapes) and the captured tensors (whose contents are read anew), never the Python code. So a
backend that bakes a host value into a kernel argument and forgets to refresh it gives the
same stale answer here as on a device, and one that reads device data on the host at capture
fails here as a device capture would (GraphCaptureError).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attnhub.graphs.adaptor import CapturedGraph, GraphAdaptor
from attnhub.graphs.tape import Tape


class EagerAdaptor(GraphAdaptor):
    name = "eager"

    def capture(self, fn: Callable[[], Any]) -> CapturedGraph:
        # one eager run first, as the device adaptors' warm-up (CUDA's side stream, the NPU's):
        # what a layer reads on the host once, at its first sight of a cache or a scale, is
        # read there and not under the recorder (KV writes are idempotent)
        fn()
        tape = Tape()
        with tape.recording():
            output = fn()
        return CapturedGraph(graph=tape, output=output)

    def replay(self, captured: CapturedGraph) -> None:
        captured.graph.replay()
