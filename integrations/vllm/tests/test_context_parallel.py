"""attnhub's context-parallel sharding against vLLM's own code: ``get_dcp_local_seq_lens``
(every rank's share of each sequence), the head-tail split of prefill context parallel
(``PCPManager``'s) and the slot-mapping kernel of vLLM's block table, which
is a Triton kernel: it runs here through Triton's interpreter on the CPU (the kernel's own
source, re-decorated with the real ``triton.jit``, since vLLM's CPU build stubs Triton out)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from attnhub import BatchMetadata
from attnhub.context_parallel import local_seq_lens, prefill_chunks, shard_step
from attnhub.testing import generator, num_blocks_for, shuffled_block_table

pytest.importorskip("vllm")

from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

SEQ_LENS = torch.arange(0, 260, dtype=torch.int32)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("interleave", [1, 2, 4, 16])
def test_local_seq_lens_equal_vllms_get_dcp_local_seq_lens(
    world_size: int, interleave: int
) -> None:
    every_rank = get_dcp_local_seq_lens(SEQ_LENS, world_size, None, interleave)  # [B, N]
    for rank in range(world_size):
        ours = local_seq_lens(SEQ_LENS, world_size, rank, interleave)
        theirs = get_dcp_local_seq_lens(SEQ_LENS, world_size, rank, interleave)
        assert ours.tolist() == theirs.tolist() == every_rank[:, rank].tolist()


def _vllm_slot_mapping_kernel(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """vLLM's ``ComputeSlotMappingKernel.kernel`` under the real ``triton.jit``, interpreted."""
    triton = pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from vllm.v1.worker.block_table import ComputeSlotMappingKernel

    source = ComputeSlotMappingKernel.kernel
    source = getattr(source, "fn", source)  # the plain function under a JIT wrapper, if any
    scope = {**source.__globals__, "tl": triton.language, "triton": triton}
    fn = types.FunctionType(source.__code__, scope, source.__name__, source.__defaults__)
    fn.__module__, fn.__qualname__ = source.__module__, source.__qualname__
    return triton.jit(do_not_specialize=["num_tokens", "max_num_tokens"])(fn)


STEPS = [([1, 1, 1], [13, 2, 40]), ([3, 2], [19, 4]), ([1, 6, 9], [11, 6, 25])]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("interleave", [1, 4])
@pytest.mark.parametrize(("query_lens", "seq_lens"), STEPS, ids=["decode", "mtp", "chunked"])
def test_each_ranks_slot_mapping_equals_vllms_kernel(
    monkeypatch: pytest.MonkeyPatch,
    world_size: int,
    interleave: int,
    query_lens: list[int],
    seq_lens: list[int],
) -> None:
    kernel = _vllm_slot_mapping_kernel(monkeypatch)
    block_size, padding = 4, 3
    virtual = world_size * block_size
    table = shuffled_block_table(
        seq_lens, virtual, num_blocks_for(seq_lens, virtual), generator(sum(seq_lens))
    )
    tokens = sum(query_lens)
    batch = BatchMetadata.from_lengths(
        query_lens, seq_lens, table, virtual, num_tokens=tokens + padding
    )
    positions = torch.cat(
        [torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)]
    )
    for rank in range(world_size):
        theirs = torch.full((tokens + padding,), 12345, dtype=torch.int64)
        kernel[(len(query_lens) + 1,)](
            tokens,
            tokens + padding,
            batch.query_start_loc_cpu,
            positions,
            table,
            table.stride(0),
            theirs,
            KV_CACHE_BLOCK_SIZE=block_size,
            TOTAL_CP_WORLD_SIZE=world_size,
            TOTAL_CP_RANK=rank,
            CP_KV_CACHE_INTERLEAVE_SIZE=interleave,
            PAD_ID=-1,
            BLOCK_SIZE=1024,
        )
        shard = shard_step(
            batch, world_size=world_size, rank=rank, block_size=block_size, interleave=interleave
        )
        assert shard.slot_mapping.tolist() == theirs.tolist()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_prefill_chunks_equal_vllms_pcp_split(world_size: int) -> None:
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    query_lens = np.array([1, 37, 1, 2, 3, 16, 100, 7, 1], dtype=np.int32)
    is_prefilling = query_lens > 1
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)])
    for rank in range(world_size):
        manager = PCPManager(world_size, rank, torch.device("cpu"), shard_decode_requests=False)
        theirs = [
            (s.global_batch_req_idx, s.global_batch_slice.start, s.global_batch_slice.stop)
            for s in manager._get_rank_segments(rank, query_lens, is_prefilling, query_start_loc)
        ]
        ours = [
            (r, int(query_start_loc[r]) + off, int(query_start_loc[r]) + off + n)
            for r, off, n in prefill_chunks(query_lens, world_size, rank)
        ]
        assert ours == theirs
