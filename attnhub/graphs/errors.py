"""The typed errors of graph capture and replay (all :class:`attnhub.errors.AttnhubError`)."""

from __future__ import annotations

from attnhub.errors import AttnhubError, InvalidInputError


class GraphCaptureError(AttnhubError):
    """The step cannot be captured: it does something a device graph cannot hold (a host read
    of device data, an op whose output size depends on the data), or the graph API refused."""


class BatchTooLargeError(InvalidInputError):
    """A batch needs more tokens than the largest capture size (and no eager fallback)."""

    def __init__(
        self,
        num_tokens: int,
        largest: int,
        *,
        query_len: int = 1,
        num_reqs: int | None = None,
        padded_reqs: int | None = None,
    ) -> None:
        """``num_tokens``: the batch's own tokens. A mixed batch (``num_reqs`` requests) pads
        its requests to ``padded_reqs``, a capture size, each dummy request one token."""
        self.num_tokens = num_tokens
        self.largest = largest
        needed, why = num_tokens, ""
        if query_len != 1:
            why = f" (a multiple of the query length {query_len})"
        if num_reqs is not None and padded_reqs is not None and padded_reqs > num_reqs:
            dummies = padded_reqs - num_reqs
            needed += dummies
            why = (
                f" (a mixed graph pads its {num_reqs} requests to a capture size, "
                f"{padded_reqs}: {dummies} dummy request(s) of one token each)"
            )
        super().__init__(
            f"a batch of {num_tokens} tokens needs a capture size of at least {needed}{why}; "
            f"the largest capture size is {largest}: add a larger capture size or construct "
            "the runner with eager_fallback=True"
        )


class NotCapturableBatchError(InvalidInputError):
    """The batch's kind is beyond the backend's declared graph support (e.g. a prefill for a
    backend that captures uniform decodes only), and the runner has no eager fallback."""
