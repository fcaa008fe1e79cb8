"""KV writes every backend's own write path shares: rows into the slots of a paged cache plane
(one ``index_copy_`` where blocks and slots merge), and the write of a captured step, whose
shape cannot depend on which rows are padding. Reached through :mod:`attnhub.kit`.

A plane is [num_blocks, block_size, ...] (NHD: ``...`` = num_kv_heads, head_size, or
head_size_v for the value plane: each plane is written at its own width); slot
``s`` is block ``s // block_size``, offset ``s % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def flat_slots(plane: torch.Tensor) -> torch.Tensor | None:
    """``plane`` as [num_slots, ...] (a view), or None where its strides cannot merge blocks
    and offsets (e.g. padding between blocks)."""
    try:
        return plane.view(-1, *plane.shape[2:])
    except RuntimeError:
        return None


def write_slots(
    plane: torch.Tensor, flat: torch.Tensor | None, slots: torch.Tensor, rows: torch.Tensor
) -> None:
    """``plane[slot] = row`` for each pair (``slots`` int64 [n], ``rows`` [n, ...] in the
    plane's dtype): one ``index_copy_`` into ``flat`` (``flat_slots(plane)``) where there is
    one, else ``index_put_`` by (block, offset). Every slot in range (checked in ``build``)."""
    if flat is not None:
        flat.index_copy_(0, slots, rows)
    else:
        bs = plane.shape[1]
        plane.index_put_((slots // bs, slots % bs), rows)


def read_slots(
    plane: torch.Tensor, flat: torch.Tensor | None, slots: torch.Tensor
) -> torch.Tensor:  # [n, ...]
    """What ``plane`` holds at ``slots`` (the read ``write_slots`` mirrors)."""
    if flat is not None:
        return flat.index_select(0, slots)
    bs = plane.shape[1]
    return plane[slots // bs, slots % bs]


@dataclass(frozen=True)
class FixedShapeWrite:
    """The KV write of a captured step: ``T`` rows whatever the step's padding, device ops only.

    Padding rows (slot -1) cannot be left out without a data-dependent shape, so each is
    redirected to the step's first written row (same slot, same value: duplicate writes of one
    value, whatever their order); a step that writes nothing rewrites slot 0 with what it holds
    (``pick`` chooses the cache's own bytes then)."""

    rows: torch.Tensor  # [T] int64: the source row of each write
    slots: torch.Tensor  # [T] int64: its slot
    writes: torch.Tensor  # 0-d bool: some row has a slot

    @classmethod
    def of(cls, slot_mapping: torch.Tensor) -> FixedShapeWrite:  # [T] int, -1 = padding
        T = slot_mapping.shape[0]
        slots = slot_mapping.long()
        valid = slots >= 0
        writes = valid.any()
        first = torch.argmax(valid.to(torch.int32))  # the first written row (0 when none)
        rows = torch.where(valid, torch.arange(T, device=slots.device), first)
        return cls(rows, torch.where(writes, slots.index_select(0, rows), 0), writes)

    def pick(self, new: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        """``new`` (the source rows at ``rows``), or ``held`` (``read_slots`` at ``slots``)
        when the step writes nothing."""
        return torch.where(self.writes, new, held)
