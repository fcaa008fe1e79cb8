"""vLLM's decode context parallel through the adapter (issue 26, item 7).

vLLM 0.32 itself refuses DCP on its CPU platform, outside attnhub (docs/context-parallel.md,
"vLLM settings"): its CPU fallback of the model runner's DCP slot-mapping kernel asserts a
context-parallel world of 1 (``vllm/utils/cpu_triton_utils.py``,
``_compute_slot_mapping_kernel_impl``: ``assert TOTAL_CP_WORLD_SIZE == 1, "Context Parallelism
is not supported on CPU."``), reached at the first scheduled step (``_prepare_inputs`` ->
``BlockTable.compute_slot_mapping``), after the engine started with the adapter's layers (their
LSE declared) and passed vLLM's own DCP check. ``test_vllm_still_refuses_dcp_on_cpu`` asserts
that refusal, so that this test fails, and the docs are revisited, when it lifts.

So the adapter's DCP path runs here with vLLM's own DCP group and helpers instead, on 2 spawned
gloo ranks (``vllm_dcp_rank.py``: vLLM's ``init_worker_distributed_environment``, vLLM's
``Attention`` layer, its slot-mapping kernel interpreted, its ``get_dcp_local_seq_lens`` and
``cp_lse_ag_out_rs``), against the adapter's single-rank run and the float64 reference.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (nox -s vllm)"
)

HERE = Path(__file__).resolve().parent


def test_vllm_still_refuses_dcp_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The slot-mapping kernel vLLM's CPU platform puts in place of the Triton one
    (``CpuPlatform.register_triton_kernel_overrides``, called by every worker) refuses a
    context-parallel world of 2 when launched as the model runner's ``BlockTable`` launches
    it, and serves a world of 1."""
    import torch
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher
    from vllm.utils import cpu_triton_utils
    from vllm.v1.worker import block_table

    current_platform.import_kernels()  # vllm._C, as a worker loads it
    registered: dict[str, object] = {}
    monkeypatch.setattr(dispatcher, "register_kernels", registered.update)
    current_platform.register_triton_kernel_overrides()
    impl = registered["vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel"]
    assert impl is cpu_triton_utils._compute_slot_mapping_kernel_impl
    cls = block_table.ComputeSlotMappingKernel
    override = dispatcher.KernelOverride(cls.kernel, impl)  # what register_kernels installs
    monkeypatch.setattr(cls, "kernel", staticmethod(override))

    def slots(world: int) -> list[int]:
        out = torch.full((3,), 12345, dtype=torch.int64)
        table = torch.tensor([[1, 2]], dtype=torch.int32)
        block_table._COMPUTE_SLOT_MAPPING_KERNEL(  # as BlockTable.compute_slot_mapping does
            1, 3, 3, torch.tensor([0, 3], dtype=torch.int32), torch.arange(3), table,
            table.stride(0), out, 4, world, 0, 1,
        )  # fmt: skip
        return out.tolist()

    assert slots(1) == [4, 5, 6]
    with pytest.raises(AssertionError, match="Context Parallelism is not supported on CPU"):
        slots(2)


@pytest.fixture(scope="module")
def mqa_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    sys.path.insert(0, str(HERE))
    try:
        from vllm_generate import write_tiny_llama
    finally:
        sys.path.remove(str(HERE))
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny-mqa")), num_kv_heads=1)


def test_adapter_dcp_with_vllms_group_matches_single_rank(mqa_model: str) -> None:
    """2 gloo ranks (tensor_parallel_size = decode_context_parallel_size = 2), the torch
    backend, float32, per-rank block 4: interleave 1 with all-gather + reduce-scatter, and
    interleave 4 (the block) with all-to-all; two steps each (prefill chunks, then decodes,
    a multi-token decode and a chunked prefill; a request of one token, empty on rank 1)."""
    from attnhub_conformance.multi_rank import run_group

    job = {
        "backend": "torch", "sub_cases": [], "spec": None, "device": "cpu", "emulate": False,
        "extra": "vllm_dcp_rank:run", "model": mqa_model, "world_size": 2, "block_size": 4,
        "num_blocks": 12, "dtype": "float32", "dist_ident": f"attnhub-dcp-{os.getpid()}",
    }  # fmt: skip
    sys.path.insert(0, str(HERE))  # a spawned rank imports vllm_dcp_rank from here
    try:
        reports = run_group(2, job, deadline_s=300.0)
    finally:
        sys.path.remove(str(HERE))
    for rank, report in reports.items():
        extra = report["extra"]
        assert extra["dcp_group"] == (2, rank) and extra["tp_group"] == (2, rank)
        cases = {k: v for k, v in extra.items() if "-step" in k}
        assert len(cases) == 4
        for name, found in cases.items():
            atol = found["tolerance"][0]
            assert found["holds_its_shard"], (rank, name)
            assert found["finite"], (rank, name)
            assert found["local_seq_lens"] == found["vllm_local_seq_lens"], (rank, name)
            assert found["vllm_merge_vs_adapter"] <= atol, (rank, name, found)
            print(f"rank {rank} {name}: {found}")
