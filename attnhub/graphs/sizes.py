"""Capture sizes: the padded token counts graphs are captured for, and padding up to them."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from attnhub.errors import InvalidInputError
from attnhub.graphs.errors import BatchTooLargeError


@dataclass(frozen=True)
class CaptureSizes:
    """Sorted, distinct, positive token counts."""

    sizes: tuple[int, ...]

    def __init__(self, sizes: Iterable[int]) -> None:
        values = sorted(set(sizes))
        for s in values:
            if isinstance(s, bool) or not isinstance(s, int) or s <= 0:
                raise InvalidInputError(f"capture size {s!r} must be a positive int")
        if not values:
            raise InvalidInputError("at least one capture size is needed")
        object.__setattr__(self, "sizes", tuple(values))

    @classmethod
    def up_to(cls, largest: int) -> CaptureSizes:
        """vLLM's default shape: 1, 2, 4, then every multiple of 8 up to ``largest``."""
        if largest <= 0:
            raise InvalidInputError(f"largest capture size {largest} must be positive")
        base = [s for s in (1, 2, 4) if s <= largest]
        return cls([*base, *range(8, largest + 1, 8), largest])

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def size_for(self, num_tokens: int, *, query_len: int = 1) -> int:
        """The smallest capture size >= ``num_tokens`` that is a multiple of ``query_len`` (a
        uniform batch pads with whole requests). Raises BatchTooLargeError naming the size."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        for s in self.sizes[i:]:
            if s % query_len == 0:
                return s
        raise BatchTooLargeError(num_tokens, self.largest, query_len=query_len)
