"""CUDAGraphAdaptor: ``torch.cuda.CUDAGraph``, every graph in one shared memory pool.

Capture follows PyTorch's recipe: one warm-up run on a side stream (lazy initialization,
cuBLAS workspaces), then capture on ``torch.cuda.graph``'s own stream with the runner's pool.
Replays are launched on the current stream, so the persistent-buffer copies made before a
replay on that stream are ordered before it, and after the previous replay, by stream order
alone: no host synchronization. No backend attnhub ships bakes host values that change per step
into a CUDA kernel (the torch backend's graph path reads every per-step value from device
buffers), so :meth:`updating` has nothing to order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from attnhub.errors import BackendUnavailableError
from attnhub.graphs.adaptor import CapturedGraph, GraphAdaptor


class CUDAGraphAdaptor(GraphAdaptor):
    name = "cuda"

    def __init__(self, device: torch.device | str = "cuda") -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailableError("graphs", str(device), "CUDA is not available")
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], Any]) -> CapturedGraph:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()  # warm-up (its effects are those of the step: KV writes are idempotent)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        return CapturedGraph(graph=graph, output=output)

    def replay(self, captured: CapturedGraph) -> None:
        captured.graph.replay()
