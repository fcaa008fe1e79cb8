"""GraphRunner: capture a step per batch descriptor on first use, replay it afterwards.

    runner = GraphRunner(backend, step, capture_sizes=CaptureSizes.up_to(64),
                         max_blocks_per_req=64, kv_caches=caches)
    out = runner.run(batch, query, key, value)   # step(query, key, value, meta) captured

Per step, on the host only: the batch is padded to its descriptor (``padding``), validated
with the backend's own step checks (values, kinds, extents against every KV cache), copied into
the persistent buffers (``buffers``), and then either captured (first batch of the descriptor:
``builder.build_for_graph_capture`` on the buffers, then ``adaptor.capture``) or not; every
step then gets ``builder.update_graph_params`` (host-side kernel arguments refreshed, inside
``adaptor.updating()``) and a replay. The returned rows are views of the graph's output: valid
until the next ``run``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attnhub.backend import AttentionBackend, AttentionMetadata, AttentionMetadataBuilder
from attnhub.batch import BatchMetadata
from attnhub.capabilities import GraphSupport
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.graphs.adaptor import CapturedGraph, GraphAdaptor
from attnhub.graphs.buffers import PersistentBatch, PersistentInputs
from attnhub.graphs.descriptor import BatchDescriptor, describe
from attnhub.graphs.errors import BatchTooLargeError, NotCapturableBatchError
from attnhub.graphs.padding import pad_batch
from attnhub.graphs.sizes import CaptureSizes
from attnhub.kv_cache import PagedKVCache
from attnhub.validation import check_extents

#: step(*inputs, meta) -> output tensor (rows = tokens) or a tuple/list of them.
StepFn = Callable[..., Any]


@dataclass
class GraphEntry:
    """One captured step: its metadata (built for capture, over the persistent buffers) and
    its graph."""

    meta: AttentionMetadata
    graph: CapturedGraph


def capture_or_replay(
    graphs: MutableMapping[Any, GraphEntry],
    key: Hashable,
    *,
    builder: AttentionMetadataBuilder[Any],
    adaptor: GraphAdaptor,
    step_batch: BatchMetadata,
    step: Callable[[AttentionMetadata], Any],
    stats: MutableMapping[str, int],
) -> Any:
    """The captured step ``key`` run on ``step_batch`` (a batch over the persistent buffers,
    already checked): on its first use, ``builder.build_for_graph_capture(step_batch)`` and the
    capture of ``step(meta)``; every time, ``builder.update_graph_params`` inside
    ``adaptor.updating()`` and the replay. Counts ``stats["captures"]`` and
    ``stats["replays"]``; returns the graph's output (valid until the next replay)."""
    entry = graphs.get(key)
    if entry is None:
        meta = builder.build_for_graph_capture(step_batch)
        entry = graphs[key] = GraphEntry(meta, adaptor.capture(lambda: step(meta)))
        stats["captures"] += 1
    with adaptor.updating() as stream:
        builder.update_graph_params(entry.meta, step_batch, stream)
    adaptor.replay(entry.graph)
    stats["replays"] += 1
    return entry.graph.output


def checked_caches(kv_caches: Sequence[PagedKVCache], who: str) -> list[PagedKVCache]:
    """``kv_caches`` as a list; refused when empty: a replay runs no Python (no layer checks a
    step's slots and blocks against its cache then), so the runner compares every step's
    extents with these caches before its replay, and without them a step whose slot or block
    lies outside a cache would be written there."""
    caches = list(kv_caches)
    if not caches:
        raise InvalidInputError(
            f"{who}(kv_caches=[]): pass the KV caches the step writes and reads (every "
            "layer's); a replay runs no Python, so each step's slots and blocks are checked "
            "against them before it replays"
        )
    return caches


