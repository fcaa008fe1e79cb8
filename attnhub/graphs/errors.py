"""The typed errors of graph capture and replay (all :class:`attnhub.errors.AttnhubError`)."""

from __future__ import annotations

from attnhub.errors import AttnhubError, InvalidInputError


class GraphCaptureError(AttnhubError):
    """The step cannot be captured: it does something a device graph cannot hold (a host read
    of device data, an op whose output size depends on the data), or the graph API refused."""


class BatchTooLargeError(InvalidInputError):
    """A batch needs more tokens than the largest capture size (and no eager fallback)."""

    def __init__(self, num_tokens: int, largest: int, *, query_len: int = 1) -> None:
        self.num_tokens = num_tokens
        self.largest = largest
        per = "" if query_len == 1 else f" (a multiple of the query length {query_len})"
        super().__init__(
            f"a batch of {num_tokens} tokens needs a capture size of at least {num_tokens}"
            f"{per}; the largest capture size is {largest}: add a larger capture size or "
            "construct the runner with eager_fallback=True"
        )


class NotCapturableBatchError(InvalidInputError):
    """The batch's kind is beyond the backend's declared graph support (e.g. a prefill for a
    backend that captures uniform decodes only), and the runner has no eager fallback."""
