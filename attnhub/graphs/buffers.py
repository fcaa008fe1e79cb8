"""Persistent buffers: the tensors a captured graph reads, refilled before every replay.

A graph holds the addresses it was captured with, so each step's batch and inputs are copied
*into* tensors that live as long as the runner. One set is allocated at the largest capture size
and every descriptor uses a prefix of it (vLLM's layout): descriptor (T tokens, R requests)
reads ``query_start_loc[:R + 1]``, ``seq_lens[:R]``, ``block_table[:R]``, ``slot_mapping[:T]``
and ``input[:T]``.

Host copies are never persistent: each step's ``*_cpu`` tensors are its own fresh host
tensors, so the metadata captured with a graph keeps the host values it was captured with
(what the graph baked in), and a later step's host values reach a backend only through its
``update_graph_params`` hook.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attnhub.batch import BatchMetadata
from attnhub.errors import InvalidInputError
from attnhub.graphs.padding import PaddedStep


class PersistentBatch:
    """Device buffers for a step's batch, at the largest descriptor."""

    def __init__(
        self, max_tokens: int, max_reqs: int, width: int, block_size: int, device: torch.device
    ) -> None:
        self.block_size = block_size
        self.query_start_loc = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((max_reqs, width), dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)

    def load(self, step: PaddedStep, *, causal: bool = True) -> BatchMetadata:
        """Copy ``step`` into the buffers (on the current stream, after whatever replay came
        before it on that stream) and return the step's batch over them: device tensors are
        prefixes of the buffers, host copies are the step's own."""
        R, T = step.seq_lens.shape[0], step.slot_mapping.shape[0]
        views = (
            (self.query_start_loc[: R + 1], step.query_start_loc),
            (self.seq_lens[:R], step.seq_lens),
            (self.block_table[:R], step.block_table),
            (self.slot_mapping[:T], step.slot_mapping),
        )
        for dst, src in views:
            # pageable host source: staged before copy_ returns, so the host may reuse it
            dst.copy_(src, non_blocking=True)
        qsl, seq, table, slots = (v for v, _ in views)
        return BatchMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=step.query_start_loc,
            seq_lens=seq,
            seq_lens_cpu=step.seq_lens,
            num_reqs=R,
            num_actual_tokens=T,  # dummy requests' tokens are rows of the batch
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            block_table=table,
            slot_mapping=slots,
            block_size=self.block_size,
            causal=causal,
            block_table_cpu=step.block_table,
            slot_mapping_cpu=step.slot_mapping,
        )


class PersistentInputs:
    """Device buffers for the step function's tensor inputs (token rows first), allocated on
    the first step at the largest capture size, zero-filled."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.buffers: list[torch.Tensor] | None = None

    def load(
        self, inputs: Sequence[torch.Tensor], rows: int, num_tokens: int
    ) -> list[torch.Tensor]:
        """Copy the first ``rows`` rows of every input in; return the ``num_tokens``-row views
        a graph of that size reads (rows past ``rows`` hold whatever a previous step left)."""
        if self.buffers is None:
            self.buffers = [
                torch.zeros((self.max_tokens, *x.shape[1:]), dtype=x.dtype, device=x.device)
                for x in inputs
            ]
        if len(inputs) != len(self.buffers):
            raise InvalidInputError(
                f"the step takes {len(self.buffers)} tensor inputs, got {len(inputs)}"
            )
        views = []
        for i, (buf, x) in enumerate(zip(self.buffers, inputs, strict=True)):
            if x.shape[1:] != buf.shape[1:] or x.dtype != buf.dtype or x.device != buf.device:
                raise InvalidInputError(
                    f"input {i} is {x.dtype} {list(x.shape)} on {x.device}; the graphs were "
                    f"captured with {buf.dtype} [*, {', '.join(map(str, buf.shape[1:]))}] on "
                    f"{buf.device}"
                )
            if x.shape[0] < rows:
                raise InvalidInputError(f"input {i} has {x.shape[0]} rows, the batch {rows}")
            buf[:rows].copy_(x[:rows])
            views.append(buf[:num_tokens])
        return views