class GraphRunner:
    """See the module docstring. ``kv_caches``: every cache the step writes or reads (each
    step's extents are checked against them before its replay; required). ``eager_fallback``:
    batches that cannot be captured (beyond the backend's declared support, or larger than
    the largest capture size, or refused by the backend's ``build_for_graph_capture``) run
    eagerly with ordinary metadata instead of raising."""

    def __init__(
        self,
        backend: AttentionBackend,
        step: StepFn,
        *,
        capture_sizes: CaptureSizes | Sequence[int],
        max_blocks_per_req: int,
        kv_caches: Sequence[PagedKVCache],
        eager_fallback: bool = False,
        adaptor: GraphAdaptor | None = None,
    ) -> None:
        self.backend = backend
        self.builder = backend.metadata_builder()
        self.level = self.builder.graph_support
        if self.level == GraphSupport.NEVER:
            raise UnsupportedConfigurationError(
                backend.name, ["device-graph capture is not supported (GraphSupport.NEVER)"]
            )
        self.step = step
        if not isinstance(capture_sizes, CaptureSizes):
            capture_sizes = CaptureSizes(capture_sizes)
        self.sizes = capture_sizes
        self.width = max_blocks_per_req
        self.kv_caches = checked_caches(kv_caches, "GraphRunner")
        self.eager_fallback = eager_fallback
        self.adaptor = adaptor if adaptor is not None else backend.graph_adaptor()
        largest = self.sizes.largest
        self.batch_buffers = PersistentBatch(
            largest, largest, max_blocks_per_req, backend.spec.block_size, backend.device
        )
        self.input_buffers = PersistentInputs(largest)
        self.graphs: dict[BatchDescriptor, GraphEntry] = {}
        #: "captures", "replays", "eager" steps so far.
        self.stats: Counter[str] = Counter()

    def descriptor(self, batch: BatchMetadata) -> BatchDescriptor | str:
        """The descriptor ``batch`` runs under, or why it cannot be captured."""
        return describe(batch, self.sizes, self.level)

    def run(self, batch: BatchMetadata, *inputs: torch.Tensor) -> Any:
        """One step: the rows of the step's output for ``batch``'s real tokens."""
        try:
            desc = self.descriptor(batch)
        except BatchTooLargeError:
            if not self.eager_fallback:
                raise
            return self._eager(batch, inputs)
        if isinstance(desc, str):
            if self.eager_fallback:
                return self._eager(batch, inputs)
            raise NotCapturableBatchError(
                f"this batch cannot be captured by the {self.backend.name} backend: {desc} "
                "(construct the runner with eager_fallback=True to run it eagerly)"
            )
        padded = pad_batch(batch, desc, self.width)
        step_batch = self.batch_buffers.load(padded, causal=batch.causal)
        extents = self.builder.check_graph_step(step_batch)
        for cache in self.kv_caches:
            check_extents(extents, step_batch, cache)
        static = self.input_buffers.load(inputs, padded.num_real_tokens, desc.num_tokens)
        try:
            output = capture_or_replay(
                self.graphs, desc, builder=self.builder, adaptor=self.adaptor,
                step_batch=step_batch, step=lambda meta: self.step(*static, meta),
                stats=self.stats,
            )  # fmt: skip
        except UnsupportedConfigurationError:
            # a batch the backend refuses to capture (its build_for_graph_capture: e.g. a
            # non-causal batch where only causal ones are captured) is not capturable either
            if not self.eager_fallback or desc in self.graphs:
                raise
            return self._eager(batch, inputs)
        return output_rows(output, padded.num_real_tokens)

    def _eager(self, batch: BatchMetadata, inputs: Sequence[torch.Tensor]) -> Any:
        self.stats["eager"] += 1
        meta = self.builder.build(batch)
        return output_rows(self.step(*inputs, meta), batch.num_actual_tokens)


def output_rows(output: Any, n: int) -> Any:
    """The first ``n`` rows of a step's output (a tensor, or a tuple/list of them)."""
    if isinstance(output, torch.Tensor):
        return output[:n]
    if isinstance(output, (list, tuple)):
        return type(output)(output_rows(o, n) for o in output)
    return output
