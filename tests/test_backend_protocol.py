"""What the base classes enforce for every backend, whatever it computes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnhub import AttentionSpec, BatchMetadata, get_backend
from attnhub.errors import UnsupportedConfigurationError
from attnhub.torch_backend import TorchBackend


def _restricted(**capability_changes: object) -> type[TorchBackend]:
    caps = dataclasses.replace(TorchBackend.capabilities, **capability_changes)
    return type("Restricted", (TorchBackend,), {"name": "restricted", "capabilities": caps})


SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float32, block_size=4)


def _batch(query_lens: list[int], seq_lens: list[int]) -> BatchMetadata:
    tables, next_block = [], 1
    for s in seq_lens:
        n = -(-s // 4)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    return BatchMetadata.from_lengths(query_lens, seq_lens, tables, 4)


def test_torch_backend_reports_a_device_torch_cannot_use():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    why = get_backend("torch").availability("cuda")
    assert why is not None and "cuda" in why


def test_undeclared_chunked_prefill_is_refused_with_the_request_named():
    backend = _restricted(chunked_prefill=False)(SPEC)
    builder = backend.metadata_builder()
    assert builder.reorder_batch_threshold == 16  # longer queries over context are prefills
    with pytest.raises(UnsupportedConfigurationError, match=r"request 1 .*chunked prefill"):
        builder.build(_batch([1, 20], [9, 24]))


def test_prefill_without_context_needs_no_chunked_prefill_support():
    backend = _restricted(chunked_prefill=False)(SPEC)
    backend.metadata_builder().build(_batch([1, 6], [9, 6]))


def test_undeclared_multi_token_decode_is_refused_below_the_reorder_threshold():
    backend = _restricted(multi_token_decode=False)(SPEC)
    builder = backend.metadata_builder()
    builder.reorder_batch_threshold = 4  # type: ignore[misc]
    with pytest.raises(UnsupportedConfigurationError, match=r"request 0 .*multi-token decode"):
        builder.build(_batch([3, 1], [9, 10]))
    builder.build(_batch([6, 1], [9, 10]))  # above the threshold: a chunked prefill
