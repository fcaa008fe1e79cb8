"""The cpu backend's MLA layers on ``CPU_MLA`` (``attnhub_cpu.mla``): what it declares per CPU
kind (features injected, decided on any machine), its forward byte for byte the direct
``mla_decode_kvcache`` call over the latents it wrote, and what it refuses, with vLLM's reasons.
The backend is this CPU's with AMX taken away (``CpuMlaBackend``): vLLM runs ``CPU_MLA`` there,
so these tests run the same path on AMX CPUs too (``AMX_MLA``: ``test_cpu_amx_mla.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attnhub_cpu import CpuBackend, mla_ops, ops
from attnhub_cpu.backend import capabilities_for, mla_support
from attnhub_cpu.ops import CpuFeatures

from attnhub import reference, testing
from attnhub.errors import UnsupportedConfigurationError
from attnhub.mla import LatentKVCache, MLASpec


class CpuMlaBackend(CpuBackend):
    """This CPU's backend without AMX: where vLLM picks ``CPU_MLA``."""

    features = dataclasses.replace(ops.detect(), amx=False)
    capabilities = capabilities_for(features)


@pytest.fixture
def mla_kernel() -> None:
    why = mla_ops.unavailable_reason()
    if why is not None:
        pytest.skip(f"vLLM's CPU MLA kernel is not usable here: {why}")


def deepseek(**kw: object) -> MLASpec:
    args: dict = dict(
        num_heads=4, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128
    )
    args.update(kw)
    return MLASpec(**args)


@pytest.mark.parametrize(
    ("features", "bf16"),
    [
        (CpuFeatures("x86"), False),  # AVX2: vLLM's kernels truncate bf16
        (CpuFeatures("x86", avx512=True, avx512_bf16=True), True),
        (CpuFeatures("arm"), True),
    ],
)
def test_mla_declares_what_mla_decode_kvcache_is_compiled_for(
    features: CpuFeatures, bf16: bool
) -> None:
    mla = mla_support(features)
    assert (torch.bfloat16 in mla.dtypes) == bf16
    assert {torch.float32, torch.float16} <= mla.dtypes
    assert mla.block_sizes == {16} and mla.latent_sizes == {(512, 64)}
    assert mla.max_query_len == 1 and mla.layouts == ("joint",) and not mla.lse.dtypes


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (deepseek(block_size=32), "compiled for block 16 only"),
        (deepseek(kv_lora_rank=256), "compiled for kv_lora_rank 512 + qk_rope_head_dim 64"),
        (deepseek(kv_cache_dtype="fp8"), "'auto' only"),
        (deepseek(kv_cache_dtype="fp8_e5m2"), "supported_kv_cache_dtypes = ['auto'] in vllm/"),
    ],
)
def test_mla_beyond_the_kernel_is_refused_with_vllms_reason(spec: MLASpec, words: str) -> None:
    reasons = CpuMlaBackend.unsupported_reasons(spec)
    assert any(words in r for r in reasons), reasons


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forward_is_the_direct_kernel_call_over_what_it_wrote(
    mla_kernel: None, dtype: torch.dtype
) -> None:
    spec = deepseek(dtype=dtype)
    backend = CpuMlaBackend(spec)
    assert backend.mla_path == "CPU_MLA"
    seq_lens = [5, 37, 16, 1]
    batch, nb = testing.make_batch([1] * 4, seq_lens, 16, seed=4, num_tokens=6)
    cache = backend.allocate_kv_cache(nb + 2)
    assert isinstance(cache, LatentKVCache) and cache.layout == "joint"
    g = testing.generator(8)
    testing.fill_latent_cache_random(cache, g)
    kv_c, k_pe = testing.random_latent_kv(spec, 6, g)
    q = testing.random_mla_query(spec, 6, g)
    want_cache = cache.clone()
    reference.write_latent_kv(want_cache, kv_c, k_pe, batch.slot_mapping)

    out = backend.impl().forward(q, kv_c, k_pe, cache, backend.metadata_builder().build(batch))

    assert cache.equal(want_cache)
    direct = torch.empty(4, spec.num_heads, spec.kv_lora_rank, dtype=dtype)
    torch.ops._C.mla_decode_kvcache(
        direct, q[:4], cache.joint, spec.scale, batch.block_table.int(), batch.seq_lens.int()
    )
    assert torch.equal(out[:4], direct) and bool((out[4:] == 0).all())


def test_a_prefill_is_refused_at_build_naming_the_request(mla_kernel: None) -> None:
    backend = CpuMlaBackend(deepseek(dtype=torch.float32))
    batch, _ = testing.make_batch([1, 4], [9, 4], 16, seed=1)
    with pytest.raises(
        UnsupportedConfigurationError, match=r"request 1 .* prefill.*\(decode only\)"
    ):
        backend.metadata_builder().build(batch)


def test_attnhub_bench_compares_mla_on_the_path_vllm_picks_here(mla_kernel: None) -> None:
    """``attnhub bench``'s cpu comparisons carry MLA rows: the backend's forward against vLLM's
    calls made directly on the MLA path vLLM picks on this CPU (each row's output compared
    byte for byte inside; the ratio reported, never asserted: no timing assertions)."""
    from attnhub_cpu import bench

    if CpuBackend.availability("cpu") is not None:
        pytest.skip(f"cpu backend unavailable: {CpuBackend.availability('cpu')}")
    path = mla_ops.vllm_mla_backend(CpuBackend.features)
    rows = bench.mla_comparisons(quick=True, repeats=1)
    assert rows and {r.isa for r in rows} == {path}
    assert all(r.case.startswith("mla ") and r.speed > 0 for r in rows)
    cpu_rows = bench.direct_comparisons(quick=True, repeats=1)
    assert {(r.case, r.dtype) for r in rows} <= {(r.case, r.dtype) for r in cpu_rows}
