"""BatchDescriptor: what a captured graph is keyed by (vLLM's ``BatchDescriptor``).

A device graph fixes every shape of the step it captured, so one graph serves every batch that
pads to the same descriptor: the padded token count, the padded request count and whether every
request has the same query length (a uniform decode; the query length is then
``num_tokens // num_reqs``: 1 for plain decode, 1 + k with k speculative tokens). A backend that
captures any batch (``GraphSupport.ALWAYS``) also gets *mixed* descriptors (``uniform_decode``
False): its requests padded to a capture size R, its tokens to a capture size with room for a
one-token dummy per missing request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnhub.batch import BatchMetadata
from attnhub.capabilities import GraphSupport
from attnhub.graphs.errors import BatchTooLargeError
from attnhub.graphs.sizes import CaptureSizes


@dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int  # padded token count (a capture size)
    num_reqs: int  # padded request count
    uniform_decode: bool  # every request has query_len num_tokens // num_reqs
    causal: bool = True  # the batch's own flag (a graph bakes it in)

    @property
    def query_len(self) -> int:
        """The query length of every request (uniform descriptors only)."""
        if not self.uniform_decode:
            raise ValueError(f"{self} is not uniform: requests have different query lengths")
        return self.num_tokens // self.num_reqs


def uniform_query_len(batch: BatchMetadata) -> int | None:
    """The query length every request of ``batch`` shares, or None (read on host copies)."""
    if not batch.num_reqs:
        return None
    q = np.diff(batch.query_start_loc_cpu.numpy())
    first = int(q[0])
    return first if bool((q == first).all()) else None


def describe(
    batch: BatchMetadata, sizes: CaptureSizes, level: GraphSupport
) -> BatchDescriptor | str:
    """The descriptor ``batch`` pads to under a backend's declared ``level``, or why the batch
    is not capturable (a sentence). Raises BatchTooLargeError when it is capturable in kind
    but larger than every capture size."""
    if not batch.num_reqs:
        return "the batch has no request"
    q = uniform_query_len(batch)
    if q is None:
        if level < GraphSupport.ALWAYS:
            return (
                f"its requests have different query lengths; the backend captures "
                f"{level.name.lower()} batches"
            )
        # a mixed graph: the requests padded to a capture size, the tokens to one with room
        # for a one-token dummy per missing request (padding.py); spare tokens need a dummy
        # request, so a batch whose request count is a size but whose token count is not
        # takes the next request size
        n, t = batch.num_reqs, batch.num_actual_tokens
        reqs = n  # (what the requests pad to so far: the error names the dummies apart)
        try:
            reqs = sizes.size_for(n)
            size = sizes.size_for(t + reqs - n)
            if size > t and reqs == n:
                reqs = n + 1
                reqs = sizes.size_for(n + 1)
                size = sizes.size_for(t + reqs - n)
        except BatchTooLargeError:
            raise BatchTooLargeError(t, sizes.largest, num_reqs=n, padded_reqs=reqs) from None
        return BatchDescriptor(
            num_tokens=size, num_reqs=reqs, uniform_decode=False, causal=batch.causal
        )
    if q > 1 and level < GraphSupport.UNIFORM_BATCH:
        return f"its requests have {q} query tokens each; the backend captures one-token decodes"
    if level == GraphSupport.NEVER:
        return "the backend declares no graph support"
    size = sizes.size_for(batch.num_actual_tokens, query_len=q)
    return BatchDescriptor(
        num_tokens=size, num_reqs=size // q, uniform_decode=True, causal=batch.causal
    )
