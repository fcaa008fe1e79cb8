"""Decode context parallel steps captured in device graphs (docs/context-parallel.md, "Graphs").

    dcp = DecodeContextParallel(backend, group, world_size=N, interleave=I)
    runner = DcpGraphRunner(dcp, step, capture_sizes=[8, 16], max_blocks_per_req=W,
                            kv_caches=caches)
    out = runner.run(batch, query, key, value)  # every rank, every step

    def step(query, key, value, dcp_step):  # captured once per capture size
        for impl, cache in layers:
            out = dcp.forward(impl, dcp_step, query, key, value, cache)
        return out

What makes a DCP step capturable: the rank's call over its shard is one one-token request per
query row of the step (``DecodeContextParallel.flat_step``), whatever the step holds, so a step
of ``T`` query rows padded to a capture size ``S >= T`` is always ``S`` one-token requests: a
uniform single-token decode of the gathered backend, every shape fixed by ``S`` (and the block
table's width ``W``). Per step, on the host:

1. the rank's shard and its flattened step (local lengths, local slot mapping, the requests'
   table rows) padded to ``S`` with dummy one-token requests (``attnhub.graphs.pad_batch``),
   copied into persistent buffers (``PersistentBatch``) and checked (the gathered builder's
   ``check_graph_step``, every cache's extents), with the rows that see no key of this rank
   (``empty_rows``: padding rows too) and the inputs;
2. the step's agreement (``agree_and_shard``: one fixed-size all-gather of a fingerprint,
   outside any graph, which carries the runner's capture sizes: ranks configured with others
   would pad the step to other row counts and meet in collectives of other shapes): whatever
   a rank refused in 1 (a batch larger than the largest capture size included) or the runner
   refuses, or capture sizes that differ, is raised there on every rank;
3. on the first step of size ``S`` (the same step on every rank: they agree on every step and
   its size): the gathered backend's ``build_for_graph_capture`` over those buffers, its
   outcome settled over the group (``ContextParallelGroup.settle``: one more fixed-size
   all-gather, so a build that fails on one rank, over its own lengths, is raised on every
   rank before the capture's collectives), then the capture of ``step`` (write, head gather,
   the backend's call, merge: the collectives inside);
4. ``update_graph_params`` (a backend whose captured kernels take host lengths refreshes
   each captured task with this rank's lengths) on the adaptor's update stream, then the
   replay. No device-wide synchronize.

What is not settled: a failure inside the capture of ``step`` itself (the layers' calls,
between the collectives) on one rank only. Every check of a layer call that depends on the
rank's own data runs before the agreement or in the settled build; what ``step`` checks is
the same on every rank of an agreed step (shapes, specs), so it fails on all or none.

Collectives inside a graph: a captured graph replays the collectives it recorded, so the
group's must be capturable on the backend's device: NCCL on CUDA, HCCL on an NPU. gloo's are
not (a gloo collective on device tensors goes through the host); on the host (the eager tape,
or an emulated graph API built on it) the tape records each collective and runs it again,
waited for, at every replay (``attnhub.graphs.tape.CollectiveEntry``). Every rank captures
and replays the same graphs in the same order (they agree on every step), so the collectives
match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from attnhub.backend import AttentionMetadata
from attnhub.batch import BatchMetadata
from attnhub.capabilities import GraphSupport
from attnhub.context_parallel.dcp import DcpStep, DecodeContextParallel
from attnhub.context_parallel.sharding import ContextShard, shard_step
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.graphs.adaptor import GraphAdaptor
from attnhub.graphs.buffers import PersistentBatch, PersistentInputs
from attnhub.graphs.descriptor import BatchDescriptor
from attnhub.graphs.padding import pad_batch
from attnhub.graphs.runner import GraphEntry, capture_or_replay, checked_caches, output_rows
from attnhub.graphs.sizes import CaptureSizes
from attnhub.kv_cache import PagedKVCache
from attnhub.validation import check_extents

#: The process-group backend whose collectives a device graph can capture, per device type.
CAPTURABLE_COLLECTIVES = {"cuda": "nccl", "npu": "hccl"}

DcpStepFn = Callable[..., Any]


@dataclass
class _Prepared:
    shard: ContextShard
    rows: int  # the step's real rows
    size: int  # the capture size it pads to
    step_batch: BatchMetadata  # over the persistent buffers
    inputs: list[torch.Tensor]  # views of the persistent inputs


def collective_refusal(dcp: DecodeContextParallel) -> str | None:
    """Why ``dcp``'s group cannot sit inside a graph of its backend's device (None: it can)."""
    device = dcp.backend.device.type
    if device == "cpu":  # the tape (eager adaptor, emulated graph API) reruns them per replay
        return None
    group = dcp.group
    need = CAPTURABLE_COLLECTIVES.get(device)
    have = dist.get_backend(group.group)
    if need is None or have != need:
        return (
            f"decode context parallel in a {device} graph: the group's {have} collectives "
            f"cannot be captured on {device} (" + (f"{need}'s can" if need else "none known")
            + ")"
        )  # fmt: skip
    if group.check_group is None and group.device.type != "cpu":
        return (
            "decode context parallel in a graph: the step's agreement would read the device "
            "group's all-gather on the host every step (a device synchronize): give the "
            "ContextParallelGroup a host check_group (vLLM's cpu_group)"
        )
    return None


class DcpGraphRunner:
    """Captured decode context parallel steps on one rank (see the module docstring).

    ``step(query, key, value, dcp_step)`` runs every layer (``dcp.forward``) and returns a
    tensor of rows (or a tuple/list of them); ``capture_sizes``: the padded row counts graphs
    are captured for; ``max_blocks_per_req``: the width ``W`` of the step's table (virtual
    blocks of ``N x B`` tokens); ``kv_caches``: the rank's caches the step writes and reads,
    checked against each step's extents before its replay (required, as ``GraphRunner``'s);
    ``adaptor``: the gathered backend's ``graph_adaptor()`` by default. What the backend or
    the group cannot capture is raised by :meth:`run` on every rank, after the step's
    agreement (no rank left in a collective)."""

    def __init__(
        self,
        dcp: DecodeContextParallel,
        step: DcpStepFn,
        *,
        capture_sizes: CaptureSizes | Sequence[int],
        max_blocks_per_req: int,
        kv_caches: Sequence[PagedKVCache],
        adaptor: GraphAdaptor | None = None,
    ) -> None:
        if not isinstance(capture_sizes, CaptureSizes):
            capture_sizes = CaptureSizes(capture_sizes)
        if (
            isinstance(max_blocks_per_req, bool)
            or not isinstance(max_blocks_per_req, int)
            or (max_blocks_per_req <= 0)
        ):
            raise InvalidInputError(
                f"max_blocks_per_req = {max_blocks_per_req!r} must be a positive int"
            )
        self.dcp = dcp
        self.step = step
        self.sizes = capture_sizes
        self.width = max_blocks_per_req
        self.kv_caches = checked_caches(kv_caches, "DcpGraphRunner")
        self.graphs: dict[int, GraphEntry] = {}
        #: "captures", "replays" so far.
        self.stats: dict[str, int] = {"captures": 0, "replays": 0}
        #: This rank's shard of the last step run (host data; a graph's forward reads none).
        self.last_shard: Any = None
        gathered = dcp.gathered
        reasons: list[str] = []
        why = collective_refusal(dcp)
        if why is not None:
            reasons.append(why)
        self.builder = None if gathered is None else gathered.metadata_builder()
        if self.builder is not None and self.builder.graph_support < (
            GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
        ):
            reasons.append(
                f"decode context parallel in a graph: the {gathered.name if gathered else ''} "
                "backend captures no one-token decodes for the gathered spec (graph_support "
                f"{self.builder.graph_support.name})"
            )
        #: Why this rank cannot capture DCP steps (raised by run after the agreement).
        self.refusal: UnsupportedConfigurationError | None = (
            UnsupportedConfigurationError(dcp.backend.name, reasons) if reasons else None
        )
        device = dcp.backend.device
        largest = self.sizes.largest
        self.batch_buffers = PersistentBatch(largest, largest, self.width, dcp.spec.block_size,
                                             device)  # fmt: skip
        self.empty_rows = torch.ones(largest, dtype=torch.bool, device=device)
        self.input_buffers = PersistentInputs(largest)
        self.adaptor = adaptor
        if adaptor is None and gathered is not None and self.refusal is None:
            self.adaptor = gathered.graph_adaptor()

    def run(self, batch: BatchMetadata, *inputs: torch.Tensor) -> Any:
        """One step on this rank: ``inputs`` are ``step``'s tensor inputs, rows first (the
        rank's query heads ``[T, Hl, D]``, the step's new keys and values ``[T, K, D]``).
        Returns the rows of ``step``'s output for the step's real tokens (valid until the
        next run). Whatever this rank refuses (a batch of more rows than the largest capture
        size: ``attnhub.graphs.BatchTooLargeError``; a step beyond the table's width or a
        cache's extents; bad inputs) is found before the step's agreement and raised there on
        every rank, before any cache is touched and before any collective of the graph."""
        prepared: _Prepared | None = None
        refusal: Exception | None = self.refusal
        if refusal is None:
            try:
                prepared = self._prepare(batch, inputs)
            except Exception as exc:  # told to the other ranks by the agreement
                refusal = exc
        self.dcp.agree_and_shard(batch, refusal, capture_sizes=self.sizes.sizes)
        assert prepared is not None and self.builder is not None and self.adaptor is not None
        size, static = prepared.size, prepared.inputs
        self.last_shard = prepared.shard

        def step(meta: AttentionMetadata) -> Any:  # captured: the gathered backend's meta
            return self.step(*static, DcpStep(prepared.shard, meta, self.empty_rows[:size]))

        if size not in self.graphs:  # the first step of this size, on every rank alike
            builder, step_batch = self.builder, prepared.step_batch
            # the capture-time build reads the rank's own lengths: it may fail on one rank
            # only, which every rank then raises, before the capture's collectives
            meta = self.dcp.group.settle(
                lambda: builder.build_for_graph_capture(step_batch),
                "the DCP graph's capture-time build",
            )
            self.graphs[size] = GraphEntry(meta, self.adaptor.capture(lambda: step(meta)))
            self.stats["captures"] += 1
        output = capture_or_replay(
            self.graphs, size, builder=self.builder, adaptor=self.adaptor,
            step_batch=prepared.step_batch, step=step, stats=self.stats,
        )  # fmt: skip
        return output_rows(output, prepared.rows)

    def _prepare(self, batch: BatchMetadata, inputs: Sequence[torch.Tensor]) -> _Prepared:
        """This rank's part of the step, before the agreement: its shard, its one-token rows
        padded to the capture size and copied into the persistent buffers (checked against
        the gathered backend and every cache), the empty-row mask and the inputs."""
        assert self.builder is not None
        dcp = self.dcp
        rows = int(batch.num_actual_tokens)
        size = self.sizes.size_for(rows)
        virtual = dcp.world_size * dcp.spec.block_size
        seq = batch.seq_lens_cpu
        longest = int(seq.max()) if seq.numel() else 0
        needed = -(-longest // virtual)
        if needed > self.width:
            raise InvalidInputError(
                f"request {int(seq.argmax())} (seq_len {longest}) needs {needed} virtual blocks "
                f"of {virtual}; the DCP graph runner's block table holds {self.width} "
                "(max_blocks_per_req)"
            )
        shard = shard_step(
            batch, world_size=dcp.world_size, rank=dcp.group.shard_rank,
            block_size=dcp.spec.block_size, interleave=dcp.interleave,
        )  # fmt: skip
        flat, empty = dcp.flat_step(batch, shard, "cpu")
        # the rank's call is the flat step (one-token rows whose lengths say what each row
        # sees, the step's causality included), as eagerly: causal whatever batch.causal is
        desc = BatchDescriptor(size, size, uniform_decode=True, causal=flat.causal)
        padded = pad_batch(flat, desc, self.width)
        step_batch = self.batch_buffers.load(padded, causal=flat.causal)
        extents = self.builder.check_graph_step(step_batch)
        for cache in self.kv_caches:
            check_extents(extents, step_batch, cache)
        static = self.input_buffers.load(inputs, rows, size)
        empty_rows = torch.ones(size, dtype=torch.bool)  # fresh host data every step
        empty_rows[:rows] = empty[:rows]
        self.empty_rows[:size].copy_(empty_rows, non_blocking=True)
        return _Prepared(shard, rows, size, step_batch, static)
