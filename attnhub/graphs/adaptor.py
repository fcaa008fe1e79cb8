"""The one small interface every device graph API sits behind.

An adaptor captures a zero-argument callable into a graph and replays it; :meth:`updating` is
the scope in which a backend refreshes host-side kernel arguments of a captured graph before
its next replay (a vendor's task-group updates), ordered after the previous replay without a
host synchronization. Adaptors: :class:`~attnhub.graphs.eager.EagerAdaptor` (any device: a
recorded tape of aten ops), :class:`~attnhub.graphs.cuda.CUDAGraphAdaptor`
(``torch.cuda.CUDAGraph``) and :class:`~attnhub.graphs.npu.NPUGraphAdaptor`
(``torch.npu.NPUGraph``, or attnhub_ascend's emulation of it).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class CapturedGraph:
    """A captured step: the device graph (or tape) and the tensors the capture produced, which
    every replay overwrites."""

    graph: Any
    output: Any


class GraphAdaptor(abc.ABC):
    name: str = "graph"

    @abc.abstractmethod
    def capture(self, fn: Callable[[], Any]) -> CapturedGraph:
        """Capture ``fn()``: what it launches is recorded, with the host values of the moment.
        What a capture computed is not an answer: replay before reading the output."""

    @abc.abstractmethod
    def replay(self, captured: CapturedGraph) -> None:
        """Launch the captured work again (asynchronously where the device is)."""

    @contextmanager
    def updating(self) -> Iterator[Any]:
        """The scope of a backend's per-step update of a captured graph's host-side arguments;
        yields the stream the update runs on (None where the device has none). Default:
        nothing to order (the update runs in host order before the replay)."""
        yield None
