"""NPUGraphAdaptor: ``torch.npu.NPUGraph`` with task-group updates, ordered by events.

Some vendor kernels take host-side lists (sequence lengths) that a captured
graph bakes in. A backend captures such a kernel inside ``graph_task_group_begin/end`` after a
captured ``ExternalEvent.wait`` (+ ``reset``), and before each replay launches it again with the
step's lists inside ``graph_task_update_begin/end`` on an update stream, then records the
event there; the replay's captured wait holds the kernel until its update is in.

What must not happen is step N's update rewriting a task while step N-1's replay of it has not
run yet. A simple runner synchronizes the device before every replay (the host waits).
Here, instead, every replay is followed by an event recorded on the replay stream, and
:meth:`updating` makes the update stream wait on it (``stream.wait_event``): step N's updates
run on the device after step N-1's replay has finished, and step N's replay waits on the
events they record. The host never blocks (docs/graphs.md, "Ordering").

``npu`` is the ``torch.npu`` namespace (the vendor's extension patches it in), or a backend's CPU
emulation of it: the same code runs against both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from attnhub.graphs.adaptor import CapturedGraph, GraphAdaptor


class NPUGraphAdaptor(GraphAdaptor):
    name = "npu"

    def __init__(self, npu: Any, *, warmup: bool = True) -> None:
        self.npu = npu
        self.pool = npu.graph_pool_handle()
        self.update_stream = npu.Stream()
        self.warmup = warmup
        self._replay_done: Any = None  # the event recorded after the last replay

    def capture(self, fn: Callable[[], Any]) -> CapturedGraph:
        npu = self.npu
        if self.warmup:
            fn()  # eager: lazy initialization outside the capture (KV writes are idempotent)
        graph = npu.NPUGraph()
        with npu.graph(graph, pool=self.pool):
            output = fn()
        return CapturedGraph(graph=graph, output=output)

    def replay(self, captured: CapturedGraph) -> None:
        npu = self.npu
        captured.graph.replay()
        done = npu.Event()
        done.record(npu.current_stream())
        self._replay_done = done

    @contextmanager
    def updating(self) -> Iterator[Any]:
        npu = self.npu
        stream = self.update_stream
        if self._replay_done is not None:
            stream.wait_event(self._replay_done)  # a device-side wait: the host goes on
        with npu.stream(stream):
            yield stream
