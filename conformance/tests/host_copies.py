"""A pytest plugin (``-p host_copies``): every batch ``BatchMetadata.from_lengths`` makes carries
host copies of its block table and slot mapping on the CPU too, as a batch on an accelerator
does. On the CPU a batch's device tensors are its host data, so without this plugin the suite
never runs a CPU backend with a separate host copy, the one builders check (a spoiler that
changed only the device tensor went unseen here and crashed an H100's CUDA context)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from attnhub import BatchMetadata

_from_lengths = BatchMetadata.from_lengths.__func__  # type: ignore[attr-defined]


def _with_host_copies(cls: type[BatchMetadata], *args: Any, **kwargs: Any) -> BatchMetadata:
    batch = _from_lengths(cls, *args, **kwargs)
    if batch.block_table_cpu is not None:
        return batch
    return replace(
        batch,
        block_table_cpu=batch.block_table.clone(),
        slot_mapping_cpu=batch.slot_mapping.clone(),
    )


def pytest_configure(config: pytest.Config) -> None:
    BatchMetadata.from_lengths = classmethod(_with_host_copies)  # type: ignore[method-assign, assignment]
